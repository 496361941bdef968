"""gptlab.distributed.world: every decision it makes in one process, with its exact messages, then
real multi-process data parallelism (gloo on the CPU, started by gptlab itself or by torchrun).

In one process, what needs other processes (a second rank, SLURM, CUDA) is stood in for by fakes
of torch's and the OS's calls; the real multi-process runs are the slow tests below, of test_fsdp
and of test_multinode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import functools
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import model_config, run_cli, typed

from gptlab.distributed import slurm
from gptlab.distributed import world as distributed
from gptlab.errors import GptlabError
from gptlab.perf import fastpath, runtime

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SUBMITIT_EXECUTOR",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "CUDA_VISIBLE_DEVICES",
)


@functools.lru_cache(maxsize=None)
def _section(section: str, *overrides: str):
    return typed(section, *overrides)


def hw(preset: str = "cpu", **changes):
    """A hardware preset with precision=auto decided as for the tests' narrow models."""
    section = _section("hardware", f"hardware={preset}")
    decided = fastpath.choose_precision(section.precision, section.device, 64).value
    return dataclasses.replace(section, **{"precision": decided, **changes})


def par(preset: str = "single", **changes):
    return dataclasses.replace(_section("parallelism", f"parallelism={preset}"), **changes)


@pytest.fixture
def env(monkeypatch):
    """No launcher variables; whatever a test sets (or the code under test writes) is undone after
    it."""
    for name in LAUNCH_VARS:
        # recorded, so that a value the code writes itself is removed after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def recorder(result=None):
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs) if kwargs else args)
        return result

    record.calls = calls
    return record


