"""gptlab.sample and gptlab.export rebuild the model from a checkpoint alone."""

import json

import pytest
import torch
from conftest import compose_config, nano_overrides, run_cli

from gptlab.train import run_training


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_training(compose_config(nano_overrides(shakespeare, "train.max_steps=30")), run_dir)
    return run_dir


@pytest.mark.slow
def test_sample_command_continues_the_prompt(trained, tmp_path):
    r = run_cli(["gptlab.sample", f"run={trained}", "prompt=ROMEO:", "max_new_tokens=40", "seed=1"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.rstrip("\n")) >= 40
    again = run_cli(["gptlab.sample", f"run={trained}", "prompt=ROMEO:", "max_new_tokens=40", "seed=1"], cwd=tmp_path)
    assert again.stdout == r.stdout  # seeded


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,fragment",
    [
        (["run=/nonexistent"], "no checkpoint found"),
        (["run={run}", "temprature=0.5"], "temprature"),
        (["run={run}", "max_new_tokens=lots"], "max_new_tokens"),
        (["run={run}", "prompt=€"], "not in"),
    ],
)
def test_sample_bad_arguments_are_one_line(trained, tmp_path, args, fragment):
    r = run_cli(["gptlab.sample", *[a.format(run=trained) for a in args]], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gptlab.sample: error:") and fragment in lines[0], r.stderr


def test_export_writes_safetensors_and_a_gpt2_folder_transformers_loads(trained, tmp_path):
    from safetensors.torch import load_file

    from gptlab.export import main as export
    from gptlab.sample import load_model

    out = export([f"run={trained}", f"out={tmp_path / 'export'}"])
    ours, _, _ = load_model(str(trained))
    weights = load_file(str(out / "model.safetensors"))
    assert torch.equal(weights["wte.weight"], ours.wte.weight)
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["n_layer"] == 2 and config["tokenizer"]["kind"] == "char"
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out / "hf_gpt2")).eval()
    x = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        expected, _ = ours(x)
        got = hf(x).logits
    assert torch.allclose(got, expected, atol=1e-4)


@pytest.mark.slow
def test_export_command_which_best_and_a_model_that_is_not_gpt2_shaped(tmp_path, shakespeare):
    """From the command line: which=best exports the best checkpoint, not the newest; a SwiGLU model
    gets its safetensors and one line saying why there is no Hugging Face folder."""
    from gptlab import checkpoint

    run_dir = tmp_path / "run"
    overrides = nano_overrides(shakespeare, "train.max_steps=10", "train.eval_every=5", "train.checkpoint_every=5",
                               "train.sample_tokens=0", "model.mlp=swiglu")  # fmt: skip
    run_training(compose_config(overrides), run_dir)
    best = checkpoint.best(run_dir / "checkpoints")
    assert best is not None and checkpoint.step_of(best) in (5, 10)
    # make the best one the older checkpoint, so latest and best differ
    if checkpoint.step_of(best) == 10:
        checkpoint.mark_best(run_dir / "checkpoints", checkpoint.checkpoint_path(run_dir / "checkpoints", 5), 0.0)
    r = run_cli(["gptlab.export", f"run={run_dir}", "which=best", f"out={tmp_path / 'best'}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "best" / "config.json").read_text())["step"] == 5
    assert "not GPT-2-shaped (positions, MLP or biases differ): no Hugging Face folder" in r.stdout
    assert (tmp_path / "best" / "model.safetensors").is_file() and not (tmp_path / "best" / "hf_gpt2").exists()
    r = run_cli(["gptlab.export", f"run={run_dir}", f"out={tmp_path / 'latest'}"], cwd=tmp_path)
    assert r.returncode == 0 and json.loads((tmp_path / "latest" / "config.json").read_text())["step"] == 10


@pytest.mark.slow
def test_a_run_without_checkpoints_names_where_they_would_be(tmp_path):
    empty = tmp_path / "run"
    empty.mkdir()
    for command in ("gptlab.sample", "gptlab.export"):
        r = run_cli([command, f"run={empty}"], cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0] == (
            f"{command}: error: run={empty}: no checkpoint found (expected {empty}/checkpoints/ckpt_<step>.pt "
            f"such as ckpt_00000030.pt, or a sharded {empty}/checkpoints/ckpt_<step>/)"
        )
