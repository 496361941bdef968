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
    assert not opt.defaults.get("fused")  # fused kernels only on CUDA by default
