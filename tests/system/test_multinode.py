"""Many nodes on one machine, end to end: tests/cluster/local_slurm.sh with GPTLAB_SLURM_NODES=2
(each node a network and UTS namespace of its own), and gptlab's multi-node path on it: the
rendezvous across nodes, the same losses as one process, slurm.json and MLflow,
launch/sbatch_gptlab.sh, a task killed on the second node, a requeue, and a `down` that leaves
nothing behind.

The cluster tests (slow) bring the 2-node cluster up themselves and, when the last one ends, put
back the cluster they found (in CI the 1-node cluster that .ci/setup.d starts for the whole session:
the other SLURM tests reach services on the host's loopback, which a node in a namespace cannot).
Like test_slurm.py they need a running local cluster, and root; without them they are skipped,
except in CI (CI=true). The first tests, on the rendezvous port and on reading srun's reports, need
neither.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from helpers import REPO, cli_env, need, start_cli
from test_slurm import PARTITION, _cluster_problem, assert_resumed_in_one_run

from gptlab.distributed.slurm import (
    check_rendezvous_port,
    ephemeral_ports,
    rendezvous_port,
    srun_failures,
)
from gptlab.errors import GptlabError

SCRIPT = REPO / "tests" / "cluster" / "local_slurm.sh"
SBATCH_SCRIPT = REPO / "launch" / "sbatch_gptlab.sh"
NODES = ["gptlab-n1", "gptlab-n2"]  # as tests/cluster/local_slurm.sh names them
HOSTS_MARK = "# gptlab tests/cluster/local_slurm.sh"
MARK = "written by gptlab tests/cluster/local_slurm.sh"
STATE_DIR = Path(os.environ.get("GPTLAB_SLURM_DIR", "/var/tmp/gptlab-slurm"))
# A few steps of the nano model, per step logged, no dropout: the numbers that must match.
COMMON = [
    "model=gpt_nano",
    "parallelism=ddp",
    "train.max_steps=8",
    "train.batch_size=8",
    "train.log_every=1",
    "train.eval_every=4",
    "train.eval_steps=2",
    "train.sample_tokens=0",
    "model.dropout=0.0",
]


def _local_slurm(action: str, nodes: int | None = None, timeout: float = 300) -> Tuple[Any, float]:
    env = {k: v for k, v in os.environ.items() if k != "GPTLAB_SLURM_NODES"}
    if nodes is not None:
        env["GPTLAB_SLURM_NODES"] = str(nodes)
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", str(SCRIPT), action], env=env, capture_output=True, text=True, timeout=timeout
    )
    return r, time.monotonic() - t0


def _ours() -> bool:
    """The clients talk to tests/cluster/local_slurm.sh's cluster (never bring another SLURM up or
    down)."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    try:
        return MARK in conf.read_text()
    except OSError:
        return False


def _node_count() -> int:
    r = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30
    )
    return len(set(r.stdout.split())) if r.returncode == 0 else 0


@pytest.fixture(scope="module")
def two_nodes():
    problem = _cluster_problem()
    if problem is None and not _ours():
        problem = "the SLURM clients do not point at tests/cluster/local_slurm.sh's cluster"
    if problem is None and os.geteuid() != 0:
        problem = "not root: tests/cluster/local_slurm.sh makes network namespaces"
    if problem:
        need(
            f"no local SLURM cluster to make 2 nodes of ({problem}); "
            "start one: bash tests/cluster/local_slurm.sh up"
        )
    found = _node_count()
    r, took = _local_slurm("up", nodes=2)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"\nGPTLAB_SLURM_NODES=2 local_slurm.sh up: {took:.1f} s (from {found} node(s))")
    try:
        yield
    finally:
        # what this module found (after its own `down`, too)
        r, took = _local_slurm("up", nodes=found)
        print(f"\nlocal_slurm.sh up (back to {found} node(s)): {took:.1f} s")
        assert r.returncode == 0, r.stdout + r.stderr


def _run(
    cmd: List[str], cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def _job_state(job_id: str) -> str:
    """The controller's word on a job (sacct's once the controller has forgotten it)."""
    r = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=30
    )
    match = re.search(r"\bJobState=(\S+)", r.stdout)
    if match:
        return match.group(1)
    r = subprocess.run(
        ["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State"],
        capture_output=True,
        text=True,
    )
    return (r.stdout.split() or ["UNKNOWN"])[0]


