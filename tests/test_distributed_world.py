"""gptlab/distributed/world.py in one process: who a process is, setup and teardown, the
collectives, wrapping the model; what needs another rank, SLURM or CUDA is stood in for by fakes."""

from __future__ import annotations

import datetime
import os
import warnings
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distributed_fakes import fake_cuda, hw, par, recorder
from helpers import model_config, typed

from gptlab.distributed import slurm
from gptlab.distributed import world as distributed
from gptlab.errors import GptlabError
from gptlab.perf import runtime

# ------------------------------------------------------------------ who am I


def test_dist_defaults_and_is_main():
    d = distributed.Dist()
    assert (d.rank, d.local_rank, d.world_size, d.device) == (0, 0, 1, torch.device("cpu"))
    assert d.is_main
    assert not distributed.Dist(rank=1).is_main


def test_slurm_task_needs_both_the_task_id_and_the_step_size(env):
    assert not slurm.slurm_task()
    env.setenv("SLURM_PROCID", "0")
    assert not slurm.slurm_task()
    env.delenv("SLURM_PROCID")
    env.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert not slurm.slurm_task()
    env.setenv("SLURM_PROCID", "0")
    assert slurm.slurm_task()


def test_role_of_each_kind_of_process(env):
    checked = recorder()
    env.setattr(distributed, "check_gpus", checked)
    assert distributed.role(hw()) == "plain"
    assert checked.calls == [(hw(), 1)]
    assert distributed.role(hw(nproc_per_node=3)) == "parent"
    assert distributed.role(hw(nproc_per_node=2)) == "parent"
    assert checked.calls[1:] == [(hw(nproc_per_node=3), 3), (hw(nproc_per_node=2), 2)]
    checked.calls[2:] = []
    env.setenv("SLURM_PROCID", "0")
    env.setenv("SLURM_STEP_NUM_TASKS", "1")  # a one-task step is a plain process
    assert distributed.role(hw()) == "plain"
    env.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert distributed.role(hw(nproc_per_node=2)) == "slurm"
    env.setenv("RANK", "0")
    assert distributed.role(hw(nproc_per_node=2)) == "slurm"  # WORLD_SIZE as well makes torchrun
    env.setenv("WORLD_SIZE", "2")
    assert distributed.role(hw(nproc_per_node=2)) == "torchrun"
    env.delenv("RANK")
    assert distributed.role(hw(nproc_per_node=2)) == "slurm"
    assert len(checked.calls) == 3  # launched processes check nothing here


@pytest.mark.integration
def test_role_refuses_to_start_a_multi_node_job_itself(env):
    with pytest.raises(GptlabError) as e:
        distributed.role(hw(nodes=2))
    assert str(e.value) == (
        "hardware.nodes=2: a multi-node job must be started by SLURM "
        "(hydra/launcher=slurm_a100x8, or launch/sbatch_gptlab.sh) or torchrun on every node"
    )


def test_check_gpus_messages(env):
    fake_cuda(env, 0)
    distributed.check_gpus(hw(), 8)  # a CPU preset needs none
    with pytest.raises(GptlabError) as e:
        distributed.check_gpus(hw("gpu"), 1)
    assert str(e.value) == "hardware=gpu needs CUDA, but no GPU is visible; use hardware=cpu"
    fake_cuda(env, 2)
    distributed.check_gpus(hw("gpu"), 2)
    with pytest.raises(GptlabError) as e:
        distributed.check_gpus(hw("gpu"), 3)
    assert str(e.value) == (
        "hardware=gpu starts 3 processes, one per GPU, but 2 GPU(s) are visible "
        "(CUDA_VISIBLE_DEVICES=unset); "
        "set hardware.nproc_per_node=2 or make the GPUs visible"
    )
    env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(GptlabError, match=r"\(CUDA_VISIBLE_DEVICES=0,1\); "):
        distributed.check_gpus(hw("gpu"), 3)


# ------------------------------------------------------------------ setup / teardown


