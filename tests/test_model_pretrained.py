"""model.init_from (gptlab/model/pretrained.py and its hook in training/build.py): a run that starts
from existing weights. Sources are small GPT-2s made here with transformers, offline; their logits
in gptlab equal transformers' own, an export read back gives the same logits bit for bit, bad input
is one line before anything is allocated, and a fine-tune from one lowers the validation loss."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config, model_config, nano_overrides, run_cli

from gptlab.errors import GptlabError
from gptlab.model import pretrained
from gptlab.model.gpt import GPT

CHARS = 65  # Tiny Shakespeare's characters: the char tokenizer's vocabulary


def hf_gpt2(folder: Path, vocab: int = CHARS, seed: int = 0, **shape) -> Path:
    """A random GPT-2 saved by transformers (config.json + model.safetensors)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    kw = {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "bos_token_id": 0, **shape}
    kw["eos_token_id"] = 0
    GPT2LMHeadModel(GPT2Config(vocab_size=vocab, **kw)).save_pretrained(folder)
    return folder


def transformers_logits(folder: Path, idx: torch.Tensor) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(folder).eval()(idx).logits


def gptlab_model(folder: Path, vocab: int = CHARS, multiple: int = 1, **changes) -> GPT:
    """gptlab's GPT built from the source's shape (an untouched nano config) with its weights."""
    source = pretrained.read_source(str(folder), folder)
    mcfg = pretrained.shaped(model_config(**changes), source, set())
    model = GPT(dataclasses.replace(mcfg, vocab_size=vocab, vocab_multiple=multiple))
    pretrained.load_into(model, source)
    return model.eval()


@pytest.mark.integration  # builds transformers' model and gptlab's from one folder
@pytest.mark.parametrize(
    "rows, multiple", [(CHARS, 1), (CHARS, 64), (128, 1)], ids=["same", "gptlab-pads", "hf-pads"]
)
def test_logits_equal_transformers_on_the_same_folder(tmp_path, rows, multiple):
    """Every position, fp32, within 1e-4: Conv1D transposed, learned positions, tied head, the
    tanh GELU; padded rows either side are never a token (zeroed here, dropped there)."""
    folder = hf_gpt2(tmp_path / "hf", vocab=rows)
    model = gptlab_model(folder, multiple=multiple)
    assert model.config.mlp == "gelu_tanh" and model.config.n_layer == 2
    assert model.wte.weight.shape[0] == (CHARS if multiple == 1 else 128)
    assert not model.wte.weight[CHARS:].any()
    idx = torch.randint(0, CHARS, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)[0]
        theirs = transformers_logits(folder, idx)[..., :CHARS]
    assert ours.shape == theirs.shape == (2, 64, CHARS)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_a_shorter_block_size_crops_the_position_table(tmp_path):
    folder = hf_gpt2(tmp_path / "hf")
    source = pretrained.read_source("hf", folder)
    model = gptlab_model(folder, block_size=16)
    mcfg = pretrained.shaped(model_config(block_size=16), source, {"block_size"})
    assert mcfg.block_size == 16 and model.config.block_size == 64  # not explicit: the source's
    short = GPT(dataclasses.replace(mcfg, vocab_size=CHARS))
    pretrained.load_into(short, source)
    assert torch.equal(short.wpe.weight, model.wpe.weight[:16])
    idx = torch.randint(0, CHARS, (1, 16))
    with torch.no_grad():
        assert torch.allclose(short.eval()(idx)[0], model(idx)[0], atol=1e-6)


def test_export_then_init_from_the_export_gives_identical_logits(tmp_path):
    """gptlab's export folder and its hf_gpt2/ folder both read back bit for bit."""
    from gptlab.data.tokenizers import CharTokenizer
    from gptlab.export import hf_gpt2_config, hf_gpt2_state
    from gptlab.model.inference import save_weights, write_model_files

    model = gptlab_model(hf_gpt2(tmp_path / "hf"), multiple=64)
    tokenizer = CharTokenizer("".join(chr(33 + i) for i in range(CHARS)))
    saved = SimpleNamespace(
        model_config=dataclasses.asdict(model.config), tokenizer=tokenizer.to_meta(), step=3
    )
    out = tmp_path / "export"
    write_model_files(model, tokenizer, saved, out)
    (out / "hf_gpt2").mkdir()
    save_weights(hf_gpt2_state(model), out / "hf_gpt2" / "model.safetensors", {"format": "pt"})
    (out / "hf_gpt2" / "config.json").write_text(json.dumps(hf_gpt2_config(model, tokenizer)))
    idx = torch.randint(0, CHARS, (2, 64))
    with torch.no_grad():
        want = model(idx)[0]
        for folder in (out, out / "hf_gpt2"):
            source = pretrained.read_source(str(folder), folder)
            assert source.tokenizer_kind == "char"
            assert torch.equal(gptlab_model(folder, multiple=64)(idx)[0], want), folder
    pretrained.check_vocab(pretrained.read_source("x", out), tokenizer, CHARS)
    other = CharTokenizer("".join(chr(34 + i) for i in range(CHARS)))
    with pytest.raises(GptlabError, match="tokenizer differs"):
        pretrained.check_vocab(pretrained.read_source("x", out), other, CHARS)


