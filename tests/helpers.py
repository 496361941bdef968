"""Shared test helpers: the repository's paths, tiny configs composed through Hydra's compose API
from the real conf/ tree, and the commands run as a user runs them. Test files import them from
here; conftest.py keeps only pytest's fixtures and hooks."""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import pytest
import warm_start
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import gptlab.config  # noqa: F401 - registers the schema in Hydra's ConfigStore
from gptlab.data.sources import cache_root, shakespeare_file
from gptlab.errors import GptlabError
from gptlab.ui import server_env

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
# this repository's CI copy
SHARED_SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
# gptlab's own cache (downloads), read before conftest's _isolated_cache points it elsewhere
GPTLAB_CACHE = cache_root(None)


def find_shakespeare(
    env: Mapping[str, str] = os.environ,
    shared: Path = SHARED_SHAKESPEARE,
    cache: Path = GPTLAB_CACHE,
    data=None,
) -> Path:
    """Tiny Shakespeare, found as `make train` finds it: $GPTLAB_SHAKESPEARE (the offline override),
    else ../shared/data/tinyshakespeare.txt, else gptlab's own download in its cache
    (<cache>/downloads/, fetched once from data.url and checked against data.sha256).

    data: the data section giving the URL and SHA-256 (default: conf/data/shakespeare_char.yaml's).
    Fails the test with one line saying how to point at a local copy.
    """
    how = "set GPTLAB_SHAKESPEARE=/path/to/tinyshakespeare.txt"
    override = env.get("GPTLAB_SHAKESPEARE")
    if override:
        if not Path(override).expanduser().is_file():
            pytest.fail(f"GPTLAB_SHAKESPEARE={override}: no such file; {how}", pytrace=False)
        return Path(override).expanduser()
    if shared.is_file():
        return shared
    data = dataclasses.replace(data or typed("data"), path=None)
    try:
        return shakespeare_file(data, cache)
    # offline, or a bad download: its reason without gptlab's data.path= advice
    except GptlabError as e:
        reason = str(e).split(";")[0]
    pytest.fail(f"Tiny Shakespeare is not at {shared}, and {reason}; {how}", pytrace=False)


# each list of overrides composed once per test process (Hydra reads and merges every file of the
# choices, about a fifth of a CPU-second; a copy, a fortieth of that)
_COMPOSED: Dict[Tuple[str, ...], DictConfig] = {}


def compose_config(overrides: List[str]) -> DictConfig:
    """The config `python -m gptlab.train OVERRIDES` composes (the caller's own copy)."""
    key = tuple(overrides)
    if key not in _COMPOSED:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            _COMPOSED[key] = compose(config_name="config", overrides=list(overrides))
    return copy.deepcopy(_COMPOSED[key])


def typed(section: str, *overrides: str, **changes: Any) -> Any:
    """One typed section of the composed config (conf/ gives every value), with some fields changed.

    A dict for a nested section (data's tokenizer) changes only the fields it names.
    """
    from gptlab.config import to_config

    return _replace(getattr(to_config(compose_config(list(overrides))), section), changes)


def _replace(obj: Any, changes: Dict[str, Any]) -> Any:
    nested = {
        k: _replace(getattr(obj, k), v)
        for k, v in changes.items()
        if isinstance(v, dict) and dataclasses.is_dataclass(getattr(obj, k))
    }
    return dataclasses.replace(obj, **{**changes, **nested})


def model_config(**changes: Any):
    """gpt_nano's GPTConfig with fields changed (vocab_size must be given to build a GPT)."""
    return typed("model", "model=gpt_nano", **changes)


def data_config(**changes: Any):
    """The Tiny Shakespeare data section, split into 8-way shards unless changed."""
    return typed("data", **{"shard_divisor": 8, **changes})


def nano_overrides(data_path: Path, *extra: str) -> List[str]:
    """conf/debug/smoke.yaml: a seconds-long fp32 nano run, MLflow off unless asked for."""
    return ["debug=smoke", f"data.path={data_path}", *extra]


def trained_hf_export(tmp_path: Path, shakespeare: Path, *extra: str) -> Tuple[Path, Path]:
    """A smoke run (nano_overrides with extra) trained in tmp_path/run, then exported by the
    command in this process to tmp_path/export: (the run folder, its Hugging Face GPT-2 folder)."""
    from gptlab.export import main as export
    from gptlab.train import run_training

    run_dir = tmp_path / "run"
    run_training(compose_config(nano_overrides(shakespeare, *extra)), run_dir)
    return run_dir, export([f"run={run_dir}", f"out={tmp_path / 'export'}"]) / "hf_gpt2"


