"""python -m gptlab.eval run=PATH tasks=[...]: lm-evaluation-harness scores of a run's checkpoint.

PATH is a run folder (its newest checkpoint, or the best with which=best; whole or sharded) or a
checkpoint file. The model and tokenizer are gptlab's own, rebuilt from the checkpoint
(``gptlab.model.inference.load_model``) and wrapped as an lm_eval model
(gptlab/evaluation/harness.py). Tasks come from lm_eval's registry, from gptlab's own
conf/eval_tasks/ (always; its example task works by name), or from another folder of task YAMLs
(eval.include=DIR). A local task's data files are checked before any model work
(gptlab/evaluation/taskdata.py); a task whose data live on the Hugging Face Hub, when the Hub does
not answer, loads from the local cache or fails at once (gptlab/evaluation/loading.py). The results
go to the console as a table, to eval.json in the run folder, and to the run's own MLflow run as
eval/<task>/<metric> at the checkpoint's step. PATH may also be a logged or registered model
(models:/NAME/1, models:/NAME@champion, runs:/<id>/model): it is downloaded from tracking_uri's
store (else $MLFLOW_TRACKING_URI, else outputs/mlflow.db), its figures go to the MLflow run the
model came from, and eval.json beside the downloaded model.

With hardware.nproc_per_node > 1 (or under torchrun / SLURM), each rank scores a stride of every
task's documents and rank 0 gathers the per-document results: the figures equal one process's.
The root config is conf/eval.yaml (``EvalConfig``); it needs the ``eval`` extra (lm_eval).
"""

from __future__ import annotations

import datetime
import difflib
import functools
import json
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from gptlab.cli import CONF, command, require, text_keys
from gptlab.config import HardwareConfig, ParallelismConfig, to_config
from gptlab.errors import GptlabError, as_user_error, never_fatal
from gptlab.evaluation import loading, taskdata
from gptlab.evaluation.taskdata import Spec
from gptlab.records import layout

log = logging.getLogger("gptlab.eval")


@dataclass
class EvalSettings:
    """The `eval` section of conf/eval.yaml (the values are there)."""

    include: Optional[str]  # another folder of task YAMLs (conf/eval_tasks is always included)
    limit: Optional[float]  # documents per task (a fraction when < 1); null: all
    batch_size: int  # requests per forward
    num_fewshot: Optional[int]  # null: each task's own
    precision: str  # auto (bf16 on a GPU, fp32 on the CPU) | fp32 | bf16
    rolling_context: int  # tokens of context each rolling window carries over (perplexity tasks)
    bootstrap_iters: int  # resamples for the stderr of metrics that are not means
    mlflow: bool  # log the metrics into the run's MLflow run
    seed: int


@dataclass
class EvalConfig:
    """The schema of conf/eval.yaml."""

    run: str  # run folder or checkpoint file (mandatory: ???)
    tasks: List[str]
    which: str  # latest | best
    tracking_uri: Optional[str]  # null: the store the run was recorded in
    eval: EvalSettings
    hardware: HardwareConfig


ConfigStore.instance().store(name="gptlab_eval_schema", node=EvalConfig)
TEXT_KEYS = text_keys(EvalConfig)  # run=, which= are text as typed (cli.hydra_words)
# lm_eval's process group needs only replicas: every rank holds the whole model
REPLICAS = ParallelismConfig("ddp", "ddp", False, True, 0, False, 1800)
TASKS = CONF / "eval_tasks"  # gptlab's own task YAMLs, always included


def check_settings(cfg: EvalConfig) -> None:
    if not cfg.tasks:
        raise GptlabError("tasks=[...]: name at least one task (tasks=[hellaswag] or a local one)")
    limit = cfg.eval.limit
    if limit is not None and limit <= 0:
        raise GptlabError(f"eval.limit={limit:g}: give a positive number of documents, or null")
    if cfg.eval.precision not in ("auto", "fp32", "bf16"):
        raise GptlabError(f"eval.precision={cfg.eval.precision}: must be auto, fp32 or bf16")
    if cfg.eval.include and not Path(cfg.eval.include).is_dir():
        raise GptlabError(f"eval.include={cfg.eval.include}: not a folder of task YAMLs")


def task_folders(include: Optional[str]) -> Tuple[str, ...]:
    """The folders of task YAMLs: gptlab's conf/eval_tasks, and eval.include's."""
    folders = [str(TASKS.resolve())]
    if include and str(Path(include).resolve()) not in folders:
        folders.append(str(Path(include).resolve()))
    return tuple(folders)


