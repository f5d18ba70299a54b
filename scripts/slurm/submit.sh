#!/usr/bin/env bash
# Submit an ablation to Slurm: capture -> a job array of replays (arms x repeats) -> reduce.
#
#   scripts/slurm/submit.sh --out /shared/runs/ab1 --wait && next-step
#   scripts/slurm/submit.sh --spec ablation.toml --arms ckpt-off,ckpt-on --repeats 5 \
#       --out /shared/runs/ab2 --partition gpu --image /shared/images/replayjob.sif --wait
#
# Three jobs, chained by Slurm dependencies, each running one `replayjob step` command (the one
# launch implementation the Kubernetes Jobs and the Argo workflow run too):
#   capture  step capture: init (unless --workspace) + capture       -> <out>/source
#   replay   --array=0..arms*repeats-1%parallelism, --dependency=afterok:<capture>, --exclusive,
#            --gres=gpu:N; step replay --index i (arm, repeat)       -> <out>/replays/<arm>/<repeat>
#            (one array per rank count, each after the one before: parallelism bounds them all)
# Every capture and replay task asks for the spec's resources (step plan: --cpus-per-task and --mem
# per rank, 1 CPU and 4 GiB without GPUs, --time from deadline_s, every GPU of the node with
# node_gpus); reduce for 1 CPU, 4 GiB and the same --time.
#   reduce   --dependency=afterany:<array> (a failed replay is missing evidence, never dropped)
#            step reduce -> <out>/verdict.json; its exit code is the verdict's
# A capture or replay of R ranks (the spec's `ranks`, an arm's "distributed.world_size") is one job of
# --ntasks=R on one node (--nodes=1, R times the GPUs per task): the step runs once in the batch
# script and starts the ranks with `srun --ntasks R` in the allocation (replayjob.runtime.slurm_ranks maps
# each task to torch.distributed's environment); with --image, torchrun inside the container starts
# them.  Arms of different rank counts get one replay array each (sparse --array indexes).  A run of
# more ranks than a node has GPUs (the spec's node_gpus; step plan's nodes=R:K) asks for --nodes=K
# --ntasks-per-node=R/K, and srun spreads its tasks over every node of the allocation, the first
# node's host being MASTER_ADDR (from the virtual environment only: with --image it is refused).
# --wait blocks until reduce ends and exits with its code as its verdict confirms it (replayjob step
# verdict): 0 pass, 1 fail, 2 refused, 3 error (also when the reduce job ended without a readable verdict
# that says the same code: cancelled, timed out, node failure, an edited verdict; nothing was decided).  Every job is requeued after infrastructure failures (--requeue: node
# failure, preemption) and after exit 3 (lib.sh finish_step), never for exit 1 or 2.  <out> and this checkout must be on a filesystem every
# node sees.  Slurm-side settings are in <out>/slurm/job.env, logs in <out>/logs/.
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPTS/../.." && pwd)

