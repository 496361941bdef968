#!/usr/bin/env bash
# A tracking server for a team: `mlflow server` on its own PostgreSQL, artifacts proxied by the server.
#
#   bash launch/mlflow_server.sh up       install PostgreSQL (if missing) and psycopg (the `server`
#                                         extra), create the database cluster and the `mlflow` and
#                                         `optuna` databases (once), start both; wait until /health
#                                         answers; print the `tracking.uri=...` to give gptlab and
#                                         the `hparams_search.storage=...` of searches' studies
#   bash launch/mlflow_server.sh status   both processes and the runs held; exit 0 when /health answers
#   bash launch/mlflow_server.sh down     stop mlflow server (all its workers) and PostgreSQL, by PID;
#                                         the data stays: `up` again serves the same runs
#
# Why: the default store (a SQLite file under outputs/) is right for one person on one machine; many
# jobs writing at once need what MLflow's docs recommend for a team, a server on a real database. Jobs
# then need only the server's address: metrics, params and artifacts all go through it over HTTP
# (--artifacts-destination), so compute nodes need no shared path to the store.
#
# Everything lives in one state folder, $GPTLAB_MLFLOW_DIR (default /var/tmp/gptlab-mlflow):
#   pgdata/      the PostgreSQL database cluster (owned by the `postgres` user when run as root)
#   pgsocket/    its Unix socket: the database listens on no TCP port at all, only the server on
#                this machine reaches it (trust authentication, the socket folder closed to others)
#   artifacts/   the artifact store the server proxies ($GPTLAB_MLFLOW_ARTIFACTS to put it elsewhere)
#   log/         postgres.log, mlflow.log;  run/  mlflow.pid
#
# Environment: GPTLAB_MLFLOW_HOST (127.0.0.1; 0.0.0.0 for jobs on other machines), GPTLAB_MLFLOW_PORT
# (5000), GPTLAB_MLFLOW_DIR, GPTLAB_MLFLOW_ARTIFACTS, GPTLAB_MLFLOW_WORKERS (2: the server's worker
# processes), GPTLAB_MLFLOW_WAIT_S (180: how long `up` waits for /health), GPTLAB_MLFLOW_ALLOWED_HOSTS
# (mlflow's --allowed-hosts, when jobs reach the server by a name or address that is not local or
# private), GPTLAB_MLFLOW_HEALTHCHECK_S (60: how long uvicorn waits for a busy worker before it
# restarts it), GPTLAB_PYTHON (the Python with gptlab and mlflow; default: this checkout's .venv).
#
# What works (Debian bookworm, PostgreSQL 15, mlflow 3, psycopg 3, as root, inside a container, no
# systemd): initdb and pg_ctl as the postgres user (runuser); mlflow server started under setsid, so
# that it and its uvicorn workers are one process group that `down` stops at once. MLflow's job runner
# (GenAI jobs, several huey consumer processes, ~1 GB) is switched off: gptlab does not use it
# (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true brings it back). A first `up` takes ~20 s (MLflow creates
# its schema); later ones ~10 s.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE_DIR="${GPTLAB_MLFLOW_DIR:-/var/tmp/gptlab-mlflow}"
HOST="${GPTLAB_MLFLOW_HOST:-127.0.0.1}"
PORT="${GPTLAB_MLFLOW_PORT:-5000}"
WORKERS="${GPTLAB_MLFLOW_WORKERS:-2}"
WAIT_S="${GPTLAB_MLFLOW_WAIT_S:-180}"
ARTIFACTS="${GPTLAB_MLFLOW_ARTIFACTS:-$STATE_DIR/artifacts}"
ALLOWED_HOSTS="${GPTLAB_MLFLOW_ALLOWED_HOSTS:-}"
PGDATA="$STATE_DIR/pgdata"
SOCK="$STATE_DIR/pgsocket"
LOG="$STATE_DIR/log"
RUN="$STATE_DIR/run"
DB=mlflow
STUDY_DB=optuna  # hyperparameter searches' studies (hparams_search.storage), beside the runs
PG_USER=postgres  # the database role (and, as root, the system user that runs the cluster)

say() { echo "mlflow_server: $*"; }
die() { echo "mlflow_server: error: $*" >&2; exit 1; }

if [ -n "${GPTLAB_PYTHON:-}" ]; then
    PY="$GPTLAB_PYTHON"
elif [ -x "$REPO/.venv/bin/python" ]; then
    PY="$REPO/.venv/bin/python"
else
    PY="$(command -v python3 || true)"
fi
# absolute (the server starts from the state folder), but not resolved: a venv's python is a symlink
case "$PY" in
    /*) ;;
    */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;;
    ?*) PY="$(command -v "$PY" || echo "$PY")" ;;
