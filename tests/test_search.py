"""Hyperparameter search (gptlab/search, hydra/sweeper=gptlab_optuna): the space, the settings, the
study's storage, a trial's pruning, and whole searches (locally; on the local SLURM with a killed
sweeper, in test_search_slurm.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import run_cli

from gptlab.compare import main as compare_main
from gptlab.errors import GptlabError
from gptlab.search import space as spaces
from gptlab.search import study as studies
from gptlab.search.sweeper import fill_params, owner_alive, owner_id, trial_alive
from gptlab.search.trial import TrialLink

optuna = pytest.importorskip("optuna")


def settings(**changes):
    """hparams_search as conf/config.yaml gives it, with changes."""
    base = dict(
        study_name="s", metric="best_val_loss", direction=None, n_trials=4, n_jobs=1,
        sampler="tpe", seed=0, pruner="median", pruner_startup_trials=1, pruner_warmup_steps=0,
        max_failure_rate=0.5, storage=None, trial=None, attempt=0,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **changes})


def test_the_space_reads_optunas_hydra_syntax():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space, fixed = spaces.parse(
        {
            "optimizer.lr": "tag(log, interval(1e-4, 1e-2))",
            "optimizer.warmup_steps": "tag(int, interval(0, 300))",
            "model.n_layer": "range(2, 8, 2)",
            "optimizer.ema_decay": "choice(0.0, 0.99)",
        },
        ["model=gpt_nano", "optimizer.weight_decay=0.0,0.1"],
    )
    assert space["optimizer.lr"] == FloatDistribution(1e-4, 1e-2, log=True)
    assert space["optimizer.warmup_steps"] == IntDistribution(0, 300)
    # Python's range leaves its stop out: 2, 4, 6
    assert space["model.n_layer"] == IntDistribution(2, 6, step=2)
    assert space["optimizer.ema_decay"] == CategoricalDistribution([0.0, 0.99])
    # a sweep on the command line joins the space; a plain value is every trial's
    assert space["optimizer.weight_decay"] == CategoricalDistribution([0.0, 0.1])
    assert fixed == ["model=gpt_nano"]
    assert spaces.describe(space["optimizer.lr"]) == "float log [0.0001, 0.01]"
    assert spaces.override("optimizer.lr", 0.001) == "optimizer.lr=0.001"
    assert spaces.override("optimizer.name", "adamw") == "optimizer.name='adamw'"


@pytest.mark.parametrize(
    "value, words",
    [
        ("tag(cubic, interval(1, 2))", "unknown tag 'cubic'"),
        ("interval(2, 1)", "is empty"),
        ("tag(log, interval(0, 1))", "must be positive"),
        ("range(5, 5)", "is empty"),
        ("interval(1, ", "search space:"),
    ],
)
def test_a_bad_distribution_is_one_line(value, words):
    with pytest.raises(GptlabError, match=None) as e:
        spaces.parse({"optimizer.lr": value}, [])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_settings_are_checked_before_any_trial():
    assert studies.check_settings(settings(), 0) == "minimize"
    assert studies.check_settings(settings(metric="hellaswag_acc_norm"), 250) == "maximize"
    with pytest.raises(GptlabError, match="no run produces it; one of best_val_loss"):
        studies.check_settings(settings(metric="val_accuracy"), 0)
    with pytest.raises(GptlabError, match="HellaSwag is off"):
        studies.check_settings(settings(metric="hellaswag_acc"), 0)
    for bad in (dict(n_trials=0), dict(max_failure_rate=1.5), dict(sampler="grid"),
                dict(pruner="hyperband"), dict(study_name=None), dict(direction="up")):  # fmt: skip
        with pytest.raises(GptlabError, match="hparams_search"):
            studies.check_settings(settings(**bad), 0)


def test_the_storage_url_is_absolute_and_postgresql_goes_through_psycopg(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert studies.storage_url(None, "outputs") == f"sqlite:///{tmp_path}/outputs/optuna.db"
    assert studies.storage_url("sqlite:///a/b.db", "x") == f"sqlite:///{tmp_path}/a/b.db"
    assert studies.storage_url("sqlite:////abs/b.db", "x") == "sqlite:////abs/b.db"
    assert (
        studies.storage_url("postgresql://u@host/optuna", "x")
        == "postgresql+psycopg://u@host/optuna"
    )
    assert studies.redact("postgresql+psycopg://u:secret@h/db") == "postgresql+psycopg://u:***@h/db"


@pytest.mark.integration
def test_sweepers_opening_a_new_study_database_at_once_all_open_it(tmp_path):
    """Two sweepers started together both create the tables of a new SQLite study; the one that
    loses the race finds them made, instead of stopping on a UNIQUE constraint."""
    # each process opens the three rounds' databases, all of them the same one at the same moment
    code = (
        "import sys, time; from gptlab.search import study\n"
        "start = float(sys.argv[1])\n"
        "for n, url in enumerate(sys.argv[2:]):\n"
        "    time.sleep(max(0.0, start + n - time.time())); study.open_storage(url); print(1)"
    )
    urls = [f"sqlite:///{tmp_path}/{round_}/optuna.db" for round_ in range(3)]
    start = str(time.time() + 3)
    procs = [subprocess.Popen([sys.executable, "-c", code, start, *urls], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]  # fmt: skip
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert out.split() == ["1"] * 3, err[-1000:]


@pytest.mark.integration
def test_an_unreachable_storage_is_one_line():
    # port 9 (discard) on loopback: nothing listens; the driver's error, in one line with the URL
    with pytest.raises(GptlabError) as e:
        studies.open_storage("postgresql+psycopg://u:pw@127.0.0.1:9/optuna")
    text = str(e.value)
    assert "cannot open the study's database" in text and "\n" not in text
    assert "pw" not in text  # the password stays out of the message


def test_a_sweeper_is_alive_while_its_process_runs_or_its_heartbeat_is_fresh():
    import socket
    import time

    assert owner_alive(owner_id(), {}, time.time())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not owner_alive(f"{socket.gethostname()}:{dead.pid}", {}, time.time())
    other = "elsewhere:123"
    beats = {f"{studies.OWNER_ATTR}:{other}": time.time() - 5}
    assert owner_alive(other, beats, time.time())
    assert not owner_alive(other, beats, time.time() + 120)
    assert not owner_alive(None, beats, time.time())


@pytest.mark.integration
def test_a_trial_being_asked_for_is_no_orphan_and_an_adopted_one_gets_the_whole_space(tmp_path):
    import time

    import optuna

    space = spaces.parse({"optimizer.lr": "tag(log, interval(1e-4, 1e-2))"}, [])[0]
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db", study_name="s")
    # what another sweeper's study.ask leaves for a moment: RUNNING, no owner, no params yet
    tid = study._storage.create_new_trial(study._study_id)
    t = study._storage.get_trial(tid)
    assert trial_alive(t, {}, time.time())
    assert not trial_alive(t, {}, time.time() + 120)  # its sweeper died before sampling it
    fill_params(study, t, space, settings())
    lr = study._storage.get_trial(tid).params["optimizer.lr"]
    assert 1e-4 <= lr <= 1e-2


def a_search(tmp_path, params=None, launcher=None, max_steps=500, seeds=1, fixed=(), **changes):
    """A sweeper's Search, prepared as `-m hparams_search=...` prepares it, on a config holding the
    keys a search reads (not a whole job's); its study in <tmp_path>/optuna.db."""
    from omegaconf import OmegaConf

    from gptlab.search.sweeper import Search

    hs = {**vars(settings(storage=f"sqlite:///{tmp_path}/optuna.db")), **changes}
    config = OmegaConf.create({
        "hparams_search": hs,
        "hydra": {"sweep": {"dir": str(tmp_path / "search")}},
        "paths": {"outputs": str(tmp_path)},
        "train": {"max_steps": max_steps, "seed": 1337},
        "optimizer": {"lr": 1e-3, "warmup_steps": 10, "weight_decay": 0.1},
    })  # fmt: skip
    params = params or {"optimizer.lr": "tag(log, interval(1e-4, 1e-2))",
                        "optimizer.weight_decay": "interval(0.0, 0.4)"}  # fmt: skip
    search = Search(config, launcher, params, seeds)
    search.prepare(list(fixed))
    return search


@pytest.mark.integration
def test_two_sweepers_on_one_study_draw_different_points(tmp_path):
    """Issue 42: a second sweeper's first trial repeated the first sweeper's (one seed, one
    stream); each trial's draw is seeded by its own number."""
    first, second = a_search(tmp_path), a_search(tmp_path)
    assert first._next_trials(1, set()) == [0] and second._next_trials(1, set()) == [1]
    zero, one = first.study.get_trials()
    assert set(zero.params) == set(one.params) == {"optimizer.lr", "optimizer.weight_decay"}
    assert zero.params["optimizer.lr"] != one.params["optimizer.lr"]
    # a trial's draw is its number's: the same study again draws the same points
    again = a_search(tmp_path / "again")
    assert again._next_trials(2, set()) == [0, 1]
    assert [t.params for t in again.study.get_trials()] == [zero.params, one.params]


@pytest.mark.integration
def test_a_study_spends_no_trial_on_a_point_it_has_tried(tmp_path):
    search = a_search(tmp_path, {"optimizer.weight_decay": "choice(0.0, 0.1, 0.2)"}, n_trials=3)
    assert search._next_trials(5, set()) == [0, 1, 2]  # more slots than trials: n_trials asked
    assert len(search.study.get_trials()) == 3
    drawn = sorted(t.params["optimizer.weight_decay"] for t in search.study.get_trials())
    assert drawn == [0.0, 0.1, 0.2]


@pytest.mark.integration
def test_a_sweeper_reading_a_study_while_another_writes_it_sees_the_whole_search(
    tmp_path, monkeypatch
):
    """Issue 42: the study's search was three writes, and a second sweeper reading between them
    refused the study ("another fixed ..."). Here the second prepares right after the first
    sweeper's first write of the study's attributes, every time."""
    from optuna.storages import RDBStorage

    write = RDBStorage.set_study_system_attr
    looked = []

    def write_then_look(self, study_id, key, value):
        write(self, study_id, key, value)
        if not looked:
            looked.append(key)
            a_search(tmp_path)  # another sweeper on the same study, at this moment

    monkeypatch.setattr(RDBStorage, "set_study_system_attr", write_then_look)
    a_search(tmp_path)
    assert looked == [studies.DEFINITION_ATTR]


@pytest.mark.integration
def test_a_study_made_before_its_search_was_one_attribute_still_continues(tmp_path):
    first = a_search(tmp_path)
    attrs = first.storage.get_study_system_attrs(first.storage.get_study_id_from_name("s"))
    held = attrs[studies.DEFINITION_ATTR]
    old_url = f"sqlite:///{tmp_path}/old/optuna.db"
    old = optuna.create_study(study_name="s", storage=studies.open_storage(old_url))
    for part, key in studies.LEGACY_ATTRS.items():
        old._storage.set_study_system_attr(old._study_id, key, held[part])
    a_search(tmp_path / "old")  # the same search: continued
    with pytest.raises(GptlabError, match="holds a search with another metric"):
        a_search(tmp_path / "old", metric="val_loss")


@pytest.mark.integration
def test_the_first_line_says_how_many_trials_run_at_once(tmp_path):
    """Issue 42: `2 at a time`, then `one trial at a time`; the basic launcher runs one."""
    import logging

    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    search = a_search(tmp_path, launcher=BasicLauncher(), n_trials=1, n_jobs=2)
    assert search._next_trials(1, set()) == [0]
    search.study.tell(0, 1.0)  # the study is done: run() only speaks
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("gptlab.search")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        assert search.run() == []
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert ("1 trials (1 done), 1 at a time (hparams_search.n_jobs=2 needs another launcher, "
            "hydra/launcher=slurm_* or local)") in lines[0]  # fmt: skip
    assert not any("2 at a time" in line or "one trial at a time" in line for line in lines)


@pytest.mark.integration
def test_a_warmup_range_past_the_trials_max_steps_is_cut_there_or_refused(tmp_path):
    from optuna.distributions import CategoricalDistribution, IntDistribution

    warmup = "optimizer.warmup_steps"
    search = a_search(tmp_path, {warmup: "tag(int, interval(0, 300))"}, max_steps=60)
    assert search.space[warmup] == IntDistribution(0, 60)
    assert search.notes == [
        "search space: optimizer.warmup_steps cut to int [0, 60] (from int [0, 300]): trials run "
        "train.max_steps=60"
    ]
    cut = a_search(tmp_path / "range", {warmup: "range(0, 300, 25)"}, max_steps=60)
    assert cut.space[warmup] == IntDistribution(0, 50, step=25)
    chosen = a_search(tmp_path / "choice", {warmup: "choice(0, 50, 100)"}, max_steps=60)
    assert chosen.space[warmup] == CategoricalDistribution([0, 50])
    inside = a_search(tmp_path / "inside", {warmup: "tag(int, interval(0, 300))"})
    assert inside.space[warmup] == IntDistribution(0, 300) and inside.notes == []
    with pytest.raises(GptlabError) as e:
        a_search(tmp_path / "past", {warmup: "tag(int, interval(100, 800))"}, max_steps=50)
    assert str(e.value) == (
        "search space optimizer.warmup_steps: int [100, 800] starts past train.max_steps=50: no "
        "trial would get there; search values up to 50, e.g. "
        "optimizer.warmup_steps='tag(int, interval(0, 50))'"
    )


@pytest.mark.integration
def test_a_trial_worse_than_the_median_is_pruned_and_a_better_one_is_not(tmp_path):
    url = f"sqlite:///{tmp_path}/optuna.db"
    storage = studies.open_storage(url)
    hs = settings(storage=url, pruner_startup_trials=2)
    study = optuna.create_study(study_name="s", storage=storage, pruner=studies.make_pruner(hs))
    for final in (2.0, 3.0):  # two finished trials, their val loss at steps 10 and 20
        t = study.ask()
        t.report(final + 1.0, 10)
        t.report(final, 20)
        study.tell(t, final)
    good, bad = study.ask(), study.ask()
    assert not TrialLink(settings(**{**vars(hs), "trial": good.number}), True).should_prune(
        10, {"val_loss": 2.5}
    )
    link = TrialLink(settings(**{**vars(hs), "trial": bad.number}), True)
    assert link.should_prune(10, {"val_loss": 9.0})
    # the report is in the study, at its step
    assert study.trials[bad.number].intermediate_values == {10: 9.0}
    # with the pruner off, nothing is pruned
    off = settings(**{**vars(hs), "trial": bad.number, "pruner": "none"})
    assert not TrialLink(off, True).should_prune(20, {"val_loss": 9.0})


@pytest.mark.integration
def test_a_trial_number_the_study_lacks_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path}/optuna.db"
    optuna.create_study(study_name="s", storage=studies.open_storage(url))
    with pytest.raises(GptlabError, match="has no trial 7"):
        TrialLink(settings(storage=url, trial=7), True)