usage() {
  cat <<EOF
usage: $(basename "$0") --out DIR [options]

Options:
  --out DIR              run directory on a filesystem every node sees (required; must be new)
  --spec FILE            ablation spec TOML (default: $REPO/examples/ablation.toml)
  --arms LIST            comma-separated subset of the spec's arms (default: all, in file order)
  --repeats N            replays per arm (default: the spec's repeats)
  --claim CLAIM          exact-input or bitwise (default: the spec's claim); the fewest replays
                         per arm the reducer accepts is the spec's min_repeats (lowered to --repeats)
  --partition P          Slurm partition for every job (default: the cluster's default)
  --gpus-per-task N      GPUs per rank of a capture or replay, as --gres=gpu:N*ranks (default 1);
                         0 drops every GPU request and runs on CPU (device "cpu")
  --image IMAGE          run replayjob from a container image (a .sif file, or docker://...)
                         with apptainer or singularity: --nv when GPUs are requested, <out> bound
  --container CMD        apptainer or singularity (default: whichever the node has)
  --bind SRC[:DST]       extra bind mount for --image (repeatable), e.g. a model directory
  --venv DIR             run replayjob from a virtual environment (default: $REPO/.venv)
  --workspace DIR        an existing 'replayjob init' directory (default: <out>/workspace, made
                         by the capture job)
  --source DIR           reuse a finished capture (its metrics.json); needs --workspace; no
                         capture job is submitted
  --sbatch-arg ARG       extra sbatch option for every job (repeatable): --account=A, --time=...
  --plant ARM:SETTING=VALUE  negative control: an undeclared override in one arm's replays, which
                         the gate must reject (repeatable)
  --wait                 block until the reduce job ends; exit with its code
  --dry-run              print the sbatch commands; submit and write nothing
  -h, --help             show this help

Exit codes: 0 submitted (with --wait: pass), 1 fail, 2 refused, 3 error or no verdict (retryable).
EOF
}

die() {
  echo "submit: $*" >&2
  exit 2
}

need_value() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value (see --help)"; fi; }
is_count() { [[ "$1" =~ ^[0-9]+$ ]]; }
abspath() { if [[ "$1" = /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }

OUT="" SPEC="$REPO/examples/ablation.toml" ARMS="" REPEATS="" CLAIM=""
PARTITION="" GPUS=1 IMAGE="" CONTAINER="" VENV="" WORKSPACE="" SOURCE="" WAIT=0 DRY_RUN=0
BINDS=() SBATCH_ARGS=() PLANT_ARGS=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --out) need_value "$@"; OUT=$2; shift ;;
    --spec) need_value "$@"; SPEC=$2; shift ;;
    --arms) need_value "$@"; ARMS=$2; shift ;;
    --repeats) need_value "$@"; REPEATS=$2; shift ;;
    --claim) need_value "$@"; CLAIM=$2; shift ;;
    --partition) need_value "$@"; PARTITION=$2; shift ;;
    --gpus-per-task) need_value "$@"; GPUS=$2; shift ;;
    --image) need_value "$@"; IMAGE=$2; shift ;;
    --container) need_value "$@"; CONTAINER=$2; shift ;;
    --bind) need_value "$@"; BINDS+=("$2"); shift ;;
    --venv) need_value "$@"; VENV=$2; shift ;;
    --workspace) need_value "$@"; WORKSPACE=$2; shift ;;
    --source) need_value "$@"; SOURCE=$2; shift ;;
    --sbatch-arg) need_value "$@"; SBATCH_ARGS+=("$2"); shift ;;
    --plant) need_value "$@"; PLANT_ARGS+=(--plant "$2"); shift ;;
    --wait) WAIT=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done

# ---- validate -------------------------------------------------------------------------------
[ -n "$OUT" ] || die "--out DIR is required (a new run directory on a shared filesystem)"
OUT=$(abspath "$OUT")
is_count "$GPUS" || die "--gpus-per-task expects an integer >= 0, got '$GPUS'"
[ -z "$REPEATS" ] || { is_count "$REPEATS" && [ "$REPEATS" -ge 1 ]; } \
  || die "--repeats expects an integer >= 1, got '$REPEATS'"
