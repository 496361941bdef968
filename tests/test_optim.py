import math

import pytest
from conftest import model_config, typed

from gptlab.model import GPT
from gptlab.optim import build_optimizer, lr_at, scaled_lr


def OptimizerConfig(**changes):  # noqa: N802 - conf/optimizer/adamw.yaml with fields changed
    return typed("optimizer", **changes)


def test_warmup_then_cosine_to_floor():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 1e-3, cfg, 110) for s in range(111)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # warmup rises
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then decays
    assert lrs[60] == pytest.approx(0.55e-3)  # half way: mid point of peak and floor
    assert lrs[110] == pytest.approx(1e-4)
    assert lr_at(10_000, 1e-3, cfg, 110) == pytest.approx(1e-4)  # stays at the floor


def test_lr_scaling_rules():
    assert scaled_lr(OptimizerConfig(lr=1e-3, lr_scaling="sqrt"), 8) == pytest.approx(1e-3 * math.sqrt(8))
    assert scaled_lr(OptimizerConfig(lr=1e-3, lr_scaling="linear"), 8) == pytest.approx(8e-3)
    assert scaled_lr(OptimizerConfig(lr=1e-3), 8) == pytest.approx(1e-3)


def test_weight_decay_only_on_matrices():
    model = GPT(model_config(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8))
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), 1e-3, "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == model.num_params()
    assert opt.defaults.get("fused")  # the CPU has a fused AdamW too, 4x faster than for-each here
    slow = build_optimizer(model, OptimizerConfig(weight_decay=0.1, fused=False), 1e-3, "cpu")
    assert not slow.defaults.get("fused")  # optimizer.fused=false chooses for-each


def test_warmup_peaks_exactly_at_the_peak_and_never_above():
    """The last warmup step and the first decay step are both the peak; nothing is above it."""
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 1e-3, cfg, 110) for s in range(111)]
    assert lrs[9] == lrs[10] == 1e-3 and max(lrs) == 1e-3
    assert lrs[:10] == pytest.approx([1e-4 * (s + 1) for s in range(10)])  # linear from peak / warmup
    assert min(lrs) == pytest.approx(1e-4)
    no_warmup = OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=0.1)
    assert lr_at(0, 1e-3, no_warmup, 100) == 1e-3  # no warmup: the peak from the first step
    one_step = OptimizerConfig(lr=1e-3, warmup_steps=1, min_lr_ratio=0.1)
    assert lr_at(0, 1e-3, one_step, 100) == lr_at(1, 1e-3, one_step, 100) == 1e-3


@pytest.mark.parametrize("schedule", ["linear", "constant"])
def test_linear_and_constant_schedules_and_decay_steps(schedule):
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule, decay_steps=50)
    lrs = [lr_at(s, 1e-3, cfg, 110) for s in range(111)]
    assert lrs[9] == lrs[10] == 1e-3 and max(lrs) == 1e-3
    if schedule == "constant":
        assert set(lrs[10:]) == {1e-3}
    else:
        assert lrs[30] == pytest.approx(0.55e-3)  # half way from step 10 to decay_steps = 50
        assert lrs[50] == pytest.approx(1e-4) and lrs[110] == pytest.approx(1e-4)  # the floor after decay_steps
        assert all(a - b == pytest.approx(0.9e-3 / 40) for a, b in zip(lrs[10:50], lrs[11:51]))  # a straight line
    # decay no longer than the warmup: the peak ever after
    short = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule, decay_steps=10)
    assert lr_at(40, 1e-3, short, 110) == 1e-3


def test_cosine_decays_over_decay_steps_when_given():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=0.0, decay_steps=20)
    assert lr_at(10, 1e-3, cfg, 1000) == pytest.approx(0.5e-3)
    assert lr_at(20, 1e-3, cfg, 1000) == pytest.approx(0.0, abs=1e-12)


def test_adamw_takes_the_configured_hyperparameters():
    model = GPT(model_config(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8))
    cfg = OptimizerConfig(betas=[0.8, 0.9], eps=1e-6, fused=False)
    opt = build_optimizer(model, cfg, 3e-4, "cuda")  # fused=false wins over the device's default
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-6 and opt.defaults["lr"] == 3e-4
    assert not opt.defaults["fused"]
    frozen = GPT(model_config(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8))
    frozen.wpe.weight.requires_grad_(False)
    opt = build_optimizer(frozen, OptimizerConfig(), 1e-3, "cpu")
    assert all(p is not frozen.wpe.weight for g in opt.param_groups for p in g["params"])