@pytest.fixture
def fake_group(env):
    """setup's process-group calls recorded instead of made (any world size, any backend)."""
    calls = SimpleNamespace(init=[], new_group=[], threads=[], kept=[])
    env.setattr(dist, "is_initialized", lambda: False)
    env.setattr(dist, "init_process_group", lambda **kw: calls.init.append(kw))
    env.setattr(dist, "new_group", lambda **kw: calls.new_group.append(kw) or "control-group")
    env.setattr(torch, "set_num_threads", calls.threads.append)
    env.setattr(runtime, "keep_freed_memory", lambda: calls.kept.append(True))
    env.setattr(distributed, "_CONTROL_GROUP", "stale")
    return calls


@pytest.mark.integration
def test_setup_of_a_plain_process(fake_group):
    d = distributed.setup(hw(), par())
    assert d == distributed.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert fake_group.init == [] and fake_group.threads == [] and fake_group.kept == [True]
    assert distributed._CONTROL_GROUP == "stale"  # no group made, none replaced


@pytest.mark.integration
def test_setup_of_a_torchrun_worker_on_the_cpu(fake_group, env):
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "4")
    env.setenv("LOCAL_RANK", "1")
    env.setattr(os, "cpu_count", lambda: 16)
    d = distributed.setup(hw(nproc_per_node=2, nodes=2), par("ddp", timeout_s=42))
    assert d == distributed.Dist(rank=3, local_rank=1, world_size=4, device=torch.device("cpu"))
    assert fake_group.init == [
        {"backend": "gloo", "timeout": datetime.timedelta(seconds=42), "device_id": None}
    ]
    assert distributed._CONTROL_GROUP is None and fake_group.new_group == []
    # 16 cores, 2 processes per node
    assert fake_group.threads == [8] and type(fake_group.threads[0]) is int
    assert fake_group.kept == [True]


