"""Checkpoints: atomic, safe to load, and a resumed run continues exactly."""

import dataclasses
import io
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

import pytest
import torch
from helpers import REPO, compose_config, nano_overrides, overwrite_entry, run_cli, start_cli

from gptlab.checkpoint import state as checkpoint
from gptlab.errors import GptlabError
from gptlab.records.layout import read_metrics
from gptlab.train import run_training


def test_save_is_atomic_and_load_round_trips(tmp_path):
    path = checkpoint.save(
        checkpoint.checkpoint_path(tmp_path, 7), {"step": 7, "w": torch.arange(3)}
    )
    assert path.name == "ckpt_00000007.pt" and [p.name for p in tmp_path.iterdir()] == [path.name]
    state = checkpoint.load(path)
    assert state["step"] == 7 and state["w"].tolist() == [0, 1, 2]


def test_corrupt_checkpoint_is_named_and_auto_falls_back(tmp_path):
    good = checkpoint.save(checkpoint.checkpoint_path(tmp_path, 5), {"step": 5})
    bad = checkpoint.checkpoint_path(tmp_path, 10)
    bad.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])  # a truncated file
    with pytest.raises(GptlabError, match="ckpt_00000010.pt"):
        checkpoint.load(bad)
    warnings = []
    path, state = checkpoint.load_latest_good(tmp_path, warn=warnings.append)
    assert path == good and state["step"] == 5
    assert len(warnings) == 1 and "ckpt_00000010.pt" in warnings[0]


def test_pruning_keeps_the_newest_and_the_best(tmp_path):
    paths = [
        checkpoint.save(checkpoint.checkpoint_path(tmp_path, s), {"step": s}) for s in (1, 2, 3, 4)
    ]
    checkpoint.mark_best(tmp_path, paths[0], 1.23)
    checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        paths[0].name,
        paths[2].name,
        paths[3].name,
    ]
    assert checkpoint.best(tmp_path) == paths[0]