@pytest.mark.integration
def test_a_job_of_a_superseded_launch_ends_without_touching_its_folder(shakespeare, tmp_path):
    """A dead sweeper's trial job still queued when another sweeper launched the trial again: when
    it starts, it ends at once with one line, and the folder stays the new launch's."""
    from gptlab.errors import Superseded
    from gptlab.search.trial import open_link

    url = f"sqlite:///{tmp_path}/optuna.db"
    storage = studies.open_storage(url)
    study = optuna.create_study(study_name="s", storage=storage)
    t = study.ask()
    storage.set_trial_system_attr(t._trial_id, studies.ATTEMPT_ATTR, 1)
    assert open_link(settings(storage=url, trial=0, attempt=1), True).number == 0
    with pytest.raises(Superseded, match="another sweeper has launched it again"):
        open_link(settings(storage=url, trial=0, attempt=0), True)
    run = tmp_path / "0"
    out = run_cli([
        "gptlab.train", "model=gpt_nano", f"data.path={shakespeare}", "train.max_steps=5",
        f"hydra.run.dir={run}", "hparams_search.study_name=s", f"hparams_search.storage='{url}'",
        "hparams_search.trial=0", "hparams_search.attempt=0",
    ], cwd=tmp_path)  # fmt: skip
    assert out.returncode != 0
    assert "this job ends without touching its folder" in out.stderr
    assert not (run / "checkpoints").exists() and not (run / "results.json").exists()


