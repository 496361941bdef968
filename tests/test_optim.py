import copy
import math

import pytest
import torch
from helpers import compose_config, model_config, nano_overrides, typed

from gptlab.config import to_config
from gptlab.errors import GptlabError
from gptlab.model.gpt import GPT
from gptlab.optim import OPTIMIZERS
from gptlab.optim.average import averaged_weights, load_average
from gptlab.optim.factory import build_optimizer
from gptlab.optim.muon import Muon, fast_bf16, muon_owners, ns_dtype, ns_flops, orthogonalize
from gptlab.optim.schedule import lr_at, scaled_lr


def OptimizerConfig(**changes):  # noqa: N802 - conf/optimizer/adamw.yaml with fields changed
    return typed("optimizer", "optimizer=adamw", **changes)


def test_warmup_then_cosine_to_floor():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 1e-3, cfg, 110) for s in range(111)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # warmup rises
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then decays
    assert lrs[60] == pytest.approx(0.55e-3)  # half way: mid point of peak and floor
    assert lrs[110] == pytest.approx(1e-4)
    assert lr_at(10_000, 1e-3, cfg, 110) == pytest.approx(1e-4)  # stays at the floor


@pytest.mark.integration
def test_lr_scaling_rules():
    assert scaled_lr(OptimizerConfig(lr=1e-3, lr_scaling="sqrt"), 8) == pytest.approx(
        1e-3 * math.sqrt(8)
    )
    assert scaled_lr(OptimizerConfig(lr=1e-3, lr_scaling="linear"), 8) == pytest.approx(8e-3)
    assert scaled_lr(OptimizerConfig(lr=1e-3), 8) == pytest.approx(1e-3)


@pytest.mark.integration
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


@pytest.mark.integration
def test_warmup_peaks_exactly_at_the_peak_and_never_above():
    """The last warmup step and the first decay step are both the peak; nothing is above it."""
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 1e-3, cfg, 110) for s in range(111)]
    assert lrs[9] == lrs[10] == 1e-3 and max(lrs) == 1e-3
    # linear from peak / warmup
    assert lrs[:10] == pytest.approx([1e-4 * (s + 1) for s in range(10)])
    assert min(lrs) == pytest.approx(1e-4)
    no_warmup = OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=0.1)
    assert lr_at(0, 1e-3, no_warmup, 100) == 1e-3  # no warmup: the peak from the first step
    one_step = OptimizerConfig(lr=1e-3, warmup_steps=1, min_lr_ratio=0.1)
    assert lr_at(0, 1e-3, one_step, 100) == lr_at(1, 1e-3, one_step, 100) == 1e-3


@pytest.mark.parametrize("schedule", ["linear", "constant"])
@pytest.mark.integration
def test_linear_and_constant_schedules_and_decay_steps(schedule):
    cfg = OptimizerConfig(
        lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule, decay_steps=50
    )
    lrs = [lr_at(s, 1e-3, cfg, 110) for s in range(111)]
    assert lrs[9] == lrs[10] == 1e-3 and max(lrs) == 1e-3
    if schedule == "constant":
        assert set(lrs[10:]) == {1e-3}
    else:
        assert lrs[30] == pytest.approx(0.55e-3)  # half way from step 10 to decay_steps = 50
        # the floor after decay_steps
        assert lrs[50] == pytest.approx(1e-4) and lrs[110] == pytest.approx(1e-4)
        # a straight line
        assert all(a - b == pytest.approx(0.9e-3 / 40) for a, b in zip(lrs[10:50], lrs[11:51]))
    # decay no longer than the warmup: the peak ever after
    short = OptimizerConfig(
        lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule, decay_steps=10
    )
    assert lr_at(40, 1e-3, short, 110) == 1e-3


def test_cosine_decays_over_decay_steps_when_given():
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=0.0, decay_steps=20)
    assert lr_at(10, 1e-3, cfg, 1000) == pytest.approx(0.5e-3)
    assert lr_at(20, 1e-3, cfg, 1000) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.integration
