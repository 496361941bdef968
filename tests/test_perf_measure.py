"""gptlab.perf.costs' FLOPs against PyTorch's FLOP counter and memory model; gptlab.perf.measure:
MFU, peaks."""

import mmap

import pytest
import torch
import torch.nn as nn
from helpers import model_config, typed
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from gptlab.model.gpt import GPT
from gptlab.perf import costs, measure


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
    assert mm == costs.matmul_params(
        c.n_layer, c.n_embd, c.hidden_dim, c.padded_vocab_size, c.mlp == "swiglu"
    )
    fpt = costs.flops_per_token(c.n_layer, c.n_embd, c.block_size, mm)
    recomputed = costs.recomputed_matmul_params(
        c.n_layer, c.n_embd, c.hidden_dim, c.mlp == "swiglu"
    )
    extra = costs.recompute_flops_per_token(c.n_layer, c.n_embd, c.block_size, recomputed)
    return fpt, extra


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=65),
        dict(
            n_layer=3,
            n_head=2,
            n_embd=48,
            block_size=32,
            vocab_size=100,
            vocab_multiple=64,
            mlp="swiglu",
        ),
    ],
)
@pytest.mark.integration
def test_flops_per_token_matches_flop_counter(kw):
    torch.manual_seed(0)
    model = GPT(model_config(**kw))
    fpt, recompute = analytic(model)
    counted = counted_flops_per_token(model, B=2, T=kw["block_size"])
    # exact: FlopCounterMode counted 713,088 and 589,824 per token, as the formula gives (torch
    # 2.13)
    assert counted == fpt
    model.activation_checkpointing = True  # HFU: checkpointing's second forward of every block
    counted_ckpt = counted_flops_per_token(model, B=2, T=kw["block_size"])
    assert counted_ckpt == fpt + recompute  # 876,928 and 737,280 counted
    print(
        f"flops/token analytic {fpt:,.0f} counted {counted:,.0f}; with recompute "
        f"{fpt + recompute:,.0f} counted {counted_ckpt:,.0f}"
    )


def test_mfu_and_hfu():
    assert measure.mfu(1000.0, 6e6, 6e9) == pytest.approx(1.0)
    assert measure.mfu(500.0, 6e6, 12e9) == pytest.approx(0.25)
    assert measure.mfu(1000.0, 6e6, 0.0) == 0.0 and measure.mfu(1000.0, 6e6, -1.0) == 0.0
    assert measure.mfu(0.5, 1.0, 1.0) == 0.5  # any positive peak is a peak, however small
    # HFU: the same rate over hardware FLOPs, which add checkpointing's second forward of the blocks
    n_layer, d, hidden, vocab, T = 2, 64, 256, 128, 64
    fpt = costs.flops_per_token(n_layer, d, T, costs.matmul_params(n_layer, d, hidden, vocab))
    recompute = costs.recompute_flops_per_token(
        n_layer, d, T, costs.recomputed_matmul_params(n_layer, d, hidden)
    )
    assert fpt == 3 * (2 * (2 * (4 * d * d + 2 * d * hidden) + vocab * d) + 4 * n_layer * T * d)
    assert recompute == 2 * 2 * (4 * d * d + d * hidden) + 4 * n_layer * T * d
    mfu, hfu = measure.mfu(1000.0, fpt, 1e9), measure.mfu(1000.0, fpt + recompute, 1e9)
    assert hfu == pytest.approx(mfu * (fpt + recompute) / fpt) and hfu > mfu
    swiglu = costs.recomputed_matmul_params(n_layer, d, hidden, swiglu=True)
    assert swiglu == n_layer * (4 * d * d + 2 * d * hidden)
    swiglu_mm = costs.matmul_params(n_layer, d, hidden, vocab, swiglu=True)
    assert swiglu_mm == n_layer * (4 * d * d + 3 * d * hidden) + vocab * d


