"""Optimizer: parameter groups, AdamW, Muon, the weight average, and the learning-rate schedule
lr_at(step)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adam import adam as adam_step


@dataclass
class OptimizerConfig:
    name: str  # adamw | muon (Muon on the blocks' matrices, AdamW on the rest)
    lr: float  # peak learning rate (before lr_scaling)
    min_lr_ratio: float  # the cosine floor, as a fraction of the peak
    betas: Tuple[float, float]
    eps: float
    weight_decay: float  # on matrices only (not biases, LayerNorm gains)
    grad_clip: float  # max global grad norm; 0 disables clipping
    warmup_steps: int
    schedule: str  # cosine | linear | constant (after warmup)
    decay_steps: Optional[int]  # null: decay over train.max_steps
    lr_scaling: str  # none | sqrt | linear: scale lr with the number of data-parallel ranks
    fused: Optional[bool]  # null: fused kernels where the device supports them
    muon_momentum: float  # name=muon: Nesterov momentum of the orthogonalised matrix updates
    muon_ns_steps: int  # name=muon: Newton-Schulz iterations per update
    # name=muon: auto (bf16 where bf16 matmuls are native, else fp32) | bf16 | fp32
    muon_ns_dtype: str
    # > 0: evaluate, sample and export an exponential moving average of the weights
    ema_decay: float


def scaled_lr(cfg: OptimizerConfig, world_size: int) -> float:
    """The peak lr after the data-parallel scaling rule (sqrt as in the 1B reference run)."""
    factor = {"none": 1.0, "sqrt": math.sqrt(world_size), "linear": float(world_size)}[
        cfg.lr_scaling
    ]
    return cfg.lr * factor


def lr_at(step: int, peak: float, cfg: OptimizerConfig, total_steps: int) -> float:
    """Linear warmup over warmup_steps, then decay to min_lr_ratio * peak at decay_steps."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    floor = peak * cfg.min_lr_ratio
    decay = cfg.decay_steps or total_steps
    if cfg.schedule == "constant" or decay <= cfg.warmup_steps:
        return peak
    progress = min(1.0, (step - cfg.warmup_steps) / (decay - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


FUSED_ADAMW_DEVICES = ("cuda", "cpu")  # where torch has a fused AdamW kernel


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, lr: float, device_type: str
) -> torch.optim.Optimizer:
    """AdamW with weight decay on >=2-D tensors (matrices, embeddings) only; name=muon: Muon on the
    blocks' matrices, AdamW on the rest, with the same decay rule."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    # One fused kernel per step on CUDA and the CPU: faster than the for-each default, the same
    # update to rounding (docs/measurements/2026-11-30-cpu-speed.md has the figures).
    fused = cfg.fused if cfg.fused is not None else device_type in FUSED_ADAMW_DEVICES
    if cfg.name == "muon":
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        matrices = [p for p in decay if p.dim() == 2 and id(p) not in embeddings]
        taken = {id(p) for p in matrices}
        groups = [
            {"params": matrices, "weight_decay": cfg.weight_decay, "muon": True},
            {
                "params": [p for p in decay if id(p) not in taken],
                "weight_decay": cfg.weight_decay,
                "muon": False,
            },
            {"params": no_decay, "weight_decay": 0.0, "muon": False},
        ]
        optimizer: torch.optim.Optimizer = Muon(
            groups,
            lr,
            tuple(cfg.betas),
            cfg.eps,
            cfg.muon_momentum,
            cfg.muon_ns_steps,
            fused,
            cfg.muon_ns_dtype,
        )
    else:
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused
        )
    if cfg.ema_decay > 0:
        WeightAverage(cfg.ema_decay).attach(optimizer)
    # resumed from a run that averaged: its average would stand still, and be evaluated and saved
    else:
        optimizer.register_load_state_dict_post_hook(drop_average)
    return optimizer


# ------------------------------------------------------------------------------ the weight average

# The exponential moving average of the weights is per-parameter optimizer state under this key, so
# it is saved, resharded and restored with the moments (a sharded run keeps the average of its own
# shard), and a resumed run goes on averaging exactly where it stopped.
AVERAGE = "ema"
# per parameter, beside its average: how many updates it has had (the first included)
UPDATES = "ema_updates"


class WeightAverage:
    """Keeps an exponential moving average of an optimizer's parameters, through the optimizer's
    hooks: after each step, average = d * average + (1 - d) * weights, the first step starting the
    average at the weights it produced. d = min(decay, (1 + n) / (10 + n)) after n updates: a short
    run (or the start of a long one) averages over its last few steps instead of lagging behind at
    its initial weights (0.775 after 30 updates, 0.991 after 1,000, decay itself from about 4,500 at
    0.998).

    n is saved as per-parameter state (UPDATES) with the average, and counted here in Python too, so
    a step reads no device value; loading a state has the next step read the loaded count, once."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.updates: Optional[int] = None  # None: read the saved count at the next update

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.update(opt))
        optimizer.register_load_state_dict_post_hook(lambda opt: self.forget_count())

    def forget_count(self) -> None:
        self.updates = None

    @torch.no_grad()
    def update(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        states = [optimizer.state[p] for p in params]
        if self.updates is None:  # first step of this process, or just loaded: read it once
            counted = next((s[UPDATES] for s in states if UPDATES in s), None)
            self.updates = int(counted.item()) if counted is not None else 0
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        started, weights, counts = [], [], []
        for p, state in zip(params, states):
            if AVERAGE in state and UPDATES in state:
                started.append(state[AVERAGE])
                weights.append(p.detach())
                counts.append(state[UPDATES])
            else:  # a new average (or one without its count): it starts at these weights, update 1
                state[AVERAGE] = p.detach().clone()
                # shape (1,), not 0-d: torch's state-dict helpers reshard it like the average
                state[UPDATES] = torch.ones(1, dtype=torch.float32, device=p.device)
        if started:
            torch._foreach_lerp_(started, weights, 1.0 - d)
            torch._foreach_add_(counts, 1.0)
        self.updates += 1


def drop_average(optimizer: torch.optim.Optimizer) -> None:
    """Forget every parameter's average (an optimizer without ema_decay that loaded one)."""
    for state in optimizer.state.values():
        state.pop(AVERAGE, None)
        state.pop(UPDATES, None)


@contextmanager
def averaged_weights(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
    """Inside, every parameter that has an average holds it (evaluation, sampling); the training
    weights are back afterwards, bit for bit. Without an average (ema_decay=0) it changes nothing.
    Yields whether it swapped any weights in."""
    pairs = [(p.detach(), s[AVERAGE]) for p, s in optimizer.state.items() if AVERAGE in s]
    saved = [p.clone() for p, _ in pairs]
    with torch.no_grad():
        for p, avg in pairs:
            p.copy_(avg)
    try:
        yield bool(pairs)
    finally:
        with torch.no_grad():
            for (p, _), kept in zip(pairs, saved):
                p.copy_(kept)


def load_average(model: nn.Module, optimizer_state: Optional[Dict[str, Any]]) -> bool:
    """Copy a saved optimizer state's weight average (keyed by parameter name, as checkpoints hold
    it) into model's parameters; True if there was one. Tied parameters take it under any of their
    names."""
    saved = (optimizer_state or {}).get("state", {})
    found = False
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            avg = saved.get(name, {}).get(AVERAGE)
            if avg is not None:
                p.copy_(avg)
                found = True
    return found


# a quintic Newton-Schulz iteration tuned to converge in ~5 steps
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximately U V^T of each matrix's SVD (singular values pushed into about [0.7, 1.2]): a
    Newton-Schulz iteration on a (..., rows, cols) stack with rows <= cols, in g's dtype."""
    a, b, c = NS_COEFFS
    x = g / (g.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    flat = x.dim() == 2
    if flat:
        x = x.unsqueeze(0)
    for _ in range(steps):
        gram = x @ x.mT
        # b * gram + c * gram @ gram, one kernel
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        # a * x + poly @ x as (a I + poly) @ x: baddbmm would first copy all of x into its output (a
        # fifth of the iteration's time on the CPU); the identity term touches only the small gram.
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        x = poly @ x
    return x.squeeze(0) if flat else x


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are native here (CUDA; a CPU with AVX-512-BF16 or AMX).

    Not oneDNN's "bf16 supported", which is true on any AVX-512 CPU: without the bf16 instructions
    it emulates them, and a Newton-Schulz iteration runs 3-4x slower than in fp32 (measured on an
    AVX-512 Xeon without either: a (8, 128, 512) stack, 4 steps, 23.5 ms in bf16 against 6.9 ms in
    fp32).
    """
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool(
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )


def ns_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The dtype of Muon's Newton-Schulz iteration: auto is bf16 where bf16 matmuls are native."""
    if choice == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]


class Muon(torch.optim.Optimizer):
    """Muon for groups with muon=True: Nesterov momentum, then each matrix's update orthogonalised
    by Newton-Schulz (in bf16 where bf16 matmuls are native, as the method intends; fp32 elsewhere),
    scaled by 0.2 * sqrt(max(rows, cols)) so that its RMS matches AdamW's. That lets both kinds
    share one lr, one weight decay and one schedule. Groups with muon=False take torch's AdamW step
    (fused: its fused kernel, as build_optimizer chooses for AdamW)."""

    def __init__(
        self,
        groups,
        lr: float,
        betas,
        eps: float,
        momentum: float,
        ns_steps: int,
        fused: bool,
        ns_dtype: str = "auto",
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, momentum=momentum, ns_steps=ns_steps, fused=fused
        )
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype  # not a group default: a choice of arithmetic, not state to save

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(group, params)

    def _muon(self, group, params):
        states = [self.state[p] for p in params]
        for p, s in zip(params, states):
            if not s:
                s["momentum_buffer"] = torch.zeros_like(p)
        bufs = [s["momentum_buffer"] for s in states]
        grads = [p.grad for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
        updates = torch._foreach_lerp(grads, bufs, group["momentum"])  # Nesterov
        # One batched iteration per matrix shape, each matrix turned wide (rows <= cols): a block's
        # c_fc (4C, C) and its MLP c_proj (C, 4C) share one (2 n_layer, C, 4C) stack. Under FSDP
        # each rank holds a shard of rows (a DTensor): the whole update is gathered, and every rank
        # orthogonalises every matrix and keeps its own rows, so the step equals one process's.
        by_shape: dict = {}
        for u, p in zip(updates, params):
            whole = u.full_tensor() if isinstance(u, DTensor) else u
            tall = whole.shape[0] > whole.shape[1]
            wide = whole.mT if tall else whole
            by_shape.setdefault(tuple(wide.shape), []).append((wide, p, tall))
        device = updates[0].device
        dtype = ns_dtype(self.ns_dtype, device)
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        for shape, members in by_shape.items():
            stack = torch.empty((len(members), *shape), dtype=dtype, device=device)
            for j, (wide, _, _) in enumerate(members):
                stack[j].copy_(wide)  # the cast to the iteration's dtype in the same copy
            ortho = orthogonalize(stack, group["ns_steps"])
            # the 0.2 sqrt(max dim) scale, the lr and the cast back folded into one add per matrix
            alpha = -group["lr"] * 0.2 * math.sqrt(max(shape))
            for j, (_, p, tall) in enumerate(members):
                o = ortho[j].mT if tall else ortho[j]
                if isinstance(p, DTensor):  # this rank's rows, sliced here: no communication
                    o = distribute_tensor(
                        o.contiguous(), p.device_mesh, p.placements, src_data_rank=None
                    )
                p.add_(o, alpha=alpha)

    def _adamw(self, group, params):
        for p in params:
            if not self.state[p]:
                self.state[p].update(
                    step=torch.zeros((), dtype=torch.float32, device=p.device),
                    exp_avg=torch.zeros_like(p),
                    exp_avg_sq=torch.zeros_like(p),
                )
        states = [self.state[p] for p in params]
        b1, b2 = group["betas"]
        adam_step(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=group["fused"],
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
