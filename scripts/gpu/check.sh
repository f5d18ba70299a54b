#!/usr/bin/env bash
# GPU readiness check in one command, made for an offline machine that already has Python, torch,
# transformers and peft.  Parts, in order, each under its own time limit inside one whole-run budget
# (a hang costs its part's limit, never the machine's time):
#   install     the carried wheels (scripts/gpu/fetch-wheels.sh) of exactly the packages this
#               interpreter lacks, then replayjob itself, all with pip --no-index --no-deps --target
#               into a work folder put on PYTHONPATH: the machine's packages are never modified
#   env         the interpreter, torch, CUDA, the GPU (nvidia-smi) and where each package came from
#   pytest-gpu  python -m pytest -m gpu tests/test_gpu.py (JUnit XML kept)
#   ablation    benchmarks/gpu_ablation.sh (capture, replays per arm, reduce, summary)
# then writes ONE results file, $OUT/gpu-check.json (every figure printed, each part's exit code,
# time and output, the ablation's benchmark JSON and verdicts, or its partial replays when it was
# cut short), and the whole output to $OUT/check.log.  Nothing else is written under $OUT.
#
# Usage: scripts/gpu/check.sh [--cpu] [--dry-run] [--wheels DIR] [--budget S] [--repeats N]
#   --cpu          the same parts on CPU with tiny sizes (CUDA hidden, the tiny model, one replay per
#                  arm); the CUDA tests then skip, which counts as passing only here.
#                  REPLAYJOB_GPU_CHECK_CPU=1 does the same
#   --dry-run      print each part's command and time limit, run nothing, write nothing
#   --wheels DIR   the carried wheels (default scripts/gpu/wheels)
#   --budget S     whole-run budget in seconds (default 450; --cpu: 300)
#   --repeats N    replays per arm in the ablation (default 5; --cpu: 1)
# Environment: OUT (results folder; default benchmarks/results/gpu-check), PYTHON (the interpreter;
#   default .venv/bin/python when present, else python3), REPLAYJOB_GPU_CHECK_WORK (work folder, kept;
#   default a new folder under /tmp, removed at the end), REPLAYJOB_GPU_CHECK_REINSTALL (carried
#   distributions to install even when present, comma-separated).
# Exit status: 0 every part passed; 1 something failed (the results file says what); 2 usage.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SELF="$REPO/scripts/gpu/check.sh"
cd "$REPO"

usage() { sed -n '15,27p' "$SELF" | sed 's/^# \{0,1\}//'; }
show() { printf '%q ' "$@"; printf '\n'; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }

pip_cmd() {  # the interpreter's pip, reading no configuration or index settings of this machine
  env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_REQUIRE_VIRTUALENV \
    -u PIP_USER -u PIP_TARGET -u PIP_PREFIX PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore "$PY" -m pip "$@"
}

# The install part (run by the script itself, under its time limit, with WORK, WHEELS and PY exported).
install_part() {
  local site="$WORK/site" force=() need=() reinstall=() f
  mkdir -p "$site"
  : > "$WORK/installed.txt"
  IFS=', ' read -r -a reinstall <<< "${REPLAYJOB_GPU_CHECK_REINSTALL:-}"
  for f in "${reinstall[@]}"; do force+=(--force "$f"); done
  mapfile -t need < <("$PY" -m benchmarks.gpu_check missing "${force[@]}" | grep -v '^$' || true)
  printf '%s\n' "${need[@]}" > "$WORK/missing.txt"
  echo "install: missing here: ${need[*]:-none}"
  if ! pip_cmd --version > /dev/null 2>&1; then
    echo "no pip: wheels extracted; replayjob runs from the source tree" > "$WORK/install-how.txt"
    if [ "${#need[@]}" -gt 0 ]; then
      "$PY" -m benchmarks.gpu_check unpack --find-links "$WHEELS" --target "$site" "${need[@]}"
      printf '%s\n' "${need[@]}" >> "$WORK/installed.txt"
    fi
    return 0
  fi
  if [ "${#need[@]}" -gt 0 ]; then
    [ -d "$WHEELS" ] || { echo "install: no wheel folder $WHEELS (scripts/gpu/fetch-wheels.sh makes it)" >&2; return 1; }
    pip_cmd install --no-index --find-links "$WHEELS" --no-deps --no-cache-dir --target "$site" "${need[@]}"
    printf '%s\n' "${need[@]}" >> "$WORK/installed.txt"
  fi
  # replayjob from a copy of its sources (a build in the checkout would write build/ and *.egg-info there)
  rm -rf "$WORK/src"
  mkdir -p "$WORK/src"
  cp -R pyproject.toml README.md replayjob "$WORK/src/"
  find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
  local iso=(--no-build-isolation) how="pip --target, build backend: the machine's setuptools"
  if "$PY" -m benchmarks.gpu_check missing --build | grep -q .; then
    iso=()
    how="pip --target, build backend: the carried setuptools"
  fi
  echo "$how" > "$WORK/install-how.txt"
  pip_cmd install --no-index --find-links "$WHEELS" --no-deps --no-cache-dir --target "$site" "${iso[@]}" "$WORK/src"
  echo "replayjob" >> "$WORK/installed.txt"
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import docopt, msgspec, replayjob, safetensors, yaml
print("install: replayjob", replayjob.__file__)'
}

if [ "${1:-}" = "--install-part" ]; then install_part; exit; fi

CPU="${REPLAYJOB_GPU_CHECK_CPU:-0}"
DRY=0
WHEELS="$REPO/scripts/gpu/wheels"
BUDGET=""
REPEATS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --wheels) WHEELS="$(realpath -m "${2:?--wheels needs a directory}")"; shift 2 ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
    --repeats) REPEATS="${2:?--repeats needs a number}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
