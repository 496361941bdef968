#!/usr/bin/env bash
# A real SLURM on this machine, one node or several, for tests and development:
#
#   bash tests/cluster/local_slurm.sh up       install (if missing), configure, start; wait until every node is idle
#   GPTLAB_SLURM_NODES=2 bash tests/cluster/local_slurm.sh up
#                                       the same with 2 nodes, each in its own network namespace
#   bash tests/cluster/local_slurm.sh status   daemons, nodes and queue; exit 0 when the cluster answers
#   bash tests/cluster/local_slurm.sh down     cancel every job; stop slurmd(s), slurmctld, slurmdbd, MariaDB and
#                                       (if this script started it) munged; remove the namespaces, the
#                                       bridge and the /etc/hosts lines it made
#
# Run as root. No systemd and no cgroups: the daemons are started by hand, processes are tracked by
# walking /proc (proctrack/linuxproc) and tasks are not confined (task/none). Everything the cluster
# writes (config, state, spool, logs, pid files, fake GPU device files, the accounting database)
# lives in one folder:
# $GPTLAB_SLURM_DIR (default /var/tmp/gptlab-slurm). The clients (sinfo, sbatch, srun, and submitit,
# which calls them) find the config through /etc/slurm/slurm.conf, a symlink to that folder's file;
# an /etc/slurm/slurm.conf that this script did not write is never touched (set SLURM_CONF instead).
#
# One node (GPTLAB_SLURM_NODES=1, the default): this machine's short hostname, reached on 127.0.0.1,
# daemons in the machine's own network. Partition $GPTLAB_SLURM_PARTITION (default `local`, the
# default partition).
#
# Several nodes (GPTLAB_SLURM_NODES=N, N > 1): nodes gptlab-n1 ... gptlab-nN, each a slurmd in its own
# network namespace (named like the node) and UTS namespace (its own hostname), so that every node
# has its own address and `gethostname()` (which gloo and NCCL resolve to find a rank's address) names
# it. The addresses come from 198.18.0.0/24, the range reserved for network tests (RFC 2544), and
# every one of them is on an interface this script creates: the bridge gptlab-br0 on the host
# (198.18.0.1, the controller's address, name gptlab-ctl) and one veth per namespace (gptlab-nI has
# 198.18.0.(10+I)). `up` refuses to start when that range is already in use on this machine.
# /etc/hosts gets one line per name (marked, rewritten in place since it is often a bind mount;
# `down` removes them). The namespaces keep the machine's mounts: /tmp, the venv and munge's socket
# are shared by all nodes, as a cluster's shared file system would be. Jobs on these nodes cannot
# reach services on the host's 127.0.0.1 (each namespace has its own loopback): give such services
# (an `mlflow server`) the address 198.18.0.1 / name gptlab-ctl.
#
# What works (Debian bookworm, slurm-wlm 22.05.8, munge 0.5.15, as root, inside a container):
#   - munged as the munge user, slurmctld and slurmd in the foreground (-D) under setsid, no systemd.
#   - Several nodes: a slurmd started with `nsenter --net=/run/netns/NODE unshare --uts` (keeps the
#     host's mounts; `ip netns exec` would remount /sys and slurmd then finds no cgroup file system),
#     slurmctld under `unshare --uts` with the fixed name gptlab-ctl (it must find its own name in
#     SlurmctldHost), listening on the bridge address only (CommunicationParameters=NoCtldInAddrAny).
#     Measured: `srun -N2 -n2 hostname` 0.05 s; a 2 x 1 gloo all_reduce through srun ~3 s.
#   - 8 fake GPUs per node as generic resources: `GresTypes=gpu`, `Gres=gpu:8` on the node line, and a
#     gres.conf with AutoDetect=off and File= pointing at 8 symlinks to /dev/null. Jobs asking for
#     --gpus-per-node=8 or --gres=gpu:8 schedule, and each task sees CUDA_VISIBLE_DEVICES=0,...,7.
#     There is no GPU behind them: a job must still run on the CPU (hardware.device=cpu).
#   - 8-task jobs on a 2-core machine: each node is declared with CPUs=16 (GPTLAB_SLURM_CPUS) and
#     `SlurmdParameters=config_overrides`, so slurmd accepts a declared node bigger than the hardware.
#     SelectTypeParameters=CR_Core: memory is not a consumable resource here, so --mem is only checked
#     against the node's RealMemory (and --mem=0, "the whole node", is fine).
#   - srun / sbatch --wait / job arrays (what submitit uses), --signal=USR2@N before the time limit.
#   - Accounting, so that `sacct` works: slurmdbd on a private MariaDB (its own data folder, loopback
#     port $GPTLAB_SLURM_DB_PORT, started as a plain process). submitit learns a job's state only from
#     sacct: without it, a job that ends without writing its result file (scancel, time limit, a
#     killed task) leaves the launcher polling forever, with a warning on every poll. Measured: the
#     MariaDB + slurmdbd packages add ~30 s to a first install and ~5 s to a first `up`.
#     GPTLAB_SLURM_ACCOUNTING=0 leaves them out (then sacct fails, with the behaviour above). sacct
#     and slurmdbd are reached on the host's loopback: call sacct from the host, not from a job.
#   - Job ids go on across restarts and node-count changes (the controller's state is kept in the
#     state folder, and FirstJobId carries the next id in case that state is lost), so a reused
#     submitit folder never meets an old job's files.
#   - A lost node: SlurmdTimeout=15, so the controller marks a node whose slurmd went silent down
#     (measured: 25-35 s after its slurmd and processes were killed) and its jobs NODE_FAIL; SLURM then
#     requeues a batch job (JobRequeue left at its default, 1: submitit's `scontrol requeue` needs it).
#     `up` again brings the node back: it starts the missing slurmd, and the node returns to service
#     (ReturnToService=2; `up` also resumes a node still down).
#   - KillOnBadExit is left at SLURM's default (0), as on most real clusters: gptlab's own launchers
#     ask for it (the hydra launcher presets and launch/sbatch_gptlab.sh), and the tests check that.
# What does not (and is not attempted):
#   - No cgroups: no memory or CPU enforcement, no GPU isolation (every task sees all 8 fake GPUs).
#   - All nodes share the machine's 2 cores: many nodes make slow jobs, not fast ones.
#   - Requeue works (submitit's USR2 handler calls `scontrol requeue`), but SLURM holds a requeued job
#     ~2 minutes before it is eligible again (measured: 121 s + one scheduler pass).
#   - Plain files as GPU device files are rejected by slurmd, and a gres.conf without File= makes the
#     node invalid; that is why the fake devices are symlinks to /dev/null.
#   - Client commands are run by this script only while the cluster's network exists: with the bridge
#     gone a client once tried the controller's address through the default route, off this machine.
# Configuration knobs (environment): GPTLAB_SLURM_NODES (1), GPTLAB_SLURM_DIR, GPTLAB_SLURM_CPUS (16
# per node), GPTLAB_SLURM_GPUS (8 per node), GPTLAB_SLURM_PARTITION (local), GPTLAB_SLURM_WAIT_S (90:
# how long `up` waits for idle nodes), GPTLAB_SLURM_ACCOUNTING (1), GPTLAB_SLURM_DB_PORT (6820).
set -euo pipefail