def test_adamw_takes_the_configured_hyperparameters():
    model = GPT(model_config(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8))
    cfg = OptimizerConfig(betas=[0.8, 0.9], eps=1e-6, fused=False)
    opt = build_optimizer(model, cfg, 3e-4, "cuda")  # fused=false wins over the device's default
    assert (
        opt.defaults["betas"] == (0.8, 0.9)
        and opt.defaults["eps"] == 1e-6
        and opt.defaults["lr"] == 3e-4
    )
    assert not opt.defaults["fused"]
    frozen = GPT(model_config(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8))
    frozen.wpe.weight.requires_grad_(False)
    opt = build_optimizer(frozen, OptimizerConfig(), 1e-3, "cpu")
    assert all(p is not frozen.wpe.weight for g in opt.param_groups for p in g["params"])


@pytest.mark.integration
def test_orthogonalize_pushes_every_singular_value_near_one():
    """Newton-Schulz on a stack of gradient-like matrices (singular values spread 10x), fp32 and
    bf16: every singular value lands in [0.68, 1.14] (measured, both dtypes)."""
    torch.manual_seed(0)
    g = torch.randn(3, 64, 200) * torch.linspace(0.1, 1, 64)[:, None]
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 10
    for dtype in (torch.float32, torch.bfloat16):
        s = torch.linalg.svdvals(orthogonalize(g.to(dtype), 5).float())
        assert s.min() > 0.6 and s.max() < 1.2, (dtype, s.min(), s.max())
    # each matrix is scaled to unit norm first, so the result does not depend on the gradient's
    # scale
    assert torch.allclose(orthogonalize(g * 1e-3, 5), orthogonalize(g, 5), atol=1e-5)
    # no NaN from a zero gradient
    assert torch.equal(orthogonalize(torch.zeros(2, 3), 5), torch.zeros(2, 3))
    one = orthogonalize(g[0], 5)  # a single matrix is one stack of one
    assert one.shape == (64, 200) and torch.allclose(one, orthogonalize(g[:1], 5)[0])


def muon_model():
    return GPT(model_config(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8))


