"""The real command in a subprocess, as a user runs it."""

import json
import sqlite3

import pytest
from conftest import run_cli


@pytest.mark.slow
def test_train_command_writes_run_folder_and_mlflow_run(tmp_path, shakespeare):
    r = run_cli(
        [
            "gptlab.train",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "train.max_steps=30",
            "train.eval_every=15",
            "train.eval_steps=4",
            "train.log_every=10",
            "train.batch_size=8",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    # plain progress lines when not on a terminal, then the UI command for the store used
    assert "step 10/30 | loss" in r.stdout
    assert "--- sample ---" in r.stdout and "results: best val loss" in r.stdout  # the train module's own lines
    # the run's lines, stamped, in its log file; MLflow's and other libraries' INFO chatter nowhere
    assert "INFO" not in r.stdout + r.stderr and "alembic" not in r.stdout + r.stderr, r.stderr[-2000:]
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/outputs/mlflow.db" in r.stdout
    (run_dir,) = list((tmp_path / "outputs" / "runs").iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 30 and results["best_val_loss"] < 4.0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 30 and "val_loss" in rows[-1]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "samples.txt").is_file()
    log_lines = (run_dir / "train.log").read_text()
    assert "][gptlab.console][INFO] step 10/30 | loss" in log_lines and "results: best val loss" in log_lines
    db = sqlite3.connect(tmp_path / "outputs" / "mlflow.db")
    (status,) = db.execute("select status from runs where run_uuid = ?", (results["mlflow_run_id"],)).fetchone()
    assert status == "FINISHED"


@pytest.mark.slow
def test_sweep_runs_each_job_into_its_own_folder(tmp_path, shakespeare):
    r = run_cli(
        [
            "gptlab.train",
            "-m",
            "model=gpt_nano",
            f"data.path={shakespeare}",
            "train.max_steps=5",
            "train.eval_steps=1",
            "train.batch_size=4",
            "tracking.mlflow=false",
            "optimizer.lr=1e-3,3e-3",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (sweep,) = list((tmp_path / "outputs" / "sweeps").iterdir())
    assert [json.loads((sweep / j / "results.json").read_text())["steps"] for j in ("0", "1")] == [5, 5]
    # each job trained with its own lr: every lr job 1 logged is job 0's times 3 (the same schedule)
    lrs = {}
    for job in ("0", "1"):
        rows = [json.loads(x) for x in (sweep / job / "metrics.jsonl").read_text().splitlines()]
        lrs[job] = [r["lr"] for r in rows if "lr" in r]
    assert len(lrs["0"]) >= 2 and lrs["1"] == pytest.approx([3 * x for x in lrs["0"]], rel=1e-9)
    assert max(lrs["1"]) <= 3e-3
