"""python -m gptlab.plan [overrides]: will this run fit, how long will it take? Allocates nothing.

Prints the parameters, FLOPs per token, memory per device by part (weights, gradients, optimizer
state, activations with and without activation checkpointing), the largest micro-batch that fits
the device, the accumulation steps that follow, and the step time, tokens/s and time to
train.max_steps at a stated MFU (``plan.mfu=0.4``; ``plan.json=true`` prints one JSON object
instead). A run whose micro-batch does not fit ends with one line saying what would. The root
config is conf/plan.yaml: the training config and the planner's own keys (``PlanConfig``).

This module is the command only: the arithmetic (parameters, FLOPs, the memory model, the plan
and ``resolve_micro_batch``, which resolves ``train.micro_batch_size=auto`` when a run is built)
is in gptlab/perf/costs.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore

from gptlab.config import Config
from gptlab.errors import GptlabError
from gptlab.optim import OPTIMIZERS

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # hints only: costs imports torch, kept off the start-up path of --help
    from gptlab.perf.costs import Plan


def optimizer_label(cfg: Config) -> str:
    """What the optimizer's memory holds, in the report's words."""
    kind = OPTIMIZERS[cfg.optimizer.name].label
    return kind + (" + average" if cfg.optimizer.ema_decay > 0 else " state")


def _steps(n: int) -> str:
    return f"{n} accumulation step{'s' if n != 1 else ''}"


def _gb(x: float) -> str:
    from gptlab.perf.costs import GiB  # torch: off the start-up path of --help and config errors

    return f"{x / GiB:8.2f} GiB"


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def _memory_rows(cfg: Config, plan: Plan) -> List[str]:
    """The report's memory table: each part with and without checkpointing, then the device's."""
    # torch: off the start-up path of --help and config errors
    from gptlab.perf.costs import USABLE_FRACTION, GiB

    s, rows = plan.shape, []
    split = f", 1/{s.shards} each" if s.sharded else ""
    for key, label in (
        ("weights", f"weights (fp32{split})"),
        ("grads", f"gradients (fp32{split}{', + in flight' if s.sharded else ''})"),
        ("optimizer", f"{optimizer_label(cfg)} (fp32 x{s.optimizer_floats:.3g}{split})"),
        ("ddp", "DDP gradient buckets"),
        ("autocast", "autocast weight copies"),
        ("gathered", "gathered weights in flight (sharded)"),
        ("activations", "activations"),
        ("transient", "logits / recompute peak"),
        ("newton_schulz", "Muon's Newton-Schulz (optimizer step)"),
        ("total", "peak (estimate)"),
    ):
        if key == "newton_schulz" and not (plan.memory_ckpt[key] or plan.memory_no_ckpt[key]):
            continue  # AdamW: no such step
        rows.append(
            f"  {label:<40} {_gb(plan.memory_ckpt[key]):>14} {_gb(plan.memory_no_ckpt[key]):>17}"
        )
    rows.append(
        f"  device memory {plan.device_bytes / GiB:.1f} GiB, usable "
        f"{plan.usable_bytes / GiB:.1f} GiB ({USABLE_FRACTION[cfg.hardware.device]:.0%})"
    )
    return rows


def report(
    cfg: Config, plan: Plan, est: Dict[str, float], choices: Optional[Tuple[str, str]] = None
) -> str:
    """The planner's report; choices: fastpath.summary's (precision, compile) texts."""
    s, m, hw = plan.shape, cfg.model, cfg.hardware
    lines = [
        f"{m.name} on {hw.name} ({plan.world_size} x {hw.device}, {hw.precision}, "
        f"{cfg.parallelism.strategy}): "
        f"{plan.params:,} parameters ({plan.params / 1e6:.1f}M), vocab {s.vocab}"
        + (" (assumed until the data is read)" if plan.vocab_assumed else ""),
    ]
    if choices:
        lines.append(f"precision {choices[0]}{choices[1]}")
    lines += [
        f"FLOPs per token: {plan.flops_per_token / 1e9:.3f} GFLOP (6N + attention)"
        + (
            f"; {plan.hardware_flops_per_token / 1e9:.3f} GFLOP with checkpointing's recomputation"
            if plan.checkpointing
            else ""
        ),
        f"batch: {cfg.train.batch_size} sequences x {m.block_size} tokens = "
        f"{cfg.train.batch_size * m.block_size:,} tokens per step; "
        f"per device {plan.per_rank_batch} "
        f"= micro-batch {plan.micro_batch} x {_steps(plan.per_rank_batch // plan.micro_batch)}",
        f"memory per device at micro-batch {plan.micro_batch}:   "
        f"{'checkpointing':>14} {'no checkpointing':>17}",
    ]
    lines += _memory_rows(cfg, plan)
    fits = (plan.largest_fit, plan.largest_fit_other)
    ckpt_fit, no_ckpt_fit = fits if plan.checkpointing else fits[::-1]
    for ckpt, mem, fit in (
        (True, plan.memory_ckpt, ckpt_fit),
        (False, plan.memory_no_ckpt, no_ckpt_fit),
    ):
        ok = mem["total"] <= plan.usable_bytes
        tail = (
            f"largest micro-batch that fits: {fit} ({_steps(plan.per_rank_batch // fit)})"
            if fit
            else "no micro-batch fits"
        )
        lines.append(
            f"  {'with' if ckpt else 'without':>7} activation checkpointing: "
            f"{'fits' if ok else 'does not fit'} at micro-batch {plan.micro_batch}; {tail}"
        )
    if est:
        lines.append(
            f"expected at {est['mfu']:.0%} MFU of {est['peak_flops_per_device'] / 1e12:.3g} "
            f"TFLOP/s per device ({est['peak_source']}): {est['step_s'] * 1e3:,.0f} ms per step, "
            f"{est['tokens_per_s']:,.0f} tokens/s, {cfg.train.max_steps:,} steps in "
            f"{_duration(est['train_s'])}"
        )
        lines.append(
            f"expected device-hours: {est['device_hours']:.3g} ({plan.world_size} devices)"
            + (f", cost {est['cost']:,.2f}" if "cost" in est else "")
        )
    lines.append(
        f"configured (activation checkpointing {'on' if plan.checkpointing else 'off'}): "
        + ("FITS" if plan.fits else "DOES NOT FIT")
    )
    return "\n".join(lines)


def mixture_report(cfg: Config, text: str) -> Tuple[str, List[Dict[str, Any]]]:
    """The report with a mixture's per-source lines, and the rows for the JSON.

    Per-source lines: tokens, weight, epochs; its warning is logged once.
    """
    from gptlab.data.mixture import planned_sources, source_lines

    step_tokens = cfg.train.batch_size * cfg.model.block_size
    rows, warnings = planned_sources(cfg.data, step_tokens, cfg.train.max_steps)
    for w in warnings:
        log.warning(w)
    return "\n".join([text, f"mixture of {len(rows)} sources:", *source_lines(rows)]), rows


@dataclass
class PlanSettings:
    """The planner's own keys (values in conf/plan.yaml)."""

    mfu: Optional[float]  # the MFU the time estimate assumes; null: DEFAULT_MFU for the device
    json: bool  # print one JSON object instead of the report