@pytest.mark.integration
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = muon_model()
    opt = build_optimizer(model, OptimizerConfig(name="muon", weight_decay=0.1), 1e-3, "cpu")
    assert isinstance(opt, Muon)
    muon, embeddings, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert muon["muon"] and sorted(names[id(p)] for p in muon["params"]) == sorted(
        n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("h.")
    )
    assert not embeddings["muon"] and {names[id(p)] for p in embeddings["params"]} == {
        "wte.weight",
        "wpe.weight",
    }
    assert embeddings["weight_decay"] == muon["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()
    assert opt.defaults["fused"]  # the AdamW groups: the same fused-kernel rule as optimizer=adamw
    unfused = build_optimizer(model, OptimizerConfig(name="muon", fused=False), 1e-3, "cpu")
    assert not unfused.defaults["fused"]


@pytest.mark.parametrize(
    "avx512_bf16, amx, native", [(False, False, False), (True, False, True), (False, True, True)]
)
def test_fast_bf16_is_cuda_and_cpus_with_native_bf16(monkeypatch, avx512_bf16, amx, native):
    """A CPU has native bf16 with AVX-512-BF16 or AMX; oneDNN's emulation on other AVX-512 CPUs is
    slower than fp32, so it does not count."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert fast_bf16(torch.device("cpu")) is native
    assert fast_bf16(torch.device("cuda")) is True
    assert fast_bf16(torch.device("meta")) is False


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.integration
def test_muon_ns_dtype_auto_follows_native_bf16_and_an_explicit_choice_wins(monkeypatch, native):
    monkeypatch.setattr("gptlab.optim.muon.fast_bf16", lambda device: native)
    cpu = torch.device("cpu")
    assert ns_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert ns_dtype("fp32", cpu) == torch.float32 and ns_dtype("bf16", cpu) == torch.bfloat16
    model = GPT(model_config(vocab_size=65))
    opt = build_optimizer(model, OptimizerConfig(name="muon", muon_ns_dtype="fp32"), 1e-3, "cpu")
    assert opt.ns_dtype == "fp32"
    with pytest.raises(GptlabError, match="optimizer.muon_ns_dtype"):
        to_config(compose_config(["optimizer=muon", "optimizer.muon_ns_dtype=fp16"]))


@pytest.mark.integration
def test_muon_adamw_groups_take_torch_fused_adamw_steps_bitwise():
    torch.manual_seed(0)
    mine = [torch.randn(64, 64, requires_grad=True) for _ in range(2)]
    ref = [p.detach().clone().requires_grad_() for p in mine]
    other = [p.detach().clone().requires_grad_() for p in mine]
    opt = Muon(
        [{"params": mine, "weight_decay": 0.1, "muon": False}],
        1e-2,
        (0.9, 0.95),
        1e-8,
        0.95,
        5,
        True,
    )
    unfused = Muon(
        [{"params": other, "weight_decay": 0.1, "muon": False}],
        1e-2,
        (0.9, 0.95),
        1e-8,
        0.95,
        5,
        False,
    )
    fused = torch.optim.AdamW(
        ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )
    for _ in range(20):
        grads = [torch.randn(64, 64) for _ in mine]
        for ps in (mine, ref, other):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        opt.step()
        fused.step()
        unfused.step()
    # the fused kernel, bitwise; the for-each one ends 1.5e-8 to 3e-8 away here (measured)
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    assert not all(torch.equal(a, b) for a, b in zip(other, ref))  # fused=False: the other kernel
    assert all(
        int(opt.state[p]["step"]) == 20 and opt.state[p]["step"].dtype == torch.float32
        for p in mine
    )


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-newton-schulz", "fp32-newton-schulz"])
@pytest.mark.integration
def test_muon_steps_match_the_method_and_adamw_groups_match_torch_adamw(bf16, monkeypatch):
    """Three steps by hand: Nesterov momentum, Newton-Schulz, 0.2 sqrt(max dim) scale, decoupled
    decay; the AdamW groups equal torch.optim.AdamW's steps to rounding. Both Newton-Schulz
    precisions."""
    monkeypatch.setattr("gptlab.optim.muon.fast_bf16", lambda device: bf16)
    cfg = OptimizerConfig(name="muon", weight_decay=0.1, betas=[0.9, 0.95], muon_momentum=0.9)
    model, ref = muon_model(), muon_model()
    ref.load_state_dict(model.state_dict())
    opt = build_optimizer(model, cfg, 1e-2, "cpu")
    muon_ids = {id(p) for p in opt.param_groups[0]["params"]}
    names = [n for n, p in model.named_parameters() if id(p) in muon_ids]
    ref_adam = torch.optim.AdamW(
        [
            {"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=cfg.eps,
    )
    dtype = torch.bfloat16 if bf16 else torch.float32
    expect = {n: p.detach().clone() for n, p in ref.named_parameters() if n in names}
    bufs = {n: torch.zeros_like(p) for n, p in expect.items()}
    x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_adam)):
            o.zero_grad()
            m(x, x)[1].backward()
        opt.step()
        grads = dict(ref.named_parameters())
        for n in names:
            g = grads[n].grad
            bufs[n] = 0.9 * bufs[n] + 0.1 * g
            u = 0.1 * g + 0.9 * bufs[n]
            tall = u.shape[0] > u.shape[1]
            ortho = orthogonalize((u.T if tall else u).to(dtype), 5).float()
            u = (ortho.T if tall else ortho) * 0.2 * max(u.shape) ** 0.5
            expect[n] = expect[n] * (1 - 1e-2 * 0.1) - 1e-2 * u
            with torch.no_grad():  # the reference model follows the muon parameters by hand
                dict(ref.named_parameters())[n].copy_(expect[n])
        ref_adam.step()
        with torch.no_grad():
            for n in names:
                dict(ref.named_parameters())[n].copy_(expect[n])
    got = dict(model.named_parameters())
    # bf16 Newton-Schulz: a stacked bmm rounds unlike one matrix's mm, 5.5e-5 to 2e-4 apart after
    # 3 steps of ~1e-2 each (measured, as the thread count varies); fp32: up to 3.1e-6 (measured in
    # CI's workers). A 5% error in the update's scale is 5e-4.
    tol = 3e-4 if dtype == torch.bfloat16 else 1e-5
    for n, p in ref.named_parameters():
        assert torch.allclose(got[n], p, atol=tol), (n, (got[n] - p).abs().max())
    assert any(
        not torch.equal(got[n], ref_before)
        for n, ref_before in muon_model().named_parameters()
        if n in names
    )


def test_an_unknown_optimizer_is_refused():
    from gptlab.config import to_config
    from gptlab.errors import GptlabError

    # the choices are the table's rows
    with pytest.raises(
        GptlabError, match="optimizer.name=sophia: must be one of adamw, muon, lion"
    ):
        to_config(compose_config(["optimizer.name=sophia"]))


# as distributed.py does
@pytest.mark.filterwarnings("ignore:.*FSDP2-wrapped module.*returned a view tensor")
@pytest.mark.integration
def test_muon_on_sharded_parameters_steps_as_on_whole_ones(monkeypatch):
    """fully_shard in a gloo group of one, in this process: Muon's parameters, gradients and
    momentum buffers are DTensors; each update is gathered whole, orthogonalised and cut back to the
    shard, so three steps equal the unsharded model's (fp32 Newton-Schulz: bitwise, measured)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    monkeypatch.setattr("gptlab.optim.muon.fast_bf16", lambda device: False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        whole, sharded = muon_model(), muon_model()
        sharded.load_state_dict(whole.state_dict())
        mesh = init_device_mesh("cpu", (1,))
        for block in sharded.h:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        cfg = OptimizerConfig(name="muon", weight_decay=0.1)
        opts = [build_optimizer(m, cfg, 1e-2, "cpu") for m in (whole, sharded)]
        x = torch.randint(0, 16, (4, 8))
        for _ in range(3):
            for m, o in zip((whole, sharded), opts):
                o.zero_grad()
                m(x, x)[1].backward()
                o.step()
        matrices = opts[1].param_groups[0]["params"]
        assert matrices and all(isinstance(p, DTensor) for p in matrices)
        assert all(isinstance(opts[1].state[p]["momentum_buffer"], DTensor) for p in matrices)
        got = {n: p.full_tensor() for n, p in sharded.named_parameters()}
        for n, p in whole.named_parameters():
            assert torch.equal(got[n], p), (n, (got[n] - p).abs().max())
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ Muon's work split over ranks


def test_muon_owners_balance_the_newton_schulz_and_deal_equal_shapes_round_the_ranks():
    shapes = [(64, 256), (256, 64), (64, 192), (64, 64)] * 3
    for ranks in (1, 2, 3, 5):
        owners = muon_owners(shapes, ranks)
        assert owners == muon_owners(shapes, ranks)  # a function of the shapes: every rank agrees
        loads = [
            sum(ns_flops(s, 5) for s, o in zip(shapes, owners) if o == r) for r in range(ranks)
        ]
        total = sum(ns_flops(s, 5) for s in shapes)
        # no rank does more than its share plus one matrix
        assert max(loads) <= total / ranks + ns_flops((64, 256), 5), (ranks, loads)
        for shape in set(map(lambda s: tuple(sorted(s)), shapes)):
            dealt = [o for s, o in zip(shapes, owners) if tuple(sorted(s)) == shape]
            assert max(map(dealt.count, set(dealt))) - min(map(dealt.count, set(dealt))) <= 1
    assert ns_flops((64, 256), 5) == ns_flops((256, 64), 5) == 5 * (4 * 64 * 64 * 256 + 2 * 64**3)


# tall and wide, several of one shape, rows that 2 ranks do not split evenly (7, 5)
SPLIT_SHAPES = [(24, 8), (8, 24), (8, 8), (24, 8), (7, 8), (12, 5), (5, 12)]
SPLIT_MODES = ["replicated", "fsdp", "hsdp 1x2", "hsdp 2x1"]


def split_model_steps(mode=None, ns="fp32", steps=3):
    """Three Muon steps on SPLIT_SHAPES' matrices with seeded gradients, the same on every rank:
    alone (mode None), or in a 2-rank gloo group with the parameters replicated, or sharded by
    fully_shard (fsdp, a 1-D mesh; hsdp, a 2-D one, replicate x shard). The final weights, whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s)) for s in SPLIT_SHAPES])
    if mode in ("fsdp", "hsdp 1x2", "hsdp 2x1"):
        dims = {"fsdp": (2,), "hsdp 1x2": (1, 2), "hsdp 2x1": (2, 1)}[mode]
        names = ("shard",) if len(dims) == 1 else ("replicate", "shard")
        holder = torch.nn.Module()
        holder.matrices = model
        fully_shard(holder, mesh=init_device_mesh("cpu", dims, mesh_dim_names=names))
    params = list(model)
    opt = Muon([{"params": params, "weight_decay": 0.1, "muon": True}], 0.02, (0.9, 0.95),
               1e-8, 0.9, 5, False, ns)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            if isinstance(p, DTensor):
                g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = g
        opt.step()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in params]


def split_worker(rank, store, out):
    """One rank of test_muon_split_over_two_ranks_equals_one_process: each mode's weights and the
    number of matrices this rank orthogonalised in each, to out/<rank>.pt."""
    import torch.distributed as dist

    import gptlab.optim.muon as optim

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    done, real = [], optim.orthogonalize

    def counting(g, steps):
        done.append(g.shape[0] if g.dim() == 3 else 1)
        return real(g, steps)

    optim.orthogonalize = counting
    results = {}
    try:
        for ns in ("fp32", "bf16"):
            for mode in SPLIT_MODES:
                done.clear()
                results[ns, mode] = (split_model_steps(mode, ns), sum(done))
    finally:
        dist.destroy_process_group()
    torch.save(results, f"{out}/{rank}.pt")


@pytest.mark.slow
def test_muon_split_over_two_ranks_equals_one_process(tmp_path):
    """On 2 gloo ranks each rank orthogonalises only its share of the matrices (muon_owners'), and
    the step equals one process's, which orthogonalises them all: with replicated parameters (an
    all-gather of the results) and with fully_shard's row shards (an all-to-all to the owners and
    one back), on a 1-D mesh and on hsdp's 2-D ones. Newton-Schulz in fp32 and in bf16: bitwise
    both (measured), since each matrix's iteration does not depend on the others in its stack."""
    import torch.multiprocessing as mp

    from gptlab.distributed.world import PRELOAD

    # forked from one server that imported torch once (training's, if this process started it)
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(
        split_worker,
        args=(str(tmp_path / "store"), str(tmp_path)),
        nprocs=2,
        start_method="forkserver",
    )
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    owners, worst = muon_owners(SPLIT_SHAPES, 2), 0.0
    for ns, mode in ranks[0]:
        alone = split_model_steps(None, ns)
        for rank, results in enumerate(ranks):
            weights, matrices = results[ns, mode]
            for got, want in zip(weights, alone):
                worst = max(worst, (got - want).abs().max().item())
                assert (got - want).abs().max() <= 1e-6, (mode, rank, (got - want).abs().max())
            # 3 steps of its share; hsdp over 2 nodes of 1 rank: each node orthogonalises all
            share = owners.count(rank) if mode != "hsdp 2x1" else len(SPLIT_SHAPES)
            assert matrices == 3 * share, (mode, rank, matrices)
    assert 0 < owners.count(0) < len(SPLIT_SHAPES)
    print(f"muon split over 2 ranks: largest |weight - 1 process| {worst:.1e}")


