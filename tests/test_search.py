"""Hyperparameter search (gptlab/search, hydra/sweeper=gptlab_optuna): the space, the settings, the
study's storage, a trial's pruning, and whole searches (locally; on the local SLURM with a killed
sweeper, in test_search_slurm.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import run_cli

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


def test_sweepers_opening_a_new_study_database_at_once_all_open_it(tmp_path):
    """Two sweepers started together both create the tables of a new SQLite study; the one that
    loses the race finds them made, instead of stopping on a UNIQUE constraint."""
    code = "import sys; from gptlab.search import study; study.open_storage(sys.argv[1]); print(1)"
    for round_ in range(3):
        url = f"sqlite:///{tmp_path}/{round_}/optuna.db"
        procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(3)]  # fmt: skip
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert out.strip() == "1", err[-1000:]


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


def a_search(tmp_path, params=None, launcher=None, max_steps=500, **changes):
    """A sweeper's Search, prepared as `-m hparams_search=...` prepares it, on a config holding the
    keys a search reads (not a whole job's); its study in <tmp_path>/optuna.db."""
    from omegaconf import OmegaConf

    from gptlab.search.sweeper import Search

    hs = {**vars(settings(storage=f"sqlite:///{tmp_path}/optuna.db")), **changes}
    config = OmegaConf.create({
        "hparams_search": hs,
        "hydra": {"sweep": {"dir": str(tmp_path / "search")}},
        "paths": {"outputs": str(tmp_path)},
        "train": {"max_steps": max_steps},
        "optimizer": {"lr": 1e-3, "warmup_steps": 10, "weight_decay": 0.1},
    })  # fmt: skip
    params = params or {"optimizer.lr": "tag(log, interval(1e-4, 1e-2))",
                        "optimizer.weight_decay": "interval(0.0, 0.4)"}  # fmt: skip
    search = Search(config, launcher, params)
    search.prepare([])
    return search


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


def test_a_study_spends_no_trial_on_a_point_it_has_tried(tmp_path):
    search = a_search(tmp_path, {"optimizer.weight_decay": "choice(0.0, 0.1, 0.2)"}, n_trials=3)
    assert search._next_trials(3, set()) == [0, 1, 2]
    drawn = sorted(t.params["optimizer.weight_decay"] for t in search.study.get_trials())
    assert drawn == [0.0, 0.1, 0.2]


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


def test_a_trial_number_the_study_lacks_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path}/optuna.db"
    optuna.create_study(study_name="s", storage=studies.open_storage(url))
    with pytest.raises(GptlabError, match="has no trial 7"):
        TrialLink(settings(storage=url, trial=7), True)


def test_a_job_of_a_superseded_launch_ends_without_touching_its_folder(shakespeare, tmp_path):
    """A dead sweeper's trial job still queued when another sweeper launched the trial again: when
    it starts, it ends at once with one line, and the folder stays the new launch's."""
    from gptlab.search.trial import open_link

    url = f"sqlite:///{tmp_path}/optuna.db"
    storage = studies.open_storage(url)
    study = optuna.create_study(study_name="s", storage=storage)
    t = study.ask()
    storage.set_trial_system_attr(t._trial_id, studies.ATTEMPT_ATTR, 1)
    assert open_link(settings(storage=url, trial=0, attempt=1), True).number == 0
    with pytest.raises(GptlabError, match="another sweeper has launched it again"):
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
def test_a_local_search_records_failed_and_pruned_trials_and_completes(shakespeare, tmp_path):
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
            assert f"trial {t.number} (" in log and "failed: GptlabError: train loss is" in log
        elif t.state.name == "PRUNED":
            # stopped early at an evaluation, with its checkpoint saved there and loadable
            assert results["stopped_by"] == "pruned" and results["steps"] < 60
            steps = sorted(t.intermediate_values)
            assert steps[-1] == results["steps"]
            from gptlab import checkpoint

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
    # compare lists the trials best first, the pruned ones marked
    c = run_cli(["gptlab.compare", str(search), f"paths.outputs={outputs}"], cwd=tmp_path)
    assert c.returncode == 0, c.stderr[-2000:]
    # a table wider than 100 columns goes on in a second part, led again by each trial
    rows = list(
        dict.fromkeys(ln.split()[0] for ln in c.stdout.splitlines()[2:] if ln[:1].isdigit())
    )
    complete = sorted((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert rows[0] == str(complete[0].number) and len(rows) == 6
    assert "PRUNED" in c.stdout


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
