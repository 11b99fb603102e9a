# Sourced by the device scripts (tests/gpu_*.sh), with $out set: installs the carried wheels
# (pycuda and its pure-Python dependencies, shared/device/README.md) and the project, or stops
# the calling script with the install log.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/*.whl \
  && export PYTHONPATH=/tmp/site \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
  || { echo "install failed"; cat "$out/install.log"; exit 1; }