# ------------------------------------------------------------------------------ the weight average


def step_with_random_grads(model, opt, gen):
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.integration
def test_the_weight_average_follows_its_recurrence_after_every_step(name):
    model = muon_model()
    opt = build_optimizer(model, OptimizerConfig(name=name, ema_decay=0.9), 1e-2, "cpu")
    gen = torch.Generator().manual_seed(0)
    params = list(model.parameters())
    expected = None
    for n in range(120):  # past n = 81, where (1 + n) / (10 + n) reaches the configured 0.9
        step_with_random_grads(model, opt, gen)
        now = [p.detach().clone() for p in params]
        # the first step starts the average at the weights it produced; then the decay warms up
        d = min(0.9, (1 + n) / (10 + n))
        expected = now if expected is None else [d * e + (1 - d) * w for e, w in zip(expected, now)]
        for p, e in zip(params, expected):
            torch.testing.assert_close(opt.state[p]["ema"], e, rtol=1e-5, atol=1e-6)
    assert all(opt.state[p]["ema_updates"] == 120 for p in params)  # saved with the average
    # a loaded state's count is read once on the next step: a copy goes on exactly as the original
    # does
    twin = copy.deepcopy(model)
    again = build_optimizer(twin, OptimizerConfig(name=name, ema_decay=0.9), 1e-2, "cpu")
    for _ in range(3):  # its own count (3) goes stale: loading forgets it
        step_with_random_grads(twin, again, gen)
    twin.load_state_dict(model.state_dict())
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: no tensor shared
    for m, o in ((model, opt), (twin, again)):
        step_with_random_grads(m, o, torch.Generator().manual_seed(7))
    for p, q in zip(params, twin.parameters()):
        assert (
            torch.equal(again.state[q]["ema"], opt.state[p]["ema"])
            and again.state[q]["ema_updates"] == 121
        )
    # the weights themselves moved away from the average (it lags them)
    assert any(not torch.equal(p, opt.state[p]["ema"]) for p in params)