esac
[[ "$PORT" =~ ^[0-9]+$ ]] && ((PORT > 0 && PORT < 65536)) || die "GPTLAB_MLFLOW_PORT=$PORT: give a TCP port"

# What jobs give gptlab: the host as jobs reach it (this machine's name when the server listens on all).
client_host() {
    case "$HOST" in
        0.0.0.0 | "::" | "[::]") hostname -f 2>/dev/null || hostname ;;
        *) echo "$HOST" ;;
    esac
}
URI="http://$(client_host):$PORT"
BACKEND="postgresql+psycopg://$PG_USER@/$DB?host=$SOCK"
STUDY_URL="postgresql+psycopg://$PG_USER@/$STUDY_DB?host=$SOCK"

# ---- PostgreSQL -----------------------------------------------------------------------------------

pg_bin() {  # the newest installed PostgreSQL's bin folder (Debian keeps them under /usr/lib/postgresql)
    local d
    d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)"
    if [ -n "$d" ] && [ -x "$d/initdb" ]; then echo "$d"; return; fi
    d="$(dirname "$(command -v initdb 2>/dev/null || echo /nonexistent/initdb)")"
    if [ -x "$d/initdb" ]; then echo "$d"; fi
}

install_postgres() {
    [ -n "$(pg_bin)" ] && return 0
    [ "$(id -u)" = 0 ] || die "PostgreSQL is not installed; as root this script installs it (apt-get install postgresql)"
    command -v apt-get >/dev/null 2>&1 || die "PostgreSQL is not installed and there is no apt-get to install it"
    say "installing PostgreSQL (apt-get install postgresql)"
    mkdir -p "$LOG"
    export DEBIAN_FRONTEND=noninteractive
    # No systemd: the package's own cluster and service start are not used (policy-rc.d refuses them);
    # this script runs its own cluster in $PGDATA.
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql; } >"$LOG/apt.log" 2>&1 \
        || { tail -20 "$LOG/apt.log" >&2; die "apt-get install postgresql failed (log: $LOG/apt.log)"; }
    [ -n "$(pg_bin)" ] || die "postgresql installed, but no initdb under /usr/lib/postgresql/*/bin"
}

# Runs a PostgreSQL program as the cluster's owner: the postgres user when we are root (PostgreSQL
# refuses to run as root), else ourselves.
as_pg() {
    if [ "$(id -u)" = 0 ]; then
        (cd / && runuser -u "$PG_USER" -- "$@")
    else
        "$@"
    fi
}

pg_pid() {  # the postmaster's pid when it runs on $PGDATA; empty otherwise
    local pid
    [ -s "$PGDATA/postmaster.pid" ] || return 0
    pid="$(head -1 "$PGDATA/postmaster.pid" | tr -dc 0-9)"
    [ -n "$pid" ] && live "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "postgres" && echo "$pid"
    return 0
}

