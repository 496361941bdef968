"""What a config costs, without building it: parameters, FLOPs, memory, and the plan that fits it.

Parameters are counted from the config alone (``param_count``, ``block_params``), as the model in
gptlab/model/gpt.py has them. Model FLOPs (MFU) count the work the model needs: every matmul of
every layer and the LM head, plus attention's T x T products, forward once and backward twice.
Hardware FLOPs (HFU) add what activation checkpointing recomputes (one more forward of every block).
Both are checked against ``torch.utils.flop_counter.FlopCounterMode`` in tests/test_perf_measure.py.

Memory per device (``memory_estimate``) is counted by part for one training step: weights,
gradients, optimizer state, DDP buckets, autocast copies, gathered shards and activations, with
and without activation checkpointing; tests/test_plan.py checks it against measured allocations.
``make_plan`` puts it together for a validated Config: the largest micro-batch that fits the
device, and ``step_estimate`` the step time at a stated MFU. ``resolve_micro_batch`` is how
``train.micro_batch_size=auto`` is resolved when a run is built; ``gptlab.plan`` prints a plan.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from gptlab.config import SHARDED, Config, HardwareConfig
from gptlab.errors import GptlabError
from gptlab.model.gpt import GPTConfig, padded_vocab
from gptlab.optim import OPTIMIZERS
from gptlab.optim.muon import muon_owners, ns_dtype
from gptlab.perf import fastpath
from gptlab.perf.measure import (
    gpu_peak_tflops,
    machine_memory_bytes,
    matmul_rate_at,
    measured_cpu_peak,
    measured_gpu_peak,
)

GiB = 2**30


# -------------------------------------------------------------------------------------- parameters


_KNOWN_VOCAB = {"gpt2": 50257}


def vocab_for(cfg: Config) -> Tuple[int, bool]:
    """The vocabulary the model will have (model.vocab_size, else the tokenizer's); True if assumed.

    A character vocabulary is only known once the text is read: 65 for Tiny Shakespeare, else 256.
    """
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, False
    tok = cfg.data.tokenizer
    if cfg.data.sources:  # a mixture: its sources' one tokenizer (data/mixture.py checks it is one)
        from gptlab.data.mixture import resolve

        tok = resolve(cfg.data)[0].cfg.tokenizer
    if tok.kind in _KNOWN_VOCAB:
        return _KNOWN_VOCAB[tok.kind], False
    if tok.kind == "bpe":
        return tok.vocab_size, False
    return (65 if cfg.data.source == "shakespeare" else 256), True


def block_params(m: GPTConfig) -> int:
    """Parameters of one transformer block.

    Two LayerNorms, attention's projections, the MLP and their biases.
    """
    d, h, b = m.n_embd, m.hidden_dim, 1 if m.bias else 0
    fc_out = (2 if m.mlp == "swiglu" else 1) * h
    layer_norms = 2 * (d + b * d)
    attention = 3 * d * d + b * 3 * d + d * d + b * d  # c_attn, c_proj
    mlp = d * fc_out + b * fc_out + h * d + b * d  # c_fc, c_proj
    return layer_norms + attention + mlp


def param_count(cfg: Config, vocab: int) -> int:
    """Parameters of gptlab.model.gpt.GPT for this config, without building it."""
    m = cfg.model
    d, V, b = m.n_embd, padded_vocab(vocab, m.vocab_multiple), 1 if m.bias else 0
    total = V * d + m.n_layer * block_params(m) + (d + b * d)  # wte, blocks, ln_f
    if m.pos_emb == "learned":
        total += m.block_size * d
    if not m.tie_weights:
        total += V * d
    return total


def optimizer_floats(cfg: Config, params: int, matmuls: int, head: int) -> float:
    """fp32 numbers of optimizer state per parameter, as the optimizer's row of the table says.

    The table is gptlab.optim.OPTIMIZERS; plus one for the weight average (optimizer.ema_decay > 0).
    The matrices Muon orthogonalises are every matmul weight but a tied head (the embedding).
    matmuls: matmul_params(); head: the LM head's weights (padded vocabulary x n_embd).
    """
    o = cfg.optimizer
    matrices = matmuls - (head if cfg.model.tie_weights else 0)
    floats = OPTIMIZERS[o.name].state_floats(params, matrices)
    return floats / params + (1.0 if o.ema_decay > 0 else 0.0)


# ------------------------------------------------------------------------------------------- FLOPs


def matmul_params(n_layer: int, n_embd: int, hidden: int, vocab: int, swiglu: bool = False) -> int:
    """Weights that take part in matmuls: q/k/v and output projections, the MLP, and the LM head.

    ``vocab`` is the padded vocabulary (the head multiplies by all of it). Embedding lookups and
    LayerNorms are not matmuls. A tied head still costs its matmul, so it is counted here.
    """
    per_layer = 4 * n_embd * n_embd + (3 if swiglu else 2) * n_embd * hidden
    return n_layer * per_layer + vocab * n_embd


def flops_per_token(n_layer: int, n_embd: int, block_size: int, matmul_params: int) -> float:
    """Training (model) FLOPs per token: 6 * matmul weights, plus attention's scores and sum.

    Forward is 2 FLOPs per weight per token plus 2 * 2 * T * d per layer for QK^T and AV (counted
    over the full T x T square, as PaLM's appendix and FlopCounterMode do; causal kernels skip about
    half of it, which MFU conventionally ignores); backward is twice the forward.
    """
    forward = 2 * matmul_params + 4 * n_layer * block_size * n_embd
    return 3.0 * forward


def recomputed_matmul_params(n_layer: int, n_embd: int, hidden: int, swiglu: bool = False) -> int:
    """Matmul weights that activation checkpointing runs again in backward.

    Every block's matmuls except its last one: PyTorch's non-reentrant checkpoint stops recomputing
    as soon as the last tensor backward needs has been saved, and the MLP output projection's input
    is saved before that matmul would run (FlopCounterMode confirms it). The LM head is not
    checkpointed.
    """
    return n_layer * (4 * n_embd * n_embd + (2 if swiglu else 1) * n_embd * hidden)


def recompute_flops_per_token(
    n_layer: int, n_embd: int, block_size: int, recomputed_params: int
) -> float:
    """Extra FLOPs per token that activation checkpointing spends in its second forward of blocks.

    ``recomputed_params`` from recomputed_matmul_params(). Add this to flops_per_token for hardware
    FLOPs (HFU).
    """
    return 2.0 * recomputed_params + 4.0 * n_layer * block_size * n_embd


def flops_for(m: GPTConfig, vocab: int, checkpointing: bool) -> Tuple[float, float]:
    """(model FLOPs per token, hardware FLOPs per token) for a model of this shape and vocabulary.

    Hardware FLOPs add what activation checkpointing recomputes (HFU); see the module docstring.
    """
    hidden, swiglu = m.hidden_dim, m.mlp == "swiglu"
    weights = matmul_params(
        m.n_layer, m.n_embd, hidden, padded_vocab(vocab, m.vocab_multiple), swiglu
    )
    fpt = flops_per_token(m.n_layer, m.n_embd, m.block_size, weights)
    if not checkpointing:
        return fpt, fpt
    recomputed = recomputed_matmul_params(m.n_layer, m.n_embd, hidden, swiglu)
    return fpt, fpt + recompute_flops_per_token(m.n_layer, m.n_embd, m.block_size, recomputed)


def peak_tflops_for(
    precision: str,
    tf32: bool,
    half: Optional[float],
    tf32_tflops: Optional[float],
    fp32: Optional[float],
) -> Optional[float]:
    """The dense peak TFLOP/s that applies to a precision, from a hardware preset's figures.

    bf16 / fp16 autocast runs the matmuls on the half-precision units (``half``, the preset's
    ``peak_tflops``); fp32 runs them as TF32 when TF32 is on and a TF32 rate is given, else at the
    fp32 rate; a preset that gives only ``half`` uses it for every precision. None when the preset
    gives nothing (the CPU: measure instead).
    """
    if precision in ("bf16", "fp16"):
        return half
    if tf32 and tf32_tflops:
        return tf32_tflops
    return fp32 or half


def device_peak(hw: HardwareConfig) -> Tuple[float, str]:
    """(peak FLOP/s of one device at the hardware's precision, where it came from).

    From the preset's figures ("config"); else, on a GPU, the visible GPU's datasheet figures by its
    name ("GPU name", metrics.GPU_PEAKS), else its measured matmul rate ("measured"); on the CPU
    its measured matmul rate ("measured"). (0.0, "unknown") only where a GPU preset without
    figures is planned with no GPU visible (MFU is then not reported).
    """
    if hw.precision == fastpath.AUTO:  # the CPU's choice depends on the model: not known here
        raise GptlabError("hardware.precision=auto: decide it (fastpath.with_precision) first")
    tflops = peak_tflops_for(
        hw.precision, hw.tf32, hw.peak_tflops, hw.peak_tflops_tf32, hw.peak_tflops_fp32
    )
    if tflops:
        return tflops * 1e12, "config"
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(hw.precision, "float32")
    if hw.device == "cpu":
        return measured_cpu_peak("bfloat16" if hw.precision == "bf16" else "float32"), "measured"
    import torch

    if not torch.cuda.is_available():
        return 0.0, "unknown"
    name = torch.cuda.get_device_name(torch.cuda.current_device())
    tflops = gpu_peak_tflops(name, hw.precision, hw.tf32)
    if tflops:
        return tflops * 1e12, f"{name} datasheet"
    return measured_gpu_peak(dtype), f"measured on {name}"


# ------------------------------------------------------------------------------------------ memory


_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Shape:
    """What the memory model needs to know about a run, as plain numbers."""

    n_layer: int
    n_embd: int
    n_head: int
    hidden: int  # MLP hidden width
    vocab: int  # padded vocabulary (the LM head's rows)
    block_size: int
    params: int  # every parameter, counted once
    matmul_params: int  # see matmul_params()
    swiglu: bool = False
    rotary: bool = False  # rotary positions: q and k are rotated into new tensors
    dropout: float = 0.0
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast: weights stay fp32)
    flash: bool = True  # attention keeps no T x T matrix (SDPA flash / memory-efficient kernels)
    device: str = "cuda"  # cuda keeps dropout masks as bytes; the CPU as the tensor's own dtype
    world_size: int = 1
    # parallelism=ddp as a world of one under torchrun: DDP wraps the model (and keeps its buckets)
    ddp_alone: bool = False
    sharded: bool = False  # fsdp / hsdp: weights, gradients, optimizer state over `shards` ranks
    shards: int = 1  # ranks each parameter is split over (fsdp: the world; hsdp: a node's ranks)
    reshard: bool = True  # sharded: blocks free their gathered weights after forward (ZeRO-3)
    layer_params: int = 0  # parameters of one block (what a sharded run gathers at a time)
    loss_chunk: int = 0  # tokens per chunk of LM head + loss (model.ChunkedHeadLoss); 0: whole
    optimizer_floats: float = 2.0  # fp32 optimizer numbers per parameter (AdamW: two moments)
    # the matrices Muon orthogonalises, (rows, cols) each (muon_matrices); none without Muon
    muon_shapes: Tuple[Tuple[int, int], ...] = ()
    ns_bytes: int = 4  # the size of Muon's Newton-Schulz dtype (optim.muon.ns_dtype)


def activation_bytes_per_layer_token(s: Shape, checkpointing: bool) -> float:
    """Bytes one transformer block keeps for backward, per token.

    Without checkpointing, counted tensor by tensor for gptlab's block (checked against autograd's
    saved tensors in tests/test_plan.py). c is the compute dtype's size; the residual stream and
    LayerNorm inputs stay fp32 under autocast:
      ln_1 input 4d + c_attn input c*d + q,k,v 3c*d + attention output c*d (c_proj's input) +
      ln_2 input 4d + c_fc input c*d + the MLP hidden before and after the activation 2c*h (3c*h
      for SwiGLU's gate, up and product) + rotary's rotated q and k 2c*d (v stays a view of c_attn's
      output, which SDPA keeps) + two residual dropout masks when dropout > 0 + the
      T x T attention probabilities (and dropout mask and dropped copy) when attention is not fused.
    With checkpointing a block keeps only its fp32 input (4d); one block is recomputed at a time
    during backward, which memory_estimate adds once.
    """
    d, h, c = s.n_embd, s.hidden, _BYTES[s.precision]
    if checkpointing:
        return 4.0 * d
    mask = 1 if s.device == "cuda" else c
    per = 8 * d + 6 * c * d + (3 if s.swiglu else 2) * c * h + (2 * c * d if s.rotary else 0)
    if s.dropout > 0:
        per += 2 * mask * d
    if not s.flash:
        per += s.n_head * s.block_size * (c + (mask + c if s.dropout > 0 else 0))
    return float(per)


def memory_estimate(s: Shape, micro_batch: int, checkpointing: bool) -> Dict[str, float]:
    """Peak memory per device in bytes, by part, for one training step at this micro-batch.

    Static: weights (fp32 master weights), optimizer (optimizer_floats fp32 numbers per parameter:
    AdamW's two moments, fewer with Muon, one more for a weight average), ddp (DDP's gradient
    buckets, a second gradient copy, when world_size > 1 or ddp_alone). Then the step's peak
    (``_step_peak``) over grads, autocast (half-precision weight copies), gathered, activations and
    transient (the LM head's logits, log-softmax and their gradient, or the recomputed block).

    Chunked loss (loss_chunk > 0): the logits and their gradients exist for one chunk of tokens at
    a time; forward keeps the head input's gradient (4 bytes per token and channel) and the head
    weight's (fp32) instead of the log-softmax.

    Sharded (fsdp / hsdp): weights, optimizer state and gradients are 1/shards each, no DDP buckets
    and no autocast copies (weights arrive in the compute dtype); instead the gathered weights in
    flight (gathered): the root's (embeddings, head: kept from forward to backward) plus two blocks
    (the one computing and the one prefetched), or every block when reshard is off; and at the end
    of backward the root's whole gradient (in the compute dtype and its fp32 copy for the
    reduce-scatter) and the block gradients not yet reduce-scattered (checked against the
    allocator's peak on 2 processes in tests/test_plan.py).

    The optimizer step is a moment of its own: this rank's gradients beside newton_schulz, what
    Muon's step holds (``newton_schulz_bytes``; 0 with AdamW).
    """
    c = _BYTES[s.precision]
    tokens = micro_batch * s.block_size
    mask = 1 if s.device == "cuda" else 4
    # ids and targets (+ the embedding's dropout mask)
    embed = 16 + (mask * s.n_embd if s.dropout > 0 else 0)
    chunk = min(s.loss_chunk, tokens) if s.loss_chunk else 0
    # ln_f input, then: the head input and the kept log-softmax; or, chunked, its input's gradient
    head = 4 * s.n_embd + (4 * s.n_embd if chunk else c * s.n_embd + 4 * s.vocab)
    # chunked: the head weight's gradient, kept from forward
    head_grad = 4.0 * s.vocab * s.n_embd if chunk else 0.0
    layer = activation_bytes_per_layer_token(s, checkpointing=False)
    recompute = tokens * layer if checkpointing else 0.0
    shards = s.shards if s.sharded else 1
    sharded = _sharded_parts(s, c)
    kept = s.n_layer * activation_bytes_per_layer_token(s, checkpointing)
    # whole: logits, log-softmax's and logits' gradients; chunked: one chunk's fp32 logits + a copy
    logits = (
        chunk * (4 + (c if c < 4 else 0)) * s.vocab if chunk else tokens * (c + 4 + 4) * s.vocab
    )
    parts = {
        "weights": 4.0 * s.params / shards,
        "optimizer": 4.0 * s.optimizer_floats * s.params / shards,
        "ddp": 4.0 * s.params if (s.world_size > 1 or s.ddp_alone) and not s.sharded else 0.0,
        "grads": 4.0 * s.params / shards + sharded["grads_in_flight"],
        "autocast": float(c * s.matmul_params) if c < 4 and not s.sharded else 0.0,
        "gathered": sharded["gathered"],
        "activations": tokens * (kept + embed + head) + head_grad,
        "transient": max(logits, recompute),
        "newton_schulz": newton_schulz_bytes(s),
    }
    # the optimizer step: this rank's gradients and what Muon's step holds beside them
    optimizer_step = 4.0 * s.params / shards + parts["newton_schulz"]
    peak = max(_step_peak(parts, recompute, s.sharded), optimizer_step)
    parts["total"] = parts["weights"] + parts["optimizer"] + parts["ddp"] + peak
    return parts


def muon_matrices(cfg: Config, vocab: int) -> Tuple[Tuple[int, int], ...]:
    """The matrices Muon orthogonalises, as muon.build picks them.

    None for a kind without Newton-Schulz; else each block's attention c_attn and c_proj, MLP c_fc
    and c_proj, and an untied head (vocab: the padded vocabulary).
    """
    if not OPTIMIZERS[cfg.optimizer.name].newton_schulz:
        return ()
    m = cfg.model
    d, h = m.n_embd, m.hidden_dim
    fc = (2 if m.mlp == "swiglu" else 1) * h
    block = ((3 * d, d), (d, d), (fc, d), (d, h))
    return block * m.n_layer + (() if m.tie_weights else ((vocab, d),))


def newton_schulz_bytes(s: Shape) -> float:
    """What Muon's step holds beside the weights, gradients and state (0 without Muon).

    The Nesterov updates (fp32, this rank's part of each matrix) and, in the Newton-Schulz dtype,
    what orthogonalising this rank's share of the matrices takes (muon.muon_owners, over the shards
    when sharded, else over the world): its largest stack with the iteration's x, next x and two
    grams; split over ranks, its results too, and the collectives' buffers: replicated, one other
    owner's broadcast results at a time; sharded, the owner's whole matrices gathered beside its
    results, and the all-to-alls' buffers (this rank's rows of every matrix).
    """
    if not s.muon_shapes:
        return 0.0
    ranks = s.shards if s.sharded else s.world_size
    owners = muon_owners(s.muon_shapes, ranks)
    shares = [[m for m, o in zip(s.muon_shapes, owners) if o == k] for k in range(ranks)]
    share = max(float(sum(r * c for r, c in mine)) for mine in shares)
    iteration = max(_stack_peak(mine) for mine in shares)
    local = sum(r * c for r, c in s.muon_shapes) / (s.shards if s.sharded else 1)
    if ranks == 1:
        held = iteration
    elif s.sharded:
        held = max(2 * share + iteration, 2 * share + local)
    else:
        held = max(share + iteration, 2 * share)
    return 4.0 * local + s.ns_bytes * held


def _stack_peak(shapes: List[Tuple[int, int]]) -> float:
    """Numbers held while the largest of these matrices' stacks iterates.

    One stack per shape, turned wide: k matrices of r <= c. Held: the stack, x, the next x (k r c
    each) and two grams (k r^2).
    """
    by_shape: Dict[Tuple[int, int], int] = {}
    for shape in shapes:
        key = (min(shape), max(shape))
        by_shape[key] = by_shape.get(key, 0) + 1
    return max((k * (3.0 * r * c + 2.0 * r * r) for (r, c), k in by_shape.items()), default=0.0)


def _step_peak(parts: Dict[str, float], recompute: float, sharded: bool) -> float:
    """The largest of the moments of a step that can be its peak.

    The start of backward, holding every saved activation, the autocast copies and the LM head's
    logits (transient); the end of backward, holding every gradient plus, with checkpointing, one
    recomputed block (between them activations are freed as gradients fill in); and, sharded, the
    first block's backward, holding the gathered weights, the activations and the gradients (the
    root's whole one) at once.
    """
    start_of_backward = (
        parts["autocast"] + parts["gathered"] + parts["activations"] + parts["transient"]
    )
    # sharded, this moment's gathered weights are fewer than in_backward's, beside the same grads
    end_of_backward = parts["grads"] + recompute
    in_backward = 0.0
    if sharded:
        in_backward = parts["gathered"] + parts["activations"] + parts["grads"] + recompute
    return max(start_of_backward, end_of_backward, in_backward)


def _sharded_parts(s: Shape, c: int) -> Dict[str, float]:
    """What a sharded run holds beyond its shards (all 0 unsharded).

    Gathered weights in flight and whole gradients waiting for their reduce-scatter.
    """
    if not s.sharded:
        return {"gathered": 0.0, "grads_in_flight": 0.0}
    root = s.params - s.n_layer * s.layer_params  # embeddings, final norm, head
    blocks_gathered = min(s.n_layer, 2) if s.reshard else s.n_layer
    # fp32 block gradients before their reduce-scatter: gloo keeps all to the end; GPUs about two
    unreduced = s.params - root if s.device == "cpu" else min(s.n_layer, 2) * s.layer_params
    return {
        "gathered": float(c * (root + blocks_gathered * s.layer_params)),
        # the root's whole gradient (compute dtype) and its fp32 copy, and the unreduced blocks'
        "grads_in_flight": (c + 4.0) * root + 4.0 * unreduced,
    }


LOSS_CHUNK_TOKENS = 1024  # parallelism.loss_chunk=null's chunk, where it chunks


def loss_chunk(par: Any, m: GPTConfig, vocab: int) -> int:
    """Tokens per chunk of the LM head + loss.

    parallelism.loss_chunk, or when null, chunks where the logits are the step's largest tensor (a
    vocabulary wider than the MLP's 4 x n_embd), else 0.
    """
    if par.loss_chunk is not None:
        return par.loss_chunk
    return LOSS_CHUNK_TOKENS if padded_vocab(vocab, m.vocab_multiple) > 4 * m.n_embd else 0


def shape_for(cfg: Config) -> Tuple[Shape, int, bool]:
    import torch

    cfg = fastpath.with_precision(cfg)
    m, hw = cfg.model, cfg.hardware
    vocab, assumed = vocab_for(cfg)
    V = padded_vocab(vocab, m.vocab_multiple)
    hidden = m.hidden_dim
    swiglu = m.mlp == "swiglu"
    params = param_count(cfg, vocab)
    matmuls = matmul_params(m.n_layer, m.n_embd, hidden, V, swiglu)
    # fused SDPA kernels keep no T x T matrix; the CPU's take no dropout (then the math path runs)
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
        ddp_alone=cfg.parallelism.strategy == "ddp" and under_torchrun(),
        sharded=cfg.parallelism.strategy in SHARDED,
        shards=cfg.world_size // hw.nodes if cfg.parallelism.strategy == "hsdp" else cfg.world_size,
        reshard=cfg.parallelism.reshard_after_forward,
        layer_params=block_params(m),
        loss_chunk=loss_chunk(cfg.parallelism, m, vocab),
        optimizer_floats=optimizer_floats(cfg, params, matmuls, V * m.n_embd),
        muon_shapes=muon_matrices(cfg, V),
        ns_bytes=ns_dtype(cfg.optimizer.muon_ns_dtype, torch.device(hw.device)).itemsize,
    )
    return shape, params, assumed


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or as gptlab's own worker).

    parallelism=ddp then wraps the model in DDP even in a world of one
    (gptlab.distributed.world.role).
    """
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def device_memory_bytes(cfg: Config) -> float:
    """Memory of one device: hardware.memory_gb, else the CPU's RAM or the visible GPU's.

    hardware.memory_gb, else this machine's RAM (shared by its processes) on the CPU, else the
    visible GPU's.
    """
    hw = cfg.hardware
    if hw.memory_gb:
        return hw.memory_gb * GiB
    if hw.device == "cpu":
        return machine_memory_bytes() / max(1, hw.nproc_per_node)
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    raise GptlabError(
        f"hardware.memory_gb: unknown for hardware={hw.name} without a visible GPU; "
        "set it, e.g. hardware.memory_gb=80"
    )


# ---------------------------------------------------------------------------------------- the plan


# CUDA's context, library workspaces and fragmentation take part of a GPU; the OS and Python RAM
USABLE_FRACTION = {"cuda": 0.92, "cpu": 0.80}


# plan.mfu=null's MFU: a tuned bf16 GPT step on A100/H100; on the CPU, of its measured matmul rate
DEFAULT_MFU = {"cuda": 0.40, "cpu": 0.60}


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
    largest_fit: Optional[int]  # largest fitting divisor of the per-rank batch (configured ckpt)
    largest_fit_other: Optional[int]  # the same with checkpointing flipped
    per_rank_batch: int
    world_size: int

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.usable_bytes


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def largest_fit(shape: Shape, per_rank: int, checkpointing: bool, usable: float) -> Optional[int]:
    fitting = [
        k
        for k in _divisors(per_rank)
        if memory_estimate(shape, k, checkpointing)["total"] <= usable
    ]
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


def eager_step_s(cfg: Any) -> Optional[float]:
    """The expected eager step time: the planner's FLOPs at DEFAULT_MFU of the device's peak."""
    peak, _ = device_peak(cfg.hardware)
    if not peak:
        return None
    vocab = cfg.model.vocab_size or 65
    fpt, _ = flops_for(cfg.model, vocab, cfg.parallelism.activation_checkpointing)
    tokens = cfg.train.batch_size * cfg.model.block_size
    return tokens * fpt / (DEFAULT_MFU[cfg.hardware.device] * peak * cfg.world_size)


def resolve_budget(cfg: Config) -> Tuple[Config, Optional[str]]:
    """The config with train.max_steps derived from train.max_tokens or train.max_flops.

    The steps are the most whole steps the budget buys, by the planner's model FLOPs per token, and
    a note says so; without a budget, the config and None. A budget beside steps that differ is
    refused.
    """
    t = cfg.train
    if t.max_tokens is None and t.max_flops is None:
        return cfg, None
    step_tokens = t.batch_size * cfg.model.block_size
    if t.max_tokens is not None:
        what, per_step = f"train.max_tokens={t.max_tokens:,}", float(step_tokens)
        unit = f"{step_tokens:,} tokens a step"
    else:
        fpt = flops_for(cfg.model, vocab_for(cfg)[0], False)[0]
        what, per_step = f"train.max_flops={t.max_flops:.4g}", fpt * step_tokens
        unit = f"{per_step:.4g} FLOPs a step: {fpt:,.0f} a token x {step_tokens:,} tokens"
    budget = float(t.max_tokens if t.max_tokens is not None else t.max_flops)
    steps = int(budget / per_step * (1 + 1e-12))  # whole steps, none past it (a float's last bit)
    if steps < 1:
        raise GptlabError(
            f"{what} buys less than one step of this model and batch ({unit}): raise it, or "
            f"make the model or train.batch_size smaller"
        )
    if t.max_steps is not None and t.max_steps != steps:
        raise GptlabError(
            f"train.max_steps={t.max_steps} and {what} ({steps:,} steps) both set the length: "
            f"add train.max_steps=null to train to the budget"
        )
    note = f"{steps:,} steps from {what} ({unit})"
    return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=steps)), note


def resolve_auto(cfg: Config, steps: Optional[int] = None) -> Tuple[Config, Dict[str, Any]]:
    """hardware.precision=auto and hardware.compile=auto decided: (the config, the choices).

    By gptlab/perf/fastpath.py's rules, the compile rule fed this planner's step time; the choices
    come with their reasons.
    """
    resolved, choices = fastpath.resolve(cfg, eager_step_s, steps, matmul_rate_at)
    hw = resolved.hardware
    if hw.device == "cuda" and hw.attention_backend == "flash" and hw.precision == "fp32":
        raise GptlabError(
            f"hardware.attention_backend=flash needs bf16 or fp16, and precision auto chose fp32 "
            f"({choices['precision'].reason}): set hardware.attention_backend=auto"
        )
    return resolved, choices


def resolve_micro_batch(cfg: Config) -> Config:
    """The config with train.micro_batch_size=auto replaced by the planner's choice (else as is)."""
    if cfg.train.micro_batch_size != "auto":
        return cfg
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, micro_batch_size=auto_micro_batch(cfg))
    )