def test_no_average_is_kept_without_ema_decay():
    model = muon_model()
    opt = build_optimizer(model, OptimizerConfig(ema_decay=0.0), 1e-2, "cpu")
    step_with_random_grads(model, opt, torch.Generator().manual_seed(0))
    assert all("ema" not in s for s in opt.state.values())
    before = [p.detach().clone() for p in model.parameters()]
    with averaged_weights(opt):  # nothing to swap in
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_averaged_weights_swap_in_the_average_and_bring_the_weights_back_bitwise():
    model = muon_model()
    opt = build_optimizer(model, OptimizerConfig(ema_decay=0.5), 1e-2, "cpu")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        step_with_random_grads(model, opt, gen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with averaged_weights(opt):
        for n, p in model.named_parameters():
            assert torch.equal(p, opt.state[p]["ema"]), n
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="inside"), averaged_weights(opt):
        raise RuntimeError("inside")  # an error inside still brings the training weights back
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_load_average_takes_the_saved_average_under_any_name_of_a_tied_weight():
    model = muon_model()
    assert model.lm_head.weight is model.wte.weight
    state = {n: torch.full_like(p, float(i)) for i, (n, p) in enumerate(model.named_parameters())}
    # a checkpoint names a tied weight once, by either of its names
    saved = {
        "state": {
            ("lm_head.weight" if n == "wte.weight" else n): {"ema": v} for n, v in state.items()
        }
    }
    assert load_average(model, saved)
    for n, p in model.named_parameters():
        assert torch.equal(p, state[n]), n
    assert not load_average(model, None) and not load_average(
        model, {"state": {"h.0.ln_1.weight": {}}}
    )