def test_gpt2_weights_need_the_gpt2_tokenizer_and_the_shape_is_the_sources(tmp_path):
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257}))
    with pytest.raises(GptlabError, match="n_embd"):  # a config without the shape
        pretrained.read_source("g", folder)
    source = pretrained.Source("gpt2", "hf", folder, {"n_layer": 12, "vocab_size": 50304}, "gpt2")
    with pytest.raises(GptlabError, match="data.tokenizer.kind=gpt2"):
        pretrained.check_tokenizer(source, "char")
    pretrained.check_tokenizer(source, "gpt2")
    assert pretrained.shaped(model_config(), source, set()).n_layer == 12
    with pytest.raises(GptlabError, match=r"^model\.n_layer=2 contradicts model\.init_from=gpt2"):
        pretrained.shaped(model_config(), source, {"n_layer"})
    with pytest.raises(GptlabError, match="embedding has 50,304 rows"):
        pretrained.check_vocab(source, None, 1000)


def damaged(folder: Path, how: str) -> str:
    """A source folder broken one way; returns what the error names."""
    if how == "llama":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        return "a llama model"
    hf_gpt2(folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    if how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif how == "corrupt":
        weights.write_bytes(b"\xff" * 16 + data[16:])
    elif how == "missing weights":
        weights.unlink()
        return "no model.safetensors or pytorch_model.bin"
    elif how == "tanh-less eps":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "layer_norm_epsilon": 1e-6}))
        return "layer_norm_epsilon"
    return "not a readable safetensors file"


@pytest.mark.parametrize(
    "spec",
    [
        "gpt3",
        "missing",
        "llama",
        "truncated",
        "corrupt",
        "missing weights",
        "tanh-less eps",
        "models:/nope@champion",
    ],
)
def test_bad_sources_are_one_line_before_the_data_or_the_model(tmp_path, shakespeare, spec):
    """In-process through the real build: the error names model.init_from, is one line, and comes
    before the data is prepared (its cache stays empty) or any run record is written."""
    from gptlab.train import run_training

    path, says = tmp_path / spec, None
    if spec in ("llama", "truncated", "corrupt", "missing weights", "tanh-less eps"):
        says = damaged(path, spec)
    value = spec if spec.startswith(("models:", "gpt3")) else str(path)
    cache = tmp_path / "cache"
    overrides = nano_overrides(
        shakespeare,
        f"model.init_from={value}",
        "data.tokenizer.kind=char",
        f"data.cache_dir={cache}",
        f"paths.mlflow_db={tmp_path / 'no-store' / 'mlflow.db'}",  # a store that is not there
    )
    with pytest.raises(GptlabError) as e:
        run_training(compose_config(overrides), tmp_path / "run")
    message = str(e.value)
    assert "\n" not in message and ("model.init_from=" in message or "models:/" in message)
    if says:
        assert says in message, message
    if spec == "gpt3":
        assert "gpt2, gpt2-medium" in message
    if spec.startswith("models:"):  # the store that does not answer is named
        assert "no-store" in message, message
    assert not cache.exists() or not any(cache.rglob("*.bin")), "data prepared"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # the command in a subprocess
