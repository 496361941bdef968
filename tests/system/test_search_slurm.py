"""A hyperparameter search on the local SLURM (tests/cluster/local_slurm.sh), its study in the team
server's PostgreSQL (CI: $GPTLAB_TEST_OPTUNA_URL) and its runs on the team tracking server: trials
2 at a time, the sweeper killed mid-search and started again with the same command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from helpers import cli_env, run_cli
from test_slurm import slurm_cluster, tracking_server  # noqa: F401 - fixtures: the cluster, MLflow

optuna = pytest.importorskip("optuna")
pytestmark = pytest.mark.slow


def study_url(tmp_path) -> str:
    """The CI session's PostgreSQL study database, else a SQLite file (a search's default)."""
    return os.environ.get("GPTLAB_TEST_OPTUNA_URL") or f"sqlite:///{tmp_path}/optuna.db"


def finished(url: str, name: str) -> int:
    try:
        trials = optuna.load_study(study_name=name, storage=url).get_trials()
    except KeyError:  # not created yet
        return 0
    return sum(t.state.is_finished() for t in trials)


def test_a_search_on_slurm_survives_its_killed_sweeper(shakespeare, tmp_path, tracking_server):  # noqa: F811
    import mlflow

    name = f"slurm-{uuid.uuid4().hex[:8]}"
    url = study_url(tmp_path)
    # 5 trials, 2 at a time: the first sweeper dies with 2 in flight; the second resumes them and
    # asks the rest
    args = [
        "gptlab.train", "-m", "hparams_search=lr_warmup", "hparams_search.n_trials=5",
        "hydra/launcher=slurm_local",
        "model=gpt_nano", "optimizer=adamw", f"data.path={shakespeare}", "train.max_steps=60",
        "train.eval_every=20", "train.eval_steps=2", "train.batch_size=8", "train.sample_tokens=0",
        f"tracking.uri={tracking_server}", f"tracking.experiment={name}",
        f"hparams_search.study_name={name}", f"hparams_search.storage='{url}'",
    ]  # fmt: skip
    sweeper = subprocess.Popen(
        [sys.executable, "-m", *args], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while finished(url, name) < 2 and sweeper.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    assert sweeper.poll() is None, sweeper.communicate()[0][-3000:]
    assert finished(url, name) >= 2, "no two trials ended in 300 s"
    # the sweeper dies at once; its trials' SLURM jobs go on
    os.kill(sweeper.pid, signal.SIGKILL)
    first = sweeper.communicate(timeout=30)[0]
    assert "2 at a time" in first

    again = run_cli(args, cwd=tmp_path, timeout=600)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    # the dead sweeper's trials were taken over and resumed, not asked again
    assert "its sweeper is gone; resuming it" in out, out[-3000:]
    trials = optuna.load_study(study_name=name, storage=url).get_trials()
    assert [t.number for t in trials] == list(range(5))
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials), (
        [(t.number, t.state.name, t.system_attrs.get("gptlab:error")) for t in trials],
        out[-3000:],
    )
    search = tmp_path / "outputs" / "searches" / name
    results = {}
    for t in trials:
        folder = search / str(t.number)
        results[t.number] = json.loads((folder / "results.json").read_text())
        # each trial trained each step once: a resumed one continues from its checkpoint
        steps = [
            json.loads(ln)["step"] for ln in (folder / "metrics.jsonl").read_text().splitlines()
        ]
        assert len(steps) == len(set(steps)), (t.number, steps)
        if t.state.name == "COMPLETE":
            assert t.value == pytest.approx(results[t.number]["best_val_loss"], rel=1e-12)
    # MLflow: the one parent (taken up again by the second sweeper) with the 5 trials
    client = mlflow.MlflowClient(tracking_server)
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("run_type") == "search"]
    assert len(parents) == 1, [r.data.tags.get("run_type") for r in runs]
    parent = parents[0]
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(kids) == 5, "\n".join(
        [f"{k.data.tags.get('search.trial')} {k.info.status} {k.info.run_id}" for k in kids]
        + ["--- the first sweeper:", first[-2000:], "--- the second:", out[-3000:]]
    )
    complete = {t.number: t.value for t in trials if t.state.name == "COMPLETE"}
    for k in kids:
        number = int(k.data.tags["search.trial"])
        if number in complete:
            assert k.data.metrics["search/objective"] == pytest.approx(complete[number])
    assert parent.data.metrics["search/best_value"] == pytest.approx(min(complete.values()))
    assert parent.info.status == "FINISHED"
    # compare lists the trials best first
    c = run_cli(["gptlab.compare", str(search)], cwd=tmp_path)
    assert c.returncode == 0, c.stderr[-2000:]
    # a table wider than 100 columns goes on in a second part, led again by each trial
    rows = list(
        dict.fromkeys(ln.split()[0] for ln in c.stdout.splitlines()[2:] if ln[:1].isdigit())
    )
    assert len(rows) == 5 and rows[0] == str(min(complete, key=complete.get)), c.stdout
