"""Every option of every group composes, validates and builds; bad config stops with one line."""

from pathlib import Path

import pytest
import torch
from helpers import CONF, compose_config, run_cli

from gptlab.config import Config, to_config
from gptlab.errors import GptlabError
from gptlab.model.gpt import GPT

GROUPS = ["model", "data", "optimizer", "parallelism", "hardware"]
EXPECTED = {
    "model": {"gpt_nano", "gpt_char", "gpt2_124m", "gpt2_350m", "gpt2_774m", "gpt2_1558m", "gpt1b"},
    "data": {"shakespeare_char"},
    "optimizer": {"adamw"},
    "parallelism": {"single", "ddp"},
    "hardware": {"cpu", "cpu_x2", "gpu", "a100x8", "h100x8", "h200"},
}


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_group_has_the_promised_choices(group):
    assert EXPECTED[group] <= set(options(group))


def test_defaults_compose_to_the_cpu_char_model():
    c = to_config(compose_config([]))
    assert isinstance(c, Config)
    assert (c.model.name, c.data.name, c.optimizer.name, c.parallelism.name, c.hardware.name) == (
        "gpt_char",
        "shakespeare_char",
        "muon",
        "single",
        "cpu",
    )


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
@pytest.mark.integration
def test_every_option_composes_validates_and_builds(group, option):
    c = to_config(compose_config([f"{group}={option}"]))
    assert getattr(c, group).name == option
    if group == "model":
        import dataclasses

        with torch.device("meta"):  # the 1.5B model is built without allocating memory
            model = GPT(dataclasses.replace(c.model, vocab_size=65))
        assert model.num_params() > 0


def test_gpt1b_is_the_reference_architecture():
    m = to_config(compose_config(["model=gpt1b"])).model
    assert (m.n_layer, m.n_embd, m.n_head, m.ffn_dim, m.block_size, m.dropout) == (
        20,
        2048,
        16,
        8192,
        2048,
        0.1,
    )
    assert m.n_embd // m.n_head == 128 and m.tie_weights and m.pos_emb == "learned"


@pytest.mark.integration
def test_derived_batch_split():
    c = to_config(compose_config(["train.batch_size=32", "train.micro_batch_size=8"]))
    assert (c.micro_batch_size, c.accum_steps) == (8, 4)
    c = to_config(compose_config(["train.batch_size=64", "hardware=a100x8"]))
    assert (c.world_size, c.micro_batch_size, c.accum_steps) == (8, 4, 2)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.n_embd=100", "model.n_head=3"], "model.n_embd"),
        (["optimizer.lr=0"], "optimizer.lr"),
        (["optimizer.lr=-1e-3"], "optimizer.lr"),
        (["train.micro_batch_size=5"], "train.micro_batch_size"),
        (
            ["train.batch_size=30", "hardware=cpu_x2", "train.micro_batch_size=4"],
            "train.micro_batch_size",
        ),
        (["hardware.precision=fp8"], "hardware.precision"),
        (["model.pos_emb=alibi"], "model.pos_emb"),
        (["model.dropout=1.5"], "model.dropout"),
        (["+model.foo=1"], "model.foo"),
        (["+train.max_step=10"], "train.max_step"),
        (["train.on_divergence=skip"], "train.on_divergence"),
        (["train.spike_factor=0.5"], "train.spike_factor"),  # most steps would be spikes
        (["train.max_rollbacks=-1"], "train.max_rollbacks"),
        # flash takes only half precision: an fp32 run would fail at its first forward on a GPU
        (
            ["hardware=a100x8", "hardware.attention_backend=flash", "hardware.precision=fp32"],
            "hardware.attention_backend",
        ),  # fmt: skip
    ],
)
def test_impossible_configs_name_the_key(overrides, key):
    with pytest.raises(GptlabError) as e:
        to_config(compose_config(overrides))
    msg = str(e.value)
    assert key in msg and "\n" not in msg


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,fragment",
    [
        ("model.n_layer=abc", "model.n_layer"),
        ("model.foo=1", "model.foo"),
        ("+model.foo=1", "model.foo"),
        ("model=gpt_giant", "gpt_char"),  # the error lists the available options
        ("optimizer.lr=0", "optimizer.lr"),
        # a data.path that is not there: in test_cli.py's
        # test_a_start_that_fails_before_training_leaves_no_run_folder
        ("model.block_size=2000000", "model.block_size"),
    ],
)
def test_bad_overrides_give_one_line_and_no_traceback(tmp_path, shakespeare, override, fragment):
    # data.progress=false: a first preparation's progress bar (stderr) is not part of the error
    args = [
        "gptlab.train",
        f"data.path={shakespeare}",
        "tracking.mlflow=false",
        "data.progress=false",
        override,
    ]
    r = run_cli(args, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gptlab.train: error:") and fragment in lines[0]
    assert "Traceback" not in r.stderr
    # nothing was trained: no checkpoint, no results
    assert not list(Path(tmp_path).rglob("results.json")) and not list(Path(tmp_path).rglob("*.pt"))


@pytest.mark.parametrize("preset", ["gpu", "a100x8", "h100x8", "h200"])
def test_every_gpu_preset_trains_in_fp32_too(preset):
    """No preset forces a half-precision-only kernel: hardware.precision=fp32 validates."""
    c = to_config(compose_config([f"hardware={preset}", "hardware.precision=fp32"]))
    assert c.hardware.attention_backend != "flash"


def test_flash_with_precision_auto_choosing_fp32_is_refused_in_one_line(monkeypatch):
    """A GPU without bf16 tensor cores: auto picks fp32, which flash cannot run."""
    from gptlab.perf import costs, fastpath

    monkeypatch.setattr(fastpath, "gpu_capability", lambda: (7, 0))
    c = to_config(compose_config(["hardware=a100x8", "hardware.attention_backend=flash"]))
    with pytest.raises(GptlabError, match="attention_backend=flash.*sm_70") as e:
        costs.resolve_auto(c)
    assert "\n" not in str(e.value)
