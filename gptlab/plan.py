"""python -m gptlab.plan [overrides]: will this run fit, and how long will it take? Nothing is allocated.

Prints the parameters, FLOPs per token, memory per device by part (weights, gradients, optimizer
state, activations with and without activation checkpointing), the largest micro-batch that fits
the device, the accumulation steps that follow, and the step time, tokens/s and time to
train.max_steps at a stated MFU (``plan.mfu=0.4``; ``plan.json=true`` prints one JSON object instead).
A run whose micro-batch does not fit ends with one line saying what would. The root config is
conf/plan.yaml: the training config and the planner's own keys (``PlanConfig``).

``train.micro_batch_size=auto`` is resolved once, by ``resolve_micro_batch`` when a run is built: the
largest micro-batch that fits.
The memory model is in ``metrics.memory_estimate``; tests/test_plan.py checks it against measured
allocations on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore

from gptlab.config import SHARDED, Config, HardwareConfig
from gptlab.errors import GptlabError
from gptlab.metrics import (
    Shape,
    flops_per_token,
    machine_memory_bytes,
    matmul_params,
    measured_cpu_peak,
    memory_estimate,
    peak_tflops_for,
    recompute_flops_per_token,
    recomputed_matmul_params,
)
from gptlab.model import GPTConfig, padded_vocab

GiB = 2**30
# Not every byte of a device is the program's: the CUDA context, cuBLAS / NCCL workspaces and the
# caching allocator's fragmentation take a few GB of a GPU; the OS, Python and the data take RAM.
USABLE_FRACTION = {"cuda": 0.92, "cpu": 0.80}
# The MFU a plan assumes unless plan.mfu says otherwise: a well-tuned GPT step with bf16, flash attention
# and compile reaches about this on A100/H100; the CPU figure is against the measured fp32 matmul rate.
DEFAULT_MFU = {"cuda": 0.40, "cpu": 0.60}
_KNOWN_VOCAB = {"gpt2": 50257}


@dataclass
class Plan:
    shape: Shape
    params: int
    vocab_assumed: bool
    flops_per_token: float
    hardware_flops_per_token: float  # with the recomputation of activation checkpointing, if on
    device_bytes: float  # per device
    usable_bytes: float
    micro_batch: int  # as configured (or chosen by auto)
    checkpointing: bool
    memory: Dict[str, float]  # memory_estimate at micro_batch with the configured checkpointing
    memory_ckpt: Dict[str, float]  # ... with activation checkpointing on
    memory_no_ckpt: Dict[str, float]  # ... and off
    largest_fit: Optional[int]  # largest micro-batch dividing the per-rank batch that fits (configured ckpt)
    largest_fit_other: Optional[int]  # the same with checkpointing flipped
    per_rank_batch: int
    world_size: int

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.usable_bytes


def vocab_for(cfg: Config) -> Tuple[int, bool]:
    """The vocabulary the model will have (model.vocab_size, else the tokenizer's); True if assumed.

    A character vocabulary is only known once the text is read: 65 for Tiny Shakespeare, else 256.
    """
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, False
    tok = cfg.data.tokenizer
    if tok.kind in _KNOWN_VOCAB:
        return _KNOWN_VOCAB[tok.kind], False
    if tok.kind == "bpe":
        return tok.vocab_size, False
    return (65 if cfg.data.source == "shakespeare" else 256), True


def block_params(m: GPTConfig) -> int:
    """Parameters of one transformer block: two LayerNorms, attention's projections, the MLP, biases."""
    d, h, b = m.n_embd, m.hidden_dim, 1 if m.bias else 0
    fc_out = (2 if m.mlp == "swiglu" else 1) * h
    layer_norms = 2 * (d + b * d)
    attention = 3 * d * d + b * 3 * d + d * d + b * d  # c_attn, c_proj
    mlp = d * fc_out + b * fc_out + h * d + b * d  # c_fc, c_proj
    return layer_norms + attention + mlp


def optimizer_floats(cfg: Config, params: int, matmuls: int, head: int) -> float:
    """fp32 numbers of optimizer state per parameter: AdamW's two moments for every parameter; with
    Muon, one momentum for each matrix it orthogonalises (every matmul weight but a tied head, which is
    the embedding) and AdamW's two for the rest; one more for the weight average (optimizer.ema_decay > 0).
    matmuls: metrics.matmul_params; head: the LM head's weights (padded vocabulary x n_embd)."""
    o = cfg.optimizer
    floats = 2.0 * params
    if o.name == "muon":
        floats -= matmuls - (head if cfg.model.tie_weights else 0)
    return floats / params + (1.0 if o.ema_decay > 0 else 0.0)


def optimizer_label(cfg: Config) -> str:
    """What the optimizer's memory holds, in the report's words."""
    kind = "Muon/AdamW" if cfg.optimizer.name == "muon" else "AdamW"
    return kind + (" + average" if cfg.optimizer.ema_decay > 0 else " state")


def param_count(cfg: Config, vocab: int) -> int:
    """Parameters of gptlab.model.GPT for this config, without building it."""
    m = cfg.model
    d, V, b = m.n_embd, padded_vocab(vocab, m.vocab_multiple), 1 if m.bias else 0
    total = V * d + m.n_layer * block_params(m) + (d + b * d)  # wte, blocks, ln_f
    if m.pos_emb == "learned":
        total += m.block_size * d
    if not m.tie_weights:
        total += V * d
    return total


LOSS_CHUNK_TOKENS = 1024  # parallelism.loss_chunk=null's chunk, where it chunks


def loss_chunk(par: Any, m: GPTConfig, vocab: int) -> int:
    """Tokens per chunk of the LM head + loss: parallelism.loss_chunk, or when null, chunks where the
    logits are the step's largest tensor (a vocabulary wider than the MLP's 4 x n_embd), else 0."""
    if par.loss_chunk is not None:
        return par.loss_chunk
    return LOSS_CHUNK_TOKENS if padded_vocab(vocab, m.vocab_multiple) > 4 * m.n_embd else 0


def flops_for(m: GPTConfig, vocab: int, checkpointing: bool) -> Tuple[float, float]:
    """(model FLOPs per token, hardware FLOPs per token) for a model of this shape and vocabulary.

    Hardware FLOPs add what activation checkpointing recomputes (HFU); see metrics.py.
    """
    hidden, swiglu = m.hidden_dim, m.mlp == "swiglu"
    weights = matmul_params(m.n_layer, m.n_embd, hidden, padded_vocab(vocab, m.vocab_multiple), swiglu)
    fpt = flops_per_token(m.n_layer, m.n_embd, m.block_size, weights)
    if not checkpointing:
        return fpt, fpt
    recomputed = recomputed_matmul_params(m.n_layer, m.n_embd, hidden, swiglu)
    return fpt, fpt + recompute_flops_per_token(m.n_layer, m.n_embd, m.block_size, recomputed)


def device_peak(hw: HardwareConfig) -> Tuple[float, str]:
    """(peak FLOP/s of one device at the hardware's precision, where it came from).

    From the preset's figures ("config"), else the CPU's measured matmul rate ("measured"), else
    (0.0, "unknown") for a GPU preset without figures (MFU is then not reported).
    """
    tflops = peak_tflops_for(hw.precision, hw.tf32, hw.peak_tflops, hw.peak_tflops_tf32, hw.peak_tflops_fp32)
    if tflops:
        return tflops * 1e12, "config"
    if hw.device == "cpu":
        return measured_cpu_peak("bfloat16" if hw.precision == "bf16" else "float32"), "measured"
    return 0.0, "unknown"


def shape_for(cfg: Config) -> Tuple[Shape, int, bool]:
    m, hw = cfg.model, cfg.hardware
    vocab, assumed = vocab_for(cfg)
    V = padded_vocab(vocab, m.vocab_multiple)
    hidden = m.hidden_dim
    swiglu = m.mlp == "swiglu"
    params = param_count(cfg, vocab)
    matmuls = matmul_params(m.n_layer, m.n_embd, hidden, V, swiglu)
    # SDPA's fused kernels keep no T x T matrix; on the CPU they take no dropout, so the math path does
    fused = hw.attention_backend != "math" and (hw.device == "cuda" or m.dropout == 0)
    shape = Shape(
        n_layer=m.n_layer,
        n_embd=m.n_embd,
        n_head=m.n_head,
        hidden=hidden,
        vocab=V,
        block_size=m.block_size,
        params=params,
        matmul_params=matmuls,
        swiglu=swiglu,
        rotary=m.pos_emb == "rotary",
        dropout=m.dropout,
        precision=hw.precision,
        flash=fused,
        device=hw.device,
        world_size=cfg.world_size,
        sharded=cfg.parallelism.strategy in SHARDED,
        shards=cfg.world_size // hw.nodes if cfg.parallelism.strategy == "hsdp" else cfg.world_size,
        reshard=cfg.parallelism.reshard_after_forward,
        layer_params=block_params(m),
        loss_chunk=loss_chunk(cfg.parallelism, m, vocab),
        optimizer_floats=optimizer_floats(cfg, params, matmuls, V * m.n_embd),
    )
    return shape, params, assumed


def device_memory_bytes(cfg: Config) -> float:
    """Memory of one device: hardware.memory_gb, else this machine's RAM (shared by its processes)
    on the CPU, else the visible GPU's."""
    hw = cfg.hardware
    if hw.memory_gb:
        return hw.memory_gb * GiB
    if hw.device == "cpu":
        return machine_memory_bytes() / max(1, hw.nproc_per_node)
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    raise GptlabError(
        f"hardware.memory_gb: unknown for hardware={hw.name} without a visible GPU; set it, e.g. hardware.memory_gb=80"
    )


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def largest_fit(shape: Shape, per_rank: int, checkpointing: bool, usable: float) -> Optional[int]:
    fitting = [k for k in _divisors(per_rank) if memory_estimate(shape, k, checkpointing)["total"] <= usable]
    return max(fitting) if fitting else None


def make_plan(cfg: Config, micro_batch: Optional[int] = None) -> Plan:
    """The plan for a validated Config (micro_batch: the one to evaluate; default: the config's)."""
    shape, params, assumed = shape_for(cfg)
    ckpt = cfg.parallelism.activation_checkpointing
    fpt, hfpt = flops_for(cfg.model, vocab_for(cfg)[0], ckpt)
    device = device_memory_bytes(cfg)
    usable = device * USABLE_FRACTION[cfg.hardware.device]
    per_rank = cfg.train.batch_size // cfg.world_size
    mb = micro_batch if micro_batch is not None else cfg.micro_batch_size
    return Plan(
        shape=shape,
        params=params,
        vocab_assumed=assumed,
        flops_per_token=fpt,
        hardware_flops_per_token=hfpt,
        device_bytes=device,
        usable_bytes=usable,
        micro_batch=mb,
        checkpointing=ckpt,
        memory=memory_estimate(shape, mb, ckpt),
        memory_ckpt=memory_estimate(shape, mb, True),
        memory_no_ckpt=memory_estimate(shape, mb, False),
        largest_fit=largest_fit(shape, per_rank, ckpt, usable),
        largest_fit_other=largest_fit(shape, per_rank, not ckpt, usable),
        per_rank_batch=per_rank,
        world_size=cfg.world_size,
    )


def resolve_micro_batch(cfg: Config) -> Config:
    """The config with train.micro_batch_size=auto replaced by the planner's choice (else unchanged)."""
    if cfg.train.micro_batch_size != "auto":
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=auto_micro_batch(cfg)))


