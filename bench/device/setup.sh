# Source at the start of a device command: installs the carried wheels (.whl/, or .whl-gpu/ when that smaller
# set is what was carried) into /tmp/site without touching the image's torch, and puts g4serve's sources on
# the path. SETUP=0 (a CPU smoke test of the
# device scripts, in an environment that already has the dependencies) skips the wheels.
if [ "${SETUP:-1}" = 1 ]; then
  WHEELS=${WHEELS:-$([ -d .whl ] && echo .whl || echo .whl-gpu)}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
