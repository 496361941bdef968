# Sourced by .ci/with_services.sh: the team tracking server (launch/mlflow_server.sh: mlflow server on
# PostgreSQL, installed with apt when missing) for the whole session, in a fresh state folder and on a
# free port, so that it never meets a server a user runs on the default 5000. The tests reach it
# through GPTLAB_TEST_MLFLOW_URI: the SLURM sweeps log to it, as a cluster's jobs would.
# (tests/system/test_mlflow_server.py starts servers of its own: it stops and kills them.)

ci_up_mlflow_server() {
    local python="${GPTLAB_PYTHON:-.venv/bin/python}"
    # psycopg (the `server` extra) goes into $python when it lacks it: the script installs it then
    GPTLAB_CI_MLFLOW_PORT="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    GPTLAB_CI_MLFLOW_DIR="$(mktemp -d /var/tmp/gptlab-mlflow-ci.XXXXXX)"
    chmod 755 "$GPTLAB_CI_MLFLOW_DIR"  # the postgres user enters it
    export GPTLAB_CI_MLFLOW_DIR GPTLAB_CI_MLFLOW_PORT
    GPTLAB_MLFLOW_DIR="$GPTLAB_CI_MLFLOW_DIR" GPTLAB_MLFLOW_PORT="$GPTLAB_CI_MLFLOW_PORT" \
        GPTLAB_PYTHON="$python" bash launch/mlflow_server.sh up
    export GPTLAB_TEST_MLFLOW_URI="http://127.0.0.1:$GPTLAB_CI_MLFLOW_PORT"
    # the same PostgreSQL's study database (the script's STUDY_URL): searches' tests use it
    export GPTLAB_TEST_OPTUNA_URL="postgresql+psycopg://postgres@/optuna?host=$GPTLAB_CI_MLFLOW_DIR/pgsocket"
}

ci_down_mlflow_server() {
    [ -n "${GPTLAB_CI_MLFLOW_DIR:-}" ] || return 0
    GPTLAB_MLFLOW_DIR="$GPTLAB_CI_MLFLOW_DIR" GPTLAB_MLFLOW_PORT="$GPTLAB_CI_MLFLOW_PORT" \
        bash launch/mlflow_server.sh down
    rm -rf "$GPTLAB_CI_MLFLOW_DIR"
}
