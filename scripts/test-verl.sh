#!/usr/bin/env bash
# Create .venv-verl (replayjob with its test and verl extras, Python 3.11) and run the verl integration's tests.
#
# verl 0.9.1 pins transformers>=5.5.3,<5.11 and tensordict<=0.10.0, and its FSDP engine imports a TRL class that
# TRL 1.16 (the trl extra) no longer has, so verl gets an environment of its own, without trl.  It is built by
# scripts/setup.sh (VENV=.venv-verl EXTRAS=test,verl): the same torch rules (a base interpreter's torch is kept,
# else `pip install torch==2.13.0`, or REPLAYJOB_TORCH_SPEC), and pip runs again only when pyproject.toml or
# setup.sh change.  Arguments are passed to pytest (e.g. -k bitwise).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3.11}
export VENV=${VERL_VENV:-.venv-verl}
EXTRAS=test,verl bash scripts/setup.sh
if "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("trl") is None)'; then
  echo "test-verl: $VENV has trl installed; verl 0.9.1's FSDP engine cannot be built beside it (docs/verl.md)" >&2
  echo "test-verl: remove it with: $VENV/bin/pip uninstall -y trl" >&2
  exit 2
fi
exec "$VENV/bin/python" -m pytest -q -W ignore::UserWarning tests/test_verl*.py "$@"
