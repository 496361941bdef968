"""python -m gptlab.ui [tracking.uri=...] [tracking.experiment=...] [ui.*=...]: the MLflow UI.

It serves the MLflow UI on the runs' store.

Starts `mlflow server` on the store the runs used (the default local store outputs/mlflow.db with
its artifacts in outputs/mlartifacts, or `tracking.uri`), on 127.0.0.1 and a free port (5000 when
free), waits until it answers, and prints the URL of the experiment's runs table (MLflow 3 otherwise
opens an experiment on its GenAI overview). Ctrl-C stops it. With `tracking.uri=http://...` the
server already runs: the URL is printed and nothing is started. The console gets gptlab's lines
only: the server's own output goes to `mlflow-ui.log` beside a SQLite store's database (else to the
system's temporary folder), and a server that exits is one line naming its exit code, its last
line and that log.

On a cluster node, `ui.host=0.0.0.0` serves on every address. MLflow rejects requests whose Host
header or page origin it does not know; gptlab.ui tells it this machine's names and addresses
(`ui.allowed_hosts` and `ui.cors_allowed_origins` for others, such as a proxy's name).

The root config is conf/ui.yaml: the training config (its `tracking` section, as the runs saw it)
and the command's own keys `ui.host`, `ui.port`, `ui.workers`, `ui.allowed_hosts`,
`ui.cors_allowed_origins`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple

from hydra.core.config_store import ConfigStore

from gptlab.cli import command, text_keys
from gptlab.config import Config, to_config
from gptlab.errors import GptlabError, as_user_error
from gptlab.records.store import (
    DEFAULT_OUTPUTS,
    artifact_root,
    local_uri,
    mlflow_client,
    runs_url,
    short_reason,
    sqlite_path,
    store_failure,
)


@dataclass
class UISettings:
    """The command's own keys (values in conf/ui.yaml)."""

    host: str  # address to serve on (0.0.0.0: every address)
    port: Optional[int]  # null: 5000 when free, else a free port
    workers: int  # server worker processes
    allowed_hosts: Optional[str]  # MLflow's --allowed-hosts; null: see network_access
    cors_allowed_origins: Optional[str]  # MLflow's --cors-allowed-origins; null: see network_access


@dataclass
class UIConfig(Config):
    """The training config with the `ui` section: the schema of conf/ui.yaml."""

    ui: UISettings


ConfigStore.instance().store(name="gptlab_ui_schema", node=UIConfig)
# ui.host=..., ui.allowed_hosts=a,b:* are text as typed (cli.hydra_words)
TEXT_KEYS = text_keys(UISettings, "ui.")


def store_uri(uri: Optional[str], default_db: Path = DEFAULT_OUTPUTS / "mlflow.db") -> str:
    """The store to open; a SQLite store must exist already.

    default_db: paths.mlflow_db's SQLite file, for uri=None. A SQLite store that does not exist
    means no run has been recorded.
    """
    uri = uri or local_uri(default_db)
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise GptlabError(
            f"no MLflow store at {db}: no run has been recorded there yet "
            "(train one from this folder, or pass tracking.uri=...)"
        )
    return uri


def find_experiment(uri: str, name: Optional[str]) -> Tuple[str, str]:
    """(id, name) of experiment `name`, or of the experiment with the newest run."""
    client = mlflow_client(uri)
    if name:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            names = ", ".join(e.name for e in client.search_experiments()) or "none"
            raise GptlabError(
                f"tracking.experiment={name}: no such experiment in {uri} (there are: {names})"
            )
        return exp.experiment_id, exp.name
    exps = [
        e for e in client.search_experiments() if e.name != "Default"
    ] or client.search_experiments()
    if not exps:
        raise GptlabError(f"{uri} holds no experiment yet")
    newest = client.search_runs(
        [e.experiment_id for e in exps], order_by=["attributes.start_time DESC"], max_results=1
    )
    exp = client.get_experiment(newest[0].info.experiment_id) if newest else exps[0]
    return exp.experiment_id, exp.name


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as the server will: TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", preferred: int = 5000) -> int:
    """`preferred` when it is free, else a port the system picks (preferred=0: always that)."""
    if preferred and port_is_free(host, preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def machine_names(host: str, shown: str) -> List[str]:
    """The names and addresses this machine is reached by when serving on `host`."""
    names = {shown, socket.gethostname(), socket.getfqdn()}
    if host not in ("0.0.0.0", "::"):
        names.add(host)
    with contextlib.suppress(OSError):  # a host name that does not resolve adds nothing
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return sorted(n for n in names if n)


def network_access(host: str, port: int, shown: str) -> Tuple[Optional[str], Optional[str]]:
    """(--allowed-hosts, --cors-allowed-origins) for serving on `host`.

    MLflow answers only Host headers of localhost and private IPs, and its UI's own POST requests
    are refused (403, "Request error" in the page) from any origin but localhost. Serving on another
    address, accept this machine's names and addresses as both, keeping MLflow's default hosts."""
    if host in LOOPBACK:
        return None, None
    names = machine_names(host, shown)
    defaults = [
        "localhost",
        "127.0.0.1",
        "[::1]",
        "0.0.0.0",
        "localhost:*",
        "127.0.0.1:*",
        "[[]::1]:*",
        "0.0.0.0:*",
        "192.168.*",
        "10.*",
        *[f"172.{i}.*" for i in range(16, 32)],
        "fc00:*",
        "fd00:*",
    ]
    hosts = ",".join(defaults + [h for n in names for h in (n, f"{n}:*")])
    origins = ",".join(f"http://{n}:{port}" for n in names)
    return hosts, origins


def server_command(
    uri: str,
    host: str,
    port: int,
    workers: int,
    allowed_hosts: Optional[str] = None,
    allowed_origins: Optional[str] = None,
) -> List[str]:
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]
    if (artifacts := artifact_root(uri)) is not None:
        cmd += [
            "--default-artifact-root",
            artifacts.as_uri(),
            "--artifacts-destination",
            str(artifacts),
        ]
    if allowed_hosts:
        cmd += ["--allowed-hosts", allowed_hosts]
    if allowed_origins:
        cmd += ["--cors-allowed-origins", allowed_origins]
    return cmd + ["--uvicorn-opts", "--log-level warning"]  # no line per request


