"""Records: the run folder (always) and MLflow (when reachable), written by rank 0 only.

Other ranks get ``NullTracker``, so the training loop calls the same methods everywhere and never
branches on whether logging is on. A tracking store that is down or fails never stops training: the
tracker warns once, stops using MLflow, and the run folder still gets everything. The optional parts
(system metrics, TensorBoard, the loss plot) each say in one line what is missing and are skipped.

A run folder inside a sweep folder that holds ``sweep.json`` (written by ``gptlab.sweep`` when a
multirun starts) becomes a child of that sweep's MLflow parent run, whatever launcher ran it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from gptlab.errors import GptlabError

log = logging.getLogger(__name__)

METRIC_NAMES = {  # flat run-folder key -> MLflow name, grouped by prefix so runs overlay in the UI
    "train_loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "opt/lr",
    "grad_norm": "opt/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "tokens": "tokens",
}
SUMMARY_METRICS = {  # results.json key -> MLflow metric logged once at the end (sortable in the runs table)
    "best_val_loss": "summary/best_val_loss",
    "val_loss": "summary/val_loss",
    "train_loss": "summary/train_loss",
    "tokens_per_s": "summary/tokens_per_s",
    "mfu": "summary/mfu",
    "wall_s": "summary/wall_s",
}
SWEEP_FILE = "sweep.json"  # in a sweep folder: the MLflow parent run its jobs nest under
SWEEP_KIND = "gptlab-sweep"  # sweep.json's "kind"
PARENT_TAG = "mlflow.parentRunId"  # what MLflow (and its UI) uses to nest a run under another
LOSS_PLOT = "loss.png"
DERIVED_FILE = "derived.json"  # the run's derived figures (accumulation steps, FLOPs per token, ...)
SQLITE_PREFIX = "sqlite:///"  # a SQLite store's URI is this and the path of its database file
NAME_TAGS = ("model", "data", "hardware")  # the run tags run_name() is made of


@dataclass
class TrackingConfig:
    mlflow: bool  # false: only the run folder is written
    uri: Optional[str]  # null: the local store sqlite:///<cwd>/outputs/mlflow.db
    experiment: Optional[str]  # null: "<model>-<data>"
    run_name: Optional[str]  # null: "<model>-<data>-<hardware>" (+ the job's overrides in a sweep)
    flush_every: int  # metric points buffered before one batched MLflow call
    system_metrics: bool  # CPU, memory, disk, network (+ GPU with nvidia-ml-py) as system/* metrics
    tensorboard: bool  # also write TensorBoard event files to <run folder>/tensorboard
    plots: bool  # loss.png (train/val loss and lr against tokens) at the end of the run


def run_name(model: str, data: str, hardware: str) -> str:
    """A run's default name: `<model>-<data>-<hardware>`."""
    return f"{model}-{data}-{hardware}"


def experiment_name(model: str, data: str) -> str:
    """The default MLflow experiment of a run: `<model>-<data>` (runs on other hardware compare there)."""
    return f"{model}-{data}"


def default_uri(outputs: Path) -> str:
    return f"{SQLITE_PREFIX}{outputs.resolve() / 'mlflow.db'}"


# The schemes of the stores MLflow itself has (a plain path is a folder store); packages add theirs
# through the entry points MLflow reads (STORE_PLUGINS)
STORE_SCHEMES = (
    "", "file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc",
)  # fmt: skip
STORE_PLUGINS = "mlflow.tracking_store"


def check_uri(uri: Optional[str]) -> None:
    """Raise GptlabError when uri's scheme is none that MLflow stores runs in (a typo: `htp://...`).

    Read from the uri alone, without opening the store: config validation calls it before anything
    runs, so a mistyped store is one line at the start rather than a run (or a sweep) that goes
    unrecorded. MLflow's own message for it speaks of the model registry.
    """
    if uri is None:
        return
    from importlib.metadata import entry_points

    scheme = urllib.parse.urlparse(uri).scheme.lower()
    base = "" if len(scheme) == 1 else scheme.split("+")[0]  # a Windows drive; postgresql+psycopg2 is postgresql
    if base in STORE_SCHEMES or base in {e.name for e in entry_points(group=STORE_PLUGINS)}:
        return
    raise GptlabError(
        f"tracking.uri={uri}: {scheme!r} is not a scheme MLflow knows; give a folder path, "
        "sqlite:///path/to/mlflow.db, http(s)://host:port (a server) or postgresql://user@host/db, "
        "or leave it out for the local store outputs/mlflow.db"
    )


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a SQLite store's URI; None for any other store."""
    return Path(uri[len(SQLITE_PREFIX) :]) if uri.startswith(SQLITE_PREFIX) else None