@dataclass
class PlanConfig(Config):
    """The training config with the `plan` section: the schema of conf/plan.yaml."""

    plan: PlanSettings


ConfigStore.instance().store(name="gptlab_plan_schema", node=PlanConfig)


def run_plan(cfg_dict) -> Dict[str, Any]:
    """Print the plan (a report, or one JSON line); a run that does not fit raises what would fit.

    cfg_dict: composed from conf/plan.yaml (``cli.compose("plan", overrides)``).
    """
    from gptlab.config import to_config

    config = to_config(cfg_dict, PlanConfig)
    # torch: off the start-up path of --help and config errors (imported once the config is valid)
    from gptlab.perf import fastpath
    from gptlab.perf.costs import (
        DEFAULT_MFU,
        make_plan,
        plan_json,
        resolve_auto,
        resolve_budget,
        resolve_micro_batch,
        step_estimate,
        what_would_fit,
    )

    config, budget = resolve_budget(config)
    cfg, choices = resolve_auto(config)
    cfg = resolve_micro_batch(cfg)
    settings = cfg.plan
    plan = make_plan(cfg)
    mfu_value = settings.mfu or DEFAULT_MFU[cfg.hardware.device]
    est = step_estimate(plan, cfg, mfu_value)
    decided = fastpath.derived(choices)
    out = {**plan_json(cfg, plan, est), **decided, "max_steps": cfg.train.max_steps}
    text = report(cfg, plan, est, fastpath.summary(decided, cfg.hardware.precision))
    if budget:
        text += f"\nlength: {budget}"
    if cfg.data.sources:
        text, out["sources"] = mixture_report(cfg, text)
    print(json.dumps(out) if settings.json else text, flush=True)
    if not plan.fits:
        raise GptlabError(
            what_would_fit(
                cfg,
                plan.shape,
                plan.per_rank_batch,
                plan.checkpointing,
                plan.usable_bytes,
                plan.micro_batch,
            )
        )
    return out


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    """python -m gptlab.plan [overrides]: a Hydra app on conf/plan.yaml that writes nothing.

    argv: overrides, to plan in this process (returns the plan's JSON object; errors raise).
    """
    from gptlab.cli import command

    return command("plan", run_plan, argv)


if __name__ == "__main__":
    main()
