#!/usr/bin/env bash
# Set up unbroken in a virtual environment: .venv here, or the one already active.
#   bash setup.sh          # the package, for `unbroken demo` / `unbroken train`
#   bash setup.sh --test   # plus the test tools
# torch: an existing install is kept; with none, torch==2.13.0 is installed first, because an open
# range would make pip fetch the newest CUDA build (gigabytes) instead of the CPU wheel on disk.
set -euo pipefail
cd "$(dirname "$0")"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY=.venv/bin/python
else
  PY="$VIRTUAL_ENV/bin/python"
fi
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
echo "setup: installing unbroken${extra}"
"$PY" -m pip install -q -e ".${extra}"
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
