#!/usr/bin/env bash
# Start, stop or inspect the emulated Slurm cluster (4 nodes x 8 GPU tokens, partition h20) on this one machine.
#
# Usage: scripts/slurm-emulated.sh start|stop|status
#
# The cluster is the one conf/cluster/h20_4x8.yaml describes (4 nodes x 8 GPUs, partition h20): munged, one
# slurmctld and four slurmd daemons (node1..node4, all on this host, each with its own port, spool and pid file;
# Debian's slurm-wlm is built with MULTIPLE_SLURMD). The "GPUs" are plain files used as scheduling tokens.
# Everything lives under a state directory (default /tmp/predmask-slurm, or $PREDMASK_SLURM_DIR).
# `start` is idempotent (starts only what is missing), prints progress on stderr and, on stdout,
# the one line clients need:  export SLURM_CONF=<state dir>/slurm.conf
# so that  eval "$(scripts/slurm-emulated.sh start)"  works. `stop` cancels every job of the
# partition, shuts the daemons down and removes the state (the log/ folder is kept for debugging).
# Must run as root (SlurmUser=root); installs slurm-wlm and munge with apt-get when they are missing.
#
# Tunables (environment): PREDMASK_SLURM_DIR, PREDMASK_SLURM_CPUS (CPUs declared per node, default 2),
# PREDMASK_SLURM_MEM_MB (default 4000), PREDMASK_SLURM_CTLD_PORT (default 6817),
# PREDMASK_SLURM_NODE_PORT_BASE (slurmd ports base+1..base+4, default 17000),
# PREDMASK_SLURM_TIMEOUT_S (how long start waits for 4 usable nodes, default 90).
set -euo pipefail

STATE_DIR="${PREDMASK_SLURM_DIR:-/tmp/predmask-slurm}"
CONF="$STATE_DIR/slurm.conf"
NUM_NODES=4
GPUS_PER_NODE=8
PARTITION=h20
CPUS_PER_NODE="${PREDMASK_SLURM_CPUS:-2}"
MEM_PER_NODE_MB="${PREDMASK_SLURM_MEM_MB:-4000}"
CTLD_PORT="${PREDMASK_SLURM_CTLD_PORT:-6817}"
NODE_PORT_BASE="${PREDMASK_SLURM_NODE_PORT_BASE:-17000}"
START_TIMEOUT_S="${PREDMASK_SLURM_TIMEOUT_S:-90}"
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PIDFILE=/run/munge/munged.pid
export SLURM_CONF="$CONF"

