"""gptlab.export rebuilds the model from a checkpoint alone: safetensors, the tokenizer as Hugging
Face files, and a GPT-2 folder transformers loads (model and tokenizer) when the model is
GPT-2-shaped."""

import json
import os

import pytest
import torch
from helpers import compose_config, nano_overrides, run_cli, trained_hf_export
from test_sample import trained  # noqa: F401 - a short run's folder, trained once per module

from gptlab.train import run_training


@pytest.mark.integration
def test_export_writes_safetensors_and_a_gpt2_folder_transformers_loads(trained, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from gptlab.export import main as export
    from gptlab.model.inference import load_model

    out = export([f"run={trained}", f"out={tmp_path / 'export'}"])
    ours, tokenizer, _ = load_model(str(trained))
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
    # the folder's tokenizer encodes text as the model was trained: the same ids, the same logits
    text = "ROMEO:\n  But soft, what light? "  # within the nano model's block of 32
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out / "hf_gpt2"))
    ids = hf_tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer.encode(text) and hf_tokenizer.decode(ids[0]) == text
    with torch.no_grad():
        expected, _ = ours(torch.tensor([tokenizer.encode(text)]))
        assert torch.allclose(hf(ids).logits, expected, atol=1e-4)
    assert hf_tokenizer.model_max_length == ours.config.block_size
    # a char tokenizer without separators has no eos: not GPT-2's 50256, which is out of range
    assert hf.config.eos_token_id is None and hf.config.bos_token_id is None
    top = transformers.AutoTokenizer.from_pretrained(str(out))  # next to gptlab's config.json
    assert top.encode(text) == tokenizer.encode(text)


@pytest.mark.integration
def test_a_mup_models_hf_folder_is_a_plain_gpt2_with_the_same_logits(tmp_path, shakespeare):
    """muP at twice its base width (attention scale, output multiplier) trained a few steps: the
    exported folder is a plain GPT-2 that transformers loads and that scores as gptlab's model."""
    transformers = pytest.importorskip("transformers")
    from gptlab.model.inference import load_model

    run_dir, folder = trained_hf_export(
        tmp_path, shakespeare, "train.max_steps=4", "train.eval_every=4", "train.sample_tokens=0",
        "model.parametrization=mup", "model.mup_base_width=16",
    )  # fmt: skip
    ours, _, _ = load_model(str(run_dir))
    assert ours.config.parametrization == "mup" and ours.config.width_mult == 2.0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    x = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = ours(x)
        got = hf(x).logits
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


@pytest.mark.slow
def test_export_command_which_best_and_a_model_that_is_not_gpt2_shaped(tmp_path, shakespeare):
    """From the command line: which=best exports the best checkpoint, not the newest; a SwiGLU model
    gets its safetensors and one line saying why there is no Hugging Face folder."""
    from gptlab.checkpoint import state as checkpoint
    from gptlab.export import main as export

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
    assert (tmp_path / "best" / "tokenizer.json").is_file()  # the tokenizer still goes with it
    # the default, in this process: the newest checkpoint
    export([f"run={run_dir}", f"out={tmp_path / 'latest'}"])
    assert json.loads((tmp_path / "latest" / "config.json").read_text())["step"] == 10


@pytest.mark.slow
def test_a_bpe_models_hf_folder_encodes_and_scores_text_as_gptlab_does(tmp_path, shakespeare):
    """The path lm_eval's hf model takes: AutoTokenizer and GPT2LMHeadModel on the folder give
    gptlab's ids and logits, and the config names the tokenizer's special tokens."""
    transformers = pytest.importorskip("transformers")
    from gptlab.model.inference import load_model

    run_dir, folder = trained_hf_export(
        tmp_path, shakespeare, "train.max_steps=3", "train.sample_tokens=0",
        "data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=512",
    )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    ours, gptlab_tokenizer, _ = load_model(str(run_dir))
    assert gptlab_tokenizer.kind == "bpe"
    text = "KING HENRY:  Once more, café 😀 1599\n\n"
    ids = gptlab_tokenizer.encode(text)
    assert tokenizer.encode(text) == ids and tokenizer.decode(ids) == text
    with torch.no_grad():
        expected, _ = ours(torch.tensor([ids]))
        assert torch.allclose(hf(torch.tensor([ids])).logits, expected, atol=1e-4)
    config = json.loads((folder / "config.json").read_text())
    specials = (509, 510, 511)  # <|bos|> <|eos|> <|pad|>
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == specials
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == specials


@pytest.mark.integration
def test_the_export_folders_files_all_get_the_mode_of_new_files(trained, tmp_path):  # noqa: F811
    """model.safetensors (safetensors writes a private temporary file) is as readable as its
    siblings: what the umask gives any new file, 0644 under 022."""
    from gptlab.export import main as export

    old = os.umask(0o022)
    try:
        out = export([f"run={trained}", f"out={tmp_path / 'export'}"])
    finally:
        os.umask(old)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.relative_to(out).as_posix() for p in files} >= {
        "model.safetensors", "config.json", "hf_gpt2/model.safetensors"
    }  # fmt: skip
    assert {p.relative_to(out).as_posix(): oct(p.stat().st_mode & 0o777) for p in files} == {
        p.relative_to(out).as_posix(): "0o644" for p in files
    }