def fake_cuda(monkeypatch, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


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


# ------------------------------------------------------------------ SLURM


def test_slurm_hostnames_asks_scontrol(monkeypatch):
    run = recorder(SimpleNamespace(stdout="gptlab-n1\ngptlab-n2\n"))
    monkeypatch.setattr(subprocess, "run", run)
    assert slurm.slurm_hostnames("gptlab-n[1-2]") == ["gptlab-n1", "gptlab-n2"]
    assert run.calls == [
        (
            (["scontrol", "show", "hostnames", "gptlab-n[1-2]"],),
            {"capture_output": True, "text": True, "check": True},
        )
    ]


@pytest.fixture
def srun_step(env):
    """Task 1 of a 4-task srun step (no submitit) on nodes n[1-2], with its hosts and checks
    faked."""
    for k, v in dict(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="4",
        SLURM_LOCALID="1",
        SLURM_JOB_ID="61",
        SLURM_JOB_NODELIST="job[1-2]",
    ).items():
        env.setenv(k, v)
    hosts = {"job[1-2]": ["job1", "job2"], "step[1-2]": ["step1", "step2"]}
    env.setattr(slurm, "slurm_hostnames", lambda nodelist: hosts[nodelist])
    env.setattr(slurm, "rendezvous_port", lambda job_id: 20000 + job_id)
    checked = recorder()
    env.setattr(slurm, "check_rendezvous_port", checked)
    return checked


def test_export_slurm_env_from_an_srun_task(srun_step, env):
    slurm.export_env()
    launch = {
        k: os.environ.get(k)
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    assert launch == {
        "MASTER_ADDR": "job1",
        "MASTER_PORT": "20061",
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
    }
    assert srun_step.calls == []  # only rank 0 listens


def test_export_slurm_env_prefers_the_steps_nodes_and_the_users_master(srun_step, env):
    env.setenv("SLURM_STEP_NODELIST", "step[1-2]")
    env.setenv("SLURM_PROCID", "0")
    slurm.export_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["RANK"]) == (
        "step1",
        "20061",
        "0",
    )
    assert srun_step.calls == [(20061,)]
    env.setenv("MASTER_ADDR", "head")
    env.setenv("MASTER_PORT", "29400")
    slurm.export_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("head", "29400")
    assert srun_step.calls[1:] == [(29400,)]
    env.setenv("MASTER_PORT", "")  # empty: the job id's port
    slurm.export_env()
    assert os.environ["MASTER_PORT"] == "20061"


def test_export_slurm_env_under_submitit(srun_step, env):
    import submitit

    made = []

    class TorchDistributedEnvironment:
        def __init__(self):
            self.master_addr, self.master_port, self.exported = "first-node", 45678, None
            made.append(self)

        def export(self, **kwargs):
            self.exported = kwargs
            os.environ["RANK"] = "0"

    env.setattr(submitit.helpers, "TorchDistributedEnvironment", TorchDistributedEnvironment)
    env.setenv("SUBMITIT_EXECUTOR", "slurm")
    slurm.export_env()
    (e,) = made
    assert (e.master_addr, e.master_port) == ("first-node", 20061)
    assert e.exported == {"set_cuda_visible_devices": False, "overwrite": True}
    assert srun_step.calls == [(20061,)]
    env.setenv("MASTER_ADDR", "head")
    slurm.export_env()
    assert made[1].master_addr == "head"


def test_slurm_job_info_outside_slurm_is_none(env):
    assert slurm.slurm_job_info() is None
    env.setenv("SLURM_PROCID", "0")
    assert slurm.slurm_job_info() is None


def test_slurm_job_info_of_an_srun_task(env):
    env.setenv("SLURM_PROCID", "0")
    env.setenv("SLURM_STEP_NUM_TASKS", "2")
    env.setenv("SLURM_JOB_ID", "74")
    env.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    shown = "JobId=74 JobName=train StdOut=/runs/74.out Reason=None Comment= StdErr=/runs/74.err\n"
    run = recorder(SimpleNamespace(stdout=shown))
    env.setattr(subprocess, "run", run)
    env.setattr(slurm, "slurm_hostnames", {"n[1-2]": ["n1", "n2"], "s[1]": ["n1"]}.get)
    info = slurm.slurm_job_info()
    assert info == {
        "job_id": "74",
        "nodes": ["n1", "n2"],
        "stdout": "/runs/74.out",
        "stderr": "/runs/74.err",
    }
    assert run.calls == [
        ((["scontrol", "show", "job", "-o", "74"],), {"capture_output": True, "text": True})
    ]
    env.setenv("SLURM_STEP_NODELIST", "s[1]")
    env.setattr(subprocess, "run", recorder(SimpleNamespace(stdout="JobId=74 StdOut=a=b\n")))
    info = slurm.slurm_job_info()
    assert info == {"job_id": "74", "nodes": ["n1"], "stdout": "a=b", "stderr": ""}
    # scontrol no longer knows the job
    env.setattr(subprocess, "run", recorder(SimpleNamespace(stdout="")))
    assert slurm.slurm_job_info() == {"job_id": "74", "nodes": ["n1"], "stdout": "", "stderr": ""}


def test_slurm_job_info_under_submitit(env):
    import submitit

    paths = SimpleNamespace(stdout="/f/%j_0_log.out", stderr="/f/%j_0_log.err", folder="/f")
    fake = SimpleNamespace(job_id="99_1", hostnames=["a", "b"], paths=paths)
    env.setattr(submitit, "JobEnvironment", lambda: fake)
    env.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert slurm.slurm_job_info() == {
        "job_id": "99_1",
        "nodes": ["a", "b"],
        "stdout": "/f/%j_0_log.out",
        "stderr": "/f/%j_0_log.err",
        "submitit_folder": "/f",
    }
    env.setenv("SUBMITIT_EXECUTOR", "local")
    assert slurm.slurm_job_info() is None


# ------------------------------------------------------------------ rendezvous ports


def test_ephemeral_ports_read_from_the_kernels_file(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert slurm.ephemeral_ports(str(f)) == (40000, 50000)
    f.write_text("1000 2000 3000\n")  # only the first two numbers count
    assert slurm.ephemeral_ports(str(f)) == (1000, 2000)
    for junk in ("40000\n", "forty fifty\n"):
        f.write_text(junk)
        assert slurm.ephemeral_ports(str(f)) == (32768, 60999)
    assert slurm.ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)
    assert slurm.EPHEMERAL_PORTS_FILE == "/proc/sys/net/ipv4/ip_local_port_range"


def test_rendezvous_port_values():
    linux = (32768, 60999)
    assert [slurm.rendezvous_port(j, linux) for j in (0, 1, 12767, 12768)] == [
        20000,
        20001,
        32767,
        20000,
    ]
    # the range above the ephemeral ports is the larger: 60001-65535
    assert [slurm.rendezvous_port(j, (20000, 60000)) for j in (0, 5534, 5535)] == [
        60001,
        65535,
        60001,
    ]
    assert slurm.rendezvous_port(3, (40000, 50000)) == 20003  # 20000 below, 15535 above
    assert slurm.rendezvous_port(3, (1000, 5000)) == 20003  # all of 20000-65535 is free
    assert slurm.rendezvous_port(45536, (1000, 5000)) == 20000
    assert slurm.rendezvous_port(45536, (70000, 80000)) == 20000
    assert slurm.rendezvous_port(999, (21000, 65535)) == 20999  # 1000 ports are enough
    assert slurm.rendezvous_port(1000, (21000, 65535)) == 20000
    assert slurm.rendezvous_port(1000, (20000, 64535)) == 64536


def test_rendezvous_port_reads_this_nodes_range(monkeypatch):
    monkeypatch.setattr(slurm, "ephemeral_ports", lambda: (40000, 50000))
    assert slurm.rendezvous_port(7) == 20007


def test_rendezvous_port_without_room_says_to_set_master_port():
    for ephemeral in ((20999, 65535), (20000, 64536), (1024, 65000)):
        with pytest.raises(GptlabError) as e:
            slurm.rendezvous_port(7, ephemeral)
        first, last = ephemeral
        assert str(e.value) == (
            f"the ephemeral port range {first}-{last} (/proc/sys/net/ipv4/ip_local_port_range) "
            f"leaves no room for a "
            "rendezvous port in 20000-65535; set MASTER_PORT to a port that no connection uses"
        )


def test_check_rendezvous_port_on_a_taken_port_prints_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(slurm, "ephemeral_ports", lambda: (40000, 50000))
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            slurm.check_rendezvous_port(port)
    assert e.value.code == 2 and e.value.__cause__ is None and e.value.__suppress_context__
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"gptlab: error: rank 0 cannot listen on the rendezvous port {port} on node7 "
        f"({os.strerror(errno.EADDRINUSE)}); set MASTER_PORT to a free port outside 40000-50000 "
        "(this node's ephemeral ports)\n"
    )
    slurm.check_rendezvous_port(port)  # free again


