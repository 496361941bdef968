"""Rank 0's records of a training run: ``Tracker`` hands each record to its sinks (``SINKS``).

The sinks (records/sinks.py's interface): the run folder (always), TensorBoard (when asked) and
MLflow (``MLflowRun``, through its background ``Sender``, when reachable). Other ranks get
``NullTracker``, so the training loop calls the same methods everywhere and never branches on
whether logging is on. A store that is down or fails never stops training: the tracker warns once,
stops using it, and the run folder still gets everything. The optional parts (system metrics,
TensorBoard, the loss plot) each say in one line what is missing and are skipped.

A run that is a sweep's job (records/identity.py finds the sweep) becomes a child of that sweep's
MLflow parent run, whatever launcher ran it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type

from gptlab.errors import never_fatal, or_none
from gptlab.records import identity as ids
from gptlab.records import layout, parent
from gptlab.records.identity import RunIdentity
from gptlab.records.sinks import Opening, RunFolder, Sink, TensorBoard
from gptlab.records.store import (
    SUMMARY_METRICS,
    artifact_root,
    check_reachable,
    error_text,
    get_or_create_experiment,
    log_params,
    mlflow_client,
    mlflow_metrics,
    mlflow_ui_command,
    runs_url,
    store_failure,
    store_name,
    sync_command,
    ui_command,
)

if TYPE_CHECKING:
    from gptlab.config import TrackingConfig

log = logging.getLogger(__name__)


class NullTracker:
    """What non-zero ranks get: every call does nothing."""

    run_id: Optional[str] = None
    uri: Optional[str] = None

    def log_metrics(self, step: int, metrics: Dict[str, float]) -> None: ...

    def log_side_metrics(self, step: int, metrics: Dict[str, float]) -> None: ...

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None: ...

    def set_tag(self, key: str, value: str) -> None: ...

    def log_inputs(self, datasets: List[Dict[str, Any]]) -> None: ...

    def write_config(self, resolved: Dict[str, Any], derived: Dict[str, Any]) -> None: ...

    def write_results(self, results: Dict[str, Any]) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


# The tracker's calls to MLflow go through a Sender: a background thread, so that a slow, restarting
# or absent server never holds the step loop (which only appends to a queue). What a server that is
# down does not take is in metrics.jsonl anyway, and gptlab.sync records it later.
SEND_FIRST_RETRY_S = 0.5  # the wait after a failed call, doubling ...
SEND_MAX_RETRY_S = 8.0  # ... up to this
SEND_TRIES = 40  # tries of one call (about 5 minutes of waits) before it is left to gptlab.sync
# metric points waiting for the store; past this, the oldest are left to gptlab.sync
SEND_QUEUE_POINTS = 100_000
# at the run's end, how long it waits for the store to take what is still queued
FINAL_FLUSH_S = 30.0
# MLflow error codes that no retry will change (a bad value, a run that was deleted, no permission)
PERMANENT_ERRORS = {
    *(
        "INVALID_PARAMETER_VALUE",
        "RESOURCE_DOES_NOT_EXIST",
        "RESOURCE_ALREADY_EXISTS",
        "BAD_REQUEST",
    ),
    *("PERMISSION_DENIED", "UNAUTHENTICATED", "INVALID_STATE"),
}


@dataclass
class Call:
    """One MLflow call the sender makes.

    It holds what the call records (for the report) and how many metric points.
    """

    what: str  # "metrics", "the run's status", "artifact results.json", ...
    fn: Callable[[], Any]
    points: int = 0


def is_permanent(e: BaseException) -> bool:
    """Whether a failure is one that trying again cannot fix (a 4xx answer).

    Anything else may pass (no answer, 5xx, a lock).
    """
    return getattr(e, "error_code", None) in PERMANENT_ERRORS


class Sender:
    """Makes MLflow calls in order on a background thread; put() never waits on the store.

    A call that fails in a way that may pass is tried again after a wait (SEND_FIRST_RETRY_S
    doubling to SEND_MAX_RETRY_S), SEND_TRIES times at most; the calls behind it wait their turn, so
    points reach the store in order once it answers again. The queue holds SEND_QUEUE_POINTS points
    at most: past that the oldest metric calls are given up. A call is sent again with the same
    points (same timestamps), which MLflow stores once even when an earlier try did reach it.
    close() waits a bounded time for the queue to empty and returns the calls that were not made.
    """

    def __init__(self, name: str, max_points: int = SEND_QUEUE_POINTS):
        import collections
        import threading

        self.name = name  # the store, as the log lines name it
        self.max_points = max_points
        self._queue: Any = collections.deque()
        self._queued_points = 0
        self._current: Optional[Call] = None
        # given up: too many tries, a permanent error, or the queue was full
        self._lost: List[Call] = []
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
        """Make the call, trying again with backoff while the failure may pass.

        Returns whether it was made.
        """
        wait = SEND_FIRST_RETRY_S
        for tries in range(1, SEND_TRIES + 1):
            try:
                call.fn()
            except Exception as e:  # noqa: BLE001 - a store's failure is reported, never raised into the run
                if is_permanent(e) or tries == SEND_TRIES:
                    log.warning(
                        f"MLflow {self.name}: {call.what} not recorded ({error_text(e)[:300]})"
                    )
                    return False
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    log.warning(
                        f"MLflow {self.name} is not answering ({error_text(e)[:200]}); "
                        "training goes on, metrics.jsonl has every point, and they are sent when "
                        "it answers"
                    )
                if self._abandon.wait(wait * random.uniform(0.8, 1.2)):
                    return False
                wait = min(wait * 2, SEND_MAX_RETRY_S)
                continue
            if self._down_since is not None:
                log.warning(
                    f"MLflow {self.name} answers again after "
                    f"{time.monotonic() - self._down_since:.0f} s"
                )
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
    """The one line printed by a run that ends with calls not made.

    It says how many points, and the sync command.
    """
    points = sum(c.points for c in left)
    others = sorted({c.what for c in left if not c.points})
    also = f" (nor {', '.join(others)})" if others else ""
    if run_dir is None:
        return f"MLflow {store} unreachable: {points} points not sent{also}"
    return (
        f"MLflow {store} unreachable: {points} points not sent{also}; they are in "
        f"{Path(run_dir).resolve() / layout.METRICS} — run `{sync_command(run_dir)}`"
    )


class MLflowRun(Sink):
    """The MLflow sink: one MLflow run, written through a Sender.

    The run is created (or reopened) at once and every later call is queued; a store that cannot be
    reached at the start is one warning and a no-op.
    """

    name = "MLflow"

    def __init__(
        self,
        cfg: TrackingConfig,
        uri: str,
        run: RunIdentity,
        params: Dict[str, Any],
        resume_run_id: Optional[str] = None,
        experiment_id: Optional[str] = None,
        run_dir: Optional[Path] = None,
    ):
        """Create (or reopen) the MLflow run of run in the store at uri.

        resume_run_id: the checkpoint's MLflow run, continued instead of a new one; experiment_id:
        the experiment when it is known already (a sweep's), else found or created by name; run_dir:
        the run folder, which the warning names when MLflow fails (to record it later).
        """
        self.uri = uri
        self.run_dir = run_dir
        self.run_name, self.experiment = run.name, run.experiment
        self.flush_every = cfg.flush_every
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None
        self._buffer: List[Any] = []
        self._client = None
        self._sender: Optional[Sender] = None
        self._monitor = None
        self.resumed = False
        self.unsent: List[Call] = []  # what the store had not taken when the run ended
        with never_fatal(self._fail):  # any tracking failure must not stop training
            self._check_reachable(uri)
            client = mlflow_client(uri)
            mlflow_run = self._reopen(client, resume_run_id)
            if mlflow_run is not None:  # a resumed run goes on in the same MLflow run
                exp_id, self.resumed = mlflow_run.info.experiment_id, True
                client.update_run(mlflow_run.info.run_id, status="RUNNING")
                for k, v in run.tags.items():
                    client.set_tag(mlflow_run.info.run_id, k, v)
                # a param cannot change once logged: keep the first value
                logged = mlflow_run.data.params
                params = {k: v for k, v in params.items() if k not in logged}
            else:
                exp_id = experiment_id or get_or_create_experiment(
                    client, run.experiment, artifact_root(uri)
                )
                mlflow_run = client.create_run(exp_id, run_name=run.name, tags=run.tags)
            self.run_id = mlflow_run.info.run_id
            log_params(client, self.run_id, params)
            self._client = client
            self.experiment_id = exp_id
            self._sender = Sender(store_name(uri))

    @classmethod
    def open(cls, opening: Opening) -> Optional["MLflowRun"]:
        """The run's MLflow run when tracking.mlflow is on, with MLflow's system metrics when asked.

        A sweep's job is nested under the sweep's parent, in its store.
        """
        cfg, run, uri, experiment_id = opening.cfg, opening.run, opening.uri, None
        if not cfg.mlflow:
            if cfg.system_metrics:
                log.warning(
                    "system metrics skipped: they are recorded in MLflow, and tracking.mlflow=false"
                )
            return None
        sweep = run.sweep
        if sweep and sweep.get("parent_run_id"):
            uri, experiment_id = sweep["uri"], sweep["experiment_id"]
            tags = {**run.tags, **parent.child_tags(sweep, sweep["parent_run_id"])}
            run = RunIdentity(run.experiment, run.name, tags, sweep)
        mlflow = cls(
            cfg, uri, run, opening.params, opening.resume_run_id, experiment_id, opening.run_dir
        )
        if cfg.system_metrics:
            mlflow.start_system_metrics(gpu_expected=_cuda_available())
        return mlflow

    @staticmethod
    def _reopen(client: Any, run_id: Optional[str]) -> Any:
        if not run_id:
            return None
        run = or_none(client.get_run, run_id)
        if run is None:  # e.g. a checkpoint copied from another store: start a new run
            log.warning(
                f"MLflow run {run_id} of the checkpoint is not in this store: recording a new run"
            )
        return run

    _check_reachable = staticmethod(check_reachable)

    def _fail(self, e: Exception) -> None:
        later = (
            sync_command(self.run_dir)
            if self.run_dir is not None
            else "python -m gptlab.sync <run folder>"
        )
        log.warning(
            f"MLflow disabled for this run: {store_failure(self.uri, e)}; the run folder still "
            f"records "
            f"everything; record it later with: {later}"
        )
        self._client = None

    def start_system_metrics(self, gpu_expected: bool) -> None:
        """Start MLflow's own sampler (a thread): system/* metrics every 10 s.

        Its settings are MLFLOW_SYSTEM_METRICS_*.
        """
        if self._client is None:
            return
        try:
            import psutil  # noqa: F401 - MLflow's CPU monitor needs it
        except ImportError:
            log.warning("system metrics skipped: psutil is not installed (pip install psutil)")
            return
        self._monitor = None
        with never_fatal(lambda e: log.warning(f"system metrics skipped: {error_text(e)}")):
            import logging

            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # no start/stop chatter
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
            monitor = SystemMetricsMonitor(
                self.run_id, tracking_uri=self.uri, resume_logging=self.resumed
            )
            monitor.start()
            self._monitor = monitor
        if self._monitor is None:
            return
        if gpu_expected and not any(
            type(m).__name__ == "GPUMonitor" for m in self._monitor.monitors
        ):
            log.warning(
                "system metrics without GPU figures: nvidia-ml-py is not installed (pip install "
                "nvidia-ml-py)"
            )

    def _buffer_points(self, step: int, values: Dict[str, float]) -> None:
        """values (MLflow name -> value) as points at step, sent by the next flush()."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in values.items())

    def _send(
        self, what: str, fn: Callable[..., Any], *args: Any, points: int = 0, **kwargs: Any
    ) -> None:
        """Queue client.fn(run_id, *args, **kwargs) for the sender (nothing when MLflow is off)."""
        if self._client is None or self._sender is None:
            return
        self._sender.put(Call(what, functools.partial(fn, self.run_id, *args, **kwargs), points))

    def log_side_metrics(self, step: int, metrics: Dict[str, Any]) -> None:
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
        """Hand the buffered points to the sender, in batches of 1000.

        1000 is the most one MLflow call takes.
        """
        if self._client is None or not self._buffer:
            return
        for i in range(0, len(self._buffer), 1000):
            batch = self._buffer[i : i + 1000]
            self._send("metrics", self._client.log_batch, metrics=batch, points=len(batch))
        self._buffer = []

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        if self._client is not None:
            self._send(
                f"artifact {Path(path).name}", self._client.log_artifact, str(path), artifact_path
            )

    def set_tag(self, key: str, value: str) -> None:
        if self._client is not None:
            self._send(f"tag {key}", self._client.set_tag, key, value)

    def log_inputs(self, datasets: List[Dict[str, Any]]) -> None:
        """The run's data as MLflow dataset inputs (records/lineage.py's descriptions)."""
        if self._client is not None and datasets:
            from gptlab.records import lineage

            inputs = lineage.dataset_inputs(datasets)
            self._send("datasets", self._client.log_inputs, datasets=inputs)

    def write_results(self, results: Dict[str, Any]) -> None:
        """Log the results again, once, as sortable summary/* metrics.

        results.json is an artifact already: the run folder published it.
        """
        self.log_summary(
            int(results.get("steps") or 0),
            {
                name: results[key]
                for key, name in SUMMARY_METRICS.items()
                if results.get(key) is not None
            },
        )

    def finish(self, status: str, error: Optional[BaseException] = None) -> None:
        """End the run: the error as a tag, what is queued, then the status.

        It waits FINAL_FLUSH_S at most for the store to take it; what it did not take is one line
        naming gptlab.sync.
        """
        if error is not None:
            self.set_tag("error", error_text(error))
        self._end(status)
        if self.active:
            how = (
                f"open {runs_url(self.uri, self.experiment_id)}"
                if self.uri.startswith(("http://", "https://"))
                else f"open the UI with: {ui_command(self.uri, self.experiment)}\n"
                f"  (or {mlflow_ui_command(self.uri)})"
            )
            log.info(f"MLflow run {self.run_id} ({self.run_name}) in {self.uri}\n  {how}")

    def _end(self, status: str) -> None:
        if self._monitor is not None:
            # a sampler that fails to stop must not fail the run
            with contextlib.suppress(Exception):
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

    @property
    def active_run_id(self) -> Optional[str]:
        """The run's id while MLflow records it (a checkpoint keeps it), else None."""
        return self.run_id if self.active else None


# where a run's records go, in this order: the run folder first (the others copy its files)
SINKS: Tuple[Type[Sink], ...] = (RunFolder, TensorBoard, MLflowRun)


class Tracker:
    """Rank 0's records: every call handed to each sink of SINKS the config turns on.

    The run folder is always on, TensorBoard and MLflow when asked; what results.json says is
    decided here.
    """

    def __init__(
        self,
        run_dir: Path,
        cfg: TrackingConfig,
        default_store: str,
        run: RunIdentity,
        params: Optional[Dict[str, Any]] = None,
        resume_run_id: Optional[str] = None,
    ):
        """Open the sinks the config turns on for this run.

        default_store: the store of tracking.uri=null (paths.mlflow_db); run: what the run is
        recorded as (identity.identify); params: MLflow's params; resume_run_id: the checkpoint's
        MLflow run.
        """
        self.run_dir = Path(run_dir)
        self.init_from = run.tags.get(ids.INIT_FROM_TAG)  # results.json's init_from
        # (devices, price of a device-hour): from the resolved config, for results' device_hours
        self.usage: Tuple[int, Optional[float]] = (1, None)
        uri, params = cfg.uri or default_store, params or {}
        opening = Opening(self.run_dir, cfg, uri, run, params, resume_run_id, self.log_artifact)
        self.sinks: List[Sink] = []
        for kind in SINKS:
            sink = self._open(kind, opening)
            if sink is not None:
                self.sinks.append(sink)
        # the store MLflow records in (a sweep's job: its parent's), where log_model logs
        self.uri = getattr(self.mlflow, "uri", opening.uri)

    def _open(self, kind: Type[Sink], opening: Opening) -> Optional[Sink]:
        """kind's sink for this run; a non-essential one that fails to open is said and skipped."""
        if kind.essential:
            return kind.open(opening)
        sink: Optional[Sink] = None
        with never_fatal(lambda e: log.warning(f"{kind.name} records skipped: {error_text(e)}")):
            sink = kind.open(opening)
        return sink

    def _each(self, call: str, *args: Any) -> None:
        """Hand a call to every sink; a non-essential one that fails is said once and dropped.

        Records never stop a run.
        """
        for sink in list(self.sinks):
            if sink.essential:
                getattr(sink, call)(*args)
                continue
            with never_fatal(lambda e, sink=sink: self._drop(sink, e)):
                getattr(sink, call)(*args)

    def _drop(self, sink: Sink, e: BaseException) -> None:
        self.sinks.remove(sink)
        log.warning(
            f"{sink.name} records stopped for this run ({error_text(e)}); the run folder still "
            "records everything"
        )

    @property
    def mlflow(self) -> Optional[MLflowRun]:
        """The run's MLflow sink, when it has one (log_model reads what it left unsent)."""
        return next((s for s in self.sinks if isinstance(s, MLflowRun)), None)

    @property
    def run_id(self) -> Optional[str]:
        """The MLflow run's id while it records (a checkpoint keeps it), else None."""
        return getattr(self.mlflow, "active_run_id", None)

    def log_metrics(self, step: int, metrics: Dict[str, Any]) -> None:
        """A logged step's figures: its metrics.jsonl row, and points in every store."""
        self._each("log_metrics", step, metrics)

    def log_side_metrics(self, step: int, metrics: Dict[str, Any]) -> None:
        """Log figures of a step that are not its training row (a checkpoint's stall).

        They go to the stores only, so metrics.jsonl keeps one row per logged step and a save logs
        none.
        """
        self._each("log_side_metrics", step, metrics)

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        self._each("log_artifact", path, artifact_path)

    def set_tag(self, key: str, value: str) -> None:
        self._each("set_tag", key, value)

    def log_inputs(self, datasets: List[Dict[str, Any]]) -> None:
        self._each("log_inputs", datasets)

    def write_config(self, resolved: Dict[str, Any], derived: Dict[str, Any]) -> None:
        """Write the resolved config and the figures derived from it.

        The resolved config has its interpolations filled in: config_resolved.yaml, also an
        artifact. The derived figures are derived.json: MLflow's derived.* params, for gptlab.sync
        too.
        """
        self._each("write_config", resolved, derived)
        hw = resolved.get("hardware") or {}
        self.usage = (
            int(hw.get("nodes") or 1) * int(hw.get("nproc_per_node") or 1),
            hw.get("cost_per_device_hour"),
        )

    def write_results(self, results: Dict[str, Any]) -> None:
        """Write the loop's results with init_from, device_hours and cost, as strict JSON.

        Strict: a figure that is not a finite number is null. They go to results.json, and to each
        store's summary.
        """
        if self.init_from:
            results = {**results, "init_from": self.init_from}
        results = {**results, **device_usage(self.run_dir, results.get("wall_s"), *self.usage)}
        strict = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in results.items()
        }
        self._each("write_results", strict)

    def finish(self, status: str = "FINISHED") -> None:
        # Called from a `finally:` block: on a failure the exception is still in flight here.
        error = sys.exc_info()[1] if status != "FINISHED" else None
        self._each("finish", status, error)


