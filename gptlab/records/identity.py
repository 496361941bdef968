"""What a run is recorded as: its MLflow experiment, name and tags, computed in one place.

gptlab.train, gptlab.bench, a sweep's callback (for a job that failed before it had a run) and
gptlab.sync (for a run recorded later) all call ``identify``, so a run recorded offline and synced
is named and tagged as it would have been live. The machine and commit a run ran on cannot be read
from its config: the tracker writes them into the run folder's run.json, which sync reads back.
"""

from __future__ import annotations

import json
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from gptlab.records import layout, store

NAME_TAGS = ("model", "data", "hardware")  # the tags a run's default name is made of
ORIGIN_TAGS = ("host", "git_commit")  # where the run ran, as only the running process knows
INIT_FROM_TAG = "gptlab.init_from"  # the weights a run started from (model.init_from)


@dataclass
class RunIdentity:
    """What a run is recorded as in MLflow."""

    experiment: str
    name: str
    tags: Dict[str, str]
    # the sweep the run is a job of (sweep.json's content, or what multirun.yaml says), if any
    sweep: Optional[Dict[str, Any]] = field(default=None, compare=False)


def run_name(model: str, data: str, hardware: str) -> str:
    """A run's default name: `<model>-<data>-<hardware>`."""
    return f"{model}-{data}-{hardware}"


def experiment_name(model: str, data: str) -> str:
    """A run's default experiment: `<model>-<data>` (runs on other hardware compare there)."""
    return f"{model}-{data}"


def _names(config: Mapping[str, Any]) -> List[str]:
    """(model, data, hardware) names of a resolved config."""
    return [str((config.get(k) or {}).get("name")) for k in NAME_TAGS]


def base_name(config: Mapping[str, Any]) -> str:
    """The run's name before a sweep adds the job's values.

    `bench-<model>-<hardware>` for a benchmark, else tracking.run_name, else
    `<model>-<data>-<hardware>`.
    """
    m, d, hw = _names(config)
    if "bench" in config:
        return f"bench-{m}-{hw}"
    return (config.get("tracking") or {}).get("run_name") or run_name(m, d, hw)


def swept(overrides: List[str]) -> List[str]:
    """The overrides that sweep (`optimizer.lr=1e-3,3e-3`, `range(...)`, ...), as typed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        return [o.input_line for o in parsed if o.is_sweep_override()]
    except HydraException:  # a name is not worth failing a sweep for
        return [o for o in overrides if "," in o]


def sweep_run_name(base: str, job_overrides: List[str], sweep: Dict[str, Any]) -> str:
    """A sweep job's name: the base name and the job's values of the swept keys.

    Hydra rewrites the job's other overrides (`x=false` becomes `x=False`), so only the keys are
    compared.
    """
    keys = set(sweep.get("swept") or [])
    if keys:
        own = [o for o in job_overrides if o.partition("=")[0] in keys]
    else:  # a sweeper that generates the values (no `a,b` on the command line): a search's trial
        given = set(sweep.get("overrides", []))
        own = [o for o in job_overrides if o not in given and not o.startswith(_UNNAMED)]
        if any(o.startswith("hparams_search.trial=") for o in own):  # sampled values: shortened
            own = [_short(o) for o in own]
    return f"{base} {' '.join(own)}" if own else base


# where the trial reports and which launch of it this is: not what it is
_UNNAMED = ("hparams_search.storage=", "hparams_search.attempt=")


def _short(override: str) -> str:
    """A sampled value's name, short enough to read in a list of runs.

    `hparams_search.trial=3` -> `trial=3`, `optimizer.lr=0.007230917851781505` -> `lr=0.007231`.
    """
    key, _, value = override.partition("=")
    try:
        number = float(value)
        value = value if value.lstrip("-").isdigit() else f"{number:.4g}"
    except ValueError:
        pass
    return f"{key.rsplit('.', 1)[-1]}={value}"


def sweep_identity(
    config: Mapping[str, Any], overrides: List[str], launcher: str, sweep_dir: Path
) -> Dict[str, Any]:
    """What sweep.json says of a sweep before its parent run exists.

    That is its experiment, store, name, and which keys it sweeps. config: the sweep's config (the
    launching process's, or multirun.yaml's).
    """
    tracking = config.get("tracking") or {}
    m, d, _ = _names(config)
    sweeping = swept(overrides)
    return {
        "kind": layout.SWEEP_KIND,
        "sweep_dir": str(Path(sweep_dir).resolve()),
        "uri": tracking.get("uri"),
        "experiment": tracking.get("experiment") or experiment_name(m, d),
        "overrides": overrides,
        "swept": [o.partition("=")[0] for o in sweeping],
        "launcher": launcher,
        "run_name": " ".join([base_name(config), "sweep", *sweeping]),
    }


def sweep_from_multirun(folder: Path) -> Optional[Dict[str, Any]]:
    """sweep_identity from the multirun.yaml Hydra writes in every sweep folder; None for no sweep.

    A sweep whose parent run could not be created has no sweep.json; None is for a folder that is no
    sweep.
    """
    cfg = layout.read_yaml(Path(folder) / layout.MULTIRUN)
    if cfg is None or not isinstance(cfg.get("hydra"), dict):
        return None
    overrides = [str(o) for o in (cfg["hydra"].get("overrides") or {}).get("task") or []]
    choices = (cfg["hydra"].get("runtime") or {}).get("choices", {})
    return sweep_identity(cfg, overrides, str(choices.get("hydra/launcher") or "basic"), folder)


def find_sweep(config: Mapping[str, Any], run_dir: Path) -> Optional[Dict[str, Any]]:
    """The sweep whose records the run belongs to: its sweep.json, or its multirun.yaml.

    multirun.yaml when the sweep could not write sweep.json; none when the run names a store of its
    own (tracking.uri) other than the sweep's.
    """
    sweep = layout.read_sweep(run_dir) or sweep_from_multirun(Path(run_dir).resolve().parent)
    own = (config.get("tracking") or {}).get("uri")
    if sweep is None or (own is not None and sweep.get("uri") not in (None, own)):
        return None
    return sweep


def git_commit() -> Optional[str]:
    try:
        here = Path(__file__).parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def this_process() -> Dict[str, str]:
    """The origin tags of a run started here: this machine, and gptlab's commit when it has one."""
    origin = {"host": socket.gethostname()}
    if commit := git_commit():
        origin["git_commit"] = commit
    return origin


