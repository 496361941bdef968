"""A run folder's layout: its file names, what counts as a run folder, job order, readers.

The one place its file names, what counts as a run folder, the order of a sweep's jobs and the
readers of its files are written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from gptlab.errors import or_none

METRICS = "metrics.jsonl"  # one JSON row per logged step (train, val, lr, throughput)
# results.json's stopped_by of a search trial that its pruner stopped (gptlab/search/trial.py)
PRUNED = "pruned"
RESULTS = "results.json"  # the run's final figures, written when it ends
CONFIG = "config_resolved.yaml"  # the config with interpolations filled in
DERIVED = "derived.json"  # figures derived from the config (accumulation, FLOPs per token, ...)
IDENTITY = "run.json"  # what the run is recorded as in MLflow (records/identity.py)
SAMPLES = "samples.txt"
LOSS_PLOT = "loss.png"
SLURM = "slurm.json"  # the SLURM job that ran it (gptlab/distributed/slurm.py)
RESTARTS = "restarts.json"  # each restart after a failure (gptlab/distributed/restarts.py)
BENCH = "bench.json"
DATASETS = "datasets.json"  # the run's data as MLflow dataset inputs (records/lineage.py)
EVAL = "eval.json"  # gptlab.eval's results of the run's checkpoint (gptlab/evaluation/)
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
EXPORT = "export"
HYDRA = ".hydra"  # Hydra's own: config.yaml, overrides.yaml, hydra.yaml
LOG = "train.log"
PREVIOUS = "previous"  # earlier runs' files, moved aside into previous/<time>/
LOCK = ".gptlab.lock"
# each rank's step in progress, 8 bytes at 8 x rank (gptlab/distributed/restarts.py)
PROGRESS = ".gptlab.progress"
# a dead worker's record, left by the launcher for the next start to complete
FAILURE = ".gptlab.failure.json"
SWEEP = "sweep.json"  # in a sweep folder: the MLflow parent run its jobs nest under
SWEEP_KIND = "gptlab-sweep"  # sweep.json's "kind"
MULTIRUN = "multirun.yaml"  # Hydra's, in every sweep folder

# What a run folder holds besides Hydra's .hydra/ and the log file (a new attempt owns those)
RECORDS = (
    CHECKPOINTS,
    METRICS,
    RESULTS,
    SAMPLES,
    LOSS_PLOT,
    CONFIG,
    DERIVED,
    IDENTITY,
    TENSORBOARD,
    SLURM,
    BENCH,
    EXPORT,
    EVAL,
    DATASETS,
    RESTARTS,
)
ARTIFACTS = (CONFIG, RESULTS, SAMPLES, LOSS_PLOT, BENCH)  # what MLflow keeps a copy of
STARTED = (METRICS, CONFIG)  # a run folder whose run began recording


def is_run_folder(folder: Path) -> bool:
    """A folder a run's job made: Hydra's .hydra/, or records of a run (written without Hydra)."""
    folder = Path(folder)
    return (folder / HYDRA).is_dir() or started(folder)


def run_folder_of(path: Path) -> Path:
    """The run folder a command's run= names.

    A run folder itself, or the folder of one of its checkpoints (<run>/checkpoints/ckpt_<step>.pt,
    or a sharded ckpt_<step>/); a checkpoint file kept elsewhere: the folder it is in.
    """
    path = Path(path)
    if path.parent.name == CHECKPOINTS:
        return path.parent.parent
    return path.parent if path.is_file() else path


def started(folder: Path) -> bool:
    """Whether the run in folder began recording (a job that failed at its start did not)."""
    return any((Path(folder) / name).is_file() for name in STARTED)


def job_order(path: Path) -> Tuple[str, bool, int, str]:
    """Sort key: a sweep's jobs in their numeric order (2 before 10), other folders by name."""
    path = Path(path)
    digit = path.name.isdigit()
    return (str(path.parent), not digit, int(path.name) if digit else 0, path.name)


def runs_in(folder: Path, depth: int = 1) -> List[Path]:
    """The run folders in folder, in job order.

    Directly in folder (depth 1) or also one level deeper (depth 2: a folder of sweeps).
    """
    pattern = [*Path(folder).glob("*"), *(Path(folder).glob("*/*") if depth > 1 else [])]
    return sorted({d for d in pattern if d.is_dir() and is_run_folder(d)}, key=job_order)


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A JSON file's object; None when it is missing, cut short or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_yaml(path: Path) -> Optional[Dict[str, Any]]:
    """A YAML file's mapping, interpolations resolved where they can be (None if not readable)."""
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        return None
    from omegaconf.errors import OmegaConfBaseException

    cfg = or_none(OmegaConf.load, path)  # None: a file cut short, or not YAML
    if cfg is None:
        return None
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:  # an interpolation only Hydra could resolve (${now:...})
        data = OmegaConf.to_container(cfg)
    return data if isinstance(data, dict) else None


def read_metrics(run_dir: Path) -> List[Dict[str, Any]]:
    """metrics.jsonl's rows (a line cut short by a killed run is left out)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def read_results(run_dir: Path) -> Dict[str, Any]:
    """A run folder's results.json ({} when it has none yet, or one cut short)."""
    return read_json(Path(run_dir) / RESULTS) or {}


def read_eval(run_dir: Path) -> List[Dict[str, Any]]:
    """eval.json's results (task, metric, value, stderr, ...); [] when there is none."""
    data = read_json(Path(run_dir) / EVAL) or {}
    return list(data.get("results", [])) if isinstance(data, dict) else []


def read_config(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The run's resolved config; None if neither copy reads.

    config_resolved.yaml, else Hydra's copy.
    """
    for path in (Path(run_dir) / CONFIG, Path(run_dir) / HYDRA / "config.yaml"):
        config = read_yaml(path)
        if config is not None:
            return config
    return None


def read_overrides(run_dir: Path) -> List[str]:
    """The command-line overrides Hydra recorded for the run folder (.hydra/overrides.yaml)."""
    path = Path(run_dir) / HYDRA / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    try:
        return [str(o) for o in (yaml.safe_load(path.read_text()) or [])]
    except (OSError, yaml.YAMLError):
        return []


def read_sweep(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The sweep.json of the sweep folder holding run_dir (sweep.dir/subdir), if any."""
    for folder in list(Path(run_dir).resolve().parents)[:3]:
        path = folder / SWEEP
        if path.is_file():
            info = read_json(path)
            if info is None or info.get("kind") != SWEEP_KIND:
                return None  # cut short, or somebody else's sweep.json
            return {**info, "sweep_dir": str(folder)}
    return None


def last_logged_step(run_dir: Path) -> int:
    """The last step recorded in a run folder's metrics.jsonl (0 when there is none)."""
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]
    return max(steps, default=0)