def device_usage(
    run_dir: Path, wall_s: Optional[float], devices: int, price: Optional[float]
) -> Dict[str, Optional[float]]:
    """results.json's device_hours and cost (x price; None without one).

    device_hours is what SLURM's accounting says for a SLURM job (its elapsed time x its GPUs), else
    the training wall time x the devices.
    """
    hours = slurm_device_hours(layout.read_json(Path(run_dir) / layout.SLURM))
    if hours is None and wall_s is not None:
        hours = wall_s * devices / 3600
    cost = hours * price if hours is not None and price is not None else None
    return {"device_hours": hours, "cost": cost}


def slurm_device_hours(job: Optional[Dict[str, Any]]) -> Optional[float]:
    """A SLURM job's (slurm.json) elapsed seconds x allocated GPUs from sacct, in hours.

    None for no job, a job without GPUs (its processes are counted instead) or when sacct does not
    answer.
    """
    if not job or not job.get("job_id"):
        return None

    def ask() -> str:
        import subprocess

        args = ["sacct", "-X", "-n", "-P", "-j", str(job["job_id"]), "-o", "ElapsedRaw,AllocTRES"]
        return subprocess.run(args, capture_output=True, text=True, timeout=20).stdout

    return sacct_device_hours(or_none(ask) or "")


def sacct_device_hours(text: str) -> Optional[float]:
    """Device-hours of `sacct -X -n -P -o ElapsedRaw,AllocTRES` output: elapsed x gres/gpu.

    None when no line has both.
    """
    for line in text.splitlines():
        elapsed, _, tres = line.strip().partition("|")
        if not elapsed.isdigit():
            continue
        alloc = dict(item.partition("=")[::2] for item in tres.split(",") if "=" in item)
        gpus = alloc.get("gres/gpu", "")
        if gpus.isdigit() and int(gpus) > 0:
            return int(elapsed) * int(gpus) / 3600
    return None


def _cuda_available() -> bool:
    def probe() -> bool:
        import torch

        return torch.cuda.is_available()

    return bool(or_none(probe))