def auto_micro_batch(cfg: Config) -> int:
    """train.micro_batch_size=auto: the largest micro-batch that divides the per-process batch and fits."""
    shape, _, _ = shape_for(cfg)
    per_rank = cfg.train.batch_size // cfg.world_size  # >= 1: to_config refuses a batch the processes do not split
    usable = device_memory_bytes(cfg) * USABLE_FRACTION[cfg.hardware.device]
    ckpt = cfg.parallelism.activation_checkpointing
    mb = largest_fit(shape, per_rank, ckpt, usable)
    if mb is None:
        raise GptlabError(what_would_fit(cfg, shape, per_rank, ckpt, usable, 1))
    return mb


def what_would_fit(cfg: Config, shape: Shape, per_rank: int, ckpt: bool, usable: float, mb: int) -> str:
    """One line: how much this needs, how much there is, and what change would fit."""
    need = memory_estimate(shape, mb, ckpt)["total"]
    head = (
        f"train.micro_batch_size={mb}: needs {need / GiB:.1f} GiB per device, more than the "
        f"{usable / GiB:.1f} GiB usable of hardware={cfg.hardware.name}"
    )
    options = []
    if not ckpt and memory_estimate(shape, mb, True)["total"] <= usable:
        options.append(
            f"parallelism.activation_checkpointing=true ({memory_estimate(shape, mb, True)['total'] / GiB:.1f} GiB)"
        )
    own, other = largest_fit(shape, per_rank, ckpt, usable), largest_fit(shape, per_rank, not ckpt, usable)
    if own is not None and own < mb:
        options.append(f"train.micro_batch_size={own} with {per_rank // own} accumulation steps")
    elif not ckpt and other is not None and other < mb:
        options.append(f"activation checkpointing with train.micro_batch_size={other}")
    sharded = fsdp_alternative(cfg, shape, per_rank, ckpt, usable, mb) if not shape.sharded else None
    if sharded:
        options.insert(0, sharded)
    if not options:
        static = sum(memory_estimate(shape, 1, True)[k] for k in ("weights", "grads", "optimizer", "ddp"))
        more = "" if shape.sharded else ", which more data-parallel GPUs do not shrink"
        options.append(
            f"a device with more memory (hardware.memory_gb): weights, gradients and optimizer "
            f"state alone take {static / GiB:.1f} GiB{more}; a smaller model.n_layer / model.n_embd"
        )
    return f"{head}; would fit: " + ", or ".join(options)


