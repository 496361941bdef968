"""The study: the objective's metric, where the study is stored, its sampler and its pruner.

The study lives in a database (SQLite by default, the team's PostgreSQL for a shared search), not in
the sweeper's memory: a sweeper started again with the same command continues it, and two sweepers
on one study share it. Trials' jobs open the same storage to report their evaluations.

The search a study holds (its space, fixed overrides and metric) is one system attribute, written
once, so a sweeper reading it never sees half of it. Each trial's point is drawn by a sampler seeded
with the trial's number, and never one the study has already tried (`sample_point`): two sweepers
on one study draw different points.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from gptlab.errors import GptlabError

log = logging.getLogger("gptlab.search")

# hparams_search.metric -> (its direction, the figure each evaluation reports to the pruner)
METRICS: Dict[str, Tuple[str, str]] = {
    "best_val_loss": ("minimize", "val_loss"),
    "val_loss": ("minimize", "val_loss"),
    "best_val_bpb": ("minimize", "val_bpb"),
    "val_bpb": ("minimize", "val_bpb"),
    "hellaswag_acc": ("maximize", "hellaswag_acc"),
    "hellaswag_acc_norm": ("maximize", "hellaswag_acc_norm"),
}
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "none")
DEFAULT_DB = "optuna.db"  # under paths.outputs, beside the MLflow store

# keys of the study's and trials' system attributes
DEFINITION_ATTR = "gptlab:search"  # the search the study holds: {space, fixed, metric}, one write
LEGACY_ATTRS = {"space": "gptlab:space", "fixed": "gptlab:fixed", "metric": "gptlab:metric"}
OWNER_ATTR = "gptlab:sweeper"
SLURM_ATTR = "gptlab:slurm_job"
ATTEMPT_ATTR = "gptlab:attempt"  # the trial's current launch; a job of an earlier one ends at once
ERROR_ATTR = "gptlab:error"
SURPLUS_ATTR = "gptlab:surplus"  # asked past n_trials while another sweeper asked too: never run
DRAWS = 20  # draws of a trial's point before one the study has tried is taken (a spent space)


def check_settings(hs: Any, hellaswag_every: int) -> str:
    """Validate hparams_search's settings (one line each); the direction it resolves to."""
    if hs.metric not in METRICS:
        raise GptlabError(
            f"hparams_search.metric={hs.metric}: no run produces it; one of {', '.join(METRICS)}"
        )
    if hs.metric.startswith("hellaswag") and not hellaswag_every:
        raise GptlabError(
            f"hparams_search.metric={hs.metric}: HellaSwag is off in these runs "
            f"(eval.hellaswag.every=0); turn it on, e.g. eval.hellaswag.every=250"
        )
    direction = hs.direction or METRICS[hs.metric][0]
    if direction not in ("minimize", "maximize"):
        raise GptlabError(
            f"hparams_search.direction={direction}: minimize, maximize or null (the metric's)"
        )
    for key, value, ok in (
        ("n_trials", hs.n_trials, hs.n_trials > 0),
        ("n_jobs", hs.n_jobs, hs.n_jobs > 0),
        ("max_failure_rate", hs.max_failure_rate, 0 <= hs.max_failure_rate <= 1),
        ("pruner_startup_trials", hs.pruner_startup_trials, hs.pruner_startup_trials >= 0),
        ("pruner_warmup_steps", hs.pruner_warmup_steps, hs.pruner_warmup_steps >= 0),
    ):
        if not ok:
            raise GptlabError(f"hparams_search.{key}={value}: out of range")
    if hs.sampler not in SAMPLERS:
        raise GptlabError(f"hparams_search.sampler={hs.sampler}: one of {', '.join(SAMPLERS)}")
    if str(hs.pruner) not in PRUNERS:
        raise GptlabError(f"hparams_search.pruner={hs.pruner}: one of {', '.join(PRUNERS)}")
    if not hs.study_name:
        raise GptlabError(
            "hparams_search.study_name is not set: name the study (the same name continues it)"
        )
    return direction


def allowed_failures(hs: Any) -> int:
    """How many of a search's trials may fail before it stops (max_failure_rate x n_trials)."""
    return math.floor(hs.max_failure_rate * hs.n_trials)