log() { printf '[slurm-emulated] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

node_names() { local i; for ((i = 1; i <= NUM_NODES; i++)); do printf 'node%d\n' "$i"; done; }
node_range() { printf 'node[1-%d]' "$NUM_NODES"; }

pid_alive() {  # pid_alive <pidfile>: the pid in the file names a live process
    local pid
    [[ -s "$1" ]] || return 1
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

check_int() {  # check_int <name> <value>
    [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"
}

require_root() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (the emulated cluster runs slurmctld/slurmd as SlurmUser=root); try: sudo $0 $*"
}

ensure_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sinfo >/dev/null; then
        return 0
    fi
    command -v apt-get >/dev/null || die "slurm-wlm/munge are missing and apt-get is not available to install them"
    log "installing slurm-wlm and munge with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >&2
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

ensure_munge() {
    if munge_ok; then
        return 0
    fi
    mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
    if [[ ! -s "$MUNGE_KEY" ]]; then
        log "creating $MUNGE_KEY"
        (umask 077 && dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none)
    fi
    chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || true
    chmod 400 "$MUNGE_KEY"
    chmod 700 /etc/munge
    log "starting munged"
    if id munge >/dev/null 2>&1 && command -v runuser >/dev/null; then
        runuser -u munge -- munged
    else
        munged --force
    fi
    : >"$STATE_DIR/run/munged.ours"   # we started it, so stop may end it
    local i
    for ((i = 0; i < 50; i++)); do
        munge_ok && return 0
        sleep 0.2
    done
    die "munged started but 'munge -n | unmunge' does not succeed (see /var/log/munge/munged.log)"
}

write_file_atomic() {  # write_file_atomic <path> (content on stdin)
    local tmp
    tmp="$(mktemp "$1.XXXXXX")"
    cat >"$tmp"
    chmod 644 "$tmp"
    mv -f "$tmp" "$1"
}

write_config() {
    local host gpu_last
    host="$(hostname -s)"
    gpu_last=$((GPUS_PER_NODE - 1))
    mkdir -p "$STATE_DIR"/{ctld,run,log,dev,tmp}
    local n
    for n in $(node_names); do mkdir -p "$STATE_DIR/spool-$n"; done
    local g
    for ((g = 0; g < GPUS_PER_NODE; g++)); do : >"$STATE_DIR/dev/gpu$g"; done
    write_file_atomic "$CONF" <<EOF
# Emulated 4 x 8-GPU cluster for predmask tests; written by scripts/slurm-emulated.sh (do not edit).
ClusterName=predmask
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also delays a requeued job's restart (default 120 s); short here so requeue tests are quick
AuthInfo=cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# re-test pending jobs every 2 s (default 60 s): a requeued job becomes eligible again without an event
SchedulerParameters=sched_interval=2
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
MailProg=/bin/true
SlurmdParameters=config_overrides
StateSaveLocation=$STATE_DIR/ctld
SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdPidFile=$STATE_DIR/run/slurmd-%n.pid
SlurmdSpoolDir=$STATE_DIR/spool-%n
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
TmpFS=$STATE_DIR/tmp
NodeName=$(node_range) NodeHostname=$host Port=[$((NODE_PORT_BASE + 1))-$((NODE_PORT_BASE + NUM_NODES))] CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE_MB Gres=gpu:h20:$GPUS_PER_NODE State=UNKNOWN
PartitionName=$PARTITION Nodes=$(node_range) Default=YES MaxTime=INFINITE State=UP
EOF
    write_file_atomic "$STATE_DIR/gres.conf" <<EOF
NodeName=$(node_range) Name=gpu Type=h20 File=$STATE_DIR/dev/gpu[0-$gpu_last]
EOF
}

ctld_up() { pid_alive "$STATE_DIR/run/slurmctld.pid" && scontrol ping 2>/dev/null | grep -q "is UP"; }

# Nodes that can run jobs: registered and in a usable state (idle, or busy with jobs).
usable_nodes() {
    sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null \
        | awk '$2 ~ /^(idle|mix|mixed|alloc|allocated|comp|completing)$/ {print $1}' | sort -u | wc -l
}

down_nodes() {
    sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null \
        | awk '$2 ~ /^(down|drain|drng|drained|fail|inval|unk)/ {print $1}' | sort -u | paste -sd, -
}

start() {
    require_root start
    check_int PREDMASK_SLURM_CPUS "$CPUS_PER_NODE"
    check_int PREDMASK_SLURM_MEM_MB "$MEM_PER_NODE_MB"
    check_int PREDMASK_SLURM_TIMEOUT_S "$START_TIMEOUT_S"
    ensure_packages
    mkdir -p "$STATE_DIR/run"
    ensure_munge

    local running_ctld=0 n
    pid_alive "$STATE_DIR/run/slurmctld.pid" && running_ctld=1
    for n in $(node_names); do pid_alive "$STATE_DIR/run/slurmd-$n.pid" && running_ctld=1; done
    if ((running_ctld)) && [[ -s "$CONF" ]]; then
        log "daemons already running under $STATE_DIR: keeping their configuration"
    else
        write_config
    fi

    if ! pid_alive "$STATE_DIR/run/slurmctld.pid"; then
        log "starting slurmctld (port $CTLD_PORT)"
        slurmctld -f "$CONF"
    fi
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until ctld_up; do
        ((SECONDS < deadline)) || die "slurmctld is not UP after ${START_TIMEOUT_S}s (see $STATE_DIR/log/slurmctld.log)"
        sleep 0.5
    done
    for n in $(node_names); do
        if ! pid_alive "$STATE_DIR/run/slurmd-$n.pid"; then
            log "starting slurmd -N $n"
            slurmd -f "$CONF" -N "$n"
        fi
    done

    local down
    while (($(usable_nodes) < NUM_NODES)); do
        if ((SECONDS >= deadline)); then
            sinfo -N -p "$PARTITION" >&2 || true
            die "fewer than $NUM_NODES usable nodes after ${START_TIMEOUT_S}s (logs: $STATE_DIR/log/)"
        fi
        down="$(down_nodes)"
        if [[ -n "$down" ]]; then
            scontrol update nodename="$down" state=resume >/dev/null 2>&1 || true
        fi
        sleep 0.5
    done
    log "cluster up: $NUM_NODES nodes x $GPUS_PER_NODE GPUs, partition $PARTITION"
    sinfo -p "$PARTITION" >&2
    printf 'export SLURM_CONF=%q\n' "$CONF"
}

wait_gone() {  # wait_gone <seconds> <pidfile>...: wait until no pidfile names a live process
    local timeout=$1 f alive
    shift
    local deadline=$((SECONDS + timeout))
    while :; do
        alive=0
        for f in "$@"; do pid_alive "$f" && alive=1; done
        ((alive)) || return 0
        ((SECONDS < deadline)) || return 1
        sleep 0.3
    done
}

stop() {
    require_root stop
    local pidfiles=("$STATE_DIR/run/slurmctld.pid") n f
    for n in $(node_names); do pidfiles+=("$STATE_DIR/run/slurmd-$n.pid"); done
    if [[ -s "$CONF" ]] && ctld_up; then
        if [[ -n "$(squeue -h -p "$PARTITION" -o %i 2>/dev/null)" ]]; then
            log "cancelling the jobs of partition $PARTITION"
            scancel -p "$PARTITION" 2>/dev/null || true
            local deadline=$((SECONDS + 30))
            while [[ -n "$(squeue -h -p "$PARTITION" -o %i 2>/dev/null)" ]] && ((SECONDS < deadline)); do
                sleep 0.5
            done
        fi
        log "scontrol shutdown"
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    if ! wait_gone 20 "${pidfiles[@]}"; then
        for f in "${pidfiles[@]}"; do pid_alive "$f" && kill -TERM "$(cat "$f")" 2>/dev/null || true; done
        if ! wait_gone 10 "${pidfiles[@]}"; then
            for f in "${pidfiles[@]}"; do pid_alive "$f" && kill -KILL "$(cat "$f")" 2>/dev/null || true; done
        fi
    fi
    if [[ -e "$STATE_DIR/run/munged.ours" ]] && pid_alive "$MUNGE_PIDFILE"; then
        log "stopping the munged this script started"
        kill -TERM "$(cat "$MUNGE_PIDFILE")" 2>/dev/null || true
        wait_gone 10 "$MUNGE_PIDFILE" || true
    fi
    if [[ -d "$STATE_DIR" ]]; then
        rm -rf "$STATE_DIR"/{ctld,run,dev,tmp} "$STATE_DIR"/spool-* "$CONF" "$STATE_DIR/gres.conf"
    fi
    log "stopped (logs kept in $STATE_DIR/log/)"
}

status() {
    if [[ ! -s "$CONF" ]]; then
        log "not started (no $CONF)"
        return 3
    fi
    printf 'export SLURM_CONF=%q\n' "$CONF"
    if ! ctld_up; then
        log "slurmctld is not responding"
        return 3
    fi
    sinfo -p "$PARTITION"
    sinfo -N -p "$PARTITION" -o '%N %t %c %m %G'
    squeue -p "$PARTITION"
    (($(usable_nodes) == NUM_NODES)) || return 3
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *)
        printf 'usage: %s start|stop|status  (got: %q)\n' "$0" "${1:-}" >&2
        exit 2
        ;;
esac
