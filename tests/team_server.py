"""The team tracking server in tests: launch/mlflow_server.sh (mlflow server on PostgreSQL) driven
from Python, and the session's server that .ci/setup.d/mlflow_server.sh starts
(GPTLAB_TEST_MLFLOW_URI).

Without what a test needs, the test is skipped, except in CI (CI=true), where that is a failure.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "mlflow_server.sh"
SESSION_URI = "GPTLAB_TEST_MLFLOW_URI"  # exported by .ci/setup.d/mlflow_server.sh


def session_server_uri() -> Optional[str]:
    """The session's team server (http://127.0.0.1:PORT), or None when this session has none
    (fails under CI)."""
    uri = os.environ.get(SESSION_URI)
    if not uri and os.environ.get("CI") == "true":
        pytest.fail(
            f"{SESSION_URI} is not set: .ci/setup.d/mlflow_server.sh starts the team server for CI"
        )
    return uri


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_pids(pgid: Optional[int] = None, parent: Optional[int] = None) -> List[int]:
    """Live (not zombie) processes of a process group, or a process's children."""
    out = subprocess.run(
        ["ps", "-e", "-o", "pid=,ppid=,pgid=,stat="], capture_output=True, text=True
    ).stdout
    found = []
    for line in out.splitlines():
        pid, ppid, group, stat = line.split()[:4]
        if stat.startswith("Z"):
            continue
        if (pgid is not None and int(group) == pgid) or (
            parent is not None and int(ppid) == parent
        ):
            found.append(int(pid))
    return found


def alive(pid: int) -> bool:
    out = subprocess.run(
        ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True
    ).stdout.strip()
    return bool(out) and not out.startswith("Z")


@dataclass
class ScriptServer:
    """A server started by launch/mlflow_server.sh in its own state folder, on its own port."""

    state: Path
    port: int

    @classmethod
    def fresh(cls) -> "ScriptServer":
        # under /var/tmp: the postgres user must enter the folder (pytest's tmp_path is closed to
        # it)
        return cls(Path("/var/tmp") / f"gptlab-test-mlflow-{uuid.uuid4().hex[:8]}", free_port())

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> Dict[str, str]:
        return {
            **os.environ,
            "GPTLAB_MLFLOW_DIR": str(self.state),
            "GPTLAB_MLFLOW_PORT": str(self.port),
        }

    def run(self, command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SCRIPT), command],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def up(self) -> str:
        r = self.run("up")
        assert r.returncode == 0, f"mlflow_server.sh up failed:\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def down(self) -> str:
        r = self.run("down", timeout=180)
        assert r.returncode == 0, f"mlflow_server.sh down failed:\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def server_pid(self) -> int:
        return int((self.state / "run" / "mlflow.pid").read_text().strip())

    def postmaster_pid(self) -> int:
        return int((self.state / "pgdata" / "postmaster.pid").read_text().split()[0])

    def pids(self) -> List[int]:
        """Every live process of the server: mlflow's group (the server, its workers) and
        PostgreSQL's."""
        server, pg = self.server_pid(), self.postmaster_pid()
        return sorted(
            {*live_pids(pgid=server), *([pg] if alive(pg) else []), *live_pids(parent=pg)}
        )

    def signal(self, sig: int) -> None:
        """sig to the mlflow server and all its workers (its process group)."""
        os.killpg(self.server_pid(), sig)

    def remove(self) -> None:
        shutil.rmtree(self.state, ignore_errors=True)

    @staticmethod
    def problem() -> Optional[str]:
        """Why this machine cannot run the script's server, or None."""
        if glob.glob("/usr/lib/postgresql/*/bin/initdb") or shutil.which("initdb"):
            return None
        if os.geteuid() == 0 and shutil.which("apt-get"):
            return None  # the script installs PostgreSQL
        return (
            "PostgreSQL is not installed, and launch/mlflow_server.sh installs it only as root "
            "with apt-get"
        )


def stop_group(pgid: int) -> None:
    """End what is left of a process group a test started (nothing when it is gone)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
