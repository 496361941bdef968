"""python -m gptlab.sync [FOLDER ...] [tracking.uri=...]: record run folders in MLflow.

Sync records each folder in MLflow, completing what is missing.

The run folder is the truth and is always written; MLflow is not, when a run could not reach its
store (an offline compute node, a server that was down, a SQLite file that was locked). This records
such folders later, and completes partly recorded ones. It is idempotent: what the store already
holds is not sent again, so a second sync adds nothing and says so.

FOLDER: a run folder, or a folder of run folders (a sweep folder, outputs/runs); several may be
given. None: every run folder under outputs/runs and outputs/sweeps. A run folder holds
metrics.jsonl or config_resolved.yaml. The store: `tracking.uri` when given, else the one the run
was configured with (its sweep's, for a sweep's job), else the local store outputs/mlflow.db (of the
current folder: run it from where you trained).

Which MLflow run a folder is: results.json's `mlflow_run_id` when the store has that run; else the
run tagged `run_dir=<the folder>`; else a new run, named and tagged as gptlab.train names and tags
it (plus `recorded_by=gptlab.sync`), a sweep's job nested under the sweep's parent run (found by
sweep.json's id or its `sweep_dir` tag, else created from sweep.json, or from Hydra's multirun.yaml
when the sweep could not write sweep.json). A run deleted in MLflow is left deleted.

What is completed: the metric points whose (name, step) the run lacks (metrics.jsonl, and
results.json as summary/*), params not logged yet (a param cannot change; the derived.* figures come
from derived.json), artifacts missing or of another size (config_resolved.yaml,
results.json, samples.txt, loss.png, bench.json), tags missing, the data as dataset inputs, the
status: FINISHED when results.json holds the results, KILLED when it says the run was stopped
(`stopped_by`), and a finished run's model (tracking.log_model) when the store has none of its
last step with its files (its figures are the run's own points: the count below is the store's).
A folder without results.json (a run still going, or one that died) leaves the status as it is
(RUNNING for a new record): sync again once it has ended. Folders of runs with
tracking.mlflow=false are skipped. Timestamps are approximate: spread by step between the folder's
first and last writes.

Prints one line per folder, `<folder>: up to date` or `<folder>: recorded as run <id> (N metric
points, M params, K artifacts)`. A folder that cannot be recorded (its store does not answer, or
fails midway) is one line on stderr, `gptlab.sync: error: <folder>: not recorded: <store and why>;
<what to do>`; the folders after it are still tried (a store that could not be opened is not asked
again), and the exit code is 2 once all were tried (0 when every folder was recorded or up to date).

The root config is conf/sync.yaml: the training config (its `tracking.uri` names the store) and the
command's own key `sync.folders`; the words without `=` are the folders (`sync.folders=[a,b]`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from hydra.core.config_store import ConfigStore

from gptlab.cli import VALUE_OPTIONS, command, fail, hydra_quote
from gptlab.config import Config, to_config
from gptlab.errors import GptlabError, as_user_error
from gptlab.records import identity, layout, lineage, parent
from gptlab.records.layout import PREVIOUS, read_metrics, read_results
from gptlab.records.store import (
    DEFAULT_OUTPUTS,
    PARENT_TAG,
    SUMMARY_METRICS,
    artifact_root,
    flatten,
    get_or_create_experiment,
    log_params,
    mlflow_metrics,
    open_store,
    store_failure,
)

SYNC_TAG = "recorded_by"  # on the runs (and sweep parents) that sync created
AGAIN = "then run gptlab.sync again (it sends only what the store lacks)"
# Hydra's options that take the next word as their value (--info takes one only when it is a topic)
INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


@dataclass
class SyncSettings:
    """The command's own keys (values in conf/sync.yaml)."""

    # run folders or folders of them; empty: every run folder under outputs/runs, outputs/sweeps
    folders: List[str]


@dataclass
class SyncConfig(Config):
    """The training config with the `sync` section: the schema of conf/sync.yaml."""

    sync: SyncSettings


