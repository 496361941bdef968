"""gptlab.metrics: analytic FLOPs against PyTorch's FLOP counter, MFU / HFU, peaks, expectations."""

import pytest
import torch
import torch.nn as nn
from conftest import model_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from gptlab import metrics
from gptlab.model import GPT


def counted_flops_per_token(model: GPT, B: int, T: int) -> float:
    """FLOPs of one forward + backward as FlopCounterMode counts them, per token.

    SDPA's math backend decomposes attention into the bmm's the counter knows (the CPU's fused
    kernel is not registered with it).
    """
    x = torch.randint(0, model.config.vocab_size, (B, T))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        _, loss = model(x, x)
        loss.backward()
    return counter.get_total_flops() / (B * T)


def analytic(model: GPT):
    c = model.config
    mm = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert mm == metrics.matmul_params(c.n_layer, c.n_embd, c.hidden_dim, c.padded_vocab_size, c.mlp == "swiglu")
    fpt = metrics.flops_per_token(c.n_layer, c.n_embd, c.block_size, mm)
    recomputed = metrics.recomputed_matmul_params(c.n_layer, c.n_embd, c.hidden_dim, c.mlp == "swiglu")
    extra = metrics.recompute_flops_per_token(c.n_layer, c.n_embd, c.block_size, recomputed)
    return fpt, extra


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=65),
        dict(n_layer=3, n_head=2, n_embd=48, block_size=32, vocab_size=100, vocab_multiple=64, mlp="swiglu"),
    ],
)
def test_flops_per_token_matches_flop_counter(kw):
    torch.manual_seed(0)
    model = GPT(model_config(**kw))
    fpt, recompute = analytic(model)
    counted = counted_flops_per_token(model, B=2, T=kw["block_size"])
    assert counted == pytest.approx(fpt, rel=0.05)
    model.activation_checkpointing = True  # HFU: checkpointing's second forward of every block
    counted_ckpt = counted_flops_per_token(model, B=2, T=kw["block_size"])
    assert counted_ckpt == pytest.approx(fpt + recompute, rel=0.05)
    print(
        f"flops/token analytic {fpt:,.0f} counted {counted:,.0f}; with recompute "
        f"{fpt + recompute:,.0f} counted {counted_ckpt:,.0f}"
    )


def test_mfu_and_hfu():
    assert metrics.mfu(1000.0, 6e6, 6e9) == pytest.approx(1.0)
    assert metrics.mfu(1000.0, 6e6, 0.0) == 0.0


def test_peak_per_precision():
    a100 = dict(half=312, tf32_tflops=156, fp32=19.5)
    assert metrics.peak_tflops_for("bf16", True, **a100) == 312
    assert metrics.peak_tflops_for("fp16", False, **a100) == 312
    assert metrics.peak_tflops_for("fp32", True, **a100) == 156
    assert metrics.peak_tflops_for("fp32", False, **a100) == 19.5
    assert metrics.peak_tflops_for("fp32", False, half=100, tf32_tflops=None, fp32=None) == 100  # one figure only
    assert metrics.peak_tflops_for("fp32", False, half=None, tf32_tflops=None, fp32=None) is None  # CPU: measure


def test_measured_cpu_peak_is_positive():
    assert metrics.measured_cpu_peak("float32", n=256, seconds=0.05) > 1e8


def test_rss_helpers():
    assert metrics.current_rss_bytes() > 0
    metrics.reset_peak_rss()
    assert metrics.peak_rss_bytes() >= metrics.current_rss_bytes() * 0.5
    assert metrics.machine_memory_bytes() > 2**30


def test_expectation_met():
    exp = {"best_val_loss": 1.47, "val_loss_tolerance": 0.03, "tokens_per_s": 1000, "source": "x"}
    assert metrics.expectation_met(exp, {"best_val_loss": 1.49, "tokens_per_s": 2000}) is True
    assert metrics.expectation_met(exp, {"best_val_loss": 1.55, "tokens_per_s": 2000}) is False
    assert metrics.expectation_met({"source": "x"}, {"best_val_loss": 1.0}) is None
