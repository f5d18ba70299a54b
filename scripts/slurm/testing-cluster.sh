#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for tests and CI.
#
#   eval "$(scripts/slurm/testing-cluster.sh start)"   # prints `export SLURM_CONF=...`
#   scripts/slurm/testing-cluster.sh status
#   scripts/slurm/testing-cluster.sh stop
#
# munged, slurmctld and slurmd run on localhost as root (SlurmUser=root) with every key, socket,
# state, spool, pid and log file under one folder, $REPLAYJOB_SLURM_DIR (default
# ${TMPDIR:-/tmp}/replayjob-slurm); nothing under /etc is changed.  The node has this machine's real
# CPU layout and memory (from `slurmd -C`), SelectType=select/cons_tres, and one partition `debug`.
# No accounting daemon: job states and exit codes come from slurmctld's job records.
# Needs Debian's slurmctld, slurmd, slurm-client and munge packages.
set -euo pipefail

DIR=${REPLAYJOB_SLURM_DIR:-${TMPDIR:-/tmp}/replayjob-slurm}
CTLD_PORT=${REPLAYJOB_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${REPLAYJOB_SLURM_SLURMD_PORT:-6818}
CONF="$DIR/slurm.conf"

log() { echo "testing-cluster: $*" >&2; }

die() {
  log "$*"
  local f
  for f in "$DIR/munged.log" "$DIR/slurmctld.log" "$DIR/slurmd.log"; do
    if [ -s "$f" ]; then
      log "--- last lines of $f"
      tail -n 20 "$f" >&2
    fi
  done
  exit 1
}

need() {
  local cmd
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null 2>&1 \
      || die "$cmd not found; install it with: apt-get install -y slurmctld slurmd slurm-client munge"
  done
}

# daemon_pid NAME PIDFILE: the pid in PIDFILE when that process is a live NAME (not a zombie, not a
# reused pid), else nothing.
daemon_pid() {
  local pid
  pid=$(cat "$2" 2>/dev/null || true)
  [[ "$pid" =~ ^[0-9]+$ ]] || return 0
  [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$1" ] || return 0
  grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null || echo "$pid"
}

# running PID NAME: whether PID is still a live NAME.
running() {
  [ "$(cat "/proc/$1/comm" 2>/dev/null || true)" = "$2" ] \
    && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}

write_conf() {
  local host node_line cpus memory
  host=$(hostname -s)
  # `slurmd -C` prints this machine's layout: NodeName=... CPUs=... Boards=... RealMemory=...
  node_line=$(slurmd -C | head -n 1)
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$node_line")
  memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
  if [ -z "$cpus" ] || [ -z "$memory" ]; then
    die "could not read CPUs and RealMemory from: $node_line"
  fi
  cat >"$CONF" <<CONF
# Written by scripts/slurm/testing-cluster.sh: a single-node test cluster on localhost.
ClusterName=replayjob-test
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${DIR}/munge/munge.socket.2
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool
SlurmctldPidFile=${DIR}/slurmctld.pid
SlurmdPidFile=${DIR}/slurmd.pid
SlurmctldLogFile=${DIR}/slurmctld.log
SlurmdLogFile=${DIR}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((memory / cpus))
ReturnToService=2
MinJobAge=600
KillWait=5
InactiveLimit=0
${node_line%% UpTime=*} NodeHostname=${host} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

start() {
  need munged mungekey slurmctld slurmd sinfo scontrol
  if [ -f "$CONF" ] && SLURM_CONF="$CONF" scontrol ping >/dev/null 2>&1; then
    log "already running ($CONF)"
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  local t0=$SECONDS
  rm -rf "$DIR"
  mkdir -p "$DIR/munge" "$DIR/state" "$DIR/spool"
  chmod 0700 "$DIR/munge"
  mungekey --create --keyfile="$DIR/munge/munge.key" --bits=1024 >/dev/null 2>&1 \
    || die "mungekey could not create a key"
  munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munged.log" \
    --seed-file="$DIR/munge/munged.seed" || die "munged did not start"
  write_conf
  export SLURM_CONF="$CONF"
  slurmctld -c -f "$CONF" || die "slurmctld did not start"
  slurmd -f "$CONF" || die "slurmd did not start"
  local _ state=""
  for _ in $(seq 1 60); do
    state=$(sinfo -h -o %T 2>/dev/null | head -n 1 || true)
    case "$state" in
      idle) break ;;
      *) sleep 0.5 ;;
    esac
  done
  [ "$state" = idle ] || die "node did not become idle within 30 s (state '${state:-unknown}')"
  log "up in $((SECONDS - t0)) s: $(sinfo -h -N -o '%N cpus=%c mem=%mMB %T')"
  echo "export SLURM_CONF=$CONF"
}

stop() {
  local name pid _ pids=() names=()
  for name in slurmctld slurmd munged; do
    case "$name" in
      munged) pid=$(daemon_pid munged "$DIR/munge/munged.pid") ;;
      *) pid=$(daemon_pid "$name" "$DIR/$name.pid") ;;
    esac
    if [ -n "$pid" ]; then
      pids+=("$pid")
      names+=("$name")
    fi
  done
  if [ -f "$CONF" ]; then
    SLURM_CONF="$CONF" scontrol shutdown >/dev/null 2>&1 || true
  fi
  local i
  for i in "${!pids[@]}"; do
    # slurmctld and slurmd exit on `scontrol shutdown`; munged on SIGTERM, after them.
    [ "${names[$i]}" != munged ] || kill "${pids[$i]}" 2>/dev/null || true
    for _ in $(seq 1 50); do
      running "${pids[$i]}" "${names[$i]}" || break
      sleep 0.2
    done
    if running "${pids[$i]}" "${names[$i]}"; then
      log "${names[$i]} (pid ${pids[$i]}) still running after 10 s; sending SIGKILL"
      kill -9 "${pids[$i]}" 2>/dev/null || true
    fi
  done
  if [ "${REPLAYJOB_SLURM_KEEP:-0}" = 1 ]; then
    log "stopped; state and logs kept in $DIR"
  else
    rm -rf "$DIR"
    log "stopped"
  fi
}

status() {
  [ -f "$CONF" ] || die "no cluster configured in $DIR"
  SLURM_CONF="$CONF" sinfo -N -l
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  -h | --help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