def _job_records(job_id: str) -> str:
    """What accounting (every start of the job) and the controller say of a job: for failure
    messages."""
    acct = ["sacct", "-D", "-j", job_id, "-P", "-o", "JobID,State,Start,End,ExitCode,NodeList"]
    parts = []
    for cmd in (acct, ["scontrol", "show", "job", "-o", job_id]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        parts.append(f"\n$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return "".join(parts)


def _sacct_starts(job_id: str) -> str:
    """Each start of job_id as sacct has it: one `State|NodeList` line per start."""
    return _run(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State,NodeList"]).stdout


def _ended(starts: str) -> str:
    """starts, once no start in it is still running ("" before)."""
    return "" if "RUNNING" in starts or "COMPLETING" in starts else starts


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(
                f"the launcher ended (exit {proc.returncode}) before {what}:\n{out[-4000:]}"
            )
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _losses(run_dir: Path) -> Tuple[List[float], List[float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r], [
        r["val_loss"] for r in rows if "val_loss" in r
    ]


def _mlflow_run(cwd: Path, run_dir: Path):
    """The MLflow run (the default store under cwd/outputs) that recorded run_dir."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}")
    runs = [
        r
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id])
        if r.data.tags.get("run_dir") == str(run_dir.resolve())
    ]
    assert len(runs) == 1, [r.data.tags for r in runs]
    return runs[0]


def _task_pid(job_id: str, rank: int) -> Tuple[int, str]:
    """(pid, node) of the python process of SLURM task `rank` of job `job_id` (every node shares
    /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = dict(
                line.split("=", 1)
                for line in Path(f"/proc/{pid}/environ").read_text().split("\0")
                if "=" in line
            )
            cmd = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        task = env.get("SLURM_JOB_ID") == str(job_id) and env.get("SLURM_PROCID") == str(rank)
        if task and "python" in cmd and env.get("SLURM_STEP_ID") not in (None, "batch"):
            return int(pid), env.get("SLURMD_NODENAME", "")
    return 0, ""


def _job_nodes(run_dir: Path) -> Tuple[str, List[str]]:
    """(job id, nodes) of a run's latest start, from its slurm.json."""
    job = json.loads((run_dir / "slurm.json").read_text())
    return str(job["job_id"]), job["nodes"]


def on_two_nodes(test):
    """A slow test on the 2-node cluster (brought up once for all of them)."""
    return pytest.mark.slow(pytest.mark.usefixtures("two_nodes")(test))


def test_rendezvous_port_is_the_job_ids_and_outside_the_ephemeral_range(tmp_path):
    linux = (32768, 60999)
    ports = {job: rendezvous_port(job, linux) for job in range(0, 100000, 997)}
    assert all(20000 <= p < 32768 for p in ports.values()), ports
    assert rendezvous_port(4242, linux) == rendezvous_port(4242, linux)  # every node, every requeue
    assert len(set(ports.values())) == len(ports)  # neighbouring jobs do not share a port
    assert 60001 <= rendezvous_port(7, (20000, 60000)) <= 65535  # the larger free stretch
    with pytest.raises(GptlabError, match="MASTER_PORT"):
        rendezvous_port(7, (1024, 65000))
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t50000\n")
    assert ephemeral_ports(str(f)) == (40000, 50000)
    assert ephemeral_ports(str(tmp_path / "missing")) == linux


def test_a_rendezvous_port_in_use_ends_the_task_with_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            check_rendezvous_port(port)
    assert e.value.code == 2  # non-zero: srun's kill-on-bad-exit ends the other tasks at once
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line.startswith(f"gptlab: error: rank 0 cannot listen on the rendezvous port {port} on ")
        and "MASTER_PORT" in line
    )
    check_rendezvous_port(port)  # free again


def test_srun_reports_of_dead_tasks_are_read_and_a_requeue_is_no_failure():
    killed = (
        "srun: error: gptlab-n2: task 1: Killed\n"
        "srun: launch/slurm: _step_signal: Terminating StepId=61.0\n"
    )
    assert srun_failures(killed) == (["rank 1 on gptlab-n2: Killed"], False)
    assert srun_failures("srun: error: n7: tasks 8-15: Exited with exit code 1\n")[0] == [
        "ranks 8-15 on n7: Exited with exit code 1"
    ]
    requeue = (
        "slurmstepd-gptlab-n1: error: *** JOB 74 ON gptlab-n1 CANCELLED AT 2026-11-30T14:38:57 DUE "
        "TO JOB REQUEUE ***\n"
        "srun: error: gptlab-n2: task 1: Terminated\n"
        "srun: error: gptlab-n1: task 0: Exited with exit code 255\n"
    )
    assert srun_failures(requeue) == ([], False)
    # the next start's failure
    assert srun_failures(requeue + killed)[0] == ["rank 1 on gptlab-n2: Killed"]
    # read in whole lines as they come, as the launcher's watcher does
    cut = requeue.index("\n") + 1
    first, inside = srun_failures(requeue[:cut])
    assert first == [] and inside
    assert srun_failures(requeue[cut:], inside) == ([], False)
    # slurmstepd may terminate rank 0 before it exits by itself (seen in CI): the requeue still ends
    # there
    terminated = requeue.replace("task 0: Exited with exit code 255", "task 0: Terminated")
    assert srun_failures(terminated) == ([], False)
    assert srun_failures(terminated + killed)[0] == ["rank 1 on gptlab-n2: Killed"]


def test_slurm_sweeps_wait_through_the_controller_checked_watcher(tmp_path):
    """SubmissionReporter puts ControllerCheckedWatcher in submitit's place for a SLURM sweep (the
    launcher's jobs wait through it), and submitit's own back when the sweep ends; not for
    others."""
    from omegaconf import OmegaConf
    from submitit.slurm.slurm import SlurmJob

    from gptlab.distributed.slurm import ControllerCheckedWatcher
    from gptlab.search.callbacks import SubmissionReporter

    stock = SlurmJob.watcher
    for launcher, installed in (("slurm_local", True), ("local", False)):
        config = OmegaConf.create(
            {
                "hydra": {
                    "runtime": {"choices": {"hydra/launcher": launcher}},
                    "sweep": {"dir": str(tmp_path)},
                }
            }
        )
        reporter = SubmissionReporter(poll_s=0.05)
        reporter.on_multirun_start(config)
        try:
            assert isinstance(SlurmJob.watcher, ControllerCheckedWatcher) is installed
            assert "_stock_watcher" not in {
                k for k, v in reporter.__getstate__().items() if v is not None
            }
        finally:
            reporter.on_multirun_end(config)
        assert SlurmJob.watcher is stock


@on_two_nodes
def test_two_nodes_each_with_its_own_name_and_address():
    states = dict(
        line.split() for line in _run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.splitlines()
    )
    assert states == {"gptlab-n1": "idle", "gptlab-n2": "idle"}, states
    t0 = time.monotonic()
    names = _run(["srun", f"--partition={PARTITION}", "-N2", "-n2", "hostname"]).stdout.split()
    print(f"\nsrun -N2 -n2 hostname: {time.monotonic() - t0:.2f} s")
    assert sorted(names) == NODES
    # each node's own name resolves, there, to its own address (what gloo does to find a rank)
    out = _run(
        ["srun", f"--partition={PARTITION}", "-N2", "-n2", sys.executable, "-c",
         "import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))"]
    ).stdout  # fmt: skip
    addresses = dict(line.split() for line in out.splitlines())
    assert addresses == {"gptlab-n1": "198.18.0.11", "gptlab-n2": "198.18.0.12"}, out


def _sweep(cwd: Path, *extra: str) -> subprocess.Popen:
    cwd.mkdir()
    return start_cli(
        ["gptlab.train", "-m", "hydra/launcher=slurm_local", *extra], cwd, merge_stderr=True
    )


def _sbatch(cwd: Path, nodes: int, tasks_per_node: int, *overrides: str) -> str:
    cwd.mkdir()
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--partition={PARTITION}",
            f"--nodes={nodes}",
            f"--ntasks-per-node={tasks_per_node}",
            f"--output={cwd}/slurm-%j.out",
            str(SBATCH_SCRIPT),
            *overrides,
        ],
        cwd=cwd,
        env=cli_env({"GPTLAB_PYTHON": sys.executable}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().split(";")[0]


@on_two_nodes
def test_ddp_across_two_nodes_matches_one_process(tmp_path, shakespeare):
    """Global batch 8 on 1 process, on 2 nodes x 1 task and 2 nodes x 2 tasks (submitit; DDP, and
    HSDP on a 2 x 2 mesh), and on 2 x 1 through launch/sbatch_gptlab.sh: the same losses; each job
    says which nodes it ran on, in slurm.json and in MLflow (world size, nodes). The five run at
    once."""
    args = [*COMMON, f"data.path={shakespeare}"]
    t0 = time.monotonic()
    ref = start_cli(["gptlab.train", *args, "hardware=cpu"], tmp_path, merge_stderr=True)
    sweeps = {
        "2x1": _sweep(tmp_path / "2x1", *args, "hardware.nodes=2"),
        "2x2": _sweep(tmp_path / "2x2", *args, "hardware.nodes=2", "hardware.nproc_per_node=2"),
        # sharded within each node, replicated across the two
        "hsdp": _sweep(
            tmp_path / "hsdp",
            *args,
            "hardware.nodes=2",
            "hardware.nproc_per_node=2",
            "parallelism=hsdp",
        ),
    }
    sbatch_job = _sbatch(tmp_path / "sbatch", 2, 1, *args)
    try:
        out = {name: p.communicate(timeout=600)[0] for name, p in {"ref": ref, **sweeps}.items()}
        _wait(
            lambda: _job_state(sbatch_job) not in ("PENDING", "RUNNING", "COMPLETING"),
            300,
            "the sbatch job",
        )
    finally:
        for p in (ref, *sweeps.values()):
            if p.poll() is None:
                p.kill()
        subprocess.run(["scancel", sbatch_job], capture_output=True)
    print(
        f"\n1 process + 2x1, 2x2, 2x2 hsdp sweeps + sbatch 2x1, at once: "
        f"{time.monotonic() - t0:.1f} s"
    )
    for name, p in {"ref": ref, **sweeps}.items():
        assert p.returncode == 0, f"{name}:\n{out[name][-3000:]}"
    sbatch_log = next((tmp_path / "sbatch").glob("slurm-*.out")).read_text()
    assert _job_state(sbatch_job) == "COMPLETED", sbatch_log[-3000:]

    (ref_dir,) = (tmp_path / "outputs" / "runs").iterdir()
    ref_train, ref_val = _losses(ref_dir)
    assert len(ref_train) == 8 and len(ref_val) == 2
    run_dirs = {name: next((tmp_path / name).glob("outputs/sweeps/*/0")) for name in sweeps}
    run_dirs["sbatch"] = tmp_path / "sbatch" / "outputs" / "runs" / f"slurm-{sbatch_job}"
    for name, world in (("2x1", 2), ("2x2", 4), ("hsdp", 4), ("sbatch", 2)):
        run_dir = run_dirs[name]
        train, val = _losses(run_dir)
        assert train == pytest.approx(ref_train, abs=1e-5), name
        assert val == pytest.approx(ref_val, abs=1e-5), name
        job = json.loads((run_dir / "slurm.json").read_text())
        assert job["nodes"] == NODES, (name, job)
        run = _mlflow_run(tmp_path / name, run_dir)
        assert run.info.status == "FINISHED", name
        assert run.data.params["derived.world_size"] == str(world), name
        assert run.data.params["hardware.nodes"] == "2", name  # the config, flattened into params
    logs = "".join(
        p.read_text() for p in (tmp_path / "2x2").glob("outputs/sweeps/*/.submitit/*/*_log.*")
    )
    assert "= 2 x 1 accum x 4 ranks" in logs, logs[-2000:]
    hsdp_logs = "".join(
        p.read_text() for p in (tmp_path / "hsdp").glob("outputs/sweeps/*/.submitit/*/*_log.out")
    )
    assert "hsdp mesh 2x2 (replicate x shard)" in hsdp_logs, hsdp_logs[-2000:]
    assert "socket.cpp" not in logs + sbatch_log  # every rank's address has a name on both sides
    script = next(
        (tmp_path / "2x2").glob("outputs/sweeps/*/.submitit/*/*_submission.sh")
    ).read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "export SLURM_KILL_BAD_EXIT=1",
    ):
        assert line in script, script
    assert "hardware.nodes=2 hardware.nproc_per_node=1" in sbatch_log, sbatch_log[:2000]


@on_two_nodes
def test_a_task_killed_on_the_second_node_fails_the_job_naming_rank_and_node(tmp_path, shakespeare):
    proc = _sweep(
        tmp_path / "kill",
        "model=gpt_nano",
        f"data.path={shakespeare}",
        "hardware.nodes=2",
        "train.max_steps=100000",
        "train.log_every=10",
        "train.checkpoint_every=10",
        "train.eval_every=100000",
        "train.eval_steps=2",
        "train.sample_tokens=0",
        "train.max_restarts=0",  # not submitted again (the test below is the one that is)
    )
    cwd = tmp_path / "kill"
    try:
        checkpoints = lambda: list(cwd.glob("outputs/sweeps/*/0/checkpoints/ckpt_*"))  # noqa: E731
        _wait(checkpoints, 180, "a first checkpoint", proc)
        run_dir = checkpoints()[0].parent.parent
        job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
        pid, node = _wait(
            lambda: _task_pid(job_id, 1) if _task_pid(job_id, 1)[0] else None, 30, "rank 1's pid"
        )
        assert node == "gptlab-n2"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _wait(lambda: _job_state(job_id) not in ("RUNNING", "COMPLETING"), 30, "the job to end")
        ended = time.monotonic() - t0
        state = _job_state(job_id)
        out = proc.communicate(timeout=120)[0]
        reported = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    print(
        f"\nSIGKILL of rank 1 on gptlab-n2: job {state} after {ended:.1f} s, launcher exited after "
        f"{reported:.1f} s"
    )
    assert state == "FAILED"
    assert proc.returncode != 0
    line = f"SLURM job {job_id}: rank 1 on gptlab-n2: Killed"
    assert line in out, out[-4000:]
    assert list((run_dir / "checkpoints").glob("ckpt_*")), "the last checkpoint is gone"
    run = _mlflow_run(cwd, run_dir)
    assert run.info.status == "FAILED"
    assert "rank 1 on gptlab-n2: Killed" in run.data.tags.get("slurm_error", ""), run.data.tags


@on_two_nodes
def test_a_job_that_lost_its_node_is_resubmitted_without_it_and_finishes(tmp_path, shakespeare):
    """A one-node job on the 2-node cluster: its task is SIGKILLed mid-run (as a node's loss kills
    it); the launcher submits the job again without that node, and it resumes on the other one
    from its latest checkpoint, in the same run folder, and finishes."""
    cwd = tmp_path / "lost"
    proc = _sweep(
        cwd, "model=gpt_nano", f"data.path={shakespeare}", "train.max_steps=300",
        "train.log_every=10", "train.checkpoint_every=20", "train.eval_every=300",
        "train.eval_steps=2", "train.sample_tokens=0",
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        checkpoints = lambda: list(cwd.glob("outputs/sweeps/*/0/checkpoints/ckpt_*"))  # noqa: E731
        _wait(checkpoints, 180, "a first checkpoint", proc)
        run_dir = checkpoints()[0].parent.parent
        job_id = str(json.loads((run_dir / "slurm.json").read_text())["job_id"])
        pid, node = _wait(
            lambda: _task_pid(job_id, 0) if _task_pid(job_id, 0)[0] else None, 30, "rank 0's pid"
        )
        os.kill(pid, signal.SIGKILL)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    print(
        f"\nSIGKILL of rank 0 on {node} -> resubmitted -> finished: {time.monotonic() - t0:.1f} s"
    )
    assert proc.returncode == 0, out[-3000:] + _job_records(job_id)
    (other,) = set(NODES) - {node}
    line = re.search(
        rf"SLURM job {job_id} failed \(rank 0 on {node}: Killed\): resubmitted as job (\d+) "
        rf"without {node} \(restart 1 of train.max_restarts=3\)",
        out,
    )
    assert line, out[-3000:]
    new_job = line.group(1)
    # the new job asked SLURM to leave the node out, and ran on the other one
    script = next(cwd.glob(f"outputs/sweeps/*/.submitit/{new_job}/{new_job}_submission.sh"))
    assert f"#SBATCH --exclude={node}" in script.read_text()
    job = json.loads((run_dir / "slurm.json").read_text())
    assert (str(job["job_id"]), job["nodes"]) == (new_job, [other])
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 300 and results["stopped_by"] is None
    (restart,) = results["restarts"]
    assert restart["cause"] == f"SLURM job {job_id}: rank 0 on {node}: Killed"
    assert restart["resumed_from"] % 20 == 0 and restart["resumed_from"] > 0, restart
    assert restart["died_at_step"] >= restart["resumed_from"], restart
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train_loss" in r]
    assert steps == [1, *range(10, 301, 10)], steps  # each step logged once, none missing


def _lose_node(node: str) -> None:
    """A node's loss: SIGKILL to its slurmd and every process of its network namespace (slurmstepd,
    the batch script, srun, the tasks), until none is left."""
    for _ in range(20):
        pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True)
        if not pids.stdout.split():
            return
        subprocess.run(["kill", "-KILL", *pids.stdout.split()], capture_output=True)
        time.sleep(0.2)
    pytest.fail(f"processes of {node} outlived SIGKILL")


def _node_state(node: str) -> str:
    return _run(["sinfo", "-h", "-n", node, "-o", "%T"]).stdout.strip()


@on_two_nodes
def test_a_lost_node_is_detected_fast_and_its_job_requeued_onto_the_other(tmp_path, shakespeare):
    """gptlab-n2, running a one-node job (gptlab-n1 held by another), is lost: the controller marks
    it down within SlurmdTimeout, SLURM requeues the job (JobRequeue=1, the default), which starts
    again as the same job on gptlab-n1, resumes from its latest checkpoint and records the restart;
    `up` brings gptlab-n2 back."""
    cwd = tmp_path / "node"
    hold = f"sbatch --parsable -p {PARTITION} -w gptlab-n1 --exclusive -o /dev/null --wrap"
    hold = _run([*hold.split(), "sleep 600"]).stdout.strip()
    train = "train.max_steps=200 train.log_every=10 train.checkpoint_every=20 train.eval_every=200"
    proc = _sweep(
        cwd,
        "model=gpt_nano",
        f"data.path={shakespeare}",
        *train.split(),
        "train.eval_steps=2",
        "train.sample_tokens=0",
    )
    try:
        checkpoints = lambda: list(cwd.glob("outputs/sweeps/*/0/checkpoints/ckpt_*"))  # noqa: E731
        _wait(checkpoints, 180, "a first checkpoint", proc)
        _run(["scancel", hold])
        run_dir = checkpoints()[0].parent.parent
        job_id = str(json.loads((run_dir / "slurm.json").read_text())["job_id"])
        assert _job_nodes(run_dir) == (job_id, ["gptlab-n2"])
        t0 = time.monotonic()
        _lose_node("gptlab-n2")
        _wait(lambda: "down" in _node_state("gptlab-n2"), 90, "gptlab-n2 to be down", proc)
        detected = time.monotonic() - t0
        _wait(lambda: _job_state(job_id) != "RUNNING", 60, "the job to leave gptlab-n2", proc)
        if _job_state(job_id) == "PENDING":  # a requeued job is held a while (BeginTime)
            _run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        subprocess.run(["scancel", hold], capture_output=True)
        r, took = _local_slurm("up", nodes=2)  # restarts gptlab-n2's slurmd; it returns to service
        assert r.returncode == 0, r.stdout + r.stderr
    print(f"\ngptlab-n2 lost: down after {detected:.1f} s; back with `up` in {took:.1f} s")
    assert proc.returncode == 0, out[-3000:] + _job_records(job_id)
    # the job's result is written before its batch step ends: slurmdbd has the end a moment later
    starts = _wait(lambda: _ended(_sacct_starts(job_id)), 60, "sacct to record the job's end")
    assert starts.split() == ["NODE_FAIL|gptlab-n2", "COMPLETED|gptlab-n1"], starts
    assert _job_nodes(run_dir) == (job_id, ["gptlab-n1"])
    assert "resubmitted" not in out  # SLURM's requeue: no failure the launcher saw
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 200, results
    (restart,) = results["restarts"]  # recorded by the start SLURM's requeue made
    assert restart["launcher"] == "slurm" and f"requeued job {job_id}" in restart["cause"]
    assert restart["died_at_step"] > restart["resumed_from"], restart
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train_loss" in r] == [1, *range(10, 201, 10)]
    assert _node_count() == 2 and _node_state("gptlab-n2") == "idle"


@on_two_nodes
def test_a_taken_rendezvous_port_fails_the_job_at_once_with_one_line(tmp_path, shakespeare):
    """Something on the first node listens on the job's rendezvous port: rank 0 says so in one line
    and exits, and kill-on-bad-exit ends rank 1 (waiting for the rendezvous) at once."""
    port = 31999  # given as MASTER_PORT, which wins over the port derived from the job id
    holder = subprocess.Popen(
        ["nsenter", "--net=/run/netns/gptlab-n1", sys.executable, "-c",
         f"import socket, time; s = socket.socket(); s.bind(('', {port})); s.listen(); "
         f"print('ready', flush=True); "
         "time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    cwd = tmp_path / "port"
    cwd.mkdir()
    try:
        assert holder.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "gptlab.train",
                "-m",
                "hydra/launcher=slurm_local",
                *COMMON,
                f"data.path={shakespeare}",
                "hardware.nodes=2",
            ],
            cwd=cwd,
            env=cli_env({"MASTER_PORT": str(port)}),
            capture_output=True,
            text=True,
            timeout=240,
        )
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    job_id = next(cwd.glob("outputs/sweeps/*/.submitit/*/*_submission.sh")).parent.name
    state, elapsed = _run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ElapsedRaw"]
    ).stdout.split("|")
    print(
        f"\nrendezvous port taken: job {state} after {elapsed.strip()} s in SLURM, launcher exited "
        f"after {took:.1f} s"
    )
    assert state == "FAILED" and int(elapsed) < 30
    line = (
        f"gptlab: error: rank 0 cannot listen on the rendezvous port {port} on gptlab-n1 "
        "(Address already in use)"
    )
    assert line in out, out[-3000:]
    assert f"SLURM job {job_id}: rank 0 on gptlab-n1: Exited with exit code 2" in out, out[-3000:]


@on_two_nodes
def test_usr2_requeues_a_two_node_job_that_resumes_in_the_same_run_folder(tmp_path, shakespeare):
    """SIGUSR2 to every task (preemption): they agree to stop, rank 0 saves, submitit requeues the
    job, and the new start, on both nodes again, resumes in the same run folder and MLflow run."""
    proc = _sweep(
        tmp_path / "requeue", "model=gpt_nano", f"data.path={shakespeare}", "hardware.nodes=2",
        "train.max_steps=60", "train.log_every=5", "train.eval_every=60", "train.eval_steps=2",
        "train.sample_tokens=0", "hydra.launcher.max_num_timeout=2",
    )  # fmt: skip
    cwd = tmp_path / "requeue"
    t0 = time.monotonic()
    try:
        metrics = lambda: list(cwd.glob("outputs/sweeps/*/0/metrics.jsonl"))  # noqa: E731
        _wait(
            lambda: metrics() and len(metrics()[0].read_text().splitlines()) >= 2,
            180,
            "training to start",
            proc,
        )
        run_dir = metrics()[0].parent
        job_id = str(json.loads((run_dir / "slurm.json").read_text())["job_id"])
        _run(["scancel", "--signal=USR2", job_id])
        # SLURM holds a requeued job for a while (BeginTime); let it start again at once
        _wait(
            lambda: "BeginTime" in _run(["squeue", "-h", "-j", job_id, "-o", "%r"]).stdout,
            120,
            "the requeue",
            proc,
        )
        _run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    print(f"\nUSR2 -> requeue -> finish on 2 nodes: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, out[-3000:] + _job_records(job_id)
    assert_resumed_in_one_run(run_dir, job_id, 60)
    assert json.loads((run_dir / "slurm.json").read_text())["nodes"] == NODES
    assert "rank 0 on" not in out  # a requeue is not a failure


def _leftovers() -> Dict[str, List[str]]:
    """What of the cluster still exists on this machine."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    daemons = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        if (
            re.search(r"\b(slurmctld|slurmd|slurmstepd|slurmdbd)\b", cmd)
            or f"--datadir={STATE_DIR}" in cmd
        ):
            daemons.append(f"{pid}: {cmd}")
    return {
        "netns": [ln for ln in netns.splitlines() if ln.startswith("gptlab-")],
        "links": [ln for ln in links.splitlines() if re.search(r"\d+: (gptlab-br0|gl-n\d+)\b", ln)],
        "hosts": [
            ln
            for ln in Path("/etc/hosts").read_text().splitlines()
            if HOSTS_MARK in ln or "gptlab-n" in ln
        ],
        "daemons": daemons,
    }


@on_two_nodes
def test_down_leaves_nothing_behind():
    before = _leftovers()
    assert before["netns"] and before["links"] and before["hosts"] and before["daemons"], before
    r, took = _local_slurm("down")
    print(f"\nlocal_slurm.sh down (2 nodes): {took:.1f} s")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _leftovers() == {"netns": [], "links": [], "hosts": [], "daemons": []}
    # and the clients say plainly that there is no cluster, without trying a gone network
    r = subprocess.run(["sinfo"], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    status, _ = _local_slurm("status")
    assert status.returncode != 0 and "slurmctld: not running" in status.stdout, status.stdout