def test_check_rendezvous_port_flushes_its_line_at_once(monkeypatch):
    """The task exits right after the line: it must be out before SLURM's kill-on-bad-exit ends the
    step."""
    written = []

    class Stderr:
        def write(self, text):
            written.append(("write", text))

        def flush(self):
            written.append("flush")

    monkeypatch.setattr(slurm, "ephemeral_ports", lambda: (40000, 50000))
    monkeypatch.setattr(sys, "stderr", Stderr())
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        with pytest.raises(SystemExit):
            slurm.check_rendezvous_port(taken.getsockname()[1])
    assert written[-1] == "flush" and written[0][1].startswith(
        "gptlab: error: rank 0 cannot listen"
    )


def test_check_rendezvous_port_allows_a_port_left_in_time_wait():
    """A previous job's closed connection on the port (TIME_WAIT) does not stop torch's TCPStore."""
    with socket.socket() as server:
        # as the previous job's TCPStore
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end waits in TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):  # without SO_REUSEADDR the port is taken
        plain.bind(("", port))
    slurm.check_rendezvous_port(port)


def test_check_rendezvous_port_binds_every_address_of_ipv4(monkeypatch):
    made = []

    class Socket:
        def __init__(self, *args):
            self.args, self.calls = args, []
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.calls.append("closed")

        def setsockopt(self, *args):
            self.calls.append(("setsockopt", *args))

        def bind(self, address):
            self.calls.append(("bind", address))

    monkeypatch.setattr(socket, "socket", Socket)
    slurm.check_rendezvous_port(29500)
    (s,) = made
    assert s.args == (socket.AF_INET, socket.SOCK_STREAM)
    assert s.calls == [
        ("setsockopt", socket.SOL_SOCKET, socket.SO_REUSEADDR, 1),
        ("bind", ("", 29500)),
        "closed",
    ]


def test_free_port_is_a_free_unprivileged_loopback_port():
    port = distributed._free_port()
    assert isinstance(port, int) and 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


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


# ------------------------------------------------------------------ spawned workers


@pytest.fixture
def worker_env(env):
    """distributed._worker in this process: its exit and its binding to the launcher recorded."""
    env.setattr(distributed, "_exit_now", recorder())
    env.setattr(distributed, "follow_launcher", recorder())
    return env


def test_worker_follows_its_launcher_sets_its_rank_runs_and_exits_with_its_code(worker_env):
    seen = []

    def fn(a, b):
        seen.append(
            (
                a,
                b,
                {
                    k: os.environ[k]
                    for k in (
                        "RANK",
                        "LOCAL_RANK",
                        "WORLD_SIZE",
                        "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR",
                        "MASTER_PORT",
                    )
                },
            )
        )

    distributed._worker(1, (3, 29511, 4242), fn, ("x", 2))
    assert distributed.follow_launcher.calls == [(4242,)]
    assert seen == [
        (
            "x",
            2,
            {
                "RANK": "1",
                "LOCAL_RANK": "1",
                "WORLD_SIZE": "3",
                "LOCAL_WORLD_SIZE": "3",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29511",
            },
        )
    ]
    assert distributed._exit_now.calls == [(0,)]