@functools.lru_cache(maxsize=8)
def _task_manager(folders: Tuple[str, ...], registry: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(folders), include_defaults=registry)


def task_manager(include: Optional[str], tasks: Sequence[str] = ()) -> Any:
    """lm_eval's index of tasks, one index serving every call in a process.

    The local folders' alone when they hold every task named (the registry's thousands of YAMLs take
    seconds to index), else with the registry.
    """
    folders = task_folders(include)
    if tasks:
        local = _task_manager(folders, False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return _task_manager(folders, True)


def check_tasks(manager: Any, tasks: List[str], include: Optional[str]) -> None:
    """Checks that every task is known to lm_eval's registry or a local folder.

    Else one line with the nearest names and where tasks come from.
    """
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            folders = f"{TASKS}" + (f" or {include}" if include else "")
            raise GptlabError(
                f"task {name!r} is not in lm_eval's registry or {folders}{hint}; tasks are "
                f"lm_eval's (lm-eval ls tasks), gptlab's conf/eval_tasks, and the task YAMLs of "
                f"a folder given as eval.include=DIR"
            )


def task_specs(manager: Any, tasks: List[str]) -> Tuple[List[Spec], List[str]]:
    """What lm_eval loads for each task, and the tasks whose data come from elsewhere.

    Each task's local data is checked first: one line for a broken file. Elsewhere is the Hugging
    Face Hub.
    """
    specs, remote = [], []
    for name in tasks:
        spec = taskdata.local_spec(manager, name)
        specs.append(name if spec is None else spec)
        if spec is None:
            remote.append(name)
    return specs, remote


def load_tasks(manager: Any, specs: Sequence[Spec]) -> Dict[str, Any]:
    """lm_eval's task objects, their data loaded.

    A task whose data cannot be had is one line naming the cause.
    """
    from lm_eval.tasks import get_task_dict

    loaded: Dict[str, Any] = {}
    for spec in specs:
        name = spec if isinstance(spec, str) else spec["task"]

        # datasets / hub / connection errors of every kind, as one line naming the cause
        def failure(e: BaseException, name: str = name) -> str:
            return loading.failure(name, e, taskdata.dataset_of(manager, name))

        # lm_eval 0.4.13 deprecates get_task_dict for TaskManager.load
        with as_user_error(failure), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            loaded.update(get_task_dict([spec], manager))
    return loaded


def autocast_for(precision: str, device: Any):
    """(the autocast context, the precision) for evaluation.

    auto is training's rule on a GPU (bf16 from Ampere on; torch.cuda.is_bf16_supported() also
    counts emulated bf16) and fp32 on the CPU.
    """
    from gptlab.perf import fastpath
    from gptlab.training.build import autocast_factory

    if precision == "auto":
        cuda = device.type == "cuda"
        precision = fastpath.choose_precision("auto", "cuda", 0).value if cuda else "fp32"
    return autocast_factory(device.type, precision), precision


def summarize(results: Dict[str, Any], tasks: List[str]) -> List[Dict[str, Any]]:
    """lm_eval's results as rows: task, metric, value, stderr, number of documents."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        n = (results.get("n-samples") or {}).get(task, {}).get("effective")
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            skip = key == "alias" or metric in ("sample_len",) or metric.endswith("_stderr")
            if skip or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append(
                {
                    "task": task,
                    "metric": metric if filt in ("none", "") else f"{metric}_{filt}",
                    "value": float(value),
                    "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                    "n": n,
                }
            )
    return rows


Source = Dict[str, Optional[str]]  # a downloaded model: its folder, store and source run


def fetch_model(cfg: EvalConfig) -> Source:
    """run=<model URI>: the model downloaded (once, before any rank starts), where it came from."""
    from gptlab.records.store import default_uri
    from gptlab.registry import serving

    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()
    folder = serving.download(uri, cfg.run, Path(tempfile.mkdtemp(prefix="gptlab-eval-")))
    return {"folder": str(folder), "store": uri, "run_id": serving.source_run(uri, cfg.run)}


def load_scored(cfg: EvalConfig, device: Any, source: Optional[Source]) -> tuple:
    """(model, tokenizer, step, what it is, its MLflow run id) of run=."""
    if source is not None:
        from gptlab.registry import serving

        model, tokenizer, meta = serving.load_export(Path(source["folder"]))
        return model.to(device), tokenizer, int(meta.get("step") or 0), cfg.run, source["run_id"]
    from gptlab.checkpoint import state as checkpoint
    from gptlab.model.inference import load_model

    path = checkpoint.find(cfg.run, cfg.which)
    model, tokenizer, saved = load_model(str(path), "latest", str(device))
    return model, tokenizer, saved.step, str(path.resolve()), saved.mlflow_run_id


def run_harness(lm: Any, tasks: List[Any], cfg: EvalConfig, manager: Any) -> Dict[str, Any]:
    """lm-eval's simple_evaluate of the tasks on lm, every seed from eval.seed."""
    from lm_eval import evaluator

    limit = cfg.eval.limit
    return evaluator.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=cfg.eval.num_fewshot,
        limit=int(limit) if limit is not None and limit >= 1 else limit,
        bootstrap_iters=cfg.eval.bootstrap_iters,
        log_samples=False,
        task_manager=manager,
        random_seed=cfg.eval.seed,
        numpy_random_seed=cfg.eval.seed,
        torch_random_seed=cfg.eval.seed,
        fewshot_random_seed=cfg.eval.seed,
    )


