"""build(config) -> Run: the one place that turns typed config into objects and derived figures."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn

from gptlab import checkpoint, distributed
from gptlab.config import Config
from gptlab.data import RandomWindowLoader, Tokenizer, build_train_loader, eval_batches, prepare_data
from gptlab.distributed import Dist
from gptlab.errors import GptlabError
from gptlab.metrics import (
    expectation_met,
    flops_per_token,
    measured_cpu_peak,
    peak_tflops_for,
    recompute_flops_per_token,
    recomputed_matmul_params,
)
from gptlab.model import GPT
from gptlab.optim import build_optimizer, lr_at, scaled_lr
from gptlab.plan import resolve_micro_batch
from gptlab.tracking import NullTracker, Tracker, flatten, last_logged_step

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Run:
    """Everything the loop needs, already built."""

    train: Any  # TrainConfig
    dist: Dist
    model: nn.Module  # wrapped (checkpointing -> compile -> DDP)
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    lr_at: Callable[[int], float]
    grad_clip: float
    train_loader: RandomWindowLoader
    val_batches: List[Any]
    tokenizer: Tokenizer
    tracker: Any  # Tracker or NullTracker
    autocast: Callable[[], contextlib.AbstractContextManager]
    block_size: int
    num_params: int
    flops_per_token: float
    peak_flops: float
    run_dir: Path
    checkpoint_dir: Path
    resolved_config: Dict[str, Any]
    model_config: Dict[str, Any]
    summary: str = ""
    start_step: int = 0
    start_tokens: int = 0
    start_best_val: float = math.inf
    # on resume after a crash, steps already in metrics.jsonl / MLflow (logged after the checkpoint)
    # are not logged again: an exact resume recomputes the same values
    logged_until_step: int = 0
    derived: Dict[str, Any] = field(default_factory=dict)
    timings: List[Any] = field(default_factory=list)  # (step, seconds, tokens) per logged window

    def stateful(self) -> Dict[str, Any]:
        """The live objects a checkpoint saves, by checkpoint.STATEFUL name."""
        return {
            "model": self.raw_model,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "loader": self.train_loader,
        }

    def close(self, status: str) -> None:
        """Finish the records (FINISHED / FAILED) and leave the process group."""
        self.tracker.finish(status)
        distributed.teardown()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_factory(
    device_type: str, precision: str, attention_backend: str = "auto"
) -> Callable[[], contextlib.AbstractContextManager]:
    """The context every forward runs in: the hardware's autocast precision and SDPA kernel choice."""
    dtype = _AUTOCAST[precision]

    def context() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if dtype is not None:
            stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype))
        stack.enter_context(distributed.attention_context(attention_backend))
        return stack

    return context


def record_expectation(run: "Run", expected: Dict[str, Any], results: Dict[str, Any]) -> None:
    """For a recipe with an `expected:` block: whether the run met it, in results and as an MLflow tag."""
    met = expectation_met(expected, results) if expected else None
    if met is not None:
        results["expected_met"] = met
        run.tracker.set_tag("expected_met", str(met).lower())