@pytest.mark.parametrize(
    "code, exit_code", [(2, 2), (0, 0), (None, 0), ("a message", 1), (True, True)]
)
def test_worker_turns_systemexit_into_its_exit_code(worker_env, code, exit_code):
    def fn():
        raise SystemExit(code)

    distributed._worker(0, (1, 1234, 1), fn, ())
    exits = distributed._exit_now.calls
    assert exits == [(exit_code,)] and type(exits[0][0]) is type(exit_code)


def test_an_interrupted_worker_exits_130_quietly(worker_env, capsys):
    def fn():
        raise KeyboardInterrupt

    distributed._worker(0, (1, 1234, 1), fn, ())
    assert distributed._exit_now.calls == [(distributed.INTERRUPTED,)] == [(130,)]
    assert capsys.readouterr() == ("", "")  # the launcher says where the run stands


def test_a_crashed_worker_prints_its_traceback_and_exits_with_its_own_code(worker_env, capsys):
    def fn():
        raise ValueError("bug")

    distributed._worker(0, (1, 1234, 1), fn, ())
    assert distributed._exit_now.calls == [(distributed.CRASHED,)]
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.rstrip().endswith(
        "ValueError: bug"
    )


FOLLOWER = """
import os, signal, sys
from gptlab.distributed import world as distributed
distributed.follow_launcher(int(sys.argv[1]))
default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
print(os.getpid(), os.getsid(0), default, flush=True)
signal.pause()
"""

LAUNCHER = """
import os, signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job: the worker inherits it
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=sys.stdout)
signal.pause()
"""


@pytest.mark.slow
def test_a_worker_ends_when_its_launcher_is_killed_and_hears_only_the_launcher(tmp_path):
    """follow_launcher in a real process: its own session, SIGINT back to Python's handler, and
    SIGKILL from the kernel when the launcher dies of SIGKILL (which no handler of the launcher's
    can pass on)."""
    out = tmp_path / "out"
    with out.open("w") as f:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, FOLLOWER], stdout=f)
    try:
        deadline = time.time() + 120
        while not out.read_text().strip():
            assert time.time() < deadline and launcher.poll() is None, "the worker never started"
            time.sleep(0.1)
        pid, sid, handler = out.read_text().split()
        # a session of its own; Ctrl-C would raise KeyboardInterrupt
        assert sid == pid and handler == "True"
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 10
        while _running(int(pid)):
            assert time.time() < deadline, f"worker {pid} outlived its launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_a_worker_whose_launcher_died_before_it_was_bound_ends_at_once():
    """The launcher died between the worker's start and its prctl: the parent is no longer the
    launcher, and the worker kills itself before running anything."""
    code = (
        "import os, sys\nfrom gptlab import distributed\n"
        "distributed.follow_launcher(os.getppid() + 1)\nprint('ran')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL and r.stdout == ""


def test_stop_again_only_for_a_second_user_stop_after_a_second():
    assert distributed.stop_again("SIGINT", 1.5, "SIGINT") and distributed.stop_again(
        "SIGTERM", 1.5, "SIGINT"
    )
    assert distributed.stop_again("SIGINT", 1.5, "SIGTERM")
    assert not distributed.stop_again("SIGINT", 0.5, "SIGINT")  # the same Ctrl-C, delivered twice
    # a scheduler's warning, then its own SIGTERM
    assert not distributed.stop_again("SIGUSR2", 60, "SIGTERM")
    assert not distributed.stop_again("SIGTERM", 60, "SIGUSR2")


class Exited(Exception):
    pass


def test_exit_now_flushes_everything_then_leaves(monkeypatch):
    events = []

    class Stream:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def flush(self):
            events.append(f"flush {self.name}")
            if self.error:
                raise self.error

    def leave(code):
        events.append(("exit", code))
        raise Exited

    monkeypatch.setattr(logging, "shutdown", lambda: events.append("logging"))
    monkeypatch.setattr(os, "_exit", leave)
    monkeypatch.setattr(sys, "stdout", Stream("stdout", OSError("closed pipe")))
    monkeypatch.setattr(sys, "stderr", Stream("stderr"))
    with pytest.raises(Exited):
        distributed._exit_now(3)
    assert events == ["logging", "flush stdout", "flush stderr", ("exit", 3)]
    events.clear()
    monkeypatch.setattr(sys, "stdout", Stream("stdout"))
    monkeypatch.setattr(sys, "stderr", Stream("stderr", ValueError("I/O operation on closed file")))
    with pytest.raises(Exited):
        distributed._exit_now(0)
    assert events == ["logging", "flush stdout", "flush stderr", ("exit", 0)]


class FakeWorker:
    """A worker that ends when the test says (its sentinel is a real pipe, as a process's is)."""

    def __init__(self, pid):
        self.pid, self.exitcode, self.killed = pid, None, False
        self.sentinel, self._end = os.pipe()

    def end(self, code):
        if self.exitcode is None:
            self.exitcode = code
            os.close(self._end)

    def is_alive(self):
        return self.exitcode is None

    def kill(self):
        self.killed = True
        self.end(-signal.SIGKILL)

    def join(self):
        pass


@pytest.fixture
def fake_spawn(monkeypatch):
    """distributed._start gives fake workers; signals sent to them (os.kill) are recorded, and
    `on_signal(pid, sig)` says what a worker does with one (default: stops and exits 0)."""
    started = SimpleNamespace(calls=[], kills=[], workers=[], on_signal=lambda w, sig: w.end(0))

    def start(nprocs, fn, args):
        started.calls.append((nprocs, fn, args))
        started.workers = [FakeWorker(101 + i) for i in range(nprocs)]
        return started.workers

    real_kill = os.kill

    def kill(pid, sig):
        for w in started.workers:
            if w.pid == pid:
                started.kills.append((pid, sig))
                return started.on_signal(w, sig)
        return real_kill(pid, sig)  # this process (the test's signals to itself)

    monkeypatch.setattr(distributed, "_start", start)
    monkeypatch.setattr(os, "kill", kill)
    yield started
    for w in started.workers:
        w.end(0)
        os.close(w.sentinel)


STOPS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)


