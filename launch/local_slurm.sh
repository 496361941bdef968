#!/usr/bin/env bash
# A real single-node SLURM on this machine, for tests and development:
#
#   bash launch/local_slurm.sh up       install (if missing), configure, start; wait until the node is idle
#   bash launch/local_slurm.sh status   daemons, node and queue; exit 0 when the cluster answers
#   bash launch/local_slurm.sh down     cancel every job; stop slurmd, slurmctld, slurmdbd, MariaDB and
#                                       (if this script started it) munged
#
# Run as root. No systemd and no cgroups: the daemons are started by hand, processes are tracked by
# walking /proc (proctrack/linuxproc) and tasks are not confined (task/none). Everything the cluster
# writes (config, state, spool, logs, pid files, fake GPU device files, the accounting database)
# lives in one folder:
# $GPTLAB_SLURM_DIR (default /var/tmp/gptlab-slurm). The clients (sinfo, sbatch, srun, and submitit,
# which calls them) find the config through /etc/slurm/slurm.conf, a symlink to that folder's file;
# an /etc/slurm/slurm.conf that this script did not write is never touched (set SLURM_CONF instead).
#
# The cluster: one node (this machine's short hostname, reached on 127.0.0.1), one partition
# ($GPTLAB_SLURM_PARTITION, default `local`, the default partition).
#
# What works (Debian bookworm, slurm-wlm 22.05.8, munge 0.5.15, as root, inside a container):
#   - munged as the munge user, slurmctld and slurmd in the foreground (-D) under setsid, no systemd.
#   - 8 fake GPUs as generic resources: `GresTypes=gpu`, `Gres=gpu:8` on the node line, and a gres.conf
#     with AutoDetect=off and File= pointing at 8 symlinks to /dev/null. Jobs asking for
#     --gpus-per-node=8 or --gres=gpu:8 schedule, and each task sees CUDA_VISIBLE_DEVICES=0,...,7.
#     There is no GPU behind them: a job must still run on the CPU (hardware.device=cpu).
#   - 8-task jobs on a 2-core machine: the node is declared with CPUs=16 (GPTLAB_SLURM_CPUS) and
#     `SlurmdParameters=config_overrides`, so slurmd accepts a declared node bigger than the hardware.
#     SelectTypeParameters=CR_Core: memory is not a consumable resource here, so --mem is only checked
#     against the node's RealMemory (and --mem=0, "the whole node", is fine).
#   - srun / sbatch --wait / job arrays (what submitit uses), --signal=USR2@N before the time limit.
#   - Accounting, so that `sacct` works: slurmdbd on a private MariaDB (its own data folder, loopback
#     port $GPTLAB_SLURM_DB_PORT, started as a plain process). submitit learns a job's state only from
#     sacct: without it, a job that ends without writing its result file (scancel, time limit, a
#     killed task) leaves the launcher polling forever, with a warning on every poll. Measured: the
#     MariaDB + slurmdbd packages add ~30 s to a first install and ~5 s to a first `up`.
#     GPTLAB_SLURM_ACCOUNTING=0 leaves them out (then sacct fails, with the behaviour above).
# What does not (and is not attempted):
#   - No cgroups: no memory or CPU enforcement, no GPU isolation (every task sees all 8 fake GPUs).
#   - One node only: a job asking for --nodes=2 is accepted but pends forever (PartitionNodeLimit);
#     multi-node runs can only be checked on a real cluster.
#   - Requeue works (submitit's USR2 handler calls `scontrol requeue`), but SLURM holds a requeued job
#     ~2 minutes before it is eligible again (measured: 121 s + one scheduler pass).
#   - Plain files as GPU device files are rejected by slurmd, and a gres.conf without File= makes the
#     node invalid; that is why the fake devices are symlinks to /dev/null.
# Configuration knobs (environment): GPTLAB_SLURM_DIR, GPTLAB_SLURM_CPUS (16), GPTLAB_SLURM_GPUS (8),
# GPTLAB_SLURM_PARTITION (local), GPTLAB_SLURM_WAIT_S (90: how long `up` waits for an idle node),
# GPTLAB_SLURM_ACCOUNTING (1), GPTLAB_SLURM_DB_PORT (6820).
set -euo pipefail