prepare_folders() {
    mkdir -p "$STATE_DIR" "$LOG" "$RUN" "$ARTIFACTS" "$PGDATA" "$SOCK"
    if [ "$(id -u)" = 0 ]; then
        id "$PG_USER" >/dev/null 2>&1 || die "no '$PG_USER' user (the postgresql package makes it)"
        chown "$PG_USER:" "$PGDATA" "$SOCK"
        as_pg test -x "$STATE_DIR" -a -w "$PGDATA" \
            || die "the $PG_USER user cannot reach $STATE_DIR (a parent folder closed to other users?): choose a GPTLAB_MLFLOW_DIR it can enter, e.g. under /var/tmp"
        touch "$LOG/postgres.log" && chown "$PG_USER:" "$LOG/postgres.log"
    fi
    chmod 700 "$PGDATA" "$SOCK"
    # a Unix socket's path holds at most 107 bytes
    ((${#SOCK} + 15 < 107)) || die "GPTLAB_MLFLOW_DIR=$STATE_DIR is too long for PostgreSQL's socket path; choose a shorter one"
}

start_postgres() {
    local bin
    bin="$(pg_bin)"
    if [ ! -s "$PGDATA/PG_VERSION" ]; then
        say "creating the database cluster in $PGDATA"
        as_pg "$bin/initdb" -D "$PGDATA" -A trust -U "$PG_USER" -E UTF8 >"$LOG/initdb.log" 2>&1 \
            || { tail -5 "$LOG/initdb.log" >&2; die "initdb failed (log: $LOG/initdb.log)"; }
    fi
    if [ -z "$(pg_pid)" ]; then
        # listen_addresses='': the Unix socket in $SOCK only, no TCP port to collide with or to expose
        as_pg "$bin/pg_ctl" -D "$PGDATA" -l "$LOG/postgres.log" -w -t 60 \
            -o "-c listen_addresses='' -k $SOCK" start >"$LOG/pg_ctl.log" 2>&1 \
            || { tail -5 "$LOG/postgres.log" >&2; die "PostgreSQL did not start (log: $LOG/postgres.log)"; }
    fi
    local db
    for db in "$DB" "$STUDY_DB"; do
        if [ "$(as_pg "$bin/psql" -h "$SOCK" -U "$PG_USER" -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
            as_pg "$bin/createdb" -h "$SOCK" -U "$PG_USER" "$db" || die "createdb $db failed (log: $LOG/postgres.log)"
        fi
    done
}

stop_postgres() {
    local bin pid
    pid="$(pg_pid)"
    [ -n "$pid" ] || return 0
    bin="$(pg_bin)"
    # fast: roll back open transactions and stop at once (a smart stop would wait for the server's
    # connection pool, which never closes by itself)
    as_pg "$bin/pg_ctl" -D "$PGDATA" -m fast -w -t 60 stop >"$LOG/pg_ctl.log" 2>&1 || true
    stop_pid "$pid" postgres
}

# ---- mlflow server --------------------------------------------------------------------------------

live() {  # is the process alive (a zombie, waiting for a parent that does not reap it, is not)
    local state
    state="$(ps -o stat= -p "$1" 2>/dev/null || true)"
    [ -n "$state" ] && [[ "$state" != Z* ]]
}

group_pids() {  # the live processes of process group $1
    [[ "$1" =~ ^[1-9][0-9]*$ ]] || return 0
    ps -e -o pid= -o pgid= -o stat= | awk -v g="$1" '$2 == g && $3 !~ /^Z/ {print $1}'
}

mlflow_pid() {  # the server's pid (its process group) when it runs; empty otherwise
    local pid
    [ -s "$RUN/mlflow.pid" ] || return 0
    pid="$(tr -dc 0-9 <"$RUN/mlflow.pid")"
    [ -n "$pid" ] && live "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "mlflow" && echo "$pid"
    return 0
}

# Where this machine reaches the server: loopback when it listens there or on every address.
case "$HOST" in
    127.0.0.1 | localhost | 0.0.0.0 | "::" | "[::]") LOCAL_URL="http://127.0.0.1:$PORT" LOCAL_ADDR=127.0.0.1 ;;
    *) LOCAL_URL="http://$HOST:$PORT" LOCAL_ADDR="$HOST" ;;
esac

healthy() {
    "$PY" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1] + '/health', timeout=5).read()" "$LOCAL_URL" \
        >/dev/null 2>&1
}

port_taken() { (exec 3<>"/dev/tcp/$LOCAL_ADDR/$PORT") 2>/dev/null; }

install_psycopg() {
    [ -x "$PY" ] || die "no Python with mlflow (set GPTLAB_PYTHON, or run make setup)"
    has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)" "$1" 2>/dev/null; }
    has mlflow || die "$PY has no mlflow (set GPTLAB_PYTHON to gptlab's Python, or run make setup)"
    has psycopg && return 0
    # the `server` extra's packages as pyproject.toml lists them (only those: gptlab is installed already)
    local specs
    specs="$("$PY" -c 'import sys, tomllib; print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["server"]))' \
        "$REPO/pyproject.toml" 2>/dev/null || echo "psycopg[binary]")"
    say "installing the server extra into $PY: $specs"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q $specs >"$LOG/pip.log" 2>&1 \
        || { tail -5 "$LOG/pip.log" >&2; die "pip install $specs failed (log: $LOG/pip.log)"; }
}

start_mlflow() {
    [ -n "$(mlflow_pid)" ] && return 0
    port_taken && die "port $PORT is taken by another program: choose another GPTLAB_MLFLOW_PORT"
    local extra=()
    [ -n "$ALLOWED_HOSTS" ] && extra+=(--allowed-hosts "$ALLOWED_HOSTS")
    # uvicorn's supervisor kills a worker that misses a 5 s health ping, and a restarted worker
    # (importing mlflow: seconds of CPU) misses the next one on a busy machine: measured, 16 runs
    # training beside the server kept its workers dying and restarting for an hour (578 of 3200
    # points recorded). A minute is a hang, not a busy spell.
    ((WORKERS > 1)) && extra+=(--uvicorn-opts "--timeout-worker-healthcheck ${GPTLAB_MLFLOW_HEALTHCHECK_S:-60}")
    # setsid: the server and its uvicorn workers are one process group (its pid), stopped at once
    (
        cd "$STATE_DIR"
        export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
        exec setsid "$PY" -m mlflow server --backend-store-uri "$BACKEND" --artifacts-destination "$ARTIFACTS" \
            --host "$HOST" --port "$PORT" --workers "$WORKERS" "${extra[@]}" >>"$LOG/mlflow.log" 2>&1 </dev/null
    ) &
    echo $! >"$RUN/mlflow.pid"
}

