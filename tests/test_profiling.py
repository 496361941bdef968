"""gptlab.profiling: a profiled run's stderr holds no profiler chatter (kineto's USDT markers, c10's
note on memory allocated before the profile began), and every other line still gets through.
tests/test_fastpath.py checks what a profile writes."""

import os
import sys

import pytest
import torch
from helpers import nano_overrides, run_cli

from gptlab.profiling import ProfileConfig, StderrFilter, StepProfiler

# as torch 2.13 printed them during `train.profile.steps=[2,3]` (issue 42)
USDT_START = (
    "USDT:2026-12-03 20:51:53 30339:30339 SyncActivityProfilerHandler.cpp:52] profiler_start"
)
USDT_STOP = "USDT:2026-12-03 20:51:55 30339:30339 SyncActivityProfilerHandler.cpp:59] profiler_stop"
UNKNOWN_BLOCK = (
    "[W1203 20:51:53.552707653 CPUAllocator.cpp:245] Memory block of unknown size was allocated "
    "before the profiling started, profiler results will not include the deallocation event"
)
CHATTER = ("USDT", "profiler_start", "profiler_stop", "CPUAllocator", "Memory block of unknown")


def test_the_filter_drops_the_profilers_lines_and_passes_every_other(capfd):
    """C++ writes straight to fd 2 (a line in pieces, as std::cerr flushes each part); Python's
    stderr too. Only the noise goes; a genuine warning or error, even one like it, stays, in
    order, with a last line that never ended."""
    quiet = StderrFilter()
    quiet.start()
    for piece in (
        f"{USDT_START}",
        "\n",
        "a real error: CUDA out of memory\n",
        "[W1203 ",
        "x.cpp:1]",
    ):
        os.write(2, piece.encode())
    os.write(2, b" a genuine C++ warning\n" + f"{UNKNOWN_BLOCK}\n{USDT_STOP}\n".encode())
    with open(2, "w", closefd=False) as stderr:  # Python's stderr: fd 2 (pytest swaps sys.stderr)
        print("Traceback (most recent call last):", file=stderr, flush=True)
    os.write(2, b"USDT: no marker\nprogress 50%\r")
    os.write(2, b"USDT:")  # no end: written when the profile stops
    quiet.stop()
    print("after", file=sys.stderr, flush=True)
    assert capfd.readouterr().err == (
        "a real error: CUDA out of memory\n[W1203 x.cpp:1] a genuine C++ warning\n"
        "Traceback (most recent call last):\nUSDT: no marker\nprogress 50%\rUSDT:after\n"
    )


def test_a_profile_leaves_stderr_as_it_found_it(tmp_path, capfd):
    """torch's own profiler in this process: its lines as it starts, records memory freed that was
    allocated before, and stops are kept out; fd 2 is the same file afterwards."""
    before = os.fstat(2).st_ino
    old = [torch.randn(64, 64) for _ in range(4)]  # freed inside the profile: c10's note
    cfg = ProfileConfig(steps=[1, 1], rows=5, oom_snapshot=False)
    prof = StepProfiler(cfg, tmp_path, torch.device("cpu"), 0, None, True)
    prof.begin(1)
    os.write(2, b"during\n")
    del old
    torch.randn(32, 32) @ torch.randn(32, 32)
    prof.end(1)
    err = capfd.readouterr().err
    assert err == "during\n", err
    assert os.fstat(2).st_ino == before and (tmp_path / "profile" / "trace_rank0.json").is_file()


@pytest.mark.slow
def test_a_profiled_run_prints_no_profiler_chatter(shakespeare, tmp_path):
    overrides = nano_overrides(
        shakespeare, "train.max_steps=4", "train.profile.steps=[2,3]", "train.sample_tokens=0",
        f"paths.outputs={tmp_path}/outputs", f"hydra.run.dir={tmp_path}/run",
    )  # fmt: skip
    r = run_cli(["gptlab.train", *overrides], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [ln for ln in r.stderr.splitlines() if any(c in ln for c in CHATTER)], r.stderr
    assert "profile of steps 2..3" in r.stdout
    assert (tmp_path / "run" / "profile" / "operators_rank0.txt").is_file()
