"""gptlab.training.profiling: a profiled run's stderr holds no profiler chatter (kineto's USDT
markers, c10's note on memory allocated before the profile began), and every other line still gets
through. tests/test_perf_fastpath.py checks what a profile writes."""

import os
import sys

import pytest
import torch
from helpers import nano_overrides, run_cli

from gptlab.training.profiling import ProfileConfig, StderrFilter, StepProfiler

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


# ---- what a profile records and writes, and the filter's pieces, in process


class Tracker:
    def __init__(self):
        self.logged = []

    def log_artifact(self, path, folder):
        self.logged.append((path.name, folder))


def steps(prof, first, last):
    for step in range(first, last + 1):
        prof.begin(step)
        torch.randn(16, 16) @ torch.randn(16, 16)
        prof.end(step)


def test_a_profile_records_its_steps_only_and_rank_0_logs_its_files(tmp_path):
    import json

    tracker = Tracker()
    cfg = ProfileConfig(steps=[2, 3], rows=3, oom_snapshot=True)  # no CUDA: no allocator history
    prof = StepProfiler(cfg, tmp_path, torch.device("cpu"), 1, tracker, True)
    assert (prof.first, prof.last, prof.rows, prof.oom_history) == (2, 3, 3, False)
    steps(prof, 1, 1)
    assert not (tmp_path / "profile").exists() and prof._prof is None
    steps(prof, 2, 2)
    assert prof._prof is not None  # still recording after step 2
    steps(prof, 3, 5)
    assert prof._prof is None
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "operators_rank1.txt",
        "trace_rank1.json",
    ]
    assert tracker.logged == [("trace_rank1.json", "profile"), ("operators_rank1.txt", "profile")]
    trace = json.loads((tmp_path / "profile" / "trace_rank1.json").read_text())
    ranges = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("step ")}
    assert ranges == {"step 2", "step 3"}
    table = (tmp_path / "profile" / "operators_rank1.txt").read_text()
    rows = [ln for ln in table.splitlines() if ln.lstrip().startswith(("aten::", "step "))]
    assert len(rows) == 3 and "Self CPU" in table and table.endswith("\n")  # rows=3
    assert prof.out_of_memory() is None  # only CUDA keeps the allocator's history
    prof.close()  # after the profile: nothing more written
    assert len(tracker.logged) == 2


def test_a_run_ending_inside_its_profile_writes_what_was_recorded_and_other_ranks_log_nothing(
    tmp_path,
):
    tracker = Tracker()
    prof = StepProfiler(ProfileConfig(steps=[1, 9], rows=2, oom_snapshot=False), tmp_path,
                        torch.device("cpu"), 0, tracker, False)  # fmt: skip
    steps(prof, 1, 2)
    prof.begin(3)  # the run fails inside step 3
    prof.close()
    assert (tmp_path / "profile" / "trace_rank0.json").is_file() and tracker.logged == []
    assert prof._range is None and prof._prof is None
    off = StepProfiler(None, tmp_path / "off", torch.device("cpu"), 0, tracker, True)
    assert (off.first, off.last, off.rows) == (0, -1, 0)
    steps(off, 1, 3)
    off.close()
    assert not (tmp_path / "off").exists()
    unset = StepProfiler(ProfileConfig(steps=None, rows=5, oom_snapshot=False), tmp_path / "u",
                         torch.device("cpu"), 0, tracker, True)  # fmt: skip
    steps(unset, 1, 3)
    assert not (tmp_path / "u").exists()


def test_the_noise_is_the_profilers_exact_lines():
    from gptlab.training.profiling import NOISE

    def noise(line):
        return any(p.search(line.encode()) for p in NOISE)

    assert noise(USDT_START) and noise(USDT_STOP) and noise(UNKNOWN_BLOCK)
    assert not noise(USDT_START + "ed")  # a line that only starts like a marker
    assert not noise("x" + USDT_START)
    assert not noise(UNKNOWN_BLOCK.replace("CPUAllocator.cpp:245", "CPUAllocator.cpp"))
    assert not noise("[W1203 x.cpp:1] Memory block of unknown size was allocated before the "
                     "profiling started")  # fmt: skip


def test_a_line_is_held_back_only_while_it_may_still_become_noise():
    quiet = StderrFilter()
    for start in (b"U", b"USDT:", b"USDT:2026", b"[", b"[W", b"[W1203"):
        assert quiet._may_be_noise(start), start
    for start in (b"X", b"USDX", b"[X", b"progress 50%"):
        assert not quiet._may_be_noise(start), start


def test_the_pump_forwards_every_line_but_the_noise_whatever_its_pieces(tmp_path):
    import threading

    quiet = StderrFilter()
    read, write = os.pipe()
    out_read, out_write = os.pipe()
    pump = threading.Thread(target=quiet._pump, args=(read, out_write))
    pump.start()
    for piece in (b"US", b"DT:1 2:3 x.cpp:52] profiler_", b"start\nkept ", b"line\n[W1",
                  b" y.cpp:2] other\n", USDT_STOP.encode() + b"\n", b"last"):  # fmt: skip
        os.write(write, piece)
    os.close(write)
    pump.join(timeout=10)
    with os.fdopen(out_read, "rb") as f:
        assert f.read() == b"kept line\n[W1 y.cpp:2] other\nlast"
    with pytest.raises(OSError):
        os.fstat(read)  # the pump closed its ends
