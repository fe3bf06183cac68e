#!/usr/bin/env bash
# A one-node Slurm on localhost, for the Slurm tests and for trying sweeps on a laptop.
#
#   slurm/local_slurm.sh up       install (apt-get, Debian/Ubuntu, as root) if needed, then start
#                                  munged, slurmctld and slurmd; waits until the node is idle
#   slurm/local_slurm.sh down     cancel this cluster's jobs, stop the daemons this script started (by PID)
#   slurm/local_slurm.sh status   daemons, node state, queue
#   slurm/local_slurm.sh env      prints `export SLURM_CONF=...`; use: eval "$(slurm/local_slurm.sh env)"
#
# Everything lives in $HMT_SLURM_DIR (default /tmp/hmt-slurm): slurm.conf, its own munge key and
# socket, spool and state directories, daemon logs under log/. Nothing is written to /etc/slurm or
# /etc/munge, so a machine's real Slurm/munge configuration is left alone; client commands find this
# cluster through SLURM_CONF. No accounting daemon: `sacct` does not work here, which is fine because
# the sweep tooling reads each run's state from results/<run_id>/status, not from Slurm.
# `up` is idempotent: when this cluster already answers it starts nothing.
set -euo pipefail

STATE_DIR="${HMT_SLURM_DIR:-/tmp/hmt-slurm}"
CONF="$STATE_DIR/slurm.conf"
PID_DIR="$STATE_DIR/pids"
LOG_DIR="$STATE_DIR/log"
MUNGE_DIR="$STATE_DIR/munge"
CTLD_PORT="${HMT_SLURM_PORT:-6817}"
HOST="$(hostname -s)"
PACKAGES=(munge slurmctld slurmd slurm-client)
export SLURM_CONF="$CONF"

log() { echo "local_slurm: $*" >&2; }

pid_alive() {  # pid_alive NAME -> true if the process recorded for NAME runs the expected program
  local name="$1" pid
  [[ -f "$PID_DIR/$name" ]] || return 1
  pid="$(cat "$PID_DIR/$name")"
  [[ -r "/proc/$pid/cmdline" ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$name"
}

cluster_answers() {
  pid_alive munged && pid_alive slurmctld && pid_alive slurmd && scontrol ping >/dev/null 2>&1
}

daemons_answer_in_time() {  # running daemons that are slow to answer (a loaded machine) are waited for, up to 60 s:
  # never torn down and restarted under another user's running jobs
  pid_alive munged && pid_alive slurmctld && pid_alive slurmd || return 1
  for _ in $(seq 60); do scontrol ping >/dev/null 2>&1 && return 0; sleep 1; done
  return 1
}

install_packages() {
  local missing=0
  for cmd in munged mungekey slurmctld slurmd sbatch; do command -v "$cmd" >/dev/null || missing=1; done
  [[ $missing == 0 ]] && return 0
  if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null; then
    log "Slurm/munge not installed; need root and apt-get to install ${PACKAGES[*]}"
    return 1
  fi
  log "installing ${PACKAGES[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >"$LOG_DIR/apt.log" 2>&1; then
    apt-get update -qq >>"$LOG_DIR/apt.log" 2>&1
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >>"$LOG_DIR/apt.log" 2>&1
  fi
}

write_conf() {
  local cpus mem_mb
  cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # GNU nproc obeys OMP_NUM_THREADS; slurmd counts all
  mem_mb="$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)"
  cat >"$CONF" <<EOF
# Written by slurm/local_slurm.sh; one node, no accounting, no cgroups.
ClusterName=hmtlocal
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_DIR/munge.socket
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_daemon() {  # start_daemon NAME COMMAND... (runs in the background, records its PID)
  local name="$1"; shift
  "$@" >>"$LOG_DIR/$name.out" 2>&1 &
  echo $! >"$PID_DIR/$name"
}

cmd_up() {
  if cluster_answers || daemons_answer_in_time; then log "already up ($CONF)"; return 0; fi
  cmd_down quiet
  rm -rf "$STATE_DIR/ctld" "$STATE_DIR/slurmd" "$MUNGE_DIR"
  mkdir -p "$PID_DIR" "$LOG_DIR" "$MUNGE_DIR" "$STATE_DIR/ctld" "$STATE_DIR/slurmd"
  install_packages
  write_conf

  chmod 700 "$MUNGE_DIR"
  mungekey --create --keyfile="$MUNGE_DIR/munge.key" --force >/dev/null 2>&1 \
    || dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
  chmod 400 "$MUNGE_DIR/munge.key"
  start_daemon munged munged --foreground --force --socket="$MUNGE_DIR/munge.socket" \
    --key-file="$MUNGE_DIR/munge.key" --pid-file="$MUNGE_DIR/munged.pid" \
    --seed-file="$MUNGE_DIR/munged.seed" --log-file="$LOG_DIR/munged.log"
  for _ in $(seq 50); do [[ -S "$MUNGE_DIR/munge.socket" ]] && break; sleep 0.1; done

  start_daemon slurmctld slurmctld -D -f "$CONF"
  start_daemon slurmd slurmd -D -f "$CONF" -N "$HOST"

  local state=""
  for _ in $(seq 300); do
    state="$(sinfo -h -N -o %T 2>/dev/null | head -n1 || true)"
    [[ "$state" == idle ]] && break  # not "idle*": the controller's default before slurmd has registered
    for name in munged slurmctld slurmd; do
      pid_alive "$name" || { log "$name exited; see $LOG_DIR"; tail -n 20 "$LOG_DIR/$name"* >&2 || true; return 1; }
    done
    sleep 0.1
  done
  if [[ "$state" != idle ]]; then
    log "node not idle after 30 s (state: '${state}'); see $LOG_DIR"
    return 1
  fi
  log "up: node $HOST idle; $(echo "export SLURM_CONF=$CONF")"
}

stop_pid() {  # stop_pid NAME: TERM, wait up to 10 s, then KILL; only the PID this script recorded
  local name="$1" pid
  pid_alive "$name" || { rm -f "$PID_DIR/$name"; return 0; }
  pid="$(cat "$PID_DIR/$name")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  rm -f "$PID_DIR/$name"
}

cmd_down() {
  if pid_alive slurmctld && scontrol ping >/dev/null 2>&1; then
    scancel --cluster=hmtlocal --full --quiet --state=PENDING 2>/dev/null || true
    squeue -h -o %i 2>/dev/null | xargs -r scancel --quiet 2>/dev/null || true
    for _ in $(seq 50); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.1; done
  fi
  for name in slurmd slurmctld munged; do stop_pid "$name"; done
  [[ "${1:-}" == quiet ]] || log "down"
}

cmd_status() {
  for name in munged slurmctld slurmd; do
    if pid_alive "$name"; then echo "$name: running (pid $(cat "$PID_DIR/$name"))"; else echo "$name: stopped"; fi
  done
  if cluster_answers; then
    echo "export SLURM_CONF=$CONF"
    sinfo -N
    squeue
  else
    return 1
  fi
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
