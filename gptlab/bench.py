"""python -m gptlab.bench [overrides]: time the real training loop.

Builds the run exactly as ``gptlab.train`` does, runs warm-up + timed steps of ``loop.train``
(logging every step, no checkpoints, no evaluation until the end, no sample), and prints ONE JSON
line: tokens_per_s, step_ms (median), mfu, hfu, peak_mem_bytes (CUDA max allocated, or the peak
RSS on the CPU), the planner's memory and speed prediction beside them, and a config summary.
The root config is conf/bench.yaml: the training config, the benchmark's own keys
``bench.warmup``, ``bench.steps`` and ``bench.mlflow`` (``BenchConfig``), and what a benchmark
changes in the run. E.g.
    python -m gptlab.bench bench.warmup=1 bench.steps=3 model=gpt2_124m train.batch_size=1
A sweep over settings is Hydra's ``-m``: one JSON line per job, e.g.
    python -m gptlab.bench -m train.micro_batch_size=1,2,4 hardware.compile=false,true
With ``bench.mlflow=true`` the figures are also recorded as an MLflow run (tag kind=bench), and a
sweep as an MLflow parent run. Multi-process benchmarks are started by torchrun (every rank times;
rank 0 prints).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from gptlab import console
from gptlab.cli import command
from gptlab.config import Config, to_config
from gptlab.errors import GptlabError
from gptlab.records import layout


@dataclass
class BenchSettings:
    """The benchmark's own keys (values in conf/bench.yaml)."""

    warmup: int  # steps run first and not timed
    steps: int  # timed steps (train.max_steps = warmup + steps)
    mlflow: bool  # also record an MLflow run (conf/bench.yaml: tracking.mlflow follows it)
    profile: bool  # record the timed steps with torch.profiler (train.profile) in the bench folder
    ladder: bool  # the tuning ladder: one benchmark per speed lever (gptlab/perf/ladder.py)
    coord_check: bool  # muP's coordinate check at several widths (gptlab/perf/coord_check.py)


@dataclass
class BenchConfig(Config):
    """The training config with the `bench` section: the schema of conf/bench.yaml."""

    bench: BenchSettings


ConfigStore.instance().store(name="gptlab_bench_schema", node=BenchConfig)


def bench_config(cfg: DictConfig) -> DictConfig:
    """The composed config with train.max_steps = bench.warmup + bench.steps.

    Everything else a benchmark changes in the run (log every step, no checkpoints, evaluation or
    sample) is in conf/bench.yaml.
    """
    warmup, steps = cfg.bench.warmup, cfg.bench.steps
    if warmup < 0:
        raise GptlabError(f"bench.warmup={warmup}: give a whole number of steps (0 or more)")
    if steps < 1:
        raise GptlabError(f"bench.steps={steps}: give a whole number of steps (at least 1)")
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.train.max_steps = warmup + steps
        cfg.train.max_tokens = cfg.train.max_flops = None  # a benchmark's length is its own
        if cfg.bench.profile:
            cfg.train.profile.steps = [warmup + 1, warmup + steps]
    return cfg


def summarise(
    run,
    timings: List[Tuple[int, float, int]],
    warmup: int,
    peak_mem: int,
    mem_source: str,
    base_mem: int,
    plan: Dict[str, Any],
    cfg,
) -> Dict[str, Any]:
    """The benchmark's figures from the loop's per-step timings (the warm-up steps dropped)."""
    from gptlab.perf import (
        measure,  # torch: off the start-up path of --help and config errors
    )

    timed = [(s, sec, tok) for s, sec, tok in timings if s > warmup]
    seconds = sum(sec for _, sec, _ in timed)
    tokens = sum(tok for _, _, tok in timed)
    tok_s = tokens / seconds if seconds > 0 else 0.0
    step_ms = [1e3 * sec for _, sec, _ in timed]
    fpt, hfpt, peak = run.flops_per_token, run.derived["hardware_flops_per_token"], run.peak_flops
    return {
        "tokens_per_s": round(tok_s, 1),
        "step_ms": round(statistics.median(step_ms), 2) if step_ms else None,
        "mfu": round(measure.mfu(tok_s, fpt, peak), 4),
        "hfu": round(measure.mfu(tok_s, hfpt, peak), 4),
        "peak_mem_bytes": peak_mem,
        "peak_mem_source": mem_source,
        "peak_mem_step_bytes": peak_mem - base_mem,  # above the memory held when the loop started
        "plan_mem_bytes": int(plan["memory"]["total"]),
        "plan_tokens_per_s": plan.get("expected_tokens_per_s"),
        "plan_mfu": plan.get("expected_mfu"),
        "step_ms_min": round(min(step_ms), 2) if step_ms else None,
        "step_ms_max": round(max(step_ms), 2) if step_ms else None,
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "profiled": bool(cfg.train.profile.steps),  # the profiler slows the steps it records
        **_setting(run, cfg),
    }