def server_env() -> dict:
    """The server's environment, without MLflow's background job runner.

    That runner (a dozen processes, for GenAI judges) is not needed for runs.
    """
    return {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get(
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"
        ),
    }


LOG_NAME = "mlflow-ui.log"


def server_log(uri: str, port: int) -> Path:
    """Where the server's own output goes: beside a SQLite store's database, else a temp folder.

    Beside the database is outputs/mlflow-ui.log by default; else the system's temporary folder. Its
    notices (security middleware, deprecations) are not gptlab's lines; its errors are read back
    from here (`last_line`).
    """
    db = sqlite_path(uri)
    return (
        db.parent / LOG_NAME
        if db is not None
        else Path(tempfile.gettempdir()) / f"gptlab-ui-{port}.log"
    )


def last_line(log: Path, start: int) -> str:
    """The last line the server wrote to its log from byte `start` on: the error that ended it.

    A traceback's last line is its exception.
    """
    try:
        with open(log, "rb") as f:
            f.seek(start)
            lines = [
                ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()
            ]
    except OSError:
        return "(its log cannot be read)"
    return lines[-1][:300] if lines else "(it wrote nothing)"


def server_ended(proc: subprocess.Popen, log: Path, start: int, when: str) -> GptlabError:
    """The one line for a server that exited: its code, its last line, and where the rest is."""
    return GptlabError(
        f"mlflow server exited with code {proc.returncode} {when}: {last_line(log, start)} (log: "
        f"{log})"
    )


def wait_until_up(proc: subprocess.Popen, url: str, timeout: float, log: Path, start: int) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise server_ended(proc, log, start, "before answering")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise GptlabError(f"mlflow server did not answer at {url} within {timeout:.0f} s (log: {log})")


def start_server(cmd: List[str], log: Path) -> Tuple[subprocess.Popen, int]:
    """Start the server in a process group of its own, appending to log.

    Returns (the server, where its output starts in log).
    """
    with open(log, "ab") as out:  # the server keeps its own copy of the file open
        start = out.tell()
        proc = subprocess.Popen(
            cmd,
            env=server_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, start


def stop(proc: subprocess.Popen) -> None:
    """The server and its workers share a process group of their own: end the whole group."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def open_store(tracking: Any, default_db: Path) -> Tuple[str, str, str]:
    """(uri, experiment id, experiment name) of the store the UI shows, or a one-line error."""
    uri = store_uri(tracking.uri, default_db)
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10).read()
        except OSError as e:
            raise GptlabError(
                f"tracking.uri={uri}: the tracking server does not answer ({short_reason(e)})"
            ) from None
    # a store that cannot be read (not a database, a failing server)
    with as_user_error(lambda e: f"MLflow {store_failure(uri, e)}"):
        exp_id, exp_name = find_experiment(uri, tracking.experiment)
    return uri, exp_id, exp_name


def run_ui(cfg: Any) -> None:
    """Serve (or point at) the runs' store until Ctrl-C. cfg: composed from conf/ui.yaml."""
    config = to_config(cfg, UIConfig)
    ui = config.ui
    uri, exp_id, exp_name = open_store(config.tracking, Path(config.paths.mlflow_db))
    if uri.startswith(("http://", "https://")):
        print(
            f"experiment {exp_name!r} on the running server {uri}:\n  {runs_url(uri, exp_id)}\n"
            f"  best val loss first, sweeps unfolded: {runs_url(uri, exp_id, best_first=True)}",
            flush=True,
        )
        return
    port = ui.port or free_port(ui.host if ui.host not in ("0.0.0.0", "::") else "0.0.0.0")
    if ui.port and not port_is_free(ui.host, port):
        raise GptlabError(
            f"ui.port={port}: already in use on {ui.host}; pick another or leave it out"
        )
    shown = socket.gethostname() if ui.host in ("0.0.0.0", "::") else ui.host
    local = f"http://{'127.0.0.1' if ui.host in ('0.0.0.0', '::') else ui.host}:{port}"
    hosts, origins = network_access(ui.host, port, shown)
    cmd = server_command(
        uri,
        ui.host,
        port,
        ui.workers,
        ui.allowed_hosts or hosts,
        ui.cors_allowed_origins or origins,
    )
    log = server_log(uri, port)
    proc, start = start_server(cmd, log)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        wait_until_up(proc, local, 120, log, start)
        server = f"http://{shown}:{port}"
        print(
            f"MLflow UI for {uri}\n"
            f"  runs of experiment {exp_name!r}: {runs_url(server, exp_id)}\n"
            f"  best val loss first, sweeps unfolded: {runs_url(server, exp_id, best_first=True)}\n"
            f"  (server pid {proc.pid}, its log {log}; Ctrl-C stops it)",
            flush=True,
        )
        proc.wait()
        raise server_ended(proc, log, start, "while serving")
    except KeyboardInterrupt:
        pass
    finally:
        stop(proc)


def main(argv: Optional[List[str]] = None) -> None:
    """python -m gptlab.ui [overrides]: a Hydra app on conf/ui.yaml that writes nothing.

    argv: overrides, to run it in this process (errors raise GptlabError).
    """
    command("ui", run_ui, argv)


if __name__ == "__main__":
    main()
