#!/usr/bin/env bash
# local-slurm.sh — a real single-node Slurm on this machine, for trying the
# examples/slurm/*.sbatch scripts and for tests/test_slurm.py.
#
#   examples/slurm/local-slurm.sh start    # as root: install if needed, configure, start, wait for the node
#   examples/slurm/local-slurm.sh status   # any user: daemons, node state; exit 0 only when usable
#   examples/slurm/local-slurm.sh stop     # as root: stop the daemons this script started
#   LOCAL_SLURM_NODES=2 examples/slurm/local-slurm.sh start   # as root: this machine as 2 Slurm nodes
# Not root? It says so and names the sudo line (sudo env VAR=... keeps the settings:
# 'sudo VAR=... cmd' is refused by sudo's default policy).
#
# What `start` does (each step is skipped when already done, so it can be run again):
#   1. installs Debian's slurm-wlm (slurmctld, slurmd, client commands) and munge
#      with apt-get when they are missing;
#   2. creates the munge key /etc/munge/munge.key when it is missing;
#   3. writes /etc/slurm/slurm.conf: Debian's slurmctld and slurmd read their
#      configuration there (compiled-in path of the Debian packages; their
#      systemd units have ConditionPathExists=/etc/slurm/slurm.conf).  The file
#      describes one node, this host's short hostname, with the CPUs and memory
#      `slurmd -C` reports, one default partition "local", select/cons_tres,
#      no accounting.  A slurm.conf this script did not write is kept as
#      slurm.conf.bak.<time>;
#   4. starts munged, slurmctld and slurmd directly as daemons (no systemd in a
#      container) and waits until `sinfo` shows the node(s) usable (idle, or
#      mix/alloc when jobs are already running).  On a timeout it fails with the
#      tail of the daemons' logs.
#
# Several nodes on one machine (LOCAL_SLURM_NODES=N): the machine's CPUs and
# memory are split evenly between N Slurm nodes, <host> and <host>-2..<host>-N,
# each served by its own slurmd (slurmd -N NAME) on its own port.  This is what
# a heterogeneous job (examples/slurm/ps-job-het.sbatch) needs: Slurm 22.05
# starts hetjobs only from its backfill scheduler, which plans whole nodes for
# each component, so two components never share one node; with one node a
# hetjob stays pending (Resources) forever.  It also lets a multi-node torchrun
# job (sbatch --nodes=2) run here.
# Checked with Slurm 22.05.8 and munge 0.5.15 (Debian 12 bookworm).
#
# State and logs: /var/lib/slurm/slurmctld and /var/lib/slurm/slurmd/<node> (under
# the Debian packages' state directories), /var/log/slurm/slurmctld.log,
# /var/log/slurm/slurmd-<node>.log, /var/log/munge/munged.log.
# The pids of the daemons this script started are kept in /run/local-slurm/;
# `stop` stops those and only those (after cancelling the jobs still queued or
# running, whose processes would otherwise outlive slurmd).
#
# Settings (environment):
#   LOCAL_SLURM_NODES     Slurm nodes to make of this machine (default: as many as
#                         the slurm.conf this script wrote last, else 1)
#   LOCAL_SLURM_TIMEOUT   seconds to wait for the node(s) in `start` (default 90)
#   LOCAL_SLURM_PROCTRACK proctrack plugin (default proctrack/linuxproc: with
#                         proctrack/cgroup every step failed here: "cgroup
#                         namespace 'freezer' not mounted" under gVisor)
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# Written by examples/slurm/local-slurm.sh"
STATE_DIR=/var/lib/slurm/slurmctld
SPOOL_BASE=/var/lib/slurm/slurmd
LOG_DIR=/var/log/slurm
CTLD_LOG=$LOG_DIR/slurmctld.log
MUNGE_KEY=/etc/munge/munge.key
MUNGE_LOG=/var/log/munge/munged.log
CTLD_PIDFILE=/run/slurmctld.pid
MUNGE_PIDFILE=/run/munge/munged.pid
OURS=/run/local-slurm
SLURMD_PORT=6818
TIMEOUT=${LOCAL_SLURM_TIMEOUT:-90}
PROCTRACK=${LOCAL_SLURM_PROCTRACK:-proctrack/linuxproc}
HOST=$(hostname -s)
# Node count: LOCAL_SLURM_NODES, else that of the slurm.conf this script wrote last, else 1.
if [[ -n ${LOCAL_SLURM_NODES:-} ]]; then
    NNODES=$LOCAL_SLURM_NODES