ConfigStore.instance().store(name="gptlab_sync_schema", node=SyncConfig)
# the words without `=` (main() gathers them: `sync.folders=[a,b]`)
POSITIONAL_LIST = "sync.folders"


def gather_words(args: Sequence[str], key: str = POSITIONAL_LIST) -> List[str]:
    """Gather the arguments' bare words into one `key=[...]` override, each quoted for Hydra.

    A bare word has no `=` and is not an option nor an option's value; each word is quoted so Hydra
    takes it as typed.
    """
    words: List[str] = []
    options: List[str] = []  # first: argparse takes no override after an option that follows one
    out: List[str] = []
    takes_value = False
    for i, arg in enumerate(args):
        if takes_value or arg.startswith("-"):
            options.append(arg)
            nxt = args[i + 1] if i + 1 < len(args) else ""
            takes_value = not takes_value and (
                arg in VALUE_OPTIONS or (arg in ("--info", "-i") and nxt in INFO_TOPICS)
            )
        elif "=" in arg:
            out.append(arg)
        else:
            words.append(arg)
    if words and any(arg.partition("=")[0].lstrip("+~") == key for arg in out):
        raise GptlabError(f"give the folders as words or as {key}=[...], not both")
    folders = [f"{key}=[{','.join(hydra_quote(w) for w in words)}]"] if words else []
    return options + out + folders


# ---- the folders ---------------------------------------------------------------------------------


@dataclass
class RunFolder:
    """What a run folder says about its run."""

    path: Path  # absolute
    config: Dict[str, Any]  # the resolved config
    results: Dict[str, Any]  # results.json ({} until the run ends)
    # sweep.json (or what multirun.yaml says) of the sweep holding it
    sweep: Optional[Dict[str, Any]]

    @functools.cached_property
    def run_identity(self) -> identity.RunIdentity:
        """What gptlab.train recorded the run as (or would have), with the origin run.json keeps.

        Read once per folder, for a new run and for the tags a found one lacks.
        """
        ident = identity.identify(self.config, self.path, identity.recorded_origin(self.path))
        if self.results.get("expected_met") is not None:
            ident.tags["expected_met"] = str(self.results["expected_met"]).lower()
        return ident


def runs_under(folder: Path) -> List[Path]:
    """The run folders that began recording in folder and one level deeper.

    One level deeper: outputs/sweeps/<sweep>/<job>.
    """
    return [d for d in layout.runs_in(folder, depth=2) if layout.started(d)]


def find_folders(names: Sequence[str], outputs: Path = DEFAULT_OUTPUTS) -> List[Path]:
    """The run folders to record (absolute, each once): those named, else all under outputs/.

    Those named, or all under outputs/runs and outputs/sweeps (paths.outputs).
    """
    if not names:
        roots = [Path(outputs) / "runs", Path(outputs) / "sweeps"]
        found = [d for root in roots if root.is_dir() for d in runs_under(root)]
        if not found:
            raise GptlabError(
                "no run folders under outputs/runs or outputs/sweeps "
                "(run from the folder holding outputs/, or name the folders: python -m gptlab.sync "
                "FOLDER ...)"
            )
        return [d.resolve() for d in found]
    out: List[Path] = []
    for name in names:
        folder = Path(name).expanduser()
        if not folder.is_dir():
            raise GptlabError(f"{name}: no such folder")
        inner = [folder] if layout.started(folder) else runs_under(folder)
        if not inner:
            raise GptlabError(
                f"{name}: not a run folder (it has no {' or '.join(layout.STARTED)}) and holds none"
            )
        out += [d.resolve() for d in inner if d.resolve() not in out]
    return out


def read_folder(path: Path) -> Optional[RunFolder]:
    """The run folder's config, results and sweep; None without a config to record the run by."""
    config = layout.read_config(path)
    if config is None:
        return None
    sweep = layout.read_sweep(path) or identity.sweep_from_multirun(path.parent)
    return RunFolder(path, config, read_results(path), sweep)


