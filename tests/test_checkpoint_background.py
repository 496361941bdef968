"""Checkpoints saved in the background (train.checkpoint_async): training goes on while one is
written, the file is what a synchronous save writes, a failure is raised, a kill loses nothing."""

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import REPO, compose_config, nano_overrides
from test_checkpoint_state import _Box, _tiny

from gptlab.checkpoint import background
from gptlab.checkpoint import state as checkpoint
from gptlab.errors import GptlabError
from gptlab.train import run_training
from gptlab.training import loop


def overrides(shakespeare, *extra):
    return nano_overrides(
        shakespeare,
        "train.max_steps=10",
        "train.checkpoint_every=5",
        "train.sample_tokens=0",
        "train.log_every=1",
        *extra,
    )


def contents(path):
    """A checkpoint's state as loaded, less the one key that differs between the two modes."""
    state = checkpoint.load(path)
    del state["config"]["train"]["checkpoint_async"]
    return state


def test_cpu_copy_copies_every_tensor_and_keeps_a_tied_one_tied():
    tied = torch.ones(3)
    state = {"model": {"wte": tied, "head": tied}, "rng": (torch.zeros(2), [1, "a"]), "step": 4}
    saved = checkpoint.state_digest(state)
    copied = background.cpu_copy(state)
    tied.add_(1)  # the next step changes the live tensors: the copy keeps the saved values
    assert checkpoint.state_digest(copied) == saved != checkpoint.state_digest(state)
    assert copied["model"]["wte"] is copied["model"]["head"]
    assert isinstance(copied["rng"], tuple) and copied["rng"][1] == [1, "a"]


@pytest.mark.integration
def test_an_async_save_lets_training_go_on_and_writes_what_a_sync_save_writes(
    tmp_path, shakespeare, monkeypatch
):
    sync = run_training(compose_config(overrides(shakespeare)), tmp_path / "sync")
    steps, later = [], threading.Event()
    real_step, real_save = loop.optimizer_step, checkpoint.save

    def counted_step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 7:
            later.set()
        return real_step(*args, **kwargs)

    written_after = []

    def slow_save(path, state):  # step 5's write waits until step 7 has started
        if path.name == "ckpt_00000005.pt":
            assert later.wait(timeout=120), "training did not go on during the save"
            written_after.append(len(steps))
        return real_save(path, state)

    monkeypatch.setattr(loop, "optimizer_step", counted_step)
    monkeypatch.setattr(checkpoint, "save", slow_save)
    async_ = run_training(
        compose_config(overrides(shakespeare, "train.checkpoint_async=true")), tmp_path / "async"
    )
    assert written_after and written_after[0] >= 7  # step 5's file was written after step 7 began
    for name in ("ckpt_00000005.pt", "ckpt_00000010.pt"):
        a = contents(tmp_path / "sync" / "checkpoints" / name)
        b = contents(tmp_path / "async" / "checkpoints" / name)
        assert checkpoint.state_digest(a) == checkpoint.state_digest(b), name  # bitwise the same
    assert async_["val_loss"] == sync["val_loss"] and async_["train_loss"] == sync["train_loss"]
    assert sync["checkpoint_stall_s"] > 0 and async_["checkpoint_stall_s"] > 0
    assert checkpoint.best(tmp_path / "async" / "checkpoints") is not None  # remembered after


@pytest.mark.integration
def test_a_failing_background_write_is_raised_at_the_next_wait(tmp_path, shakespeare, monkeypatch):
    def full_disk(path, state):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save", full_disk)
    with pytest.raises(
        GptlabError,
        match=r"checkpoint \S+ckpt_00000005.pt was not saved \(in the background: .*No space left",
    ):
        run_training(
            compose_config(overrides(shakespeare, "train.checkpoint_async=true")), tmp_path / "r"
        )
    assert not checkpoint.list_checkpoints(tmp_path / "r" / "checkpoints")


@pytest.mark.integration
def test_an_async_sharded_save_is_the_sync_one_with_its_digests(tmp_path, one_rank_group):
    model, opt = _tiny(0, shard=True)
    objects = {"model": model, "optimizer": opt, "scaler": _Box(), "loader": _Box(3)}
    saver, paths = background.Saver(), {}
    for mode in ("sync", "async"):
        state = checkpoint.TrainingState.capture(
            objects, step=3, tokens=30, best_val_loss=1.0, config={}, model_config={},
            tokenizer={}, mlflow_run_id=None,
        )  # fmt: skip
        paths[mode] = saver.save(tmp_path / mode, state, None, 5, True, background=mode == "async")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next step: the staged copy is what gets written
    saver.close()
    a, b = (checkpoint.read_model(paths[m]).model for m in ("sync", "async"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (paths["async"] / "sha256.json").is_file() and not checkpoint.unfinished(
        tmp_path / "async"
    )


KILL_DURING_ASYNC_SAVE = textwrap.dedent("""
    import sys, time, pathlib, torch
    sys.path.insert(0, {tests!r})
    from helpers import compose_config
    from gptlab.train import run_training
    real_save, calls = torch.save, []
    def slow_save(obj, f, *a, **k):  # the 2nd save (in the writer thread) writes part, then hangs
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK partial checkpoint")
            f.flush()
            pathlib.Path({marker!r}).touch()
            time.sleep(600)
        return real_save(obj, f, *a, **k)
    torch.save = slow_save
    run_training(compose_config({overrides!r}), pathlib.Path({run_dir!r}))
""")


@pytest.mark.slow
def test_sigkill_during_a_background_save_leaves_the_previous_checkpoint_as_the_latest(
    tmp_path, shakespeare
):
    run_dir, marker = tmp_path / "run", tmp_path / "saving"
    args = nano_overrides(
        shakespeare,
        "train.max_steps=20",
        "train.checkpoint_every=5",
        "train.sample_tokens=0",
        "train.checkpoint_async=true",
    )
    script = KILL_DURING_ASYNC_SAVE.format(
        tests=str(REPO / "tests"), marker=str(marker), overrides=args, run_dir=str(run_dir)
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "never reached the 2nd save"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    folder = run_dir / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["ckpt_00000005.pt"]
    assert checkpoint.load(folder / "ckpt_00000005.pt")["step"] == 5
    results = run_training(compose_config(args), run_dir)  # resume=auto, from step 5
    assert results["steps"] == 20 and results["tokens_this_session"] == 15 * 8 * 32
    straight = tmp_path / "straight"
    run_training(compose_config(args), straight)
    a = checkpoint.read_model(checkpoint.latest(straight / "checkpoints")).model
    b = checkpoint.read_model(checkpoint.latest(folder)).model
    assert all(torch.equal(a[k], b[k]) for k in a)