elif [[ -f $CONF ]] && grep -q "^$MARK" "$CONF"; then
    NNODES=$(grep -c '^NodeName=' "$CONF" || true)
else
    NNODES=1
fi

die() { echo "local-slurm: error: $*" >&2; exit 1; }
say() { echo "local-slurm: $*"; }

[[ $NNODES =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_NODES must be a positive integer (got '$NNODES')"
[[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_TIMEOUT must be a positive integer of seconds (got '$TIMEOUT')"

# The Slurm node names: this host's short name, then <host>-2 ... <host>-N.
NODES=("$HOST")
for ((i = 2; i <= NNODES; i++)); do NODES+=("$HOST-$i"); done

slurmd_pidfile() { echo "/run/slurmd-$1.pid"; }   # SlurmdPidFile=/run/slurmd-%n.pid
slurmd_log() { echo "$LOG_DIR/slurmd-$1.log"; }   # SlurmdLogFile=.../slurmd-%n.log

log_tails() {
    local f
    for f in "$CTLD_LOG" "$LOG_DIR"/slurmd-*.log "$MUNGE_LOG"; do
        if [[ -f $f ]]; then
            echo "----- last 25 lines of $f -----" >&2
            tail -n 25 "$f" >&2
        fi
    done
}

need_root() {
    [[ $EUID -eq 0 ]] && return
    local why="must run as root (it installs packages, writes $CONF and starts daemons)"
    command -v sudo >/dev/null || die "$why; no sudo here: run it as root"
    die "$why; try: sudo env LOCAL_SLURM_NODES=$NNODES $0 $1"
}

# alive PID NAME: true when PID runs a program called NAME (guards against reused pids).
alive() {
    local pid=$1 name=$2
    [[ -n $pid && -r /proc/$pid/comm ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]]
}

pid_from() { if [[ -s $1 ]]; then tr -dc '0-9' <"$1"; fi; }

munge_ok() { command -v munge >/dev/null && munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
ctld_ok() { command -v scontrol >/dev/null && timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; }
slurmd_ok() { alive "$(pid_from "$(slurmd_pidfile "$1")")" slurmd; }
any_slurmd_ok() {
    local f
    for f in /run/slurmd-*.pid /run/slurmd.pid; do
        [[ -f $f ]] && alive "$(pid_from "$f")" slurmd && return 0
    done
    return 1
}

# node_state NODE: the node's state as sinfo prints it (idle, mix, alloc, down*, drain, ...), or empty.
node_state() { timeout 10 sinfo -h -N -n "$1" -o '%t' 2>/dev/null | head -n1 || true; }

# registered_since NODE EPOCH: true when NODE's slurmd registered with slurmctld at or
# after EPOCH (a restarted slurmctld shows the nodes' saved state before that).
registered_since() {
    local t
    t=$(timeout 10 scontrol show node "$1" -o 2>/dev/null | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p')
    [[ -n $t && $t != None ]] && (($(date -d "$t" +%s 2>/dev/null || echo 0) >= $2))
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "slurm is not installed and apt-get is missing: install slurm-wlm and munge by hand"
    say "installing slurm-wlm and munge with apt-get (quiet) ..."
    local apt=(apt-get -y -q -o Dpkg::Use-Pty=0 -o Dpkg::Options::=--force-confdef
        -o Dpkg::Options::=--force-confold install --no-install-recommends slurm-wlm munge)
    local log c
    log=$(mktemp /tmp/local-slurm-apt.XXXXXX)
    # Try without `apt-get update` first (fast when the lists are fresh), then with it.
    if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" >"$log" 2>&1; then
        if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive "${apt[@]}"; } >>"$log" 2>&1; then
            tail -n 20 "$log" >&2
            die "apt-get could not install slurm-wlm and munge (full log: $log)"
        fi
    fi
    rm -f "$log"
    for c in slurmctld slurmd sbatch munged; do
        command -v "$c" >/dev/null || die "$c still missing after installing slurm-wlm and munge"
    done
}

ensure_munge_key() {
    if [[ -s $MUNGE_KEY ]]; then return; fi
    say "creating $MUNGE_KEY"
    install -d -m 0700 -o munge -g munge /etc/munge
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile="$MUNGE_KEY"
    else
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 0400 "$MUNGE_KEY"
}

# node_lines: the NodeName lines of slurm.conf, from `slurmd -C`.
node_lines() {
    local hw=$1 cpus boards sockets cores threads mem
    field() { sed -n "s/.*[[:space:]]$1=\([0-9]*\).*/\1/p" <<<"$hw"; }
    cpus=$(field CPUs); boards=$(field Boards); sockets=$(field SocketsPerBoard)
    cores=$(field CoresPerSocket); threads=$(field ThreadsPerCore); mem=$(field RealMemory)
    [[ -n $cpus && -n $cores && -n $mem ]] || die "could not parse 'slurmd -C' output: $hw"
    # Declare 2% less memory than measured: a node reporting less memory than
    # slurm.conf declares is drained ("Low RealMemory"), and the free memory a
    # container reports can move a little between runs.
    mem=$((mem * 98 / 100))
    if ((NNODES == 1)); then
        echo "NodeName=$HOST CPUs=$cpus Boards=${boards:-1} SocketsPerBoard=${sockets:-1} CoresPerSocket=$cores ThreadsPerCore=${threads:-1} RealMemory=$mem State=UNKNOWN"
        return
    fi
    ((cpus >= NNODES)) || die "LOCAL_SLURM_NODES=$NNODES but this machine has only $cpus CPUs (each node needs one)"
    # Several nodes: an even share of CPUs and memory each; all on this host
    # (NodeHostname), each slurmd on its own port.
    local i=0 n
    for n in "${NODES[@]}"; do
        echo "NodeName=$n NodeHostname=$HOST NodeAddr=$HOST Port=$((SLURMD_PORT + i)) CPUs=$((cpus / NNODES)) RealMemory=$((mem / NNODES)) State=UNKNOWN"
        i=$((i + 1))
    done
}

write_conf() {
    local hw nodes tmp
    hw=$(slurmd -C | head -n1) || die "'slurmd -C' failed (it reports this machine's hardware for slurm.conf)"
    nodes=$(node_lines "$hw")
    tmp=$(mktemp "$CONF_DIR/.slurm.conf.XXXXXX")
    cat >"$tmp" <<CONF
$MARK (it rewrites this file on every 'start').
# Slurm for the asyncsgd examples on one machine; see 'man slurm.conf' (Slurm $(slurmd -V | awk '{print $2}')).
ClusterName=asyncsgd-local
SlurmctldHost=$HOST
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# linuxproc tracks a step's processes by parent pid and needs no cgroups
# (proctrack/cgroup failed every step in this container).
ProctrackType=$PROCTRACK
TaskPlugin=task/none
# A node that went DOWN (e.g. slurmd restarted) returns to service when its
# slurmd registers again with a valid configuration.
ReturnToService=2
SlurmctldPidFile=$CTLD_PIDFILE
SlurmctldPort=6817
SlurmctldLogFile=$CTLD_LOG
SlurmctldDebug=info
StateSaveLocation=$STATE_DIR
# %n is the node's name: one pid file, spool directory and log per slurmd.
SlurmdPort=$SLURMD_PORT
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdSpoolDir=$SPOOL_BASE/%n
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmdDebug=info
# Scheduling: cores are the consumable resource; memory is not (with the
# default CR_Core_Memory every job without --mem would take its whole node).
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Hetjobs start only from the backfill scheduler: run it every 5 s (default
# 30 s) and start a hetjob as soon as all its components can start.
SchedulerParameters=bf_interval=5,bf_hetjob_immediate
# No accounting (no slurmdbd): sacct does not work; finished jobs stay visible
# to 'scontrol show job' for MinJobAge seconds.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
InactiveLimit=0
KillWait=10
SlurmctldTimeout=60
SlurmdTimeout=120
# This machine, as 'slurmd -C' describes it: $hw
$nodes
PartitionName=local Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
CONF
    chmod 0644 "$tmp"
    if [[ -f $CONF ]] && cmp -s "$CONF" "$tmp"; then
        rm -f "$tmp"
        CONF_CHANGED=0
        return
    fi
    if [[ -f $CONF ]] && ! grep -q "^$MARK" "$CONF"; then
        local bak
        bak=$CONF.bak.$(date +%Y%m%d-%H%M%S)
        say "keeping the existing $CONF (not written by this script) as $bak"
        cp -p "$CONF" "$bak"
    fi
    mv -f "$tmp" "$CONF"
    say "wrote $CONF (nodes: ${NODES[*]})"
    CONF_CHANGED=1
}

# record NAME PROGRAM PIDFILE: remember that this script started PROGRAM (pid from its pid file) as NAME.
record() {
    local name=$1 prog=$2 pidfile=$3 pid="" i
    for ((i = 0; i < 100; i++)); do
        pid=$(pid_from "$pidfile")
        alive "$pid" "$prog" && break
        sleep 0.1
    done
    alive "$pid" "$prog" || { log_tails; die "$name did not start (no live pid in $pidfile)"; }
    mkdir -p "$OURS"
    echo "$pid" >"$OURS/$name.pid"
}

start_munge() {
    if munge_ok; then return; fi
    say "starting munged"
    install -d -m 0755 -o munge -g munge /run/munge
    install -d -m 0700 -o munge -g munge /var/lib/munge
    install -d -m 0700 -o munge -g munge /var/log/munge
    # As Debian's munge.service does: run as the munge user, which owns the key.
    runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PIDFILE" ||
        { log_tails; die "munged failed to start"; }
    record munged munged "$MUNGE_PIDFILE"
    local i
    for ((i = 0; i < 50; i++)); do munge_ok && return; sleep 0.1; done
    log_tails
    die "munged runs but 'munge -n | unmunge' fails"
}

start_slurmctld() {
    if ctld_ok; then return; fi
    say "starting slurmctld"
    install -d -m 0755 -o slurm -g slurm "$STATE_DIR" "$LOG_DIR"
    # Without -D it daemonizes; it starts as root and switches to SlurmUser.
    /usr/sbin/slurmctld || { log_tails; die "slurmctld failed to start (log: $CTLD_LOG)"; }
    record slurmctld slurmctld "$CTLD_PIDFILE"
}

start_slurmds() {
    local n
    STARTED_AT=$(($(date +%s) - 1))
    STARTED=()
    for n in "${NODES[@]}"; do
        if slurmd_ok "$n"; then continue; fi
        say "starting slurmd for node $n"
        STARTED+=("$n")
        install -d -m 0755 "$SPOOL_BASE/$n"
        # -N: the node this slurmd serves (several run on this host with LOCAL_SLURM_NODES>1).
        /usr/sbin/slurmd -N "$n" || { log_tails; die "slurmd for $n failed to start (log: $(slurmd_log "$n"))"; }
        record "slurmd-$n" slurmd "$(slurmd_pidfile "$n")"
    done
}

wait_for_nodes() {
    local deadline=$((SECONDS + TIMEOUT)) n st up resumed=""
    while ((SECONDS < deadline)); do
        up=0
        for n in "${NODES[@]}"; do
            st=$(node_state "$n")
            case $st in
            idle | mix | alloc | comp | planned)
                # A slurmd started just now must also have registered.
                if [[ " ${STARTED[*]} " != *" $n "* ]] || registered_since "$n" "$STARTED_AT"; then
                    up=$((up + 1))
                fi
                ;;
            drain | drng | down | fail | inval)
                # A node left down/drained by an earlier run: resume it once.
                if [[ " $resumed " != *" $n "* ]]; then
                    say "node $n is $st; resuming it"
                    scontrol update NodeName="$n" State=RESUME 2>/dev/null || true
                    resumed+=" $n"
                fi
                ;;
            esac
        done
        if ((up == NNODES)); then
            say "Slurm is up: $(timeout 10 sinfo -h -N -o '%N %t' | tr '\n' ' ')(try: srun hostname)"
            return
        fi
        sleep 1
    done
    log_tails
    timeout 10 scontrol show node >&2 2>/dev/null || true
    die "node(s) not usable after ${TIMEOUT}s: $(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | tr '\n' ' ' || echo 'no answer from slurmctld')"
}

# stop_ours NAME PROGRAM: stop what this script started as NAME, if it still runs PROGRAM.
stop_ours() {
    local name=$1 prog=$2 rec=$OURS/$1.pid pid i
    if [[ ! -f $rec ]]; then
        say "$name: none started by this script (left alone)"
        return
    fi
    pid=$(pid_from "$rec")
    if alive "$pid" "$prog"; then
        say "stopping $name (pid $pid)"
        kill -TERM "$pid"
        for ((i = 0; i < 150; i++)); do alive "$pid" "$prog" || break; sleep 0.1; done
        if alive "$pid" "$prog"; then
            say "$name did not stop within 15 s; killing it"
            kill -KILL "$pid" || true
        fi
    else
        say "$name (pid ${pid:-?}) is no longer running"
    fi
    rm -f "$rec"
}

stop_our_slurmds() {
    local f
    for f in "$OURS"/slurmd-*.pid; do
        [[ -e $f ]] || continue
        f=${f##*/}
        stop_ours "${f%.pid}" slurmd
    done
}

cmd_start() {
    need_root start
    install_packages
    ensure_munge_key
    CONF_CHANGED=0
    write_conf
    if ((CONF_CHANGED)) && { ctld_ok || any_slurmd_ok; }; then
        # A changed slurm.conf (e.g. another LOCAL_SLURM_NODES): restart the
        # daemons so that all of them read it.
        say "slurm.conf changed; restarting slurmctld and slurmd"
        stop_our_slurmds
        [[ -f $OURS/slurmctld.pid ]] && stop_ours slurmctld slurmctld
        if ctld_ok || any_slurmd_ok; then
            die "slurm.conf changed but slurmctld/slurmd that this script did not start still run; stop them first"
        fi
    fi
    start_munge
    start_slurmctld
    start_slurmds
    wait_for_nodes
}

cmd_stop() {
    need_root stop
    local jobs
    if [[ -f $OURS/slurmctld.pid ]] && ctld_ok; then
        jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ' || true)
        if [[ -n ${jobs// /} ]]; then
            say "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs || true
            sleep 2
        fi
    fi
    stop_our_slurmds
    stop_ours slurmctld slurmctld
    stop_ours munged munged
}

# status: exit 0 when munged, slurmctld and every node's slurmd run and sinfo shows the nodes usable.
cmd_status() {
    local ok=0 n st
    who() { [[ -f $OURS/$1.pid ]] && echo " (started by this script, pid $(pid_from "$OURS/$1.pid"))"; }
    if munge_ok; then echo "munged:    running$(who munged)"; else echo "munged:    not running"; ok=1; fi
    if ctld_ok; then echo "slurmctld: running$(who slurmctld)"; else echo "slurmctld: not answering"; ok=1; fi
    for n in "${NODES[@]}"; do
        if slurmd_ok "$n"; then echo "slurmd $n: running$(who "slurmd-$n")"; else echo "slurmd $n: not running"; ok=1; fi
    done
    if ctld_ok; then
        timeout 10 sinfo -N || true
        for n in "${NODES[@]}"; do
            st=$(node_state "$n")
            [[ $st =~ ^(idle|mix|alloc|comp|planned)$ ]] || { echo "node $n: ${st:-unknown} (not usable)"; ok=1; }
        done
    fi
    return $ok
}

case ${1:-} in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
*)
    echo "usage: [LOCAL_SLURM_NODES=N] $0 start|stop|status" >&2
    exit 2
    ;;
esac