STATE_DIR="${GPTLAB_SLURM_DIR:-/var/tmp/gptlab-slurm}"
NODES="${GPTLAB_SLURM_NODES:-1}"
CPUS="${GPTLAB_SLURM_CPUS:-16}"
GPUS="${GPTLAB_SLURM_GPUS:-8}"
PARTITION="${GPTLAB_SLURM_PARTITION:-local}"
WAIT_S="${GPTLAB_SLURM_WAIT_S:-90}"
ACCOUNTING="${GPTLAB_SLURM_ACCOUNTING:-1}"
DB_PORT="${GPTLAB_SLURM_DB_PORT:-6820}"
DBD_PORT=6819
DB_DIR="$STATE_DIR/mariadb"
CONF="$STATE_DIR/slurm.conf"
ETC_CONF=/etc/slurm/slurm.conf
LOG="$STATE_DIR/log"
RUN="$STATE_DIR/run"
NETS="$RUN/network"  # what this script made in the network: "bridge NAME" / "netns NAME" / "veth NAME" lines
MARK="# written by gptlab tests/cluster/local_slurm.sh"
HOSTS=/etc/hosts
HOSTS_MARK="# gptlab tests/cluster/local_slurm.sh"
# Several nodes: RFC 2544's test range, a bridge with the controller's address, one namespace per node.
NET=198.18.0
BRIDGE=gptlab-br0
CTL_NAME=gptlab-ctl
CTL_ADDR="$NET.1"
# The clients read $ETC_CONF (our symlink) unless the caller points SLURM_CONF elsewhere; this script
# always talks to its own cluster.
export SLURM_CONF="$CONF"