def auto_micro_batch(cfg: Config) -> int:
    """train.micro_batch_size=auto: the largest micro-batch that divides the batch and fits.

    The batch divided is the per-process batch.
    """
    shape, _, _ = shape_for(cfg)
    # >= 1: to_config refuses a batch the processes do not split
    per_rank = cfg.train.batch_size // cfg.world_size
    usable = device_memory_bytes(cfg) * USABLE_FRACTION[cfg.hardware.device]
    ckpt = cfg.parallelism.activation_checkpointing
    mb = largest_fit(shape, per_rank, ckpt, usable)
    if mb is None:
        raise GptlabError(what_would_fit(cfg, shape, per_rank, ckpt, usable, 1))
    return mb


def what_would_fit(
    cfg: Config, shape: Shape, per_rank: int, ckpt: bool, usable: float, mb: int
) -> str:
    """One line: how much this needs, how much there is, and what change would fit."""
    need = memory_estimate(shape, mb, ckpt)["total"]
    head = (
        f"train.micro_batch_size={mb}: needs {need / GiB:.1f} GiB per device, more than the "
        f"{usable / GiB:.1f} GiB usable of hardware={cfg.hardware.name}"
    )
    options = []
    if not ckpt and memory_estimate(shape, mb, True)["total"] <= usable:
        with_ckpt = memory_estimate(shape, mb, True)["total"]
        options.append(f"parallelism.activation_checkpointing=true ({with_ckpt / GiB:.1f} GiB)")
    own, other = (
        largest_fit(shape, per_rank, ckpt, usable),
        largest_fit(shape, per_rank, not ckpt, usable),
    )
    if own is not None and own < mb:
        options.append(f"train.micro_batch_size={own} with {per_rank // own} accumulation steps")
    elif not ckpt and other is not None and other < mb:
        options.append(f"activation checkpointing with train.micro_batch_size={other}")
    sharded = (
        fsdp_alternative(cfg, shape, per_rank, ckpt, usable, mb) if not shape.sharded else None
    )
    if sharded:
        options.insert(0, sharded)
    if not options:
        static = sum(
            memory_estimate(shape, 1, True)[k] for k in ("weights", "grads", "optimizer", "ddp")
        )
        more = "" if shape.sharded else ", which more data-parallel GPUs do not shrink"
        options.append(
            f"a device with more memory (hardware.memory_gb): weights, gradients and optimizer "
            f"state alone take {static / GiB:.1f} GiB{more}; a smaller model.n_layer / model.n_embd"
        )
    return f"{head}; would fit: " + ", or ".join(options)


def fsdp_alternative(
    cfg: Config, shape: Shape, per_rank: int, ckpt: bool, usable: float, mb: int
) -> Optional[str]:
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
                return (
                    f"parallelism=fsdp {' '.join(how)}".rstrip()
                    + f" ({need / GiB:.1f} GiB per device)"
                )
    return None


def step_estimate(plan: Plan, cfg: Config, mfu_value: float) -> Dict[str, float]:
    """Step time, tokens/s and time to train.max_steps at the given MFU of the job's peak, and cost.

    What that time costs: device_hours (time x devices) and, with hardware.cost_per_device_hour,
    cost.
    """
    peak, source = device_peak(fastpath.with_precision(cfg).hardware)
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
        **predicted_cost(step_s * cfg.train.max_steps, cfg),
    }


def predicted_cost(train_s: float, cfg: Config) -> Dict[str, float]:
    """device_hours of train_s on the job's devices and, when a device-hour has a price, cost."""
    hours = train_s * cfg.world_size / 3600
    price = cfg.hardware.cost_per_device_hour
    return {"device_hours": hours, **({"cost": hours * price} if price is not None else {})}


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