def test_peak_per_precision():
    a100 = dict(half=312, tf32_tflops=156, fp32=19.5)
    assert costs.peak_tflops_for("bf16", True, **a100) == 312
    assert costs.peak_tflops_for("fp16", False, **a100) == 312
    assert costs.peak_tflops_for("fp32", True, **a100) == 156
    assert costs.peak_tflops_for("fp32", False, **a100) == 19.5
    # one figure only
    assert costs.peak_tflops_for("fp32", False, half=100, tf32_tflops=None, fp32=None) == 100
    # CPU: measure
    assert costs.peak_tflops_for("fp32", False, half=None, tf32_tflops=None, fp32=None) is None


def test_measured_cpu_peak_is_positive():
    assert measure.measured_cpu_peak("float32", n=256, seconds=0.05) > 1e8


def test_measured_cpu_peak_is_the_best_trials_rate(monkeypatch):
    """On a clock that ticks 1/1024 s per reading, each trial of 10/1024 s runs 9 matmuls; a last
    trial whose clock runs slow (the neighbours' load) does not lower the best."""

    def readings():
        for trial in range(4):  # 9 matmuls in each trial's 10 ticks
            start = trial * 10 / 1024
            yield start
            yield from (start + k / 1024 for k in range(1, 11))
        yield 40 / 1024  # the last trial: a clock at half the rate, so 4 matmuls in its 10 ticks
        yield from (40 / 1024 + 2 * k / 1024 for k in range(1, 6))

    clock = readings()
    perf_counter = lambda: next(clock)  # noqa: E731
    monkeypatch.setattr(measure.time, "perf_counter", perf_counter)
    n = 8
    rate = measure.measured_cpu_peak.__wrapped__("float32", n=n, seconds=5 * 10 / 1024, trials=5)
    assert rate == 2 * n**3 * 9 / (10 / 1024)


def test_a_slow_dtypes_peak_is_measured_on_a_product_that_fits_the_time(monkeypatch):
    """One probe product of 128 sizes the measured one: a CPU that multiplies a dtype at 42 MFLOP/s
    (bf16 without bf16 units is of that order) is measured at 128, a fast one at the full 1024."""
    sizes = []
    monkeypatch.setattr(measure, "best_matmul_rate", lambda a, *args, **kw: sizes.append(a.shape))
    for tick, n in ((0.1, 128), (1e-6, 1024)):  # the probe's time: 2 x 128^3 flops in one tick
        readings = iter([0.0, tick])
        monkeypatch.setattr(measure.time, "perf_counter", readings.__next__)
        measure.measured_cpu_peak.__wrapped__("bfloat16", seconds=0.3)
        assert sizes.pop() == (n, n)


def test_rss_helpers():
    assert measure.current_rss_bytes() > 0
    assert measure.reset_peak_rss()
    before = measure.current_rss_bytes()
    # 64 MiB of fresh pages, every one touched: an anonymous map, so no free memory the allocator
    # kept resident (gptlab.perf.runtime.keep_freed_memory in an earlier test) can serve it
    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"x" * len(block))
    assert measure.current_rss_bytes() >= before + 60 * 2**20
    block.close()
    assert measure.peak_rss_bytes() >= before + 60 * 2**20  # the peak remembers what was freed
    assert measure.peak_rss_bytes() >= measure.current_rss_bytes()
    assert measure.machine_memory_bytes() > 2**30


def test_cpu_peak_bytes_counts_what_fn_holds_at_once():
    def step():
        a = torch.ones(2**20)  # 4 MiB
        b = torch.ones(2**20)  # 8 MiB held together
        del a, b
        c = torch.ones(2**19)  # then 2 MiB
        del c

    assert measure.cpu_peak_bytes(step) == 8 * 2**20


