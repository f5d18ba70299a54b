#!/usr/bin/env bash
# Replay-harness overhead on one GPU, in one command: capture one GRPO step of a mid-size bf16 LoRA
# model built from config, replay it 5 times per arm (gradient checkpointing off / on, each replay a
# fresh process, arms alternating), reduce (exact-input gates; bitwise is recorded), then summarise:
# per-arm median update time, peak memory and spread, and the replay's update time against the raw
# forward + backward + optimizer seconds of the same step in the source trainer.  Budget: 8 minutes
# on one H200.  Writes OUT/ (artifacts, verdicts, report.md) and benchmarks/results/gpu_ablation.json.
#
# Usage: benchmarks/gpu_ablation.sh [--out DIR] [--repeats N] [--device cuda:N] [--results DIR]
#                                   [--tiny] [--dry-run]
#   --out DIR      run directory (default: a new directory under /tmp); must not exist yet
#   --repeats N    replays per arm (default 5; --tiny: 2)
#   --device D     the one GPU to use (default cuda:0)
#   --results DIR  where the benchmark JSON goes (default benchmarks/results)
#   --tiny         the same chain on CPU with the built-in tiny model (what CI runs; not a figure)
#   --dry-run      print every command of the run and exit without running anything
# Exit status: the exact-input verdict's (0 pass, 1 fail, 2 refused, 3 error: rerun); 2 for a usage or
# setup error.
#
# Model size and why: hidden 1024, MLP 4096, 20 layers, 16 heads of 64, 4 KV heads, 512 positions:
# about 0.3 B parameters (0.6 GB in bf16), LoRA r=16 on q/k/v/o.  Every replay is a fresh process
# that imports torch and transformers (~5 s), builds the base model by random initialisation on the
# CPU (fp32, ~1.2 GB for 0.3 B parameters, a few seconds on 16 cores) and moves it to the GPU;
# 12 such processes (state, capture, 10 replays) fit in about 3-4 minutes, leaving half the budget
# as margin.  A 1 B model would spend ~4x as long in CPU initialisation per process and put the
# 8-minute budget at risk without telling us more about the harness.  The step is 16 prompts x 8
# completions of up to 64 new tokens (128 rows, ~90 tokens each) in micro-batches of 32, so the
# update's activations (what checkpointing trades for recompute) show in peak memory.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=""
REPEATS=""
DEVICE="cuda:0"
RESULTS="$REPO/benchmarks/results"
TINY=0
DRY=0

usage() { sed -n '9,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    --repeats) REPEATS="${2:?--repeats needs a number}"; shift 2 ;;
    --device) DEVICE="${2:?--device needs a device}"; shift 2 ;;
    --results) RESULTS="${2:?--results needs a directory}"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_ablation.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

if [ -z "$REPEATS" ]; then
  if [ "$TINY" = 1 ]; then REPEATS=2; else REPEATS=5; fi
fi
case "$REPEATS" in ''|*[!0-9]*|0) echo "gpu_ablation.sh: --repeats must be a positive integer" >&2; exit 2 ;; esac
case "$DEVICE" in cuda|cuda:[0-9]*) ;; *) echo "gpu_ablation.sh: --device must be cuda or cuda:N" >&2; exit 2 ;; esac

# Paths given relative to the caller's directory stay so; the Python half runs from the repository.
[ -n "$OUT" ] && OUT="$(realpath -m "$OUT")"
RESULTS="$(realpath -m "$RESULTS")"
cd "$REPO"

PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"

# The same determinism environment every GPU replay in replayjob's launchers pins.
export CUBLAS_WORKSPACE_CONFIG=":4096:8" NVIDIA_TF32_OVERRIDE=0 PYTHONHASHSEED=0 REPLAYJOB_MATH_MODE=pedantic

if [ "$TINY" = 1 ]; then
  MODEL_SETS=(backend.devices='"cpu"')
else
  MODEL_SETS=(
    model.hidden_size=1024 model.intermediate_size=4096 model.num_layers=20 model.num_heads=16
    model.num_kv_heads=4 model.max_position_embeddings=512 model.dtype='"bfloat16"' lora.r=16 lora.alpha=32
    algorithm.prompts_per_step=16 algorithm.group_size=8 inference.max_new_tokens=64
    training.micro_batch_size=32 backend.devices="\"$DEVICE\""
  )
fi
ARMS=(ckpt-off ckpt-on)
arm_sets() {
  case "$1" in
    ckpt-off) printf '%s\n' 'optimizer_batch.arm="ckpt-off"' ;;
    ckpt-on) printf '%s\n' 'backend.options.gradient_checkpointing=true' \
      'optimizer_batch.allow_config_differences=["backend.options.gradient_checkpointing"]' \
      'optimizer_batch.arm="ckpt-on"' ;;
  esac
}

