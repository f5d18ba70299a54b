# shellcheck shell=bash
# Sourced by the Slurm job scripts (capture.sbatch, replay.sbatch, reduce.sbatch).
#
# Each job script takes one argument, the job.env file submit.sh wrote under <out>/slurm/ (bash
# `declare -p` lines: every value quoted, arrays kept), sources it, then this file, and runs one
# `replayjob step` command, which owns the layout, the pins, the partial-output policy and the
# determinism environment.  job.env names how to run replayjob: from a container image (apptainer
# or singularity, with --nv when GPUs are requested and the output tree bound) or from a virtual
# environment, and the spec's determinism environment (REPLAYJOB_ENV: NAME=VALUE words, the `env=`
# lines of `replayjob step plan`; its math mode is the existing capture's), set in every job: passed
# with --env into the container (over the image's own ENV) or exported.

# replayjob_cmd: fill the array REPLAYJOB with the command that runs the replayjob CLI.
replayjob_cmd() {
  local threads=${SLURM_CPUS_PER_TASK:-}
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
    local bind name
    for bind in "${REPLAYJOB_BINDS[@]}"; do
      REPLAYJOB+=(--bind "$bind")
    done
    if [ "${REPLAYJOB_GPUS:-0}" -gt 0 ]; then
      REPLAYJOB+=(--nv)
    fi
    # --cleanenv drops the host environment: pass on what must survive it.  Above all the GPUs Slurm
    # allocated (CUDA_VISIBLE_DEVICES): without it the process would see every GPU --nv binds.
    for name in CUDA_VISIBLE_DEVICES SLURM_JOB_ID SLURM_ARRAY_JOB_ID SLURM_ARRAY_TASK_ID \
      SLURM_RESTART_COUNT SLURMD_NODENAME; do
      if [ -n "${!name:-}" ]; then
        REPLAYJOB+=(--env "$name=${!name}")
      fi
    done
    REPLAYJOB+=(--env "REPLAYJOB_IMAGE_REF=$REPLAYJOB_IMAGE")
    # A .sif file is identified by its SHA-256, computed by every job from the file it runs: a file
    # replaced between two jobs of one run changes the run's fingerprint, and the step refuses.
    if [ -f "$REPLAYJOB_IMAGE" ]; then
      local digest
      digest=$(sha256sum "$REPLAYJOB_IMAGE") || { echo "job: cannot read $REPLAYJOB_IMAGE" >&2; exit 3; }
      REPLAYJOB+=(--env "REPLAYJOB_IMAGE_DIGEST=sha256:${digest%% *}")
    fi
    if [ -n "$threads" ]; then
      REPLAYJOB+=(--env "OMP_NUM_THREADS=$threads" --env "MKL_NUM_THREADS=$threads")
    fi
    local pinned
    for pinned in ${REPLAYJOB_ENV[@]+"${REPLAYJOB_ENV[@]}"}; do
      REPLAYJOB+=(--env "$pinned")
    done
    REPLAYJOB+=("$REPLAYJOB_IMAGE" replayjob)
  else
    local venv=${REPLAYJOB_VENV:?job.env names neither an image nor a virtual environment}
    REPLAYJOB=("$venv/bin/replayjob")
    local pinned
    for pinned in ${REPLAYJOB_ENV[@]+"${REPLAYJOB_ENV[@]}"}; do
      export "${pinned?}"
    done
    if [ -n "$threads" ]; then
      export OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
    fi
  fi
}

# job_banner NAME: one line saying what runs where, for the job's log.
job_banner() {
  echo "job $1: slurm job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ task $SLURM_ARRAY_TASK_ID}" \
    "on $(hostname -s), restart ${SLURM_RESTART_COUNT:-0}, gpus ${REPLAYJOB_GPUS:-0}" \
    "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}), runner ${REPLAYJOB[*]}"
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

# The exit statuses that end a step for good (a decided negative verdict, a refusal):
# replayjob.errors.FINAL_EXIT_STATUSES, which a test compares with this line.  Every other non-zero
# status (3, a signal such as 137: an OOM kill, an eviction's or a time limit's SIGKILL) is retried.
REPLAYJOB_FINAL_STATUSES=(1 2)

# confirm_verdict RUN_DIR CODE: the run's outcome, the reducer's CODE as RUN_DIR/verdict.json confirms it, read
# by `replayjob step verdict` (0-3, returned).  The command must say its outcome on its last stdout line
# ("replayjob step verdict: outcome N", the same N it exits with); without that line nothing was decided (3):
# an image whose replayjob predates the command answers a usage error (2, which would read as "refused"), a
# container runtime that failed or a signal ends it elsewhere.
confirm_verdict() {
  local said outcome=0 confirmed
  said=$("${REPLAYJOB[@]}" step verdict --run-dir "$1" --code "$2") || outcome=$?
  if [ -n "$said" ]; then
    printf '%s\n' "$said" | grep -v '^replayjob step verdict: outcome ' || true
  fi
  confirmed=$(printf '%s\n' "$said" | sed -n 's/^replayjob step verdict: outcome \([0-3]\)$/\1/p' | tail -n 1)
  if [ -z "$confirmed" ] || [ "$confirmed" != "$outcome" ]; then
    echo "submit: replayjob step verdict exited $outcome without confirming its outcome (an image whose replayjob" \
      "predates the command, a container runtime that failed, a signal); nothing was decided" >&2
    return 3
  fi
  return "$outcome"
}

# is_retryable CODE: whether a step that exited CODE is retried (replayjob.errors.is_retryable).
is_retryable() {
  local final
  [ "$1" -ne 0 ] || return 1
  for final in "${REPLAYJOB_FINAL_STATUSES[@]}"; do
    [ "$1" -ne "$final" ] || return 1
  done
}

# finish_step CODE: end the job with replayjob's exit code.  1 (a negative verdict) and 2 (refused)
# are final.  Any other failure (3: nothing was decided; a signal) is retried: the job requeues
# itself, keeping its job id (an array task only itself), at most REPLAYJOB_MAX_RESTARTS times
# (default 2; Slurm's SLURM_RESTART_COUNT counts), and the dependent jobs wait for the new attempt.
# When the retries are used up, or the requeue fails, the job ends with 3.
finish_step() {
  local code=$1
  if is_retryable "$code"; then
    if [ "${SLURM_RESTART_COUNT:-0}" -lt "${REPLAYJOB_MAX_RESTARTS:-2}" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
      echo "job: exit $code (error, nothing was decided): requeueing job $SLURM_JOB_ID," \
        "restart $((${SLURM_RESTART_COUNT:-0} + 1)) of ${REPLAYJOB_MAX_RESTARTS:-2}"
      if scontrol_retry requeue "$SLURM_JOB_ID"; then
        exit 0  # slurmctld ends this attempt and queues the next
      fi
    fi
    exit 3
  fi
  exit "$code"
}