def test_expectation_met():
    exp = {"best_val_loss": 1.47, "val_loss_tolerance": 0.03, "tokens_per_s": 1000, "source": "x"}
    assert measure.expectation_met(exp, {"best_val_loss": 1.49, "tokens_per_s": 2000}) is True
    assert measure.expectation_met(exp, {"best_val_loss": 1.55, "tokens_per_s": 2000}) is False
    assert measure.expectation_met({"source": "x"}, {"best_val_loss": 1.0}) is None
    # both at the edge
    assert measure.expectation_met(exp, {"best_val_loss": 1.50, "tokens_per_s": 1000}) is True
    # too slow
    assert measure.expectation_met(exp, {"best_val_loss": 1.49, "tokens_per_s": 999}) is False
    # the default tolerance: 0.05
    assert measure.expectation_met({"val_loss": 2.0}, {"val_loss": 2.05}) is True
    assert measure.expectation_met({"val_loss": 2.0}, {"val_loss": 2.06}) is False
    assert measure.expectation_met({"val_loss": 2.0, "tokens_per_s": 5}, {"val_loss": 1.0}) is True


def _shape(**kw) -> costs.Shape:
    base = dict(n_layer=3, n_embd=32, n_head=4, hidden=128, vocab=96, block_size=16, params=50_000,
                matmul_params=40_000)  # fmt: skip
    return costs.Shape(**{**base, **kw})


def test_memory_estimate_counts_ids_targets_and_the_embedding_dropout_mask_per_token():
    """Per token: int64 ids and targets (16 bytes), and with dropout the embedding's mask, one byte
    per channel on CUDA (bool) and the fp32 embedding's 4 on the CPU; each block adds two residual
    masks."""
    d, L, tokens = 32, 3, 2 * 16
    # chunked loss: the head keeps 8 bytes per channel and token, plus the head weight's fp32
    # gradient
    s = _shape(loss_chunk=8, device="cpu")
    per_layer = costs.activation_bytes_per_layer_token(s, checkpointing=False)
    got = costs.memory_estimate(s, micro_batch=2, checkpointing=False)["activations"]
    assert got == tokens * (L * per_layer + 16 + 8 * d) + 4 * 96 * d
    for device, mask in (("cpu", 4), ("cuda", 1)):
        without = costs.memory_estimate(_shape(device=device), micro_batch=2, checkpointing=False)
        with_dropout = costs.memory_estimate(
            _shape(device=device, dropout=0.1), micro_batch=2, checkpointing=False
        )
        assert (
            with_dropout["activations"] - without["activations"] == tokens * (2 * L + 1) * mask * d
        ), device


def test_rss_readings_are_whole_pages_in_bytes_and_agree_with_psutil():
    import psutil

    rss, peak = measure.current_rss_bytes(), measure.peak_rss_bytes()
    assert rss % 4096 == 0 and peak % 4096 == 0  # /proc reports kB of 4 KiB pages
    assert rss == pytest.approx(psutil.Process().memory_info().rss, rel=0.01)
    assert peak >= rss


def test_peak_rss_falls_back_to_getrusage_without_proc(monkeypatch):
    import resource

    monkeypatch.setattr(measure, "_proc_status_kb", lambda key: 0)
    # Linux: kB
    assert measure.peak_rss_bytes() == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_memory_helpers_say_unavailable_when_the_os_refuses(monkeypatch):
    assert measure._proc_status_kb("NoSuchKey") == 0

    def refuse(*args, **kwargs):
        raise OSError("not here")

    monkeypatch.setattr(measure, "open", refuse, raising=False)  # shadows the builtin in the module
    assert measure.reset_peak_rss() is False
    assert measure._proc_status_kb("VmRSS") == 0

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(measure.os, "sysconf", no_sysconf)
    assert measure.machine_memory_bytes() == 0


def test_expectation_met_reads_the_recipes_own_tolerance():
    exp = {"val_loss": 2.0, "val_loss_tolerance": 0.0}
    assert measure.expectation_met(exp, {"val_loss": 2.0}) is True
    # within the default 0.05, not within 0
    assert measure.expectation_met(exp, {"val_loss": 2.01}) is False


