#!/usr/bin/env bash
# NVDEC for container videos (issue 23): bench/nvdec_probe.py with the wheels of .whl-nvdec/
# (`bash bench/device/download_wheels.sh nvdec`: PyNvVideoCodec, PyAV and the engine's; alone in the carry):
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/nvdec_probe.sh", carry=[".whl-nvdec"])
# Prints where the driver's libnvcuvid is, then the probe's report; its JSON lands in $OUT. Arguments go to
# the probe (e.g. --size 1920x1080).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
WHEELS=.whl-nvdec source bench/device/setup.sh
ldconfig -p 2> /dev/null | grep -i nvcuvid || echo "libnvcuvid: not in the loader's cache"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -k 5 300 python3 bench/nvdec_probe.py --out "$OUT" "$@"