def test_setup_of_ddp_launched_as_a_world_of_one_joins_a_group(fake_group, env):
    """torchrun --nproc_per_node=1 ... parallelism=ddp: the launcher's group (env://), so the one
    process runs DDP's wrapper and backend as the many-GPU job does; single stays alone."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():  # fmt: skip
        env.setenv(name, value)
    distributed.setup(hw(), par("single"))
    assert fake_group.init == []
    distributed.setup(hw(), par("ddp", timeout_s=42))
    assert fake_group.init == [
        {"backend": "gloo", "timeout": datetime.timedelta(seconds=42), "device_id": None}
    ]


@pytest.mark.parametrize(
    "world, nodes, cores, threads",
    [(2, 2, 8, 8), (4, 1, 2, 1), (2, 1, None, 1), (2, 2, None, 1), (2, 1, 3, 1), (3, 1, 9, 3)],
)
def test_setup_shares_the_cores_among_a_nodes_cpu_processes(
    fake_group, env, world, nodes, cores, threads
):
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", str(world))
    env.setattr(os, "cpu_count", lambda: cores)
    distributed.setup(hw(nproc_per_node=world // nodes, nodes=nodes), par("ddp"))
    assert fake_group.threads == [threads]
    assert [init["backend"] for init in fake_group.init] == ["gloo"]


def test_setup_sets_the_hardwares_threads(fake_group, env):
    distributed.setup(hw(threads=3), par())
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "2")
    distributed.setup(hw(nproc_per_node=2, threads=5), par("ddp"))
    assert fake_group.threads == [3, 5]


@pytest.mark.integration
def test_setup_of_a_world_of_one_under_fsdp_uses_an_in_memory_group(fake_group):
    d = distributed.setup(hw(), par("fsdp", timeout_s=7))
    assert d == distributed.Dist()
    (init,) = fake_group.init
    store = init.pop("store")
    assert isinstance(store, dist.HashStore)
    assert init == {
        "backend": "gloo",
        "timeout": datetime.timedelta(seconds=7),
        "device_id": None,
        "rank": 0,
        "world_size": 1,
    }
    assert distributed.setup(hw(), par("hsdp")) == distributed.Dist() and len(fake_group.init) == 2


def test_setup_joins_no_group_twice(fake_group, env):
    env.setattr(dist, "is_initialized", lambda: True)
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "2")
    assert distributed.setup(hw(nproc_per_node=2), par("ddp")).world_size == 2
    env.setenv("WORLD_SIZE", "1")
    assert distributed.setup(hw(), par("fsdp")).world_size == 1
    assert fake_group.init == [] and distributed._CONTROL_GROUP == "stale"


@pytest.fixture
def tf32_flags():
    """torch's TF32 switches, put back after the test (monkeypatch cannot: they are properties of
    modules)."""
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    before = [f.allow_tf32 for f in flags]
    for f in flags:
        f.allow_tf32 = False
    yield
    for f, value in zip(flags, before):
        f.allow_tf32 = value


def test_setup_on_a_gpu_picks_the_local_ranks_device_and_nccl(fake_group, env, tf32_flags):
    fake_cuda(env, 2)
    picked = recorder()
    env.setattr(torch.cuda, "set_device", picked)
    env.setenv("RANK", "5")
    env.setenv("WORLD_SIZE", "8")
    env.setenv("LOCAL_RANK", "3")
    d = distributed.setup(
        hw("gpu", nproc_per_node=4, nodes=2, threads=None), par("ddp", timeout_s=9)
    )
    assert d == distributed.Dist(rank=5, local_rank=3, world_size=8, device=torch.device("cuda", 1))
    assert picked.calls == [(torch.device("cuda", 1),)]
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    timeout = datetime.timedelta(seconds=9)
    assert fake_group.init == [
        {"backend": "nccl", "timeout": timeout, "device_id": torch.device("cuda", 1)}
    ]
    assert fake_group.new_group == [{"backend": "gloo", "timeout": timeout}]
    assert distributed._CONTROL_GROUP == "control-group"
    # threads and malloc are the CPU's concerns
    assert fake_group.threads == [] and fake_group.kept == []
    distributed.setup(hw("gpu", nproc_per_node=4, nodes=2, tf32=False), par("ddp"))
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_setup_on_a_gpu_checks_that_one_is_visible(fake_group, env, tf32_flags):
    fake_cuda(env, 0)
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "1")  # a torchrun worker: role checked nothing
    with pytest.raises(GptlabError, match="^hardware=gpu needs CUDA, but no GPU is visible"):
        distributed.setup(hw("gpu"), par())
    fake_cuda(env, 1)  # one GPU is all a rank needs
    env.setattr(torch.cuda, "set_device", recorder())
    assert distributed.setup(hw("gpu"), par()).device == torch.device("cuda", 0)


def test_setup_refuses_a_world_the_hardware_does_not_describe(fake_group, env):
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "3")
    with pytest.raises(GptlabError) as e:
        distributed.setup(hw(nproc_per_node=2, nodes=2), par("ddp"))
    assert str(e.value) == (
        "hardware=cpu asks for 4 process(es) but this job has 3: set hardware.nproc_per_node / "
        "hardware.nodes to "
        "match the launcher (torchrun --nproc_per_node, SLURM tasks)"
    )
    assert fake_group.init == []


def test_setup_of_a_slurm_task_exports_its_identity_first(fake_group, env):
    env.setenv("SLURM_PROCID", "1")
    env.setenv("SLURM_STEP_NUM_TASKS", "2")

    def export():
        env.setenv("RANK", "1")
        env.setenv("WORLD_SIZE", "2")
        env.setenv("LOCAL_RANK", "0")

    env.setattr(slurm, "export_env", export)
    d = distributed.setup(hw(nproc_per_node=1, nodes=2), par("ddp"))
    assert (d.rank, d.local_rank, d.world_size) == (1, 0, 2)
    env.setenv("SLURM_STEP_NUM_TASKS", "1")
    env.setattr(slurm, "export_env", lambda: pytest.fail("a one-task step has nothing to export"))
    env.delenv("RANK")
    env.delenv("WORLD_SIZE")
    env.delenv("LOCAL_RANK")
    assert distributed.setup(hw(), par()) == distributed.Dist()


def test_setup_and_teardown_of_a_real_one_rank_fsdp_group(env):
    sleeps = recorder()
    env.setattr(distributed.time, "sleep", sleeps)
    d = distributed.setup(hw(), par("fsdp", timeout_s=11))
    try:
        assert d == distributed.Dist()
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert distributed._CONTROL_GROUP is None
    finally:
        distributed.teardown()
    # one rank: no other gloo thread to wait for
    assert not dist.is_initialized() and sleeps.calls == []
    distributed.teardown()  # no group: nothing to do


@pytest.mark.parametrize(
    "world, backend, control, slept",
    [
        (2, "gloo", None, True),
        (2, "nccl", None, False),
        (2, "nccl", "control", True),
        (1, "gloo", "control", False),
    ],
)
def test_teardown_waits_for_gloos_threads_only_with_other_ranks(
    one_rank_group, env, world, backend, control, slept
):
    sleeps = recorder()
    env.setattr(distributed.time, "sleep", sleeps)
    env.setattr(dist, "get_world_size", lambda *a, **k: world)
    env.setattr(dist, "get_backend", lambda *a, **k: backend)
    env.setattr(distributed, "_CONTROL_GROUP", control)
    distributed.teardown()
    assert not dist.is_initialized()
    assert sleeps.calls == ([(0.2,)] if slept else [])
    assert distributed._CONTROL_GROUP is None
    assert distributed.GLOO_SETTLE_S == 0.2


# ------------------------------------------------------------------ collectives


@pytest.fixture
def two_ranks(monkeypatch):
    """This process as rank 0 of two; rank 1's contribution to each collective is peer.value."""
    peer = SimpleNamespace(value=None, ops=[])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)

    def all_reduce(t, op, group=None):
        peer.ops.append((op, group))
        other = torch.as_tensor(peer.value, dtype=t.dtype)
        if op == dist.ReduceOp.SUM:
            t += other
        elif op == dist.ReduceOp.MAX:
            torch.maximum(t, other, out=t)
        else:
            raise AssertionError(f"unexpected op {op}")

    def broadcast_object_list(box, src):
        peer.ops.append(("broadcast", src))
        if src == 1:
            box[0] = peer.value

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    return peer


