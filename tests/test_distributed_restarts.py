"""Restarts after a failure (gptlab/distributed/restarts.py): progress marks, the launcher's failure
record, the budget's one line, and the next start's record of the restarts. The real processes
that die and start again are in test_distributed_processes.py."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from gptlab.distributed import restarts
from gptlab.records import layout


def test_the_furthest_step_any_rank_started_is_read_back(tmp_path):
    assert restarts.furthest_step(tmp_path) is None
    first, second = restarts.StepMarks(tmp_path, 0), restarts.StepMarks(tmp_path, 1)
    lr_at = second.marking(lambda step: 0.5 * step)
    first.mark(11)
    assert lr_at(11) == 5.5  # the rate of the step after 11: step 12 has started
    assert restarts.furthest_step(tmp_path) == 12
    restarts.clear_marks(tmp_path)
    assert restarts.furthest_step(tmp_path) is None


def test_how_a_worker_ended_in_a_few_words():
    assert restarts.how_it_ended(17) == "exit 17"
    assert restarts.how_it_ended(-int(signal.SIGKILL)) == "SIGKILL"
    assert restarts.how_it_ended(-200) == "signal 200"


def _failure(rank=1, ended="exit 17", step=12):
    return {"launcher": "gptlab", "rank": rank, "ended": ended, "died_at_step": step}


def test_the_budget_line_counts_the_same_death_or_the_restarts_made():
    same = [_failure(), _failure(), _failure()]
    assert restarts.budget_line(same, 2) == (
        "rank 1 died at step 12 (exit 17) 3 times; no restarts left (train.max_restarts=2)"
    )
    mixed = [_failure(step=12), _failure(0, "SIGKILL", None)]
    assert restarts.budget_line(mixed, 1) == (
        "rank 0 died before its first step (SIGKILL), after 1 restart(s); no restarts left "
        "(train.max_restarts=1)"
    )


class _Tracker:
    def __init__(self):
        self.metrics, self.tags = [], {}

    def log_metrics(self, step, metrics):
        self.metrics.append((step, metrics))

    def set_tag(self, key, value):
        self.tags[key] = value


def _run(run_dir: Path, start_step: int, rank: int = 0, world_size: int = 2):
    return SimpleNamespace(
        run_dir=run_dir,
        checkpoint_dir=run_dir / layout.CHECKPOINTS,
        start_step=start_step,
        tracker=_Tracker(),
        dist=SimpleNamespace(rank=rank, world_size=world_size, is_main=rank == 0),
        lr_at=lambda step: 1.0,
    )


def test_the_next_start_completes_the_launchers_failure_once(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    (tmp_path / layout.CHECKPOINTS).mkdir()
    (tmp_path / layout.CHECKPOINTS / "ckpt_00000010.pt").write_bytes(b"")
    restarts.StepMarks(tmp_path, 1).mark(12)
    restarts.leave_failure(tmp_path, restarts.failure(1, 17, tmp_path, started_at=0.0))
    run = _run(tmp_path, start_step=10)
    (event,) = restarts.begin(run)
    assert event["cause"] == "rank 1 died at step 12 (exit 17)" and event["restart"] == 1
    assert (event["resumed_from"], event["steps_lost"]) == (10, 2)
    assert 0 <= event["seconds_lost"] < 600  # since the checkpoint was written, not the epoch
    assert run.tracker.metrics == [(10, {"restarts": 1})] and run.tracker.tags == {"restarts": "1"}
    assert not (tmp_path / layout.FAILURE).exists()
    saved = json.loads((tmp_path / layout.RESTARTS).read_text())["restarts"]
    assert saved == [event]
    # a later start with nothing new: the same history, nothing logged again
    again = _run(tmp_path, start_step=20)
    assert restarts.begin(again) == [event] and again.tracker.metrics == []


def test_a_torchrun_restart_is_recorded_by_the_start_it_made(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    restarts.StepMarks(tmp_path, 0).mark(7)
    (event,) = restarts.begin(_run(tmp_path, start_step=5))
    assert event["launcher"] == "torchrun" and event["rank"] is None
    assert "restart 1 of --max-restarts=2" in event["cause"]
    assert (event["died_at_step"], event["steps_lost"], event["seconds_lost"]) == (7, 2, None)
    # the same restart's other start (or a rebuilt rank 0) does not record it twice
    assert len(restarts.begin(_run(tmp_path, start_step=5))) == 1


@pytest.mark.parametrize("world_size, torchrun, marks", [(1, False, False), (2, False, True),
                                                          (1, True, True)])  # fmt: skip
def test_steps_are_marked_only_where_a_launcher_may_start_the_job_again(
    tmp_path, monkeypatch, world_size, torchrun, marks
):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    run = _run(tmp_path, start_step=0, rank=1, world_size=world_size)
    assert restarts.begin(run) == []  # not rank 0: it records nothing
    run.lr_at(3)
    assert restarts.furthest_step(tmp_path) == (4 if marks else None)


def test_a_negative_restart_budget_is_one_line():
    from helpers import compose_config

    from gptlab.config import to_config
    from gptlab.errors import GptlabError

    with pytest.raises(GptlabError, match=r"^train.max_restarts: must be >= 0"):
        to_config(compose_config(["train.max_restarts=-1"]))


def test_steps_are_marked_in_a_slurm_task_whose_job_the_launcher_may_submit_again(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    run = _run(tmp_path, start_step=0, rank=0, world_size=1)
    assert restarts.begin(run) == []
    run.lr_at(3)
    assert restarts.furthest_step(tmp_path) == 4


def test_a_slurm_jobs_failure_is_recorded_with_the_launchers_cause(tmp_path, monkeypatch):
    from gptlab.distributed.slurm_launcher import slurm_failure

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    dead = {"rank": 1, "node": "gptlab-n2", "ended": "Killed"}
    restarts.leave_failure(tmp_path, slurm_failure("105", "FAILED", dead, 12, started_at=None))
    (event,) = restarts.begin(_run(tmp_path, start_step=10))
    assert event["cause"] == "SLURM job 105: rank 1 on gptlab-n2: Killed"
    assert (event["launcher"], event["rank"], event["node"]) == ("slurm", 1, "gptlab-n2")
    assert (event["died_at_step"], event["resumed_from"], event["steps_lost"]) == (12, 10, 2)


def test_slurms_own_requeue_after_a_failure_is_recorded_once_and_a_stop_is_not(
    tmp_path, monkeypatch
):
    """A job SLURM requeued (a lost node) whose ranks had gone past the resumed checkpoint is one
    restart; the same count again, a requeue after a stop (resumed where it stopped), or a first
    start is none."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    restarts.StepMarks(tmp_path, 0).mark(12)
    restarts.StepMarks(tmp_path, 1).mark(11)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert restarts.slurm_requeue_failure(tmp_path, [], 10) == []  # a first start
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert restarts.slurm_requeue_failure(tmp_path, [], 12) == []  # stopped at 12, resumed there
    (failure,) = restarts.slurm_requeue_failure(tmp_path, [], 10)
    assert failure["launcher"] == "slurm" and failure["died_at_step"] == 12
    assert "requeued job 41 after it failed" in failure["cause"]
    event = restarts.complete(failure, 10, None, 1)
    assert (event["steps_lost"], event["cause"]) == (2, failure["cause"])
    assert restarts.slurm_requeue_failure(tmp_path, [event], 10) == []  # recorded already
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert len(restarts.slurm_requeue_failure(tmp_path, [event], 10)) == 1  # a second requeue
