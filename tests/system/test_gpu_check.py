"""launch/gpu_check.sh on the CPU (--cpu): the GPU check's dry run, its budget, its per-step
timeouts and its JSON, rewritten after every step."""

import contextlib
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import warm_start
from helpers import REPO

SCRIPT = REPO / "launch" / "gpu_check.sh"
STEPS = [
    "wheels", "env", "gpt2_124m", "gpt1b", "train", "train_resume", "sample", "fp16",
    "fp16_resume", "fsdp", "chunked_loss", "gpt2_124m_muon", "gpt2_124m_stop", "ckpt_sync",
    "ckpt_async", "rollback", "restart", "ladder",
]  # fmt: skip
DEPENDENT = {"train_resume", "sample", "fp16_resume"}
# the bench steps and the model each measures
BENCHES = {
    "gpt2_124m": "gpt2_124m", "gpt1b": "gpt1b", "fsdp": "gpt2_124m", "gpt2_124m_muon": "gpt2_124m",
    "gpt2_124m_stop": "gpt2_124m",
}  # fmt: skip


def env(tmp, **extra):
    """The script's environment: this interpreter (its gptlab commands forked warm:
    tests/warm_start.py), its temporary files under tmp, no device-tool $OUT, no leftover
    settings."""
    base = {k: v for k, v in os.environ.items() if k != "OUT" and not k.startswith("GPU_CHECK_")}
    python = warm_start.python_env() if warm_start.enabled() else {"PYTHON": sys.executable}
    return {**base, **python, "TMPDIR": str(tmp), **extra}


# the suite's other tests share the machine: the dry run gets three times the steps' timeouts and
# a budget to match (its own, measured alone: docs/measurements)
SHARED = {"GPU_CHECK_TIMEOUT_SCALE": "3", "GPU_CHECK_BUDGET": "1200"}


