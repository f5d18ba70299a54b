#!/usr/bin/env bash
# Create .venv and install replayjob with its test extra.
#
# torch: an existing torch in the base interpreter (for example a CUDA build) is kept by
# creating the venv with --system-site-packages; otherwise the CPU wheel torch==2.13.0 is
# installed first, so no multi-GB CUDA build is downloaded.  Override with REPLAYJOB_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test}
if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
    echo "setup: keeping the base interpreter's torch ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q "${REPLAYJOB_TORCH_SPEC:-torch==2.13.0}"
fi
"$VENV/bin/pip" install -q -e ".[${EXTRAS}]"
echo "setup: $("$VENV/bin/replayjob" --version) in $VENV"