@pytest.mark.integration
def test_a_run_without_the_average_drops_a_resumed_one_instead_of_evaluating_it_stale():
    """Resuming an averaging run's state with ema_decay=0: the old average would never move again,
    yet be swapped in for evaluation and saved for sample and export. It is dropped on load."""
    model = muon_model()
    averaging = build_optimizer(model, OptimizerConfig(ema_decay=0.5), 1e-2, "cpu")
    step_with_random_grads(model, averaging, torch.Generator().manual_seed(2))
    saved = averaging.state_dict()
    assert all("ema" in s for s in saved["state"].values())
    plain = build_optimizer(model, OptimizerConfig(ema_decay=0.0), 1e-2, "cpu")
    plain.load_state_dict(saved)
    assert plain.state and all("ema" not in s and "exp_avg" in s for s in plain.state.values())
    again = build_optimizer(model, OptimizerConfig(ema_decay=0.5), 1e-2, "cpu")
    again.load_state_dict(saved)  # an averaging run keeps it
    assert all("ema" in s for s in again.state.values())


# ---- Lion, and every optimizer of the table --------------------------------------------------


def lion_reference(p, g, m, lr, betas, weight_decay):
    """Lion's step written out: (the new weights, the new momentum)."""
    b1, b2 = betas
    p = p * (1 - lr * weight_decay) - lr * torch.sign(b1 * m + (1 - b1) * g)
    return p, b2 * m + (1 - b2) * g