def storage_url(setting: Optional[str], outputs: str) -> str:
    """The study's database URL: the setting, else SQLite at <paths.outputs>/optuna.db.

    A relative SQLite path is made absolute (trials run in other folders and on other nodes), and
    PostgreSQL goes through psycopg 3 (the driver the team server's extra installs).
    """
    if not setting:
        return f"sqlite:///{(Path(outputs) / DEFAULT_DB).resolve()}"
    url = str(setting)
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        return f"sqlite:///{Path(url[len('sqlite:///') :]).resolve()}"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def open_storage(url: str) -> Any:
    """Optuna's RDBStorage on url, connected (and its tables made), or one line saying why not."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    kwargs: Dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        # trials' jobs and the sweeper write at once: wait for the lock rather than fail
        kwargs = {"connect_args": {"timeout": 60}}
    elif url.startswith("postgresql"):
        kwargs = {"connect_args": {"connect_timeout": 10}}
    for attempt in range(3):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        # the database's, the driver's (or its absence), a malformed URL: one line with the URL
        except (
            SQLAlchemyError,
            optuna.exceptions.OptunaError,
            ImportError,
            ValueError,
            OSError,
        ) as e:
            if attempt < 2 and _made_at_once(e):
                time.sleep(0.5)  # another sweeper made the tables at the same moment: they exist
                continue
            error = e
            break
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    why = lines[0] if lines else type(error).__name__
    raise GptlabError(
        f"hparams_search.storage={redact(url)}: cannot open the study's database: {why[:300]}"
    ) from None


def _made_at_once(e: BaseException) -> bool:
    """Whether opening failed because another process was creating the same tables."""
    from sqlalchemy.exc import IntegrityError

    return isinstance(e, IntegrityError) or "already exists" in str(e)


def redact(url: str) -> str:
    """url without its password, for messages."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"


def make_sampler(name: str, seed: int, n_trials: int) -> Any:
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # Optuna's default samples the first 10 trials at random: all of a small search. A quarter of
    # the trials (2 to 10) at random, then the model. Multivariate: lr and warmup interact.
    startup = max(2, min(10, n_trials // 4))
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=startup)


def definition(attrs: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The search a study holds, from its system attributes; None while there is none.

    The one attribute, or for a study made before it, the three it replaced once all are there.
    """
    if DEFINITION_ATTR in attrs:
        return attrs[DEFINITION_ATTR]
    if all(key in attrs for key in LEGACY_ATTRS.values()):
        return {part: attrs[key] for part, key in LEGACY_ATTRS.items()}
    return None


def trial_seed(seed: Optional[int], number: int, draw: int = 0) -> Optional[int]:
    """The sampler's seed for a trial's draw: the configured seed mixed with the trial's number.

    Unique in the study, so sweepers sharing a study never sample from the same stream.
    """
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{number}:{draw}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _draw(sampler: Any, study: Any, trial: Any, space: Dict[str, Any]) -> Dict[str, Any]:
    """One point of `space` from `sampler`: its joint (relative) sample, the rest one by one."""
    sampler.before_trial(study, trial)
    joint = sampler.infer_relative_search_space(study, trial)
    joint = {k: d for k, d in joint.items() if k in space}
    point = sampler.sample_relative(study, trial, joint) if joint else {}
    for name, dist in space.items():
        if name in point:
            continue
        if dist.single():
            point[name] = dist.choices[0] if hasattr(dist, "choices") else dist.low
        else:
            point[name] = sampler.sample_independent(study, trial, name, dist)
    return point


def _point_key(params: Dict[str, Any]) -> Tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def sample_point(study: Any, trial: Any, space: Dict[str, Any], hs: Any) -> Dict[str, Any]:
    """A point of `space` for `trial` from the configured sampler seeded by the trial's number.

    `trial` is a FrozenTrial just asked; the params it already has are kept. The seed is
    trial_seed's. The point is drawn again while another trial of the study holds it (up to DRAWS
    times: a small discrete space can be spent).
    """
    tried = {
        _point_key(t.params)
        for t in study.get_trials(deepcopy=False)
        if t.number != trial.number and t.params and not t.system_attrs.get(SURPLUS_ATTR)
    }
    for draw in range(DRAWS):
        sampler = make_sampler(hs.sampler, trial_seed(hs.seed, trial.number, draw), hs.n_trials)
        point = {**_draw(sampler, study, trial, space), **trial.params}
        if _point_key(point) not in tried:
            return point
    log.info(f"trial {trial.number}: every point drawn was tried already; it repeats one")
    return point


def set_point(study: Any, storage: Any, trial_id: int, space: Dict[str, Any], hs: Any) -> None:
    """Give trial `trial_id` the parameters of `space` it lacks (sample_point)."""
    trial = storage.get_trial(trial_id)
    point = sample_point(study, trial, space, hs)
    for name, dist in space.items():
        if name not in trial.params:
            storage.set_trial_param(trial_id, name, dist.to_internal_repr(point[name]), dist)


def make_pruner(hs: Any) -> Any:
    """The pruner the sweeper and the trials' jobs agree on (both build it from the same config)."""
    import optuna

    if str(hs.pruner) == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(
        n_startup_trials=hs.pruner_startup_trials, n_warmup_steps=hs.pruner_warmup_steps
    )


def load(storage: Any, name: str, hs: Any) -> Any:
    """The existing study `name` with the config's sampler and pruner."""
    import optuna

    return optuna.load_study(
        study_name=name,
        storage=storage,
        sampler=make_sampler(hs.sampler, hs.seed, hs.n_trials),
        pruner=make_pruner(hs),
    )


def objective(results: Dict[str, Any], metric: str) -> Optional[float]:
    """The trial's objective from its results.json; None when it has none (or not a number)."""
    value = results.get(metric)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None
