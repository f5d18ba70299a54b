# shellcheck shell=bash
# Sourced by the Slurm job scripts (capture.sbatch, replay.sbatch, reduce.sbatch).
#
# Each job script takes one argument, the job.env file submit.sh wrote under <out>/slurm/ (bash
# `declare -p` lines: every value quoted, arrays kept), sources it, then this file.  job.env names
# the output tree and how to run replayjob: from a container image (apptainer or singularity, with
# --nv when GPUs are requested and the output tree bound) or from a virtual environment.

# replayjob_cmd: fill the arrays REPLAYJOB and REPLAYJOB_PY with the commands that run the
# replayjob CLI and the Python interpreter it is installed in.
replayjob_cmd() {
  if [ -n "${REPLAYJOB_IMAGE:-}" ]; then
    local runtime=${REPLAYJOB_CONTAINER:-}
    if [ -z "$runtime" ]; then
      runtime=$(command -v apptainer || command -v singularity || true)
    fi
    if [ -z "$runtime" ]; then
      echo "job: --image needs apptainer or singularity on the compute node" >&2
      exit 2
    fi
    REPLAYJOB=("$runtime" exec --cleanenv --bind "$REPLAYJOB_OUT")
    local bind env_kv
    for bind in "${REPLAYJOB_BINDS[@]}"; do
      REPLAYJOB+=(--bind "$bind")
    done
    if [ "${REPLAYJOB_GPUS:-0}" -gt 0 ]; then
      REPLAYJOB+=(--nv)
    fi
    for env_kv in "${REPLAYJOB_DETERMINISM_ENV[@]}"; do
      REPLAYJOB+=(--env "$env_kv")
    done
    REPLAYJOB+=("$REPLAYJOB_IMAGE")
    REPLAYJOB_PY=("${REPLAYJOB[@]}" python3)
    REPLAYJOB+=(replayjob)
  else
    local venv=${REPLAYJOB_VENV:?job.env names neither an image nor a virtual environment}
    REPLAYJOB=("$venv/bin/replayjob")
    REPLAYJOB_PY=("$venv/bin/python")
  fi
}

# export_determinism_env: pin the determinism environment in this job (KEY=VALUE words).
export_determinism_env() {
  local env_kv
  for env_kv in "${REPLAYJOB_DETERMINISM_ENV[@]}"; do
    export "${env_kv?}"
  done
}

# read_pins METRICS_JSON: print "<logical sha256> <manifest sha256>" from the capture's metrics.json,
# read with replayjob's strict JSON reader; anything but two 64-digit hex digests exits 2.
read_pins() {
  "${REPLAYJOB_PY[@]}" -c '
import re, sys
from replayjob.errors import ReplayjobError
from replayjob.jsonio import read_json_object
try:
    m = read_json_object(sys.argv[1])
except ReplayjobError as exc:
    sys.exit("replay: " + exc.diagnostics())
pins = [m.get("optimizer/logical_batch_sha256"), m.get("optimizer_batch/manifest_sha256")]
if not all(isinstance(p, str) and re.fullmatch("[0-9a-f]{64}", p) for p in pins):
    sys.exit("replay: " + sys.argv[1] + ": no valid capture pins")
print(*pins)
' "$1" || exit 2
}

# job_banner NAME: one line saying what runs where, for the job's log.
job_banner() {
  echo "job $1: slurm job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ task $SLURM_ARRAY_TASK_ID}" \
    "on $(hostname -s), restart ${SLURM_RESTART_COUNT:-0}, gpus ${REPLAYJOB_GPUS:-0}," \
    "runner ${REPLAYJOB[*]}"
}

# set_aside_partial DIR: a requeued attempt (node failure, preemption) starts clean; the previous
# attempt's partial output is moved out of the tree the reducer reads, never deleted.
set_aside_partial() {
  local dir=$1
  if [ -e "$dir" ]; then
    local aside
    aside="$REPLAYJOB_OUT/attempts/$(basename "$dir").restart-${SLURM_RESTART_COUNT:-0}.$$"
    mkdir -p "$REPLAYJOB_OUT/attempts"
    mv "$dir" "$aside"
    echo "job: moved a previous attempt's output to $aside"
  fi
}

# scontrol_retry ARGS...: scontrol with retries (slurmctld can be briefly unreachable: restarts,
# failover, load); up to REPLAYJOB_SCONTROL_TRIES attempts (default 5), backing off 2, 4, 8... s.
scontrol_retry() {
  local try=1 tries=${REPLAYJOB_SCONTROL_TRIES:-5} delay=2
  while ! scontrol "$@"; do
    if [ "$try" -ge "$tries" ]; then
      echo "job: scontrol $* failed $tries times" >&2
      return 1
    fi
    sleep "$delay"
    try=$((try + 1))
    delay=$((delay * 2))
  done
}

# finish_step CODE: end the job with replayjob's exit code.  1 (a negative verdict) and 2 (refused)
# are final.  3 (an error: nothing was decided) is retried: the job requeues itself, keeping its job
# id (an array task only itself), at most REPLAYJOB_MAX_RESTARTS times (default 2; Slurm's
# SLURM_RESTART_COUNT counts), and the dependent jobs wait for the new attempt.  When the retries
# are used up, or the requeue fails, the job ends with 3.
finish_step() {
  local code=$1
  if [ "$code" -eq 3 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "${REPLAYJOB_MAX_RESTARTS:-2}" ] \
    && [ -n "${SLURM_JOB_ID:-}" ]; then
    echo "job: exit 3 (error, nothing was decided): requeueing job $SLURM_JOB_ID," \
      "restart $((${SLURM_RESTART_COUNT:-0} + 1)) of ${REPLAYJOB_MAX_RESTARTS:-2}"
    if scontrol_retry requeue "$SLURM_JOB_ID"; then
      exit 0  # slurmctld ends this attempt and queues the next; this status is not recorded
    fi
  fi
  exit "$code"
}