[ "$CPU" = 1 ] || CPU=0
if [ "$CPU" = 1 ]; then MODE=cpu; else MODE=gpu; fi
: "${BUDGET:=$([ "$CPU" = 1 ] && echo 300 || echo 450)}"
: "${REPEATS:=$([ "$CPU" = 1 ] && echo 1 || echo 5)}"
for n in "$BUDGET" "$REPEATS"; do
  case "$n" in ''|*[!0-9]*|0) echo "check.sh: --budget and --repeats take positive integers" >&2; exit 2 ;; esac
done

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY="$(command -v python3 || command -v python)"; fi
fi
OUT="$(realpath -m "${OUT:-$REPO/benchmarks/results/gpu-check}")"
RESULTS="$OUT/gpu-check.json"
RESERVE=30  # seconds kept for writing the results

# Per-part time limits (seconds), each cut to what is left of the budget.
declare -A LIMIT=([install]=120 [env]=60 [pytest-gpu]=150 [ablation]=420)
ABLATION=(bash benchmarks/gpu_ablation.sh --repeats "$REPEATS")
if [ "$CPU" = 1 ]; then
  LIMIT[pytest-gpu]=120
  LIMIT[ablation]=180
  ABLATION+=(--tiny)
fi

if [ "$DRY" = 1 ]; then
  WORK="${REPLAYJOB_GPU_CHECK_WORK:-/tmp/replayjob-gpu-check.XXXXXX}"
  echo "# gpu check ($MODE): budget $BUDGET s; python $PY; wheels $WHEELS; results $RESULTS"
  echo "## install (limit ${LIMIT[install]} s): the missing ones of: $("$PY" -m benchmarks.gpu_check wheels | tr '\n' ' ')"
  echo "##   pip install --no-index --find-links $WHEELS --no-deps --target $WORK/site <missing> <replayjob>"
  echo "## env (limit ${LIMIT[env]} s): $(show "$PY" -m benchmarks.gpu_check env "$WORK/env.json" --site "$WORK/site")"
  echo "## pytest-gpu (limit ${LIMIT[pytest-gpu]} s): $(show "$PY" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider --junitxml="$WORK/pytest-gpu.xml")"
  echo "## ablation (limit ${LIMIT[ablation]} s): $(show "${ABLATION[@]}" --out "$WORK/ablation" --results "$WORK/bench")"
  echo "## collect: $(show "$PY" -m benchmarks.gpu_check collect --work "$WORK" --results "$RESULTS" --mode "$MODE")"
  exit 0
fi

if [ -n "${REPLAYJOB_GPU_CHECK_WORK:-}" ]; then
  WORK="$(realpath -m "$REPLAYJOB_GPU_CHECK_WORK")"
  KEEP=1
  if [ -e "$WORK" ] && [ -n "$(ls -A "$WORK")" ]; then echo "check.sh: work folder $WORK is not empty" >&2; exit 2; fi
  mkdir -p "$WORK"
else
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/replayjob-gpu-check.XXXXXX")"
  KEEP=0
fi
mkdir -p "$OUT" "$WORK/logs"
rm -f "$RESULTS" "$OUT/check.log"
exec > >(tee -a "$OUT/check.log") 2>&1
TEE_PID=$!

export WORK WHEELS PY PYTHON="$PY" PYTHONHASHSEED=0
if [ "$CPU" = 1 ]; then export CUDA_VISIBLE_DEVICES=""; fi
echo "# gpu check ($MODE): budget $BUDGET s; python $PY; wheels $WHEELS; work $WORK; results $RESULTS"

# part NAME CMD...: run CMD under min(LIMIT[NAME], what the budget leaves), its output to the log and to
# logs/NAME.log; record NAME, exit code, seconds, limit in parts.tsv.  A failing part does not stop the run.
part() {
  local name="$1" limit="${LIMIT[$1]}" left rc t0 note=""
  shift
  left=$((BUDGET - SECONDS - RESERVE))
  if [ "$left" -lt "$limit" ]; then limit="$left"; note="limit cut to what the budget left"; fi
  echo "## $name (limit $limit s): $(show "$@")"
  if [ "$limit" -lt 5 ]; then
    printf '%s\t124\t0\t%s\t%s\n' "$name" "$limit" "not started: the budget ran out" >> "$WORK/parts.tsv"
    return 0
  fi
  t0="$EPOCHREALTIME"
  set +e
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/logs/$name.log"
  rc="${PIPESTATUS[0]}"
  set -e
  case "$rc" in 124|137) note="stopped at its time limit" ;; esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(elapsed "$t0" "$EPOCHREALTIME")" "$limit" "$note" >> "$WORK/parts.tsv"
  echo "## $name: exit $rc"
}

part install bash "$SELF" --install-part
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
part env "$PY" -m benchmarks.gpu_check env "$WORK/env.json" --site "$WORK/site"
part pytest-gpu "$PY" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider --junitxml="$WORK/pytest-gpu.xml"
part ablation "${ABLATION[@]}" --out "$WORK/ablation" --results "$WORK/bench"

rc=0
timeout --kill-after=5 "$RESERVE" "$PY" -m benchmarks.gpu_check collect --work "$WORK" --results "$RESULTS" \
  --mode "$MODE" --budget-s "$BUDGET" --total-s "$SECONDS" || rc=$?
if [ "$rc" -gt 1 ] || [ ! -s "$RESULTS" ]; then
  echo "check.sh: writing the results failed (exit $rc); the parts' exit codes follow" >&2
  cat "$WORK/parts.tsv" >&2 || true
  rc=1
fi
if [ "$KEEP" = 0 ]; then rm -rf "$WORK"; else echo "# work folder kept: $WORK"; fi
exec >&- 2>&-
wait "$TEE_PID" || true
exit "$rc"
