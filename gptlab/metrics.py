"""Pure functions for throughput and memory figures: FLOPs per token, MFU / HFU, peaks, memory.

Model FLOPs (MFU) count the work the model needs: every matmul of every layer and the LM head,
plus attention's T x T products, forward once and backward twice. Hardware FLOPs (HFU) add what
activation checkpointing recomputes (one more forward of every block). Both are checked against
``torch.utils.flop_counter.FlopCounterMode`` in tests/test_metrics.py.

Only torch, numpy and the standard library are imported here (a leaf module).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, Optional

import torch

# ---------------------------------------------------------------------------------------------- FLOPs


def matmul_params(n_layer: int, n_embd: int, hidden: int, vocab: int, swiglu: bool = False) -> int:
    """Weights that take part in matmuls: q/k/v and output projections, the MLP, and the LM head.

    ``vocab`` is the padded vocabulary (the head multiplies by all of it). Embedding lookups and
    LayerNorms are not matmuls. A tied head still costs its matmul, so it is counted here.
    """
    per_layer = 4 * n_embd * n_embd + (3 if swiglu else 2) * n_embd * hidden
    return n_layer * per_layer + vocab * n_embd


def flops_per_token(n_layer: int, n_embd: int, block_size: int, matmul_params: int) -> float:
    """Training (model) FLOPs per token: 6 * matmul weights, plus attention's scores and weighted sum.

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


def recompute_flops_per_token(n_layer: int, n_embd: int, block_size: int, recomputed_params: int) -> float:
    """Extra FLOPs per token that activation checkpointing spends in its second forward of the blocks.

    ``recomputed_params`` from recomputed_matmul_params(). Add this to flops_per_token for hardware
    FLOPs (HFU).
    """
    return 2.0 * recomputed_params + 4.0 * n_layer * block_size * n_embd


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s as a fraction of the hardware peak.

    Pass hardware FLOPs per token (with recomputation) to get HFU instead.
    """
    if peak_flops <= 0:
        return 0.0
    return tokens_per_s * flops_per_tok / peak_flops


def peak_tflops_for(
    precision: str, tf32: bool, half: Optional[float], tf32_tflops: Optional[float], fp32: Optional[float]
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


@lru_cache(maxsize=None)
def measured_cpu_peak(dtype_name: str = "float32", n: int = 1024, seconds: float = 0.3, trials: int = 5) -> float:
    """Dense-matmul FLOP/s of this CPU (threads as configured), the reference for CPU MFU.

    The best of several short trials: on a shared machine one long trial measures the neighbours'
    load as much as the CPU, and a peak is the rate the CPU reaches when it is ours.
    """
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(max(1, trials)):
        count, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds / max(1, trials) or count == 0:
            a @ b
            count += 1
        best = max(best, 2 * n**3 * count / elapsed)
    return best


# --------------------------------------------------------------------------------------------- memory

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
    sharded: bool = False  # fsdp / hsdp: weights, gradients and optimizer state split over `shards` ranks
    shards: int = 1  # ranks each parameter is split over (fsdp: the world; hsdp: the ranks of a node)
    reshard: bool = True  # sharded: blocks free their gathered weights after forward (ZeRO-3)
    layer_params: int = 0  # parameters of one transformer block (what a sharded run gathers at a time)
    loss_chunk: int = 0  # tokens per chunk of LM head + loss (model.ChunkedHeadLoss); 0: the whole logits
    optimizer_floats: float = 2.0  # fp32 numbers of optimizer state per parameter (AdamW: its two moments)


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
    AdamW's two moments, fewer with Muon, one more for a weight average), ddp (DDP's
    gradient buckets, a second gradient copy, when world_size > 1). Then two moments of a step can
    be the peak: the start of backward, holding every saved activation, autocast's half-precision
    weight copies and the LM head's logits, log-softmax and their gradient (transient); and the end
    of backward, holding every gradient (grads) plus, with checkpointing, one recomputed block.
    Between them activations are freed as gradients fill in, so the peak is the larger of the two.

    Chunked loss (loss_chunk > 0): the logits and their gradients exist for one chunk of tokens at a
    time; forward keeps the head input's gradient (4 bytes per token and channel) and the head
    weight's (fp32) instead of the log-softmax.

    Sharded (fsdp / hsdp): weights, optimizer state and gradients are 1/shards each, no DDP buckets
    and no autocast copies (weights arrive in the compute dtype); instead the gathered weights in
    flight (gathered): the root's (embeddings, head: kept from forward to backward) plus two blocks
    (the one computing and the one prefetched), or every block when reshard is off; and at the end
    of backward the root's whole gradient (in the compute dtype and its fp32 copy for the reduce-scatter)
    and the block gradients not yet reduce-scattered;
    a third moment, the first block's backward, holds the gathered weights, the activations and the
    root's gradient at once (checked against the allocator's peak on 2 processes in tests/test_plan.py).
    """
    c = _BYTES[s.precision]
    tokens = micro_batch * s.block_size
    mask = 1 if s.device == "cuda" else 4
    embed = 16 + (mask * s.n_embd if s.dropout > 0 else 0)  # ids and targets (+ embedding dropout mask)
    chunk = min(s.loss_chunk, tokens) if s.loss_chunk else 0
    # ln_f input, then: the head input and the kept log-softmax; or, chunked, the head input's gradient
    head = 4 * s.n_embd + (4 * s.n_embd if chunk else c * s.n_embd + 4 * s.vocab)
    layer = activation_bytes_per_layer_token(s, checkpointing=False)
    recompute = tokens * layer if checkpointing else 0.0
    shards = s.shards if s.sharded else 1
    sharded = _sharded_parts(s, c)
    parts = {
        "weights": 4.0 * s.params / shards,
        "optimizer": 4.0 * s.optimizer_floats * s.params / shards,
        "ddp": 4.0 * s.params if s.world_size > 1 and not s.sharded else 0.0,
        "grads": 4.0 * s.params / shards + sharded["grads_in_flight"],
        "autocast": float(c * s.matmul_params) if c < 4 and not s.sharded else 0.0,
        "gathered": sharded["gathered"],
        "activations": tokens * (s.n_layer * activation_bytes_per_layer_token(s, checkpointing) + embed + head)
        + (4.0 * s.vocab * s.n_embd if chunk else 0.0),  # chunked: the head weight's gradient, kept from forward
        # logits in the compute dtype, the log-softmax's gradient and the logits' gradient; chunked: one
        # chunk's fp32 logits (turned into their gradient in place), briefly beside a half-precision copy
        "transient": max(
            chunk * (4 + (c if c < 4 else 0)) * s.vocab if chunk else tokens * (c + 4 + 4) * s.vocab, recompute
        ),
    }
    start_of_backward = parts["autocast"] + parts["gathered"] + parts["activations"] + parts["transient"]
    # sharded, the end of backward also holds the root and one block gathered: fewer weights than the
    # in-backward moment below holds beside the same gradients, so that moment bounds it
    end_of_backward = parts["grads"] + recompute
    # sharded: the first block's backward holds the gathered weights, every kept activation, the
    # gradients (with the root's whole one) and, with checkpointing, the recomputed block's activations
    in_backward = parts["gathered"] + parts["activations"] + parts["grads"] + recompute if s.sharded else 0.0
    peak = max(start_of_backward, end_of_backward, in_backward)
    parts["total"] = parts["weights"] + parts["optimizer"] + parts["ddp"] + peak
    return parts