def _setting(run, cfg) -> Dict[str, Any]:
    """What was benchmarked: the model, the data, the hardware and each speed lever's setting."""
    import torch  # off the start-up path of --help and config errors

    hw, m = cfg.hardware, cfg.model
    fpt, hfpt, peak = run.flops_per_token, run.derived["hardware_flops_per_token"], run.peak_flops
    return {
        "model": m.name,
        "params": run.num_params,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_embd": m.n_embd,
        "block_size": m.block_size,
        "vocab_size": run.model_config["vocab_size"],
        "data": cfg.data.name,
        "hardware": hw.name,
        "device": str(run.dist.device),
        "world_size": run.dist.world_size,
        "precision": hw.precision,
        "precision_reason": run.derived.get("precision_reason"),
        "compile": cfg.compile,
        "compile_reason": run.derived.get("compile_reason"),
        "activation_checkpointing": cfg.parallelism.activation_checkpointing,
        "strategy": cfg.parallelism.strategy,
        "attention_backend": hw.attention_backend,
        "threads": torch.get_num_threads(),
        "batch_size": cfg.train.batch_size,
        "micro_batch_size": run.derived["micro_batch_size"],
        "accum_steps": run.derived["accum_steps"],
        "tokens_per_step": run.derived["tokens_per_step"],
        "flops_per_token": fpt,
        "hardware_flops_per_token": hfpt,
        "peak_flops": peak,
        "peak_flops_source": _peak_source(run.dist.device.type, hw),
        "torch": torch.__version__,
    }


def _peak_source(device: str, hw) -> str:
    """Where the peak FLOP/s came from: the preset's figures, else (the CPU) measured."""
    from gptlab.perf.costs import peak_tflops_for  # torch: off the start-up path of --help

    figures = hw.precision, hw.tf32, hw.peak_tflops, hw.peak_tflops_tf32, hw.peak_tflops_fp32
    return "measured" if device == "cpu" and not peak_tflops_for(*figures) else "config"


def _prediction(config: BenchConfig, stands_for: int) -> Tuple[BenchConfig, Dict[str, Any]]:
    """The config as the planner resolves it, and the planner's figures for it.

    It resolves compile=auto and micro_batch_size=auto; the figures (memory, tokens/s, MFU) are
    printed beside the measured ones.
    """
    # torch: off the start-up path of --help and config errors
    from gptlab.perf.costs import (
        DEFAULT_MFU,
        make_plan,
        plan_json,
        resolve_auto,
        resolve_micro_batch,
        step_estimate,
    )

    planned = resolve_micro_batch(resolve_auto(config, stands_for)[0])
    plan = make_plan(planned)
    est = step_estimate(plan, planned, DEFAULT_MFU[config.hardware.device])
    return planned, plan_json(planned, plan, est)


def run_length(cfg: DictConfig) -> int:
    """The steps of the run a benchmark stands for: train.max_steps, or what its budget buys."""
    if cfg.train.max_steps is not None:
        return int(cfg.train.max_steps)
    from gptlab.perf.costs import resolve_budget

    return resolve_budget(to_config(cfg, BenchConfig))[0].train.max_steps


