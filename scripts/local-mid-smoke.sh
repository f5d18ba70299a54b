#!/usr/bin/env bash
# local-mid-smoke.sh: the cluster ablation chain on one machine, with the same CLI commands.
#
#   init (or --resume DIR) -> capture -> N fresh replays per arm -> reduce -> verdict.json
#
# Every stage is `replayjob step capture|replay|reduce` on the ablation spec (default
# examples/ablation.toml): the one launch implementation the Kubernetes Jobs, the Argo workflow and
# the Slurm jobs run too (same layout, pins, partial-output policy and expected arms).  Uses the GPU when torch sees one (and says so), the CPU otherwise.  Prints where every
# artifact is and the wall time, and exits with the reducer's code: 0 pass, 1 a negative verdict,
# 2 refused, 3 error (nothing was decided; rerun).  A step that fails ends the script with that
# step's code, so 3 stays retryable and 1 and 2 stay final.  Creates .venv with scripts/setup.sh when `replayjob` is not installed.
#
# Usage: scripts/local-mid-smoke.sh [--repeats N] [--arms A,B] [--out DIR] [--claim CLAIM] [--spec FILE]
# (the seed and a resume state are spec keys: `seed`, `resume`)
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/local-mid-smoke.sh [options]

Run init -> capture -> N replays per arm -> reduce on this machine (GPU if present, else CPU).

Options:
  --repeats N    fresh replays per arm (default 3)
  --arms LIST    comma-separated arms of the spec (default: all, i.e. ckpt-off,ckpt-on)
  --out DIR      output directory (default runs/mid-smoke-YYYYmmdd-HHMMSS)
  --claim CLAIM  exact-input or bitwise (default: the spec's claim)
  --spec FILE    ablation spec (default examples/ablation.toml); its `seed` and `resume` keys
                 choose the initial adapter or another resume state (step -1)
  -h, --help     show this help

Exit code: the reducer's (0 pass, 1 negative verdict, 2 refused, 3 error: rerun).
EOF
}

cd "$(dirname "$0")/.."
repeats=3
arms=""
out=""
claim=""
spec=examples/ablation.toml
while [ $# -gt 0 ]; do
  case "$1" in
    --repeats) repeats=${2:?--repeats needs a value}; shift 2 ;;
    --arms) arms=${2:?--arms needs a value}; shift 2 ;;
    --out) out=${2:?--out needs a value}; shift 2 ;;
    --claim) claim=${2:?--claim needs a value}; shift 2 ;;
    --spec) spec=${2:?--spec needs a value}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "local-mid-smoke: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

if command -v replayjob >/dev/null 2>&1; then
  RJ=$(command -v replayjob)
  PY=$(dirname "$RJ")/python
  [ -x "$PY" ] || PY=python3
else
  [ -x .venv/bin/replayjob ] || bash scripts/setup.sh
  RJ=.venv/bin/replayjob
  PY=.venv/bin/python
fi

start=$(date +%s)
device=$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
if [ "$device" = cuda ]; then
  echo "local-mid-smoke: GPU present: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))'); running on cuda"
else
  echo "local-mid-smoke: no GPU visible to torch; running on CPU"
fi

select_args=(--repeats "$repeats" --device "$device")
[ -n "$arms" ] && select_args+=(--arms "$arms")
[ -n "$claim" ] && select_args+=(--claim "$claim")
plan=$("$RJ" step plan --spec "$spec" "${select_args[@]}")  # size=N is its first line
size=${plan%%$'\n'*}
size=${size#size=}

out=${out:-runs/mid-smoke-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
ws=$out/workspace
src=$out/source
run=(--spec "$spec" --run-dir "$out" "${select_args[@]}")

echo "== init + capture -> $src"
"$RJ" step capture "${run[@]}"
for ((i = 0; i < size; i++)); do
  echo "== replay $((i + 1))/$size"
  "$RJ" step replay "${run[@]}" --index "$i"
done

echo "== reduce -> $out/verdict.json"
code=0
"$RJ" step reduce "${run[@]}" || code=$?

echo
echo "artifacts:"
echo "  workspace (init_resume, configs)  $ws"
echo "  capture (manifest, metrics.json)  $src"
echo "  replays (replay_metrics.json)     $out/replays/ARM/REPEAT"
echo "  verdict                           $out/verdict.json"
echo "device $device; wall time $(($(date +%s) - start)) s; reducer exit code $code"
exit "$code"