def target_uri(folder: RunFolder, given: Optional[str]) -> str:
    """The store: the one given, else the run's own (identity.store_of)."""
    return given or identity.store_of(folder.config, folder.sweep)


# ---- what the folder holds, as MLflow records it -------------------------------------------------


def folder_params(folder: RunFolder) -> Dict[str, Any]:
    """The resolved config, flattened, and the derived.* figures (derived.json).

    A folder written before derived.json existed has only derived.params, from results.json.
    """
    params = flatten(folder.config)
    with contextlib.suppress(OSError, ValueError):
        derived = json.loads((folder.path / layout.DERIVED).read_text())
        params.update({f"derived.{k}": v for k, v in derived.items()})
    if "derived.params" not in params and folder.results.get("params") is not None:
        params["derived.params"] = folder.results["params"]
    return params


def folder_points(folder: RunFolder) -> Dict[Tuple[str, int], float]:
    """(MLflow metric name, step) -> value of the folder's metrics.

    metrics.jsonl's rows, then results.json's summary/* at its last step.
    """
    points: Dict[Tuple[str, int], float] = {}
    for row in read_metrics(folder.path):
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            points.update({(name, row["step"]): v for name, v in mlflow_metrics(row).items()})
    r = folder.results
    if r:
        step = int(r.get("steps") or 0)
        for key, name in SUMMARY_METRICS.items():
            if isinstance(r.get(key), (int, float)):
                points[(name, step)] = float(r[key])
    return points


def _mtime_ms(path: Path) -> Optional[int]:
    return int(path.stat().st_mtime * 1000) if path.is_file() else None


def span_ms(path: Path) -> Tuple[int, int]:
    """(first, last) write of the run folder in ms: when the run started and last recorded."""
    hydra = path / layout.HYDRA
    first = [
        _mtime_ms(p)
        for p in (hydra / "config.yaml", hydra / "overrides.yaml", path / layout.CONFIG)
    ]
    last = [_mtime_ms(path / n) for n in (layout.RESULTS, layout.METRICS)]
    now = int(time.time() * 1000)
    start = min([t for t in first if t is not None], default=now)
    return start, max([t for t in last if t is not None] + [start])


# ---- one store -----------------------------------------------------------------------------------