def _sharded_parts(s: Shape, c: int) -> Dict[str, float]:
    """What a sharded run holds beyond its shards (all 0 unsharded): gathered weights in flight and
    whole gradients waiting for their reduce-scatter."""
    if not s.sharded:
        return {"gathered": 0.0, "grads_in_flight": 0.0}
    root = s.params - s.n_layer * s.layer_params  # embeddings, final norm, head
    blocks_gathered = min(s.n_layer, 2) if s.reshard else s.n_layer
    # whole fp32 block gradients waiting for their reduce-scatter: on the CPU (gloo) FSDP2 keeps every
    # block's until the end of backward (measured); on GPUs the reduce-scatter stream frees them, ~2 at a time
    unreduced = s.params - root if s.device == "cpu" else min(s.n_layer, 2) * s.layer_params
    return {
        "gathered": float(c * (root + blocks_gathered * s.layer_params)),
        "grads_in_flight": (c + 4.0) * root + 4.0 * unreduced,  # the root's whole gradient and its fp32 copy
    }


def cpu_peak_bytes(fn) -> int:
    """Peak bytes the CPU allocator held during fn() above what was held before it (torch.profiler's
    memory events, summed in time order). How the memory model is checked against a real step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for e in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        current += e.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def current_rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where unavailable)."""
    return _proc_status_kb("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident memory since start or since reset_peak_rss()."""
    kb = _proc_status_kb("VmHWM")
    if kb:
        return kb * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux: /proc/self/clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def machine_memory_bytes() -> int:
    """Physical memory of this machine (the CPU 'device' memory)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _proc_status_kb(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------------------------- expected results


def expectation_met(expected: Dict[str, Any], results: Dict[str, Any]) -> Optional[bool]:
    """Whether a run's results meet a recipe's ``expected`` figures; None when nothing is comparable.

    Keys: best_val_loss / val_loss (at most this + val_loss_tolerance, default 0.05), tokens_per_s
    (at least this), and free text (source, note) that is not compared.
    """
    tol = float(expected.get("val_loss_tolerance", 0.05))
    checks = []
    for key in ("best_val_loss", "val_loss"):
        if expected.get(key) is not None and results.get(key) is not None:
            checks.append(results[key] <= expected[key] + tol)
    if expected.get("tokens_per_s") is not None and results.get("tokens_per_s") is not None:
        checks.append(results["tokens_per_s"] >= expected["tokens_per_s"])
    return all(checks) if checks else None
