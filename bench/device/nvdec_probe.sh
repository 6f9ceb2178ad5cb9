#!/usr/bin/env bash
# NVDEC for container videos (issue 23): bench/nvdec_probe.py with PyNvVideoCodec installed from .whl-nvdec/
# (`bash bench/device/download_wheels.sh nvdec`, 9 MB once slimmed) beside .whl/ (PyAV among it):
#   run(command="G4SERVE_GIT_COMMIT=<sha> bash bench/device/nvdec_probe.sh", carry=[".whl", ".whl-nvdec"])
# Prints where the driver's libnvcuvid is, then the probe's report; its JSON lands in $OUT. Arguments go to
# the probe (e.g. --size 1920x1080).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device/setup.sh
[ "${SETUP:-1}" = 1 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl-nvdec/*.whl
python3 -c "import av" 2> /dev/null || { echo "PyAV is missing: carry .whl too"; exit 1; }
ldconfig -p 2> /dev/null | grep -i nvcuvid || echo "libnvcuvid: not in the loader's cache"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -k 5 300 python3 bench/nvdec_probe.py --out "$OUT" "$@"