def test_a_trials_run_name_is_short():
    from gptlab.records.identity import sweep_run_name

    name = sweep_run_name(
        "nano",
        ["model=gpt_nano", "optimizer.lr=0.007230917851781505", "optimizer.warmup_steps=290",
         "hparams_search.trial=3", "hparams_search.storage='sqlite:////x.db'"],
        {"overrides": ["model=gpt_nano"], "swept": []},
    )  # fmt: skip
    assert name == "nano lr=0.007231 warmup_steps=290 trial=3"


# ---- whole searches, locally (Hydra's basic launcher: one trial after another)


def search_args(shakespeare: Path, outputs: Path, *extra: str):
    """A search of gpt_nano trials of 60 steps, evaluated every 10 (so the pruner has steps)."""
    return [
        "gptlab.train", "-m", "hparams_search=default_job", "model=gpt_nano", "optimizer=adamw",
        f"data.path={shakespeare}", f"paths.outputs={outputs}", "train.max_steps=60",
        "train.eval_every=10", "train.eval_steps=4", "train.log_every=10", "train.sample_tokens=0",
        "train.checkpoint_every=0", *extra,
    ]  # fmt: skip


def trials_of(url: str, name: str):
    return optuna.load_study(study_name=name, storage=url).get_trials()


@pytest.mark.slow
def test_a_local_search_records_failed_and_pruned_trials_and_completes(
    shakespeare, tmp_path, capsys, monkeypatch
):
    outputs = tmp_path / "outputs"
    # half the lr range (log scale) diverges
    r = run_cli(
        search_args(
            shakespeare, outputs, "hparams_search.n_trials=6",
            "optimizer.lr=tag(log, interval(1e-3, 1e3))",
        ),
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trials = trials_of(f"sqlite:///{outputs}/optuna.db", "default_job")
    states = [t.state.name for t in trials]
    assert len(trials) == 6 and all(t.state.is_finished() for t in trials), states
    assert "FAIL" in states and "PRUNED" in states and "COMPLETE" in states, states
    search = outputs / "searches" / "default_job"
    log = r.stdout + r.stderr
    for t in trials:
        folder = search / str(t.number)
        results = (
            json.loads((folder / "results.json").read_text()) if t.state.name != "FAIL" else {}
        )
        if t.state.name == "FAIL":
            # one line naming why
            assert t.system_attrs[studies.ERROR_ATTR].count("\n") == 0
            assert "diverged" in t.system_attrs[studies.ERROR_ATTR]
            assert f"trial {t.number} (" in log and "failed: GptlabError: " in log
            assert "training diverged after" in log  # its rollbacks used up (train.max_rollbacks)
        elif t.state.name == "PRUNED":
            # stopped early at an evaluation, with its checkpoint saved there and loadable
            assert results["stopped_by"] == "pruned" and results["steps"] < 60
            steps = sorted(t.intermediate_values)
            assert steps[-1] == results["steps"]
            from gptlab.checkpoint import state as checkpoint

            ckpt = checkpoint.latest(folder / "checkpoints")
            assert checkpoint.step_of(ckpt) == results["steps"]
            assert checkpoint.load(ckpt)["step"] == results["steps"]
        else:
            assert t.value == pytest.approx(results["best_val_loss"], rel=1e-12)
            assert t.params["optimizer.lr"] < 10
    # MLflow: one parent, a child per trial with its state and objective; the parent's best
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{outputs}/mlflow.db")
    sweep = json.loads((search / "sweep.json").read_text())
    parent = client.get_run(sweep["parent_run_id"])
    kids = client.search_runs(
        [sweep["experiment_id"]], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert len(kids) == 6
    by_trial = {int(k.data.tags["search.trial"]): k for k in kids}
    for t in trials:
        assert by_trial[t.number].data.tags["search.state"] == t.state.name
        if t.state.name == "COMPLETE":
            assert by_trial[t.number].data.metrics["search/objective"] == pytest.approx(t.value)
    best = min(t.value for t in trials if t.state.name == "COMPLETE")
    assert parent.data.metrics["search/best_value"] == pytest.approx(best)
    assert parent.info.status == "FINISHED"  # failures within max_failure_rate
    assert parent.data.params["space/optimizer.lr"] == "float log [0.001, 1000.0]"
    # compare (in this process: test_compare.py runs its command) lists the trials best first, the
    # pruned ones marked
    monkeypatch.chdir(tmp_path)  # where the command ran
    compare_main([str(search), f"paths.outputs={outputs}"])
    out = capsys.readouterr().out
    # a table wider than 100 columns goes on in a second part, led again by each trial
    rows = list(dict.fromkeys(ln.split()[0] for ln in out.splitlines()[2:] if ln[:1].isdigit()))
    complete = sorted((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert rows[0] == str(complete[0].number) and len(rows) == 6
    assert "PRUNED" in out


@pytest.mark.slow
def test_a_search_over_seeds_ranks_each_point_by_its_seeds_mean(
    shakespeare, tmp_path, capsys, monkeypatch
):
    outputs = tmp_path / "outputs"
    r = run_cli(
        search_args(
            shakespeare, outputs, "hparams_search.n_trials=2", "train.max_steps=20",
            "optimizer.lr=choice(1e-3, 3e-3)", "hydra.sweeper.seeds=2", "train.seed=5",
        ),
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    search = outputs / "searches" / "default_job"
    trials = trials_of(f"sqlite:///{outputs}/optuna.db", "default_job")
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    for t in trials:
        seeds = [json.loads((search / str(t.number) / f"seed_{n}" / "results.json").read_text())
                 for n in (5, 6)]  # fmt: skip
        losses = [res["best_val_loss"] for res in seeds]
        assert losses[0] != losses[1]  # two seeds, two runs
        assert t.value == pytest.approx(sum(losses) / 2, rel=1e-12)
        assert t.user_attrs["seed_values"] == pytest.approx(losses)
    assert "(mean ± std of 2 seeds)" in r.stdout + r.stderr
    # compare, in this process: the trials' seeds are replicates of 2 configurations
    monkeypatch.chdir(tmp_path)  # where the command ran
    compare_main([str(search), f"paths.outputs={outputs}"])
    out = capsys.readouterr().out
    assert "4 runs, 2 configurations (by train.seed)" in out
    assert "0/seed_5" in out and "1/seed_6" in out


@pytest.mark.slow
def test_a_search_that_fails_too_often_stops_with_one_line(shakespeare, tmp_path):
    outputs = tmp_path / "outputs"
    r = run_cli(
        search_args(
            shakespeare, outputs, "hparams_search.n_trials=4", "hparams_search.max_failure_rate=0",
            "train.max_steps=20", "optimizer.lr=interval(500, 1000)",
        ),
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "search stopped: 1 of 4 trials failed" in last and "diverged" in last, r.stderr[-2000:]
    assert len(trials_of(f"sqlite:///{outputs}/optuna.db", "default_job")) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, words",
    [
        (["optimizer.lrr=interval(1e-3, 1e-2)"],
         "search space: optimizer.lrr is not a key of the training config; did you mean "
         "optimizer.lr"),
        (["hparams_search.metric=val_accuracy"], "hparams_search.metric=val_accuracy: no run"),
        (["hparams_search.storage=postgresql://gptlab@127.0.0.1:9/optuna"],
         "cannot open the study's database"),
    ],
)  # fmt: skip
def test_bad_search_input_is_one_line_before_any_trial(shakespeare, tmp_path, extra, words):
    outputs = tmp_path / "outputs"
    r = run_cli(search_args(shakespeare, outputs, *extra), cwd=tmp_path, timeout=300)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and words in err[0], r.stderr[-2000:]
    # nothing started: no trial, no MLflow run
    assert not (outputs / "searches" / "default_job" / "0").exists()
    assert not (outputs / "mlflow.db").exists()


@pytest.mark.slow
def test_a_study_continues_only_with_the_same_search(shakespeare, tmp_path):
    outputs = tmp_path / "outputs"
    args = search_args(shakespeare, outputs, "hparams_search.n_trials=1", "train.max_steps=10")
    first = run_cli(args, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    # the same command again: the study is complete, nothing runs
    again = run_cli(args, cwd=tmp_path, timeout=300)
    assert again.returncode == 0 and "(1 done)" in again.stdout + again.stderr
    assert len(trials_of(f"sqlite:///{outputs}/optuna.db", "default_job")) == 1
    # another space under the same name: refused, naming the way out
    other = run_cli([*args, "optimizer.lr=interval(1e-3, 2e-3)"], cwd=tmp_path, timeout=300)
    assert other.returncode != 0
    assert "holds a search with another space" in other.stderr and "study_name" in other.stderr


@pytest.mark.slow
def test_two_sweepers_on_one_study_share_it(shakespeare, tmp_path):
    from helpers import start_cli

    outputs = tmp_path / "outputs"
    args = search_args(
        shakespeare, outputs, "hparams_search.n_trials=4", "train.max_steps=20",
        "tracking.mlflow=false",
    )  # fmt: skip
    procs = [start_cli(args, tmp_path, merge_stderr=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    study = optuna.load_study(study_name="default_job", storage=f"sqlite:///{outputs}/optuna.db")
    real = [t for t in study.get_trials() if not t.system_attrs.get(studies.SURPLUS_ATTR)]
    assert sorted(t.number for t in real) == [0, 1, 2, 3]
    assert len({tuple(sorted(t.params.items())) for t in real}) == 4  # no point tried twice
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in real)
    # each trial ran in one sweeper only
    for t in real:
        ran = [f"trial {t.number} (" in out for out in outs]
        assert sum(ran) == 1, (t.number, ran)
        assert (outputs / "searches" / "default_job" / str(t.number) / "results.json").is_file()


# ---- the study's rules, a trial's report and how the sweeper records each way a trial ends


def test_each_metric_has_its_direction_and_the_figure_its_trials_report():
    assert studies.METRICS == {
        "best_val_loss": ("minimize", "val_loss"),
        "val_loss": ("minimize", "val_loss"),
        "best_val_bpb": ("minimize", "val_bpb"),
        "val_bpb": ("minimize", "val_bpb"),
        "hellaswag_acc": ("maximize", "hellaswag_acc"),
        "hellaswag_acc_norm": ("maximize", "hellaswag_acc_norm"),
    }
    for metric, (direction, _) in studies.METRICS.items():
        assert studies.check_settings(settings(metric=metric), 10) == direction
    assert studies.check_settings(settings(direction="maximize"), 0) == "maximize"
    assert studies.check_settings(settings(metric="hellaswag_acc", direction="minimize"), 1) == (
        "minimize"
    )


def test_each_setting_is_checked_at_its_bounds_in_one_line_naming_it():
    ok = [dict(max_failure_rate=0.0), dict(max_failure_rate=1.0), dict(pruner_startup_trials=0),
          dict(pruner_warmup_steps=0), dict(n_trials=1, n_jobs=1), dict(sampler="random"),
          dict(pruner="none")]  # fmt: skip
    for changes in ok:
        studies.check_settings(settings(**changes), 0)
    bad = {
        "n_trials=0": dict(n_trials=0),
        "n_jobs=0": dict(n_jobs=0),
        "max_failure_rate=-0.1": dict(max_failure_rate=-0.1),
        "max_failure_rate=1.01": dict(max_failure_rate=1.01),
        "pruner_startup_trials=-1": dict(pruner_startup_trials=-1),
        "pruner_warmup_steps=-1": dict(pruner_warmup_steps=-1),
    }
    for said, changes in bad.items():
        with pytest.raises(GptlabError, match=f"^hparams_search.{said}: out of range$"):
            studies.check_settings(settings(**changes), 0)
    with pytest.raises(GptlabError, match="^hparams_search.sampler=grid: one of tpe, random$"):
        studies.check_settings(settings(sampler="grid"), 0)
    with pytest.raises(GptlabError, match="^hparams_search.pruner=hyperband: one of median, none$"):
        studies.check_settings(settings(pruner="hyperband"), 0)
    with pytest.raises(
        GptlabError, match="^hparams_search.direction=up: minimize, maximize or null"
    ):
        studies.check_settings(settings(direction="up"), 0)
    with pytest.raises(GptlabError, match="^hparams_search.study_name is not set: name the study"):
        studies.check_settings(settings(study_name=""), 0)
    with pytest.raises(GptlabError, match=r"HellaSwag is off in these runs \(eval.hellaswag.every"):
        studies.check_settings(settings(metric="hellaswag_acc_norm"), 0)


def test_the_failures_allowed_are_the_rate_times_the_trials_rounded_down():
    cases = [(0.5, 4, 2), (0.25, 10, 2), (0.29, 7, 2), (1.0, 6, 6), (0.0, 9, 0), (0.99, 1, 0)]
    for rate, n, allowed in cases:
        assert studies.allowed_failures(settings(max_failure_rate=rate, n_trials=n)) == allowed


def test_the_sampler_and_pruner_are_built_from_the_settings():
    assert isinstance(studies.make_sampler("random", 3, 10), optuna.samplers.RandomSampler)
    for n_trials, startup in [(4, 2), (11, 2), (12, 3), (20, 5), (40, 10), (400, 10)]:
        tpe = studies.make_sampler("tpe", 3, n_trials)
        assert isinstance(tpe, optuna.samplers.TPESampler) and tpe._multivariate
        assert tpe._n_startup_trials == startup, n_trials
    pruner = studies.make_pruner(settings(pruner_startup_trials=3, pruner_warmup_steps=50))
    assert isinstance(pruner, optuna.pruners.MedianPruner)
    assert (pruner._n_startup_trials, pruner._n_warmup_steps) == (3, 50)
    assert isinstance(studies.make_pruner(settings(pruner="none")), optuna.pruners.NopPruner)


def test_a_trials_seed_mixes_the_seed_its_number_and_its_draw():
    import hashlib

    want = int.from_bytes(hashlib.sha256(b"7:3:1").digest()[:4], "little")
    assert studies.trial_seed(7, 3, 1) == want
    assert studies.trial_seed(7, 3) == studies.trial_seed(7, 3, 0) != want
    assert studies.trial_seed(None, 3, 1) is None
    assert len({studies.trial_seed(0, n, d) for n in range(5) for d in range(3)}) == 15


def test_the_objective_is_a_finite_number_of_the_results_else_none():
    assert studies.objective({"best_val_loss": 2}, "best_val_loss") == 2.0
    assert isinstance(studies.objective({"best_val_loss": 2}, "best_val_loss"), float)
    for value in (float("nan"), float("inf"), -float("inf"), "2.0", None):
        assert studies.objective({"best_val_loss": value}, "best_val_loss") is None
    assert studies.objective({"val_loss": 1.0}, "best_val_loss") is None


def test_a_studys_search_is_its_one_attribute_else_all_three_older_ones():
    held = {"space": {"a": 1}, "fixed": [], "metric": "val_loss"}
    assert studies.definition({studies.DEFINITION_ATTR: held, "gptlab:space": 2}) is held
    legacy = {"gptlab:space": {"a": 1}, "gptlab:fixed": [], "gptlab:metric": "val_loss"}
    assert studies.definition(legacy) == held
    del legacy["gptlab:fixed"]
    assert studies.definition(legacy) is None and studies.definition({}) is None


def test_urls_lose_their_password_in_messages_and_other_databases_are_kept(tmp_path):
    assert studies.redact("postgresql://u:p@ss@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert studies.redact("postgresql://u@h/db") == "postgresql://u:***@h/db"
    assert studies.redact("postgresql://u:p:q@h/db") == "postgresql://u:***@h/db"
    assert studies.redact("postgresql://u:p@h/db?o=a://b") == "postgresql://u:***@h/db?o=a://b"
    assert studies.redact("sqlite:////a/b.db") == "sqlite:////a/b.db"
    assert studies.redact("user@host") == "user@host"
    assert studies.storage_url("postgres://u@h/db", "x") == "postgresql+psycopg://u@h/db"
    assert studies.storage_url("mysql://u@h/db", "x") == "mysql://u@h/db"
    assert studies.storage_url("", str(tmp_path)) == f"sqlite:///{tmp_path}/optuna.db"


def test_a_sweeper_is_dead_once_its_heartbeat_is_a_minute_old():
    import datetime

    other = "elsewhere:123"
    beats = {f"{studies.OWNER_ATTR}:{other}": 1000.0}
    assert owner_alive(other, beats, 1059.9) and not owner_alive(other, beats, 1060.0)
    assert not owner_alive(other, {f"{studies.OWNER_ATTR}:{other}": "1000"}, 1001.0)
    assert not owner_alive("", beats, 1001.0) and not owner_alive("elsewhere:9", beats, 1001.0)
    start = datetime.datetime.fromtimestamp(1000.0)
    unowned = SimpleNamespace(system_attrs={}, datetime_start=start)
    assert trial_alive(unowned, beats, 1059.9) and not trial_alive(unowned, beats, 1060.0)
    assert not trial_alive(SimpleNamespace(system_attrs={}, datetime_start=None), beats, 59.0 + 1)
    owned = SimpleNamespace(system_attrs={studies.OWNER_ATTR: other}, datetime_start=None)
    assert trial_alive(owned, beats, 1030.0) and not trial_alive(owned, beats, 1061.0)


@pytest.mark.integration
def test_a_trial_reports_its_metrics_figure_and_stays_unpruned_when_it_cannot(
    tmp_path, monkeypatch
):
    url = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="s", storage=studies.open_storage(url))
    t = study.ask()
    hs = settings(storage=url, trial=t.number, metric="best_val_bpb")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    link = TrialLink(hs, True)
    assert link.reported == "val_bpb" and link.superseded is None
    assert link.storage.get_trial(link.trial_id).system_attrs[studies.SLURM_ATTR] == "4242"
    assert not link.should_prune(10, {"val_loss": 3.0})  # not its figure: nothing reported
    assert not link.should_prune(20, {"val_bpb": 1.5})
    assert study.trials[0].intermediate_values == {20: 1.5}

    def broken(study, trial):
        raise RuntimeError("database is locked")

    monkeypatch.setattr(link.study.pruner, "prune", broken)
    assert link.should_prune(30, {"val_bpb": 9.0}) is False  # the trial goes on
    other = TrialLink(hs, False)  # another rank: no storage, and the answer is rank 0's
    assert other.storage is None and other.number == t.number
    assert other.should_prune(10, {"val_bpb": 9.0}) is False
    from gptlab.search.trial import open_link

    assert open_link(settings(trial=None), True) is None


def ended_search(tmp_path):
    """A search of 8 trials, 7 asked for; no MLflow parent."""
    s = a_search(tmp_path, n_trials=8)
    s.parent = None
    assert s._next_trials(7, set()) == list(range(7))
    return s


def finish(search, number, outcome, results=None):
    folder = search.sweep_dir / str(number)
    folder.mkdir(parents=True, exist_ok=True)
    if results is not None:
        (folder / "results.json").write_text(json.dumps(results))
    return search._finish(number, outcome)


@pytest.mark.integration
def test_each_way_a_trial_ends_is_told_to_the_study(tmp_path, monkeypatch):
    import concurrent.futures as cf

    from hydra.core.utils import JobReturn, JobStatus

    from gptlab.distributed import slurm
    from gptlab.search.sweeper import _fmt

    s = ended_search(tmp_path)
    lost = {str(s.sweep_dir / "5"): "SLURM job 61: rank 1 on n2: Killed"}
    monkeypatch.setattr(slurm, "job_error", lambda run_dir: lost.get(run_dir))
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("gptlab.search")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    done = JobReturn(status=JobStatus.COMPLETED)
    future = cf.Future()
    future.set_result(done)
    try:
        assert finish(s, 0, future, {"best_val_loss": 2.5, "val_loss": 2.6}) is done
        finish(s, 1, done, {"stopped_by": "pruned", "steps": 40})
        finish(s, 2, done, {"stopped_by": "signal", "steps": 12})
        finish(s, 3, done)
        long = ValueError("bad lr " + "x" * 3000 + "\nmore")
        finish(s, 4, JobReturn(status=JobStatus.FAILED, _return_value=long))
        s._check_failures()  # 3 failed: within the 4 allowed
        finish(s, 5, RuntimeError("it died"))
        s._check_failures()
        finish(s, 6, done, {"val_loss": 2.0, "best_val_loss": "n/a"})
        finish(s, 0, done, {"best_val_loss": 9.0})  # told already: kept as it was
        s._summary(optuna)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    trials = s.study.get_trials()
    assert [t.state.name for t in trials] == [
        "COMPLETE", "PRUNED", "FAIL", "FAIL", "FAIL", "FAIL", "FAIL"
    ]  # fmt: skip
    assert trials[0].value == 2.5 and trials[0].values == [2.5]
    errors = [t.system_attrs.get(studies.ERROR_ATTR) for t in trials]
    assert errors == [
        None,
        None,
        "stopped by signal at step 12",
        f"no results.json in {s.sweep_dir / '3'}",
        ("ValueError: bad lr " + "x" * 3000)[:2000],  # kept short in the study
        "SLURM job 61: rank 1 on n2: Killed",  # a SLURM job's own account of its end
        "its results have no best_val_loss (got n/a)",
    ]
    shown = [", ".join(f"{k}={_fmt(v)}" for k, v in t.params.items()) for t in trials]
    assert lines[0] == f"trial 0 ({shown[0]}): best_val_loss 2.5000 | best 2.5000 (trial 0)"
    assert lines[1] == f"trial 1 ({shown[1]}): pruned at step 40 | best 2.5000 (trial 0)"
    assert lines[2] == (
        f"trial 2 ({shown[2]}): failed: stopped by signal at step 12 | best 2.5000 (trial 0)"
    )
    assert lines[-2] == "trial 0: already ended (COMPLETE) elsewhere"
    assert lines[-1] == (
        f"search 's': 1 complete, 1 pruned, 5 failed; best best_val_loss 2.5000, trial 0: "
        f"{shown[0]}; the trials: python -m gptlab.compare {s.sweep_dir}"
    )
    with pytest.raises(GptlabError) as e:
        s._check_failures()
    assert str(e.value) == (
        "search stopped: 5 of 8 trials failed, more than hparams_search.max_failure_rate=0.5 "
        "allows; the last, trial 6: its results have no best_val_loss (got n/a)"
    )


@pytest.mark.integration
def test_a_maximised_study_is_not_continued_as_a_minimised_one(tmp_path):
    made = a_search(tmp_path, direction="maximize")
    assert made.study.direction.name == "MAXIMIZE" and made.direction == "maximize"
    made.parent = {"uri": "sqlite:///x.db", "parent_run_id": "P", "experiment_id": "e"}
    client = Recorder()
    made._client = lambda: client
    made._record_space()
    assert client.tags["P"]["search.direction"] == "maximize"
    with pytest.raises(GptlabError, match="was made to maximize, not minimize: choose another"):
        a_search(tmp_path)


def test_a_trials_job_gets_the_fixed_overrides_its_point_and_its_launch(tmp_path):
    from gptlab.search.sweeper import _fmt

    s = a_search(tmp_path / "it's", {"optimizer.weight_decay": "choice(0.1)"}, n_trials=2)
    s.fixed = ["train.max_steps=50"]
    assert s._next_trials(1, set()) == [0]
    url = f"sqlite:///{tmp_path}/it\\'s/optuna.db"
    assert s._overrides(0) == [
        "train.max_steps=50",
        "optimizer.weight_decay=0.1",
        "hparams_search.trial=0",
        "hparams_search.attempt=0",
        f"hparams_search.storage='{url}'",
    ]
    assert [_fmt(0.000123456), _fmt(3), _fmt("x")] == ["0.0001235", "3", "x"]


def test_a_trial_of_three_seeds_is_three_jobs_in_its_folder_that_never_prune(tmp_path):
    s = a_search(tmp_path, {"optimizer.weight_decay": "choice(0.1)"}, seeds=3, n_trials=2)
    assert s._next_trials(1, set()) == [0]
    jobs = s._jobs(0)
    assert [j[-3:] for j in jobs] == [
        [f"train.seed={seed}", "hparams_search.pruner=none", f"hydra.sweep.subdir=0/seed_{seed}"]
        for seed in (1337, 1338, 1339)
    ]
    assert all(j[:-3] == s._overrides(0) for j in jobs)
    assert s.folders(0) == [s.sweep_dir / "0" / f"seed_{n}" for n in (1337, 1338, 1339)]
    # a train.seed given on the command line is where the seeds start, and is not given twice
    given = a_search(tmp_path / "given", seeds=2, fixed=["train.seed=7"])
    given._next_trials(1, set())
    assert [[o for o in j if o.startswith("train.seed")] for j in given._jobs(0)] == [
        ["train.seed=7"], ["train.seed=8"]
    ]  # fmt: skip


@pytest.mark.parametrize(
    "seeds, params, words",
    [
        (0, None, "hydra.sweeper.seeds=0: the number of seeds each trial trains"),
        ("two", None, "hydra.sweeper.seeds=two: the number of seeds"),
        (2, {"train.seed": "range(0, 9)"}, "a search over train.seed do not go together"),
    ],
)
def test_bad_seed_counts_are_one_line(tmp_path, seeds, params, words):
    with pytest.raises(GptlabError, match=re.escape(words)):
        a_search(tmp_path, params, seeds=seeds)


@pytest.mark.integration
def test_a_trial_of_seeds_is_their_mean_and_fails_with_its_first_failed_seed(tmp_path):
    from hydra.core.utils import JobReturn, JobStatus

    s = a_search(tmp_path, seeds=3, n_trials=2)
    s.parent = None
    assert s._next_trials(2, set()) == [0, 1]
    done = JobReturn(status=JobStatus.COMPLETED)
    for number, values in ((0, [2.0, 2.3, 2.6]), (1, [1.9, None, 2.0])):
        for folder, v in zip(s.folders(number), values):
            folder.mkdir(parents=True)
            figures = {"best_val_loss": v} if v is not None else {"stopped_by": "signal"}
            (folder / "results.json").write_text(json.dumps({**figures, "steps": 5}))
        s._finish(number, [done] * 3)
    zero, one = s.study.get_trials()
    assert zero.state.name == "COMPLETE" and zero.value == pytest.approx(2.3)
    assert zero.user_attrs["seed_values"] == pytest.approx([2.0, 2.3, 2.6])
    assert one.state.name == "FAIL"
    assert one.system_attrs[studies.ERROR_ATTR] == "seed 1338: stopped by signal at step 5"
    # a study made with one seed per trial is not continued with three, nor the reverse
    for seeds in (2, 1):
        with pytest.raises(GptlabError, match=r"another set of seeds per trial \(hydra.sweeper"):
            a_search(tmp_path, seeds=seeds, n_trials=2)


class Recorder:
    """The MLflow client calls the sweeper makes, recorded; search_runs answers with `runs`."""

    def __init__(self, runs=()):
        self.runs, self.tags, self.metrics, self.params, self.deleted = list(runs), {}, {}, {}, []

    def set_tag(self, run_id, key, value):
        self.tags.setdefault(run_id, {})[key] = value

    def log_metric(self, run_id, key, value, step=None):
        self.metrics.setdefault(run_id, {})[key] = (value, step)

    def log_batch(self, run_id, params=()):
        self.params.setdefault(run_id, {}).update({p.key: p.value for p in params})

    def search_runs(self, experiment_ids, filter_string, max_results):
        assert experiment_ids == ["e"] and filter_string == "tags.`mlflow.parentRunId` = 'P'"
        return self.runs

    def delete_run(self, run_id):
        self.deleted.append(run_id)


def run_in(folder, run_id):
    return SimpleNamespace(info=SimpleNamespace(run_id=run_id),
                           data=SimpleNamespace(tags={"run_dir": str(folder)}))  # fmt: skip


@pytest.mark.integration
def test_the_sweeper_records_the_search_and_each_trial_in_mlflow(tmp_path, monkeypatch):
    from hydra.core.utils import JobReturn, JobStatus

    s = ended_search(tmp_path)
    s.parent = {"uri": "sqlite:///x.db", "parent_run_id": "P", "experiment_id": "e"}
    client = Recorder([run_in(s.sweep_dir / "1", "r1"), run_in(s.sweep_dir / "10", "r10")])
    monkeypatch.setattr(s, "_client", lambda: client)
    s._record_space()
    assert client.params["P"] == {
        "space/optimizer.lr": spaces.describe(s.space["optimizer.lr"]),
        "space/optimizer.weight_decay": spaces.describe(s.space["optimizer.weight_decay"]),
    }
    assert client.tags["P"] == {
        "run_type": "search", "search.study": "s", "search.storage": s.url,
        "search.metric": "best_val_loss", "search.direction": "minimize", "search.n_trials": "8",
    }  # fmt: skip
    done = JobReturn(status=JobStatus.COMPLETED)
    finish(s, 0, done, {"best_val_loss": 2.5, "mlflow_run_id": "r0"})
    best = s.study.trials[0].params
    assert client.tags["r0"] == {"search.trial": "0", "search.state": "COMPLETE"}
    assert client.metrics["r0"] == {"search/objective": (2.5, None)}
    assert client.metrics["P"] == {"search/best_value": (2.5, 1)}
    assert {k: v for k, v in client.tags["P"].items() if k.startswith("search.b")} == {
        "search.best_trial": "0", **{f"search.best.{k}": str(v) for k, v in best.items()},
    }  # fmt: skip
    assert client.tags["P"]["search.finished"] == "1"
    finish(s, 1, done, {"stopped_by": "signal", "steps": 3})  # its run found by its folder
    assert client.tags["r1"] == {"search.trial": "1", "search.state": "FAIL",
                                 "search.error": "stopped by signal at step 3"}  # fmt: skip
    assert "r1" not in client.metrics and client.tags["P"]["search.finished"] == "2"
    assert client.metrics["P"] == {"search/best_value": (2.5, 2)}
    finish(s, 2, done)  # no run of its own: only the parent's count
    assert client.tags["P"]["search.finished"] == "3" and "r10" not in client.tags

    def down():
        raise ConnectionError("the store is down")

    monkeypatch.setattr(s, "_client", down)
    finish(s, 3, done, {"best_val_loss": 1.0})  # told to the study all the same
    s._record_space()
    assert s.study.trials[3].value == 1.0


def test_an_orphan_is_adopted_once_and_a_trial_asked_past_the_count_is_never_run(tmp_path):
    s = a_search(tmp_path, n_trials=3)
    s.parent = None  # no MLflow parent (run() reads sweep.json)
    dead = s.study.ask()  # a trial of a sweeper that died: RUNNING, its owner gone
    s.storage.set_trial_system_attr(dead._trial_id, studies.OWNER_ATTR, "elsewhere:1")
    assert s._next_trials(2, {dead.number}) == [1, 2]  # one of ours is no orphan
    attrs = s.storage.get_trial(dead._trial_id).system_attrs
    assert attrs[studies.OWNER_ATTR] == "elsewhere:1" and studies.ATTEMPT_ATTR not in attrs
    assert s._next_trials(2, set()) == [0]  # adopted; the study has its 3 trials
    attrs = s.storage.get_trial(dead._trial_id).system_attrs
    assert attrs[studies.OWNER_ATTR] == s.owner and attrs[studies.ATTEMPT_ATTR] == 1
    assert set(s.study.trials[0].params) == set(s.space)  # given the whole space
    assert s._overrides(0)[-2] == "hparams_search.attempt=1"
    assert all(t.system_attrs[studies.OWNER_ATTR] == s.owner for t in s.study.trials)
    assert not s._more_to_do(set()) and s._next_trials(2, set()) == []
    assert len(s.study.get_trials()) == 3  # none asked past n_trials
    s.study.get_trials = lambda deepcopy=False: []  # as another sweeper asks at the same moment
    assert s._next_trials(1, set()) == []
    surplus = s.storage.get_trial(s.storage.get_trial_id_from_study_id_trial_number(s.study_id, 3))
    assert surplus.system_attrs[studies.SURPLUS_ATTR] is True and surplus.state.name == "FAIL"
    del s.study.get_trials
    assert [t.number for t in s.trials()] == [0, 1, 2]
    s._check_failures()  # the surplus trial is no failure


def test_a_taken_over_trial_without_a_checkpoint_loses_its_unfinished_run(tmp_path, monkeypatch):
    s = a_search(tmp_path)
    s.parent = None
    s._drop_unsaved_attempt(0)  # no MLflow parent: nothing to do
    s.parent = {"uri": "sqlite:///x.db", "parent_run_id": "P", "experiment_id": "e"}
    client = Recorder([run_in(s.sweep_dir / "0", "r0"), run_in(s.sweep_dir / "1", "r1")])
    monkeypatch.setattr(s, "_client", lambda: client)
    s._drop_unsaved_attempt(0)
    assert client.deleted == ["r0"]
    (s.sweep_dir / "1" / "checkpoints").mkdir(parents=True)
    (s.sweep_dir / "1" / "checkpoints" / "ckpt_00000010.pt").write_bytes(b"x")
    s._drop_unsaved_attempt(1)  # it has a checkpoint: its run goes on
    assert client.deleted == ["r0"]


def test_a_superseded_launch_is_refused_in_one_line_and_the_current_one_goes_on(tmp_path):
    from gptlab.search.trial import open_link

    url = f"sqlite:///{tmp_path}/optuna.db"
    storage = studies.open_storage(url)
    optuna.create_study(study_name="other", storage=storage)  # the study is found by its name
    study = optuna.create_study(study_name="s", storage=storage)
    t = study.ask()
    storage.set_trial_system_attr(t._trial_id, studies.ATTEMPT_ATTR, 2)
    for attempt in (2, 3):
        link = open_link(settings(storage=url, trial=0, attempt=attempt), True)
        assert link.number == 0 and link.superseded is None and link.study.study_name == "s"
    with pytest.raises(GptlabError) as e:
        open_link(settings(storage=url, trial=0, attempt=1), True)
    assert str(e.value) == (
        "trial 0: this job is launch 1 of it, and another sweeper has launched it again (launch "
        "2); this job ends without touching its folder"
    )
    other_rank = open_link(settings(storage=url, trial=0, attempt=1), False)
    assert other_rank.superseded is None and other_rank.storage is None  # rank 0 decides
    secret = f"sqlite:///{tmp_path}/optuna.db"
    with pytest.raises(GptlabError) as e:
        TrialLink(settings(storage=secret, trial=9), True)
    assert str(e.value) == (
        f"hparams_search: study 's' has no trial 9 in {secret}; a trial's job is started by the "
        f"search (python -m gptlab.train -m hparams_search=...)"
    )


def test_a_loaded_study_gets_the_configured_sampler_and_pruner(tmp_path):
    storage = studies.open_storage(f"sqlite:///{tmp_path}/optuna.db")
    optuna.create_study(study_name="a", storage=storage)
    optuna.create_study(study_name="s", storage=storage)
    study = studies.load(storage, "s", settings(sampler="random", seed=3, pruner="none"))
    assert study.study_name == "s" and isinstance(study.sampler, optuna.samplers.RandomSampler)
    assert isinstance(study.pruner, optuna.pruners.NopPruner)
    tpe = studies.load(storage, "s", settings(seed=3, n_trials=40))
    assert isinstance(tpe.sampler, optuna.samplers.TPESampler)
    assert tpe.sampler._n_startup_trials == 10 and isinstance(
        tpe.pruner, optuna.pruners.MedianPruner
    )
    again = studies.load(storage, "s", settings(sampler="random", seed=3))
    first = [again.sampler._rng.rng.random() for _ in range(3)]
    same = studies.make_sampler("random", 3, 4)
    assert first == [same._rng.rng.random() for _ in range(3)]  # seeded by hparams_search.seed


def test_tables_made_at_once_by_another_sweeper_are_told_from_other_failures():
    from sqlalchemy.exc import IntegrityError

    from gptlab.search.study import _made_at_once

    assert _made_at_once(IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed")))
    assert _made_at_once(RuntimeError('relation "studies" already exists'))
    assert not _made_at_once(RuntimeError("could not connect to server"))


def test_a_report_that_fails_is_one_warning_naming_the_trial_and_step(
    tmp_path, monkeypatch, caplog
):
    url = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="s", storage=studies.open_storage(url))
    study.ask()
    link = TrialLink(settings(storage=url, trial=0), True)

    def broken(study, trial):
        raise RuntimeError("database is locked")

    monkeypatch.setattr(link.study.pruner, "prune", broken)
    with caplog.at_level("WARNING", logger="gptlab.search.trial"):
        assert link.should_prune(30, {"val_loss": 9.0}) is False
    assert [r.getMessage() for r in caplog.records] == [
        "trial 0: could not report step 30: database is locked"
    ]


def test_a_sweeper_of_another_user_on_this_host_is_alive(monkeypatch):
    import socket

    def not_yours(pid, sig):
        assert sig == 0  # only asked whether it runs
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", not_yours)
    assert owner_alive(f"{socket.gethostname()}:1", {}, 0.0)


def test_a_trials_draw_is_the_samplers_own_joint_draw_after_its_startup_trials(tmp_path):
    """Past its random startup trials TPE draws lr and weight decay jointly: the point drawn is the
    one optuna's own Trial draws with the same seeded sampler on the same history; a one-valued
    range is its value."""
    from optuna.distributions import FloatDistribution

    space = spaces.parse({"optimizer.lr": "tag(log, interval(1e-4, 1e-2))",
                          "optimizer.weight_decay": "interval(0.0, 0.4)"}, [])[0]  # fmt: skip
    history = [(1e-3, 0.1), (3e-3, 0.2), (5e-4, 0.3), (2e-3, 0.05), (8e-3, 0.35)]

    def study_with_history(name):
        study = optuna.create_study(study_name=name, storage=f"sqlite:///{tmp_path}/{name}.db")
        for i, (lr, wd) in enumerate(history):
            study.add_trial(optuna.trial.create_trial(
                params={"optimizer.lr": lr, "optimizer.weight_decay": wd}, distributions=space,
                value=float(i),
            ))  # fmt: skip
        return study

    ours = study_with_history("ours")
    asked = ours.ask()
    trial = ours._storage.get_trial(asked._trial_id)
    got = studies._draw(studies.make_sampler("tpe", 5, 8), ours, trial, space)
    ref = study_with_history("ref")
    ref.sampler = studies.make_sampler("tpe", 5, 8)
    assert got == ref.ask(space).params
    assert got != studies._draw(studies.make_sampler("random", 5, 8), ours, trial, space)
    fixed = {**space, "train.grad_clip": FloatDistribution(1.0, 1.0)}
    assert studies._draw(studies.make_sampler("tpe", 5, 8), ours, trial, fixed) == {
        **got, "train.grad_clip": 1.0
    }  # fmt: skip