def later(*actions):
    """Run (seconds to wait, action) pairs on a thread while spawn waits in the main thread."""

    def run():
        for wait, action in actions:
            time.sleep(wait)
            action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def to_me(sig):
    """Send sig to this process's main thread, where Python runs signal handlers."""
    return lambda: signal.pthread_kill(threading.main_thread().ident, sig)


def test_spawn_starts_the_workers_and_waits_for_all(fake_spawn):
    def target():
        pass

    before = {s: signal.getsignal(s) for s in STOPS}
    later((0.2, lambda: fake_spawn.workers[1].end(0)), (0.2, lambda: fake_spawn.workers[0].end(0)))
    assert distributed.spawn(target, 2, ("a",)) is None
    assert fake_spawn.calls == [(2, target, ("a",))] and fake_spawn.kills == []
    assert {s: signal.getsignal(s) for s in STOPS} == before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2, signal.SIGINT])
@pytest.mark.integration
def test_spawn_forwards_the_first_stop_signal_once_to_every_live_worker(fake_spawn, sig):
    before = {s: signal.getsignal(s) for s in STOPS}
    fake_spawn.on_signal = lambda w, s: None  # the workers stop at their next step: not yet
    later((0.2, lambda: fake_spawn.workers[2].end(0)), (0.1, to_me(sig)), (0.1, to_me(sig)),
          (0.3, lambda: [w.end(0) for w in fake_spawn.workers]))  # fmt: skip
    distributed.spawn(print, 3, ())
    # the same stop delivered twice (a terminal's process group, a SLURM step) is passed on once
    assert fake_spawn.kills == [(101, sig), (102, sig)]
    assert {s: signal.getsignal(s) for s in STOPS} == before


@pytest.mark.integration
def test_a_second_ctrl_c_kills_the_workers_and_interrupts_at_once(fake_spawn):
    fake_spawn.on_signal = lambda w, s: None  # saving: they would take their time
    later((0.2, to_me(signal.SIGINT)), (distributed.SAME_STOP_S + 0.3, to_me(signal.SIGINT)))
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        distributed.spawn(print, 2, ())
    assert time.monotonic() - t0 < distributed.SAME_STOP_S + 3
    assert fake_spawn.kills == [(101, signal.SIGINT), (102, signal.SIGINT)]
    assert all(w.killed for w in fake_spawn.workers)


def test_a_launcher_started_with_sigint_ignored_leaves_it_ignored(fake_spawn):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen = []
        later((0.2, lambda: seen.append(signal.getsignal(signal.SIGINT))),
              (0, lambda: [w.end(0) for w in fake_spawn.workers]))  # fmt: skip
        distributed.spawn(print, 2, ())
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    "code, how",
    [(-9, "(pid 102) was killed by SIGKILL"), (-6, "(pid 102) was killed by SIGABRT"),
     (3, "(pid 102) exited with code 3"), (distributed.CRASHED, "failed (traceback above)")],
)  # fmt: skip
def test_a_failed_worker_ends_the_others_at_once_and_is_named(fake_spawn, code, how):
    before = {s: signal.getsignal(s) for s in STOPS}
    later((0.2, lambda: fake_spawn.workers[1].end(code)))
    with pytest.raises(GptlabError) as e:
        distributed.spawn(print, 3, ())
    assert str(e.value) == f"worker rank 1 {how}; all workers were stopped"
    assert e.value.__cause__ is None and e.value.__suppress_context__
    # killed, not sent SIGTERM: a worker would take that for a stop and try to save with a peer gone
    assert [w.killed for w in fake_spawn.workers] == [True, False, True] and fake_spawn.kills == []
    assert {s: signal.getsignal(s) for s in STOPS} == before