def fsdp_alternative(cfg: Config, shape: Shape, per_rank: int, ckpt: bool, usable: float, mb: int) -> Optional[str]:
    """For an unsharded run on several devices: the fsdp setting that would fit, if one does."""
    if cfg.world_size < 2:
        return None
    sharded = dataclasses.replace(shape, sharded=True, shards=cfg.world_size)
    for checkpointing in (ckpt, True):
        for k in sorted(_divisors(per_rank), reverse=True):
            need = memory_estimate(sharded, k, checkpointing)["total"]
            if k <= mb and need <= usable:
                # the fsdp preset turns activation checkpointing on
                how = [] if checkpointing else ["parallelism.activation_checkpointing=false"]
                how += [] if k == mb else [f"train.micro_batch_size={k}"]
                return f"parallelism=fsdp {' '.join(how)}".rstrip() + f" ({need / GiB:.1f} GiB per device)"
    return None


def step_estimate(plan: Plan, cfg: Config, mfu_value: float) -> Dict[str, float]:
    """Step time, tokens/s and time to train.max_steps at the given MFU of the job's peak."""
    peak, source = device_peak(cfg.hardware)
    if not peak:
        return {}
    job_peak = peak * cfg.world_size
    tokens_per_step = cfg.train.batch_size * cfg.model.block_size
    tok_s = mfu_value * job_peak / plan.flops_per_token
    step_s = tokens_per_step / tok_s
    return {
        "mfu": mfu_value,
        "peak_flops_per_device": peak,
        "peak_source": source,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tok_s,
        "step_s": step_s,
        "train_s": step_s * cfg.train.max_steps,
    }