say() { echo "local_slurm: $*"; }
die() { echo "local_slurm: error: $*" >&2; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts system daemons)"; }

[[ "$NODES" =~ ^[1-9][0-9]*$ ]] && ((NODES <= 64)) || die "GPTLAB_SLURM_NODES=$NODES: give a node count from 1 to 64"
if ((NODES > 1)); then
    CTL_HOST="$CTL_NAME" CTL_IP="$CTL_ADDR"
    NODE_NAMES=() NODE_ADDRS=()
    for ((i = 1; i <= NODES; i++)); do NODE_NAMES+=("gptlab-n$i"); NODE_ADDRS+=("$NET.$((10 + i))"); done
else
    CTL_HOST="$(hostname -s)" CTL_IP=127.0.0.1
    NODE_NAMES=("$CTL_HOST") NODE_ADDRS=(127.0.0.1)
fi

# pid from a pid file if that process is alive and is the program named; empty otherwise.
alive_pid() {
    local file="$1" name="$2" pid
    [ -s "$file" ] || return 0
    pid="$(tr -dc 0-9 <"$file")"
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 0
    if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$name"; then echo "$pid"; fi
}

# Pids of every slurmd this script started (one per node, whichever layout started them).
# (slurmd.pid: the name before per-node pid files; never slurmdbd.pid)
slurmd_pid_files() { local f; for f in "$RUN"/slurmd-*.pid "$RUN"/slurmd.pid "$RUN"/slurmd.launch.pid; do [ -e "$f" ] && echo "$f"; done; }
slurmd_pids() {
    local f
    for f in $(slurmd_pid_files); do alive_pid "$f" "slurmd -D"; done | sort -u
}

install_packages() {
    local missing=()
    local cmds=(slurmctld slurmd sinfo sbatch srun scontrol munged) pkgs=(slurm-wlm munge)
    if [ "$ACCOUNTING" = 1 ]; then cmds+=(slurmdbd sacctmgr mariadbd mariadb-install-db); pkgs+=(slurmdbd mariadb-server); fi
    if ((NODES > 1)); then cmds+=(ip nsenter unshare); pkgs+=(iproute2 util-linux); fi
    for cmd in "${cmds[@]}"; do
        command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$cmd")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing ${pkgs[*]} (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # No systemd: the packages' own service starts are refused (policy-rc.d); the daemons start below.
    # Every plugin used here is in slurm-wlm-basic-plugins (a dependency); the recommended extras
    # (hdf5, rrd, ipmi, ... plugins and their -dev packages) are not needed.
    apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >"$STATE_DIR/apt.log" 2>&1 \
        || { tail -20 "$STATE_DIR/apt.log" >&2; die "apt-get install failed (log: $STATE_DIR/apt.log)"; }
}

# The next job id the controller would hand out, as far as this machine can tell (1 if none ran).
next_job_id() {
    local recorded=1 top=0 ids
    [ -s "$STATE_DIR/next_job_id" ] && recorded="$(tr -dc 0-9 <"$STATE_DIR/next_job_id")"
    if cluster_reachable && [ -n "$(alive_pid "$RUN/slurmctld.pid" slurmctld)" ]; then
        ids="$(squeue -h -r -o %A 2>/dev/null || true)"
        if [ "$ACCOUNTING" = 1 ]; then
            ids="$ids $(sacct -a -X -n -P -o JobIDRaw -S 1970-01-01T00:00:00 2>/dev/null || true)"
        fi
        top="$(echo "$ids" | tr -c '0-9' '\n' | grep -v '^$' | sort -n | tail -1 || true)"
    fi
    echo $(( ${recorded:-1} > ${top:-0} ? ${recorded:-1} : ${top:-0} + 1 ))
}

record_next_job_id() { next_job_id >"$STATE_DIR/next_job_id.tmp" && mv "$STATE_DIR/next_job_id.tmp" "$STATE_DIR/next_job_id"; }

