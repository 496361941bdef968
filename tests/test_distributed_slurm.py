"""gptlab/distributed/slurm.py in one process: a task's identity and environment, host names, job
info and the rendezvous port (the real SLURM: test_slurm.py, test_multinode.py)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from distributed_fakes import recorder

from gptlab.distributed import slurm
from gptlab.distributed import world as distributed
from gptlab.errors import GptlabError

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


# ------------------------------------------------------------------ the restarting launcher

KILLED = "srun: error: gptlab-n2: task 1: Killed\nsrun: error: gptlab-n1: task 0: Terminated\n"


def test_the_first_task_srun_reported_dead_is_the_failure():
    from gptlab.distributed.slurm_launcher import first_failure

    lines = slurm.srun_failures(KILLED)[0]
    assert slurm.failure_parts(lines[0]) == ("1", "gptlab-n2", "Killed")
    assert slurm.failure_parts("srun: something else") is None
    assert first_failure(lines) == {"rank": 1, "node": "gptlab-n2", "ended": "Killed"}
    assert first_failure(["ranks 8-15 on n7: Exited with exit code 1"]) == {
        "rank": None,
        "node": "n7",
        "ended": "Exited with exit code 1",
    }
    assert first_failure([]) == {}


def test_the_node_left_out_is_the_one_that_failed_if_the_partition_can_spare_it():
    from gptlab.distributed.slurm_launcher import node_to_exclude

    two = ["gptlab-n1", "gptlab-n2"]
    named = {"node": "gptlab-n2", "rank": 1, "ended": "Killed"}
    assert node_to_exclude(named, two, two, set(), need=1) == "gptlab-n2"
    # a 2-node job on a 2-node partition: leaving one out would leave the job nowhere to run
    assert node_to_exclude(named, two, two, set(), need=2) is None
    assert node_to_exclude(named, two, ["gptlab-n2"], set(), need=1) is None  # a 1-node cluster
    assert node_to_exclude(named, two, two, {"gptlab-n2"}, need=1) is None  # out already
    # a lost node that srun did not name: the job's only node, else none
    lost = {"ended": "NODE_FAIL"}
    assert node_to_exclude(lost, ["gptlab-n1"], two, set(), need=1) == "gptlab-n1"
    assert node_to_exclude(lost, two, two + ["gptlab-n3"], set(), need=1) is None


def _slurm_failure(job_id="105", step=12, ended="Killed", node="gptlab-n2"):
    from gptlab.distributed.slurm_launcher import slurm_failure

    return slurm_failure(job_id, "FAILED", {"rank": 1, "node": node, "ended": ended}, step)


def test_a_failed_job_is_resubmitted_until_the_budget_is_spent_or_it_fails_again_alike():
    from gptlab.distributed.slurm_launcher import not_resubmitted, resubmitted_line, stop_line

    first = _slurm_failure("105", 12)
    assert first["cause"] == "SLURM job 105: rank 1 on gptlab-n2: Killed"
    assert stop_line([first], 3) is None
    assert resubmitted_line(first, "106", "gptlab-n2", 1, 3) == (
        "SLURM job 105 failed (rank 1 on gptlab-n2: Killed): resubmitted as job 106 without "
        "gptlab-n2 (restart 1 of train.max_restarts=3)"
    )
    assert resubmitted_line(first, "106", None, 1, 3).endswith(
        "resubmitted as job 106 (restart 1 of train.max_restarts=3)"
    )
    progressed = [first, _slurm_failure("106", 30, node="gptlab-n1")]
    assert stop_line(progressed, 3) is None  # further than the time before
    assert stop_line([first, _slurm_failure("106", 12)], 3) == (
        "SLURM job 106 failed (rank 1 on gptlab-n2: Killed) at step 12, as job 105 did: a repeated "
        "failure, not resubmitted (1 of train.max_restarts=3 restarts used)"
    )
    before = [_slurm_failure("105", None), _slurm_failure("106", None)]
    assert "before its first step, as job 105 did" in stop_line(before, 3)
    spent = [_slurm_failure(str(105 + i), 10 * i) for i in range(3)]
    assert stop_line(spent, 2) == (
        "SLURM job 107 failed (rank 1 on gptlab-n2: Killed) 3 times; no restarts left "
        "(train.max_restarts=2)"
    )
    assert stop_line([first], 0) == (
        "SLURM job 105 failed (rank 1 on gptlab-n2: Killed); not resubmitted (train.max_restarts=0)"
    )
    # a user error, or an exception the job raised, is the same at every start
    assert "user error" in not_resubmitted(_slurm_failure(ended="Exited with exit code 2"), False)
    assert not_resubmitted(first, raised=True) is not None
    assert not_resubmitted(first, raised=False) is None


class _FakeJob:
    """A submitit job that ended: its state, its folder (with srun's lines), its result."""

    def __init__(self, job_id, state, folder, srun_lines="", result=None):
        self.job_id, self.state, self.result = job_id, state, result
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{job_id}_0_log.err").write_text(srun_lines)
        self.paths = SimpleNamespace(folder=folder, result_pickle=folder / "none.pkl")

    def done(self):
        return True

    def get_info(self, mode="standard"):
        return {"NodeList": "gptlab-n2"}

    def results(self):
        if self.result is None:
            raise RuntimeError(f"submitit: job {self.job_id} has not produced any output")
        return [self.result]


class _FakeExecutor:
    def __init__(self, jobs):
        self.jobs, self.submitted, self.parameters = list(jobs), [], {}

    def update_parameters(self, **kwargs):
        self.parameters.update(kwargs)

    def submit(self, fn, *args):
        self.submitted.append((args, dict(self.parameters)))
        return self.jobs.pop(0)


def _sweep(monkeypatch, tmp_path, jobs, max_restarts=3):
    """A _Sweep of one Hydra job (run folder tmp_path/sweep/0) whose submissions are `jobs`."""
    from omegaconf import OmegaConf

    from gptlab.distributed import slurm_launcher

    cfg = {"hydra": {"sweep": {"dir": str(tmp_path / "sweep"), "subdir": "${hydra.job.num}"},
                     "job": {"num": -1}},
           "train": {"max_restarts": max_restarts}}  # fmt: skip
    loader = SimpleNamespace(load_sweep_config=lambda config, overrides: OmegaConf.create(cfg))
    launcher = SimpleNamespace(
        params={"nodes": 1, "partition": "local", "submitit_folder": str(tmp_path)},
        hydra_context=SimpleNamespace(config_loader=loader),
        config=OmegaConf.create(cfg),
    )
    executor = _FakeExecutor(jobs[1:])
    monkeypatch.setattr(slurm_launcher._Sweep, "_executor", lambda self: executor)
    monkeypatch.setattr(slurm_launcher, "partition_nodes", lambda p: ["gptlab-n1", "gptlab-n2"])
    monkeypatch.setattr(slurm_launcher, "started_at", lambda job_id: None)
    monkeypatch.setattr(slurm_launcher, "POLL_S", 0.0)
    sweep = slurm_launcher._Sweep(launcher)
    args = (["x=1"], "hydra.sweep.dir", 0, "job_id_for_0", {})
    return sweep, [slurm_launcher._Watched(jobs[0], args)], executor


def test_the_launcher_resubmits_a_failed_job_without_its_node_and_leaves_the_failure(
    monkeypatch, tmp_path, caplog
):
    import json

    from gptlab.distributed import restarts
    from gptlab.records import layout

    run_dir = tmp_path / "sweep" / "0"
    run_dir.mkdir(parents=True)
    restarts.StepMarks(run_dir, 1).mark(12)
    failed = _FakeJob("105", "FAILED", tmp_path / "105", KILLED)
    finished = _FakeJob("106", "COMPLETED", tmp_path / "106", result="job return")
    sweep, watched, executor = _sweep(monkeypatch, tmp_path, [failed, finished])
    assert sweep.wait(watched) == ["job return"]
    ((args, parameters),) = executor.submitted
    assert args[2] == 0 and parameters["slurm_exclude"] == "gptlab-n2"  # same job number
    (left,) = json.loads((run_dir / layout.FAILURE).read_text())["failures"]
    assert left["cause"] == "SLURM job 105: rank 1 on gptlab-n2: Killed"
    assert (left["launcher"], left["died_at_step"]) == ("slurm", 12)
    assert restarts.furthest_step(run_dir) is None  # the next start's marks are its own
    assert (
        "SLURM job 105 failed (rank 1 on gptlab-n2: Killed): resubmitted as job 106 without "
        "gptlab-n2 (restart 1 of train.max_restarts=3)"
    ) in caplog.text


def test_the_launcher_stops_a_job_that_fails_again_at_the_same_step_with_one_line(
    monkeypatch, tmp_path
):
    from gptlab.distributed import restarts

    run_dir = tmp_path / "sweep" / "0"
    run_dir.mkdir(parents=True)
    jobs = [_FakeJob(str(105 + i), "FAILED", tmp_path / str(105 + i), KILLED) for i in range(3)]
    sweep, watched, executor = _sweep(monkeypatch, tmp_path, jobs)
    # each start dies at step 12 again
    monkeypatch.setattr(restarts, "furthest_step", lambda run_dir: 12)
    with pytest.raises(GptlabError) as e:
        sweep.wait(watched)
    assert str(e.value).startswith("SLURM job 106 failed (rank 1 on gptlab-n2: Killed) at step 12")
    assert len(executor.submitted) == 1


def test_the_launcher_does_not_resubmit_a_user_error(monkeypatch, tmp_path):
    user_error = "srun: error: gptlab-n1: task 0: Exited with exit code 2\n"
    failed = _FakeJob("105", "FAILED", tmp_path / "105", user_error)
    sweep, watched, executor = _sweep(monkeypatch, tmp_path, [failed])
    with pytest.raises(RuntimeError, match="has not produced any output"):  # submitit's own error
        sweep.wait(watched)
    assert executor.submitted == []