def _steps(n: int) -> str:
    return f"{n} accumulation step{'s' if n != 1 else ''}"


def _gb(x: float) -> str:
    return f"{x / GiB:8.2f} GiB"


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def report(cfg: Config, plan: Plan, est: Dict[str, float]) -> str:
    s, m, hw = plan.shape, cfg.model, cfg.hardware
    lines = [
        f"{m.name} on {hw.name} ({plan.world_size} x {hw.device}, {hw.precision}, {cfg.parallelism.strategy}): "
        f"{plan.params:,} parameters ({plan.params / 1e6:.1f}M), vocab {s.vocab}"
        + (" (assumed until the data is read)" if plan.vocab_assumed else ""),
        f"FLOPs per token: {plan.flops_per_token / 1e9:.3f} GFLOP (6N + attention)"
        + (
            f"; {plan.hardware_flops_per_token / 1e9:.3f} GFLOP with checkpointing's recomputation"
            if plan.checkpointing
            else ""
        ),
        f"batch: {cfg.train.batch_size} sequences x {m.block_size} tokens = "
        f"{cfg.train.batch_size * m.block_size:,} tokens per step; per device {plan.per_rank_batch} "
        f"= micro-batch {plan.micro_batch} x {_steps(plan.per_rank_batch // plan.micro_batch)}",
        f"memory per device at micro-batch {plan.micro_batch}:   {'checkpointing':>14} {'no checkpointing':>17}",
    ]
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
        ("total", "peak (estimate)"),
    ):
        lines.append(f"  {label:<40} {_gb(plan.memory_ckpt[key]):>14} {_gb(plan.memory_no_ckpt[key]):>17}")
    lines.append(
        f"  device memory {plan.device_bytes / GiB:.1f} GiB, usable "
        f"{plan.usable_bytes / GiB:.1f} GiB ({USABLE_FRACTION[hw.device]:.0%})"
    )
    for ckpt, mem, fit in (
        (True, plan.memory_ckpt, plan.largest_fit if plan.checkpointing else plan.largest_fit_other),
        (False, plan.memory_no_ckpt, plan.largest_fit_other if plan.checkpointing else plan.largest_fit),
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
            f"expected at {est['mfu']:.0%} MFU of {est['peak_flops_per_device'] / 1e12:.3g} TFLOP/s per device "
            f"({est['peak_source']}): {est['step_s'] * 1e3:,.0f} ms per step, "
            f"{est['tokens_per_s']:,.0f} tokens/s, {cfg.train.max_steps:,} steps in {_duration(est['train_s'])}"
        )
    lines.append(
        f"configured (activation checkpointing {'on' if plan.checkpointing else 'off'}): "
        + ("FITS" if plan.fits else "DOES NOT FIT")
    )
    return "\n".join(lines)