# Writes the new config files as *.tmp next to the live ones; install_config moves them in.
write_config() {
    local real_mem
    # RealMemory as slurmd measures it, so that --mem requests are checked against the real machine.
    real_mem="$(/usr/sbin/slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
    [ -n "$real_mem" ] || real_mem=1024
    local gres="" accounting="AccountingStorageType=accounting_storage/none" comm=""
    [ "$GPUS" -gt 0 ] && gres=" Gres=gpu:$GPUS"
    if [ "$ACCOUNTING" = 1 ]; then
        accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu"
        write_dbd_config
    fi
    # The controller listens on the bridge address only, not on every address of the machine.
    ((NODES > 1)) && comm="CommunicationParameters=NoCtldInAddrAny"
    mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool" "$LOG" "$RUN" "$STATE_DIR/dev"
    # Fake GPU device files: slurmd rejects plain files, a symlink to /dev/null is a character device.
    local i node_lines=""
    for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$STATE_DIR/dev/nvidia$i"; done
    for ((i = 0; i < NODES; i++)); do
        mkdir -p "$STATE_DIR/spool/${NODE_NAMES[i]}"
        node_lines+="NodeName=${NODE_NAMES[i]} NodeAddr=${NODE_ADDRS[i]} CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$real_mem$gres State=UNKNOWN
"
    done
    local node_list
    node_list="$(IFS=,; echo "${NODE_NAMES[*]}")"
    cat >"$CONF.tmp" <<EOC
$MARK; regenerated by every \`up\`.
ClusterName=gptlab
SlurmctldHost=$CTL_HOST($CTL_IP)
$comm
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroups, no systemd: track job processes through /proc, don't confine tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Trust the node lines below over the hardware (16 declared CPUs on 2 real cores).
SlurmdParameters=config_overrides
GresTypes=gpu
JobAcctGatherType=jobacct_gather/none
$accounting
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
# A lost node (its slurmd silent) is DOWN within ~SlurmdTimeout and its jobs end NODE_FAIL, not
# after SLURM's 300 s; slurmd restarted there brings it back (ReturnToService=2).
SlurmdTimeout=15
# JobRequeue stays at SLURM's default (1), as on most clusters: submitit's scontrol requeue (USR2)
# needs it, and with it SLURM itself requeues a batch job whose node was lost (same job id).
SchedulerType=sched/backfill
# Seconds between SIGTERM and SIGKILL when a job is cancelled or hits its time limit.
KillWait=10
# Used only when the controller starts without its saved state: job ids never start over at 1.
FirstJobId=$(next_job_id)
StateSaveLocation=$STATE_DIR/state
# %n: the node's name, so that the nodes of one machine keep apart.
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
${node_lines}PartitionName=$PARTITION Nodes=$node_list Default=YES MaxTime=INFINITE State=UP
EOC
    {
        echo "$MARK"
        echo "AutoDetect=off"
        if [ "$GPUS" -gt 0 ]; then
            echo "NodeName=$node_list Name=gpu File=$STATE_DIR/dev/nvidia[0-$((GPUS - 1))]"
        fi
    } >"$STATE_DIR/gres.conf.tmp"
}

# Did the new config (the *.tmp files) change anything? FirstJobId alone does not count: it only
# matters at the controller's next start.
config_changed() {
    local f
    for f in "$CONF" "$STATE_DIR/gres.conf" "$STATE_DIR/slurmdbd.conf"; do
        [ -e "$f.tmp" ] || continue
        [ -e "$f" ] || return 0
        cmp -s <(grep -v '^FirstJobId=' "$f.tmp") <(grep -v '^FirstJobId=' "$f") || return 0
    done
    return 1
}

install_config() {
    local f
    for f in "$CONF" "$STATE_DIR/gres.conf" "$STATE_DIR/slurmdbd.conf"; do
        if [ -e "$f.tmp" ]; then mv "$f.tmp" "$f"; fi
    done
    link_etc_conf
}

discard_config() { rm -f "$CONF.tmp" "$STATE_DIR/gres.conf.tmp" "$STATE_DIR/slurmdbd.conf.tmp"; }

write_dbd_config() {
    # A password for the loopback-only database user, made once and kept with the state.
    [ -s "$STATE_DIR/db.pass" ] || (umask 077 && head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE_DIR/db.pass")
    (umask 077 && cat >"$STATE_DIR/slurmdbd.conf.tmp" <<EOC
$MARK; regenerated by every \`up\`.
AuthType=auth/munge
DbdHost=$(hostname -s)
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$STATE_DIR/db.pass")
StorageLoc=slurm_acct_db
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
EOC
)
}

link_etc_conf() {
    mkdir -p /etc/slurm
    if [ -L "$ETC_CONF" ] || [ ! -e "$ETC_CONF" ]; then
        ln -sfn "$CONF" "$ETC_CONF"
    elif ! grep -qF "$MARK" "$ETC_CONF"; then
        say "warning: $ETC_CONF exists and was not written by this script; leaving it alone."
        say "         point the clients at this cluster with: export SLURM_CONF=$CONF"
    else
        ln -sfn "$CONF" "$ETC_CONF"
    fi
}

# ---- the nodes' network (several nodes only) ------------------------------------------------------

# The controller address of the live config, and whether clients can reach it now: a config that
# puts the controller on the bridge is only usable while the bridge is up with that address.
live_ctl_addr() { [ -e "$CONF" ] && sed -n 's/^SlurmctldHost=.*(\(.*\))$/\1/p' "$CONF" | head -1; }
cluster_reachable() {
    local addr
    addr="$(live_ctl_addr)"
    [ -n "$addr" ] || return 1
    [ "$addr" = 127.0.0.1 ] && return 0
    ip -4 -o addr show dev "$BRIDGE" 2>/dev/null | grep -qF " $addr/"
}

made() { [ -e "$NETS" ] && grep -qxF "$1" "$NETS"; }
remember() { made "$1" || echo "$1" >>"$NETS"; }

hosts_remove() {
    grep -qF "$HOSTS_MARK" "$HOSTS" 2>/dev/null || return 0
    local kept
    kept="$(grep -vF "$HOSTS_MARK" "$HOSTS" || true)"
    # in place (cat >), not a new file: in a container /etc/hosts is usually a bind mount
    printf '%s\n' "$kept" | cat >"$HOSTS"
}

hosts_add() {
    local i lines
    # also the IPv4-mapped IPv6 form: a dual-stack listener (torch's rendezvous store) sees its
    # clients as ::ffff:a.b.c.d, and without these lines its reverse look-up asks DNS and warns
    lines="$(
        echo "$CTL_ADDR $CTL_NAME $HOSTS_MARK"
        for ((i = 0; i < NODES; i++)); do echo "${NODE_ADDRS[i]} ${NODE_NAMES[i]} $HOSTS_MARK"; done
        echo "::ffff:$CTL_ADDR $CTL_NAME $HOSTS_MARK"
        for ((i = 0; i < NODES; i++)); do echo "::ffff:${NODE_ADDRS[i]} ${NODE_NAMES[i]} $HOSTS_MARK"; done
    )"
    if [ "$(grep -F "$HOSTS_MARK" "$HOSTS" 2>/dev/null || true)" = "$lines" ]; then return 0; fi
    hosts_remove
    printf '%s\n' "$lines" >>"$HOSTS"
}

net_up() {
    # Refuse a range someone else uses: every address here must be on an interface made below.
    local other
    other="$( (ip -4 -o addr show; ip -4 route show) | grep -E "(^|[[:space:]])${NET//./\\.}\\." | grep -vF "$BRIDGE" || true)"
    [ -z "$other" ] || die "$NET.0/24 is already in use on this machine (not by $BRIDGE):
$other"
    mkdir -p /run/netns
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge || die "could not create the bridge $BRIDGE (ip link add ... type bridge)"
        remember "bridge $BRIDGE"
    fi
    ip addr replace "$CTL_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local i ns veth
    for ((i = 0; i < NODES; i++)); do
        ns="${NODE_NAMES[i]}" veth="gl-${NODE_NAMES[i]#gptlab-}"
        if [ ! -e "/run/netns/$ns" ]; then
            ip netns add "$ns" || die "could not create the network namespace $ns"
        fi
        remember "netns $ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            # made in the host's namespace, then the peer moved in and renamed (works where
            # `peer ... netns` at creation does not)
            ip link add "$veth" type veth peer name "${veth}p"
            ip link set "${veth}p" netns "$ns"
            ip -n "$ns" link set "${veth}p" name eth0
        fi
        remember "veth $veth"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" addr replace "${NODE_ADDRS[i]}/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
    hosts_add
}

# Every process left in a namespace this script made (job steps of a killed slurmd) is ended, then the
# namespaces (and their veths), the bridge and the /etc/hosts lines go.
net_down() {
    local kind name pids i
    if [ -e "$NETS" ]; then
        while read -r kind name; do
            [ "$kind" = netns ] && [ -e "/run/netns/$name" ] || continue
            pids="$(ip netns pids "$name" 2>/dev/null | tr '\n' ' ')"
            if [ -n "${pids// /}" ]; then
                # shellcheck disable=SC2086
                kill -TERM $pids 2>/dev/null || true
                for ((i = 0; i < 50; i++)); do [ -z "$(ip netns pids "$name" 2>/dev/null)" ] && break; sleep 0.2; done
                pids="$(ip netns pids "$name" 2>/dev/null | tr '\n' ' ')"
                # shellcheck disable=SC2086
                [ -z "${pids// /}" ] || kill -KILL $pids 2>/dev/null || true
            fi
            ip netns del "$name" 2>/dev/null || true
        done <"$NETS"
        # a namespace's veth pair goes with it, but not at once: delete the host ends here
        while read -r kind name; do
            case "$kind" in veth | bridge) ip link del "$name" 2>/dev/null || true ;; esac
        done <"$NETS"
        rm -f "$NETS"
    fi
    hosts_remove
}

# ---- daemons ----------------------------------------------------------------------------------------

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then return 0; fi
    if [ ! -s /etc/munge/munge.key ]; then
        say "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        /usr/sbin/mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    # munged refuses to run as root. setpriv execs (runuser would stay as a parent), so under setsid
    # in the foreground, $! is munged's own pid.
    setsid setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F --force >>"$LOG/munged.out" 2>&1 </dev/null &
    echo $! >"$RUN/munged.launch.pid"
    local i
    for ((i = 0; i < 50; i++)); do munge_ok && { touch "$RUN/munged.ours"; return 0; }; sleep 0.2; done
    die "munged did not start (logs: $LOG/munged.out, /var/log/munge/munged.log)"
}

db_sql() { mariadb --no-defaults --socket="$RUN/mariadb.sock" -u root "$@"; }

start_mariadb() {
    if [ -n "$(alive_pid "$RUN/mariadb.pid" mariadbd)" ]; then return 0; fi
    if [ ! -d "$DB_DIR/mysql" ]; then
        say "creating the accounting database in $DB_DIR"
        mkdir -p "$DB_DIR"
        mariadb-install-db --no-defaults --user=root --datadir="$DB_DIR" --skip-test-db \
            --auth-root-authentication-method=socket >"$LOG/mariadb-install.log" 2>&1 \
            || die "mariadb-install-db failed (log: $LOG/mariadb-install.log)"
    fi
    # Our own server, not the system's: private data folder and socket, loopback TCP for slurmdbd.
    setsid mariadbd --no-defaults --user=root --datadir="$DB_DIR" --socket="$RUN/mariadb.sock" \
        --pid-file="$RUN/mariadb.pid" --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
        --innodb-buffer-pool-size=32M --log-error="$LOG/mariadb.log" >>"$LOG/mariadb.out" 2>&1 </dev/null &
    local i
    for ((i = 0; i < 150; i++)); do
        mariadb-admin --no-defaults --socket="$RUN/mariadb.sock" -u root ping >/dev/null 2>&1 && break
        sleep 0.2
    done
    mariadb-admin --no-defaults --socket="$RUN/mariadb.sock" -u root ping >/dev/null 2>&1 \
        || die "MariaDB did not start (log: $LOG/mariadb.log)"
    local pw
    pw="$(cat "$STATE_DIR/db.pass")"
    db_sql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
        ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" \
        || die "could not create the slurm database user (log: $LOG/mariadb.log)"
}

start_slurmdbd() {
    if [ -z "$(alive_pid "$RUN/slurmdbd.pid" slurmdbd)" ]; then
        # slurmdbd reads slurmdbd.conf from the folder of $SLURM_CONF.
        setsid /usr/sbin/slurmdbd -D >>"$LOG/slurmdbd.out" 2>&1 </dev/null &
        echo $! >"$RUN/slurmdbd.launch.pid"
    fi
    local i
    for ((i = 0; i < 150; i++)); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done
    sacctmgr -n list cluster >/dev/null 2>&1 || die "slurmdbd does not answer (logs: $LOG/slurmdbd.log $LOG/slurmdbd.out)"
    if [ -z "$(sacctmgr -n -P list cluster format=cluster | grep -x gptlab)" ]; then
        sacctmgr -i add cluster gptlab >/dev/null || die "sacctmgr add cluster failed (log: $LOG/slurmdbd.log)"
    fi
}

start_slurmctld() {
    if [ -n "$(alive_pid "$RUN/slurmctld.pid" slurmctld)" ]; then return 0; fi
    # -i: ignore state that does not match a changed config instead of refusing to start.
    if ((NODES > 1)); then
        # its own UTS namespace: slurmctld must find its own name (gptlab-ctl) in SlurmctldHost
        setsid unshare --uts sh -c "hostname $CTL_NAME && exec /usr/sbin/slurmctld -D -i -f '$CONF'" \
            >>"$LOG/slurmctld.out" 2>&1 </dev/null &
    else
        setsid /usr/sbin/slurmctld -D -i -f "$CONF" >>"$LOG/slurmctld.out" 2>&1 </dev/null &
    fi
    echo $! >"$RUN/slurmctld.launch.pid"
}

start_slurmd() {
    local name i
    for ((i = 0; i < NODES; i++)); do
        name="${NODE_NAMES[i]}"
        [ -n "$(alive_pid "$RUN/slurmd-$name.pid" slurmd)" ] && continue
        if ((NODES > 1)); then
            # the node's network namespace, and a UTS namespace with the node's name; the mounts stay
            # the machine's (`ip netns exec` would remount /sys, and slurmd finds no cgroup fs there)
            setsid nsenter --net="/run/netns/$name" unshare --uts \
                sh -c "hostname $name && exec /usr/sbin/slurmd -D -N $name -f '$CONF'" \
                >>"$LOG/slurmd-$name.out" 2>&1 </dev/null &
        else
            setsid /usr/sbin/slurmd -D -N "$name" -f "$CONF" >>"$LOG/slurmd-$name.out" 2>&1 </dev/null &
        fi
        echo $! >"$RUN/slurmd-$name.launch.pid"
    done
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null; }

wait_idle() {
    local deadline=$((SECONDS + WAIT_S)) states="" name state ready resumed=" "
    while ((SECONDS < deadline)); do
        states="$(node_states)"
        ready=0
        for name in "${NODE_NAMES[@]}"; do
            state="$(awk -v n="$name" '$1 == n {print $2; exit}' <<<"$states")"
            case "$state" in
                idle* | mixed* | allocated* | completing*) ready=$((ready + 1)) ;;
                down* | drain* | fail* | inval*)
                    # After a config change a node may come back down or drained; once registered, resume it.
                    if [[ "$resumed" != *" $name "* ]]; then
                        scontrol update nodename="$name" state=resume >/dev/null 2>&1 && resumed+="$name " || true
                    fi ;;
            esac
        done
        ((ready == NODES)) && return 0
        sleep 0.5
    done
    echo "local_slurm: error: nodes not idle after ${WAIT_S}s (states: '${states:-no answer}')." >&2
    echo "  logs: $LOG/slurmctld.log $LOG/slurmd-*.log $LOG/slurmctld.out $LOG/slurmd-*.out" >&2
    tail -5 "$LOG/slurmctld.log" "$LOG"/slurmd-*.log >&2 2>/dev/null || true
    exit 1
}

cancel_all_jobs() {
    local jobs i
    cluster_reachable && [ -n "$(alive_pid "$RUN/slurmctld.pid" slurmctld)" ] || return 0
    jobs="$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')"
    [ -n "${jobs// /}" ] || return 0
    say "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for ((i = 0; i < 30; i++)); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 1; done
}

cmd_up() {
    need_root
    mkdir -p "$STATE_DIR" "$LOG" "$RUN"
    install_packages
    write_config
    local running layout_changed=0
    running="$(alive_pid "$RUN/slurmctld.pid" slurmctld)$(slurmd_pids)"
    [ "$(live_ctl_addr)" != "$CTL_IP" ] || [ "$(grep -c '^NodeName=' "$CONF" 2>/dev/null)" != "$NODES" ] && layout_changed=1
    if config_changed && [ -n "$running" ]; then
        # `scontrol reconfigure` leaves slurmd on the old node description (the node goes INVAL), so
        # a changed config restarts the daemons, stopped through the old config; jobs survive in the
        # saved state, unless the nodes themselves change (then they are cancelled first).
        if [ "$layout_changed" = 1 ]; then
            say "the nodes change (now: ${NODE_NAMES[*]}); restarting slurmctld and slurmd"
            cancel_all_jobs
        else
            say "config changed; restarting slurmctld and slurmd"
        fi
        record_next_job_id
        stop_slurm
    fi
    if [ "$layout_changed" = 1 ] || ((NODES == 1)); then net_down; fi
    if [ -n "$(alive_pid "$RUN/slurmctld.pid" slurmctld)" ]; then
        discard_config  # unchanged, and running: the live files stay as the daemons read them
        link_etc_conf
    else
        write_config  # again: FirstJobId from the id recorded above
        install_config
    fi
    ((NODES > 1)) && net_up
    start_munge
    if [ "$ACCOUNTING" = 1 ]; then start_mariadb; start_slurmdbd; fi
    start_slurmctld
    start_slurmd
    wait_idle
    if ((NODES > 1)); then
        say "up: nodes ${NODE_NAMES[*]} (${NODE_ADDRS[*]}), controller $CTL_NAME ($CTL_ADDR), partition $PARTITION, $CPUS CPUs and $GPUS fake GPUs per node; config $CONF"
    else
        say "up: node ${NODE_NAMES[0]} ($(sinfo -h -N -o %T 2>/dev/null | head -1)), partition $PARTITION, $CPUS CPUs, $GPUS fake GPUs; config $CONF"
    fi
}

stop_pid() {  # stop_pid FILE NAME: SIGTERM, wait up to 15 s, then SIGKILL
    local pid i
    pid="$(alive_pid "$1" "$2")"
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 75; i++)); do [ -d "/proc/$pid" ] || return 0; sleep 0.2; done
    say "$2 ($pid) ignored SIGTERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

stop_slurm() {
    # asks slurmctld and every slurmd to save state and exit (only through a network that exists)
    if cluster_reachable; then scontrol shutdown >/dev/null 2>&1 || true; fi
    local f
    for f in $(slurmd_pid_files); do stop_pid "$f" "slurmd -D"; done
    stop_pid "$RUN/slurmctld.pid" slurmctld
    stop_pid "$RUN/slurmctld.launch.pid" slurmctld
    rm -f $(slurmd_pid_files) "$RUN"/slurmctld*.pid
}

cmd_down() {
    need_root
    # Cancel every job so that no slurmstepd or job process outlives the cluster.
    cancel_all_jobs
    [ -e "$CONF" ] && record_next_job_id
    stop_slurm
    stop_pid "$RUN/slurmdbd.pid" slurmdbd
    stop_pid "$RUN/slurmdbd.launch.pid" slurmdbd
    stop_pid "$RUN/mariadb.pid" mariadbd
    if [ -e "$RUN/munged.ours" ]; then
        stop_pid "$RUN/munged.launch.pid" munged
        stop_pid /run/munge/munged.pid munged
        rm -f "$RUN/munged.ours"
    fi
    rm -f "$RUN"/*.pid
    net_down
    # Leave no dangling client config behind: without it `sinfo` says plainly that there is no cluster.
    if [ -L "$ETC_CONF" ] && [ "$(readlink "$ETC_CONF")" = "$CONF" ]; then rm -f "$ETC_CONF"; fi
    say "down (state and logs kept in $STATE_DIR)"
}

cmd_status() {
    local d pid rc=0 f
    for d in munged mariadb slurmdbd slurmctld; do
        pid="$(alive_pid "$RUN/$d.pid" "$d")"
        [ -n "$pid" ] || pid="$(alive_pid "$RUN/$d.launch.pid" "$d")"
        [ -n "$pid" ] || pid="$(alive_pid /run/munge/$d.pid "$d")"
        [ "$d" = mariadb ] && [ -z "$pid" ] && pid="$(alive_pid "$RUN/mariadb.pid" mariadbd)"
        if [ -n "$pid" ]; then echo "$d: running (pid $pid)"; else echo "$d: not running"; fi
    done
    local any=0
    for f in "$RUN"/slurmd-*.pid; do
        [ -e "$f" ] || continue
        case "$f" in *.launch.pid) continue ;; esac
        pid="$(alive_pid "$f" slurmd)"
        d="$(basename "$f" .pid)"
        [ -n "$pid" ] && { echo "slurmd ${d#slurmd-}: running (pid $pid)"; any=1; }
    done
    [ "$any" = 1 ] || echo "slurmd: not running"
    if [ -e "$NETS" ]; then echo "network: $(tr '\n' ' ' <"$NETS")"; fi
    if cluster_reachable && sinfo -h >/dev/null 2>&1; then
        sinfo -N -o '%N %P %T %c %m %G'
        squeue
    else
        echo "sinfo: no answer from slurmctld (config $CONF, logs $LOG)"
        rc=1
    fi
    return $rc
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status (GPTLAB_SLURM_NODES=N for N nodes)" >&2; exit 2 ;;
esac