@pytest.mark.integration
def test_training_state_round_trips_every_stateful_object_and_names_a_missing_field(tmp_path):
    """One module owns what a checkpoint holds: capture -> save -> load -> restore, field by
    field."""

    class Box:  # any object with state_dict / load_state_dict
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"value": torch.tensor([self.value])}

        def load_state_dict(self, state):
            self.value = int(state["value"])

    def model_and_optimizer(seed):  # the model and optimizer go through torch's state-dict API
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        return model, opt

    model, opt = model_and_optimizer(1)
    objects = {"model": model, "optimizer": opt, "scaler": Box(2), "loader": Box(3)}
    fields = dict(
        config={"a": 1}, model_config={"n_layer": 2}, tokenizer={"kind": "char"}, mlflow_run_id=None
    )
    torch.manual_seed(123)
    state = checkpoint.TrainingState.capture(
        objects, step=9, tokens=90, best_val_loss=1.5, loss_window=(2.5, 3), **fields
    )
    expected_draw = torch.rand(3)  # what the generator gives after the capture
    path = checkpoint.save_state(tmp_path, state, val_loss=1.5, keep=2)
    assert path.name == "ckpt_00000009.pt" and checkpoint.best(tmp_path) == path

    fresh_model, fresh_opt = model_and_optimizer(2)
    fresh = {"model": fresh_model, "optimizer": fresh_opt, "scaler": Box(-1), "loader": Box(-1)}
    path_found, _ = checkpoint.load_latest_good(tmp_path)
    loaded = checkpoint.TrainingState.load(path_found)
    assert (loaded.step, loaded.tokens, loaded.best_val_loss, loaded.config) == (
        9,
        90,
        1.5,
        {"a": 1},
    )
    assert tuple(loaded.progress()["loss_window"]) == (2.5, 3)
    loaded.restore(fresh)
    assert (fresh["scaler"].value, fresh["loader"].value) == (2, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(torch.rand(3), expected_draw)  # the random generators continue exactly
    saved = checkpoint.read_model(path)
    assert (saved.step, saved.model_config, saved.tokenizer) == (
        9,
        {"n_layer": 2},
        {"kind": "char"},
    )

    raw = checkpoint.load(path)
    assert json.loads((tmp_path / "best.json").read_text())["val_loss"] == 1.5
    # every field but a sharded checkpoint's folder, which exists only in memory (save adds the
    # version), and the loop's progress entry by entry
    names = {f.name for f in dataclasses.fields(checkpoint.TrainingState)} - {"shards"}
    names = names - {"progress_entries"} | {"loss_window"}
    assert raw.keys() == names and raw["format_version"] == checkpoint.FORMAT_VERSION
    del raw["loader"], raw["rng"]
    checkpoint.save(
        checkpoint.checkpoint_path(tmp_path, 10),
        {k: v for k, v in raw.items() if k != "format_version"},
    )
    bad = checkpoint.checkpoint_path(tmp_path, 10)
    with pytest.raises(GptlabError) as e:
        checkpoint.TrainingState.load(bad)
    assert str(e.value) == f"checkpoint {bad} is not a gptlab training checkpoint (no loader, rng)"


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {Exploit.marker}",))


def test_a_checkpoint_that_runs_code_on_unpickling_is_refused(tmp_path):
    Exploit.marker = tmp_path / "pwned"
    evil = tmp_path / "ckpt_00000001.pt"
    torch.save({"format_version": checkpoint.FORMAT_VERSION, "step": 1, "x": Exploit()}, evil)
    with pytest.raises(GptlabError, match="unreadable or unsafe"):
        checkpoint.load(evil)
    assert not Exploit.marker.exists()


def resume_overrides(shakespeare, *extra):
    # the lr schedule is pinned to 20 steps so a 10-step first leg follows the same curve
    return nano_overrides(
        shakespeare,
        "train.log_every=1",
        "train.sample_tokens=0",
        "optimizer.decay_steps=20",
        "model.dropout=0.1",
        *extra,
    )


def final_params(run_dir: Path):
    return checkpoint.read_model(checkpoint.latest(run_dir / "checkpoints")).model


def logged(run_dir: Path, key: str):
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


def logged_losses(run_dir: Path):
    return logged(run_dir, "train_loss")


def logged_val_losses(run_dir: Path):
    return logged(run_dir, "val_loss")


@pytest.mark.parametrize(
    "extra",
    [
        [],
        # the sequential loader's (epoch, position) and shuffled order
        ["data.sampling=sequential"],
        ["hardware.precision=fp16"],  # the GradScaler's scale and growth tracker
        ["optimizer=muon"],  # Muon's momentum buffers beside AdamW's moments and step counts
        # the weight average, kept in the optimizer state, and evaluated
        ["optimizer.ema_decay=0.9"],
        # muP at twice its base width: the hidden matrices' group and its lr_mult of 1/2
        ["model.parametrization=mup", "model.mup_base_width=16"],
    ],
    ids=["random", "sequential", "fp16", "muon", "ema", "mup"],
)
@pytest.mark.integration
def test_resume_in_a_new_process_is_bitwise_exact(tmp_path, shakespeare, extra):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_training(
        compose_config(resume_overrides(shakespeare, "train.max_steps=20", *extra)), straight
    )
    first = run_training(
        compose_config(resume_overrides(shakespeare, "train.max_steps=10", *extra)), split
    )
    assert first["steps"] == 10
    second = run_training(
        compose_config(resume_overrides(shakespeare, "train.max_steps=20", *extra)), split
    )
    assert second["steps"] == 20 and second["tokens"] == 20 * 8 * 32
    a, b = final_params(straight), final_params(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # includes the dropout draws after resume
    assert logged_losses(straight) == logged_losses(split)
    saved = checkpoint.load(checkpoint.latest(split / "checkpoints"))
    # the scaler was on, and its state went through the checkpoint
    if "hardware.precision=fp16" in extra:
        assert saved["scaler"]["scale"] > 0 and saved["scaler"]["_growth_tracker"] == 20 % 2000
    if "optimizer=muon" in extra:
        kinds = {frozenset(v) for v in saved["optimizer"]["state"].values()}
        # optimizer=muon keeps a weight average too (conf/optimizer/muon.yaml)
        average = {"ema", "ema_updates"}
        adamw = {"step", "exp_avg", "exp_avg_sq"}
        assert kinds == {frozenset({"momentum_buffer", *average}), frozenset({*adamw, *average})}
    if "data.sampling=sequential" in extra:
        assert saved["loader"]["kind"] == "sequential" and saved["loader"]["position"] > 0
    if "model.parametrization=mup" in extra:
        assert sorted(g.get("lr_mult", 1.0) for g in saved["optimizer"]["param_groups"])[0] == 0.5
        model = saved["model_config"]  # what sample, export and init_from rebuild the model from
        assert (model["parametrization"], model["mup_base_width"]) == ("mup", 16)
    if "optimizer.ema_decay=0.9" in extra:
        assert all("ema" in v for v in saved["optimizer"]["state"].values())
        assert logged_val_losses(straight) == logged_val_losses(split) and logged_val_losses(split)


@pytest.mark.integration
def test_resuming_an_averaging_run_without_the_average_evaluates_and_saves_the_weights(
    tmp_path, shakespeare
):
    """ema_decay=0 warm-started from an averaging run's checkpoint: its average is dropped, so
    evaluation sees the weights and the next checkpoint (what sample and export read) holds no stale
    average."""
    run = tmp_path / "run"
    run_training(
        compose_config(
            resume_overrides(shakespeare, "train.max_steps=10", "optimizer.ema_decay=0.9")
        ),
        run,
    )
    first = checkpoint.load(checkpoint.latest(run / "checkpoints"))
    assert all("ema" in v for v in first["optimizer"]["state"].values())
    path = checkpoint.latest(run / "checkpoints")
    warm = tmp_path / "warm"  # another config: a new folder, warm-started from that checkpoint
    overrides = resume_overrides(
        shakespeare, "train.max_steps=20", "optimizer.ema_decay=0", f"train.resume={path}"
    )
    results = run_training(compose_config(overrides), warm)
    second = checkpoint.load(checkpoint.latest(warm / "checkpoints"))
    assert second["step"] == 20 and all(
        "ema" not in v for v in second["optimizer"]["state"].values()
    )
    assert second["optimizer"]["state"]  # the moments came along
    assert results["val_loss"] == logged_val_losses(warm)[20]


@pytest.mark.integration
def test_resume_never_starts_over_in_the_same_folder_and_a_path_resumes_from_that_file(
    tmp_path, shakespeare
):
    run_dir = tmp_path / "r"
    run_training(compose_config(resume_overrides(shakespeare, "train.max_steps=10")), run_dir)
    first = logged_losses(run_dir)
    # the same folder and the same run, finished: auto would say so and train nothing; never starts
    # over
    again = run_training(
        compose_config(resume_overrides(shakespeare, "train.max_steps=12", "train.resume=never")),
        run_dir,
    )
    assert again["steps"] == 12 and again["tokens"] == 12 * 8 * 32
    fresh = logged_losses(run_dir)
    # from step 1 again
    assert sorted(fresh) == list(range(1, 13)) and {s: fresh[s] for s in first} == first
    (previous,) = list((run_dir / "previous").iterdir())
    assert logged_losses(previous) == first
    ckpt = checkpoint.latest(previous / "checkpoints")
    other = run_training(
        compose_config(resume_overrides(shakespeare, "train.max_steps=12", f"train.resume={ckpt}")),
        tmp_path / "from_path",
    )
    assert other["steps"] == 12 and other["tokens"] == 12 * 8 * 32
    assert sorted(logged_losses(tmp_path / "from_path")) == [11, 12]  # continued from step 10


@pytest.mark.integration
def test_a_run_resumed_at_its_final_step_reports_the_checkpoints_losses_and_no_tokens_trained(
    tmp_path, shakespeare
):
    """Issue 27 case 7: killed after its final checkpoint, before results.json; the rerun has no
    step left."""
    run_dir = tmp_path / "r"
    overrides = resume_overrides(shakespeare, "train.max_steps=20")
    first = run_training(compose_config(overrides), run_dir)
    assert first["tokens_this_session"] == 20 * 8 * 32
    (run_dir / "results.json").unlink()  # what a kill between the last save and results.json leaves
    again = run_training(compose_config(overrides), run_dir)
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["train_loss"] == first["train_loss"] == logged_losses(run_dir)[20]
    assert saved["val_loss"] == first["val_loss"] == logged_val_losses(run_dir)[20]
    # results.json adds what the tracker measures as it writes (device-hours, cost)
    written = {k: v for k, v in saved.items() if k not in ("device_hours", "cost")}
    assert written == again and saved["steps"] == 20 and saved["tokens"] == first["tokens"]
    assert saved["device_hours"] >= 0 and saved["cost"] is None  # no price set
    assert saved["best_val_loss"] == first["best_val_loss"]
    # this resumption trained nothing
    assert saved["tokens_this_session"] == 0 and saved["tokens_per_s"] is None
    # a checkpoint from before the losses were saved still resumes (its results then have none to
    # give)
    path = checkpoint.latest(run_dir / "checkpoints")
    old = {
        k: v
        for k, v in checkpoint.load(path).items()
        if k not in ("train_loss", "val_loss", "format_version")
    }
    checkpoint.save(path, old)
    (run_dir / "results.json").unlink()
    run_training(compose_config(overrides), run_dir)
    older = json.loads((run_dir / "results.json").read_text())
    assert older["steps"] == 20 and older["train_loss"] is None and older["val_loss"] is None


def cli(args, cwd):
    return run_cli(["gptlab.train", *args], cwd)


@pytest.mark.slow
def test_two_process_resume_is_exact_and_can_continue_on_one_process(tmp_path, shakespeare, capsys):
    base = [*resume_overrides(shakespeare), "model.dropout=0.0", "train.micro_batch_size=4"]
    straight, split, moved = tmp_path / "straight", tmp_path / "split", tmp_path / "moved"
    # in this process, whose fork server starts the workers of every two-process run it launches
    run_training(compose_config([*base, "hardware=cpu_x2", "train.max_steps=20"]), straight)
    run_training(compose_config([*base, "hardware=cpu_x2", "train.max_steps=10"]), split)
    shutil.copytree(split, moved)  # the same first leg, resumed below on one process
    r = cli([*base, "hardware=cpu_x2", "train.max_steps=20", f"hydra.run.dir={split}"], tmp_path)
    assert r.returncode == 0 and "resuming from" in r.stdout, r.stderr[-2000:]
    # the same global batch of 8 on one process: 4 x 2 accumulation steps
    capsys.readouterr()
    run_training(compose_config([*base, "hardware=cpu", "train.max_steps=20"]), moved)
    out = capsys.readouterr().out
    assert "= 4 x 2 accum x 1 ranks" in out and "resuming from" in out, out[-2000:]
    a, b = final_params(straight), final_params(split)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = logged_losses(straight)
    assert logged_losses(split) == ref
    moved_losses = logged_losses(moved)
    assert sorted(moved_losses) == list(range(1, 21))
    assert [moved_losses[s] for s in range(11, 21)] == pytest.approx(
        [ref[s] for s in range(11, 21)], abs=1e-5
    )
    # the windows drawn over the whole run are those of the uninterrupted run: step s's global batch
    # is a function of (seed, s) only, and the resumed run continued at step 11
    assert json.loads((moved / "results.json").read_text())["tokens"] == 20 * 8 * 32


KILL_DURING_SAVE = textwrap.dedent("""
    import sys, time, pathlib, torch
    sys.path.insert(0, {tests!r})
    from helpers import compose_config
    from gptlab.checkpoint import state as checkpoint
    from gptlab.train import run_training
    real_save, calls = torch.save, []
    def slow_save(obj, f, *a, **k):  # the second save writes part of its bytes, then hangs
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK partial checkpoint")
            f.flush()
            pathlib.Path({marker!r}).touch()
            time.sleep(600)
        return real_save(obj, f, *a, **k)
    checkpoint.torch.save = slow_save
    run_training(compose_config({overrides!r}), pathlib.Path({run_dir!r}))
""")


@pytest.mark.slow
def test_sigkill_while_writing_a_checkpoint_loses_nothing(tmp_path, shakespeare):
    run_dir, marker = tmp_path / "run", tmp_path / "saving"
    overrides = resume_overrides(shakespeare, "train.max_steps=20", "train.checkpoint_every=5")
    script = KILL_DURING_SAVE.format(
        tests=str(REPO / "tests"), marker=str(marker), overrides=overrides, run_dir=str(run_dir)
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, (
                "never reached the second checkpoint"
            )
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the half-written file never took a checkpoint's name; the step-5 checkpoint is intact
    assert [p.name for p in checkpoint.list_checkpoints(run_dir / "checkpoints")] == [
        "ckpt_00000005.pt"
    ]
    assert checkpoint.load(run_dir / "checkpoints" / "ckpt_00000005.pt")["step"] == 5
    assert list((run_dir / "checkpoints").glob(".ckpt_*.tmp*"))  # the killed save's temporary file
    results = run_training(compose_config(overrides), run_dir)  # resume=auto
    assert results["steps"] == 20
    # steps 6-10 were logged before the kill; the resumed run recomputed but did not log them again
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))
    assert not list((run_dir / "checkpoints").glob(".ckpt_*.tmp*"))  # cleaned up by the next save
    straight = tmp_path / "straight"
    run_training(compose_config(overrides), straight)
    a, b = final_params(straight), final_params(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigterm_stops_cleanly_with_a_checkpoint_and_the_same_command_continues(
    tmp_path, shakespeare, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    args = [
        *nano_overrides(
            shakespeare,
            "train.max_steps=100000",
            "train.log_every=1",
            "train.sample_tokens=0",
            "tracking.mlflow=true",
        ),
        f"hydra.run.dir={run_dir}",
    ]
    proc = start_cli(["gptlab.train", *args], tmp_path)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "SIGTERM received: stopped at step" in out
    stopped = json.loads((run_dir / "results.json").read_text())
    assert stopped["stopped_by"] == "SIGTERM"
    step = stopped["steps"]
    assert checkpoint.latest(run_dir / "checkpoints").name == f"ckpt_{step:08d}.pt"
    # the same overrides continue from there, in this process, from the same working folder
    args = [a for a in args if not a.startswith(("train.max_steps=", "hydra.run.dir="))]
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    run_training(compose_config([*args, f"train.max_steps={step + 5}"]), run_dir)
    out = capsys.readouterr().out
    assert f"step {step}" in out, out[-2000:]
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if "train_loss" in x]
    assert steps == list(range(1, step + 6))  # every step once: none missing, none logged twice
    # one MLflow run across the restart, with one point per logged step
    from mlflow.tracking import MlflowClient

    finished = json.loads((run_dir / "results.json").read_text())
    assert finished["mlflow_run_id"] == stopped["mlflow_run_id"] is not None
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    history = client.get_metric_history(finished["mlflow_run_id"], "train/loss")
    assert sorted(m.step for m in history) == list(range(1, step + 6))
    assert client.get_run(finished["mlflow_run_id"]).info.status == "FINISHED"


# ------------------------------------------------------------------ sharded (DCP) checkpoints, in-
# process


class _Box:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _tiny(seed, shard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    if shard:
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save_sharded(folder, step, seed=1):
    model, opt = _tiny(seed, shard=True)
    objects = {"model": model, "optimizer": opt, "scaler": _Box(), "loader": _Box(step)}
    state = checkpoint.TrainingState.capture(
        objects, step=step, tokens=step * 10, best_val_loss=1.0, config={}, model_config={},
        tokenizer={}, mlflow_run_id=None,
    )  # fmt: skip
    assert state.sharded
    return checkpoint.save_state(folder, state, val_loss=None, keep=5), model


@pytest.mark.integration
def test_a_sharded_checkpoint_is_a_complete_folder_that_restores_into_an_unsharded_model(
    tmp_path, one_rank_group
):
    path, model = _save_sharded(tmp_path, 3)
    assert path.name == "ckpt_00000003" and path.is_dir() and not checkpoint.unfinished(tmp_path)
    assert {".metadata", "state.pt", "__0_0.distcp", "sha256.json"} == {
        f.name for f in path.iterdir()
    }
    assert checkpoint.find(str(tmp_path)) == path and checkpoint.find(str(path)) == path
    state = checkpoint.TrainingState.load(path)
    assert (state.step, state.model, state.shards) == (3, None, path)
    # another init, unsharded: the checkpoint reshards into it
    plain, plain_opt = _tiny(2, shard=False)
    loader = _Box()
    state.restore({"model": plain, "optimizer": plain_opt, "scaler": _Box(), "loader": loader})
    assert loader.value == 3
    whole = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert all(torch.equal(plain.state_dict()[k], whole[k]) for k in whole)
    assert plain_opt.state_dict()["state"][0]["step"] == 1
    bigger = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), torch.nn.Linear(2, 2)
    )
    objects = {
        "model": bigger,
        "optimizer": torch.optim.AdamW(bigger.parameters()),
        "scaler": _Box(),
        "loader": _Box(),
    }
    with pytest.raises(
        GptlabError,
        match=(
            r"does not fit this model and optimizer: "
            r"Missing key in checkpoint state_dict: model.2.weight.$"
        ),
    ) as e:
        state.restore(objects)  # DCP's own error is a BaseException with a traceback per rank
    assert "\n" not in str(e.value)
    consolidated = checkpoint.read_model(path).model  # sample / export: whole tensors, one process
    assert consolidated.keys() == whole.keys() and all(
        torch.equal(consolidated[k], whole[k]) for k in whole
    )


def test_an_incomplete_or_unsafe_sharded_checkpoint_is_named_and_the_previous_one_used(
    tmp_path, one_rank_group
):
    first, _ = _save_sharded(tmp_path, 5)
    second, _ = _save_sharded(tmp_path, 10)
    shard = second / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # a cut copy
    with pytest.raises(
        GptlabError,
        match=r"ckpt_00000010 is incomplete: shard file\(s\) __0_0.distcp missing or cut",
    ):
        checkpoint.load(second)
    notes = []
    found, _ = checkpoint.load_latest_good(tmp_path, warn=notes.append)
    assert found == first and "incomplete" in notes[0]
    # a save killed before its rename is named, skipped, and removed by the next save's pruning
    partial = tmp_path / ".ckpt_00000015.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    notes.clear()
    assert checkpoint.load_latest_good(tmp_path, warn=notes.append)[0] == first
    assert any(".ckpt_00000015.partial is a sharded save that did not finish" in n for n in notes)
    _save_sharded(tmp_path, 20)
    assert not partial.exists()
    # metadata that would run code on unpickling is refused unread
    marker = tmp_path / "pwned"
    Exploit.marker = marker
    evil = tmp_path / "ckpt_00000020" / ".metadata"
    evil.write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(
        GptlabError, match=r"unreadable or unsafe metadata: it refers to posix.system"
    ):
        checkpoint.load(evil.parent)
    assert not marker.exists()


def test_a_damaged_sharded_entry_is_named_with_its_cause_and_not_taken_for_a_mismatch(
    tmp_path, one_rank_group
):
    """An entry that does not read back as what its own metadata says (random bytes, a pickle that
    would run code, another object or shape in its place) is UnreadableCheckpoint naming the entry,
    in restore and in the consolidating reader; torch's advice to load unsafely is never quoted.
    (Its digest tells the damage first: the entry is named by a load that does not check it.)"""

    def restore(path):
        model, opt = _tiny(2, shard=False)
        objects = {"model": model, "optimizer": opt, "scaler": _Box(), "loader": _Box()}
        checkpoint.TrainingState.load(path, verify=False).restore(objects)

    def saved(obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    Exploit.marker = tmp_path / "pwned"
    cases = {
        "optimizer.state.": (None, r"\(.+\)"),  # random bytes over the first moment
        "optimizer.param_groups.": (pickle.dumps(Exploit(), protocol=2),
                                    r"\(unsafe: loading it would run posix.system\)"),
        "model.0.weight": (saved({"not": "a tensor"}), r"\(a dict where a tensor was saved\)"),
        "model.0.bias": (saved(torch.zeros(3)), r"\(a torch.float32 tensor of shape \(3,\) where "
                                                 r"a torch.float32 one of shape \(8,\) was "
                                                 r"saved\)"),
    }  # fmt: skip
    for step, (prefix, (content, cause)) in enumerate(cases.items(), start=1):
        path, _ = _save_sharded(tmp_path / str(step), step)
        entry, shard = overwrite_entry(path, prefix, content)
        with pytest.raises(GptlabError, match=rf"^checkpoint {path}/{shard} is damaged: its SHA"):
            checkpoint.load(path)
        said = rf"^checkpoint {path} has an unreadable entry {entry} in {shard} {cause}$"
        with pytest.raises(GptlabError, match=said) as e:
            restore(path)
        assert isinstance(e.value, checkpoint.UnreadableCheckpoint)  # what resume falls back past
        assert "weights_only" not in str(e.value) and "does not fit" not in str(e.value)
        if prefix.startswith("model."):  # sample and export read the model entries whole
            with pytest.raises(GptlabError, match=said):
                checkpoint.read_model(path, verify=False)
    assert not Exploit.marker.exists()


def test_torchs_refusal_is_told_in_a_few_words_without_its_advice_to_load_unsafely():
    from gptlab.checkpoint.safe_dcp import load_error

    def refusal(data):
        with pytest.raises(Exception) as e:
            torch.load(io.BytesIO(data), weights_only=True)
        return e.value

    Exploit.marker = "/nonexistent/pwned"
    garbage = b"\x80\x02\xff" + bytes(64)  # a pickle's header, then no opcode pickle knows
    assert "weights_only" in str(refusal(garbage))  # what torch itself says: load it unsafely
    assert load_error(refusal(garbage)) == "corrupt: Unsupported operand 255"
    assert (
        load_error(refusal(pickle.dumps(Exploit(), protocol=2)))
        == "unsafe: loading it would run posix.system"
    )
    assert load_error(refusal(b"")) == "corrupt: cut short"
    zip_cut = load_error(refusal(b"PK\x03\x04" + bytes(64)))
    assert (
        zip_cut.startswith("corrupt: PytorchStreamReader failed reading zip archive")
        and "\n" not in zip_cut
    )
    assert load_error(OSError(5, "Input/output error")) == "Input/output error"


def test_checkpoint_names_and_steps(tmp_path):
    assert checkpoint.step_of(Path("ckpt_00000007.pt")) == 7
    assert checkpoint.step_of(Path("ckpt_00000012")) == 12  # a sharded checkpoint's folder
    assert checkpoint.step_of(Path(".ckpt_00000015.partial")) == 15  # an unfinished sharded save
    # anything else sorts before step 0, so an unfinished save is compared against "no checkpoint"
    assert [
        checkpoint.step_of(Path(n)) for n in ("best.json", "ckpt_7.pt", "ckpt_00000007.pt.tmp1")
    ] == [-1] * 3
    assert checkpoint.latest(tmp_path) is None and checkpoint.latest(tmp_path / "absent") is None
    assert (
        checkpoint.list_checkpoints(tmp_path / "absent") == []
        and checkpoint.unfinished(tmp_path / "absent") == []
    )


def test_removing_a_checkpoint_someone_already_deleted_is_not_an_error(tmp_path):
    """Pruning lists, then deletes: a checkpoint a user removed by hand in between is simply
    gone."""
    checkpoint._remove(tmp_path / "ckpt_00000001.pt")
    checkpoint._remove(tmp_path / "ckpt_00000002")
    kept = checkpoint.save(checkpoint.checkpoint_path(tmp_path, 3), {"step": 3})
    folder = tmp_path / "ckpt_00000004"
    (folder / "sub").mkdir(parents=True)
    checkpoint._remove(folder)
    assert not folder.exists() and kept.exists()


@pytest.mark.parametrize("present", ["state.pt", ".metadata", None])
def test_a_folder_without_both_state_and_metadata_is_not_taken_for_a_sharded_checkpoint(
    tmp_path, present
):
    folder = tmp_path / "ckpt_00000005"
    folder.mkdir()
    if present:
        (folder / present).write_bytes(b"x")
    with pytest.raises(GptlabError) as e:
        checkpoint.load(folder)
    assert str(e.value) == (
        f"checkpoint {folder} is a folder but not a sharded checkpoint "
        "(no state.pt and .metadata): give ckpt_<step>.pt or a sharded ckpt_<step>/"
    )


def test_an_incomplete_sharded_checkpoint_names_every_missing_shard(
    tmp_path, one_rank_group, monkeypatch
):
    path, _ = _save_sharded(tmp_path, 5)
    from gptlab.checkpoint import safe_dcp

    monkeypatch.setattr(safe_dcp, "missing_data", lambda *_: ["__0_0.distcp", "__1_0.distcp"])
    with pytest.raises(GptlabError) as e:
        checkpoint.load(path)
    names = "__0_0.distcp, __1_0.distcp"
    assert (
        str(e.value)
        == f"checkpoint {path} is incomplete: shard file(s) {names} missing or cut short"
    )


def test_a_sharded_save_makes_its_folders_clears_killed_leftovers_and_replaces_the_same_step(
    tmp_path, one_rank_group
):
    """A new run's checkpoints/ (parents too) is created; a killed save's .partial folder (maybe
    with another world size's shards) is cleared first; saving the same step again (a stop at a
    checkpoint step) replaces the folder whole, even past a stale .replaced from a save killed in
    that rename."""
    folder = tmp_path / "run" / "checkpoints"
    _save_sharded(folder, 1)  # into folders that do not exist yet
    stale = folder / ".ckpt_00000003.partial"
    stale.mkdir(parents=True)
    (stale / "__1_0.distcp").write_bytes(b"a rank that no longer exists")
    path, _ = _save_sharded(folder, 3, seed=1)
    files = {".metadata", "state.pt", "__0_0.distcp", "sha256.json"}
    assert {f.name for f in path.iterdir()} == files
    assert not stale.exists()
    first = checkpoint.read_model(path).model
    old = folder / ".ckpt_00000003.replaced"
    old.mkdir()
    (old / "junk").write_bytes(b"x")
    again, _ = _save_sharded(folder, 3, seed=2)
    assert again == path and sorted(f.name for f in folder.iterdir()) == [
        "ckpt_00000001",
        "ckpt_00000003",
    ]
    second = checkpoint.read_model(path).model  # the second save's weights, consolidated
    assert second.keys() == first.keys() and not torch.equal(second["0.weight"], first["0.weight"])
    _save_sharded(folder, 3, seed=2)  # and once more with no stale folder in the way
    assert sorted(f.name for f in folder.iterdir()) == ["ckpt_00000001", "ckpt_00000003"]


def test_best_json_names_the_checkpoint_and_its_val_loss(tmp_path):
    path = checkpoint.save(checkpoint.checkpoint_path(tmp_path, 4), {"step": 4})
    checkpoint.mark_best(tmp_path, path, 1.625)
    assert json.loads((tmp_path / "best.json").read_text()) == {
        "checkpoint": "ckpt_00000004.pt",
        "val_loss": 1.625,
    }
    # no temporary left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.json", "ckpt_00000004.pt"]
    assert checkpoint.best(tmp_path) == path
    path.unlink()
    assert checkpoint.best(tmp_path) is None  # a marker naming a deleted checkpoint names nothing


def test_an_unfinished_sharded_save_is_named_only_when_newer_than_the_checkpoint_used(
    tmp_path, caplog
):
    def notes():
        caplog.clear()
        with caplog.at_level("WARNING", logger="gptlab.checkpoint.state"):
            # warnings go to gptlab.checkpoint.state's logger
            found = checkpoint.load_latest_good(tmp_path)
        return found, [
            r.getMessage() for r in caplog.records if r.name == "gptlab.checkpoint.state"
        ]

    (tmp_path / ".ckpt_00000001.partial").mkdir()
    assert notes() == (None, [f"warning: {tmp_path}/.ckpt_00000001.partial is a sharded save that "
                              "did not finish (the job stopped during it); skipped"])  # fmt: skip
    good = checkpoint.save(checkpoint.checkpoint_path(tmp_path, 5), {"step": 5})
    # the same step saved again, killed: step 5 is whole
    (tmp_path / ".ckpt_00000005.partial").mkdir()
    found, said = notes()
    assert found[0] == good and said == []
    (tmp_path / ".ckpt_00000006.partial").mkdir()
    found, said = notes()
    assert found[0] == good and len(said) == 1 and ".ckpt_00000006.partial" in said[0]


def _v1_state(model, opt, step):
    """A format-1 checkpoint's state: the model by name, the optimizer's state by position."""
    return checkpoint.TrainingState(
        step=step, tokens=0, best_val_loss=1.0, model=model.state_dict(),
        optimizer=opt.state_dict(), scaler={"value": 0}, loader={"value": step},
        rng=checkpoint.rng_state(), config={}, model_config={}, tokenizer={}, mlflow_run_id=None,
        format_version=1,
    )  # fmt: skip


def test_whole_checkpoints_restore_into_a_sharded_model_and_v1_ones_into_unsharded_ones_only(
    tmp_path, one_rank_group
):
    model, opt = _tiny(1, shard=False)
    objects = {"model": model, "optimizer": opt, "scaler": _Box(), "loader": _Box(4)}
    state = checkpoint.TrainingState.capture(
        objects,
        step=4,
        tokens=40,
        best_val_loss=1.0,
        config={},
        model_config={},
        tokenizer={},
        mlflow_run_id=None,
    )
    sharded, sharded_opt = _tiny(2, shard=True)
    state.restore({"model": sharded, "optimizer": sharded_opt, "scaler": _Box(), "loader": _Box()})
    got = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())

    old = _v1_state(model, opt, 4)
    plain, plain_opt = _tiny(3, shard=False)
    old.restore({"model": plain, "optimizer": plain_opt, "scaler": _Box(), "loader": _Box()})
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(
        plain_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    with pytest.raises(GptlabError) as e:
        old.restore(
            {"model": sharded, "optimizer": sharded_opt, "scaler": _Box(), "loader": _Box()}
        )
    assert str(e.value) == (
        "a v1 checkpoint resumes under parallelism=single or ddp only: resume it there once "
        "(its next checkpoint is v2), then under fsdp"
    )


def test_find_resolves_a_file_a_run_folder_or_a_checkpoints_folder_latest_or_best(tmp_path):
    run = tmp_path / "run"
    folder = run / "checkpoints"
    first, second = (
        checkpoint.save(checkpoint.checkpoint_path(folder, s), {"step": s}) for s in (2, 4)
    )
    assert checkpoint.find(str(first)) == first  # a file is itself
    assert checkpoint.find(str(run)) == second and checkpoint.find(str(folder)) == second
    assert checkpoint.find(str(run), which="best") == second  # no best.json yet: the newest
    checkpoint.mark_best(folder, first, 1.5)
    assert (
        checkpoint.find(str(run), which="best") == first
        and checkpoint.find(str(folder), which="best") == first
    )
    assert checkpoint.find(str(run), which="latest") == second
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(GptlabError) as e:
        checkpoint.find(str(empty))
    where = empty / "checkpoints"  # where a run keeps them, not the folder given
    assert str(e.value) == (
        f"run={empty}: no checkpoint found (expected {where}/ckpt_<step>.pt "
        f"such as ckpt_00000030.pt, or a sharded {where}/ckpt_<step>/)"
    )


def test_pruning_keeps_all_with_keep_0_one_with_keep_1_and_clears_other_processes_temporaries(
    tmp_path,
):
    paths = [
        checkpoint.save(checkpoint.checkpoint_path(tmp_path, s), {"step": s}) for s in (1, 2, 3)
    ]
    checkpoint.prune(tmp_path, keep=0)  # 0: keep every checkpoint
    assert checkpoint.list_checkpoints(tmp_path) == paths
    killed = tmp_path / ".ckpt_00000004.pt.tmp999999"  # a save killed mid-write, by another process
    own = tmp_path / f".ckpt_00000005.pt.tmp{os.getpid()}"  # this process's save in progress
    killed.write_bytes(b"x")
    own.write_bytes(b"x")
    checkpoint.prune(tmp_path, keep=1)
    assert checkpoint.list_checkpoints(tmp_path) == [paths[2]]
    assert not killed.exists() and own.exists()


def test_unreadable_checkpoints_say_what_is_wrong_in_one_line(tmp_path, one_rank_group):
    missing = tmp_path / "ckpt_00000001.pt"
    with pytest.raises(GptlabError) as e:
        checkpoint.load(missing)
    assert str(e.value) == f"checkpoint {missing}: no such file"
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    # a path through a file: an OSError that is not "no such file"
    inside = blocker / "ckpt_00000001.pt"
    with pytest.raises(GptlabError) as e:
        checkpoint.load(inside)
    assert str(e.value) == f"checkpoint {inside} cannot be read (Not a directory)"
    # a sharded checkpoint whose state.pt is someone else's: the message names the checkpoint's
    # folder
    path, _ = _save_sharded(tmp_path / "run", 3)
    torch.save({"x": 1}, path / "state.pt")
    with pytest.raises(GptlabError) as e:
        checkpoint.load(path, verify=False)  # (with the check: its digest differs, named below)
    assert str(e.value) == (
        f"checkpoint {path} is not a gptlab checkpoint (a PyTorch file that gptlab did not write)"
    )
    with pytest.raises(GptlabError, match=rf"^checkpoint {path}/state.pt is damaged: its SHA-256"):
        checkpoint.load(path)


def test_a_file_that_is_not_a_gptlab_checkpoint_is_named_for_what_it_is(tmp_path):
    good = checkpoint.save(tmp_path / "good.pt", {"step": 1}).read_bytes()
    cases = {
        "empty.pt": (b"", "an empty file"),
        # a zip archive, cut
        "cut.pt": (good[: len(good) // 2], "a truncated or corrupt PyTorch file"),
        "notes.pt": (b"step 1\n", "not a PyTorch file"),
    }
    for name, (content, why) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(GptlabError) as e:
            checkpoint.load(tmp_path / name)
        assert str(e.value) == f"checkpoint {tmp_path / name} is not a gptlab checkpoint ({why})"
    newer = tmp_path / "newer.pt"
    torch.save({"format_version": 99, "step": 1}, newer)
    with pytest.raises(GptlabError) as e:
        checkpoint.load(newer)
    assert str(e.value) == (
        f"checkpoint {newer} has checkpoint format v99; this gptlab reads v1, v2: "
        "use the gptlab version that wrote it"
    )


def test_a_checkpoint_from_more_gpus_than_visible_restores_the_rng_of_those_there(monkeypatch):
    """An 8-GPU checkpoint's eight CUDA generator states, resumed where one GPU is visible: the one
    visible device gets its state; torch's set_rng_state_all would fail on the second."""
    state = {**checkpoint.rng_state(), "cuda": [torch.full((4,), i, dtype=torch.uint8, device="cpu")
                                                for i in range(8)]}  # fmt: skip
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((i, s)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("all GPUs"))
    checkpoint.restore_rng(state)
    assert [(i, s.tolist()) for i, s in restored] == [(0, [0, 0, 0, 0])]


# ------------------------------------------------------------------------------ digests


def flip_byte(path: Path, offset: int) -> None:
    """A bad disk block: one byte of the file inverted in place, the size kept."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_pt_checkpoint_carries_its_digest_and_a_flipped_tensor_byte_is_refused(tmp_path):
    weights = torch.arange(100_000, dtype=torch.float32)
    path = checkpoint.save(checkpoint.checkpoint_path(tmp_path, 20), {"step": 20, "w": weights})
    raw = torch.load(path, weights_only=True)
    assert raw["sha256"] == checkpoint.state_digest({k: v for k, v in raw.items() if k != "sha256"})
    state = checkpoint.load(path)  # round trip: the digest checks and is not part of the state
    assert "sha256" not in state and torch.equal(state["w"], weights) and state["step"] == 20
    flip_byte(path, path.stat().st_size // 2)  # the middle of the file: inside the tensor's bytes
    # torch reads it without a word, one value changed
    assert not torch.equal(torch.load(path, weights_only=True)["w"], weights)
    said = rf"^checkpoint {path} is damaged: its SHA-256 does not match the one recorded at save$"
    with pytest.raises(GptlabError, match=said):
        checkpoint.load(path)
    unchecked = checkpoint.load(path, verify=False)  # train.verify_checkpoints=false
    assert (unchecked["w"] != weights).sum() == 1
    older = tmp_path / "ckpt_00000030.pt"  # a checkpoint from before digests: loads, unchecked
    torch.save({"format_version": 2, "step": 30, "w": weights}, older)
    assert checkpoint.load(older)["step"] == 30


def test_the_digest_covers_every_value_and_tensor_layout():
    base = {"step": 5, "rng": (1, [2, 3]), "w": torch.zeros(2, 3), "name": "a"}
    digest = checkpoint.state_digest(base)
    assert checkpoint.state_digest({**base, "rng": [1, (2, 3)]}) == digest  # as torch.load gives
    changed = [
        {**base, "step": 6},
        {**base, "name": "b"},
        {**base, "w": torch.zeros(3, 2)},
        {**base, "w": torch.zeros(2, 3, dtype=torch.float64)},
        {**base, "w": torch.zeros(2, 3).t().contiguous().t()},  # same values, other strides: same
    ]
    assert [checkpoint.state_digest(c) == digest for c in changed] == [
        False,
        False,
        False,
        False,
        True,
    ]


@pytest.mark.integration
def test_a_damaged_pt_checkpoint_of_a_run_is_named_and_resume_falls_back_unless_told_not_to_check(
    tmp_path, shakespeare
):
    import shutil

    run_dir = tmp_path / "run"
    overrides = nano_overrides(shakespeare, "train.checkpoint_every=10", "train.sample_tokens=0")
    run_training(compose_config([*overrides, "train.max_steps=20"]), run_dir)
    damaged = run_dir / "checkpoints" / "ckpt_00000020.pt"
    flip_byte(damaged, damaged.stat().st_size // 2)
    torch.load(damaged, weights_only=True)  # which torch does not notice
    with pytest.raises(GptlabError, match=rf"^checkpoint {damaged} is damaged: its SHA-256 "):
        checkpoint.load(damaged)
    unchecked = tmp_path / "unchecked"
    shutil.copytree(run_dir, unchecked)
    # resume=auto: the damaged one goes to broken/, the run continues from step 10
    results = run_training(compose_config([*overrides, "train.max_steps=30"]), run_dir)
    assert results["steps"] == 30 and results["tokens_this_session"] == 20 * 8 * 32
    assert (run_dir / "checkpoints" / "broken" / "ckpt_00000020.pt").is_file()
    # train.verify_checkpoints=false: read as it is, from step 20
    results = run_training(
        compose_config([*overrides, "train.max_steps=25", "train.verify_checkpoints=false"]),
        unchecked,
    )
    assert results["tokens_this_session"] == 5 * 8 * 32
    assert not (unchecked / "checkpoints" / "broken").exists()


def test_a_flipped_byte_in_a_shard_file_is_named_and_the_previous_checkpoint_used(
    tmp_path, one_rank_group
):
    first, _ = _save_sharded(tmp_path, 5)
    second, _ = _save_sharded(tmp_path, 10)
    digests = json.loads((second / "sha256.json").read_text())
    assert set(digests) == {".metadata", "state.pt", "__0_0.distcp"}
    assert checkpoint.load(second)["step"] == 10
    shard = second / "__0_0.distcp"
    flip_byte(shard, shard.stat().st_size // 2)
    said = rf"^checkpoint {shard} is damaged: its SHA-256 does not match the one recorded at save$"
    with pytest.raises(GptlabError, match=said):
        checkpoint.load(second)
    notes = []
    found, state = checkpoint.load_latest_good(tmp_path, warn=notes.append)
    assert found == first and state["step"] == 5 and "__0_0.distcp is damaged" in notes[0]
    # without the check it loads (and restores: the flipped value is a number like any other)
    found, _ = checkpoint.load_latest_good(tmp_path, warn=notes.append, verify=False)
    assert found == second
    os.remove(second / "sha256.json")  # an older sharded checkpoint: no digests, loaded unchecked
    assert checkpoint.load(second)["step"] == 10
