"""Sharded data parallelism (FSDP2) and sharded checkpoints, with real gloo processes on the CPU.

Equivalence: fsdp / hsdp on 2 processes give the losses of 1 process with the same global batch.
Checkpoints: a sharded save is a DCP folder that only takes its name when complete; it resumes
exactly on the same topology, reshards onto another world size or strategy, and sample / export
read it in one process.
"""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import REPO, cli_env, compose_config, nano_overrides, overwrite_entry, run_cli

from gptlab.checkpoint import state as checkpoint
from gptlab.model.inference import load_model
from gptlab.train import run_training

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# each test trains several multi-process runs (and a shared one in its set-up): on a machine the
# rest of the suite shares, more than pytest-timeout's 600 s
pytestmark = pytest.mark.timeout(1500)


def base(shakespeare, *extra):
    # the lr schedule is pinned to 20 steps so a 10-step first leg follows the same curve
    return nano_overrides(
        shakespeare,
        "train.log_every=1",
        "train.eval_every=5",
        "train.eval_steps=2",
        "train.sample_tokens=0",
        "optimizer.decay_steps=20",
        "model.dropout=0.0",
        "train.checkpoint_every=5",
        *extra,
    )


def train(
    args, run_dir: Path, cwd: Path, launcher=None, timeout=300
) -> subprocess.CompletedProcess:
    """python -m gptlab.train args into run_dir (or `launcher -m gptlab.train args`, e.g.
    torchrun)."""
    args = [*args, f"hydra.run.dir={run_dir}"]
    if launcher is None:
        r = run_cli(["gptlab.train", *args], cwd, timeout=timeout)
    else:
        r = subprocess.run(
            [*launcher, "-m", "gptlab.train", *args],
            cwd=cwd,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def train_here(args, run_dir: Path) -> None:
    """run_training in this process, for a run whose console lines the test does not read.

    With hardware=cpu_x2 this process is the launcher: its workers fork from this process's fork
    server, which imported torch once for every such run of the test process.
    """
    run_training(compose_config(list(args)), run_dir)


TRAIN_IN_ONE_PROCESS = textwrap.dedent("""
    import pathlib, sys
    sys.path.insert(0, {tests!r})
    from helpers import compose_config
    from gptlab.train import run_training
    for args, run_dir in {runs!r}:
        print({separator!r}, flush=True)
        print({separator!r}, file=sys.stderr, flush=True)
        run_training(compose_config(args), pathlib.Path(run_dir))
""")


def train_in_one_process(runs, cwd: Path, timeout=600) -> "list[tuple[str, str]]":
    """Train each (args, run_dir) in turn in one new process; return each run's (stdout, stderr).

    Its workers fork from that process's one fork server, and their lines come back too.
    """
    separator = "--- gptlab test: the next run ---"
    script = TRAIN_IN_ONE_PROCESS.format(
        tests=str(REPO / "tests"), runs=[(list(a), str(d)) for a, d in runs], separator=separator
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=cli_env(),
                       capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    outs, errs = (text.split(separator + "\n")[1:] for text in (r.stdout, r.stderr))
    assert len(outs) == len(errs) == len(runs)
    return list(zip(outs, errs))


def curves(run_dir: Path):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (
        {r["step"]: r["train_loss"] for r in rows if "train_loss" in r},
        {r["step"]: r["val_loss"] for r in rows if "val_loss" in r},
    )


def final_params(run_dir: Path):
    return checkpoint.read_model(checkpoint.latest(run_dir / "checkpoints")).model


def assert_same_curves(got, ref, steps=None, abs=1e-5):
    for g, r in zip(got, ref):
        keys = sorted(r) if steps is None else [s for s in sorted(r) if s in steps]
        assert keys and all(s in g for s in keys)
        assert [g[s] for s in keys] == pytest.approx([r[s] for s in keys], abs=abs)


@pytest.mark.slow
def test_fsdp_and_hsdp_on_two_processes_match_one_process(tmp_path, shakespeare):
    """Per-step train and val losses within 1e-5 of one process, with and without accumulation and
    activation checkpointing, ZeRO-2 and ZeRO-3 style, and hsdp on a 2 x 1 mesh."""
    # 3 validation batches on 2 ranks: one rank pads with an uncounted forward (each is a
    # collective); the sample at the end is generated on every rank in step
    args = base(
        shakespeare,
        "train.max_steps=8",
        "train.eval_every=4",
        "train.save_checkpoints=false",
        "train.eval_steps=3",
        "train.sample_tokens=20",
    )
    torchrun = [TORCHRUN, "--nproc_per_node=2"]
    runs = {
        "single": (["hardware=cpu"], None, "x1"),
        "fsdp": (
            ["hardware=cpu_x2", "parallelism=fsdp", "parallelism.activation_checkpointing=false"],
            None,
            "fsdp mesh 2 (shard)",
        ),
        "fsdp_accum_ckpt": (
            ["hardware=cpu_x2", "parallelism=fsdp", "train.micro_batch_size=2"],
            None,
            "= 2 x 2 accum x 2 ranks",
        ),
        "fsdp_zero2": (
            [
                "hardware=cpu_x2",
                "parallelism=fsdp",
                "parallelism.reshard_after_forward=false",
                "train.micro_batch_size=2",
            ],
            None,
            "fsdp mesh 2",
        ),
        # two "nodes" of one process each: replicate across them, shard within (a 2 x 1 mesh)
        "hsdp": (
            ["hardware=cpu", "hardware.nodes=2", "hardware.nproc_per_node=1", "parallelism=hsdp"],
            torchrun,
            "hsdp mesh 2x1 (replicate x shard)",
        ),
    }
    # every run but torchrun's in one process: each run's lines, its workers' too, come back
    spawned = [name for name, run in runs.items() if run[1] is None]
    legs = [([*args, *runs[n][0]], tmp_path / n) for n in spawned]
    stdouts = {n: out for n, (out, _) in zip(spawned, train_in_one_process(legs, tmp_path))}
    out = {}
    for name, (extra, launcher, shown) in runs.items():
        if name not in stdouts:
            stdouts[name] = train([*args, *extra], tmp_path / name, tmp_path, launcher).stdout
        assert shown in stdouts[name], f"{name}: {stdouts[name][-2000:]}"
        assert len((tmp_path / name / "samples.txt").read_text()) >= 20
        out[name] = curves(tmp_path / name)
    ref = out.pop("single")
    assert len(ref[0]) == 8 and len(ref[1]) == 2
    for name, got in out.items():
        worst = max(abs(g[s] - r[s]) for g, r in zip(got, ref) for s in r)
        print(f"{name}: largest |loss - 1 process| over 8 train and 2 val losses: {worst:.2e}")
        assert_same_curves(got, ref), name


@pytest.mark.slow
def test_muon_under_fsdp_matches_one_process_and_resumes_exactly(tmp_path, shakespeare):
    """Muon with each rank holding a shard of rows: every update is gathered whole, orthogonalised
    and cut back to this rank's rows, so the losses are one process's; its sharded momentum buffers
    resume bitwise. With a weight average: each rank averages its shards, evaluation swaps them in
    (the val losses are one process's), they resume bitwise, and a sharded checkpoint's reader
    rebuilds it."""
    # fp32 Newton-Schulz, on every CPU: in bf16 (auto's choice where bf16 is native) gradients
    # summed in another order round a few stack elements apart, and 4 iterations amplify that to
    # 3e-4 in the weights
    args = base(
        shakespeare,
        "optimizer=muon",
        "optimizer.muon_ns_dtype=fp32",
        "train.micro_batch_size=2",
        "optimizer.ema_decay=0.8",
    )
    fsdp2 = ["hardware=cpu_x2", "parallelism=fsdp"]
    single, straight, resumed = tmp_path / "single", tmp_path / "straight", tmp_path / "resumed"
    train_here([*args, "hardware=cpu", "train.max_steps=10"], single)
    train_here([*args, *fsdp2, "train.max_steps=10"], straight)
    got, ref = curves(straight), curves(single)
    worst = max(abs(g[s] - r[s]) for g, r in zip(got, ref) for s in r)
    print(f"muon fsdp: largest |loss - 1 process| over 10 train and 2 val losses: {worst:.2e}")
    # orthogonalising each rank's shard alone instead of the whole update: 2.1e-3 apart
    assert_same_curves(got, ref, abs=2e-5)
    hsdp = tmp_path / "hsdp"  # a 2 x 1 mesh: replicated across two "nodes", sharded within each
    train(
        [
            *args,
            "hardware=cpu",
            "hardware.nodes=2",
            "hardware.nproc_per_node=1",
            "parallelism=hsdp",
            "train.max_steps=10",
        ],
        hsdp,
        tmp_path,
        [TORCHRUN, "--nproc_per_node=2"],
    )
    assert_same_curves(curves(hsdp), ref, abs=2e-5)
    train_here([*args, *fsdp2, "train.max_steps=5"], resumed)
    r = train([*args, *fsdp2, "train.max_steps=10"], resumed, tmp_path)
    assert "resuming from" in r.stdout
    assert curves(resumed) == curves(straight)
    got, ref = final_params(resumed), final_params(straight)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got)
    averaged, _, saved = load_model(str(resumed))  # consolidated from the shards, with the average
    one, _, _ = load_model(str(single))
    assert saved.shards is not None and saved.step == 10
    for name, p in averaged.named_parameters():
        assert not torch.equal(p, got[name]), name  # the average, not the training weights
        torch.testing.assert_close(p, dict(one.named_parameters())[name], rtol=0, atol=2e-5)


@pytest.mark.slow
def test_evaluating_the_weight_average_leaves_no_gathered_copy_for_the_next_step(
    tmp_path, shakespeare
):
    """Blocks that keep their gathered weights after forward (reshard_after_forward=false) gathered
    the average during evaluation; the step after it must gather the training weights again.
    Measured before the fix: step 5 at 4.1555 against one process's 3.9677 (Muon with its 0.998
    average)."""
    muon = ["optimizer=muon", "optimizer.muon_ns_dtype=fp32"]  # the same updates on every CPU
    args = base(
        shakespeare, *muon, "train.max_steps=8", "train.eval_every=4", "optimizer.warmup_steps=2"
    )
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    train_here([*args, "hardware=cpu"], single)
    train_here(
        [*args, "hardware=cpu_x2", "parallelism=fsdp", "parallelism.reshard_after_forward=false"],
        sharded,
    )
    assert_same_curves(curves(sharded), curves(single))


def fsdp_run(tmp_path_factory, shakespeare, steps: int) -> Path:
    """A steps-long fsdp run of base's settings on 2 processes, in a folder of its own."""
    tmp = tmp_path_factory.mktemp(f"fsdp_{steps}")
    args = [*base(shakespeare, f"train.max_steps={steps}"), "hardware=cpu_x2", "parallelism=fsdp"]
    train_here(args, tmp / "run")
    return tmp / "run"


@pytest.fixture(scope="module")
def straight_fsdp(tmp_path_factory, shakespeare):
    """A 20-step fsdp run on 2 processes, never interrupted: what every resumed run must equal."""
    return fsdp_run(tmp_path_factory, shakespeare, 20)


@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_and_reshard_to_any_world_and_strategy(
    tmp_path, shakespeare, straight_fsdp
):
    args = base(shakespeare)
    fsdp2 = ["hardware=cpu_x2", "parallelism=fsdp"]
    first = tmp_path / "first"
    train_here([*args, *fsdp2, "train.max_steps=10"], first)
    ckpts = checkpoint.list_checkpoints(first / "checkpoints")
    assert [p.name for p in ckpts] == ["ckpt_00000005", "ckpt_00000010"]  # folders: sharded
    assert sorted(f.name for f in ckpts[-1].iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "sha256.json",  # every file's digest, checked on load
        "state.pt",
    ]
    ref_train, ref_val = curves(straight_fsdp)
    ref_params = final_params(straight_fsdp)
    # the same topology: bitwise the uninterrupted run
    same = tmp_path / "same"
    shutil.copytree(first, same)
    r = train([*args, *fsdp2, "train.max_steps=20"], same, tmp_path)
    assert "resuming from" in r.stdout
    assert curves(same) == (ref_train, ref_val)
    got = final_params(same)
    assert got.keys() == ref_params.keys() and all(torch.equal(got[k], ref_params[k]) for k in got)
    # onto one process, unsharded and as fsdp in a world of one; onto DDP on 2 processes
    for name, topology in {
        "single": ["hardware=cpu"],
        "fsdp_world_of_one": ["hardware=cpu", "parallelism=fsdp"],
        "ddp": ["hardware=cpu_x2", "parallelism=ddp", "parallelism.activation_checkpointing=false"],
    }.items():
        moved = tmp_path / name
        shutil.copytree(first, moved)
        train_here([*args, *topology, "train.max_steps=20"], moved)
        assert_same_curves(curves(moved), (ref_train, ref_val), steps=range(11, 21))
        got = final_params(moved)
        assert all(torch.allclose(got[k], ref_params[k], atol=1e-5, rtol=0) for k in ref_params), (
            name
        )
    # a DDP checkpoint resumes under fsdp
    ddp = tmp_path / "from_ddp"
    train_here([*args, "hardware=cpu_x2", "parallelism=ddp", "train.max_steps=10"], ddp)
    assert checkpoint.latest(ddp / "checkpoints").name == "ckpt_00000010.pt"
    train_here([*args, *fsdp2, "train.max_steps=20"], ddp)
    assert checkpoint.latest(ddp / "checkpoints").name == "ckpt_00000020"
    assert_same_curves(curves(ddp), (ref_train, ref_val), steps=range(11, 21))


STALL_RANK1_IN_SECOND_SAVE = textwrap.dedent("""
    import os, pathlib, runpy, sys, time
    from torch.distributed.checkpoint import FileSystemWriter
    real, calls = FileSystemWriter.write_data, []
    def write_data(self, plan, planner):  # rank 1 writes its shard of the 2nd save, then stalls
        result = real(self, plan, planner)
        calls.append(1)
        if len(calls) == 2 and os.environ["RANK"] == "1":
            result.wait()
            pathlib.Path({marker!r}).touch()
            time.sleep(600)
        return result
    FileSystemWriter.write_data = write_data
    sys.argv = ["gptlab.train", *{args!r}]
    runpy.run_module("gptlab.train", run_name="__main__")
""")


@pytest.mark.slow
def test_a_job_killed_during_a_sharded_save_resumes_from_the_previous_one(
    tmp_path, shakespeare, straight_fsdp
):
    run_dir, marker = tmp_path / "run", tmp_path / "saving"
    args = [
        *base(shakespeare, "train.max_steps=20"),
        "hardware=cpu_x2",
        "parallelism=fsdp",
        "parallelism.timeout_s=60",
    ]
    script = tmp_path / "stall.py"
    script.write_text(
        STALL_RANK1_IN_SECOND_SAVE.format(
            marker=str(marker), args=[*args, f"hydra.run.dir={run_dir}"]
        )
    )
    proc = subprocess.Popen([TORCHRUN, "--nproc_per_node=2", str(script)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.time() + 180
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, (
                "never reached the second checkpoint"
            )
            time.sleep(0.2)
        # the whole job at once, as a lost node or `scancel -s KILL` would: torchrun and its workers
        job = [proc_ := psutil.Process(proc.pid), *proc_.children(recursive=True)]
        for p in job:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(job, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    folder = run_dir / "checkpoints"
    # rank 1's shard of step 10 is on disk, but the save never took a checkpoint's name
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["ckpt_00000005"]
    (partial,) = checkpoint.unfinished(folder)
    assert partial.name == ".ckpt_00000010.partial" and (partial / "__1_0.distcp").is_file()
    assert not (partial / "state.pt").exists()
    r = train(args, run_dir, tmp_path)  # the same command: resume=auto
    assert ".ckpt_00000010.partial is a sharded save that did not finish" in r.stdout + r.stderr
    assert "resuming from" in r.stdout and "ckpt_00000005" in r.stdout
    assert not checkpoint.unfinished(folder)  # cleaned up by the next save
    got, ref = final_params(run_dir), final_params(straight_fsdp)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert curves(run_dir) == curves(straight_fsdp)


class Exploit:
    """A pickle that would create a file when unpickled (what a crafted checkpoint entry could
    do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def fifteen_fsdp(tmp_path_factory, shakespeare):
    """The first 15 steps of straight_fsdp's run, as their own run: each damage test copies it."""
    return fsdp_run(tmp_path_factory, shakespeare, 15)


def damaged_copy(fifteen: Path, run_dir: Path, damage: str, marker: Path):
    """A copy of fifteen with one entry of its newest checkpoint damaged in place, sizes kept.

    Returns the checkpoint, the entry, its shard file, the cause the line gives, and the sizes.
    """
    shutil.copytree(fifteen, run_dir)
    newest = run_dir / "checkpoints" / "ckpt_00000015"
    sizes = {f.name: f.stat().st_size for f in newest.iterdir()}
    if damage == "random_bytes":  # a moment tensor: its zip archive is gone, torch.load fails on it
        entry, shard = overwrite_entry(newest, "optimizer.state.")
        cause = "("
    else:
        entry, shard = overwrite_entry(
            newest, "optimizer.param_groups.", pickle.dumps(Exploit(marker), protocol=2)
        )
        cause = "(unsafe: loading it would run posix.system)"
    assert {f.name: f.stat().st_size for f in newest.iterdir()} == sizes
    return newest, entry, shard, cause, sizes


@pytest.mark.slow
def test_a_sharded_checkpoint_with_an_unreadable_entry_is_named_moved_aside_and_the_previous_one_resumed(  # noqa: E501
    tmp_path, shakespeare, straight_fsdp, fifteen_fsdp
):
    """Issue 27 case 1: random bytes over an optimizer moment (sizes kept), or a pickle that would
    run code in place of a non-tensor entry (stock DCP unpickles those unsafely): the rerun names
    the entry and why in one line, moves the checkpoint to broken/ and resumes the one before,
    bitwise the run never damaged; the crafted entry runs nothing, and nothing tells the user to
    load unsafely. Both damages' reruns run in one process, one after the other."""
    marker = tmp_path / "pwned"
    args = [*base(shakespeare), "hardware=cpu_x2", "parallelism=fsdp"]
    damages = ["random_bytes", "crafted_pickle"]
    cases = {d: damaged_copy(fifteen_fsdp, tmp_path / d, d, marker) for d in damages}
    # the entries' own reader, behind the digests (test_checkpoint_state.py tests those): off here
    rerun = [*args, "train.max_steps=20", "train.verify_checkpoints=false"]
    printed = train_in_one_process([(rerun, tmp_path / d) for d in damages], tmp_path)
    ref_params, ref_curves = final_params(straight_fsdp), curves(straight_fsdp)
    for damage, (stdout, stderr) in zip(damages, printed):
        run_dir, (newest, entry, shard, cause, sizes) = tmp_path / damage, cases[damage]
        out = stdout + stderr
        # the one line naming it, and why
        (line,) = [ln for ln in out.splitlines() if str(newest) in ln]
        assert line in stderr.splitlines(), damage  # a warning
        assert line.startswith(
            f"gptlab: checkpoint {newest} has an unreadable entry {entry} in {shard} {cause}"
        )
        assert line.endswith("); trying the previous checkpoint")
        ckpt_10 = run_dir / "checkpoints" / "ckpt_00000010"
        assert "resuming from" in out and f"{ckpt_10} (step 10)" in out
        assert "does not fit" not in out and "weights_only" not in out and "Traceback" not in out
        broken = run_dir / "checkpoints" / "broken" / "ckpt_00000015" / shard
        assert broken.stat().st_size == sizes[shard]
        assert json.loads((run_dir / "results.json").read_text())["steps"] == 20
        got = final_params(run_dir)
        assert all(torch.equal(got[k], ref_params[k]) for k in ref_params)  # nothing left behind
        assert curves(run_dir) == ref_curves
    assert not marker.exists()


@pytest.mark.slow
def test_sample_and_export_read_a_sharded_checkpoint_in_one_process(
    tmp_path, shakespeare, straight_fsdp
):
    """Consolidated on load: the same logits and the same export files as the unsharded model."""
    from gptlab.export import main as export
    from gptlab.model.inference import load_model

    sharded, _, saved = load_model(str(straight_fsdp))
    assert saved.shards is not None and saved.step == 20
    # the same weights as an unsharded .pt: resume the sharded checkpoint on one process for 0 steps
    whole = tmp_path / "whole"
    shutil.copytree(straight_fsdp, whole)
    state = checkpoint.TrainingState.load(checkpoint.latest(whole / "checkpoints"))
    unsharded, _, _ = load_model(str(straight_fsdp))
    torch.manual_seed(0)
    for p in unsharded.parameters():  # scramble, then restore through the resume path
        p.data.normal_()
    opt = torch.optim.AdamW(unsharded.parameters())
    box = type("Box", (), {"state_dict": dict, "load_state_dict": lambda self, s: None})()
    state.restore({"model": unsharded, "optimizer": opt, "scaler": box, "loader": box})
    pt = checkpoint.TrainingState.capture(
        {"model": unsharded, "optimizer": opt, "scaler": box, "loader": box},
        **{
            k: getattr(state, k)
            for k in (
                "step",
                "tokens",
                "best_val_loss",
                "config",
                "model_config",
                "tokenizer",
                "mlflow_run_id",
            )
        },
    )
    pt_path = pt.save(tmp_path / "ckpt_00000020.pt")
    x = torch.randint(0, 65, (2, 16))
    a, b = sharded(x)[0], load_model(str(pt_path))[0](x)[0]
    assert torch.allclose(a, b, atol=1e-5, rtol=0)
    out_sharded, out_whole = tmp_path / "export_sharded", tmp_path / "export_whole"
    export([f"run={straight_fsdp}", f"out={out_sharded}"])
    export([f"run={pt_path}", f"out={out_whole}"])
    files = sorted(p.relative_to(out_sharded) for p in out_sharded.rglob("*") if p.is_file())
    assert files and files == sorted(
        p.relative_to(out_whole) for p in out_whole.rglob("*") if p.is_file()
    )
    for f in files:
        assert (out_sharded / f).read_bytes() == (out_whole / f).read_bytes(), f
    r = run_cli(["gptlab.sample", f"run={straight_fsdp}", "max_new_tokens=20"], REPO, timeout=120)
    assert r.returncode == 0 and len(r.stdout.strip()) >= 20, r.stderr[-2000:]
