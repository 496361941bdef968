"""An MLflow store: opened, retried and named the same way by every command using runs.

Every command that writes or reads runs goes through it.

A SQLite store is created under a lock and its calls retried while the database is locked, so many
runs may start on one fresh store; a server that does not answer costs seconds, not minutes, and is
named in one short phrase (`open_store`); MLflow's console noise is kept out of gptlab's output
(`quiet_bounded_mlflow`).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import logging
import os
import random
import re
import shlex
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from gptlab.errors import GptlabError, as_user_error, or_none

log = logging.getLogger(__name__)

# flat run-folder key -> MLflow name, grouped by prefix so runs overlay in the UI; a key not here is
# recorded under its own name
METRIC_NAMES = {
    "train_loss": "train/loss",
    "val_loss": "val/loss",
    "val_bpb": "val/bpb",
    "hellaswag_acc": "hellaswag/acc",
    "hellaswag_acc_norm": "hellaswag/acc_norm",
    "lr": "opt/lr",
    "grad_norm": "opt/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "tokens": "tokens",
}
# metrics.jsonl keys that are no metric of their own: the step is every point's x
NOT_METRICS = frozenset({"step"})
# results.json key -> MLflow metric logged once at the end (sortable in the runs table)
SUMMARY_METRICS = {
    "best_val_loss": "summary/best_val_loss",
    "val_loss": "summary/val_loss",
    "best_val_bpb": "summary/best_val_bpb",
    "val_bpb": "summary/val_bpb",
    "hellaswag_acc": "summary/hellaswag_acc",
    "hellaswag_acc_norm": "summary/hellaswag_acc_norm",
    "train_loss": "summary/train_loss",
    "tokens_per_s": "summary/tokens_per_s",
    "mfu": "summary/mfu",
    "wall_s": "summary/wall_s",
    "device_hours": "summary/device_hours",  # wall x devices, or SLURM's accounting
    "cost": "summary/cost",  # device_hours x hardware.cost_per_device_hour
    # what a scaling study reads (docs/scaling.md): C, N and D of the run
    "flops": "summary/flops",
    "params": "summary/params",
    "params_non_embedding": "summary/params_non_embedding",
    "tokens": "summary/tokens",
}
PARENT_TAG = "mlflow.parentRunId"  # what MLflow (and its UI) uses to nest a run under another
SQLITE_PREFIX = "sqlite:///"  # a SQLite store's URI is this and the path of its database file
DEFAULT_OUTPUTS = Path("outputs")  # paths.outputs's default (conf/paths/default.yaml)


def local_uri(db: Path) -> str:
    """The URI of the SQLite store in file db (paths.mlflow_db: the store of tracking.uri=null)."""
    return f"{SQLITE_PREFIX}{Path(db).resolve()}"


def default_uri(outputs: Path = DEFAULT_OUTPUTS) -> str:
    """The default store of a folder with no config at hand: paths.mlflow_db's default file."""
    return local_uri(Path(outputs) / "mlflow.db")


# The schemes of the stores MLflow itself has (a plain path is a folder store); packages add theirs
# through the entry points MLflow reads (STORE_PLUGINS)
STORE_SCHEMES = (
    "",
    "file",
    "sqlite",
    "http",
    "https",
    "postgresql",
    "mysql",
    "mssql",
    "databricks",
    "databricks-uc",
    "uc",
)
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
    # a Windows drive; postgresql+psycopg2 is postgresql
    base = "" if len(scheme) == 1 else scheme.split("+")[0]
    if base in STORE_SCHEMES or base in {e.name for e in entry_points(group=STORE_PLUGINS)}:
        return
    raise GptlabError(
        f"tracking.uri={uri}: {scheme!r} is not a scheme MLflow knows; give a folder path, "
        "sqlite:///path/to/mlflow.db, http(s)://host:port (a server) or postgresql://user@host/db, "
        "or leave it out for the local store outputs/mlflow.db"
    )


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\- ]{0,254}$")
_ALIAS = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def check_names(name: Optional[str], alias: Optional[str]) -> None:
    """A registered model's name and alias MLflow takes, or one line (an alias needs a name).

    Here, without MLflow, so that gptlab.export says so at once (serving.register checks too)."""
    if name is None:
        if alias is not None:
            raise GptlabError(
                f"export.alias={alias}: an alias points at a registered version; give "
                "export.register=NAME too"
            )
        return
    if not _NAME.match(name):
        raise GptlabError(
            f"export.register={name!r}: a registered model's name is letters, digits, '_', '-', "
            f"'.' and spaces"
        )
    if alias is not None and (not _ALIAS.match(alias) or re.match(r"^[vV][0-9]+$", alias)):
        raise GptlabError(f"export.alias={alias!r}: an alias is a name like champion, not v3")


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a SQLite store's URI; None for any other store."""
    return Path(uri[len(SQLITE_PREFIX) :]) if uri.startswith(SQLITE_PREFIX) else None


