#!/usr/bin/env bash
# local-mid-smoke.sh: the workstation funnel, a thin wrapper over `replayjob funnel` (docs/funnel.md).
#
#   (1) a short source run twice with the same seed, diffed  ->  (2) its behavioural signals
#   ->  (3) capture -> interleaved replays of the ablation spec's arms -> reduce, report and PNG
#
# Creates .venv with scripts/setup.sh (with the plot extra, for the report's PNG) when `replayjob`
# is not installed, runs from the repository root, passes every option through, and exits with the
# funnel's code: the first non-passing stage's (0 pass, 1 negative, 2 refused or inconclusive, 3 error).
#
# Usage: scripts/local-mid-smoke.sh [replayjob funnel options]   (see `replayjob --help`)
#   e.g. --repeats 5 --arms ckpt-off,ckpt-on --out DIR --budgets FILE --only-ablation --plant-kill
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
if command -v replayjob >/dev/null 2>&1; then
  RJ=$(command -v replayjob)
else
  [ -x .venv/bin/replayjob ] || EXTRAS=${EXTRAS:-test,plot} bash scripts/setup.sh
  RJ=.venv/bin/replayjob
fi
exec "$RJ" funnel "$@"