def test_peak_rss_follows_the_kernels_mark_after_a_reset():
    """reset_peak_rss moves the kernel's mark down to the current RSS: a peak freed before it is
    forgotten (what lets gptlab.bench report the timed steps' peak rather than the start-up's)."""
    block = torch.ones(256 * 2**20 // 4)  # 256 MiB, its own mapping (above malloc's mmap threshold)
    high = measure.peak_rss_bytes()
    del block
    assert measure.reset_peak_rss()
    assert measure.peak_rss_bytes() < high - 128 * 2**20


def test_memory_estimate_static_parts_by_world_and_precision():
    """DDP's buckets (a second fp32 gradient) from 2 processes on; autocast's half-precision copies
    of the matmul weights only below fp32; the unchunked head keeps its input and fp32
    log-softmax."""
    est = lambda **kw: costs.memory_estimate(_shape(**kw), micro_batch=2, checkpointing=False)  # noqa: E731
    one, two = est(), est(world_size=2)
    assert one["ddp"] == 0.0 and two["ddp"] == 4.0 * 50_000
    assert one["autocast"] == 0.0 and est(precision="bf16")["autocast"] == 2.0 * 40_000
    assert est(world_size=2, sharded=True, shards=2)["ddp"] == 0.0
    per_layer = costs.activation_bytes_per_layer_token(_shape(), checkpointing=False)
    assert one["activations"] == 2 * 16 * (3 * per_layer + 16 + 4 * 32 + 4 * 32 + 4 * 96)


def test_memory_estimate_transient_logits_whole_and_chunked():
    """The LM head's transient: whole logits, their log-softmax's and their own gradients (compute
    dtype + 4 + 4 bytes a logit); chunked, one chunk's fp32 logits beside a half-precision copy."""
    est = lambda **kw: costs.memory_estimate(_shape(**kw), micro_batch=2, checkpointing=False)  # noqa: E731
    tokens, vocab = 2 * 16, 96
    assert est()["transient"] == tokens * 12 * vocab
    assert est(precision="bf16")["transient"] == tokens * 10 * vocab
    assert est(loss_chunk=8)["transient"] == 8 * 4 * vocab
    assert est(loss_chunk=8, precision="bf16")["transient"] == 8 * 6 * vocab
    # a chunk longer than the micro-batch
    assert est(loss_chunk=1000)["transient"] == tokens * 4 * vocab


def test_memory_estimate_sharded_parts_exactly():
    """fsdp on 2 ranks, 3 blocks of 10,000 parameters and a root of 20,000: the root plus two blocks
    gathered (every block with reshard off), in the compute dtype; the root's whole gradient in the
    compute dtype and fp32, plus the block gradients not yet reduce-scattered (gloo on the CPU keeps
    every block's, CUDA about two); nothing of this unsharded."""
    root, layer = 20_000, 10_000
    s = lambda **kw: _shape(sharded=True, shards=2, world_size=2, layer_params=layer, **kw)  # noqa: E731
    assert costs._sharded_parts(s(device="cpu"), 4) == {
        "gathered": 4.0 * (root + 2 * layer),
        "grads_in_flight": 8.0 * root + 4.0 * 3 * layer,
    }
    assert costs._sharded_parts(s(device="cuda"), 2) == {
        "gathered": 2.0 * (root + 2 * layer),
        "grads_in_flight": 6.0 * root + 4.0 * 2 * layer,
    }
    assert costs._sharded_parts(s(device="cuda", reshard=False), 2)["gathered"] == 2.0 * (
        root + 3 * layer
    )
    assert costs._sharded_parts(_shape(), 4) == {"gathered": 0.0, "grads_in_flight": 0.0}
    # the static parts are halved, the gathered weights and gradients in flight added
    est = costs.memory_estimate(s(device="cpu"), micro_batch=2, checkpointing=False)
    assert (est["weights"], est["optimizer"], est["ddp"]) == (2.0 * 50_000, 4.0 * 50_000, 0.0)
    assert est["grads"] == 2.0 * 50_000 + 8.0 * root + 4.0 * 3 * layer
    assert est["gathered"] == 4.0 * (root + 2 * layer)
    assert costs.memory_estimate(_shape(), micro_batch=2, checkpointing=False)["gathered"] == 0.0


def test_memory_estimate_peak_is_the_largest_of_the_step_moments():
    """The total is the static parts plus the largest moment: the start of backward (logits dominate
    a large vocabulary), or, sharded, the first block's backward (gathered weights, activations and
    gradients at once); unsharded with checkpointing, the end of backward (every gradient and one
    recomputed block)."""
    layer = 10_000
    sharded = dict(sharded=True, shards=2, world_size=2, layer_params=layer, device="cpu")
    for kw, checkpointing, moment in (
        (dict(vocab=50_000), False, "start"),
        (dict(vocab=50_000, **sharded), False, "start"),
        (sharded, True, "in_backward"),
        (dict(params=5_000_000), True, "end"),
        (dict(params=5_000_000), False, "end"),  # every gradient, nothing recomputed
    ):
        e = costs.memory_estimate(_shape(**kw), micro_batch=2, checkpointing=checkpointing)
        recompute = (
            2 * 16 * costs.activation_bytes_per_layer_token(_shape(**kw), False)
            if checkpointing
            else 0
        )
        moments = {
            "start": e["autocast"] + e["gathered"] + e["activations"] + e["transient"],
            "end": e["grads"] + recompute,
            "in_backward": e["gathered"] + e["activations"] + e["grads"] + recompute
            if "sharded" in kw
            else 0.0,
        }
        assert max(moments, key=moments.get) == moment, (kw, moments)
        assert e["total"] == e["weights"] + e["optimizer"] + e["ddp"] + moments[moment], kw


def test_activation_bytes_per_layer_token_for_swiglu_and_unfused_attention():
    """Per token and block (d=32, h=128, 4 heads, T=16, fp32): SwiGLU keeps gate, up and product
    (3c*h); attention without a fused kernel keeps the T x T probabilities per head, and with
    dropout their mask (a byte on CUDA, the dtype's size on the CPU) and the dropped copy;
    checkpointing keeps the input."""
    d, h, c, heads, T = 32, 128, 4, 4, 16
    per = lambda **kw: costs.activation_bytes_per_layer_token(_shape(**kw), checkpointing=False)  # noqa: E731
    base = 8 * d + 6 * c * d
    assert per() == base + 2 * c * h
    assert per(swiglu=True) == base + 3 * c * h
    assert per(flash=False) == base + 2 * c * h + heads * T * c
    for device, mask in (("cuda", 1), ("cpu", 4)):
        assert per(
            flash=False, dropout=0.1, device=device
        ) == base + 2 * c * h + 2 * mask * d + heads * T * (c + mask + c), device
    assert (
        costs.activation_bytes_per_layer_token(_shape(swiglu=True, flash=False), checkpointing=True)
        == 4 * d
    )


@pytest.fixture
def visible_gpu(monkeypatch):
    """A GPU called `name` is visible (what device_peak asks of torch.cuda)."""

    def show(name):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: name)

    return show


