#!/usr/bin/env bash
# Workstation reproducibility self-test: run the source trainer twice with the same seed, each in
# a fresh process, and diff their diag.jsonl leaf by leaf (wall-clock and memory leaves ignored).
#
#   scripts/determinism-check.sh                      # tiny default model, 2 steps, temp workspace
#   scripts/determinism-check.sh --quick [CONFIG ...] # 1 step per run
#   scripts/determinism-check.sh CONFIG [OPTIONS...]  # any `replayjob determinism-check` options
#   scripts/determinism-check.sh --command 'my_train --log-dir {out}' [OPTIONS...]   # any trainer
#
# Exit 0 deterministic, 1 drift (report printed), 2 a run failed or the input was refused, 3 an
# error decided nothing (a run crashed or was killed; rerun).
# REPLAYJOB_MATH_MODE (prod | pedantic | default) is passed through to every run.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -x "$repo/.venv/bin/python" ]]; then
  replayjob=("$repo/.venv/bin/python" -m replayjob)
else
  replayjob=(python3 -m replayjob)
fi

quick=0
if [[ "${1:-}" == "--quick" ]]; then
  quick=1
  shift
fi

own_command=0
for arg in "$@"; do
  if [[ "$arg" == --command || "$arg" == --command=* ]]; then
    own_command=1
  fi
done

if [[ $own_command -eq 0 && ( $# -eq 0 || "$1" == -* ) ]]; then
  workspace="$(mktemp -d "${TMPDIR:-/tmp}/replayjob-determinism-ws.XXXXXX")"
  echo "initialising a tiny workspace in $workspace" >&2
  "${replayjob[@]}" init "$workspace" >/dev/null
  set -- "$workspace/train.toml" --steps "$((quick ? 1 : 2))" "$@"
elif [[ $quick -eq 1 && $own_command -eq 0 ]]; then
  set -- "$@" --steps 1
fi

exec "${replayjob[@]}" determinism-check "$@"