def build(
    cfg: Config,
    run_dir: Path,
    resolved: Dict[str, Any],
    outputs: Path = Path("outputs"),
    run_name: Optional[str] = None,
    tags: Optional[Dict[str, str]] = None,
    log: Callable[[str], None] = print,
) -> Run:
    """Build every object of a training run from a validated Config."""
    cfg = resolve_micro_batch(cfg)  # train.micro_batch_size=auto: the planner's choice, once
    d = distributed.setup(cfg.hardware, cfg.parallelism)
    say = log if d.is_main else (lambda *_: None)
    # Every rank uses rank 0's run folder (under torchrun each rank's Hydra picked its own timestamp).
    own_dir, run_dir = Path(run_dir), Path(distributed.broadcast_object(str(run_dir)))
    if own_dir != run_dir and own_dir.is_dir() and {p.name for p in own_dir.iterdir()} <= {".hydra", "train.log"}:
        shutil.rmtree(own_dir, ignore_errors=True)  # this rank's unused, empty Hydra folder

    # Data: rank 0 prepares the token files first so the others only read them.
    if d.is_main:
        data = prepare_data(cfg.data, log=say)
    if d.world_size > 1:
        torch.distributed.barrier()
    if not d.is_main:
        data = prepare_data(cfg.data, log=say)
    train_tokens, val_tokens = data.tokens("train"), data.tokens("val")
    T = cfg.model.block_size
    if min(len(train_tokens), len(val_tokens)) < T + 1:
        raise GptlabError(
            f"model.block_size={T} is longer than the data allows ({len(val_tokens):,} validation tokens)"
        )

    # Model: identical initialisation on every rank, then per-rank seeds for dropout.
    mcfg = dataclasses.replace(cfg.model, vocab_size=data.vocab_size)
    seed_everything(cfg.train.seed)
    raw_model = GPT(mcfg).to(d.device)
    seed_everything(cfg.train.seed + d.rank)
    model = distributed.wrap_model(
        raw_model, d, cfg.parallelism.strategy, cfg.parallelism.activation_checkpointing, cfg.compile
    )

    world = d.world_size
    mb = cfg.micro_batch_size
    peak_lr = scaled_lr(cfg.optimizer, world)
    optimizer = build_optimizer(raw_model, cfg.optimizer, peak_lr, d.device.type)
    scaler = torch.amp.GradScaler(d.device.type, enabled=cfg.hardware.precision == "fp16")
    loader = build_train_loader(
        train_tokens,
        T,
        cfg.train.batch_size,
        mb,
        d.rank,
        world,
        cfg.train.seed,
        sampling=cfg.data.sampling,
        pin_memory=d.device.type == "cuda",
    )
    eval_bs = cfg.train.eval_batch_size or mb
    val = eval_batches(val_tokens, T, eval_bs, cfg.train.eval_steps, cfg.train.seed, d.rank, world)

    matmul_params = sum(m.weight.numel() for m in raw_model.modules() if isinstance(m, nn.Linear))
    fpt = flops_per_token(mcfg.n_layer, mcfg.n_embd, T, matmul_params)
    # activation checkpointing runs every block's forward twice: hardware FLOPs (HFU) count it
    recomputed = recomputed_matmul_params(mcfg.n_layer, mcfg.n_embd, mcfg.hidden_dim, mcfg.mlp == "swiglu")
    hfpt = fpt + (
        recompute_flops_per_token(mcfg.n_layer, mcfg.n_embd, T, recomputed)
        if cfg.parallelism.activation_checkpointing
        else 0.0
    )
    hw = cfg.hardware
    peak_tflops = peak_tflops_for(hw.precision, hw.tf32, hw.peak_tflops, hw.peak_tflops_tf32, hw.peak_tflops_fp32)
    if peak_tflops:
        peak = peak_tflops * 1e12
    elif d.device.type == "cpu":
        peak = measured_cpu_peak("bfloat16" if cfg.hardware.precision == "bf16" else "float32")
    else:
        peak = 0.0
    peak *= world  # the loop's tokens/s are the whole job's, so MFU compares with the whole job's peak
    num_params = raw_model.num_params()
    derived = {
        "params": num_params,
        "world_size": world,
        "micro_batch_size": mb,
        "accum_steps": loader.accum_steps,
        "tokens_per_step": cfg.train.batch_size * T,
        "peak_lr": peak_lr,
        "flops_per_token": fpt,
        "hardware_flops_per_token": hfpt,
        "peak_flops": peak,
        "data_dir": str(data.root),
        "train_tokens": len(train_tokens),
        "val_tokens": len(val_tokens),
        "tokenizer_sha256": data.tokenizer_sha256,
    }

    checkpoint_dir = run_dir / "checkpoints"
    start = {"step": 0, "tokens": 0, "best_val": math.inf}
    mlflow_run_id = None
    state = checkpoint.find_resume(cfg.train.resume, checkpoint_dir, say)
    state_loaded = state is not None
    if state is not None:
        state.restore({"model": raw_model, "optimizer": optimizer, "scaler": scaler, "loader": loader})
        start = {"step": state.step, "tokens": state.tokens, "best_val": state.best_val_loss}
        mlflow_run_id = state.mlflow_run_id
        del state

    model_name = f"{cfg.model.name}-{cfg.data.name}"
    if d.is_main:
        params = {**flatten(resolved), **{f"derived.{k}": v for k, v in derived.items()}}
        all_tags = {
            "hardware": cfg.hardware.name,
            "model": cfg.model.name,
            "data": cfg.data.name,
            "run_dir": str(run_dir.resolve()),
            **(tags or {}),
        }
        tracker: Any = Tracker(
            run_dir,
            cfg.tracking,
            outputs,
            cfg.tracking.experiment or model_name,
            run_name or cfg.tracking.run_name or f"{model_name}-{cfg.hardware.name}",
            params,
            all_tags,
            resume_run_id=mlflow_run_id,
        )
    else:
        tracker = NullTracker()

    if d.is_main and (job := distributed.slurm_job_info()) is not None:
        # the job's logs live in submitit's folder: say where from the run folder
        (run_dir / "slurm.json").write_text(json.dumps(job, indent=1) + "\n")
        say(f"SLURM job {job['job_id']} on {','.join(job['nodes'])}; logs: {job['stdout']}")

    summary = (
        f"{cfg.model.name}: {num_params / 1e6:.2f}M params | data {cfg.data.name} "
        f"({len(train_tokens):,} train tokens, vocab {data.vocab_size}) | {cfg.hardware.name} "
        f"x{world} {cfg.hardware.precision} | batch {cfg.train.batch_size} = {mb} x {loader.accum_steps} "
        f"accum x {world} ranks of {T} tokens | peak lr {peak_lr:g} | {cfg.train.max_steps} steps"
    )
    return Run(
        train=cfg.train,
        dist=d,
        model=model,
        raw_model=raw_model,
        optimizer=optimizer,
        scaler=scaler,
        lr_at=lambda s: lr_at(s, peak_lr, cfg.optimizer, cfg.train.max_steps),
        grad_clip=cfg.optimizer.grad_clip,
        train_loader=loader,
        val_batches=val,
        tokenizer=data.tokenizer,
        tracker=tracker,
        autocast=autocast_factory(d.device.type, cfg.hardware.precision, cfg.hardware.attention_backend),
        block_size=T,
        num_params=num_params,
        flops_per_token=fpt,
        peak_flops=peak,
        run_dir=run_dir,
        checkpoint_dir=checkpoint_dir,
        resolved_config=resolved,
        model_config=dataclasses.asdict(mcfg),
        summary=summary,
        start_step=start["step"],
        start_tokens=start["tokens"],
        start_best_val=start["best_val"],
        derived=derived,
        logged_until_step=last_logged_step(run_dir) if state_loaded else 0,
    )


def write_sample(run: Run) -> Optional[str]:
    """Generate train.sample_tokens of text from the trained model into samples.txt (rank 0)."""
    if not run.dist.is_main or run.train.sample_tokens <= 0:
        return None
    prompt = run.tokenizer.encode(run.train.sample_prompt) or [0]
    idx = torch.tensor([prompt], dtype=torch.long, device=run.dist.device)
    gen = torch.Generator(device=run.dist.device).manual_seed(run.train.seed)
    with run.autocast():
        out = run.raw_model.generate(idx, run.train.sample_tokens, temperature=0.8, top_k=200, generator=gen)
    text = run.tokenizer.decode(out[0].tolist())
    path = run.run_dir / "samples.txt"
    path.write_text(text)
    run.tracker.log_artifact(path)
    return text