def _not_found(e: Exception) -> bool:
    return getattr(e, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def _quoted(value: str) -> str:
    """A string value of an MLflow search filter."""
    return f'"{value}"' if "'" in value else f"'{value}'"


@dataclass
class Sent:
    """What one sync sent for one folder."""

    points: int = 0
    params: int = 0
    artifacts: int = 0
    status: Optional[str] = None  # the status set, when sync changed it
    model: Optional[str] = None  # the run's MLflow model, when sync logged it

    def __bool__(self) -> bool:
        return bool(self.points or self.params or self.artifacts or self.status or self.model)


@dataclass
class Store:
    """One tracking store: its client, and the sweep parent runs found or made in it."""

    uri: str
    client: Any
    # sweep_dir -> (run id, experiment id)
    parents: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    ours: Set[str] = field(default_factory=set)  # parents that sync made
    # parents a child of which this sync recorded something of
    touched: Set[str] = field(default_factory=set)

    @classmethod
    def open(cls, uri: str) -> "Store":
        advice = f"start it (or name another store with tracking.uri=...), {AGAIN}"
        return cls(uri, open_store(uri, advice))

    def get_run(self, run_id: Optional[str]) -> Any:
        """The run, or None when this store has no such run."""
        if not run_id:
            return None
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException as e:
            if _not_found(e):
                return None
            raise

    def search_one(self, filter_string: str, skip: Sequence[str] = ()) -> Any:
        """The latest run of any experiment (deleted ones too) matching filter, but those in skip.

        None when there is none.
        """
        from mlflow.entities import ViewType

        ids = [e.experiment_id for e in self.client.search_experiments(view_type=ViewType.ALL)]
        runs = self.client.search_runs(
            ids,
            filter_string,
            run_view_type=ViewType.ALL,
            max_results=100,
            order_by=["attributes.start_time DESC"],
        )
        return next((r for r in runs if r.info.run_id not in skip), None) if ids else None

    def find_run(self, folder: RunFolder) -> Any:
        """The folder's run: results.json's run when this store has it, else the run tagged with it.

        The runs tagged with the folder leave out the earlier runs moved aside into previous/<time>/
        (they had the same tag).
        """
        earlier = [
            read_results(p).get("mlflow_run_id") for p in sorted((folder.path / PREVIOUS).glob("*"))
        ]
        return self.get_run(folder.results.get("mlflow_run_id")) or self.search_one(
            f"tags.run_dir = {_quoted(str(folder.path))}", skip=[i for i in earlier if i]
        )

    def parent(self, sweep: Dict[str, Any]) -> Tuple[str, str]:
        """(run id, experiment id) of the sweep's parent run in this store.

        Made from sweep.json if missing.
        """
        key = sweep["sweep_dir"]
        if key not in self.parents:
            run = self.get_run(sweep.get("parent_run_id")) or self.search_one(
                f"tags.run_type = 'sweep' and tags.sweep_dir = {_quoted(key)}"
            )
            if run is None:
                run = self.create_parent(sweep)
            if run.data.tags.get(SYNC_TAG):
                self.ours.add(run.info.run_id)
            self.parents[key] = (run.info.run_id, run.info.experiment_id)
        return self.parents[key]

    def create_parent(self, sweep: Dict[str, Any]) -> Any:
        """The sweep's parent run as gptlab.search.callbacks records it (records/parent.py)."""
        start = min([span_ms(p)[0] for p in runs_under(Path(sweep["sweep_dir"]))], default=None)
        run = parent.create(self.client, self.uri, sweep, {SYNC_TAG: "gptlab.sync"}, start)
        print(f"{sweep['sweep_dir']}: recorded as sweep run {run.info.run_id}", flush=True)
        return self.client.get_run(run.info.run_id)

    def close(self) -> None:
        """End the parent runs sync made whose children it recorded, as the sweep's end would have.

        Their status is FINISHED, or FAILED when a job failed; their figure the best
        summary/best_val_loss.
        """
        from gptlab.distributed import slurm  # submitit: off the command's start-up

        for sweep_dir, (run_id, experiment_id) in self.parents.items():
            if run_id in self.ours and run_id in self.touched:
                parent.end(
                    self.client, experiment_id, run_id, stopped=False, job_error=slurm.job_error
                )
                print(f"{sweep_dir}: sweep run {run_id} ended from its jobs' records", flush=True)


# ---- one folder ----------------------------------------------------------------------------------


def create_run(store: Store, folder: RunFolder) -> Any:
    """A new run for the folder, named, tagged and placed as gptlab.train would have.

    Placed: nested in its sweep.
    """
    ident = folder.run_identity
    tags = {**ident.tags, SYNC_TAG: "gptlab.sync"}
    if folder.sweep is not None:
        parent_id, experiment_id = store.parent(folder.sweep)
        tags.update(parent.child_tags(folder.sweep, parent_id))
    else:
        experiment_id = get_or_create_experiment(
            store.client, ident.experiment, artifact_root(store.uri)
        )
    run = store.client.create_run(
        experiment_id, run_name=ident.name, tags=tags, start_time=span_ms(folder.path)[0]
    )
    return store.client.get_run(run.info.run_id)


def send_metrics(client: Any, run_id: str, folder: RunFolder) -> int:
    """The metric points the run lacks; returns how many were sent."""
    from mlflow.entities import Metric

    points = folder_points(folder)
    have: Set[Tuple[str, int]] = set()
    for name in sorted({name for name, _ in points}):
        have |= {(name, m.step) for m in client.get_metric_history(run_id, name)}
    missing = sorted((k, v) for k, v in points.items() if k not in have)
    start, end = span_ms(folder.path)
    last = max([step for (_, step) in points] + [1])
    metrics = [
        Metric(name, v, start + (end - start) * max(step, 0) // last, step)
        for (name, step), v in missing
    ]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000])
    return len(metrics)


