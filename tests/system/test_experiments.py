"""conf/experiment: every reference recipe composes, says what it expects, and runs on the CPU
shrunk; each inherits what the references share from conf/experiment/base/reference.yaml."""

import json
import math
from pathlib import Path

import pytest
from helpers import CONF, compose_config
from omegaconf import OmegaConf

from gptlab.config import to_config
from gptlab.perf.costs import resolve_auto

RECIPES = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
BASE = "base/reference"  # not a recipe: what the recipes share

# The model shrunk and the run made CPU-sized; everything else is the recipe's.
SHRINK = [
    "hardware=cpu",
    "hardware.memory_gb=null",
    "hardware.compile=false",
    "hardware.attention_backend=auto",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "model.ffn_dim=null",
    "train.max_steps=5",
    "eval.hellaswag.every=0",  # the GPT-2 recipes score HellaSwag, whose file is not here offline
    "train.batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_steps=1",
    "train.eval_batch_size=2",
    "train.log_every=1",
    "train.sample_tokens=0",
    "train.save_checkpoints=false",
    "optimizer.warmup_steps=2",
    "tracking.mlflow=false",
    "tracking.plots=false",
]


def test_the_reference_recipes_are_all_there():
    assert set(RECIPES) >= {
        "gpt1b_shakespeare",
        "bpe_25m",
        "gpt2_124m_gutenberg",
        "gpt2_124m_fineweb_edu",
        "shakespeare_char_baby",
    }


def defaults(name: str) -> list:
    return [str(entry) for entry in OmegaConf.load(CONF / "experiment" / f"{name}.yaml").defaults]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_inherits_the_reference_base_and_chooses_no_optimizer(name):
    chain = [name]
    while defaults(chain[-1])[0] in RECIPES:  # a recipe built on another one (fineweb on gutenberg)
        chain.append(defaults(chain[-1])[0])
    assert defaults(chain[-1])[0] == BASE, f"{chain[-1]}'s defaults start with {BASE}"
    assert not [e for n in chain for e in defaults(n) if "optimizer" in e], "the base chooses it"
    assert to_config(compose_config([f"experiment={name}"])).optimizer.name == "adamw"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_states_its_expected_result(name):
    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_")
    c = to_config(compose_config([f"experiment={name}"]))
    assert c.expected.get("source"), "each recipe says where its expected result comes from"


def test_gpt1b_recipe_is_the_reference_run():
    c = to_config(compose_config(["experiment=gpt1b_shakespeare"]))
    assert (c.model.name, c.model.n_layer, c.model.n_embd, c.model.n_head, c.model.ffn_dim) == (
        "gpt1b",
        20,
        2048,
        16,
        8192,
    )
    assert c.data.name == "shakespeare_char" and c.hardware.name == "a100x8" and c.world_size == 8
    assert c.parallelism.strategy == "ddp" and c.parallelism.activation_checkpointing
    assert c.model.block_size == 2048 and c.train.batch_size * c.model.block_size == 131_072
    assert (
        c.train.max_steps == 15_000
        and c.optimizer.lr_scaling == "sqrt"
        and c.optimizer.schedule == "cosine"
    )
    # the reference's bf16 and compile: what auto decides for an A100 and a 15,000-step run
    decided = resolve_auto(c)[0].hardware
    assert c.optimizer.warmup_steps > 0 and (decided.precision, decided.compile) == ("bf16", True)


def test_bpe_25m_recipe():
    c = to_config(compose_config(["experiment=bpe_25m"]))
    m = c.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.pos_emb) == (
        4,
        16,
        512,
        512,
        "sinusoidal",
    )
    assert c.data.tokenizer.kind == "bpe" and c.data.tokenizer.vocab_size == 32768
    assert c.hardware.precision == "fp16" and (c.micro_batch_size, c.accum_steps) == (8, 4)
    o = c.optimizer
    assert (o.warmup_steps, o.lr, o.lr * o.min_lr_ratio, o.grad_clip, o.weight_decay) == (
        50,
        6e-4,
        pytest.approx(6e-5),
        1.0,
        0.1,
    )
    assert c.train.max_steps == 10_000 and c.train.eval_every == 100


@pytest.mark.parametrize("name", ["gpt2_124m_gutenberg", "gpt2_124m_fineweb_edu"])
def test_gpt2_recipes(name):
    c = to_config(compose_config([f"experiment={name}"]))
    assert (
        c.model.name == "gpt2_124m"
        and c.data.tokenizer.kind == "gpt2"
        and resolve_auto(c)[0].hardware.precision == "bf16"
    )
    assert (
        # auto: SDPA's flash kernel for bf16 on these GPUs, a fallback where flash cannot run
        c.hardware.attention_backend == "auto"
        and c.optimizer.fused
        and c.optimizer.schedule == "cosine"
    )
    tokens = c.train.batch_size * c.model.block_size
    assert 0.45e6 <= tokens <= 0.55e6 and c.accum_steps > 1


def test_baby_recipe():
    c = to_config(compose_config(["experiment=shakespeare_char_baby"]))
    m = c.model
    assert (m.n_layer, m.n_embd, m.n_head, m.block_size, m.dropout) == (6, 384, 6, 256, 0.2)
    assert c.expected["best_val_loss"] == pytest.approx(1.47)


def local_data(name: str, shakespeare: Path, tmp_path: Path):
    """Offline stand-ins: the recipes' Hugging Face corpora become a parquet file of Tiny
    Shakespeare (through the same hf source and cleaner), and BPE vocabularies shrink so training
    one takes seconds. The GPT-2 tokenizer needs a download, so those recipes use a small trained
    BPE here."""
    if compose_config([f"experiment={name}"]).data.name in ("gutenberg", "fineweb_edu"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        text = shakespeare.read_text()
        docs = [text[i : i + 20_000] for i in range(0, 400_000, 20_000)]
        pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet")
        return [
            f"data.path={tmp_path / 'docs.parquet'}",
            "data.tokenizer.kind=bpe",
            "data.tokenizer.vocab_size=300",
            "data.workers=0",
            "data.val_fraction=0.2",
            "data.progress=false",
        ]
    extra = [f"data.path={shakespeare}"]
    if compose_config([f"experiment={name}"]).model.init_from:  # GPT-2's weights: a download
        extra += ["model.init_from=null", "data.tokenizer.kind=char"]
    if name == "bpe_25m":
        extra += ["data.tokenizer.vocab_size=300", "data.workers=0", "data.progress=false"]
    return extra


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.integration
def test_recipe_runs_five_steps_on_the_cpu(name, shakespeare, tmp_path):
    from gptlab.train import run_training

    cfg = compose_config([f"experiment={name}", *SHRINK, *local_data(name, shakespeare, tmp_path)])
    results = run_training(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses, norms = [r["train_loss"] for r in rows], [r["grad_norm"] for r in rows]
    assert results["steps"] == 5 and len(losses) == 5
    # An untrained model's loss is ln(vocab); warmup's small lr keeps the five near it, and every
    # step moves the weights (no two losses equal). Under fp16 an unscaled (2^16 x) or skipped (inf)
    # gradient, or a loader that repeats its batch, leaves the gradient norms' band and fails here.
    ln_vocab = math.log(json.loads((tmp_path / "run" / "derived.json").read_text())["vocab_size"])
    assert abs(losses[0] - ln_vocab) < 0.03, (losses, ln_vocab)
    assert all(abs(x - ln_vocab) < 0.12 for x in losses), losses
    assert len(set(losses)) == 5, losses
    assert all(0.4 < g < 2.5 for g in norms), norms
