"""A run's data as MLflow dataset inputs (gptlab/records/lineage.py): the same prepared data shows
the same digest in every run, other data another one, live and through gptlab.sync."""

from __future__ import annotations

import json

import pytest
from helpers import compose_config, nano_overrides, run_cli, typed
from mlflow import MlflowClient

from gptlab.errors import GptlabError
from gptlab.records import lineage
from gptlab.train import run_training


def train(data_path, tmp_path, name, *extra):
    outputs = tmp_path / "outputs"
    overrides = nano_overrides(
        data_path, "tracking.mlflow=true", "train.sample_tokens=0", f"paths.outputs={outputs}",
        f"data.cache_dir={tmp_path / 'cache'}", *extra,
    )  # fmt: skip
    results = run_training(compose_config(overrides), tmp_path / name)
    client = MlflowClient(tracking_uri=f"sqlite:///{outputs}/mlflow.db")
    return client.get_run(results["mlflow_run_id"]), tmp_path / name


def inputs_of(run):
    return {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}  # context -> dataset


def test_the_same_data_has_the_same_digest_and_other_data_another(shakespeare, tmp_path):
    first, folder = train(shakespeare, tmp_path, "a")
    # another run, the same data (and no MLflow model: tracking.log_model=false)
    again, _ = train(shakespeare, tmp_path, "b", "train.seed=1", "tracking.log_model=false")
    other_text = tmp_path / "other.txt"
    other_text.write_text(shakespeare.read_text()[:200_000].upper())
    other, _ = train(other_text, tmp_path, "c")

    seen = inputs_of(first)
    assert set(seen) == {"training", "validation"}
    train_set = seen["training"]
    assert train_set.name == "shakespeare_char-train" and len(train_set.digest) == 16
    assert train_set.source_type == "local"
    source = json.loads(train_set.source)
    assert source["path"] == str(shakespeare.resolve()) and source["tokenizer"] == "char"
    profile = json.loads(train_set.profile)
    assert profile["tokens"] == 1_003_855 and profile["vocab_size"] == 65
    assert profile["dtype"] == "uint16"
    assert seen["validation"].digest != train_set.digest

    assert {k: d.digest for k, d in inputs_of(again).items()} == {
        k: d.digest for k, d in seen.items()
    }
    assert inputs_of(other)["training"].digest != train_set.digest
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/outputs/mlflow.db")
    models = client.search_logged_models([first.info.experiment_id])
    assert sorted(m.source_run_id for m in models) == sorted([first.info.run_id, other.info.run_id])
    # the run folder holds the same descriptions (what gptlab.sync sends later)
    assert [d["digest"] for d in lineage.read(folder)] == [
        seen["training"].digest, seen["validation"].digest
    ]  # fmt: skip


def damaged_side_file(shakespeare, cache):
    """Tiny Shakespeare prepared under `cache` as nano_overrides' runs have it, its first validation
    shard's side file without its digest: (the prepared data, its config, the side file)."""
    from gptlab.data import prepare_data

    cfg = typed("data", *nano_overrides(shakespeare, f"data.cache_dir={cache}"))
    data = prepare_data(cfg)
    side = sorted((data.root / "val").glob("shard_*.json"))[0]
    record = json.loads(side.read_text())
    del record["sha256"]
    side.write_text(json.dumps(record))
    return data, cfg, side


def test_a_side_file_without_its_digest_is_one_line(shakespeare, tmp_path):
    """Issue 42: KeyError: 'sha256' and a traceback; now one line naming the file and the way out,
    as a deleted side file gets."""
    data, cfg, side = damaged_side_file(shakespeare, tmp_path / "cache")
    with pytest.raises(GptlabError) as e:
        lineage.describe(data.root, data.meta, cfg)
    assert str(e.value) == (
        f"{side}: no sha256 of its shard (the side file is damaged); delete {data.root} to "
        f"prepare it again"
    )


@pytest.mark.slow
def test_a_run_on_a_side_file_without_its_digest_stops_before_its_folder(shakespeare, tmp_path):
    _, _, side = damaged_side_file(shakespeare, tmp_path / "cache")
    run = tmp_path / "run"
    args = nano_overrides(shakespeare, f"data.cache_dir={tmp_path / 'cache'}",
                          f"hydra.run.dir={run}", "train.max_steps=2")  # fmt: skip
    r = run_cli(["gptlab.train", *args], cwd=tmp_path)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"gptlab.train: error: {side}") and "prepare it again" in line
    assert not run.exists()
