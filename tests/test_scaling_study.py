"""Budgets instead of steps (train.max_tokens / max_flops, perf.costs.resolve_budget) and the
isoFLOP study as one sweep (-m scaling=FILE, gptlab/scaling/study.py)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import compose_config, nano_overrides, run_cli
from omegaconf import OmegaConf

from gptlab.config import to_config
from gptlab.errors import GptlabError
from gptlab.perf import costs
from gptlab.scaling import study


def budget_config(*overrides):
    return to_config(compose_config(["model=gpt_nano", "train.max_steps=null", *overrides]))


def test_a_flops_budget_buys_the_whole_steps_the_planner_counts():
    cfg = budget_config("train.max_flops=3e10")
    resolved, note = costs.resolve_budget(cfg)
    plan = costs.make_plan(resolved)
    step_flops = plan.flops_per_token * cfg.train.batch_size * cfg.model.block_size
    assert resolved.train.max_steps == math.floor(3e10 / step_flops)
    assert (
        resolved.train.max_steps * step_flops <= 3e10 < (resolved.train.max_steps + 1) * step_flops
    )
    assert note.startswith(f"{resolved.train.max_steps:,} steps from train.max_flops=3e+10")
    # the same config with its derived steps given too is the same run (a spawned rank's)
    assert costs.resolve_budget(resolved)[0].train.max_steps == resolved.train.max_steps
    tokens = costs.resolve_budget(budget_config("train.max_tokens=100000"))[0]
    assert tokens.train.max_steps == 100000 // (cfg.train.batch_size * cfg.model.block_size)
    plain = budget_config("train.max_steps=7")
    assert costs.resolve_budget(plain) == (plain, None)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.max_flops=1e3"], "train.max_flops=1000 buys less than one step of this model"),
        (["train.max_flops=1e12", "train.max_steps=5"], "both set the length: add train.max"),
        (["train.max_tokens=1000000", "train.max_flops=1e12"], "max_flops are both set"),
        ([], "train.max_steps: null needs a budget: train.max_tokens=N or train.max_flops=N"),
        (["train.max_flops=-1"], "train.max_flops: must be positive"),
    ],
)  # fmt: skip
def test_a_budget_that_cannot_set_the_length_is_one_line(overrides, words):
    with pytest.raises(GptlabError) as e:
        costs.resolve_budget(budget_config(*overrides))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.integration
def test_a_run_to_a_flops_budget_records_what_it_spent(shakespeare, tmp_path):
    from gptlab.train import run_training

    overrides = nano_overrides(shakespeare, "train.max_steps=null", "train.max_flops=2e9")
    results = run_training(compose_config(overrides), tmp_path / "run")
    planned = costs.resolve_budget(to_config(compose_config(overrides)))[0].train.max_steps
    assert results["steps"] == planned
    assert results["flops"] <= 2e9 and results["flops"] == pytest.approx(
        results["tokens"]
        * json.loads((tmp_path / "run" / "derived.json").read_text())["flops_per_token"]
    )
    assert 0 < results["params_non_embedding"] < results["params"]


def settings(**changes):
    base = {"name": "s", "budgets": [1e10, 1e11], "sizes": [], "depths": [1, 2, 3],
            "width_per_depth": 32, "head_dim": 16, "tokens_per_param": [1, 1000],
            "objective": "best_val_loss"}  # fmt: skip
    return OmegaConf.create({**base, **changes})


def test_the_grid_is_every_budget_times_every_size_without_the_command_lines_length():
    pts = study.points(settings(), ["data.path=x", "train.max_steps=5", "train.max_flops=1"])
    assert [p.name for p in pts] == [
        "1e10_d1",
        "1e10_d2",
        "1e10_d3",
        "1e11_d1",
        "1e11_d2",
        "1e11_d3",
    ]
    assert pts[4].overrides == [
        "data.path=x", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
        "train.max_steps=null", "train.max_flops=1e+11",
    ]  # fmt: skip
    listed = settings(
        sizes=[{"n_layer": 1, "n_embd": 32, "lr": 0.01}, {"n_embd": 48}, {"n_layer": 3}]
    )
    names = [(label, o) for label, o in study.sizes(listed)]
    assert names[0] == ("L1xD32", ["model.n_layer=1", "model.n_embd=32", "optimizer.lr=0.01"])
    assert [n for n, _ in names[1:]] == ["s1", "s2"]
    assert study.budget_label(3e12) == "3e12" and study.budget_label(2.5e11) == "2.5e11"


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"budgets": []}, "scaling.budgets is empty"),
        ({"depths": [1, 2]}, "2 size(s) in the family"),
        ({"budgets": [0]}, "scaling.budgets: 0 is not a positive number"),
    ],
)
def test_a_grid_that_cannot_be_fitted_is_one_line(changes, words):
    with pytest.raises(GptlabError, match=words.replace("(", r"\(").replace(")", r"\)")):
        study.points(settings(**changes), [])


@pytest.mark.slow
def test_a_study_runs_its_grid_fits_it_and_started_again_runs_only_what_is_missing(
    shakespeare, tmp_path
):
    outputs = tmp_path / "outputs"
    args = [
        "gptlab.train", "-m", "scaling=char_cpu", f"data.path={shakespeare}",
        f"paths.outputs={outputs}", "scaling.budgets=[2e9,6e9]",
        "scaling.tokens_per_param=[0.01,1e5]",
        "scaling.sizes=[{n_layer:1,n_embd:16,n_head:1},{n_layer:1,n_embd:32,n_head:2},"
        "{n_layer:2,n_embd:48,n_head:2}]",
        "train.batch_size=8", "train.eval_steps=4", "model.block_size=32",
    ]  # fmt: skip
    first = run_cli(args, cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    folder = outputs / "scaling" / "char_cpu"
    held = json.loads((folder / "study.json").read_text())
    assert [p["state"] for p in held["points"]] == ["run"] * 6
    for p in held["points"]:
        results = json.loads((folder / p["name"] / "results.json").read_text())
        assert results["steps"] == p["steps"] and results["tokens"] == p["tokens"]
        assert results["flops"] <= p["budget"]
    assert (folder / "scaling.json").is_file() and (folder / "scaling.png").is_file()
    # stopped with one point unfinished: the same command runs that one only
    (folder / "6e9_L1xD32" / "results.json").unlink()
    again = run_cli(args, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr
    assert "6 points (2 budgets x 3 sizes); 1 to run, 5 finished before (kept)" in log
    assert log.count("results: best val loss") == 1
    states = [p["state"] for p in json.loads((folder / "study.json").read_text())["points"]]
    assert states == ["kept"] * 4 + ["run", "kept"]
    # the fit is in the sweep's MLflow parent run
    import mlflow

    sweep = json.loads((folder / "sweep.json").read_text())
    parent = mlflow.MlflowClient(sweep["uri"]).get_run(sweep["parent_run_id"])
    assert "scaling/a" in parent.data.metrics and parent.data.tags["run_type"] == "scaling"


def test_a_size_the_model_refuses_is_one_line_naming_the_point():
    s = settings(sizes=[{"n_layer": 1, "n_embd": 30, "n_head": 4}, {"n_embd": 32}, {"n_embd": 48}])
    point = study.points(s, [])[0]
    job = compose_config(["model=gpt_nano", *point.overrides])
    with pytest.raises(GptlabError) as e:
        study.plan(point, job, [1, 1000])
    assert str(e.value) == (
        "scaling point 1e10_L1xD30: model.n_embd: 30 is not divisible by model.n_head=4"
    )
