"""The local SLURM cluster (tests/cluster/local_slurm.sh) and the Hydra launcher presets, end to
end.

These tests need a running cluster: `bash tests/cluster/local_slurm.sh up` (.ci/run starts one).
Without one they are skipped, except in CI (CI=true), where a missing cluster is a failure.

The jobs that record in MLflow log to the session's team server (launch/mlflow_server.sh: mlflow
server on PostgreSQL, at $GPTLAB_TEST_MLFLOW_URI, which .ci/setup.d/mlflow_server.sh starts), as a
cluster's jobs would. Without it (outside CI) they log to an `mlflow server` on a SQLite file
instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List

import pytest
from helpers import need, run_cli, start_cli, start_mlflow_server
from team_server import session_server_uri

pytestmark = pytest.mark.slow

PARTITION = os.environ.get(
    "GPTLAB_SLURM_PARTITION", "local"
)  # as tests/cluster/local_slurm.sh names it


def _cluster_problem() -> str | None:
    """Why the local cluster can't be used, or None when sinfo shows a usable node."""
    if shutil.which("sinfo") is None:
        return "sinfo is not installed"
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 30 s"
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return f"sinfo failed: {lines[-1] if lines else f'exit {r.returncode}'}"
    states = r.stdout.split()
    if not any(
        s.rstrip("*~#").startswith(("idle", "mixed", "allocated", "completing")) for s in states
    ):
        return f"no usable node (sinfo states: {states})"
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    problem = _cluster_problem()
    if problem:
        need(
            f"no local SLURM cluster ({problem}); start one with "
            "`bash tests/cluster/local_slurm.sh up`"
        )


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """The tracking server the jobs log to: the session's team server, else (outside CI) an `mlflow
    server` on a SQLite file for this module."""
    uri = session_server_uri()
    if uri:
        yield uri
        return
    server, uri = start_mlflow_server(tmp_path_factory.mktemp("mlflow-store"))
    try:
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def new_experiment(name: str) -> str:
    # the session's server outlives a test: names never repeat
    return f"{name}-{uuid.uuid4().hex[:6]}"


def sweep_runs(uri: str, experiment: str):
    """(the parent run, its children) of the one sweep recorded in the experiment."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
    kids = [x for x in runs if "mlflow.parentRunId" in x.data.tags]
    assert len(parents) == 1, [(x.info.run_name, x.data.tags) for x in runs]
    assert {k.data.tags["mlflow.parentRunId"] for k in kids} == {parents[0].info.run_id}
    return parents[0], kids


def _run(cmd: List[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def test_cluster_runs_srun_and_sbatch_with_fake_gpus(tmp_path):
    # 8 tasks on the 16 declared CPUs (2 real cores), each seeing the 8 fake GPUs.
    r = _run(
        [
            "srun",
            f"--partition={PARTITION}",
            "--ntasks=8",
            "--gpus-per-node=8",
            "--time=2",
            "bash",
            "-c",
            'echo "$SLURM_PROCID $SLURM_NTASKS $CUDA_VISIBLE_DEVICES"',
        ],
        tmp_path,
    )
    rows = sorted(line.split() for line in r.stdout.strip().splitlines())
    assert [int(rank) for rank, _, _ in rows] == list(range(8)), r.stdout
    assert {(n, gpus) for _, n, gpus in rows} == {("8", "0,1,2,3,4,5,6,7")}, r.stdout

    out = tmp_path / "batch.out"
    _run(
        [
            "sbatch",
            "--wait",
            f"--partition={PARTITION}",
            "--time=2",
            f"--output={out}",
            "--wrap",
            "echo batch job $SLURM_JOB_ID on $SLURM_JOB_NODELIST",
        ],
        tmp_path,
    )
    assert re.match(r"batch job \d+ on \S+", out.read_text()), out.read_text()


def test_the_sweep_waits_for_a_job_that_accounting_calls_ended_while_the_controller_runs_it(
    tmp_path,
):
    """submitit takes sacct's first ended state as final; a requeued job can read so while SLURM's
    controller has it pending again. The watcher that SubmissionReporter installs for SLURM sweeps
    (ControllerCheckedWatcher) asks the controller first."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    from gptlab.distributed.slurm import ControllerCheckedWatcher, controller_state

    r = _run(
        [
            "sbatch",
            "--parsable",
            f"--partition={PARTITION}",
            "--time=2",
            f"--output={tmp_path}/%j.out",
            "--wrap",
            "exit 3",
        ],
        tmp_path,
    )
    job = r.stdout.strip().split(";")[0]
    stock, ours = SlurmInfoWatcher(delay_s=600), ControllerCheckedWatcher(delay_s=600)
    try:
        deadline = time.monotonic() + 60
        for watcher in (stock, ours):
            watcher.register_job(job)
            while watcher.get_state(job, mode="force") != "FAILED":
                assert time.monotonic() < deadline, (
                    f"job {job}: {watcher.get_state(job, mode='cache')}"
                )
                time.sleep(0.5)
        # both agree: it ended
        assert stock.is_done(job, mode="cache") and ours.is_done(job, mode="cache")
        # the job comes back (held, so that it stays pending): what both last read from sacct is
        # stale
        _run(["scontrol", "requeuehold", job], tmp_path)
        assert controller_state(job) == "PENDING"
        assert stock.get_state(job, mode="cache") == ours.get_state(job, mode="cache") == "FAILED"
        # submitit's own: ended (the launcher would give up)
        assert stock.is_done(job, mode="cache")
        assert not ours.is_done(job, mode="cache")  # gptlab's: the controller has it pending
        # and sacct, asked again, says so too (or not yet)
        assert not ours.is_done(job, mode="force")
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    # cancelled: the controller and accounting agree again
    while not ours.is_done(job, mode="force"):
        assert time.monotonic() < deadline, (
            controller_state(job),
            ours.get_state(job, mode="cache"),
        )
        time.sleep(0.5)
    assert controller_state(job) == "CANCELLED"