def run_bench(cfg: DictConfig, run_dir: Path) -> Dict[str, Any]:
    """Build, time, and print one JSON line (rank 0). cfg: conf/bench.yaml's (cli.compose)."""
    stands_for = run_length(cfg)  # compile=auto decides for the run a bench measures
    cfg = bench_config(cfg)
    config = to_config(cfg, BenchConfig)
    # torch: off the start-up path of --help and config errors (imported once the config is valid)
    import torch

    from gptlab.distributed import world as distributed
    from gptlab.perf import measure
    from gptlab.training.build import build
    from gptlab.training.loop import train

    flags = dataclasses.asdict(config.bench)  # warmup, steps, mlflow
    if distributed.role(config.hardware) == "parent":
        n = config.hardware.nproc_per_node
        raise GptlabError(
            f"hardware={config.hardware.name} asks for {n} processes: start the benchmark with "
            f"torchrun --nproc_per_node={n} -m gptlab.bench ..."
        )
    planned, predicted = _prediction(config, stands_for)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    # named and tagged as a benchmark (records.identity)
    run = build(config, run_dir, resolved, auto_steps=stands_for)
    config = planned
    status = "FAILED"
    try:
        cuda = run.dist.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(run.dist.device)
            torch.cuda.reset_peak_memory_stats(run.dist.device)
            base = torch.cuda.memory_allocated(run.dist.device)
        else:
            measure.reset_peak_rss()
            base = measure.current_rss_bytes()
        with console.quiet():
            train(run)  # the loop's progress lines are not the benchmark's output
        if cuda:
            peak, source = torch.cuda.max_memory_allocated(run.dist.device), "cuda_max_allocated"
        else:
            peak, source = measure.peak_rss_bytes(), "peak_rss"
        result = summarise(run, run.timings, flags["warmup"], peak, source, base, predicted, config)
        if run.dist.is_main:
            (Path(run.run_dir) / layout.BENCH).write_text(json.dumps(result, indent=1) + "\n")
            mlflow_run = getattr(run.tracker, "mlflow", None)
            if mlflow_run is not None:
                mlflow_run.log_summary(
                    config.train.max_steps,
                    {
                        f"bench/{k}": float(v)
                        for k, v in result.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)
                    },
                )
                run.tracker.log_artifact(Path(run.run_dir) / layout.BENCH)
            print(json.dumps(result), flush=True)
        status = "FINISHED"
        return result
    finally:
        run.close(status)


def _job(cfg: DictConfig) -> Dict[str, Any]:
    """One benchmark (one job of a sweep): its run folder is Hydra's output folder."""
    hc = HydraConfig.get()
    if cfg.bench.coord_check:  # muP's coordinate check: widths, not speed (gptlab/perf)
        from gptlab.perf import coord_check  # torch: off the start-up path of --help and errors

        config = to_config(bench_config(cfg), BenchConfig)
        return coord_check.run(config, Path(hc.runtime.output_dir))
    if cfg.bench.ladder:

        def typed(c: DictConfig) -> BenchConfig:
            return to_config(bench_config(c), BenchConfig)

        typed(cfg)  # a config error is one line before the ladder imports torch
        from gptlab.distributed import world  # torch: off the start-up path of --help and errors
        from gptlab.perf import ladder

        if world.role(typed(cfg).hardware) in ("torchrun", "slurm"):
            raise GptlabError(
                "bench.ladder=true starts each rung's processes itself: run it without torchrun"
            )
        return ladder.run(cfg, typed, list(hc.overrides.task), Path(hc.runtime.output_dir))
    return run_bench(cfg, Path(hc.runtime.output_dir))


def main() -> None:
    """python -m gptlab.bench [overrides]: a Hydra app on conf/bench.yaml."""
    from gptlab.console import ConsoleHandler

    ConsoleHandler.info_stream_is_stderr = True  # stdout is the JSON line, nothing else
    command("bench", _job)


if __name__ == "__main__":
    main()
