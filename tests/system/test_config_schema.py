"""Defaults live once: the schema gives types, conf/ gives every value, and files inherit.

- the schema (gptlab.config.Config) has no values: every leaf is MISSING;
- the default config and every option of every group compose with no key on one side only (a key
  the schema lacks fails to merge; a schema key no file sets stays MISSING) and validate;
- `--cfg job` of every option equals its snapshot in tests/golden/cfg_job/ (taken before the files
  were made to inherit); a new option needs a snapshot: GPTLAB_UPDATE_SNAPSHOTS=1 writes missing
  ones;
- the groups around the job: `paths` (where commands write), `debug=smoke` (the tests' short run)
  and the optional, git-ignored `local` file (this machine's settings; see
  conf/local/slurm_example.yaml).
"""

import os
import shutil
from pathlib import Path

import pytest
from helpers import CONF, compose_config
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from gptlab.config import Config, PathsConfig, to_config

SNAPSHOTS = Path(__file__).resolve().parents[1] / "golden" / "cfg_job"
GROUPS = ["model", "data", "optimizer", "parallelism", "hardware", "experiment", "debug"]
SECTIONS = ("model", "data", "optimizer", "parallelism", "hardware", "train", "tracking", "paths")
CHOICES = [[]] + [[f"{g}={p.stem}"] for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def ids(overrides):
    return overrides[0] if overrides else "default"


def leaves(node, prefix=""):
    """(dotted key, raw value) of every leaf, MISSING ones included."""
    for key in node:
        child = node._get_node(key)
        path = f"{prefix}{key}"
        if OmegaConf.is_dict(child) and not child._is_missing():
            yield from leaves(child, path + ".")
        else:
            yield path, child._value()


def test_the_schema_holds_types_and_no_values():
    schema = OmegaConf.structured(Config)
    valued = [k for k, v in leaves(schema) if v != "???"]
    assert not valued, valued
    # each section's own keys, MISSING until a file of its group sets them
    for section in SECTIONS:
        assert OmegaConf.is_missing(schema, section)


@pytest.mark.parametrize("overrides", CHOICES, ids=ids)
@pytest.mark.integration
def test_every_choice_sets_every_schema_key_and_no_other(overrides):
    cfg = compose_config(overrides)  # a key outside the schema fails here, naming it
    missing = sorted(OmegaConf.missing_keys(cfg))
    assert not missing, f"keys no file sets: {missing}"
    composed = {k for k, _ in leaves(cfg) if not k.startswith("expected.")}
    typed = OmegaConf.structured(to_config(cfg))
    assert composed == {k for k, _ in leaves(typed) if not k.startswith("expected.")}


@pytest.mark.parametrize("overrides", CHOICES, ids=ids)
@pytest.mark.integration
def test_cfg_job_matches_its_snapshot(overrides):
    path = SNAPSHOTS / (overrides[0].replace("=", "__") + ".yaml" if overrides else "default.yaml")
    text = OmegaConf.to_yaml(compose_config(overrides))
    if not path.is_file() and os.environ.get("GPTLAB_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    assert path.is_file(), f"no snapshot for {ids(overrides)}: GPTLAB_UPDATE_SNAPSHOTS=1 writes it"
    assert text == path.read_text()


def test_a_key_no_file_sets_is_a_one_line_error():
    from gptlab.errors import GptlabError

    plain = OmegaConf.to_container(compose_config([]))
    del plain["model"]["rope_base"]  # as if conf/model/ forgot it
    with pytest.raises(GptlabError, match="rope_base") as e:
        to_config(OmegaConf.create(plain))
    assert "\n" not in str(e.value)


def compose_with_hydra(overrides, conf: Path = CONF, name: str = "config") -> DictConfig:
    """The composed config with its hydra section (run and sweep folders, launcher)."""
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        return compose(config_name=name, overrides=overrides, return_hydra_config=True)


def without_hydra(cfg: DictConfig) -> str:
    job = OmegaConf.to_container(cfg)
    del job["hydra"]
    return OmegaConf.to_yaml(job)


# ---- paths: where the commands write, written once ----------------------------------------------


@pytest.mark.integration
def test_paths_holds_the_outputs_root_and_the_default_store():
    assert to_config(compose_config([])).paths == PathsConfig("outputs", "outputs/mlflow.db")
    moved = to_config(compose_config(["paths.outputs=/scratch/me"])).paths
    assert moved == PathsConfig("/scratch/me", "/scratch/me/mlflow.db")


def test_run_and_sweep_folders_live_under_paths_outputs():
    h = compose_with_hydra(["paths.outputs=/scratch/me"]).hydra
    assert h.run.dir.startswith("/scratch/me/runs/")
    assert h.sweep.dir.startswith("/scratch/me/sweeps/")
    # every command that writes a folder takes it from paths (the read-only ones write none: ".")
    for root in sorted(CONF.glob("*.yaml")):
        hydra = OmegaConf.load(root).get("hydra", {})
        for mode in ("run", "sweep"):
            folder = OmegaConf.select(hydra, f"{mode}.dir", throw_on_resolution_failure=False)
            assert folder is None or folder.startswith("${paths.outputs}/"), (root.name, folder)


# ---- debug=smoke: the tests' seconds-long run ---------------------------------------------------

# What the tests' nano run spelled on the command line before debug=smoke held it (but data.path)
SMOKE = [
    "model=gpt_nano",
    "optimizer=adamw",
    "train.max_steps=20",
    "train.batch_size=8",
    "train.eval_every=10",
    "train.eval_steps=2",
    "train.log_every=5",
    "train.sample_tokens=20",
    "tracking.mlflow=false",
    "tracking.plots=false",
    "optimizer.warmup_steps=5",
    "hardware.threads=null",
]


# group choices after it still win, as they did after the spelled-out list
EXTRAS = [
    [],
    ["optimizer=muon"],
    ["hardware=cpu_x2", "train.max_steps=10"],
    ["experiment=gpt1b_shakespeare"],
]


@pytest.mark.parametrize("extra", EXTRAS, ids=lambda extra: " ".join(extra) or "alone")
@pytest.mark.integration
def test_debug_smoke_is_the_nano_run_and_the_command_line_still_wins(extra):
    data = "data.path=/data/tinyshakespeare.txt"
    spelled = OmegaConf.to_yaml(compose_config([*SMOKE, data, *extra]))
    assert OmegaConf.to_yaml(compose_config(["debug=smoke", data, *extra])) == spelled


@pytest.mark.integration
def test_debug_smoke_is_what_the_tests_nano_overrides_compose():
    from helpers import nano_overrides

    data = Path("/data/tinyshakespeare.txt")
    smoke = compose_config(["debug=smoke", f"data.path={data}"])
    assert compose_config(nano_overrides(data)) == smoke


# ---- local: this machine's settings, git-ignored ------------------------------------------------

EXAMPLE = CONF / "local" / "slurm_example.yaml"


@pytest.fixture
def conf_with_local(tmp_path) -> Path:
    """conf/ copied, with the SLURM example as conf/local/default.yaml, as a cluster user has it."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    shutil.copy(EXAMPLE, conf / "local" / "default.yaml")
    return conf


LAUNCHERS = [[], ["hydra/launcher=slurm_a100x8"], ["hydra/launcher=slurm_local"]]
RESTARTING_LAUNCHER = "hydra_plugins.gptlab_slurm.launcher.RestartingSlurmLauncher"


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda chosen: " ".join(chosen) or "its own")
@pytest.mark.integration
def test_the_local_example_gives_slurm_its_partition_and_account(conf_with_local, launcher):
    copied = compose_with_hydra(launcher, conf_with_local)  # as conf/local/default.yaml
    chosen = compose_with_hydra(["local=slurm_example", *launcher])  # tried without copying
    for cfg in copied, chosen:
        # the presets' launcher: submitit's, which submits a failed job again
        assert cfg.hydra.launcher._target_ == RESTARTING_LAUNCHER
        assert (cfg.hydra.launcher.partition, cfg.hydra.launcher.account) == ("gpu", "myproject")


JOBS = [[], ["experiment=gpt1b_shakespeare"], ["debug=smoke"]]


@pytest.mark.parametrize("overrides", JOBS, ids=ids)
@pytest.mark.integration
def test_the_local_example_leaves_the_job_as_it_was(conf_with_local, overrides):
    cfg = compose_with_hydra(overrides, conf_with_local)
    assert without_hydra(cfg) == OmegaConf.to_yaml(compose_config(overrides))
    to_config(OmegaConf.create(without_hydra(cfg)))  # a plain run validates with it


def test_without_a_local_file_or_with_it_dropped_the_launcher_is_hydras_own(conf_with_local):
    dropped = compose_with_hydra(["~local"], conf_with_local)
    assert dropped.hydra.launcher._target_.endswith(".BasicLauncher")
    if not (CONF / "local" / "default.yaml").is_file():  # a developer's own file may choose one
        assert compose_with_hydra([]).hydra.launcher._target_.endswith(".BasicLauncher")