def evaluate_checkpoint(
    cfg: EvalConfig,
    rank: int,
    world: int,
    device: Any,
    source: Optional[Source] = None,
    specs: Optional[List[Spec]] = None,
) -> Optional[Dict]:
    """Score the checkpoint on every rank; rank 0 returns eval.json's body, the others None.

    The tasks are loaded first, then the model. specs: the tasks as task_specs gave them (None: from
    cfg.tasks).
    """
    import lm_eval

    from gptlab.evaluation.harness import GptlabLM

    manager = task_manager(cfg.eval.include, cfg.tasks)
    check_tasks(manager, cfg.tasks, cfg.eval.include)
    limit = cfg.eval.limit
    with loading.progress_bars(rank == 0 and loading.terminal()), loading.no_environment_report():
        task_dict = load_tasks(manager, specs or task_specs(manager, cfg.tasks)[0])
        model, tokenizer, step, scored, run_id = load_scored(cfg, device, source)
        autocast, precision = autocast_for(cfg.eval.precision, device)
        lm = GptlabLM(
            model,
            tokenizer,
            device,
            cfg.eval.batch_size,
            autocast,
            rank,
            world,
            cfg.eval.rolling_context,
        )
        results = run_harness(lm, list(task_dict.values()), cfg, manager)
    if rank != 0:
        return None
    from importlib.metadata import version

    from lm_eval.utils import make_table

    return {
        "checkpoint": scored,
        "step": step,
        "tasks": list(cfg.tasks),
        "limit": limit,
        "num_fewshot": cfg.eval.num_fewshot,
        "precision": precision,
        "processes": world,
        "lm_eval_version": getattr(lm_eval, "__version__", None) or version("lm_eval"),
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "results": summarize(results, cfg.tasks),
        "table": make_table(results),
        "mlflow_run_id": run_id,
    }


def record(cfg: EvalConfig, body: Dict[str, Any], source: Optional[Source] = None) -> Path:
    """eval.json in the run folder (atomically), and the metrics in the run's MLflow run."""
    folder = Path(source["folder"]) if source else layout.run_folder_of(Path(body["checkpoint"]))
    path = folder / layout.EVAL
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)
    if cfg.eval.mlflow:
        log_to_mlflow(cfg, folder, body, path, source and source["store"])
    return path


def log_to_mlflow(
    cfg: EvalConfig, folder: Path, body: Dict[str, Any], path: Path, store_uri: Optional[str]
) -> None:
    from gptlab.records import identity, store

    run_id = body.get("mlflow_run_id") or layout.read_results(folder).get("mlflow_run_id")
    config = layout.read_config(folder) or {}
    uri = store_uri or cfg.tracking_uri or identity.store_of(config, layout.read_sweep(folder))
    if run_id is None:
        log.warning("eval: the run has no MLflow run to record into; eval.json holds the results")
        return
    db = store.sqlite_path(uri)

    def unrecorded(e: BaseException) -> None:  # eval.json is written; the store is a copy
        log.warning(f"eval: MLflow {store.store_failure(uri, e)}; eval.json holds the results")

    with never_fatal(unrecorded):
        if db is not None and not db.is_file():
            raise store.Unreachable(f"store {db} does not exist")
        store.check_reachable(uri)
        client = store.mlflow_client(uri)
        metrics = {}
        for r in body["results"]:
            metrics[f"eval/{r['task']}/{r['metric']}"] = r["value"]
            if r["stderr"] is not None:
                metrics[f"eval/{r['task']}/{r['metric']}_stderr"] = r["stderr"]
        from mlflow.entities import Metric

        now = int(datetime.datetime.now().timestamp() * 1000)
        points = [Metric(k, v, now, body["step"]) for k, v in metrics.items()]
        client.log_batch(run_id, metrics=points)
        client.log_artifact(run_id, str(path))
        log.info(f"eval: recorded in MLflow run {run_id} ({store.store_name(uri)})")


