"""gptlab.export rebuilds the model from a checkpoint alone: safetensors, and a GPT-2 folder
transformers loads when the model is GPT-2-shaped."""

import json

import pytest
import torch
from helpers import compose_config, nano_overrides, run_cli
from test_sample import trained  # noqa: F401 - a short run's folder, trained once per module

from gptlab.train import run_training


def test_export_writes_safetensors_and_a_gpt2_folder_transformers_loads(trained, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from gptlab.export import main as export
    from gptlab.inference import load_model

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
    overrides = nano_overrides(
        shakespeare,
        "train.max_steps=10",
        "train.eval_every=5",
        "train.checkpoint_every=5",
        "train.sample_tokens=0",
        "model.mlp=swiglu",
    )
    run_training(compose_config(overrides), run_dir)
    best = checkpoint.best(run_dir / "checkpoints")
    assert best is not None and checkpoint.step_of(best) in (5, 10)
    # make the best one the older checkpoint, so latest and best differ
    if checkpoint.step_of(best) == 10:
        checkpoint.mark_best(
            run_dir / "checkpoints", checkpoint.checkpoint_path(run_dir / "checkpoints", 5), 0.0
        )
    r = run_cli(
        ["gptlab.export", f"run={run_dir}", "which=best", f"out={tmp_path / 'best'}"], cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "best" / "config.json").read_text())["step"] == 5
    assert "not GPT-2-shaped (positions, MLP or biases differ): no Hugging Face folder" in r.stdout
    assert (tmp_path / "best" / "model.safetensors").is_file() and not (
        tmp_path / "best" / "hf_gpt2"
    ).exists()
    r = run_cli(["gptlab.export", f"run={run_dir}", f"out={tmp_path / 'latest'}"], cwd=tmp_path)
    assert (
        r.returncode == 0
        and json.loads((tmp_path / "latest" / "config.json").read_text())["step"] == 10
    )