if [ -z "$OUT" ]; then
  if [ "$DRY" = 1 ]; then OUT="/tmp/replayjob-gpu-ablation.XXXXXX"; else OUT="$(mktemp -d /tmp/replayjob-gpu-ablation.XXXXXX)"; rmdir "$OUT"; fi
fi
if [ "$DRY" = 0 ] && [ -e "$OUT" ]; then
  echo "gpu_ablation.sh: $OUT already exists; choose a new --out" >&2; exit 2
fi
WS="$OUT/workspace"
STATE="$OUT/init_state"

sets_args() { local s; for s in "$@"; do printf '%s\0%s\0' --set "$s"; done; }
show() { printf '%q ' "$@"; printf '\n'; }
now() { printf '%s' "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }

# run PHASE CMD...: print the command, run it (unless --dry-run) and record its wall seconds.
run() {
  local phase="$1"; shift
  show "$@"
  [ "$DRY" = 1 ] && return 0
  local t0 t1 rc=0
  t0="$(now)"
  "$@" || rc=$?
  t1="$(now)"
  printf '%s\t%s\n' "$phase" "$(elapsed "$t0" "$t1")" >> "$OUT/process_wall.tsv"
  return "$rc"
}

START="$(now)"
if [ "$DRY" = 0 ]; then
  mkdir -p "$OUT"
  if [ "$TINY" = 0 ]; then
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || {
      echo "gpu_ablation.sh: no CUDA device is visible; use --tiny for the CPU chain or --dry-run" >&2; exit 2; }
  fi
fi
echo "# gpu_ablation: out $OUT, repeats $REPEATS per arm, $([ "$TINY" = 1 ] && echo "tiny CPU chain" || echo "device $DEVICE")"

mapfile -d '' MODEL_ARGS < <(sets_args "${MODEL_SETS[@]}")
run init "$PY" -m replayjob init "$WS" --seed 123
run init-state "$PY" -m benchmarks.gpu_ablation init-state "$STATE" "$WS/source.toml" "${MODEL_ARGS[@]}"
STATE_ARGS=(--set "resume.from=\"$STATE\"")
run capture "$PY" -m replayjob capture "$WS/source.toml" --out "$OUT/source" "${MODEL_ARGS[@]}" "${STATE_ARGS[@]}"

if [ "$DRY" = 1 ]; then
  PIN_ARGS=(--set 'optimizer_batch.expected_logical_sha256="<from OUT/source/metrics.json>"'
            --set 'optimizer_batch.expected_manifest_sha256="<from OUT/source/metrics.json>"')
else
  mapfile -t PINS < <("$PY" -c 'import sys
from replayjob.artifacts.metrics import read_pins
print(*read_pins(sys.argv[1])[:2], sep="\n")' "$OUT/source")
  PIN_ARGS=(--set "optimizer_batch.expected_logical_sha256=\"${PINS[0]}\""
            --set "optimizer_batch.expected_manifest_sha256=\"${PINS[1]}\"")
fi
REPLAY_PATH=(--set "optimizer_batch.replay_path=\"$OUT/source/optimizer_batch_step_000000.manifest.json\"")

for ((i = 0; i < REPEATS; i++)); do
  for arm in "${ARMS[@]}"; do
    mapfile -t ASETS < <(arm_sets "$arm")
    mapfile -d '' ARM_ARGS < <(sets_args "${ASETS[@]}")
    run "replay $arm" "$PY" -m replayjob replay "$WS/replay.toml" --out "$OUT/replays/$arm/repeat-$(printf '%03d' "$i")" \
      --repeat-index "$i" "${MODEL_ARGS[@]}" "${STATE_ARGS[@]}" "${REPLAY_PATH[@]}" "${PIN_ARGS[@]}" "${ARM_ARGS[@]}"
  done
done

declare -A CODE
for claim in exact-input bitwise; do
  rc=0
  run "reduce $claim" "$PY" -m replayjob reduce "$OUT/replays" --claim "$claim" --source "$OUT/source" \
    --min-repeats "$REPEATS" --baseline ckpt-off --out "$OUT/verdict-$claim.json" --report "$OUT/report-$claim.md" || rc=$?
  CODE[$claim]=$rc
done

if [ "$DRY" = 1 ]; then
  show "$PY" -m benchmarks.gpu_ablation summarize "$OUT" --total-s "<seconds>" --results "$RESULTS"
  exit 0
fi
TOTAL="$(elapsed "$START" "$(now)")"
SMOKE=()
[ "$TINY" = 1 ] && SMOKE=(--smoke)
"$PY" -m benchmarks.gpu_ablation summarize "$OUT" --total-s "$TOTAL" --results "$RESULTS" "${SMOKE[@]}" \
  --verdict "exact-input=${CODE[exact-input]}" --verdict "bitwise=${CODE[bitwise]}"
echo "# artifacts in $OUT (verdict-exact-input.json, verdict-bitwise.json, report-*.md); ${TOTAL} s"
exit "${CODE[exact-input]}"