def _evaluate(
    resolved: Dict[str, Any], source: Optional[Source], specs: Optional[List[Spec]] = None
) -> Optional[Path]:
    """This process's share: join the group, score, and on rank 0 write the records."""
    from gptlab.distributed import (
        world as distributed,  # torch: off the start-up path of --help and config errors
    )

    cfg = to_config(OmegaConf.create(resolved), EvalConfig)
    d = distributed.setup(cfg.hardware, REPLICAS)
    try:
        body = evaluate_checkpoint(cfg, d.rank, d.world_size, d.device, source, specs)
        if body is None:
            return None
        table = body.pop("table", None)
        if table:
            print(table, flush=True)
        path = record(cfg, body, source)
        print(f"eval: {len(body['results'])} figures at step {body['step']} -> {path}", flush=True)
        return path
    finally:
        distributed.teardown()


def _worker(
    resolved: Dict[str, Any], source: Optional[Source], specs: Optional[List[Spec]] = None
) -> None:
    """One locally spawned rank (distributed.spawn sets RANK / WORLD_SIZE)."""
    from gptlab import console
    from gptlab.cli import fail

    console.setup_logging()
    console.local_bars()  # tqdm's default lock would be a semaphore the launcher calls leaked
    try:
        _evaluate(resolved, source, specs)
    except GptlabError as e:
        rank = os.environ.get("RANK", "0")
        fail("gptlab.eval", str(e) if rank == "0" else f"[rank {rank}] {e}")


def run_eval(config: Any) -> Optional[Path]:
    """Evaluate and return eval.json's path. config: composed from conf/eval.yaml."""
    require(config, "run", "run=PATH, a run folder or a checkpoint file")
    cfg = to_config(config, EvalConfig)
    check_settings(cfg)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise GptlabError(
            "gptlab.eval needs lm-evaluation-harness: pip install -e '.[eval]'"
        ) from None
    # torch: off the start-up path of --help and config errors (imported once the config is valid)
    from gptlab.checkpoint import state as checkpoint
    from gptlab.distributed import world as distributed
    from gptlab.registry import serving

    source = None
    if serving.is_model_uri(cfg.run):
        source = fetch_model(cfg)  # an unknown model: one line before any process starts
    else:
        checkpoint.find(cfg.run, cfg.which)  # no checkpoint: one line, the same
    manager = task_manager(cfg.eval.include, cfg.tasks)
    check_tasks(manager, cfg.tasks, cfg.eval.include)
    specs, remote = task_specs(manager, cfg.tasks)  # a broken local file: one line, no model yet
    resolved = OmegaConf.to_container(config, resolve=True)
    with loading.hub_access(bool(remote)):
        if distributed.role(cfg.hardware) != "parent":
            return _evaluate(resolved, source, specs)
        if remote:  # the launcher downloads once (or says why not); its ranks read the cache
            with loading.progress_bars(loading.terminal()):
                load_tasks(manager, remote)
        distributed.spawn(_worker, cfg.hardware.nproc_per_node, (resolved, source, specs))
    if source:
        return Path(source["folder"]) / layout.EVAL
    return layout.run_folder_of(checkpoint.find(cfg.run, cfg.which)) / layout.EVAL


def main(argv: Optional[List[str]] = None) -> Optional[Path]:
    """python -m gptlab.eval run=PATH tasks=[...] [key=value ...]: a Hydra app on conf/eval.yaml.

    argv: the same key=value arguments, to evaluate in this process (returns eval.json's path;
    errors raise GptlabError).
    """
    return command("eval", run_eval, argv)


if __name__ == "__main__":
    main()