def send_artifacts(client: Any, run_id: str, path: Path) -> int:
    """The folder's artifacts the run lacks, or has in another size.

    Another size: a results.json rewritten by a resume, for one.
    """
    have = {a.path: a.file_size for a in client.list_artifacts(run_id)}
    sent = 0
    for name in layout.ARTIFACTS:
        if (path / name).is_file() and have.get(name) != (path / name).stat().st_size:
            client.log_artifact(run_id, str(path / name))
            sent += 1
    return sent


def send_status(client: Any, run: Any, folder: RunFolder) -> Optional[str]:
    """The run's final status once results.json holds the results; None: unchanged.

    FINISHED, or KILLED when the run was stopped.
    """
    if not folder.results:
        return None
    status = "KILLED" if folder.results.get("stopped_by") else "FINISHED"
    if run.info.status == status:
        return None
    client.set_terminated(
        run.info.run_id, status=status, end_time=_mtime_ms(folder.path / layout.RESULTS)
    )
    return status


def complete(store: Store, run: Any, folder: RunFolder) -> Sent:
    """Send what the run lacks of the folder.

    That is metric points, params, artifacts, tags and the status.
    """
    client, run_id = store.client, run.info.run_id
    params = {k: v for k, v in folder_params(folder).items() if k not in run.data.params}
    log_params(client, run_id, params)
    for key, value in folder.run_identity.tags.items():
        if key not in run.data.tags:
            client.set_tag(run_id, key, value)
    send_datasets(client, run, folder)
    sent = Sent(
        points=send_metrics(client, run_id, folder),
        params=len(params),
        artifacts=send_artifacts(client, run_id, folder.path),
        status=send_status(client, run, folder),
    )
    sent.model = send_model(store, run_id, folder)
    return sent


def send_model(store: Store, run_id: str, folder: RunFolder) -> Optional[str]:
    """Log a finished run's model (tracking.log_model) when the store lacks it; its URI, or None.

    It is what the run's end logs when its store answers. None when nothing was logged.
    """
    tracking, train = folder.config.get("tracking") or {}, folder.config.get("train") or {}
    results = folder.results
    if not (results and results.get("stopped_by") is None and tracking.get("log_model")):
        return None
    from gptlab.checkpoint import state as checkpoint
    from gptlab.registry import serving

    if not train.get("save_checkpoints", True):
        return None
    if checkpoint.latest(folder.path / layout.CHECKPOINTS) is None:
        return None
    if serving.logged_at(store.uri, run_id, int(results.get("steps") or 0))[0]:
        return None
    return serving.log_checkpoint(folder.path, store.uri, run_id, results).model_uri


def send_datasets(client: Any, run: Any, folder: RunFolder) -> int:
    """The folder's dataset inputs the run lacks (records/lineage.py); how many were sent."""
    datasets = lineage.read(folder.path) or []
    inputs = getattr(run, "inputs", None)
    have = {(i.dataset.name, i.dataset.digest) for i in (inputs.dataset_inputs if inputs else [])}
    missing = [d for d in datasets if (d["name"], d["digest"]) not in have]
    if missing:
        client.log_inputs(run.info.run_id, datasets=lineage.dataset_inputs(missing))
    return len(missing)


