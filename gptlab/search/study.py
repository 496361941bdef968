"""The study: the objective's metric, where the study is stored, its sampler and its pruner.

The study lives in a database (SQLite by default, the team's PostgreSQL for a shared search), not in
the sweeper's memory: a sweeper started again with the same command continues it, and two sweepers
on one study share it. Trials' jobs open the same storage to report their evaluations.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from gptlab.errors import GptlabError

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
SPACE_ATTR = "gptlab:space"
FIXED_ATTR = "gptlab:fixed"
METRIC_ATTR = "gptlab:metric"
OWNER_ATTR = "gptlab:sweeper"
SLURM_ATTR = "gptlab:slurm_job"
ATTEMPT_ATTR = "gptlab:attempt"  # the trial's current launch; a job of an earlier one ends at once
ERROR_ATTR = "gptlab:error"
SURPLUS_ATTR = "gptlab:surplus"  # asked past n_trials while another sweeper asked too: never run


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
    """The study's database URL: the setting, else SQLite at <paths.outputs>/optuna.db; a relative
    SQLite path is made absolute (trials run in other folders and on other nodes), and PostgreSQL
    goes through psycopg 3 (the driver the team server's extra installs)."""
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
        except Exception as e:  # noqa: BLE001 - any driver's error: one line with the URL
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
