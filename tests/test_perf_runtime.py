"""gptlab.perf.runtime: the CPU allocator setting (keep_freed_memory: a step's freed memory is
reused, not faulted in again) and the choice of SDPA kernel."""

import os
import resource
import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from gptlab.perf import runtime

PROBE = r"""
import resource, sys, torch
from gptlab.perf import runtime
tune = sys.argv[1] == "1"
if tune:
    assert runtime.keep_freed_memory()
def step():
    # a training step's pattern: a few large blocks allocated, used and freed, over and over
    xs = [torch.ones(3 * 2**20) for _ in range(4)]  # 12 MiB each
    return sum(float(x[0]) for x in xs)
for _ in range(3):
    step()
faults = []
for _ in range(20):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
# the median step: a one-off growth of the heap (one block's pages, once) is not every step's cost
print(sorted(faults)[len(faults) // 2])
"""


def faults_per_step(tune: bool) -> float:
    # glibc's default threshold, held fixed: left dynamic, the untuned count depends on the heap's
    # history (0 or 12,256 per step in five runs), and the test could pass with the setting broken
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    cmd = [sys.executable, "-c", PROBE, "1" if tune else "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not hasattr(resource, "getrusage") or sys.platform != "linux", reason="glibc on Linux"
)
@pytest.mark.integration
def test_freed_memory_is_kept_for_the_next_step():
    # 4 x 12 MiB freshly mapped per step is 12,288 faults of 4 KiB pages; the median step
    # measured 12,292 untuned, 0 tuned
    assert faults_per_step(False) > 10_000
    assert faults_per_step(True) < 100


def test_keep_freed_memory_on_glibc():
    assert runtime.keep_freed_memory() is True
    assert (runtime.MMAP_THRESHOLD, runtime.TRIM_THRESHOLD) == (32 * 2**20, 2**31 - 1)


@pytest.mark.parametrize(
    "answers, kept", [((1, 1), True), ((0, 1), False), ((1, 0), False), ((2, 3), True)]
)
def test_keep_freed_memory_sets_the_mmap_then_the_trim_threshold(monkeypatch, answers, kept):
    import ctypes

    calls = []
    replies = iter(answers)

    def mallopt(param, value):
        calls.append((param, value))
        return next(replies)

    monkeypatch.setattr(
        ctypes, "CDLL", lambda name: SimpleNamespace(mallopt=mallopt) if name is None else None
    )
    assert runtime.keep_freed_memory() is kept
    expected = [(-3, 32 * 2**20), (-1, 2**31 - 1)]
    assert calls == (expected if answers[0] else expected[:1])


def test_keep_freed_memory_without_mallopt_changes_nothing(monkeypatch):
    import ctypes

    monkeypatch.setattr(ctypes, "CDLL", lambda name: SimpleNamespace())
    assert runtime.keep_freed_memory() is False

    def no_library(name):
        raise OSError("no C library")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert runtime.keep_freed_memory() is False


def test_attention_context_restricts_sdpa_to_one_kernel_family():
    b = torch.backends.cuda
    enabled = lambda: (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())  # noqa: E731
    assert isinstance(runtime.attention_context("auto"), nullcontext)
    with runtime.attention_context("auto"):
        assert enabled() == (True, True, True)
    for backend, only in (
        ("flash", (True, False, False)),
        ("efficient", (False, True, False)),
        ("math", (False, False, True)),
    ):
        with runtime.attention_context(backend):
            assert enabled() == only, backend
    assert enabled() == (True, True, True)
    with pytest.raises(KeyError):
        runtime.attention_context("fast")
