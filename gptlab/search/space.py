"""The search space: overrides in Optuna's Hydra syntax -> Optuna distributions.

    optimizer.lr: tag(log, interval(1e-4, 1e-2))   a float, sampled on a log scale
    train.warmup: tag(int, interval(0, 200))        an integer in [0, 200]
    optimizer.weight_decay: interval(0.0, 0.2)      a float
    model.n_layer: range(2, 8, 2)                   2, 4 or 6 (Python's range: the stop is left out)
    optimizer.name: choice(adamw, muon)             one of the values (also written adamw,muon)

Any other value is fixed: every trial gets it as an override.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

from gptlab.errors import GptlabError


def parse(params: Mapping[str, Any], arguments: Sequence[str]) -> Tuple[Dict[str, Any], List[str]]:
    """(space: key -> distribution, fixed: overrides for every trial), from the sweep's params.

    The params are hydra.sweeper.params and the command line's overrides (a sweep there,
    `optimizer.lr=1e-3,3e-3`, joins the space).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    lines = [f"{k}={v}" for k, v in params.items()] + list(arguments)
    try:
        overrides = parser.parse_overrides(lines)
    except HydraException as e:  # a parse error: one line naming the override
        raise GptlabError(f"search space: {str(e).strip().splitlines()[0]}") from None
    space: Dict[str, Any] = {}
    fixed: List[str] = []
    for line, o in zip(lines, overrides):
        if o.is_sweep_override():
            space[o.key_or_group] = distribution(o.key_or_group, o.value())
        elif o.key_or_group not in space:
            fixed.append(line)
    return space, fixed


def distribution(key: str, sweep: Any) -> Any:
    """The Optuna distribution of one sweep value.

    The value is Hydra's ChoiceSweep, RangeSweep or IntervalSweep.
    """
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    tags = set(getattr(sweep, "tags", ()) or ())
    unknown = tags - {"log", "int"}
    if unknown:
        raise GptlabError(
            f"search space {key}: unknown tag {sorted(unknown)[0]!r} (log and int are known)"
        )
    log = "log" in tags
    if isinstance(sweep, ChoiceSweep):
        values = list(sweep.list)
        if not values:
            raise GptlabError(f"search space {key}: choice() needs at least one value")
        return CategoricalDistribution(values)
    if isinstance(sweep, RangeSweep):
        start, stop, step = sweep.start, sweep.stop, sweep.step
        if all(isinstance(v, int) for v in (start, stop, step)):
            if stop <= start:
                raise GptlabError(f"search space {key}: range({start}, {stop}) is empty")
            # Python's range leaves the stop out; Optuna's high is inclusive
            high = start + ((stop - 1 - start) // step) * step
            return IntDistribution(start, high, step=step, log=log)
        return FloatDistribution(float(start), float(stop), step=float(step), log=log)
    if isinstance(sweep, IntervalSweep):
        low, high = sweep.start, sweep.end
        if not low < high:
            raise GptlabError(f"search space {key}: interval({low}, {high}) is empty")
        if log and low <= 0:
            raise GptlabError(f"search space {key}: a log interval must be positive, not {low}")
        if "int" in tags:
            return IntDistribution(int(low), int(high), log=log)
        return FloatDistribution(float(low), float(high), log=log)
    raise GptlabError(f"search space {key}: {sweep} is not a distribution Optuna can sample")


def describe(dist: Any) -> str:
    """A distribution as a short line, for the parent run's params (`log [0.0001, 0.01]`)."""
    from optuna.distributions import CategoricalDistribution

    if isinstance(dist, CategoricalDistribution):
        return "choice(" + ", ".join(str(c) for c in dist.choices) + ")"
    kind = "int" if type(dist).__name__.startswith("Int") else "float"
    scale = " log" if getattr(dist, "log", False) else ""
    step = f" step {dist.step}" if getattr(dist, "step", None) not in (None, 1) else ""
    return f"{kind}{scale} [{dist.low}, {dist.high}]{step}"


def override(key: str, value: Any) -> str:
    """A sampled value as a Hydra override for the trial's job."""
    if isinstance(value, bool) or value is None:
        text = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, int):
        text = str(value)
    else:
        escaped = str(value).replace("\\", "\\\\").replace("'", "\\'")
        text = f"'{escaped}'"
    return f"{key}={text}"


def lowest(dist: Any) -> Any:
    """The smallest value a distribution can give (its low end; a choice's smallest number)."""
    from optuna.distributions import CategoricalDistribution

    if isinstance(dist, CategoricalDistribution):
        numbers = [c for c in dist.choices if _number(c)]
        return min(numbers) if numbers else None
    return dist.low


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def cap(space: Dict[str, Any], key: str, limit: int, why: str) -> Any:
    """Keep `key`'s distribution in `space` (a count of steps) at or under `limit`.

    A range reaching past it is cut there and the note saying so returned (None when nothing was
    cut); one wholly past it is refused in one line. `why` names the limit (`train.max_steps=60`).
    """
    from optuna.distributions import CategoricalDistribution

    dist = space.get(key)
    if dist is None:
        return None
    low = lowest(dist)
    if low is not None and low > limit:
        raise GptlabError(
            f"search space {key}: {describe(dist)} starts past {why}: no trial would get there; "
            f"search values up to {limit}, e.g. "
            f"{key}='tag(int, interval(0, {limit}))'"
        )
    if isinstance(dist, CategoricalDistribution):
        kept = [c for c in dist.choices if not (_number(c) and c > limit)]
        if len(kept) == len(dist.choices):
            return None
        space[key] = CategoricalDistribution(kept)
    elif dist.high > limit:
        step = dist.step or 0
        high = low + ((limit - low) // step) * step if step else limit
        space[key] = type(dist)(low, type(low)(high), log=dist.log, step=dist.step)
    else:
        return None
    cut = describe(space[key])
    return f"search space: {key} cut to {cut} (from {describe(dist)}): trials run {why}"
