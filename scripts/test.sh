#!/usr/bin/env bash
# The test command: set up, lint (ruff), type-check (mypy), then pytest in two phases: every test not
# marked `alone` in parallel (pytest-xdist, one worker per core, at most 4; a test file stays on one
# worker, so its module fixtures are built once), then the `alone` tests one at a time: they assert on
# wall-time evidence that the contention guard admits only on a quiet host, or their processes
# rendezvous (torchrun, srun, gloo).
#   bash scripts/test.sh            everything (what CI runs)
#   bash scripts/test.sh --quick    lint, types and the tests not marked slow (the edit loop)
#   bash scripts/test.sh [--quick] -- ARGS...   extra pytest arguments for both phases (e.g. -k NAME, -x); verl's
#                                                 tests (their own environment, scripts/test-verl.sh) run only without
set -euo pipefail
cd "$(dirname "$0")/.."
marks="not alone"
alone="alone"
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) marks="not slow and not alone"; alone="alone and not slow"; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: bash scripts/test.sh [--quick] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
  esac
done
EXTRAS=test,plot,trl bash scripts/setup.sh  # plot: the reducer report test draws its PNG; trl: tests/test_trl.py
.venv/bin/ruff check replayjob tests benchmarks
.venv/bin/mypy
# pytest exits 5 when a phase selects no test (-k naming tests of one phase only): that phase is skipped,
# but a selection with no test in either phase fails
ran=0
for phase in parallel alone; do
  status=0
  if [ "$phase" = parallel ]; then
    .venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile -m "$marks" "${extra[@]}" || status=$?
  else
    .venv/bin/python -m pytest -m "$alone" "${extra[@]}" || status=$?
  fi
  if [ "$status" -eq 0 ]; then ran=1; elif [ "$status" -ne 5 ]; then exit "$status"; fi
done
if [ "$ran" -eq 0 ]; then echo "test.sh: no test selected" >&2; exit 5; fi
# verl's pins cannot share the main environment (docs/verl.md): its tests run in .venv-verl, built from the same
# files (scripts/test-verl.sh); a run narrowed by extra pytest arguments leaves them out
if [ "${#extra[@]}" -eq 0 ]; then bash scripts/test-verl.sh; fi