def test_all_reduce_mean_over_two_ranks(two_ranks):
    two_ranks.value = [5.0, -1.0]
    t = torch.tensor([1.0, 3.0])
    assert distributed.all_reduce_mean(t) is t
    assert t.tolist() == [3.0, 1.0]
    assert two_ranks.ops == [(dist.ReduceOp.SUM, None)]


def test_all_reduce_mean_in_a_group_of_one(one_rank_group, monkeypatch):
    monkeypatch.setattr(
        dist, "all_reduce", lambda *a, **k: pytest.fail("no collective for a group of one")
    )
    t = torch.tensor([2.0])
    assert distributed.all_reduce_mean(t) is t and t.item() == 2.0


@pytest.mark.parametrize(
    "mine, theirs, agreed",
    [(None, 0, None), (None, 1, "SIGINT"), (None, 2, "SIGTERM"), (None, 3, "SIGUSR2"),
     ("SIGTERM", 0, "SIGTERM"), ("SIGTERM", 3, "SIGUSR2"), ("SIGUSR2", 2, "SIGUSR2"),
     ("SIGINT", 0, "SIGINT"), ("SIGINT", 2, "SIGTERM"), ("SIGHUP", 0, "SIGTERM")],
)  # fmt: skip
def test_agree_on_signal_over_two_ranks(two_ranks, monkeypatch, mine, theirs, agreed):
    monkeypatch.setattr(distributed, "_CONTROL_GROUP", "control")
    two_ranks.value = [theirs]
    assert distributed.agree_on_signal(mine) == agreed
    assert two_ranks.ops == [(dist.ReduceOp.MAX, "control")]


def test_agree_on_signal_in_a_group_of_one(one_rank_group, monkeypatch):
    monkeypatch.setattr(
        dist, "all_reduce", lambda *a, **k: pytest.fail("no collective for a group of one")
    )
    assert distributed.agree_on_signal("SIGUSR2") == "SIGUSR2"
    assert distributed.agree_on_signal(None) is None


def test_broadcast_object_over_two_ranks(two_ranks):
    two_ranks.value = {"theirs": 1}
    assert distributed.broadcast_object({"mine": 0}, src=1) == {"theirs": 1}
    assert distributed.broadcast_object({"mine": 0}) == {"mine": 0}
    assert two_ranks.ops == [("broadcast", 1), ("broadcast", 0)]