def artifact_root(uri: str) -> Optional[Path]:
    """Where a SQLite store's artifacts live: next to the database file.

    By default that is outputs/mlartifacts.
    """
    db = sqlite_path(uri)
    # a server stores (or proxies) its own
    return db.parent / "mlartifacts" if db is not None else None


# tries of a SQLite call that finds the database locked (backoff 0.1 s doubling, to 3 s)
LOCKED_RETRIES = 8


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock on `<db>.lock` beside a SQLite store's database file.

    Nothing for other stores.

    MLflow creates and migrates a SQLite store on a process's first connection to it; processes that
    do so at once race (`table ... already exists`, `Online migration expected to match one row`)
    and lose their runs. Every first connection is made under this lock, so they do it one at a
    time.
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
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(LOCKED_RETRIES):
        try:
            return call(*args, **kwargs)
        except (MlflowException, SQLAlchemyError) as e:  # MLflow wraps SQLAlchemy's, or not
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


def quiet_bounded_mlflow() -> None:
    """MLflow's settings for a command: HTTP calls that give up in seconds, and no console noise.

    The noise: INFO lines, download bars, run URLs, urllib3's retry lines. Each is a default: the
    environment variable set by the user wins.
    """
    # MLflow's HTTP client retries for minutes by default (7 retries, 120 s timeout); a down server
    # should cost one call at most 3 x 15 s plus 2 s of backoff. The tracker's Sender tries again
    # itself, on its own thread, so this bounds how long one of its tries waits.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    # MLflow's own INFO lines (creating and migrating a new store, "No artifacts found to
    # download") are not the command's: warnings only (MLFLOW_LOGGING_LEVEL=INFO brings them back).
    # Read when mlflow is first imported; set on its logger too where it was imported already
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    with contextlib.suppress(ValueError):  # a level logging does not know: MLflow's own default
        logging.getLogger("mlflow").setLevel(os.environ["MLFLOW_LOGGING_LEVEL"].upper())
    # nor its download bars (a model loaded by URI), which fill a redirected output
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # nor the "View run ... at: URL" lines it writes to stdout when a server's run ends: gptlab
    # says where a run is itself, and sync's stdout is one line per folder
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # nor urllib3's line for each of MLflow's HTTP retries: gptlab says once that a server does not
    # answer. They are warnings, which reach the console through the root logger: Hydra's launcher
    # gives it a handler at INFO in the process that launches a sweep (where the sweep callback
    # opens the store), and gptlab's job logging one at WARNING
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def mlflow_client(uri: str) -> Any:
    """An MlflowClient on the store at uri that gives up on a down server in seconds, not minutes.

    Every place that opens a store uses this one: a SQLite store is created (and migrated) under
    store_lock, and its calls are retried while the database is locked, so concurrent runs on one
    fresh store are all recorded.
    """
    quiet_bounded_mlflow()
    from mlflow.tracking import MlflowClient

    db = sqlite_path(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    with store_lock(uri):  # MlflowClient() connects: it creates, migrates and checks the store
        if not db.exists():
            seed_sqlite_store(db)
        return RetryingClient(retry_locked(MlflowClient, tracking_uri=uri))


def seed_sqlite_store(db: Path) -> None:
    """A new SQLite store at db, as a copy of an empty one MLflow migrated (made once per version).

    MLflow takes a new SQLite store through its whole schema history on the first connection, in
    every fresh run folder; a file copy is far cheaper. The copy holds MLflow's tables and no
    experiment: MLflow makes the Default one, under this store's artifact root, when it connects.
    Where the template cannot be made, MLflow migrates the store itself.
    """
    template = or_none(_migrated_template)
    if template is None:
        return
    partial = db.with_name(f".{db.name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(template, partial)
        os.replace(partial, db)  # a store is there whole or not at all
    except OSError:  # a full disk, say: nothing left behind, and MLflow's own connection says why
        partial.unlink(missing_ok=True)


def _migrated_template() -> Path:
    """The empty store MLflow migrated, in gptlab's cache ($GPTLAB_CACHE_DIR or ~/.cache/gptlab)."""
    import mlflow
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    # data.sources.cache_root's default: spelled here, as this leaf module imports no gptlab module
    root = Path(os.environ.get("GPTLAB_CACHE_DIR") or "~/.cache/gptlab").expanduser() / "mlflow"
    template = root / f"empty-store-{mlflow.__version__}.db"
    if template.is_file():
        return template
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{template.name}.{os.getpid()}.partial"
    partial.unlink(missing_ok=True)
    engine = sqlalchemy.create_engine(f"sqlite:///{partial}")
    try:
        _initialize_tables(engine)
    except BaseException:
        partial.unlink(missing_ok=True)  # no half-migrated template is left in the cache
        raise
    finally:
        engine.dispose()
    os.replace(partial, template)  # several processes may make it at once: the last one stays
    return template


def open_store(uri: str, advice: str, create: bool = True) -> Any:
    """mlflow_client(uri) once the store answers; else a GptlabError saying why, with advice.

    A server is asked first, in seconds (check_reachable); the error reads `MLflow <the store and
    why>; <advice>`. create=False: a SQLite store that does not exist is that error too, not a new
    empty store (a command that only reads).
    """
    db = sqlite_path(uri)
    if not create and db is not None and not db.is_file():
        raise GptlabError(f"MLflow {store_name(uri)}: no such store (no file {db}); {advice}")
    # a store that does not answer is the user's to fix
    with as_user_error(lambda e: f"MLflow {store_failure(uri, e)}; {advice}"):
        check_reachable(uri)
        # a SQLite store is created here (under its lock) when it is new
        client = mlflow_client(uri)
        client.search_experiments(max_results=1)
    return client


# /health asked this many times, 10 s each, 2 s apart, before a server counts as down
REACHABLE_TRIES = 3


class Unreachable(ConnectionError):
    """A tracking server that does not answer; the message names it and says why in a few words."""


# the OS's reason inside a library's message
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\"()<>\[\]]+)")


def short_reason(e: BaseException) -> str:
    """Why a call to a store failed, in a few words, cut short.

    The OS's reason for a failed connection (`Connection refused`, `timed out`) where there is one,
    else `Type: first line`.

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
    """The store and what went wrong with it, in one short phrase.

    For example `server http://h:9 unreachable (Connection refused)`, `store sqlite:///...:
    OperationalError: database is locked`.
    """
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
        # refused, reset, timed out, an HTTP error status, a reply that is not HTTP, a bad URL
        except (OSError, http.client.HTTPException, ValueError) as e:
            if attempt == REACHABLE_TRIES - 1:
                raise Unreachable(f"{store_name(uri)} unreachable ({short_reason(e)})") from None
            time.sleep(2)


def sync_command(run_dir: Path) -> str:
    """The `python -m gptlab.sync` command that records the run folder in MLflow later."""
    return f"python -m gptlab.sync {shlex.quote(str(Path(run_dir).resolve()))}"


def log_params(client: Any, run_id: str, params: Dict[str, Any]) -> None:
    """Log params as strings (cut at 6,000 characters), in batches of 100.

    100 is the most MLflow accepts at once.
    """
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
    """The run-folder metrics under their MLflow (and TensorBoard) names, None values left out.

    A key METRIC_NAMES does not rename keeps its own name, so every metric logged is recorded.
    """
    return {
        METRIC_NAMES.get(k, k): float(v)
        for k, v in metrics.items()
        if k not in NOT_METRICS and v is not None
    }


def _hydra_value(value: str) -> str:
    """A command-line override value, quoted for Hydra when it holds characters Hydra parses."""
    if re.fullmatch(r"[\w./:+@-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def ui_command(uri: str, experiment: Optional[str] = None) -> str:
    """The `python -m gptlab.ui` command that opens the MLflow UI on the store at uri."""
    cmd = "python -m gptlab.ui"
    if uri != default_uri():
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
    """The MLflow UI's runs table of one experiment, in its "Model training" mode.

    MLflow 3 opens an experiment on a GenAI overview otherwise. best_first: sorted by best val loss,
    which also lists a sweep's jobs flat instead of folded under their parent.
    """
    url = f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if best_first:
        url += "&orderByKey=metrics.%60summary%2Fbest_val_loss%60&orderByAsc=true"
    return url


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
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(
            name, artifact_location=(artifacts / name).as_uri() if artifacts else None
        )
    except MlflowException:  # another job created it a moment ago
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def store_name(uri: str) -> str:
    """`server http://host:port` or `store sqlite:///...`, for log lines."""
    return f"server {uri}" if uri.startswith(("http://", "https://")) else f"store {uri}"
