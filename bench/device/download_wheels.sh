#!/usr/bin/env bash
# Download the wheels of bench/device/wheels.txt for the device machine (CPython 3.12, x86_64 manylinux)
# into .whl/. Run from the repository root; then name `.whl` in the device call's `carry` and start the
# command with `source bench/device/setup.sh`. (.whl/ is in .gitignore.)
# `download_wheels.sh nvdec`: .whl-nvdec/ instead, for --video-decoder nvdec on the device
# (bench/device/nvdec_probe.sh, tests/gpu/test_nvdec_gpu.py): NVIDIA's PyNvVideoCodec beside the wheels above
# but the OpenAI client's and the assistant's (it carries alone, under the limit). PyNvVideoCodec's wheel
# (27 MB) is slimmed to 9 MB: no samples, FFmpeg source tarball or CUDA 12 module (the driver is CUDA 13).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = nvdec ]; then
  dest=.whl-nvdec
  reqs=$(grep -v '^\s*#' bench/device/wheels.txt | grep -v '^\s*$' |
    grep -v -i -E '^(openai|httpx2|httpcore2|truststore|jiter|text2num|rapidfuzz|jellyfish)=='
    echo "pynvvideocodec==2.2.4")
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
if [ "$dest" = .whl-nvdec ]; then
  python3 - "$dest"/pynvvideocodec-*.whl <<'PY'
import os, sys, zipfile
path = sys.argv[1]
drop = ("samples/", "benchmarks/", "pynvvideocodec-2.2.4.data/data/external/")
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".slim", "w", zipfile.ZIP_DEFLATED) as out:
    for info in src.infolist():
        if not info.filename.startswith(drop) and "_121.cpython" not in info.filename:
            out.writestr(info, src.read(info.filename))
os.replace(path + ".slim", path)
PY
fi
du -sh "$dest"