def test_spawn_passes_on_a_workers_user_error_exit(fake_spawn):
    later((0.2, lambda: fake_spawn.workers[0].end(2)))
    with pytest.raises(SystemExit) as e:
        distributed.spawn(print, 2, ())
    assert e.value.code == 2 and e.value.__suppress_context__
    assert fake_spawn.workers[1].killed


def test_a_worker_interrupted_before_training_interrupts_the_launcher(fake_spawn):
    later((0.2, lambda: fake_spawn.workers[0].end(130)))
    with pytest.raises(KeyboardInterrupt):
        distributed.spawn(print, 2, ())
    # a worker killed by the stop signal it was sent (before its loop took that signal over)
    fake_spawn.on_signal = lambda w, s: w.end(-s)
    later((0.2, to_me(signal.SIGTERM)))
    with pytest.raises(KeyboardInterrupt):
        distributed.spawn(print, 2, ())


# ------------------------------------------------------------------ real processes: gloo on the CPU


COMMON = [
    "model=gpt_nano",
    "train.max_steps=8",
    "train.batch_size=8",
    "train.log_every=1",
    "train.eval_every=4",
    "train.eval_steps=2",
    "tracking.mlflow=false",
    "train.sample_tokens=0",
    "model.dropout=0.0",
]


def losses(cwd: Path):
    (run_dir,) = [p for p in (cwd / "outputs" / "runs").iterdir() if (p / "results.json").exists()]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r], [
        r["val_loss"] for r in rows if "val_loss" in r
    ]


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path, shakespeare):
    """Same global batch on 1 process and on 2 (spawned by gptlab, or by torchrun, and with gradient
    accumulation, where DDP must all-reduce on the last micro-step only): same losses."""
    args = [*COMMON, f"data.path={shakespeare}"]
    runs = {
        "cpu": [sys.executable, "-m", "gptlab.train", *args, "hardware=cpu"],
        "spawn": [sys.executable, "-m", "gptlab.train", *args, "hardware=cpu_x2"],
        "torchrun": [
            str(Path(sys.executable).parent / "torchrun"),
            "--nproc_per_node=2",
            "-m",
            "gptlab.train",
            *args,
            "hardware=cpu_x2",
        ],
        "spawn_accum": [
            sys.executable,
            "-m",
            "gptlab.train",
            *args,
            "hardware=cpu_x2",
            "train.micro_batch_size=2",
        ],
    }
    out = {}
    for name, cmd in runs.items():
        cwd = tmp_path / name
        cwd.mkdir()
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        out[name] = losses(cwd)
        if name != "cpu":
            split = (
                "= 2 x 2 accum x 2 ranks" if name == "spawn_accum" else "= 4 x 1 accum x 2 ranks"
            )
            assert "x2" in r.stdout and split in r.stdout
            # one run folder, rank 0's: other ranks leave nothing behind
            assert len(list((cwd / "outputs" / "runs").iterdir())) == 1
    ref_train, ref_val = out["cpu"]
    assert len(ref_train) == 8
    for name in ("spawn", "torchrun", "spawn_accum"):
        train, val = out[name]
        assert train == pytest.approx(ref_train, abs=1e-5), name
        assert val == pytest.approx(ref_val, abs=1e-5), name


@pytest.mark.slow
def test_ddp_with_fewer_validation_batches_than_ranks_finishes(tmp_path, shakespeare):
    """train.eval_steps=1 on 2 ranks of a rotary model: rank 1 has no validation batch and goes
    straight to the sums' all-reduce. With DDP broadcasting buffers (the rotary tables), rank 0's
    evaluation forward was a collective rank 1 never joined: a hang until killed."""
    args = [*COMMON, f"data.path={shakespeare}", "model.pos_emb=rotary", "train.eval_steps=1",
            "train.max_steps=4", "train.eval_every=2", "parallelism=ddp", "hardware=cpu_x2",
            "parallelism.timeout_s=60"]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "gptlab.train", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    _, val = losses(tmp_path)
    assert len(val) == 2 and all(math.isfinite(v) for v in val)