def sync_folder(store: Store, folder: RunFolder) -> str:
    """Record one run folder in the store; the line that says what was done."""
    run = store.find_run(folder)
    if run is not None and run.info.lifecycle_stage == "deleted":
        return f"{folder.path}: skipped (its MLflow run {run.info.run_id} is deleted)"
    created = run is None
    if created:
        run = create_run(store, folder)
    sent = complete(store, run, folder)
    parent = run.data.tags.get(PARENT_TAG)
    if parent and (sent or created):
        store.touched.add(parent)
    note = "" if folder.results else " (no results.json yet: its status is left as it is)"
    if not (sent or created):
        return f"{folder.path}: up to date{note}"
    what = f"{sent.points} metric points, {sent.params} params, {sent.artifacts} artifacts"
    status = f", {sent.status}" if sent.status else ""
    status += f", its model {sent.model}" if sent.model else ""
    return f"{folder.path}: recorded as run {run.info.run_id} ({what}{status}){note}"


class NotRecorded(GptlabError):
    """Folders that sync could not record (each named in its own line as it happened)."""


def sync(paths: Sequence[Path], uri: Optional[str] = None) -> List[str]:
    """Record the run folders (each in its store: uri, else its own); the lines printed.

    One line is printed per folder.

    A folder that cannot be recorded (its store does not answer, or fails midway) is one line on
    stderr, `gptlab.sync: error: <folder>: not recorded: ...`, and the folders after it are still
    tried; then NotRecorded is raised, naming how many were not.
    """
    # uri -> its Store, or the error of a store that could not be opened
    stores: Dict[str, Any] = {}
    lines, failed = [], 0
    try:
        for path in paths:
            try:
                line = sync_path(stores, path, uri)
            except GptlabError as e:
                failed += 1
                print(f"gptlab.sync: error: {path}: not recorded: {e}", file=sys.stderr, flush=True)
                continue
            print(line, flush=True)
            lines.append(line)
    finally:
        for store in stores.values():
            if isinstance(store, Store):
                store.close()
    if failed:
        raise NotRecorded(f"{failed} of {len(paths)} folders not recorded (each named above)")
    return lines


def sync_path(stores: Dict[str, Any], path: Path, uri: Optional[str]) -> str:
    """Record one folder in its store; the line that says what was done. Raises GptlabError.

    The stores are opened once for all the folders: a store that could not be opened is not asked
    again.
    """
    folder = read_folder(path)
    if folder is None:
        return f"{path}: skipped (no config_resolved.yaml or .hydra/config.yaml to record it by)"
    if (folder.config.get("tracking") or {}).get("mlflow") is False:
        return f"{path}: skipped (it ran with tracking.mlflow=false)"
    target = target_uri(folder, uri)
    if target not in stores:
        try:
            stores[target] = Store.open(target)
        except GptlabError as e:
            stores[target] = e
    if isinstance(stores[target], GptlabError):
        raise stores[target]
    # the store failed midway: one line, and sync again later
    with as_user_error(lambda e: f"MLflow {store_failure(target, e)} (it failed midway); {AGAIN}"):
        return sync_folder(stores[target], folder)


def run_sync(cfg: Any) -> List[str]:
    """Record the folders of sync.folders (all under outputs/ when empty).

    cfg: composed from conf/sync.yaml.
    """
    config = to_config(cfg, SyncConfig)
    return sync(find_folders(config.sync.folders, Path(config.paths.outputs)), config.tracking.uri)


def sync_command_line(cfg: Any) -> List[str]:
    """Run run_sync for the command line: folders not recorded end it with exit code 2.

    Their lines are already printed (one each, not a summary line after them).
    """
    try:
        return run_sync(cfg)
    except NotRecorded:
        sys.exit(2)


def main(argv: Optional[List[str]] = None) -> Any:
    """python -m gptlab.sync [FOLDER ...] [overrides]: a Hydra app on conf/sync.yaml.

    The words without `=` are the folders (sync.folders=[...]). argv: the same arguments, to run it
    in this process (errors raise GptlabError, folders not recorded NotRecorded); it returns the
    lines printed.
    """
    if argv is not None:
        return command("sync", run_sync, gather_words(argv))
    try:
        sys.argv[1:] = gather_words(sys.argv[1:])
    except GptlabError as e:
        fail("gptlab.sync", e)
    return command("sync", sync_command_line)


if __name__ == "__main__":
    main()
