"""Process-level settings a run makes once: malloc thresholds and the SDPA kernel family.

glibc's malloc thresholds on the CPU, and the SDPA kernel family the hardware preset asks for
(gptlab.distributed.world decides who a process is and how its model is wrapped).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

# glibc malloc: blocks up to this size come from the heap rather than their own mmap
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest accepted value (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # free memory at the heap's top is kept, never handed back


def keep_freed_memory() -> bool:
    """Keep the memory a CPU training step frees, so that the next step does not fault it in again.

    Each step allocates and frees the same activations and gradients. glibc's malloc serves large
    blocks from fresh mmaps and hands freed heap tops back to the kernel, so every step would touch
    them as new pages (measured in docs/measurements/2026-11-30-cpu-speed.md). Resident memory
    stays at its peak, as it would anyway over the next step. Returns False where the C library has
    no mallopt (not glibc), or with GPTLAB_KEEP_FREED_MEMORY=0 (glibc's own settings, to compare).
    """
    import ctypes

    if os.environ.get("GPTLAB_KEEP_FREED_MEMORY", "1") == "0":
        return False

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, TRIM_THRESHOLD)
    )


def attention_context(backend: str):
    """Restrict SDPA to one kernel family when the hardware preset asks for it."""
    if backend == "auto":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return sdpa_kernel(kinds[backend])