[ -f "$SPEC" ] || die "ablation spec $SPEC not found; pass --spec FILE"
SPEC=$(abspath "$SPEC")
[ -z "$IMAGE" ] || [ -z "$VENV" ] || die "--image and --venv exclude each other"
if [ -n "$IMAGE" ]; then
  [[ "$IMAGE" = *://* ]] || { [ -f "$IMAGE" ] && IMAGE=$(abspath "$IMAGE"); } \
    || die "--image $IMAGE: no such file (give a .sif path or a docker:// reference)"
  VENV=""
else
  [ "${#BINDS[@]}" -eq 0 ] || die "--bind applies to --image only"
  VENV=$(abspath "${VENV:-$REPO/.venv}")
  [ -x "$VENV/bin/replayjob" ] \
    || die "no replayjob in $VENV (create it with scripts/setup.sh, or pass --venv DIR or --image)"
fi
INIT_WORKSPACE=0
if [ -n "$WORKSPACE" ]; then
  WORKSPACE=$(abspath "$WORKSPACE")
  if [ ! -f "$WORKSPACE/source.toml" ] || [ ! -f "$WORKSPACE/replay.toml" ]; then
    die "--workspace $WORKSPACE holds no source.toml and replay.toml (make one with replayjob init)"
  fi
else
  WORKSPACE=$OUT/workspace
  INIT_WORKSPACE=1
fi
if [ -n "$SOURCE" ]; then
  SOURCE=$(abspath "$SOURCE")
  [ "$INIT_WORKSPACE" = 0 ] || die "--source needs --workspace (the workspace the capture ran from)"
  [ -f "$SOURCE/metrics.json" ] || die "--source $SOURCE holds no metrics.json (not a finished capture)"
else
  SOURCE=$OUT/source
fi
if [ "$DRY_RUN" = 0 ]; then
  command -v sbatch >/dev/null 2>&1 || die "sbatch not found: run this on a Slurm login node"
  [ ! -e "$OUT/slurm/job.env" ] || die "$OUT already holds a submission; choose a new --out"
fi

# ---- the fan-out, from the shared ablation spec ----------------------------------------------
# shellcheck source=scripts/slurm/lib.sh
. "$SCRIPTS/lib.sh"
REPLAYJOB_IMAGE=$IMAGE REPLAYJOB_CONTAINER=$CONTAINER REPLAYJOB_VENV=$VENV REPLAYJOB_OUT=$OUT
REPLAYJOB_GPUS=0 REPLAYJOB_BINDS=("${BINDS[@]}" "$(dirname "$SPEC")")
replayjob_cmd
SELECT=()
[ -z "$ARMS" ] || SELECT+=(--arms "$ARMS")
[ -z "$REPEATS" ] || SELECT+=(--repeats "$REPEATS")
[ -z "$CLAIM" ] || SELECT+=(--claim "$CLAIM")
[ "$GPUS" -gt 0 ] || SELECT+=(--device cpu)
# step plan also validates every --plant against the selection (the check step replay makes)
plan=$("${REPLAYJOB[@]}" step plan --spec "$SPEC" "${SELECT[@]}" "${PLANT_ARGS[@]}") \
  || die "the ablation spec or a --plant was refused (see above)"
SIZE="" PARALLELISM="" DEVICE="" CLAIM="" MIN_REPEATS="" ARM_NAMES="" RANKS=""
CPUS="" MEM_MIB="" TIME_MIN="" NODE_GPUS=""  # the spec's resources per rank (step plan)
PINNED_ENV=()  # the spec's determinism environment, NAME=VALUE: every job sets it (lib.sh replayjob_cmd)
GROUPS_RANKS=() GROUPS_INDEXES=()  # one replay array per rank count: its ranks and its array indexes
NODES_OF=()  # rank count -> the nodes its runs span, when more than one (step plan's nodes=N:K)
while IFS= read -r line; do
  case "$line" in
    size=*) SIZE=${line#size=} ;;
    cpus=*) CPUS=${line#cpus=} ;;
    mem_mib=*) MEM_MIB=${line#mem_mib=} ;;
    time_min=*) TIME_MIN=${line#time_min=} ;;
    node_gpus=*) NODE_GPUS=${line#node_gpus=} ;;
    ranks=*) RANKS=${line#ranks=} ;;
    env=*) PINNED_ENV+=("${line#env=}") ;;
    nodes=*:*)
      line=${line#nodes=}
      { is_count "${line%%:*}" && is_count "${line#*:}"; } || die "unexpected plan from replayjob: $plan"
      NODES_OF[${line%%:*}]=${line#*:}
      ;;
    replays=*:*)
      line=${line#replays=}
      GROUPS_RANKS+=("${line%%:*}")
      GROUPS_INDEXES+=("${line#*:}")
      ;;
    parallelism=*) PARALLELISM=${line#parallelism=} ;;
    device=*) DEVICE=${line#device=} ;;
    claim=*) CLAIM=${line#claim=} ;;
    min_repeats=*) MIN_REPEATS=${line#min_repeats=} ;;
    arms=*) ARM_NAMES=${line#arms=} ;;
  esac
done <<<"$plan"
if ! is_count "$SIZE" || [ "$SIZE" -lt 1 ] || ! is_count "$PARALLELISM" || ! is_count "$RANKS" \
  || ! is_count "$CPUS" || ! is_count "$MEM_MIB" || ! is_count "$TIME_MIN" || ! is_count "$NODE_GPUS" \
  || [ "${#GROUPS_RANKS[@]}" -lt 1 ]; then
  die "unexpected plan from replayjob: $plan"
fi
for group in "${!GROUPS_RANKS[@]}"; do
  if ! is_count "${GROUPS_RANKS[$group]}" || ! [[ "${GROUPS_INDEXES[$group]}" =~ ^[0-9,-]+$ ]]; then
    die "unexpected plan from replayjob: $plan"
  fi
done
[ "${#PINNED_ENV[@]}" -ge 1 ] || die "unexpected plan from replayjob (no determinism environment): $plan"
for pinned in "${PINNED_ENV[@]}"; do
  [[ "$pinned" =~ ^[A-Z_][A-Z0-9_]*=[^[:space:]]*$ ]] || die "unexpected plan from replayjob: $plan"
done
[ "$GPUS" -eq 0 ] || [ "$DEVICE" = cuda ] || echo "submit: note: the spec runs on $DEVICE with $GPUS GPU(s) requested" >&2
if [ "${#NODES_OF[@]}" -gt 0 ] && [ -n "$IMAGE" ]; then  # inside the image torchrun starts the ranks: one node
  die "runs of $(IFS=,; echo "${!NODES_OF[*]}") ranks span several nodes (node_gpus = $NODE_GPUS), which needs srun" \
    "across the allocation: run them from a virtual environment (--venv), not --image"
fi

# ---- the three jobs -----------------------------------------------------------------------------
JOB_ENV=$OUT/slurm/job.env
common=(--parsable --chdir "$OUT" --open-mode=append)  # a requeued attempt appends to its log
[ -z "$PARTITION" ] || common+=(--partition "$PARTITION")
# ranks_args R: R tasks (one rank each) on one node, or, when R ranks need more GPUs than a node has
# (step plan's nodes=R:K), on K nodes with R/K tasks each; on every node GPUs for its ranks (all of
# the node's with the spec's node_gpus; --gres and --mem are per node), the spec's CPUs per rank and
# its memory per rank times the node's ranks, and its deadline
ranks_args() {
  local nodes=${NODES_OF[$1]:-1}
  local per=$(($1 / nodes))
  RANKS_ARGS=("--nodes=$nodes" "--ntasks=$1")
  [ "$nodes" -eq 1 ] || RANKS_ARGS+=("--ntasks-per-node=$per")
  if [ "$GPUS" -gt 0 ] && [ "$NODE_GPUS" -gt 0 ]; then
    RANKS_ARGS+=("--gres=gpu:$NODE_GPUS")
  elif [ "$GPUS" -gt 0 ]; then
    RANKS_ARGS+=("--gres=gpu:$((GPUS * per))")
  fi
  RANKS_ARGS+=("--cpus-per-task=$CPUS" "--mem=$((MEM_MIB * per))M" "--time=$TIME_MIN")
}
ranks_args "$RANKS"
capture_cmd=(sbatch "${common[@]}" --job-name replayjob-capture --output "$OUT/logs/capture-%j.out"
  --requeue "${RANKS_ARGS[@]}" "${SBATCH_ARGS[@]}" "$SCRIPTS/capture.sbatch" "$JOB_ENV")
# replay_cmd GROUP: REPLAY_CMD, the replay array of one rank count (its indexes, its tasks and GPUs)
replay_cmd() {
  ranks_args "${GROUPS_RANKS[$1]}"
  REPLAY_CMD=(sbatch "${common[@]}" --job-name replayjob-replay --output "$OUT/logs/replay-%A_%a.out"
    --array "${GROUPS_INDEXES[$1]}%$PARALLELISM" --exclusive --requeue "${RANKS_ARGS[@]}" "${SBATCH_ARGS[@]}")
}
reduce_cmd=(sbatch "${common[@]}" --job-name replayjob-reduce --output "$OUT/logs/reduce-%j.out"
  --requeue --cpus-per-task=1 --mem=4096M "--time=$TIME_MIN" "${SBATCH_ARGS[@]}")  # a site's options last
# replay_dep GROUP: the dependency of a replay array: the capture's success, and the end of the array
# before it (one rank count's array after another, so parallelism bounds every replay at once)
replay_dep() {
  local after=()
  [ -z "${CAPTURE_DEP:-}" ] || after+=("afterok:$CAPTURE_DEP")
  [ "$1" -eq 0 ] || after+=("afterany:$2")
  DEP_ARGS=()
  [ "${#after[@]}" -eq 0 ] || DEP_ARGS=("--dependency=$(IFS=,; echo "${after[*]}")" --kill-on-invalid-dep=yes)
}

if [ "$DRY_RUN" = 1 ]; then
  echo "# plan: $SIZE replays (arms $ARM_NAMES), claim $CLAIM, min repeats $MIN_REPEATS, device $DEVICE"
  show() {
    local line
    line=$(printf '%q ' "$@")
    echo "${line% }"
  }
  CAPTURE_DEP=""
  if [ "$SOURCE" = "$OUT/source" ]; then
    show "${capture_cmd[@]}"
    CAPTURE_DEP=CAPTURE_ID
  fi
  for group in "${!GROUPS_RANKS[@]}"; do
    replay_cmd "$group"
    replay_dep "$group" "REPLAY_ID_$((group - 1))"
    show "${REPLAY_CMD[@]}" "${DEP_ARGS[@]}" "$SCRIPTS/replay.sbatch" "$JOB_ENV"
  done
  show "${reduce_cmd[@]}" --dependency=afterany:REPLAY_ID "$SCRIPTS/reduce.sbatch" "$JOB_ENV"
  exit 0
fi

mkdir -p "$OUT/slurm" "$OUT/logs"
cp "$SPEC" "$OUT/slurm/ablation.toml"
{
  echo "# Written by scripts/slurm/submit.sh; sourced by the job scripts."
  # shellcheck disable=SC2034  # read by the job scripts through declare -p
  (
    REPLAYJOB_SCRIPTS=$SCRIPTS REPLAYJOB_GPUS=$GPUS REPLAYJOB_MAX_RESTARTS=${REPLAYJOB_MAX_RESTARTS:-2}
    REPLAYJOB_BINDS=("${BINDS[@]}")
    REPLAYJOB_ENV=("${PINNED_ENV[@]}")
    REPLAYJOB_STEP=(--spec "$OUT/slurm/ablation.toml" --run-dir "$OUT" "${SELECT[@]}")
    if [ "$WORKSPACE" != "$OUT/workspace" ]; then
      REPLAYJOB_BINDS+=("$WORKSPACE")
      REPLAYJOB_STEP+=(--workspace "$WORKSPACE")
    fi
    if [ "$SOURCE" != "$OUT/source" ]; then
      REPLAYJOB_BINDS+=("$SOURCE")
      REPLAYJOB_STEP+=(--source "$SOURCE")
    fi
    # How a step starts R > 1 ranks: srun (this allocation's tasks); torchrun inside the container
    # with --image (srun is not in the image)
    REPLAYJOB_LAUNCHER=srun
    [ -z "$IMAGE" ] || REPLAYJOB_LAUNCHER=torchrun
    REPLAYJOB_CAPTURE_ARGS=() REPLAYJOB_REPLAY_ARGS=("${PLANT_ARGS[@]}") REPLAYJOB_REDUCE_ARGS=()
    declare -p REPLAYJOB_OUT REPLAYJOB_SCRIPTS REPLAYJOB_GPUS REPLAYJOB_MAX_RESTARTS REPLAYJOB_IMAGE \
      REPLAYJOB_CONTAINER REPLAYJOB_VENV REPLAYJOB_BINDS REPLAYJOB_ENV REPLAYJOB_STEP REPLAYJOB_LAUNCHER \
      REPLAYJOB_CAPTURE_ARGS REPLAYJOB_REPLAY_ARGS REPLAYJOB_REDUCE_ARGS
  )
} >"$JOB_ENV.tmp"
mv "$JOB_ENV.tmp" "$JOB_ENV"

first_id() { local id; id=$("$@") || return 1; echo "${id%%;*}"; }
submitted=()
refused() {  # a half-submitted chain would run without its gate: cancel what was submitted
  [ "${#submitted[@]}" -eq 0 ] || scancel "${submitted[@]}" || true
  die "sbatch refused the $1${submitted[*]:+; cancelled job(s) ${submitted[*]}}"
}
capture_id="" CAPTURE_DEP=""
if [ "$SOURCE" = "$OUT/source" ]; then
  capture_id=$(first_id "${capture_cmd[@]}") || refused "capture job"
  submitted+=("$capture_id")
  CAPTURE_DEP=$capture_id
fi
replay_ids=()
for group in "${!GROUPS_RANKS[@]}"; do
  replay_cmd "$group"
  replay_dep "$group" "${replay_ids[*]: -1}"
  id=$(first_id "${REPLAY_CMD[@]}" "${DEP_ARGS[@]}" "$SCRIPTS/replay.sbatch" "$JOB_ENV") \
    || refused "replay array of ${GROUPS_RANKS[$group]} rank(s)"
  submitted+=("$id")
  replay_ids+=("$id")
done
replay_id=$(IFS=,; echo "${replay_ids[*]}")  # every array, comma-separated
reduce_id=$(first_id "${reduce_cmd[@]}" "--dependency=afterany:${replay_id//,/:}" "$SCRIPTS/reduce.sbatch" \
  "$JOB_ENV") || refused "reduce job"
printf 'capture=%s\nreplay=%s\nreduce=%s\n' "$capture_id" "$replay_id" "$reduce_id" >"$OUT/slurm/jobs"
ranks_note=""
for group in "${!GROUPS_RANKS[@]}"; do
  ranks_note+="${ranks_note:+, }${GROUPS_INDEXES[$group]} on ${GROUPS_RANKS[$group]} rank(s)"
done
echo "submit: capture ${capture_id:-(reusing $SOURCE)} on $RANKS rank(s), replays $replay_id (array 0-$((SIZE - 1)):" \
  "arms $ARM_NAMES; $ranks_note), reduce $reduce_id; claim $CLAIM, min repeats $MIN_REPEATS, gpus/rank $GPUS"
echo "submit: run directory $OUT (logs in $OUT/logs, replays in $OUT/replays/ARM/REPEAT, verdict $OUT/verdict.json)"
[ "$WAIT" = 1 ] || exit 0

# ---- --wait: block until reduce ends, exit with its code --------------------------------------
POLL_S=${REPLAYJOB_SLURM_POLL_S:-10}
all_ids=$capture_id${capture_id:+,}$replay_id,$reduce_id
trap 'echo "submit: interrupted; the jobs keep running (scancel ${all_ids//,/ } to stop them)" >&2; exit 130' INT TERM

field() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" <<<" $2" | head -n 1; }

last=""
while :; do
  record=$(REPLAYJOB_SCONTROL_TRIES=${REPLAYJOB_SCONTROL_TRIES:-5} scontrol_retry show job -o "$reduce_id" \
    2>/dev/null || true)
  if [ -z "$record" ]; then
    if command -v sacct >/dev/null 2>&1 && acct=$(sacct -n -X -P -j "$reduce_id" -o State,ExitCode 2>/dev/null) \
      && [ -n "$acct" ]; then
      acct=$(head -n 1 <<<"$acct")
      record="JobState=$(cut -d' ' -f1 <<<"${acct%%|*}") ExitCode=${acct#*|}"
    else
      echo "submit: slurmctld no longer knows reduce job $reduce_id and there is no accounting;" \
        "read $OUT/verdict.json" >&2
      exit 3
    fi
  fi
  state=$(field JobState "$record")
  queue=$(squeue -h -j "$all_ids" -o '%i:%T' 2>/dev/null | tr '\n' ' ' || true)
  if [ "$queue" != "$last" ]; then
    echo "submit: $(date +%H:%M:%S) ${queue:-reduce $state}"
    last=$queue
  fi
  case "$state" in
    PENDING | CONFIGURING | RUNNING | COMPLETING | REQUEUED | REQUEUE_HOLD | REQUEUE_FED | RESIZING \
      | SUSPENDED | STAGE_OUT | SIGNALING | "")
      sleep "$POLL_S"
      ;;
    *) break ;;
  esac