wait_healthy() {
    local deadline=$((SECONDS + WAIT_S))
    while ((SECONDS < deadline)); do
        healthy && return 0
        [ -n "$(mlflow_pid)" ] || { tail -15 "$LOG/mlflow.log" >&2; die "mlflow server exited (log: $LOG/mlflow.log)"; }
        sleep 0.5
    done
    tail -15 "$LOG/mlflow.log" >&2
    die "mlflow server does not answer $URI/health after ${WAIT_S}s (log: $LOG/mlflow.log)"
}

stop_pid() {  # stop_pid PID NAME: SIGTERM, wait up to 30 s, then SIGKILL
    local i
    live "$1" || return 0
    kill -TERM "$1" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do live "$1" || return 0; sleep 0.2; done
    say "$2 ($1) ignored SIGTERM; killing it"
    kill -KILL "$1" 2>/dev/null || true
}

saved_pid() {  # the pid the last `up` recorded for the server (alive or not)
    if [ -s "$RUN/mlflow.pid" ]; then tr -dc 0-9 <"$RUN/mlflow.pid"; fi
}

stop_mlflow() {
    local pid i
    pid="$(saved_pid)"
    [ -n "$pid" ] || return 0
    [ -n "$(group_pids "$pid")" ] || { rm -f "$RUN/mlflow.pid"; return 0; }
    # the whole group: the server and every worker (a worker alone would keep the port)
    kill -TERM -- "-$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do [ -z "$(group_pids "$pid")" ] && break; sleep 0.2; done
    if [ -n "$(group_pids "$pid")" ]; then
        say "mlflow server ($pid) did not stop on SIGTERM; killing its processes"
        kill -KILL -- "-$pid" 2>/dev/null || true
        sleep 0.5
    fi
    rm -f "$RUN/mlflow.pid"
}

runs_held() {  # "N experiments, M runs" in the database, when PostgreSQL answers
    local bin
    bin="$(pg_bin)"
    [ -n "$bin" ] && [ -n "$(pg_pid)" ] || return 0
    as_pg "$bin/psql" -h "$SOCK" -U "$PG_USER" -d "$DB" -tA -F ' ' \
        -c "SELECT (SELECT count(*) FROM experiments), (SELECT count(*) FROM runs)" 2>/dev/null \
        | awk '{print $1 " experiments, " $2 " runs"}' || true
}

# ---- commands -------------------------------------------------------------------------------------

cmd_up() {
    mkdir -p "$STATE_DIR" "$LOG" "$RUN"
    install_postgres
    install_psycopg
    prepare_folders
    start_postgres
    start_mlflow
    wait_healthy
    say "up: mlflow server (pid $(mlflow_pid), $WORKERS workers) on $HOST:$PORT, PostgreSQL (pid $(pg_pid)) in $PGDATA, artifacts in $ARTIFACTS; logs in $LOG"
    say "use: tracking.uri=$URI"
    say "searches on this machine: hparams_search.storage='$STUDY_URL'"
}

cmd_down() {
    local server pg left
    server="$(saved_pid)" pg="$(pg_pid)"
    stop_mlflow
    stop_postgres
    left="$(group_pids "$server" | tr '\n' ' ')"
    if [ -n "$pg" ] && live "$pg"; then left+=" $pg"; fi
    [ -z "${left// /}" ] || die "processes still running: $left"
    say "down (data kept in $STATE_DIR: \`up\` again serves the same runs)"
}

cmd_status() {
    local pid rc=0
    pid="$(pg_pid)"
    if [ -n "$pid" ]; then echo "postgres: running (pid $pid, data $PGDATA)"; else echo "postgres: not running"; fi
    pid="$(mlflow_pid)"
    if [ -n "$pid" ]; then
        echo "mlflow server: running (pid $pid, $(group_pids "$pid" | wc -l) processes, port $PORT)"
    else
        echo "mlflow server: not running"
    fi
    if healthy; then
        echo "health: ok ($URI/health)"
        local held
        held="$(runs_held)"
        [ -n "$held" ] && echo "database: $held"
        echo "use: tracking.uri=$URI"
        echo "searches on this machine: hparams_search.storage='$STUDY_URL'"
    else
        echo "health: no answer from $URI/health"
        rc=1
    fi
    return $rc
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status (GPTLAB_MLFLOW_HOST, GPTLAB_MLFLOW_PORT, GPTLAB_MLFLOW_DIR)" >&2; exit 2 ;;
esac