def _wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_killed_worker_ends_the_whole_job_naming_the_rank(tmp_path, shakespeare):
    cmd = [
        sys.executable,
        "-m",
        "gptlab.train",
        "model=gpt_nano",
        f"data.path={shakespeare}",
        "hardware=cpu_x2",
        "train.max_steps=1000000",
        "train.log_every=1",
        "tracking.mlflow=false",
        "parallelism.timeout_s=30",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        metrics = lambda: list((tmp_path / "outputs").rglob("metrics.jsonl"))  # noqa: E731
        _wait_for(
            lambda: metrics() and len(metrics()[0].read_text().splitlines()) >= 3,
            120,
            "training to start",
        )
        # the spawned ranks, in start order (the resource tracker is not one of them)
        workers = sorted(
            (
                p
                for p in psutil.Process(proc.pid).children()
                if "spawn_main" in " ".join(p.cmdline())
            ),
            key=lambda p: p.create_time(),
        )
        assert len(workers) == 2
        workers[1].send_signal(signal.SIGKILL)
        t0 = time.time()
        _, err = proc.communicate(timeout=60)
        assert time.time() - t0 < 30  # well within the collective timeout
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last.startswith("gptlab.train: error: worker rank 1") and "SIGKILL" in last, err[-2000:]
    for w in workers:  # no orphaned worker keeps running
        with contextlib.suppress(psutil.NoSuchProcess):
            _wait_for(
                lambda w=w: not w.is_running() or w.status() == psutil.STATUS_ZOMBIE,
                10,
                f"pid {w.pid} to end",
            )


@pytest.mark.slow
def test_worker_user_error_is_one_line(tmp_path, shakespeare):
    # the per-process micro-batch check passes, the data check fails inside the workers
    r = run_cli(
        [
            "gptlab.train",
            "model=gpt_nano",
            "hardware=cpu_x2",
            f"data.path={shakespeare}",
            "tracking.mlflow=false",
            "model.block_size=2000000",
        ],
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "error" in ln]
    assert (
        lines
        and lines[0].startswith("gptlab.train: error: model.block_size")
        and "Traceback" not in r.stderr
    )


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, shakespeare):
    """SIGTERM reaching rank 1 alone (a scheduler signalling one task): the ranks agree at the next
    step boundary, rank 0 saves that step's checkpoint, and the job ends cleanly; a rank stopping on
    its own would leave the other in a collective until parallelism.timeout_s."""
    from helpers import start_cli

    from gptlab.checkpoint import state as checkpoint

    run_dir = tmp_path / "run"
    args = [
        *COMMON,
        f"data.path={shakespeare}",
        "hardware=cpu_x2",
        "train.max_steps=100000",
        "train.eval_every=0",
        "parallelism.timeout_s=30",
        f"hydra.run.dir={run_dir}",
    ]
    proc = start_cli(["gptlab.train", *args], tmp_path)
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
            120,
            "training to start",
        )
        workers = sorted(
            (
                p
                for p in psutil.Process(proc.pid).children()
                if "spawn_main" in " ".join(p.cmdline())
            ),
            key=lambda p: p.create_time(),
        )
        assert len(workers) == 2
        workers[1].send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received: stopped at step" in out
    results = json.loads((run_dir / "results.json").read_text())
    assert results["stopped_by"] == "SIGTERM"
    assert checkpoint.latest(run_dir / "checkpoints").name == f"ckpt_{results['steps']:08d}.pt"