def overwrite_entry(folder: Path, prefix: str, content: Optional[bytes] = None) -> Tuple[str, str]:
    """In a sharded checkpoint, overwrite the saved entry first by name of those starting with
    prefix, in place, keeping every file's size (random bytes: a bad disk block; or content, padded
    with zeros): (the entry's name, the shard file holding it)."""
    from gptlab.checkpoint.safe_dcp import read_metadata

    # storage_data: where each entry's bytes are (file, offset, length)
    stored = read_metadata(folder).storage_data.items()
    index, info = min(
        ((i, s) for i, s in stored if i.fqn.startswith(prefix)), key=lambda item: item[0].fqn
    )
    data = os.urandom(info.length) if content is None else content.ljust(info.length, b"\0")
    assert len(data) == info.length, "the content does not fit in the entry"
    with open(folder / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(data)
    return index.fqn, info.relative_path


def cli_env(env_extra=None) -> Dict[str, str]:
    """The environment a user's shell gives a command (no HYDRA_FULL_ERROR from the test run)."""
    env = {**os.environ, **(env_extra or {})}
    env.pop("HYDRA_FULL_ERROR", None)
    return env


# CI runs the suite's processes beside each other and beside the services on 2 cores: a command
# that takes 15 s alone can take several times that there, so its deadlines stretch by this factor.
SLACK = float(os.environ.get("GPTLAB_TEST_SLACK", 3 if os.environ.get("CI") == "true" else 1))


def need(problem: str) -> None:
    """Skip the test for `problem`, or fail it under CI=true (where the services must be there)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{problem} (.ci/run should have provided it)")
    pytest.skip(problem)


def slack(seconds: float) -> float:
    """A subprocess deadline of `seconds` on a quiet machine, stretched for a loaded one (SLACK)."""
    return seconds * SLACK


def run_cli(
    args: List[str], cwd: Path, timeout: float = 300, env_extra=None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run `python -m <args>` as a user would, from cwd; timeout stretched by SLACK.

    The process is forked from this test process's warm-start server (tests/warm_start.py: torch,
    MLflow and Hydra already imported); fresh=True starts a new interpreter instead.
    """
    if warm_start.enabled() and not fresh:
        return warm_start.run(args, cwd, cli_env(env_extra), slack(timeout))
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=cli_env(env_extra),
        capture_output=True,
        text=True,
        timeout=slack(timeout),
    )


def start_cli(
    args: List[str], cwd: Path, merge_stderr: bool = False, fresh: bool = False, env_extra=None,
    start_new_session: bool = False,
):  # fmt: skip
    """Start `python -m <args>` as run_cli does, without waiting (to signal it, or to start
    several): a Popen, or warm_start's equivalent."""
    env = cli_env(env_extra)
    if warm_start.enabled() and not fresh:
        return warm_start.WarmPopen(args, cwd, env, merge_stderr, start_new_session)
    return subprocess.Popen(
        [sys.executable, "-m", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
        start_new_session=start_new_session,
    )  # fmt: skip


def start_cli_logged(args: List[str], cwd: Path, log: Path, fresh: bool = False):
    """Start `python -m <args>` as start_cli does, its output (stdout and stderr) into the file log
    and in a session of its own (os.killpg(pid) ends it and anything it started)."""
    with open(log, "w") as out:
        if warm_start.enabled() and not fresh:
            return warm_start.WarmProcess(
                args, cwd, cli_env(), None, out.fileno(), out.fileno(), start_new_session=True
            )
        return subprocess.Popen(
            [sys.executable, "-m", *args], cwd=cwd, env=cli_env(), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def start_mlflow_server(store: Path, attempts: int = 3):
    """A real `mlflow server` on a free loopback port with a SQLite backend: (process, uri).

    A server that exits at start (another process took the port between its pick and the bind)
    is started again on a new port; its output is in store/server.log."""
    store.mkdir(parents=True, exist_ok=True)
    log_path = store / "server.log"
    for _attempt in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(log_path, "a") as log:
            server = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "mlflow"),
                    "server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--backend-store-uri",
                    f"sqlite:///{store / 'mlflow.db'}",
                    "--artifacts-destination",
                    str(store / "artifacts"),
                    "--workers",  # as gptlab.ui's default: MLflow's 4 each import MLflow
                    "1",
                ],
                cwd=store,
                env=server_env(),  # as gptlab.ui's: no job runner beside it
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        uri = f"http://127.0.0.1:{port}"
        # generous: a loaded 2-core machine under xdist imports mlflow slowly
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=5).read()
                return server, uri
            except OSError:
                if server.poll() is not None:
                    break
                if time.time() > deadline:
                    os.killpg(server.pid, signal.SIGTERM)
                    server.wait(timeout=30)
                    tail = log_path.read_text(errors="replace")[-2000:]
                    pytest.fail(f"mlflow server did not answer in 300 s; its log:\n{tail}")
                time.sleep(0.5)
    tail = log_path.read_text(errors="replace")[-2000:]
    pytest.fail(f"mlflow server exited at start {attempts} times; its log:\n{tail}")
