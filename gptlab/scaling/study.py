"""An isoFLOP study as one sweep: `python -m gptlab.train -m scaling=FILE` (gptlab_scaling sweeper).

The study's file names the compute budgets and a family of model sizes; every (budget, size) pair is
a point, trained to that budget (train.max_flops, so each size trains as many tokens as the budget
buys it) in <study folder>/<budget>_<size>/. Before anything runs every point is composed and
planned: a shape the model refuses, or a budget that buys the smallest model no step, is one line
naming the point; points whose tokens per parameter fall outside scaling.tokens_per_param are left
out, with a line. The points run through whatever launcher is configured (one after another here,
as SLURM jobs at once on a cluster), a point already finished in the folder is kept and not run
again, and an unfinished one resumes from its checkpoint: the same command continues a study that
was stopped. The points and their plan are written to study.json; when the study ends its fit
(gptlab.scale) is written beside them and into the sweep's MLflow parent run.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from gptlab.errors import GptlabError, never_fatal
from gptlab.records import layout

log = logging.getLogger("gptlab.scaling")

STUDY = "study.json"
LENGTH_KEYS = ("train.max_steps=", "train.max_tokens=", "train.max_flops=")
SHORT_KEYS = {"lr": "optimizer.lr"}  # a size may carry its own learning rate


@dataclass
class Point:
    name: str  # its folder in the study: <budget>_<size>
    budget: float
    size: str
    overrides: List[str]  # the size's and the budget's; the command line's come first
    params: int = 0  # N, as the planner counts it
    tokens: int = 0  # D: the steps the budget buys x tokens a step
    steps: int = 0
    state: str = "planned"  # planned | kept (finished before) | run | failed | left out


def budget_label(flops: float) -> str:
    """3e+12 -> '3e12' (a folder name)."""
    mantissa, exponent = f"{flops:.3g}".split("e") if "e" in f"{flops:.3g}" else (f"{flops:g}", "")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def sizes(s: Any) -> List[Tuple[str, List[str]]]:
    """(label, model overrides) of each size of the family: scaling.sizes, else the depth dial."""
    out = []
    for entry in s.sizes:
        keys = {SHORT_KEYS.get(k, k if "." in k else f"model.{k}"): v for k, v in entry.items()}
        shape = [keys.get(f"model.{k}") for k in ("n_layer", "n_embd")]
        label = f"L{shape[0]}xD{shape[1]}" if None not in shape else f"s{len(out)}"
        out.append((label, [f"{k}={v}" for k, v in keys.items()]))
    if out:
        return out
    for depth in s.depths:
        width = depth * s.width_per_depth
        heads = max(1, width // s.head_dim)
        overrides = [f"model.n_layer={depth}", f"model.n_embd={width}", f"model.n_head={heads}"]
        out.append((f"d{depth}", overrides))
    return out


def points(s: Any, fixed: Sequence[str]) -> List[Point]:
    """Every (budget, size) of the study, the command line's overrides first (less any length)."""
    if not s.budgets:
        raise GptlabError("scaling.budgets is empty: a study needs compute budgets (FLOPs)")
    family = sizes(s)
    if len(family) < 3:
        raise GptlabError(
            f"scaling: {len(family)} size(s) in the family (scaling.sizes or scaling.depths): an "
            f"isoFLOP parabola needs at least 3"
        )
    base = [o for o in fixed if not o.startswith(LENGTH_KEYS)]
    out = []
    for budget in s.budgets:
        if not float(budget) > 0:
            raise GptlabError(f"scaling.budgets: {budget} is not a positive number of FLOPs")
        for label, model in family:
            name = f"{budget_label(float(budget))}_{label}"
            length = ["train.max_steps=null", f"train.max_flops={float(budget):g}"]
            out.append(Point(name, float(budget), label, [*base, *model, *length]))
    return out