def _spawned_workers(launcher: int):
    """The ranks a launcher spawned, in start order (the resource tracker is not one of them)."""
    children = psutil.Process(launcher).children()
    return sorted(
        (p for p in children if "spawn_main" in " ".join(p.cmdline())),
        key=lambda p: p.create_time(),
    )


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _long_run(shakespeare, run_dir, *extra, steps=100000):
    return [
        sys.executable,
        "-m",
        "gptlab.train",
        *COMMON,
        f"data.path={shakespeare}",
        "hardware=cpu_x2",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "parallelism.timeout_s=30",
        "data.progress=false",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_worker_and_a_free_folder_that_resumes(tmp_path, shakespeare):
    """A launcher started with SIGINT ignored (a background job of a shell script), killed by
    SIGKILL (nothing of it runs: kill -9, the OOM killer): its workers end within seconds without
    saving again, the run folder's lock is free, and the same command resumes from an intact
    checkpoint."""
    import fcntl

    from helpers import cli_env

    from gptlab.checkpoint import state as checkpoint

    run_dir = tmp_path / "run"
    cmd = _long_run(shakespeare, run_dir, "train.checkpoint_every=5", "train.log_every=5")
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 - as `trap '' INT`
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=ignore_sigint,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
            120,
            "training to start",
        )
        workers = _spawned_workers(proc.pid)
        assert len(workers) == 2
        proc.kill()
        proc.wait()
        for w in workers:
            _wait_for(lambda w=w: _gone(w), 10, f"worker {w.pid} to end with its launcher")
    finally:
        proc.kill()
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    time.sleep(2)
    # nobody saves any more
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == saved
    with open(run_dir / ".gptlab.lock", "a") as f:
        # free: raises BlockingIOError while a rank holds it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
    latest = checkpoint.latest(run_dir / "checkpoints")
    step = checkpoint.step_of(latest)
    again = _long_run(
        shakespeare, run_dir, "train.checkpoint_every=5", "train.log_every=5", steps=step + 2
    )
    r = subprocess.run(
        again, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        f"resuming from {latest} (step {step})" in r.stdout and "warning" not in r.stdout + r.stderr
    )


@pytest.mark.slow
def test_a_second_start_in_a_busy_folder_is_one_line_with_two_processes(tmp_path, shakespeare):
    from helpers import cli_env

    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        _long_run(shakespeare, run_dir, "hardware=cpu"),
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1,
            120,
            "training to start",
        )
        r = subprocess.run(
            _long_run(shakespeare, run_dir),
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        first.kill()
        first.wait()
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()  # no line of torch's about the other rank it stopped
    assert line.startswith(
        f"gptlab.train: error: run folder {run_dir} is in use by another gptlab run (pid "
    )


@pytest.mark.slow
def test_a_two_process_run_on_a_terminal_ends_without_a_resource_tracker_warning(
    tmp_path, shakespeare
):
    """On a terminal rank 0 draws a progress bar; the run, and every process it started (the
    resource tracker writes last, once the launcher has gone), print nothing after the results."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    from helpers import cli_env

    primary, secondary = pty.openpty()
    # a terminal's size
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    cmd = _long_run(shakespeare, tmp_path / "run", steps=20)
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=secondary, text=True
    )
    os.close(secondary)
    seen = []

    def read():  # until every process holding the terminal has closed it
        with contextlib.suppress(OSError):
            while chunk := os.read(primary, 4096):
                seen.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=300)
    reader.join(60)
    os.close(primary)
    terminal = b"".join(seen).decode(errors="replace")
    assert proc.returncode == 0 and "results: best val loss" in out, terminal[-3000:]
    assert "step/s" in terminal or "s/step" in terminal, terminal[-3000:]  # tqdm's bar was drawn
    assert "resource_tracker" not in terminal and "leaked" not in terminal, terminal[-3000:]
    assert "Warning" not in terminal and "Traceback" not in terminal, terminal[-3000:]


HANG_RANK1 = """
import os, runpy, sys, time
import gptlab.training.loop as loop
real = loop.optimizer_step
def optimizer_step(run, lr, loss_sum):  # rank 1 hangs (alive, not dead) in its 4th step
    if os.environ["RANK"] == "1" and run.train_loader.step == 3:
        time.sleep(600)
    return real(run, lr, loss_sum)
loop.optimizer_step = optimizer_step
sys.argv = ["gptlab.train", *{args!r}]
runpy.run_module("gptlab.train", run_name="__main__")
"""


@pytest.mark.slow
def test_a_hung_rank_is_ended_by_the_collective_timeout(tmp_path, shakespeare):
    """A rank that stops answering (not dead: no exit code to notice) ends the job after
    parallelism.timeout_s, through the waiting rank's collective, not after the job's time limit."""
    args = [
        "model=gpt_nano",
        f"data.path={shakespeare}",
        "hardware=cpu_x2",
        "train.max_steps=50",
        "train.log_every=1",
        "tracking.mlflow=false",
        "train.sample_tokens=0",
        "parallelism.timeout_s=10",
    ]
    args.append(f"hydra.run.dir={tmp_path / 'run'}")
    script = tmp_path / "hang.py"
    script.write_text(HANG_RANK1.format(args=args))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    t0 = time.time()
    r = subprocess.run(
        [torchrun, "--nproc_per_node=2", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    took = time.time() - t0
    assert r.returncode != 0
    assert took < 90, f"the job took {took:.0f} s to end"
    assert "timed out" in r.stderr.lower() or "timeout" in r.stderr.lower(), r.stderr[-3000:]
    steps = [
        json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3]  # rank 0 logged until the step rank 1 never finished


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