def test_broadcast_object_in_a_group_of_one(one_rank_group, monkeypatch):
    monkeypatch.setattr(
        dist, "broadcast_object_list", lambda *a, **k: pytest.fail("no one to broadcast to")
    )
    obj = {"a": 1}
    assert distributed.broadcast_object(obj) is obj


def test_grad_norm_value_of_a_sharded_norm():
    class Replicated:
        def full_tensor(self):
            return torch.tensor(4.0)

    assert distributed.grad_norm_value(Replicated()).item() == 4.0
    t = torch.tensor(2.0)
    assert distributed.grad_norm_value(t) is t


def test_no_sync_on_ddp_enters_its_no_sync_only_between_syncs():
    entered = []

    class FakeDDP(torch.nn.Linear):
        def no_sync(self):
            entered.append(True)
            return nullcontext("skipped")

    model = FakeDDP(2, 2)
    with distributed.no_sync(model, False) as inside:
        assert inside == "skipped"
    with distributed.no_sync(model, True) as inside:
        assert inside is None
    assert entered == [True]


def test_no_sync_on_a_sharded_model_returns_an_empty_context():
    told = []

    class Sharded(torch.nn.Linear):
        def set_requires_gradient_sync(self, sync):
            told.append(sync)
            return "not a context"

    for sync in (False, True):
        ctx = distributed.no_sync(Sharded(2, 2), sync)
        assert isinstance(ctx, nullcontext)
    assert told == [False, True]


# ------------------------------------------------------------------ wrapping the model


def tiny_gpt():
    from gptlab.model.gpt import GPT

    torch.manual_seed(0)
    return GPT(
        model_config(vocab_size=10, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0)
    )


def test_replicate_alone_and_with_others(one_rank_group, monkeypatch):
    model = torch.nn.Linear(2, 2)
    assert distributed._replicate(model, distributed.Dist()) is model
    ddp = distributed._replicate(model, distributed.Dist(world_size=2))
    assert (
        type(ddp).__name__ == "DistributedDataParallel"
        and ddp.module is model
        and ddp.device_ids is None
    )
    made = recorder("ddp")
    monkeypatch.setattr("torch.nn.parallel.DistributedDataParallel", made)
    assert (
        distributed._replicate(
            model, distributed.Dist(world_size=2, device=torch.device("cuda", 3))
        )
        == "ddp"
    )
    # no buffer broadcast: it would make every forward a collective (evaluation's hang)
    off = distributed._no_buffer_sync()
    assert list(off.values()) == [False]
    assert made.calls == [((model,), {"device_ids": [3], **off})]
    # parallelism=ddp launched alone (torchrun --nproc_per_node=1): DDP all the same
    alone = distributed._replicate(model, distributed.Dist(), alone_in_ddp=True)
    assert alone == "ddp" and made.calls[-1] == ((model,), {"device_ids": None, **off})


def test_wrap_model_without_sharding_leaves_checkpointing_as_configured():
    d = distributed.Dist()
    model = tiny_gpt()
    assert (
        distributed.wrap_model(model, d, par(activation_checkpointing=False), hw(), compile=False)
        is model
    )
    assert not model.activation_checkpointing
    assert (
        distributed.wrap_model(model, d, par(activation_checkpointing=True), hw(), compile=False)
        is model
    )
    assert model.activation_checkpointing


def test_mesh_shape():
    assert distributed.mesh_shape("hsdp", 8, 2) == (2, 4)
    assert (
        distributed.mesh_shape("hsdp", 16, 4) == (4, 4)
        and type(distributed.mesh_shape("hsdp", 16, 4)[1]) is int
    )
    assert distributed.mesh_shape("fsdp", 8, 2) == (8,)
    assert distributed.mesh_shape("ddp", 8, 2) == (8,)


def _fsdp_settings(module):
    group = module._get_fsdp_state()._fsdp_param_group
    return group.mp_policy, group.post_forward_mesh_info is not None


