"""records/identity.py and records/layout.py: one function names and tags a run, from its config,
its folder and its origin; the run folder's layout is read one way."""

import json

from omegaconf import OmegaConf

from gptlab.records import identity, layout


def config(**tracking):
    base = {"model": {"name": "gpt_nano"}, "data": {"name": "shakespeare_char"},
            "hardware": {"name": "cpu"}, "tracking": {"uri": None, "experiment": None,
                                                      "run_name": None, **tracking}}  # fmt: skip
    return base


def test_a_plain_run_is_named_after_its_model_data_and_hardware(tmp_path):
    ident = identity.identify(config(), tmp_path / "run", {"host": "n1", "git_commit": "abc"})
    assert ident.experiment == "gpt_nano-shakespeare_char"
    assert ident.name == "gpt_nano-shakespeare_char-cpu"
    assert ident.tags == {"hardware": "cpu", "model": "gpt_nano", "data": "shakespeare_char",
                          "run_dir": str((tmp_path / "run").resolve()), "host": "n1",
                          "git_commit": "abc"}  # fmt: skip
    assert ident.sweep is None


def test_given_names_win_and_a_benchmark_is_named_as_one(tmp_path):
    named = identity.identify(config(run_name="mine", experiment="exp"), tmp_path, {})
    assert (named.name, named.experiment) == ("mine", "exp")
    bench = identity.identify({**config(run_name="mine"), "bench": {"steps": 3}}, tmp_path, {})
    assert bench.name == "bench-gpt_nano-cpu" and bench.tags["kind"] == "bench"


def test_only_origin_tags_come_from_the_origin(tmp_path):
    ident = identity.identify(config(), tmp_path, {"host": "n1", "model": "not this"})
    assert ident.tags["model"] == "gpt_nano" and ident.tags["host"] == "n1"


def sweep_folder(tmp_path, uri="sqlite:///x.db"):
    sweep = tmp_path / "sweep"
    job = sweep / "3"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=0.003\n- model=gpt_nano\n")
    info = identity.sweep_identity(
        config(), ["optimizer.lr=1e-3,3e-3", "model=gpt_nano"], "basic", sweep
    )
    (sweep / "sweep.json").write_text(json.dumps({**info, "uri": uri, "parent_run_id": "p"}))
    return sweep, job


def test_a_sweep_job_is_named_by_its_swept_values_in_the_sweeps_experiment(tmp_path):
    sweep, job = sweep_folder(tmp_path)
    ident = identity.identify(config(), job, {})
    assert ident.name == "gpt_nano-shakespeare_char-cpu optimizer.lr=0.003"
    assert ident.tags["overrides"] == "optimizer.lr=0.003 model=gpt_nano"
    assert ident.tags["sweep_dir"] == str(sweep.resolve()) and ident.sweep["parent_run_id"] == "p"
    info = json.loads((sweep / "sweep.json").read_text())
    assert info["run_name"] == "gpt_nano-shakespeare_char-cpu sweep optimizer.lr=1e-3,3e-3"
    assert info["swept"] == ["optimizer.lr"]


def test_a_run_with_a_store_of_its_own_is_not_the_sweeps(tmp_path):
    _, job = sweep_folder(tmp_path, uri="sqlite:///x.db")
    assert identity.identify(config(uri="sqlite:///x.db"), job, {}).sweep is not None
    assert identity.identify(config(uri="http://other:5000"), job, {}).sweep is None


def test_a_sweep_without_sweep_json_is_read_from_multirun_yaml(tmp_path):
    sweep, job = sweep_folder(tmp_path)
    (sweep / "sweep.json").unlink()
    hydra = {"overrides": {"task": ["optimizer.lr=1e-3,3e-3", "model=gpt_nano"]},
             "runtime": {"choices": {"hydra/launcher": "submitit_slurm"}}}  # fmt: skip
    (sweep / "multirun.yaml").write_text(OmegaConf.to_yaml({**config(), "hydra": hydra}))
    ident = identity.identify(config(), job, {})
    assert ident.name == "gpt_nano-shakespeare_char-cpu optimizer.lr=0.003"
    assert ident.sweep["launcher"] == "submitit_slurm" and "parent_run_id" not in ident.sweep


def test_the_origin_is_read_back_from_run_json_then_slurm_json(tmp_path):
    ident = identity.identify(config(), tmp_path, {"host": "n7", "git_commit": "abc"})
    identity.write(tmp_path, ident)
    assert identity.recorded_origin(tmp_path) == {"host": "n7", "git_commit": "abc"}
    (tmp_path / layout.IDENTITY).unlink()
    assert identity.recorded_origin(tmp_path) == {}
    (tmp_path / layout.SLURM).write_text(json.dumps({"job_id": "4", "nodes": ["gpu3", "gpu4"]}))
    assert identity.recorded_origin(tmp_path) == {"host": "gpu3"}


def test_what_counts_as_a_run_folder_and_the_order_of_a_sweeps_jobs(tmp_path):
    for name in ("10", "2", "x"):
        (tmp_path / name / ".hydra").mkdir(parents=True)
    (tmp_path / "y").mkdir()  # neither Hydra's nor a run's
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / layout.METRICS).write_text('{"step": 3}\n{"step": 7, "val_loss": 1.0}\n{"st')
    assert [p.name for p in layout.runs_in(tmp_path)] == ["2", "10", "x", "z"]
    assert not layout.started(tmp_path / "2") and layout.started(tmp_path / "z")
    assert layout.last_logged_step(tmp_path / "z") == 7  # the line cut short is left out
    assert layout.read_results(tmp_path / "z") == {}
