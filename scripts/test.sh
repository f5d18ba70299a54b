#!/usr/bin/env bash
# The test command: set up, lint (ruff), type-check (mypy), then pytest.
#   bash scripts/test.sh            everything (what CI runs)
#   bash scripts/test.sh --quick    lint, types and the tests not marked slow (the edit loop)
#   bash scripts/test.sh [--quick] -- ARGS...   extra pytest arguments (e.g. -k NAME, -x)
set -euo pipefail
cd "$(dirname "$0")/.."
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) pytest_args+=(-m "not slow"); shift ;;
    --) shift; pytest_args+=("$@"); break ;;
    *) echo "usage: bash scripts/test.sh [--quick] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
  esac
done
EXTRAS=test,plot,trl bash scripts/setup.sh  # plot: the reducer report test draws its PNG; trl: tests/test_trl.py
.venv/bin/ruff check replayjob tests benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest "${pytest_args[@]}"