def test_sweep_on_slurm_local_runs_each_job_as_a_slurm_job(shakespeare, tmp_path, tracking_server):
    experiment = new_experiment("slurm-sweep")
    r = run_cli(
        [
            "gptlab.train",
            "-m",
            "hydra/launcher=slurm_local",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "train.max_steps=10",
            "train.batch_size=4",
            "train.eval_every=10",
            "train.eval_steps=2",
            "train.sample_tokens=0",
            f"tracking.uri={tracking_server}",
            f"tracking.experiment={experiment}",
            "optimizer.lr=1e-3,2e-3,3e-3",
            # 2 of the fake GPUs each (training stays on the CPU): accounting's device-hours
            "hydra.launcher.gpus_per_node=2",
            "hardware.cost_per_device_hour=3.0",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sweeps = list((tmp_path / "outputs" / "sweeps").iterdir())
    assert len(sweeps) == 1, sweeps
    sweep = sweeps[0]
    for num in ("0", "1", "2"):
        assert (sweep / num / "results.json").is_file(), sorted(
            p.name for p in (sweep / num).iterdir()
        )
        # the run folder says which SLURM job it was and where that job's logs are
        job = json.loads((sweep / num / "slurm.json").read_text())
        assert Path(job["stdout"]).is_file() and job["job_id"]
        # device-hours: SLURM's elapsed seconds (when results.json was written) x 2 GPUs, not the
        # training wall time x 1 process; cost at the price given
        results = json.loads((sweep / num / "results.json").read_text())
        seconds = results["device_hours"] * 3600 / 2
        assert seconds == pytest.approx(round(seconds), abs=1e-6), results
        acct = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-j", str(job["job_id"]), "-o", "ElapsedRaw"],
            capture_output=True, text=True, timeout=20,
        ).stdout.split()  # fmt: skip
        assert int(results["wall_s"]) <= round(seconds) <= int(acct[0]), (results, acct)
        assert results["cost"] == pytest.approx(3.0 * results["device_hours"])
    # One array job of three tasks, on the local partition, one task each (hardware=cpu); its logs
    # sit next to the job folders.
    (submission,) = sweep.glob(".submitit/*/*_submission.sh")
    script = submission.read_text()
    # the launching command said which job it submitted and where its logs are
    assert f"submitted SLURM job {submission.parent.name}; logs: " in r.stdout, r.stdout[-2000:]
    for flag in (
        "--array=0-2",
        f"--partition={PARTITION}",
        "--ntasks-per-node=1",
        "--nodes=1",
        "--signal=USR2@",
    ):
        assert flag in script, script
    job_id = submission.parent.name
    for num in ("0", "1", "2"):
        assert (sweep / ".submitit" / f"{job_id}_{num}" / f"{job_id}_{num}_0_log.out").is_file()
    # the sweep on the tracking server: one parent run, a FINISHED child per job
    parent, kids = sweep_runs(tracking_server, experiment)
    assert [k.info.status for k in kids] == ["FINISHED"] * 3 and parent.info.status == "FINISHED"
    assert sorted(k.data.params["optimizer.lr"] for k in kids) == ["0.001", "0.002", "0.003"]


def _submit_held(args: List[str], sweep: Path, cwd: Path) -> tuple[subprocess.Popen, str, str]:
    """Start `python -m gptlab.train -m ...` with the job held in the queue, so that it never runs;
    return the launcher process, the job id and the submission script submitit wrote."""
    cmd = [
        sys.executable,
        "-m",
        "gptlab.train",
        "-m",
        *args,
        f"hydra.sweep.dir={sweep}",
        "+hydra.launcher.additional_parameters.hold=true",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        found = list(sweep.glob(".submitit/*/*_submission.sh"))
        if found:
            return proc, found[0].parent.name, found[0].read_text()
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    _stop(proc)
    out = proc.communicate(timeout=30)[0]
    pytest.fail(
        f"no submission appeared under {sweep}/.submitit (launcher exit "
        f"{proc.returncode}):\n{out[-4000:]}"
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _job_field(job_id: str, field: str, cwd: Path) -> str:
    out = _run(["scontrol", "show", "job", job_id], cwd).stdout
    match = re.search(rf"\b{field}=(\S+)", out)
    assert match, f"{field} not in:\n{out}"
    return match.group(1)


def test_slurm_a100x8_asks_for_one_node_8_tasks_8_gpus(tmp_path):
    # The real preset, submitted to the local cluster. Only cpus_per_task is lowered: 8 tasks x 8
    # CPUs would not fit the 16 CPUs declared here. The job is held, checked, cancelled; it never
    # runs. The composed 1B recipe, as `--cfg job` shows it ...
    shown = run_cli(
        ["gptlab.train", "experiment=gpt1b_shakespeare", "--cfg", "job"], cwd=tmp_path, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    for line in (
        "name: gpt1b",
        "n_layer: 20",
        "n_embd: 2048",
        "block_size: 2048",
        "batch_size: 64",
        "max_steps: 15000",
        "lr_scaling: sqrt",
        "activation_checkpointing: true",
        "nproc_per_node: 8",
    ):
        assert line in shown.stdout, line
    # ... then submitted with the 8-GPU preset.
    sweep = tmp_path / "sweep"
    proc, job_id, script = _submit_held(
        [
            "hydra/launcher=slurm_a100x8",
            "experiment=gpt1b_shakespeare",
            "hydra.launcher.cpus_per_task=2",
        ],
        sweep,
        tmp_path,
    )
    try:
        for flag in (
            "--nodes=1",
            "--ntasks-per-node=8",
            "--gpus-per-node=8",
            "--signal=USR2@300",
            "--time=1440",
            f"--output={sweep}/.submitit/%j/%j_0_log.out",
        ):
            assert flag in script, script
        assert "--partition" not in script and "--account" not in script, script
        # What the scheduler accepted, not only what was asked.
        assert _job_field(job_id, "NumNodes", tmp_path).startswith("1")
        assert _job_field(job_id, "NumTasks", tmp_path) == "8"
        assert "gpu:8" in _job_field(job_id, "TresPerNode", tmp_path)
        _run(["scancel", job_id], tmp_path)
        # With accounting (sacct) up, submitit sees the cancellation and the launcher ends with an
        # error instead of polling forever.
        out = proc.communicate(timeout=90)[0]
        assert proc.returncode != 0 and "CANCELLED" in out, out[-4000:]
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        _stop(proc)


def test_slurm_local_tasks_per_node_follow_hardware(tmp_path):
    # `tasks_per_node: ${hardware.nproc_per_node}` resolves against the composed config.
    sweep = tmp_path / "sweep"
    proc, job_id, script = _submit_held(
        ["hydra/launcher=slurm_local", "hardware=cpu_x2", "model=gpt_nano"], sweep, tmp_path
    )
    try:
        assert "--ntasks-per-node=2" in script and "--gpus-per-node=0" in script, script
        assert _job_field(job_id, "NumTasks", tmp_path) == "2"
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        _stop(proc)


def assert_resumed_in_one_run(run_dir: Path, job_id, max_steps: int) -> dict:
    """A job stopped by SIGUSR2 and requeued: it finished in run_dir, its two starts' logs say it
    stopped and resumed, both wrote one MLflow run, and each step is logged once. Its results."""
    stopped = [c.name for c in (run_dir / "checkpoints").iterdir()]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == max_steps and results["stopped_by"] is None, results
    logs = "".join(p.read_text() for p in run_dir.parent.glob(f".submitit/{job_id}*/*_log.out"))
    assert "SIGUSR2 received: stopped at step" in logs and "resuming from" in logs, logs[-3000:]
    run_ids = re.findall(r"MLflow run ([0-9a-f]{32})", logs)
    assert len(run_ids) == 2 and len(set(run_ids)) == 1, run_ids  # both starts wrote one MLflow run
    assert results["mlflow_run_id"] == run_ids[0]
    steps = [
        json.loads(x)["step"]
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "train_loss" in x
    ]
    assert steps == sorted(set(steps)) and steps[-1] == max_steps, (steps, stopped)
    return results


def test_preempted_job_is_requeued_and_finishes_in_the_same_run_folder(
    shakespeare, tmp_path, tracking_server
):
    """SIGUSR2 (what SLURM sends before preemption or the time limit): the job saves a checkpoint,
    submitit requeues it, and the new start resumes in the same run folder and MLflow run."""
    args = [
        "gptlab.train",
        "-m",
        "hydra/launcher=slurm_local",
        "model=gpt_nano",
        f"data.path={shakespeare}",
        "train.max_steps=200",
        "train.log_every=10",
        "train.eval_every=100",
        "train.eval_steps=2",
        "train.sample_tokens=0",
        "hydra.launcher.max_num_timeout=2",
        f"tracking.uri={tracking_server}",
        f"tracking.experiment={new_experiment('requeue')}",
    ]
    proc = start_cli(args, tmp_path, merge_stderr=True)
    try:
        deadline = time.time() + 180
        metrics: List[Path] = []
        while not (metrics and len(metrics[0].read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.time() < deadline, "the job never started training"
            time.sleep(0.5)
            metrics = list(tmp_path.glob("outputs/sweeps/*/0/metrics.jsonl"))
        run_dir = metrics[0].parent
        job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
        _run(["scancel", "--signal=USR2", str(job_id)], tmp_path)
        # SLURM holds a requeued job for a while (BeginTime); let it start again at once
        while (
            "BeginTime"
            not in _run(["squeue", "-h", "-j", str(job_id), "-o", "%r"], tmp_path).stdout
        ):
            assert proc.poll() is None and time.time() < deadline + 60, "the job was not requeued"
            time.sleep(0.5)
        _run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], tmp_path)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert_resumed_in_one_run(run_dir, job_id, 200)


def test_ddp_sweep_on_slurm_is_one_mlflow_parent_with_two_finished_children(
    shakespeare, tmp_path, tracking_server
):
    """Two 2-task gloo DDP jobs on SLURM, recorded through the tracking server."""
    experiment = new_experiment("slurm-ddp")
    r = run_cli(
        [
            "gptlab.train",
            "-m",
            "hydra/launcher=slurm_local",
            "hardware=cpu_x2",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "train.max_steps=30",
            "train.batch_size=8",
            "train.eval_every=30",
            "train.eval_steps=2",
            "train.sample_tokens=0",
            f"tracking.uri={tracking_server}",
            f"tracking.experiment={experiment}",
            "optimizer.lr=1e-3,3e-3",
        ],
        cwd=tmp_path,
        timeout=400,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (sweep,) = list((tmp_path / "outputs" / "sweeps").iterdir())
    for num in ("0", "1"):
        results = json.loads((sweep / num / "results.json").read_text())
        assert results["steps"] == 30
    script = next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    assert "--ntasks-per-node=2" in script  # hardware=cpu_x2: two ranks per job
    logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.out"))
    assert "= 4 x 1 accum x 2 ranks" in logs, logs[-2000:]
    parent, kids = sweep_runs(tracking_server, experiment)
    assert len(kids) == 2, [k.info.run_name for k in kids]  # one run per job, not one per rank
    assert {k.info.status for k in kids} == {"FINISHED"} and parent.info.status == "FINISHED"
    assert sorted(k.data.params["optimizer.lr"] for k in kids) == ["0.001", "0.003"]


# a 20-step run that saves every 5 steps (debug=smoke); rank 0 exits abruptly (exit 17) at step 12
RESTARTED = [
    "gptlab.train",
    "-m",
    "hydra/launcher=slurm_local",
    "debug=smoke",
    "train.checkpoint_every=5",
    "train.sample_tokens=0",
    "data.progress=false",
    "train.faults.crash_rank=0",
]


def test_a_job_whose_task_died_is_resubmitted_and_ends_as_the_undisturbed_job(
    shakespeare, tmp_path, tracking_server
):
    """Two jobs of one array, the same but for a crash: job 0's task exits 17 at step 12 (once),
    its SLURM job FAILS, and the launcher submits the same Hydra job again, which resumes from step
    10 in the same run folder and MLflow run; it ends with job 1's losses, the restart recorded."""
    experiment = new_experiment("slurm-restart")
    r = run_cli(
        [
            *RESTARTED,
            f"data.path={shakespeare}",
            "train.faults.crash_once=true",
            "train.faults.crash_at_step=12,null",
            "tracking.mlflow=true",
            "tracking.log_model=false",
            f"tracking.uri={tracking_server}",
            f"tracking.experiment={experiment}",
        ],
        cwd=tmp_path,
        timeout=400,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    line = re.search(
        r"SLURM job (\d+_0) failed \(rank 0 on (\S+): Exited with exit code 17\): resubmitted as "
        r"job (\d+) \(restart 1 of train.max_restarts=3\)",
        out,
    )
    assert line, out[-3000:]  # the 1-node cluster cannot spare its node: none is left out
    failed_job, node, new_job = line.groups()
    (sweep,) = (tmp_path / "outputs" / "sweeps").iterdir()
    crashed, undisturbed = (json.loads((sweep / n / "results.json").read_text()) for n in "01")
    (restart,) = crashed["restarts"]
    assert restart["cause"] == f"SLURM job {failed_job}: rank 0 on {node}: Exited with exit code 17"
    assert (restart["launcher"], restart["rank"], restart["node"]) == ("slurm", 0, node)
    assert (restart["died_at_step"], restart["resumed_from"], restart["steps_lost"]) == (12, 10, 2)
    assert undisturbed["restarts"] == [] and crashed["steps"] == undisturbed["steps"] == 20
    for key in ("train_loss", "val_loss", "best_val_loss"):
        assert crashed[key] == undisturbed[key], key
    # the run folder names the job that finished it
    assert json.loads((sweep / "0" / "slurm.json").read_text())["job_id"] == new_job
    # one MLflow run per Hydra job: the restart went on in the crashed start's run (the one its
    # checkpoint names) instead of opening another, and recorded the restart there
    parent, kids = sweep_runs(tracking_server, experiment)
    assert [k.info.status for k in kids] == ["FINISHED"] * 2 and parent.info.status == "FINISHED"
    restarted = next(k for k in kids if k.info.run_id == crashed["mlflow_run_id"])
    assert restarted.data.tags["run_dir"] == str((sweep / "0").resolve())
    assert restarted.data.tags["restarts"] == "1" and restarted.data.metrics["restarts"] == 1


def test_a_job_that_fails_at_the_same_step_again_stops_with_one_line(shakespeare, tmp_path):
    """A task that dies at step 3 at every start (before the first checkpoint): the launcher submits
    the job once more, and when it dies at the same step again, ends the sweep with one line
    instead of spending the rest of train.max_restarts."""
    r = run_cli(
        [
            *RESTARTED,
            f"data.path={shakespeare}",
            "train.faults.crash_once=false",
            "train.faults.crash_at_step=3",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    jobs = sorted(
        (p.parent.name for p in tmp_path.glob("outputs/sweeps/*/.submitit/*/*.sh")), key=int
    )
    assert len(jobs) == 2, jobs  # the job and its one resubmission
    errors = [x for x in r.stderr.splitlines() if x.startswith("gptlab.train: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert re.fullmatch(
        rf"gptlab.train: error: SLURM job {jobs[1]} failed \(rank 0 on \S+: Exited with exit code "
        rf"17\) at step 3, as job {jobs[0]} did: a repeated failure, not resubmitted \(1 of "
        r"train.max_restarts=3 restarts used\)",
        errors[0],
    ), errors