STATE_DIR="${GPTLAB_SLURM_DIR:-/var/tmp/gptlab-slurm}"
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
MARK="# written by gptlab launch/local_slurm.sh"
NODE="$(hostname -s)"
# The clients read $ETC_CONF (our symlink) unless the caller points SLURM_CONF elsewhere; this script
# always talks to its own cluster.
export SLURM_CONF="$CONF"

say() { echo "local_slurm: $*"; }
die() { echo "local_slurm: error: $*" >&2; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts system daemons)"; }

# pid from a pid file if that process is alive and is the program named; empty otherwise.
alive_pid() {
    local file="$1" name="$2" pid
    [ -s "$file" ] || return 0
    pid="$(tr -dc 0-9 <"$file")"
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 0
    if tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$name"; then echo "$pid"; fi
}

install_packages() {
    local missing=()
    local cmds=(slurmctld slurmd sinfo sbatch srun scontrol munged) pkgs=(slurm-wlm munge)
    if [ "$ACCOUNTING" = 1 ]; then cmds+=(slurmdbd sacctmgr mariadbd mariadb-install-db); pkgs+=(slurmdbd mariadb-server); fi
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

write_config() {
    local real_mem
    # RealMemory as slurmd measures it, so that --mem requests are checked against the real machine.
    real_mem="$(/usr/sbin/slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
    [ -n "$real_mem" ] || real_mem=1024
    local gres="" accounting="AccountingStorageType=accounting_storage/none"
    [ "$GPUS" -gt 0 ] && gres=" Gres=gpu:$GPUS"
    if [ "$ACCOUNTING" = 1 ]; then
        accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT"
        write_dbd_config
    fi
    mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool" "$LOG" "$RUN" "$STATE_DIR/dev"
    # Fake GPU device files: slurmd rejects plain files, a symlink to /dev/null is a character device.
    local i
    for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$STATE_DIR/dev/nvidia$i"; done
    cat >"$CONF.tmp" <<EOF
$MARK; regenerated by every \`up\`.
ClusterName=gptlab
SlurmctldHost=$NODE(127.0.0.1)
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
# Trust the node line below over the hardware (16 declared CPUs on 2 real cores).
SlurmdParameters=config_overrides
GresTypes=gpu
JobAcctGatherType=jobacct_gather/none
$accounting
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
# Seconds between SIGTERM and SIGKILL when a job is cancelled or hits its time limit.
KillWait=10
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$real_mem$gres State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    {
        echo "$MARK"
        echo "AutoDetect=off"
        if [ "$GPUS" -gt 0 ]; then
            echo "NodeName=$NODE Name=gpu File=$STATE_DIR/dev/nvidia[0-$((GPUS - 1))]"
        fi
    } >"$STATE_DIR/gres.conf.tmp"
    CONFIG_CHANGED=0
    local f
    for f in "$CONF" "$STATE_DIR/gres.conf" "$STATE_DIR/slurmdbd.conf"; do
        [ -e "$f.tmp" ] || continue
        if ! cmp -s "$f.tmp" "$f"; then CONFIG_CHANGED=1; mv "$f.tmp" "$f"; else rm -f "$f.tmp"; fi
    done
    link_etc_conf
}

write_dbd_config() {
    # A password for the loopback-only database user, made once and kept with the state.
    [ -s "$STATE_DIR/db.pass" ] || (umask 077 && head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE_DIR/db.pass")
    (umask 077 && cat >"$STATE_DIR/slurmdbd.conf.tmp" <<EOF
$MARK; regenerated by every \`up\`.
AuthType=auth/munge
DbdHost=$NODE
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
EOF
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
    setsid /usr/sbin/slurmctld -D -i -f "$CONF" >>"$LOG/slurmctld.out" 2>&1 </dev/null &
    echo $! >"$RUN/slurmctld.launch.pid"
}

start_slurmd() {
    if [ -n "$(alive_pid "$RUN/slurmd.pid" slurmd)" ]; then return 0; fi
    setsid /usr/sbin/slurmd -D -N "$NODE" -f "$CONF" >>"$LOG/slurmd.out" 2>&1 </dev/null &
    echo $! >"$RUN/slurmd.launch.pid"
}

node_state() { sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -1; }

wait_idle() {
    local deadline=$((SECONDS + WAIT_S)) state="" resumed=0
    while ((SECONDS < deadline)); do
        state="$(node_state)"
        case "$state" in
            idle | mixed | allocated | completing) return 0 ;;
            down* | drain* | fail* | inval* | unknown*)
                # After a config change the node may come back down or drained; once registered, resume it.
                if [ "$resumed" = 0 ] && [ -n "$state" ] && [ "${state#unknown}" = "$state" ]; then
                    scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 && resumed=1 || true
                fi ;;
        esac
        sleep 1
    done
    echo "local_slurm: error: node $NODE not idle after ${WAIT_S}s (state: '${state:-no answer}')." >&2
    echo "  logs: $LOG/slurmctld.log $LOG/slurmd.log $LOG/slurmctld.out $LOG/slurmd.out" >&2
    tail -5 "$LOG/slurmctld.log" "$LOG/slurmd.log" >&2 2>/dev/null || true
    exit 1
}

cmd_up() {
    need_root
    mkdir -p "$STATE_DIR" "$LOG" "$RUN"
    install_packages
    write_config
    if [ "$CONFIG_CHANGED" = 1 ] && [ -n "$(alive_pid "$RUN/slurmctld.pid" slurmctld)$(alive_pid "$RUN/slurmd.pid" slurmd)" ]; then
        # `scontrol reconfigure` leaves slurmd on the old node description (the node goes INVAL), so
        # a changed config restarts both daemons; jobs survive in the saved state.
        say "config changed; restarting slurmctld and slurmd"
        stop_slurm
    fi
    start_munge
    if [ "$ACCOUNTING" = 1 ]; then start_mariadb; start_slurmdbd; fi
    start_slurmctld
    start_slurmd
    wait_idle
    say "up: node $NODE ($(node_state)), partition $PARTITION, $CPUS CPUs, $GPUS fake GPUs; config $CONF"
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
    scontrol shutdown >/dev/null 2>&1 || true  # asks slurmctld and every slurmd to save state and exit
    stop_pid "$RUN/slurmd.pid" slurmd
    stop_pid "$RUN/slurmd.launch.pid" slurmd
    stop_pid "$RUN/slurmctld.pid" slurmctld
    stop_pid "$RUN/slurmctld.launch.pid" slurmctld
}

cmd_down() {
    need_root
    if [ -n "$(alive_pid "$RUN/slurmctld.pid" slurmctld)" ]; then
        # Cancel every job so that no slurmstepd or job process outlives the cluster.
        local jobs i
        jobs="$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')"
        if [ -n "${jobs// /}" ]; then
            say "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 30; i++)); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 1; done
        fi
    fi
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
    # Leave no dangling client config behind: without it `sinfo` says plainly that there is no cluster.
    if [ -L "$ETC_CONF" ] && [ "$(readlink "$ETC_CONF")" = "$CONF" ]; then rm -f "$ETC_CONF"; fi
    say "down (state and logs kept in $STATE_DIR)"
}

cmd_status() {
    local d pid rc=0
    for d in munged mariadb slurmdbd slurmctld slurmd; do
        pid="$(alive_pid "$RUN/$d.pid" "$d")"
        [ -n "$pid" ] || pid="$(alive_pid "$RUN/$d.launch.pid" "$d")"
        [ -n "$pid" ] || pid="$(alive_pid /run/munge/$d.pid "$d")"
        [ "$d" = mariadb ] && [ -z "$pid" ] && pid="$(alive_pid "$RUN/mariadb.pid" mariadbd)"
        if [ -n "$pid" ]; then echo "$d: running (pid $pid)"; else echo "$d: not running"; fi
    done
    if sinfo -h >/dev/null 2>&1; then
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
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
