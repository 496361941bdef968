"""Runtime measurement: MFU, the CPU's matmul peak, memory, and whether results meet a recipe.

MFU of a measured rate, the CPU's matmul peak, memory as the process and the allocator hold it, and
whether a run's results meet its recipe's expected figures.

What a config should cost (parameters, FLOPs per token, the memory model) is in
gptlab/perf/costs.py; this module measures what a run does. Only torch and the standard library are
imported here (a leaf module)."""

from __future__ import annotations

import os
import time
from functools import lru_cache
from typing import Any, Dict, Optional, Tuple

import torch

# -------------------------------------------------------------------------------------- throughput


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s as a fraction of the hardware peak.

    Pass hardware FLOPs per token (with recomputation) to get HFU instead.
    """
    if peak_flops <= 0:
        return 0.0
    return tokens_per_s * flops_per_tok / peak_flops


@lru_cache(maxsize=None)
def measured_cpu_peak(
    dtype_name: str = "float32", n: int = 1024, seconds: float = 0.3, trials: int = 5
) -> float:
    """Dense-matmul FLOP/s of this CPU (threads as configured), the reference for CPU MFU.

    The best of several short trials: on a shared machine one long trial measures the neighbours'
    load as much as the CPU, and a peak is the rate the CPU reaches when it is ours.
    """
    dtype = getattr(torch, dtype_name)
    n = _size_within(dtype, n, seconds / 2)
    a = torch.randn(n, n, dtype=dtype, device="cpu")
    b = torch.randn(n, n, dtype=dtype, device="cpu")
    return best_matmul_rate(a, b, seconds, trials, warmup=2)


def _size_within(dtype: torch.dtype, largest: int, seconds: float, probe: int = 128) -> int:
    """The largest square size up to `largest` whose product takes at most `seconds`.

    A multiple of `probe`, from one timed product of that size. A dtype this CPU multiplies slowly
    (bf16 without bf16 units: a 1024 product can take seconds) is then measured in a fraction of a
    second, as fast ones are.
    """
    if largest <= probe:
        return largest
    a = torch.randn(probe, probe, dtype=dtype, device="cpu")
    a @ a
    t0 = time.perf_counter()
    a @ a
    rate = 2 * probe**3 / max(time.perf_counter() - t0, 1e-9)
    fits = int((rate * seconds / 2) ** (1 / 3)) // probe * probe
    return max(probe, min(largest, fits))


def best_matmul_rate(
    a: torch.Tensor, b: torch.Tensor, seconds: float, trials: int, warmup: int
) -> float:
    """The best FLOP/s of `a @ b` (square, n x n) over `trials` short timed loops sharing `seconds`.

    After `warmup` untimed products.
    """
    n = a.shape[0]
    for _ in range(warmup):
        a @ b
    best = 0.0
    for _ in range(max(1, trials)):
        count, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds / max(1, trials) or count == 0:
            a @ b
            count += 1
        best = max(best, 2 * n**3 * count / elapsed)
    return best


def matmul_rate_at(threads: int, n: int = 384, seconds: float = 0.06, trials: int = 3) -> float:
    """fp32 dense-matmul FLOP/s of this CPU at a thread count, now.

    The neighbours' load is counted: what hardware.threads=auto compares; the thread count is
    restored after.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n, device="cpu")
        return best_matmul_rate(a, a, seconds, trials, warmup=1)
    finally:
        torch.set_num_threads(before)


# Dense (not sparse) peak TFLOP/s of common data-centre GPUs, by a part of the name torch reports:
# bf16/fp16 tensor cores, TF32 ("-": none), fp32. Searched in order ("H100 PCIe" before "H100").
_GPU_TABLE = """
H100 PCIe  756   378    51.2
H100 NVL   835   417.5  60.0
H100       989   494.5  66.9
H200       989   494.5  66.9
GH200      989   494.5  66.9
H800       989   494.5  66.9
B200       2250  1100   80.0
A100       312   156    19.5
A800       312   156    19.5
A10G       70    35     31.2
L40S       362   183    91.6
L4         121   60     30.3
A10        125   62.5   31.2
V100       125   -      15.7
T4         65    -      8.1
"""


def _gpu_peaks() -> Tuple[Tuple[str, Tuple[float, Optional[float], float]], ...]:
    rows = []
    for line in _GPU_TABLE.strip().splitlines():
        *name, half, tf32, fp32 = line.split()
        rows.append(
            (" ".join(name), (float(half), None if tf32 == "-" else float(tf32), float(fp32)))
        )
    return tuple(rows)


GPU_PEAKS = _gpu_peaks()  # (name part, (bf16/fp16, TF32 or None, fp32)); V100 / T4: fp16 only


def gpu_peak_tflops(name: str, precision: str, tf32: bool) -> Optional[float]:
    """The dense peak TFLOP/s of the GPU called name at a precision.

    None for a GPU not in GPU_PEAKS.
    """
    for part, (half, tf32_rate, fp32) in GPU_PEAKS:
        if part.lower() in name.lower():
            if precision in ("bf16", "fp16"):
                return half
            return tf32_rate if tf32 and tf32_rate else fp32
    return None


@lru_cache(maxsize=None)
def measured_gpu_peak(dtype_name: str = "bfloat16", n: int = 4096, trials: int = 5) -> float:
    """Dense-matmul FLOP/s of the current GPU.

    For an unknown one: below its datasheet's peak, so MFU reads high, never 0.
    """
    dtype, device = getattr(torch, dtype_name), torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    best = 0.0
    for _ in range(max(1, trials)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        end.synchronize()
        best = max(best, 10 * 2 * n**3 / (start.elapsed_time(end) / 1e3))
    return best


# ------------------------------------------------------------------------------------------ memory


def cpu_peak_bytes(fn) -> int:
    """Peak bytes the CPU allocator held during fn() above what was held before it.

    From torch.profiler's memory events, summed in time order. How the memory model is checked
    against a real step.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for e in sorted(
        (e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start
    ):
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


# -------------------------------------------------------------------------------- expected results


def expectation_met(expected: Dict[str, Any], results: Dict[str, Any]) -> Optional[bool]:
    """Whether a run's results meet a recipe's ``expected`` figures; None when none is comparable.

    Keys: best_val_loss / val_loss (at most this + val_loss_tolerance, default 0.05), tokens_per_s
    (at least this), and what is not compared: free text (source, note) and reference figures
    (hellaswag_acc_norm: GPT-2's, which a recipe on other data need not reach).
    """
    tol = expected.get("val_loss_tolerance")
    tol = 0.05 if tol is None else float(tol)
    checks = []
    for key in ("best_val_loss", "val_loss"):
        if expected.get(key) is not None and results.get(key) is not None:
            checks.append(results[key] <= expected[key] + tol)
    if expected.get("tokens_per_s") is not None and results.get("tokens_per_s") is not None:
        checks.append(results["tokens_per_s"] >= expected["tokens_per_s"])
    return all(checks) if checks else None