def recorded_origin(run_dir: Path) -> Dict[str, str]:
    """The origin tags a run folder recorded (run.json).

    For a folder from before run.json, the SLURM node that ran it, when slurm.json says.
    """
    saved = layout.read_json(Path(run_dir) / layout.IDENTITY)
    if saved is not None and isinstance(saved.get("tags"), dict):
        return {k: str(v) for k, v in saved["tags"].items() if k in ORIGIN_TAGS}
    job = layout.read_json(Path(run_dir) / layout.SLURM) or {}
    nodes = job.get("nodes")
    return {"host": str(nodes[0])} if isinstance(nodes, list) and nodes else {}


def identify(
    config: Mapping[str, Any],
    run_dir: Path,
    origin: Dict[str, str],
    overrides: Optional[List[str]] = None,
) -> RunIdentity:
    """The run's experiment, name and tags, from its resolved config, its folder and its origin.

    The folder gives the sweep it is in, and Hydra's overrides unless given; the origin is
    this_process() live, recorded_origin() later.
    """
    run_dir = Path(run_dir).resolve()
    m, d, hw = _names(config)
    tracking = config.get("tracking") or {}
    experiment = tracking.get("experiment") or experiment_name(m, d)
    name = base_name(config)
    tags = {"hardware": hw, "model": m, "data": d, "run_dir": str(run_dir)}
    init_from = (config.get("model") or {}).get("init_from")
    if init_from:
        tags[INIT_FROM_TAG] = str(init_from)
    if "bench" in config:
        tags["kind"] = "bench"
    overrides = layout.read_overrides(run_dir) if overrides is None else overrides
    if overrides:
        tags["overrides"] = " ".join(overrides)
    sweep = find_sweep(config, run_dir)
    if sweep is not None:  # one experiment for the whole sweep, so the UI can nest the jobs
        experiment = sweep.get("experiment") or experiment
        name = sweep_run_name(name, overrides, sweep)
        tags["sweep_dir"] = sweep["sweep_dir"]
    tags.update({k: v for k, v in origin.items() if k in ORIGIN_TAGS})
    return RunIdentity(experiment, name, tags, sweep)


def store_of(config: Mapping[str, Any], sweep: Optional[Dict[str, Any]]) -> str:
    """The store a run folder's run is recorded in.

    Its sweep's (as the tracker chose), else its own tracking.uri, else its paths.mlflow_db (a
    folder from before paths: the default).
    """
    own = (config.get("tracking") or {}).get("uri")
    sweep_uri = (sweep or {}).get("uri")
    if sweep_uri and own in (None, sweep_uri):
        return sweep_uri
    db = (config.get("paths") or {}).get("mlflow_db")
    return own or (store.local_uri(Path(db)) if db else store.default_uri())


def write(run_dir: Path, identity: RunIdentity) -> None:
    """run.json: the identity the run is recorded as, read back by gptlab.sync."""
    body = {"experiment": identity.experiment, "name": identity.name, "tags": identity.tags}
    (Path(run_dir) / layout.IDENTITY).write_text(json.dumps(body, indent=1) + "\n")
