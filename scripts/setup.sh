#!/usr/bin/env bash
# Create .venv and install replayjob with its test extra.
#
# torch: an existing torch in the base interpreter (for example a CUDA build) is kept by
# creating the venv with --system-site-packages.  Otherwise `pip install torch==2.13.0` runs first,
# and pip picks the build: from the default index on Linux x86_64 that is the CUDA build (several
# GB, with the nvidia libraries; it runs on a CPU too).  For the CPU build, point pip at the CPU index
# through REPLAYJOB_TORCH_SPEC, whose words are pip install's arguments:
#   REPLAYJOB_TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'
# (or PIP_FIND_LINKS / PIP_INDEX_URL naming a local wheel source).
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
# the venv is current when it was set up from these very requirements (pyproject.toml, this script, the
# extras): the editable install follows code changes by itself, so pip runs again only when they change
stamp="$VENV/.replayjob-setup"
want="$(cat pyproject.toml "$0" | "$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())') $EXTRAS"
found='import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("replayjob")))'
# the package's bytecode, as pip writes it for a regular install (an editable one leaves it to the first
# import, which an environment with PYTHONDONTWRITEBYTECODE never writes: every process would compile
# every module again); compileall rewrites only what changed
compile_package() { "$VENV/bin/python" -m compileall -q replayjob >/dev/null; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "$found" >/dev/null 2>&1; then
  compile_package
  echo "setup: $VENV is current (requirements unchanged)"
  exit 0
fi
rm -f "$stamp"
if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  read -r -a torch_spec <<<"${REPLAYJOB_TORCH_SPEC:-torch==2.13.0}"
  echo "setup: pip install ${torch_spec[*]}"
  "$VENV/bin/pip" install -q "${torch_spec[@]}"
fi
"$VENV/bin/pip" install -q -e ".[${EXTRAS}]"
compile_package
echo "setup: $("$VENV/bin/replayjob" --version) in $VENV, torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
echo "$want" > "$stamp"