def plan_json(cfg: Config, plan: Plan, est: Dict[str, float]) -> Dict[str, Any]:
    return {
        "model": cfg.model.name,
        "hardware": cfg.hardware.name,
        "world_size": plan.world_size,
        "params": plan.params,
        "flops_per_token": plan.flops_per_token,
        "hardware_flops_per_token": plan.hardware_flops_per_token,
        "micro_batch_size": plan.micro_batch,
        "accum_steps": plan.per_rank_batch // plan.micro_batch,
        "activation_checkpointing": plan.checkpointing,
        "device_bytes": plan.device_bytes,
        "usable_bytes": plan.usable_bytes,
        "memory": plan.memory,
        "memory_ckpt": plan.memory_ckpt,
        "memory_no_ckpt": plan.memory_no_ckpt,
        "fits": plan.fits,
        "fits_ckpt": plan.memory_ckpt["total"] <= plan.usable_bytes,
        "fits_no_ckpt": plan.memory_no_ckpt["total"] <= plan.usable_bytes,
        "largest_micro_batch": plan.largest_fit,
        **{f"expected_{k}": v for k, v in est.items()},
    }


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

    cfg = resolve_micro_batch(to_config(cfg_dict, PlanConfig))
    settings = cfg.plan
    plan = make_plan(cfg)
    mfu_value = settings.mfu or DEFAULT_MFU[cfg.hardware.device]
    est = step_estimate(plan, cfg, mfu_value)
    out = plan_json(cfg, plan, est)
    print(json.dumps(out) if settings.json else report(cfg, plan, est), flush=True)
    if not plan.fits:
        raise GptlabError(
            what_would_fit(
                cfg, plan.shape, plan.per_rank_batch, plan.checkpointing, plan.usable_bytes, plan.micro_batch
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
