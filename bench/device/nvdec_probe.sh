#!/usr/bin/env bash
# Is NVDEC there for container videos (issue 23)? One short device call, before anything of it is built:
# bench/nvdec_probe.py with PyNvVideoCodec installed from .whl-nvdec/ (fetched by
# `bash bench/device/download_wheels.sh nvdec`: PyNvVideoCodec and PyAV, 63 MB, under the carry limit
# alone; the rest of .whl/ is not needed: the probe imports g4serve's video module only).
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/nvdec_probe.sh", carry=[".whl-nvdec"])
# Prints where the driver's libnvcuvid is, then the probe's report; its JSON lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
WHEELS=.whl-nvdec source bench/device/setup.sh
ldconfig -p 2> /dev/null | grep -i nvcuvid || echo "libnvcuvid: not in the loader's cache"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -k 5 300 python3 bench/nvdec_probe.py --out "$OUT" "$@"