def artifact_root(uri: str) -> Optional[Path]:
    """Artifacts of a SQLite store live next to the database file (outputs/mlartifacts by default)."""
    db = sqlite_path(uri)
    return db.parent / "mlartifacts" if db is not None else None  # a server stores (or proxies) its own


LOCKED_RETRIES = 8  # tries of a SQLite call that finds the database locked (backoff 0.1 s doubling, to 3 s)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock on `<db>.lock` beside a SQLite store's database file (nothing for other stores).

    MLflow creates and migrates a SQLite store on a process's first connection to it; processes that
    do so at once race (`table ... already exists`, `Online migration expected to match one row`) and
    lose their runs. Every first connection is made under this lock, so they do it one at a time.
    """
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    import fcntl

    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "a") as lock:  # closing it releases the lock, whatever happens inside
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def retry_locked(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """call(*args, **kwargs), tried again with backoff while SQLite answers `database is locked`.

    SQLite waits for a busy database, but gives up at once when two writers would deadlock; the
    transaction is rolled back then, so trying it again records it once.
    """
    for attempt in range(LOCKED_RETRIES):
        try:
            return call(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - MLflow wraps SQLAlchemy's OperationalError
            if "database is locked" not in str(e) or attempt == LOCKED_RETRIES - 1:
                raise
            time.sleep(min(0.1 * 2**attempt, 3.0) * random.uniform(0.5, 1.5))
    raise AssertionError("unreachable")


class RetryingClient:
    """An MlflowClient on a SQLite store whose every call is made through retry_locked."""

    def __init__(self, client: Any):
        self.client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        return functools.partial(retry_locked, attr) if callable(attr) else attr


def mlflow_client(uri: str) -> Any:
    """An MlflowClient on the store at uri that gives up on a down server in seconds, not minutes.

    Every place that opens a store uses this one: a SQLite store is created (and migrated) under
    store_lock, and its calls are retried while the database is locked, so concurrent runs on one
    fresh store are all recorded.
    """
    # MLflow's HTTP client retries for minutes by default (7 retries, 120 s timeout); a down server
    # should cost one call at most 3 x 15 s plus 2 s of backoff. The tracker's Sender tries again
    # itself, on its own thread, so this bounds how long one of its tries waits.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    # MLflow's own INFO lines (creating and migrating a new store) are not the run's: warnings only,
    # read when mlflow is first imported (MLFLOW_LOGGING_LEVEL=INFO brings them back)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    # nor are the "View run ... at: URL" lines it writes to stdout when a server's run ends: gptlab
    # says where a run is itself, and sync's stdout is one line per folder
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # nor urllib3's line for each of MLflow's HTTP retries: gptlab says once that a server does not
    # answer. They are warnings, which reach the console through the root logger: Hydra's launcher
    # gives it a handler at INFO in the process that launches a sweep (where the sweep callback opens
    # the store), and gptlab's job logging one at WARNING
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    from mlflow.tracking import MlflowClient

    if sqlite_path(uri) is None:
        return MlflowClient(tracking_uri=uri)
    with store_lock(uri):  # MlflowClient() connects: it creates, migrates and checks the store
        return RetryingClient(retry_locked(MlflowClient, tracking_uri=uri))


REACHABLE_TRIES = 3  # /health asked this many times, 10 s each, 2 s apart, before a server counts as down


class Unreachable(ConnectionError):
    """A tracking server that does not answer; the message names it and says why in a few words."""


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\"()<>\[\]]+)")  # the OS's reason inside a library's message


def short_reason(e: BaseException) -> str:
    """Why a call to a store failed, in a few words: the OS's reason for a failed connection
    (`Connection refused`, `timed out`) where there is one, else `Type: first line`, cut short.

    MLflow's own message for a server that does not answer quotes urllib3's (a few hundred
    characters: the URL, the retries, the connection object) around that reason.
    """
    reason = getattr(e, "reason", None)  # urllib's URLError wraps the OS's error
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    text = str(e)
    if m := _ERRNO.search(text):
        return m.group(1).strip()
    if "timed out" in text or isinstance(reason, TimeoutError):
        return "timed out"
    return error_text(e)[:200]


def store_failure(uri: str, e: BaseException) -> str:
    """The store and what went wrong with it, in one short phrase (`server http://h:9 unreachable
    (Connection refused)`, `store sqlite:///...: OperationalError: database is locked`)."""
    return str(e) if isinstance(e, Unreachable) else f"{store_name(uri)}: {short_reason(e)}"


def check_reachable(uri: str) -> None:
    """Raise Unreachable, in seconds, when the tracking server at an http(s) uri does not answer.

    A server busy with many jobs (or restarting) may miss one question: it is asked REACHABLE_TRIES
    times, so a run gives up on it after ~4 s when nothing listens, ~35 s when it hangs.
    """
    if not (uri.startswith("http://") or uri.startswith("https://")):
        return
    for attempt in range(REACHABLE_TRIES):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10).read()
            return
        except Exception as e:  # noqa: BLE001
            if attempt == REACHABLE_TRIES - 1:
                raise Unreachable(f"{store_name(uri)} unreachable ({short_reason(e)})") from None
            time.sleep(2)


def sync_command(run_dir: Path) -> str:
    """The `python -m gptlab.sync` command that records the run folder in MLflow later."""
    return f"python -m gptlab.sync {shlex.quote(str(Path(run_dir).resolve()))}"


def log_params(client: Any, run_id: str, params: Dict[str, Any]) -> None:
    """params as strings (cut at 6,000 characters), in batches of 100: the most MLflow accepts at once."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])