def run_check(out, timeout=560, **extra):
    return subprocess.run(
        ["bash", str(SCRIPT), "--cpu", str(out)],
        cwd=REPO, env=env(out.parent, **extra), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the script's own budget (SHARED) decides
def test_cpu_dry_run_measures_every_step_inside_its_budget(tmp_path):
    """Every step runs on the CPU with the models shrunk; the JSON holds one entry per step."""
    out = tmp_path / "gpu_check.json"
    done = run_check(out, timeout=1300, **SHARED)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert list(steps) == STEPS and report["complete"] and report["ok"] and report["mode"] == "cpu"
    assert report["wall_s"] <= report["budget_s"] == 1200
    assert steps["wheels"]["status"] == "skipped"  # this interpreter has Hydra
    ladder = steps["ladder"]
    assert ladder["status"] == "skipped" and "GPU_CHECK_LADDER" in ladder["reason"]  # off
    for name in STEPS[1:-1]:
        step = steps[name]
        assert step["status"] == "ok" and step["rc"] == 0, (name, step)
        assert 0 < step["timeout_s"] <= step["budget_left_s"] and "result" in step, (name, step)
    assert report["env"]["torch"] and report["env"]["packages"]["hydra"]

    for name, model in BENCHES.items():
        bench = steps[name]["result"]
        assert bench["model"] == model and bench["timed_steps"] == 6, name
        vs = bench["measured_vs_plan"]
        assert vs["plan_mem_bytes"] > 0 and vs["mem_ratio"] > 0 and vs["mfu"] > 0, name
    gpt1b = steps["gpt1b"]["result"]
    assert gpt1b["activation_checkpointing"] is True and gpt1b["strategy"] == "ddp"
    assert gpt1b["measured_vs_reference"]["reference_peak_gb"] == 27.66
    fsdp = steps["fsdp"]["result"]
    assert fsdp["strategy"] == "fsdp" and fsdp["world_size"] == 1  # a world of one, via torchrun

    # the real runs: evaluated, checkpointed, resumed with more steps, sampled
    for first, resumed in (("train", "train_resume"), ("fp16", "fp16_resume")):
        a, b = steps[first]["result"], steps[resumed]["result"]
        assert a["results"]["steps"] == 20 and b["results"]["steps"] == 30, (a, b)
        assert a["results"]["best_val_loss"] > 0 and "ckpt_00000020.pt" in a["checkpoints"]
        assert "ckpt_00000030.pt" in b["checkpoints"] and b["sample_head"]
    assert "hardware.precision=fp16" in steps["fp16"]["command"]
    sample = steps["sample"]["result"]
    assert "ROMEO:" in sample["text_head"] and sample["attention_png_bytes"] > 0
    chunked = steps["chunked_loss"]["result"]
    assert chunked["chunked"]["peak_step_bytes"] < chunked["whole"]["peak_step_bytes"]
    # the failures survived: each save's stall, a NaN rolled back, a dead rank restarted
    for name in ("ckpt_sync", "ckpt_async"):
        ckpt = steps[name]["result"]
        assert ckpt["results"]["checkpoint_stall_s"] > 0 and ckpt["checkpoints"], (name, ckpt)
    assert "train.checkpoint_async=true" in steps["ckpt_async"]["command"]
    (rollback,) = steps["rollback"]["result"]["results"]["rollbacks"]
    assert rollback["step"] == 7 and rollback["back_to"] == 5
    (restart,) = steps["restart"]["result"]["results"]["restarts"]
    assert restart["died_at_step"] == 12 and restart["resumed_from"] == 10, restart

    log = out.with_suffix(".log").read_text()
    assert all(f"== {name}: " in log for name in STEPS) and "budget left" in log


@pytest.mark.slow
def test_a_killed_step_is_recorded_and_the_script_goes_on(tmp_path):
    """A step past its timeout is killed and recorded as timed out, and the next step still runs;
    steps left out, or that the budget cannot hold, are recorded as skipped with the reason."""
    out = tmp_path / "killed.json"
    done = run_check(
        out, timeout=120, GPU_CHECK_ONLY="gpt1b,chunked_loss", GPU_CHECK_TIMEOUTS="gpt1b=1"
    )
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert list(steps) == STEPS and report["complete"] and report["ok"] is False
    killed = steps["gpt1b"]
    assert killed["status"] == "timed_out" and killed["rc"] == 124 and killed["timeout_s"] == 1
    assert "gptlab.bench" in killed["command"] and "result" not in killed
    assert steps["chunked_loss"]["status"] == "ok" and steps["chunked_loss"]["result"]["chunked"]
    assert steps["env"]["status"] == "ok"
    for name in set(STEPS) - {"wheels", "env", "gpt1b", "chunked_loss", "ladder"}:
        assert steps[name]["status"] == "skipped", name
        assert "GPU_CHECK_ONLY" in steps[name]["reason"], name

    # a budget too small for any step: each is skipped, saying so, and the script ends at once
    out = tmp_path / "budget.json"
    done = run_check(out, timeout=60, GPU_CHECK_BUDGET="12")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    for name in set(STEPS) - {"wheels", "ladder"}:
        reason = steps[name]["reason"]
        assert steps[name]["status"] == "skipped", name
        # a resume or sample needs a checkpoint that its skipped run did not leave
        assert reason.startswith("needs" if name in DEPENDENT else "budget"), (name, reason)


@pytest.mark.slow
def test_the_json_holds_what_was_measured_when_the_script_is_killed(tmp_path):
    """The JSON is rewritten after every step: killing the whole script mid-step leaves the steps
    before it, and the one it was in marked as running."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--cpu", str(out)], cwd=REPO,
        env=env(tmp_path, GPU_CHECK_ONLY="gpt2_124m", GPU_CHECK_TIMEOUTS="gpt2_124m=120"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                steps = json.loads(out.read_text())["steps"]
            except (OSError, ValueError):
                steps = {}
            if steps.get("gpt2_124m", {}).get("status") == "running":
                break
            time.sleep(0.2)
        else:
            seen = out.read_text() if out.exists() else "no JSON"
            pytest.fail(f"gpt2_124m never started: {seen}")
    finally:
        # the script and everything it started (timeout puts its command in a group of its own)
        script = psutil.Process(proc.pid)
        for p in [*script.children(recursive=True), script]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        proc.wait(timeout=30)
    report = json.loads(out.read_text())
    assert report["complete"] is False
    assert report["steps"]["env"]["status"] == "ok" and report["env"]["torch"]
    running = report["steps"]["gpt2_124m"]
    assert running["status"] == "running" and running["timeout_s"] == 120
    assert report["steps"]["wheels"]["status"] == "skipped"  # recorded before gpt2_124m began
    assert report["steps"]["gpt1b"]["status"] == "pending"  # after it: not reached