@pytest.mark.parametrize(
    "name,precision,tf32,tflops",
    [
        ("NVIDIA H200", "bf16", True, 989.0),
        ("NVIDIA H100 PCIe", "bf16", True, 756.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", True, 156.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", False, 19.5),
        ("Tesla T4", "fp16", False, 65.0),
    ],
)
def test_a_gpu_preset_without_figures_takes_the_visible_gpus_peak(
    visible_gpu, name, precision, tf32, tflops
):
    """hardware=gpu names no peak: MFU is against the visible GPU's datasheet figure, not 0."""
    visible_gpu(name)
    hw = typed("hardware", "hardware=gpu", precision=precision, tf32=tf32)
    peak, source = costs.device_peak(hw)
    assert peak == tflops * 1e12 and name in source


def test_an_unknown_gpus_peak_is_measured(visible_gpu, monkeypatch):
    visible_gpu("Some Future GPU")
    monkeypatch.setattr(costs, "measured_gpu_peak", lambda dtype: {"bfloat16": 5e14}[dtype])
    peak, source = costs.device_peak(typed("hardware", "hardware=gpu", precision="bf16"))
    assert peak == 5e14 and source == "measured on Some Future GPU"


def test_a_gpu_preset_planned_without_a_gpu_has_no_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hw = typed("hardware", "hardware=gpu", precision="bf16")
    assert costs.device_peak(hw) == (0.0, "unknown")
