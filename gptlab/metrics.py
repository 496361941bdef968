"""Pure functions for throughput figures: FLOPs per token, MFU, a measured CPU peak."""

from __future__ import annotations

import time
from functools import lru_cache

import torch


def flops_per_token(n_layer: int, n_embd: int, block_size: int, matmul_params: int) -> float:
    """Training FLOPs per token: 6 * matmul weights, plus attention's scores and weighted sum.

    Forward is 2 FLOPs per weight per token plus 2 * 2 * T * d per layer for QK^T and AV (counted
    over the full T x T square, as PaLM's appendix does); backward is twice the forward.
    """
    forward = 2 * matmul_params + 4 * n_layer * block_size * n_embd
    return 3.0 * forward


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s as a fraction of the hardware peak."""
    if peak_flops <= 0:
        return 0.0
    return tokens_per_s * flops_per_tok / peak_flops


@lru_cache(maxsize=None)
def measured_cpu_peak(dtype_name: str = "float32", n: int = 1024, seconds: float = 0.3) -> float:
    """Dense-matmul FLOP/s of this CPU (threads as configured), the reference for CPU MFU."""
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    count, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / elapsed