@pytest.mark.parametrize(
    "case", ["gpt2 offline", "contradicting override", "truncated"], ids=lambda c: c.split()[0]
)
def test_the_command_says_one_line_and_leaves_no_run_folder(tmp_path, shakespeare, case):
    source = tmp_path / "src"
    if case == "gpt2 offline":
        extra = ["model.init_from=gpt2", "data.tokenizer.kind=gpt2"]
        want = "model.init_from=/path/to/folder"
    elif case == "contradicting override":
        hf_gpt2(source)
        extra = [f"model.init_from={source}", "model.n_layer=3", "data.tokenizer.kind=char"]
        want = "model.n_layer=3 contradicts"
    else:
        damaged(source, "truncated")
        extra = [f"model.init_from={source}", "data.tokenizer.kind=char"]
        want = "not a readable safetensors file"
    runs = tmp_path / "runs"
    r = run_cli(
        ["gptlab.train", *nano_overrides(shakespeare, *extra), f"hydra.run.dir={runs}/one"],
        cwd=tmp_path,
        env_extra={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")},
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("gptlab.train: error: ") and want in lines[0], lines[0]
    assert not runs.exists() or not any(runs.iterdir())


FINETUNE = [
    "experiment=gpt2_finetune_shakespeare",
    "hardware=cpu",
    "hardware.precision=fp32",
    "hardware.compile=false",
    "data.tokenizer.kind=char",  # GPT-2's encoding is a download: the source's vocabulary is 65
    "model.block_size=64",  # the preset's value: the source's 128 replace it (not the command line)
    "train.max_steps=30",
    "train.batch_size=8",
    "train.eval_every=10",
    "train.eval_steps=4",
    "train.eval_batch_size=8",
    "train.log_every=10",
    "train.sample_tokens=0",
    "train.checkpoint_every=30",
    "optimizer.lr=1e-3",  # a random source: the recipe's 3e-5 suits GPT-2's trained weights
    "tracking.mlflow=false",
    "tracking.plots=false",
]


def val_losses(run_dir: Path):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.mark.integration  # trains
def test_the_finetune_recipe_on_a_small_gpt2_lowers_val_loss_and_records_its_source(
    tmp_path, shakespeare
):
    """The recipe itself, its source a 2-layer GPT-2 of the char vocabulary (shape from the source,
    not gpt2_124m's); the run's records name the source; a second run starts from the first's run
    folder with the weights it ended with."""
    from gptlab.train import run_training

    # the recipe's data=shakespeare separates documents with an end-of-text token: 65 chars + 1
    folder = hf_gpt2(tmp_path / "hf", vocab=CHARS + 1, n_positions=128, n_embd=64)
    base = [*FINETUNE, f"data.path={shakespeare}", f"data.cache_dir={tmp_path / 'cache'}"]
    run = tmp_path / "run"
    results = run_training(compose_config([*base, f"model.init_from={folder}"]), run)
    before = gptlab_model(folder, vocab=CHARS + 1, block_size=64)
    first, *_, last = val_losses(run)
    print(f"fine-tune val loss: step 10 {first:.4f}, step 30 {last:.4f}")
    assert last < first - 0.2, (first, last)
    saved = json.loads((run / "results.json").read_text())
    assert saved["init_from"] == str(folder) and results["steps"] == 30
    assert json.loads((run / "run.json").read_text())["tags"]["gptlab.init_from"] == str(folder)
    derived = json.loads((run / "derived.json").read_text())
    assert derived["model_shape"]["n_layer"] == 2 and derived["model_shape"]["n_embd"] == 64
    # composed in-process, nothing is a command-line override: the source's 128 positions stand
    assert derived["model_shape"]["block_size"] == before.config.block_size == 128
    # the run folder as a source: its evaluated weights, its tokenizer
    from gptlab.model.inference import load_model

    trained = load_model(str(run))[0]
    source = pretrained.read_source("run", run)
    assert source.kind == "checkpoint" and source.tokenizer_kind == "char"
    again = GPT(dataclasses.replace(trained.config))
    pretrained.load_into(again, source)
    idx = torch.randint(0, CHARS, (1, 64))
    with torch.no_grad():
        assert torch.equal(again.eval()(idx)[0], trained(idx)[0])


@pytest.fixture(scope="module")
def init_from_one(tmp_path_factory, shakespeare):
    """A short run from a GPT-2 source on one process: its overrides and its folder.

    The reference both strategies' two-process runs must equal.
    """
    from test_fsdp import base, train_here

    tmp = tmp_path_factory.mktemp("init_from")
    folder = hf_gpt2(tmp / "hf")
    args = base(
        shakespeare,
        f"model.init_from={folder}",
        "data.tokenizer.kind=char",
        "train.max_steps=6",
        "train.eval_every=3",
        "train.save_checkpoints=false",
        "parallelism.activation_checkpointing=false",
    )
    train_here([*args, "hardware=cpu"], tmp / "one")
    return args, tmp / "one"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_init_from_under_two_processes_equals_one_process(tmp_path, init_from_one, strategy):
    """Weights loaded whole on every rank before wrapping (fsdp shards the loaded model): the
    per-step losses of 2 gloo processes are one process's within 1e-5."""
    from test_fsdp import assert_same_curves, curves, train_here

    args, one = init_from_one
    train_here([*args, "hardware=cpu_x2", f"parallelism={strategy}"], tmp_path / "two")
    assert_same_curves(curves(tmp_path / "two"), curves(one))
