#!/usr/bin/env bash
# Download the wheels of bench/device/wheels.txt for the device machine (CPython 3.12, x86_64 manylinux)
# into .whl/. Run from the repository root; then name `.whl` in the device call's `carry` and start the
# command with `source bench/device/setup.sh`. (.whl/ is in .gitignore.)
# `download_wheels.sh nvdec`: NVIDIA's PyNvVideoCodec (27 MB) into .whl-nvdec/ instead, for the NVDEC probe
# (bench/device/nvdec_probe.sh). It does not fit the carry limit beside .whl/, so that call runs on a warm
# machine right after one that installed .whl/ (PyAV among it) into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = nvdec ]; then
  dest=.whl-nvdec
  reqs="pynvvideocodec==2.2.4"
else
  dest=.whl
  reqs=$(grep -v '^\s*#' bench/device/wheels.txt | grep -v '^\s*$')
fi
mkdir -p "$dest"
echo "$reqs" | while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    -d "$dest" "$req"
done
du -sh "$dest"