def test_lion_steps_each_coordinate_by_lr_in_the_sign_of_its_momentum():
    from gptlab.optim.lion import Lion

    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(8))
    lr, betas = 0.01, (0.9, 0.99)
    opt = Lion([{"params": [w], "weight_decay": 0.5}, {"params": [b], "weight_decay": 0.0}], lr,
               betas)  # fmt: skip
    ref = {
        "w": (w.detach().clone(), torch.zeros_like(w)),
        "b": (b.detach().clone(), torch.zeros(8)),
    }
    for step in range(3):
        grads = {"w": torch.randn_like(w), "b": torch.randn_like(b)}
        if step == 0:
            before = b.detach().clone()
        w.grad, b.grad = grads["w"].clone(), grads["b"].clone()
        opt.step()
        if step == 0:  # no decay on b: every coordinate moved by exactly lr
            assert torch.allclose((b.detach() - before).abs(), torch.full_like(b, lr))
        for name, decay in (("w", 0.5), ("b", 0.0)):
            ref[name] = lion_reference(ref[name][0], grads[name], ref[name][1], lr, betas, decay)
        assert torch.allclose(w, ref["w"][0], atol=1e-6) and torch.allclose(
            b, ref["b"][0], atol=1e-6
        )
    # one state buffer per parameter: the momentum
    assert [sorted(s) for s in opt.state.values()] == [["exp_avg"], ["exp_avg"]]


def test_lion_on_sharded_parameters_steps_as_on_whole_ones(one_rank_group):
    """fully_shard's DTensors: the for-each update and the per-shard sign give the same weights."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    sharded = copy.deepcopy(whole)
    fully_shard(sharded)
    cfg = OptimizerConfig(name="lion", weight_decay=0.3)
    opts = [build_optimizer(m, cfg, 0.01, "cpu") for m in (whole, sharded)]
    x = torch.randn(5, 8)
    for _ in range(3):
        for model, opt in zip((whole, sharded), opts):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(whole.parameters(), sharded.parameters()):
        assert torch.allclose(a, b.full_tensor(), atol=1e-6)


def state_bytes(optimizer_state) -> int:
    """The fp32 bytes an optimizer's saved state holds per parameter tensor (a step count or an
    update count aside)."""
    return sum(
        v.numel() * v.element_size()
        for per_param in optimizer_state["state"].values()
        for k, v in per_param.items()
        if k not in ("step", "ema_updates")
    )


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_of_the_table_is_planned_trains_and_resumes_exactly(
    name, tmp_path, shakespeare
):
    """compose -> plan -> steps -> resume: the plan's optimizer memory is what the optimizer holds,
    and a run stopped and resumed ends with the uninterrupted run's weights, bit for bit."""
    from gptlab.checkpoint import state as checkpoint
    from gptlab.perf.costs import make_plan, resolve_auto, resolve_micro_batch
    from gptlab.train import run_training

    def overrides(steps):
        return nano_overrides(
            shakespeare, f"optimizer={name}", f"train.max_steps={steps}",
            "optimizer.decay_steps=6", "optimizer.warmup_steps=2", "train.eval_every=3",
            "train.eval_steps=1", "train.checkpoint_every=3", "train.sample_tokens=0",
        )  # fmt: skip

    cfg = resolve_micro_batch(resolve_auto(to_config(compose_config(overrides(6))))[0])
    planned = make_plan(cfg).memory["optimizer"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_training(compose_config(overrides(6)), straight)
    assert run_training(compose_config(overrides(3)), split)["steps"] == 3
    assert run_training(compose_config(overrides(6)), split)["steps"] == 6
    saved = checkpoint.load(checkpoint.latest(straight / "checkpoints"))
    assert planned == pytest.approx(state_bytes(saved["optimizer"]), rel=1e-6)
    a = checkpoint.read_model(checkpoint.latest(straight / "checkpoints")).model
    b = checkpoint.read_model(checkpoint.latest(split / "checkpoints")).model
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