def children(client: Any, experiment_id: str, parent_run_id: str) -> List[Any]:
    """The runs nested under parent_run_id (a sweep's jobs)."""
    return client.search_runs(
        [experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'", max_results=10000
    )


def mlflow_metrics(metrics: Dict[str, Optional[float]]) -> Dict[str, float]:
    """The run-folder metrics that MLflow records, under their MLflow names (None values left out)."""
    return {METRIC_NAMES[k]: float(v) for k, v in metrics.items() if k in METRIC_NAMES and v is not None}


def _hydra_value(value: str) -> str:
    """A command-line override value, quoted for Hydra when it holds characters Hydra would parse."""
    if re.fullmatch(r"[\w./:+@-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def ui_command(uri: str, experiment: Optional[str] = None) -> str:
    """The `python -m gptlab.ui` command that opens the MLflow UI on the store at uri."""
    cmd = "python -m gptlab.ui"
    if uri != default_uri(Path("outputs")):
        cmd += " " + shlex.quote(f"tracking.uri={_hydra_value(uri)}")
    if experiment:
        cmd += " " + shlex.quote(f"tracking.experiment={_hydra_value(experiment)}")
    return cmd


def mlflow_ui_command(uri: str) -> str:
    """The same as plain `mlflow ui` (for machines without gptlab)."""
    cmd = f"mlflow ui --backend-store-uri {shlex.quote(uri)}"
    if (artifacts := artifact_root(uri)) is not None:
        cmd += f" --default-artifact-root {shlex.quote(str(artifacts))}"
    return cmd


def runs_url(server: str, experiment_id: str, best_first: bool = False) -> str:
    """The MLflow UI's runs table of one experiment, in its "Model training" mode (MLflow 3 opens an
    experiment on a GenAI overview otherwise). best_first: sorted by best val loss, which also lists
    a sweep's jobs flat instead of folded under their parent."""
    url = f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if best_first:
        url += "&orderByKey=metrics.%60summary%2Fbest_val_loss%60&orderByAsc=true"
    return url


def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def error_text(e: BaseException) -> str:
    """`Type: first line of the message`, short enough for an MLflow tag."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:5000]


def get_or_create_experiment(client: Any, name: str, artifacts: Optional[Path]) -> str:
    """The id of experiment `name`, creating it (with its artifacts under `artifacts`) if needed."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=(artifacts / name).as_uri() if artifacts else None)
    except Exception:  # noqa: BLE001 - another job created it a moment ago
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def read_sweep(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The sweep.json of the sweep folder holding run_dir (sweep.dir/subdir), if any."""
    for folder in list(Path(run_dir).resolve().parents)[:3]:
        path = folder / SWEEP_FILE
        if path.is_file():
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
            if not isinstance(info, dict) or info.get("kind") != SWEEP_KIND:
                return None  # somebody else's sweep.json
            return {**info, "sweep_dir": str(folder)}
    return None


def read_overrides(run_dir: Path) -> List[str]:
    """The command-line overrides Hydra recorded for the run folder (.hydra/overrides.yaml)."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    try:
        return [str(o) for o in (yaml.safe_load(path.read_text()) or [])]
    except (OSError, yaml.YAMLError):
        return []


def sweep_run_name(base: str, job_overrides: List[str], sweep: Dict[str, Any]) -> str:
    """A sweep job's name: the base name and the job's values of the swept keys (Hydra rewrites the
    job's other overrides, `x=false` becomes `x=False`, so only the keys are compared)."""
    swept = set(sweep.get("swept") or [])
    if swept:
        own = [o for o in job_overrides if o.partition("=")[0] in swept]
    else:  # a sweeper that generates the values (no `a,b` on the command line)
        own = [o for o in job_overrides if o not in sweep.get("overrides", [])]
    return f"{base} {' '.join(own)}" if own else base


def read_metrics(run_dir: Path) -> List[Dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a killed run
    return rows


def read_results(run_dir: Path) -> Dict[str, Any]:
    """A run folder's results.json ({} when it has none yet, or one cut short)."""
    try:
        results = json.loads((Path(run_dir) / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    return results if isinstance(results, dict) else {}


def last_logged_step(run_dir: Path) -> int:
    """The last step recorded in a run folder's metrics.jsonl (0 when there is none)."""
    steps = [row["step"] for row in read_metrics(run_dir) if isinstance(row, dict) and isinstance(row.get("step"), int)]
    return max(steps, default=0)


def plot_loss(rows: List[Dict[str, Any]], path: Path, title: str) -> None:
    """PNG of train and val loss against tokens, with lr on a second axis (needs matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def series(key: str):
        pts = [(r["tokens"], r[key]) for r in rows if r.get(key) is not None and r.get("tokens") is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, style in (
        ("train_loss", dict(color="tab:blue", lw=1.5)),
        ("val_loss", dict(color="tab:orange", marker="o", ms=3, lw=1.5)),
    ):
        x, y = series(key)
        if x:
            ax.plot(x, y, label=key.replace("_", " "), **style)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    x, y = series("lr")
    handles, labels = ax.get_legend_handles_labels()
    if x:
        ax2 = ax.twinx()
        ax2.plot(x, y, color="tab:gray", ls="--", lw=1, label="lr")
        ax2.set_ylabel("lr")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="upper right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


class NullTracker:
    """What non-zero ranks get: every call does nothing."""

    run_id: Optional[str] = None
    uri: Optional[str] = None

    def log_metrics(self, step: int, metrics: Dict[str, float]) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def set_tag(self, key: str, value: str) -> None: ...

    def write_config(self, resolved: Dict[str, Any], derived: Dict[str, Any]) -> None: ...

    def write_results(self, results: Dict[str, Any]) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


@dataclass
class RunIdentity:
    """What a run is recorded as in MLflow."""

    experiment: str
    name: str
    params: Dict[str, Any]
    tags: Dict[str, str]
    resume_run_id: Optional[str] = None  # the checkpoint's MLflow run, continued instead of a new one


# The tracker's calls to MLflow go through a Sender: a background thread, so that a slow, restarting
# or absent server never holds the step loop (which only appends to a queue). What a server that is
# down does not take is in metrics.jsonl anyway, and gptlab.sync records it later.
SEND_FIRST_RETRY_S = 0.5  # the wait after a failed call, doubling ...
SEND_MAX_RETRY_S = 8.0  # ... up to this
SEND_TRIES = 40  # tries of one call (about 5 minutes of waits) before it is left to gptlab.sync
SEND_QUEUE_POINTS = 100_000  # metric points waiting for the store; past this, the oldest are left to gptlab.sync
FINAL_FLUSH_S = 30.0  # at the run's end, how long it waits for the store to take what is still queued
# MLflow error codes that no retry will change (a bad value, a run that was deleted, no permission)
PERMANENT_ERRORS = {
    *("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST"),
    *("PERMISSION_DENIED", "UNAUTHENTICATED", "INVALID_STATE"),
}


@dataclass
class Call:
    """One MLflow call the sender makes: what it records (for the report) and how many metric points."""

    what: str  # "metrics", "the run's status", "artifact results.json", ...
    fn: Callable[[], Any]
    points: int = 0


def is_permanent(e: BaseException) -> bool:
    """A failure that trying again cannot fix (a 4xx answer); anything else may pass (no answer, 5xx, a lock)."""
    return getattr(e, "error_code", None) in PERMANENT_ERRORS


class Sender:
    """Makes MLflow calls in order on a background thread; put() never waits on the store.

    A call that fails in a way that may pass is tried again after a wait (SEND_FIRST_RETRY_S doubling
    to SEND_MAX_RETRY_S), SEND_TRIES times at most; the calls behind it wait their turn, so points reach
    the store in order once it answers again. The queue holds SEND_QUEUE_POINTS points at most: past
    that the oldest metric calls are given up. A call is sent again with the same points (same
    timestamps), which MLflow stores once even when an earlier try did reach it. close() waits a
    bounded time for the queue to empty and returns the calls that were not made.
    """

    def __init__(self, name: str, max_points: int = SEND_QUEUE_POINTS):
        import collections
        import threading

        self.name = name  # the store, as the log lines name it
        self.max_points = max_points
        self._queue: Any = collections.deque()
        self._queued_points = 0
        self._current: Optional[Call] = None
        self._lost: List[Call] = []  # given up: too many tries, a permanent error, or the queue was full
        self._closed = False
        self._cond = threading.Condition()
        self._abandon = threading.Event()
        self._down_since: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="gptlab-mlflow-sender", daemon=True)
        self._thread.start()

    def put(self, call: Call) -> None:
        with self._cond:
            if self._closed:
                self._lost.append(call)
                return
            self._queue.append(call)
            self._queued_points += call.points
            while self._queued_points > self.max_points:
                oldest = next((c for c in self._queue if c.points), None)
                if oldest is None:
                    break
                self._queue.remove(oldest)
                self._queued_points -= oldest.points
                self._lost.append(oldest)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue or self._abandon.is_set():
                    return
                call = self._current = self._queue.popleft()
                self._queued_points -= call.points
            done = self._attempt(call)
            with self._cond:
                self._current = None
                if not done:
                    self._lost.append(call)
                self._cond.notify_all()

    def _attempt(self, call: Call) -> bool:
        """Make the call, trying again with backoff while the failure may pass; whether it was made."""
        wait = SEND_FIRST_RETRY_S
        for tries in range(1, SEND_TRIES + 1):
            try:
                call.fn()
            except Exception as e:  # noqa: BLE001 - a store's failure is reported, never raised into the run
                if is_permanent(e) or tries == SEND_TRIES:
                    log.warning(f"MLflow {self.name}: {call.what} not recorded ({error_text(e)[:300]})")
                    return False
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    log.warning(
                        f"MLflow {self.name} is not answering ({error_text(e)[:200]}); "
                        "training goes on, metrics.jsonl has every point, and they are sent when it answers"
                    )
                if self._abandon.wait(wait * random.uniform(0.8, 1.2)):
                    return False
                wait = min(wait * 2, SEND_MAX_RETRY_S)
                continue
            if self._down_since is not None:
                log.warning(f"MLflow {self.name} answers again after {time.monotonic() - self._down_since:.0f} s")
                self._down_since = None
            return True
        return False

    def close(self, timeout: float) -> List[Call]:
        """Wait up to timeout seconds for every queued call to be made; the calls that were not."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while (self._queue or self._current) and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            self._abandon.set()  # a call still being tried stops at its next wait
            left = [*self._lost, *([self._current] if self._current else []), *self._queue]
            self._queue.clear()
            self._cond.notify_all()
        return left


def unsent_line(store: str, run_dir: Optional[Path], left: List[Call]) -> str:
    """The one line a run that ends with calls not made prints: how many points, and the sync command."""
    points = sum(c.points for c in left)
    others = sorted({c.what for c in left if not c.points})
    also = f" (nor {', '.join(others)})" if others else ""
    if run_dir is None:
        return f"MLflow {store} unreachable: {points} points not sent{also}"
    return (
        f"MLflow {store} unreachable: {points} points not sent{also}; they are in "
        f"{Path(run_dir).resolve() / 'metrics.jsonl'} — run `{sync_command(run_dir)}`"
    )


def store_name(uri: str) -> str:
    """`server http://host:port` or `store sqlite:///...`, for log lines."""
    return f"server {uri}" if uri.startswith(("http://", "https://")) else f"store {uri}"


class MLflowRun:
    """One MLflow run, written through a Sender: the run is created (or reopened) at once, and every
    later call is queued; a store that cannot be reached at the start is one warning and a no-op."""

    def __init__(
        self,
        cfg: TrackingConfig,
        uri: str,
        run: RunIdentity,
        experiment_id: Optional[str] = None,
        run_dir: Optional[Path] = None,
    ):
        """experiment_id: the experiment when it is known already (a sweep's), else found or created by name;
        run_dir: the run folder, which the warning names when MLflow fails (to record it later)."""
        self.uri = uri
        self.run_dir = run_dir
        self.flush_every = cfg.flush_every
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self._buffer: List[Any] = []
        self._client = None
        self._sender: Optional[Sender] = None
        self._monitor = None
        self.resumed = False
        self.unsent: List[Call] = []  # what the store had not taken when the run ended
        try:
            self._check_reachable(uri)
            client = mlflow_client(uri)
            params = run.params
            mlflow_run = self._reopen(client, run.resume_run_id)
            if mlflow_run is not None:  # a resumed run goes on in the same MLflow run
                exp_id, self.resumed = mlflow_run.info.experiment_id, True
                client.update_run(mlflow_run.info.run_id, status="RUNNING")
                for k, v in run.tags.items():
                    client.set_tag(mlflow_run.info.run_id, k, v)
                logged = mlflow_run.data.params  # a param cannot change once logged: keep the first value
                params = {k: v for k, v in params.items() if k not in logged}
            else:
                exp_id = experiment_id or get_or_create_experiment(client, run.experiment, artifact_root(uri))
                mlflow_run = client.create_run(exp_id, run_name=run.name, tags=run.tags)
            self.run_id = mlflow_run.info.run_id
            log_params(client, self.run_id, params)
            self._client = client
            self.experiment_id = exp_id
            self._sender = Sender(store_name(uri))
        except Exception as e:  # noqa: BLE001 - any tracking failure must not stop training
            self._fail(e)

    @staticmethod
    def _reopen(client: Any, run_id: Optional[str]) -> Any:
        if not run_id:
            return None
        try:
            return client.get_run(run_id)
        except Exception:  # noqa: BLE001 - e.g. a checkpoint copied from another store: start a new run
            log.warning(f"MLflow run {run_id} of the checkpoint is not in this store: recording a new run")
            return None

    _check_reachable = staticmethod(check_reachable)

    def _fail(self, e: Exception) -> None:
        later = sync_command(self.run_dir) if self.run_dir is not None else "python -m gptlab.sync <run folder>"
        log.warning(
            f"MLflow disabled for this run: {store_failure(self.uri, e)}; the run folder still records "
            f"everything; record it later with: {later}"
        )
        self._client = None

    def start_system_metrics(self, gpu_expected: bool) -> None:
        """MLflow's own sampler (a thread): system/* metrics every 10 s (MLFLOW_SYSTEM_METRICS_*)."""
        if self._client is None:
            return
        try:
            import psutil  # noqa: F401 - MLflow's CPU monitor needs it
        except ImportError:
            log.warning("system metrics skipped: psutil is not installed (pip install psutil)")
            return
        try:
            import logging

            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no start/stop chatter
            self._monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.uri, resume_logging=self.resumed)
            self._monitor.start()
        except Exception as e:  # noqa: BLE001
            log.warning(f"system metrics skipped: {error_text(e)}")
            self._monitor = None
            return
        if gpu_expected and not any(type(m).__name__ == "GPUMonitor" for m in self._monitor.monitors):
            log.warning("system metrics without GPU figures: nvidia-ml-py is not installed (pip install nvidia-ml-py)")

    def _buffer_points(self, step: int, values: Dict[str, float]) -> None:
        """values (MLflow name -> value) as points at step, sent by the next flush()."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in values.items())

    def _send(self, what: str, fn: Callable[..., Any], *args: Any, points: int = 0, **kwargs: Any) -> None:
        """Queue client.fn(run_id, *args, **kwargs) for the sender (nothing when MLflow is off)."""
        if self._client is None or self._sender is None:
            return
        self._sender.put(Call(what, functools.partial(fn, self.run_id, *args, **kwargs), points))

    def log_metrics(self, step: int, metrics: Dict[str, float]) -> None:
        if self._client is None:
            return
        self._buffer_points(step, mlflow_metrics(metrics))
        if len(self._buffer) >= self.flush_every * 4:
            self.flush()

    def log_summary(self, step: int, values: Dict[str, float]) -> None:
        if self._client is None:
            return
        self._buffer_points(step, values)
        self.flush()

    def flush(self) -> None:
        """Hand the buffered points to the sender, in batches of 1000 (the most one MLflow call takes)."""
        if self._client is None or not self._buffer:
            return
        for i in range(0, len(self._buffer), 1000):
            batch = self._buffer[i : i + 1000]
            self._send("metrics", self._client.log_batch, metrics=batch, points=len(batch))
        self._buffer = []

    def log_artifact(self, path: Path) -> None:
        if self._client is not None:
            self._send(f"artifact {Path(path).name}", self._client.log_artifact, str(path))

    def set_tag(self, key: str, value: str) -> None:
        if self._client is not None:
            self._send(f"tag {key}", self._client.set_tag, key, value)

    def finish(self, status: str) -> None:
        """End the run: what is queued, then the status, waiting FINAL_FLUSH_S at most for the store to
        take it; what it did not take is one line naming gptlab.sync."""
        if self._monitor is not None:
            with contextlib.suppress(Exception):  # a sampler that fails to stop must not fail the run
                self._monitor.finish()
            self._monitor = None
        self.flush()
        if self._client is None or self._sender is None:
            return
        self._send("the run's status", self._client.set_terminated, status=status)
        self.unsent = self._sender.close(FINAL_FLUSH_S)
        if self.unsent:
            log.warning(unsent_line(store_name(self.uri), self.run_dir, self.unsent))

    @property
    def active(self) -> bool:
        return self._client is not None


class Tracker:
    """Rank 0's records: metrics.jsonl and results.json in the run folder, mirrored to MLflow
    (and to TensorBoard when asked), and loss.png at the end."""

    def __init__(self, run_dir: Path, cfg: TrackingConfig, outputs: Path, run: RunIdentity):
        """outputs: where the default local store lives; run: what MLflow records the run as."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.run_name = run.name
        self.experiment = run.experiment
        # line-buffered for the whole run, closed by finish()
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self.uri = cfg.uri or default_uri(outputs)
        self.mlflow: Optional[MLflowRun] = None
        self._tb = self._open_tensorboard() if cfg.tensorboard else None
        if cfg.mlflow:
            tags = dict(run.tags)
            experiment_id = None
            overrides = read_overrides(self.run_dir)
            if overrides:
                tags["overrides"] = " ".join(overrides)
            sweep = read_sweep(self.run_dir)
            if sweep and cfg.uri in (None, sweep.get("uri")):
                # One experiment and store for the whole sweep, so the UI can nest the jobs.
                self.uri, self.experiment = sweep["uri"], sweep["experiment"]
                experiment_id = sweep["experiment_id"]
                tags.update({PARENT_TAG: sweep["parent_run_id"], "sweep_dir": sweep["sweep_dir"]})
                self.run_name = sweep_run_name(cfg.run_name or _tags_name(tags) or run.name, overrides, sweep)
            tags["host"] = socket.gethostname()
            if commit := git_commit():
                tags["git_commit"] = commit
            run = dataclasses.replace(run, experiment=self.experiment, name=self.run_name, tags=tags)
            self.mlflow = MLflowRun(cfg, self.uri, run, experiment_id, run_dir=self.run_dir)
            if cfg.system_metrics:
                self.mlflow.start_system_metrics(gpu_expected=_cuda_available())
        elif cfg.system_metrics:
            log.warning("system metrics skipped: they are recorded in MLflow, and tracking.mlflow=false")

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning(
                "TensorBoard event files skipped: the tensorboard package is not installed (pip install tensorboard)"
            )
            return None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    @property
    def run_id(self) -> Optional[str]:
        return self.mlflow.run_id if self.mlflow and self.mlflow.active else None

    def log_metrics(self, step: int, metrics: Dict[str, float]) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        self._metrics.write(json.dumps(row) + "\n")
        if self.mlflow:
            self.mlflow.log_metrics(step, metrics)
        if self._tb is not None:
            for name, value in mlflow_metrics(metrics).items():
                self._tb.add_scalar(name, value, step)

    def log_artifact(self, path: Path) -> None:
        if self.mlflow:
            self.mlflow.log_artifact(path)

    def set_tag(self, key: str, value: str) -> None:
        if self.mlflow:
            self.mlflow.set_tag(key, value)

    def write_config(self, resolved: Dict[str, Any], derived: Dict[str, Any]) -> None:
        """The resolved config (interpolations filled in) as config_resolved.yaml, also an artifact, and
        the figures derived from it (derived.json: MLflow's derived.* params, for gptlab.sync too)."""
        import yaml

        path = self.run_dir / "config_resolved.yaml"
        path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        self.log_artifact(path)
        (self.run_dir / DERIVED_FILE).write_text(json.dumps(derived, indent=1) + "\n")

    def write_results(self, results: Dict[str, Any]) -> None:
        """results.json, atomically, as strict JSON: a figure that is not a finite number is null."""
        path = self.run_dir / "results.json"
        tmp = path.with_suffix(".json.tmp")
        strict = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in results.items()}
        tmp.write_text(json.dumps(strict, indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
        results = strict
        self.log_artifact(path)
        if self.mlflow:
            self.mlflow.log_summary(
                int(results.get("steps") or 0),
                {name: results[key] for key, name in SUMMARY_METRICS.items() if results.get(key) is not None},
            )

    def _plot(self) -> None:
        rows = read_metrics(self.run_dir)
        if not rows:
            return
        path = self.run_dir / LOSS_PLOT
        try:
            plot_loss(rows, path, self.run_name)
        except ImportError:
            log.warning(f"{LOSS_PLOT} skipped: matplotlib is not installed (pip install matplotlib)")
            return
        except Exception as e:  # noqa: BLE001 - a plot must never fail a run
            log.warning(f"{LOSS_PLOT} skipped: {error_text(e)}")
            return
        self.log_artifact(path)

    def finish(self, status: str = "FINISHED") -> None:
        # Called from a `finally:` block: on a failure the exception is still in flight here.
        error = sys.exc_info()[1] if status != "FINISHED" else None
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self.cfg.plots:
            self._plot()
        if self.mlflow:
            if error is not None:
                self.mlflow.set_tag("error", error_text(error))
            self.mlflow.finish(status)
            if self.mlflow.active:
                how = (
                    f"open {runs_url(self.uri, self.mlflow.experiment_id)}"
                    if self.uri.startswith(("http://", "https://"))
                    else f"open the UI with: {ui_command(self.uri, self.experiment)}\n"
                    f"  (or {mlflow_ui_command(self.uri)})"
                )
                log.info(f"MLflow run {self.mlflow.run_id} ({self.run_name}) in {self.uri}\n  {how}")


def _tags_name(tags: Dict[str, str]) -> str:
    """run_name() of the run's model, data and hardware tags (those there when some are missing)."""
    parts = [tags[k] for k in NAME_TAGS if k in tags]
    return run_name(*parts) if len(parts) == len(NAME_TAGS) else "-".join(parts)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False