@pytest.mark.integration
def test_fsdp_on_one_rank_shards_every_block_then_the_root(one_rank_group):
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    model = tiny_gpt()
    assert not distributed.is_sharded(model)
    wrapped = distributed.wrap_model(
        model,
        distributed.Dist(),
        par("fsdp", activation_checkpointing=False),
        hw(precision="bf16"),
        compile=False,
    )
    assert wrapped is model and isinstance(model, FSDPModule) and not model.activation_checkpointing
    assert distributed.is_sharded(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert all(isinstance(b, FSDPModule) and _fsdp_settings(b) == (policy, True) for b in model.h)
    assert _fsdp_settings(model) == (policy, False)  # the root keeps its gathered parameters
    assert all(b._compiled_call_impl is None for b in model.h)
    mesh = next(model.parameters()).device_mesh
    assert (mesh.device_type, mesh.mesh_dim_names, tuple(mesh.shape)) == ("cpu", ("shard",), (1,))
    x = torch.randint(0, 10, (2, 8))
    _, loss = model(x, x)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a replicated DTensor
    assert (
        type(norm).__name__ == "DTensor" and type(distributed.grad_norm_value(norm)) is torch.Tensor
    )
    ignored = [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None]
    assert any(f[1].pattern == r".*FSDP2-wrapped module.*returned a view tensor" for f in ignored)


def test_fsdp_warns_of_nothing_on_its_views(one_rank_group, recwarn):
    model = distributed.wrap_model(tiny_gpt(), distributed.Dist(), par("fsdp"), hw(), compile=False)
    x = torch.randint(0, 10, (2, 8))
    model(x, x)
    assert not [w for w in recwarn if "FSDP2-wrapped module" in str(w.message)]


@pytest.mark.integration
def test_hsdp_and_fp32_and_zero2_settings(one_rank_group):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = tiny_gpt()
    distributed.wrap_model(model, distributed.Dist(), par("hsdp", reshard_after_forward=False),
                           hw(precision="fp32"), compile=True)  # fmt: skip
    assert model.activation_checkpointing  # the hsdp preset's choice
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    assert all(_fsdp_settings(b) == (policy, False) for b in model.h)
    # each block compiled (lazily) in place
    assert all(b._compiled_call_impl is not None for b in model.h)
    assert model._compiled_call_impl is None
    mesh = next(model.parameters()).device_mesh
    assert (mesh.mesh_dim_names, tuple(mesh.shape)) == (("replicate", "shard"), (1, 1))
    fp16 = distributed.wrap_model(
        tiny_gpt(), distributed.Dist(), par("fsdp"), hw(precision="fp16"), compile=False
    )
    assert _fsdp_settings(fp16.h[0])[0].param_dtype == torch.float16


# ------------------------------------------------------------------ in-process: a gloo group of one


def test_no_sync_skips_ddps_reduction_except_when_syncing(one_rank_group):
    """DDP all-reduces in backward unless inside no_sync (counted by a communication hook)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gptlab.distributed import world as distributed

    ddp = DDP(torch.nn.Linear(4, 2))
    reduced = []

    def hook(state, bucket):
        reduced.append(bucket.buffer().numel())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    x = torch.randn(3, 4)
    for sync in (False, False, True):
        with distributed.no_sync(ddp, sync):
            ddp(x).sum().backward()
    assert reduced == [10]  # one bucket of 4 x 2 + 2 gradients, on the syncing micro-step only


def test_no_sync_tells_a_sharded_model_and_leaves_a_plain_one_alone():
    import torch

    from gptlab.distributed import world as distributed

    class Sharded(torch.nn.Linear):
        told = []

        def set_requires_gradient_sync(self, sync):
            self.told.append(sync)

        def no_sync(self):  # never used for a sharded model
            raise AssertionError("no_sync on an FSDP model")

    model = Sharded(2, 2)
    for sync in (False, True):
        with distributed.no_sync(model, sync):
            pass
    assert model.told == [False, True]
    with distributed.no_sync(torch.nn.Linear(2, 2), False):  # one process: nothing to skip
        pass


def test_collectives_are_identities_without_a_group():
    import torch

    from gptlab.distributed import world as distributed

    t = torch.tensor([3.0])
    assert distributed.all_reduce_mean(t) is t and t.item() == 3.0
    assert distributed.agree_on_signal("SIGUSR2") == "SIGUSR2"
    assert distributed.agree_on_signal(None) is None
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    assert distributed.grad_norm_value(t) is t


@pytest.mark.integration
def test_wrap_model_order_single_process():
    """Checkpointing is switched on, then torch.compile wraps the model (lazily: nothing compiles
    until the first forward); one process needs no DDP."""
    from gptlab.distributed import world as distributed
    from gptlab.model.gpt import GPT

    hw, par = typed("hardware"), typed("parallelism", "parallelism.activation_checkpointing=true")
    d = distributed.Dist()
    model = GPT(model_config(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8))
    plain = distributed.wrap_model(model, d, par, hw, compile=False)
    assert plain is model and model.activation_checkpointing
    compiled = distributed.wrap_model(model, d, par, hw, compile=True)
    assert type(compiled).__name__ == "OptimizedModule" and compiled._orig_mod is model
    assert distributed.mesh_shape("hsdp", 8, 2) == (2, 4) and distributed.mesh_shape(
        "fsdp", 8, 2
    ) == (8,)


@pytest.mark.slow
def test_fsdp_order_is_checkpointing_then_per_block_compile_then_sharding():
    """distributed.wrap_model under fsdp (a world of one, in this process): every block compiled in
    place and sharded, the root sharded, checkpointing on; compiled losses equal eager ones."""
    import torch.distributed as dist
    from helpers import typed
    from torch.distributed.fsdp import FSDPModule

    from gptlab.distributed import world as distributed
    from gptlab.model.gpt import GPT

    par = typed("parallelism", "parallelism=fsdp")
    hw = typed("hardware", "hardware=cpu", precision="fp32")  # what auto picks for gpt_nano
    d = distributed.setup(hw, par)  # fsdp needs a process group even alone: one rank, in memory
    try:
        cfg = typed("model", "model=gpt_nano", vocab_size=65, dropout=0.0)
        x = torch.randint(0, 65, (4, cfg.block_size))
        losses = {}
        for compile_ in (False, True):
            torch.manual_seed(0)
            model = distributed.wrap_model(GPT(cfg), d, par, hw, compile=compile_)
            assert isinstance(model, FSDPModule) and model.activation_checkpointing
            assert all(isinstance(b, FSDPModule) for b in model.h)
            assert all((b._compiled_call_impl is not None) == compile_ for b in model.h)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses[compile_] = []
            for _ in range(3):
                _, loss = model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[compile_].append(loss.item())
        assert losses[True] == pytest.approx(losses[False], abs=1e-5)
        assert losses[False][-1] < losses[False][0]
    finally:
        distributed.teardown()
        assert not dist.is_initialized()


def compiled_graph_ops(module, *args):
    """The higher-order ops in the graph torch.compile captures of module(*args) (its own backend
    records the graph; nothing is compiled to code)."""
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)
    compiled(*args)
    return [op for op in ops if "checkpoint" in op]


@pytest.mark.integration
def test_checkpointing_is_applied_before_compile_so_a_compiled_block_holds_it():
    """wrap_model turns checkpointing on before it compiles: a compiled block (FSDP compiles each)
    must capture the checkpoint inside its graph, compile(checkpoint(block)); checkpointing around
    a compiled block (pytorch#166926) is the order torch does not support."""
    model = tiny_gpt()
    model.activation_checkpointing = True
    model.train()
    x = torch.randn(2, 8, model.config.n_embd, device="cpu")
    assert compiled_graph_ops(model.h[0], x) != []  # the block's own graph checkpoints
    model.eval()  # no recompute outside training
    assert compiled_graph_ops(model.h[0], x) == []
    model.activation_checkpointing = False
    model.train()
    assert compiled_graph_ops(model.h[0], x) == []


def test_checkpointing_with_compile_turns_off_dynamos_lru_reordering(monkeypatch):
    seen = []
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "_set_lru_cache", seen.append)
    model = tiny_gpt()
    distributed.wrap_model(model, distributed.Dist(), par(activation_checkpointing=True), hw(),
                           compile=False)  # fmt: skip
    assert seen == []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)
    distributed.wrap_model(model, distributed.Dist(), par(activation_checkpointing=True), hw(),
                           compile=True)  # fmt: skip
    assert seen == [False] and model.activation_checkpointing
