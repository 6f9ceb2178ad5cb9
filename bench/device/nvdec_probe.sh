#!/usr/bin/env bash
# Is NVDEC there for container videos (issue 23)? One short device call, before anything of it is built:
# bench/nvdec_probe.py with PyNvVideoCodec installed from .whl-nvdec/ (fetched by
# `bash bench/device/download_wheels.sh nvdec`, 27 MB). PyAV comes from .whl/, which does not fit beside it
# in one call's carry: run this on a warm machine right after a call that sourced setup.sh with .whl/
# (the installs in /tmp/site stay while the machine does).
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/nvdec_probe.sh", carry=[".whl-nvdec"])
# Prints where the driver's libnvcuvid is, then the probe's report; its JSON lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
WHEELS=.whl-nvdec source bench/device/setup.sh
python3 -c "import av" 2> /dev/null || { echo "PyAV is missing: run a call that installs .whl/ first"; exit 1; }
ldconfig -p 2> /dev/null | grep -i nvcuvid || echo "libnvcuvid: not in the loader's cache"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -k 5 300 python3 bench/nvdec_probe.py --out "$OUT" "$@"