done
trap - INT TERM

exit_code=$(field ExitCode "$record")
status=${exit_code%%:*} signal=${exit_code#*:}
tasks=$(for id in "${replay_ids[@]}"; do scontrol show job -o "$id" 2>/dev/null; done | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' | sort | uniq -c \
  | awk '{printf "%s%s %s", sep, $1, $2; sep=", "}' || true)
echo "submit: replay tasks: ${tasks:-unknown}"
if [ "$state" = COMPLETED ] || { [ "$state" = FAILED ] && [ "$signal" = 0 ] && is_count "$status"; }; then
  [ "$state" != COMPLETED ] || status=0
  if is_retryable "$status"; then
    echo "submit: reduce exited $status on its last attempt (an error, nothing was decided; retrying may help);" \
      "log $OUT/logs/reduce-$reduce_id.out" >&2
    exit 3
  fi
  # the outcome is the reducer's code only as its verdict confirms it, read strictly (argo wait's and the
  # driver's rule): a missing, unreadable or edited verdict, or one that says another code, is 3
  outcome=0
  confirm_verdict "$OUT" "$status" || outcome=$?  # lib.sh: 3 unless the command confirms its 0-3
  echo "submit: reduce exited $status; outcome $outcome (log $OUT/logs/reduce-$reduce_id.out)"
  exit "$outcome"
fi
echo "submit: reduce job $reduce_id ended $state (exit $exit_code) without a verdict; nothing was decided" >&2
exit 3
