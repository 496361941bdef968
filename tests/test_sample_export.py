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
