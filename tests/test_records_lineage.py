"""A run's data as MLflow dataset inputs (gptlab/records/lineage.py): the same prepared data shows
the same digest in every run, other data another one, live and through gptlab.sync."""

from __future__ import annotations

import json
from types import SimpleNamespace

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


@pytest.mark.integration
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


# ---- the descriptions themselves, in process on a prepared folder made by hand


def prepared(root, shards):
    """root/<split>/shard_<n>.json side files recording the given digests."""
    for split, digests in shards.items():
        (root / split).mkdir(parents=True)
        for n, digest in reversed(list(enumerate(digests))):  # made last-first: read in name order
            (root / split / f"shard_{n:06d}.json").write_text(json.dumps({"sha256": digest}))
    return root


META = {
    "tokenizer_sha256": "tok1",
    "dtype": "uint16",
    "train_tokens": 900,
    "val_tokens": 100,
    "train_shards": 2,
    "val_shards": 1,
    "documents": 7,
    "vocab_size": 65,
}


def data_config(source="local", path="text.txt", url=None, **hf):
    return SimpleNamespace(name="tiny", source=source, path=path, url=url,
                           tokenizer=SimpleNamespace(kind="char"), **hf)  # fmt: skip


def test_a_splits_digest_is_its_shards_digests_in_order_the_tokenizers_and_the_dtype(tmp_path):
    import hashlib

    root = prepared(tmp_path / "p", {"train": ["aa", "bb", "cc"], "val": ["dd"]})
    want = hashlib.sha256(b"aabbcctok1uint16").hexdigest()[:16]
    assert lineage.split_digest(root / "train", META) == want
    assert (
        lineage.split_digest(root / "val", META) == hashlib.sha256(b"ddtok1uint16").hexdigest()[:16]
    )
    for change in ({"tokenizer_sha256": "tok2"}, {"dtype": "uint32"}):
        assert lineage.split_digest(root / "train", {**META, **change}) != want
    assert (
        lineage.split_digest(root / "train", {})
        == hashlib.sha256(b"aabbccNoneNone").hexdigest()[:16]
    )


@pytest.mark.parametrize("content", ["{}", '{"sha256": ""}', '{"sha256": 3}', "[1]", "not json"])
def test_a_side_file_without_a_digest_names_itself_and_the_folder_to_delete(tmp_path, content):
    root = prepared(tmp_path / "p", {"train": ["aa"]})
    side = root / "train" / "shard_000000.json"
    side.write_text(content)
    with pytest.raises(GptlabError) as e:
        lineage.split_digest(root / "train", META)
    assert str(e.value) == (
        f"{side}: no sha256 of its shard (the side file is damaged); delete {root} to prepare it "
        f"again"
    )


def test_each_split_is_described_with_its_own_figures_context_and_source(tmp_path):
    root = prepared(tmp_path / "p", {"train": ["aa", "bb"], "val": ["cc"]})
    text = tmp_path / "text.txt"
    got = lineage.describe(root, {**META, "source_sha256": "src"}, data_config(path=str(text)))
    source = {"source": "local", "path": str(text.resolve()), "sha256": "src", "tokenizer": "char"}
    assert got == [
        {
            "name": "tiny-train",
            "digest": lineage.split_digest(root / "train", META),
            "context": "training",
            "source_type": "local",
            "source": json.dumps(source, sort_keys=True),
            "profile": json.dumps(
                {
                    "tokens": 900,
                    "shards": 2,
                    "documents": 7,
                    "vocab_size": 65,
                    "dtype": "uint16",
                    "prepared": str(root),
                },
                sort_keys=True,
            ),
        },  # fmt: skip
        {
            "name": "tiny-val",
            "digest": lineage.split_digest(root / "val", META),
            "context": "validation",
            "source_type": "local",
            "source": json.dumps(source, sort_keys=True),
            "profile": json.dumps(
                {
                    "tokens": 100,
                    "shards": 1,
                    "documents": 7,
                    "vocab_size": 65,
                    "dtype": "uint16",
                    "prepared": str(root),
                },
                sort_keys=True,
            ),
        },  # fmt: skip
    ]
    assert got[0]["digest"] != got[1]["digest"]
    lineage.write(tmp_path, got)
    assert lineage.read(tmp_path) == got
    assert json.loads((tmp_path / "datasets.json").read_text()) == {"datasets": got}
    assert lineage.read(tmp_path / "nowhere") is None


def test_the_source_says_where_the_text_came_from_in_the_data_configs_words(tmp_path):
    hf = {"hf_dataset": "roneneldan/TinyStories", "hf_config": None, "hf_split": "train"}
    assert lineage.source_of(data_config("hf", None, **hf), {}) == {
        "source": "hf", **hf, "tokenizer": "char"
    }  # fmt: skip
    assert lineage.source_of(data_config("hf", "/d/stories", **hf), {"source_sha256": ""}) == {
        "source": "hf", **hf, "path": "/d/stories", "tokenizer": "char"
    }  # fmt: skip
    url = "https://example.org/t.txt"
    assert lineage.source_of(data_config("url", None, url), {"source_sha256": "s"}) == {
        "source": "url", "url": url, "sha256": "s", "tokenizer": "char"
    }  # fmt: skip
    root = prepared(tmp_path / "p", {"train": ["aa"], "val": ["bb"]})
    kinds = {
        "hugging_face": data_config("hf", "/d/stories", **hf),
        "http": data_config("url", None, url),
        "local": data_config("local", str(tmp_path / "t.txt")),
    }
    for kind, data in kinds.items():
        assert {d["source_type"] for d in lineage.describe(root, META, data)} == {kind}


def test_the_descriptions_become_mlflow_dataset_inputs_tagged_with_their_context(tmp_path):
    root = prepared(tmp_path / "p", {"train": ["aa"], "val": ["bb"]})
    described = lineage.describe(root, META, data_config(path=str(tmp_path / "t.txt")))
    inputs = lineage.dataset_inputs(described)
    assert [(i.tags[0].key, i.tags[0].value) for i in inputs] == [
        ("mlflow.data.context", "training"),
        ("mlflow.data.context", "validation"),
    ]
    for i, d in zip(inputs, described):
        ds = i.dataset
        got = (ds.name, ds.digest, ds.source_type, ds.source, ds.schema, ds.profile)
        assert got == (d["name"], d["digest"], "local", d["source"], None, d["profile"])
