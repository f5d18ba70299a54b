#!/usr/bin/env bash
# local-mid-smoke.sh: the cluster ablation chain on one machine, with the same CLI commands.
#
#   init (or --resume DIR) -> capture -> N fresh replays per arm -> reduce -> verdict.json
#
# Arms and their overrides come from the ablation spec (default examples/ablation.toml) through
# `replayjob ablation plan|index`, the source the Kubernetes Jobs and the Argo workflow are rendered
# from.  Uses the GPU when torch sees one (and says so), the CPU otherwise.  Prints where every
# artifact is and the wall time, and exits with the reducer's code: 0 pass, 1 a negative verdict,
# 2 refused.  Creates .venv with scripts/setup.sh when `replayjob` is not installed.
#
# Usage: scripts/local-mid-smoke.sh [--repeats N] [--arms A,B] [--out DIR] [--claim CLAIM]
#                                   [--spec FILE] [--resume DIR] [--seed N]
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
  --spec FILE    ablation spec (default examples/ablation.toml)
  --resume DIR   start from this resume state (step -1) instead of the one init writes
  --seed N       seed for replayjob init (default: the spec's seed)
  -h, --help     show this help

Exit code: the reducer's (0 pass, 1 negative verdict, 2 refused).
EOF
}

cd "$(dirname "$0")/.."
repeats=3
arms=""
out=""
claim=""
spec=examples/ablation.toml
resume=""
seed=""
while [ $# -gt 0 ]; do
  case "$1" in
    --repeats) repeats=${2:?--repeats needs a value}; shift 2 ;;
    --arms) arms=${2:?--arms needs a value}; shift 2 ;;
    --out) out=${2:?--out needs a value}; shift 2 ;;
    --claim) claim=${2:?--claim needs a value}; shift 2 ;;
    --spec) spec=${2:?--spec needs a value}; shift 2 ;;
    --resume) resume=${2:?--resume needs a value}; shift 2 ;;
    --seed) seed=${2:?--seed needs a value}; shift 2 ;;
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
plan=$("$RJ" ablation plan "$spec" "${select_args[@]}")

# plan_value KEY: the first KEY=VALUE line of the plan; plan_values KEY: every one.
plan_value() { printf '%s\n' "$plan" | sed -n "s/^$1=//p" | head -n 1; }
plan_values() { printf '%s\n' "$plan" | sed -n "s/^$1=//p"; }

size=$(plan_value size)
min_repeats=$(plan_value min_repeats)
claim=${claim:-$(plan_value claim)}
seed=${seed:-$(plan_value seed)}
while IFS= read -r kv; do export "${kv?}"; done < <(plan_values env)
common=()
while IFS= read -r kv; do common+=(--set "$kv"); done < <(plan_values config)
[ -n "$resume" ] && common+=(--set "resume.from=\"$(cd "$resume" && pwd)\"")

out=${out:-runs/mid-smoke-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
ws=$out/workspace
src=$out/source

echo "== init -> $ws"
"$RJ" init "$ws" --seed "$seed"
echo "== capture -> $src"
"$RJ" capture "$ws/source.toml" --out "$src" "${common[@]}"
read -r logical manifest < <("$PY" - "$src/metrics.json" <<'PY'
import json, re, sys
m = json.load(open(sys.argv[1], encoding="utf-8"))
pins = [m.get("optimizer/logical_batch_sha256"), m.get("optimizer_batch/manifest_sha256")]
if not all(isinstance(p, str) and re.fullmatch("[0-9a-f]{64}", p) for p in pins):
    sys.exit(sys.argv[1] + ": no valid pins")
print(*pins)
PY
)

arm_list=""  # every arm of the plan: the reducer refuses if one of them left no replay
for ((i = 0; i < size; i++)); do
  task=$("$RJ" ablation index "$spec" "$i" "${select_args[@]}")
  arm=$(printf '%s\n' "$task" | sed -n 's/^arm=//p')
  case ",$arm_list," in *",$arm,"*) ;; *) arm_list=${arm_list:+$arm_list,}$arm ;; esac
  repeat=$(printf '%s\n' "$task" | sed -n 's/^repeat=//p')
  allow=$(printf '%s\n' "$task" | sed -n 's/^allow=//p')
  sets=()
  while IFS= read -r kv; do sets+=(--set "$kv"); done < <(printf '%s\n' "$task" | sed -n 's/^set=//p')
  echo "== replay $((i + 1))/$size: arm $arm repeat $repeat -> $out/replays/$arm/$repeat"
  "$RJ" replay "$ws/replay.toml" --out "$out/replays/$arm/$repeat" --repeat-index "$repeat" \
    "${common[@]}" "${sets[@]}" \
    --set "optimizer_batch.replay_path=\"$src/optimizer_batch_step_000000.manifest.json\"" \
    --set "optimizer_batch.expected_logical_sha256=\"$logical\"" \
    --set "optimizer_batch.expected_manifest_sha256=\"$manifest\"" \
    --set "optimizer_batch.arm=\"$arm\"" \
    --set "optimizer_batch.allow_config_differences=$allow"
done

echo "== reduce ($claim, at least $min_repeats repeats per arm) -> $out/verdict.json"
code=0
"$RJ" reduce "$out/replays" --claim "$claim" --source "$src" --out "$out/verdict.json" \
  --min-repeats "$min_repeats" --arms "$arm_list" --spec "$spec" || code=$?

echo
echo "artifacts:"
echo "  workspace (init_resume, configs)  $ws"
echo "  capture (manifest, metrics.json)  $src"
echo "  replays (replay_metrics.json)     $out/replays/ARM/REPEAT"
echo "  verdict                           $out/verdict.json"
echo "device $device; wall time $(($(date +%s) - start)) s; reducer exit code $code"
exit "$code"