def plan(point: Point, job: DictConfig, bounds: Sequence[float]) -> None:
    """Fill the point's N, D and steps from its composed config; drop it when D/N is out of bounds.

    A shape or budget that is refused is one line naming the point.
    """
    from gptlab.config import to_config
    from gptlab.perf import costs

    plain = OmegaConf.to_container(job, resolve=False)
    plain.pop("hydra", None)
    try:
        config, _ = costs.resolve_budget(to_config(OmegaConf.create(plain)))
    except GptlabError as e:
        raise GptlabError(f"scaling point {point.name}: {e}") from None
    point.steps = config.train.max_steps
    point.params = costs.param_count(config, costs.vocab_for(config)[0])
    point.tokens = point.steps * config.train.batch_size * config.model.block_size
    low, high = bounds
    if not low <= point.tokens / point.params <= high:
        point.state = "left out"


def finished(folder: Path) -> bool:
    """A point trained to its end before (its results.json, not stopped by a signal)."""
    results = layout.read_json(folder / layout.RESULTS)
    return results is not None and not results.get("stopped_by")


def write_study(sweep_dir: Path, s: Any, all_points: List[Point]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    doc = {"scaling": OmegaConf.to_container(s, resolve=True) if isinstance(s, DictConfig) else s}
    doc["points"] = [asdict(p) for p in all_points]
    tmp = sweep_dir / (STUDY + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, sweep_dir / STUDY)


def read_study(folder: Path) -> Optional[Dict[str, Any]]:
    return layout.read_json(Path(folder) / STUDY)


class Study:
    """One start of a study: plan every point, run those not finished, fit what is there."""

    def __init__(self, config: DictConfig, launcher: Any, compose: Any) -> None:
        self.config, self.launcher, self.compose = config, launcher, compose
        self.s = config.scaling
        self.sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()

    def prepare(self, arguments: Sequence[str]) -> List[Point]:
        s = self.s
        bounds = list(s.tokens_per_param)
        if len(bounds) != 2 or not 0 < bounds[0] <= bounds[1]:
            raise GptlabError(
                f"scaling.tokens_per_param={bounds}: give [low, high], 0 < low <= high"
            )
        if s.objective not in ("best_val_loss", "best_val_bpb"):
            raise GptlabError(
                f"scaling.objective={s.objective}: must be best_val_loss or best_val_bpb"
            )
        self.points = points(s, arguments)
        for p in self.points:
            plan(p, self.compose(p.overrides), bounds)
            if finished(self.sweep_dir / p.name):
                p.state = "kept"
        run = [p for p in self.points if p.state != "left out"]
        by_budget = {b: sum(p.budget == b for p in run) for b in s.budgets}
        thin = [budget_label(float(b)) for b, n in by_budget.items() if n < 3]
        if thin:
            raise GptlabError(
                f"scaling: budget(s) {', '.join(thin)} keep fewer than 3 sizes inside "
                f"scaling.tokens_per_param={bounds}: widen it, or change the budgets or sizes"
            )
        return self.points

    def run(self) -> List[Any]:
        todo = [p for p in self.points if p.state == "planned"]
        kept = [p for p in self.points if p.state == "kept"]
        left = [p for p in self.points if p.state == "left out"]
        log.info(
            f"scaling study {self.s.name!r}: {len(self.points)} points ({len(self.s.budgets)} "
            f"budgets x {len(self.points) // len(self.s.budgets)} sizes); {len(todo)} to run, "
            f"{len(kept)} finished before (kept), {len(left)} left out; in {self.sweep_dir}"
        )
        for p in left:
            log.info(
                f"point {p.name}: left out ({p.tokens / p.params:.3g} tokens per parameter, "
                f"outside scaling.tokens_per_param)"
            )
        write_study(self.sweep_dir, self.s, self.points)
        returns = []
        if todo:
            jobs = [[*p.overrides, f"hydra.sweep.subdir={p.name}"] for p in todo]
            returns = list(self.launcher.launch(jobs, initial_job_idx=0))
            for p, r in zip(todo, returns):
                p.state = "run" if finished(self.sweep_dir / p.name) else "failed"
                if p.state == "failed":
                    log.warning(f"point {p.name}: failed ({_why(r)})")
        write_study(self.sweep_dir, self.s, self.points)
        self.fit()
        return returns

    def fit(self) -> None:
        """The study's fit, when every budget has 3 finished sizes.

        It writes scaling.json and the plot in the folder and in the parent run.
        """
        from gptlab.scaling import report

        done = [p for p in self.points if p.state in ("kept", "run")]
        counts = {b: sum(p.budget == b for p in done) for b in self.s.budgets}
        if min(counts.values()) < 3:
            log.warning(
                f"scaling study {self.s.name!r}: too few finished points to fit "
                f"({', '.join(f'{budget_label(float(b))}: {n}' for b, n in counts.items())}); "
                f"the same command runs what is missing"
            )
            return
        try:
            result = report.fit_folder(self.sweep_dir, self.s.objective)
        except GptlabError as e:  # the points stand; the fit says why it cannot be made
            log.warning(f"scaling study {self.s.name!r}: no fit: {e}")
            return
        log.info(f"fit: python -m gptlab.scale {self.sweep_dir}\n{report.table(result)}")
        with never_fatal(lambda e: log.warning(f"could not log the fit to MLflow: {e}")):
            log_fit(self.sweep_dir, result)


def _why(r: Any) -> str:
    from gptlab.records.store import error_text

    value = getattr(r, "_return_value", None)
    return error_text(value) if isinstance(value, BaseException) else "no results.json"


def log_fit(sweep_dir: Path, result: Dict[str, Any]) -> None:
    """The fit's figures and files into the sweep's parent run (sweep.json), when there is one."""
    sweep = layout.read_json(sweep_dir / layout.SWEEP)
    if not sweep:
        return
    from gptlab.records.store import mlflow_client

    client = mlflow_client(sweep["uri"])
    run_id = sweep["parent_run_id"]
    for key in ("a", "b", "alpha", "beta", "E", "A", "B"):
        value = result.get(key)
        if isinstance(value, (int, float)):
            client.log_metric(run_id, f"scaling/{key}", float(value))
    client.set_tag(run_id, "run_type", "scaling")
    for name in ("scaling.json", "scaling.png"):
        if (sweep_dir / name).is_file():
            client.log_artifact(run_id, str(sweep_dir / name), "scaling")


def nearest_run(held: Dict[str, Any], target: Dict[str, Any]) -> None:
    """Add to the fit's target the study's size nearest its N_opt (in ln N).

    Also the command that trains it at the target budget.
    """
    import math
    import shlex

    pts = [p for p in held.get("points", []) if p.get("params")]
    if not pts:
        return
    best = min(pts, key=lambda p: abs(math.log(p["params"] / target["n_opt"])))
    overrides = [o for o in best["overrides"] if not o.startswith(LENGTH_KEYS)]
    overrides += ["train.max_steps=null", f"train.max_flops={target['flops']:g}"]
    target["overrides"] = overrides
    target["size"] = best["size"]
    target["size_note"] = f" ({best['size']}, {best['params']:,} parameters)"
    # the steps scale with the budget at one size (the run derives them exactly)
    target["steps"] = int(best["steps"] * target["flops"] / best["budget"])
    target["command"] = "python -m gptlab.train " + " ".join(shlex.quote(o) for o in overrides)


def verify(folder: Path, target: Dict[str, Any], objective: str) -> None:
    """Train the target's run (nearest_run) in <folder>/verify_<budget>/.

    Its `objective` is recorded beside the prediction (target['verify']).
    """
    import subprocess
    import sys

    run_dir = Path(folder) / f"verify_{budget_label(target['flops'])}"
    args = [sys.executable, "-m", "gptlab.train", *target["overrides"], f"hydra.run.dir={run_dir}"]
    log.info(f"verifying the prediction: {target['command']} (in {run_dir})")
    done = subprocess.run(args)
    results = layout.read_json(run_dir / layout.RESULTS)
    if done.returncode != 0 or not results or results.get(objective) is None:
        raise GptlabError(f"scale.verify: the run in {run_dir} did not finish (see its log)")
    loss = float(results[objective])
    target["verify"] = {
        "run_dir": str(run_dir),
        "loss": loss,
        "loss_error": loss / target["loss"] - 1,
        "params": results.get("params"),
        "tokens": results.get("tokens"),
        "flops": results.get("flops"),
    }
