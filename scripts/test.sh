#!/usr/bin/env bash
# The test command: set up, lint (ruff), type-check (mypy), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test,plot,trl bash scripts/setup.sh  # plot: the reducer report test draws its PNG; trl: tests/test_trl.py
.venv/bin/ruff check replayjob tests benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
