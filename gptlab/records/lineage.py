"""A run's data as MLflow dataset inputs: which token shards it trained and validated on.

Each split of the prepared data is one dataset: named `<data.name>-<split>`, its digest made from
the shards' own SHA-256s (written beside each shard when it was prepared: nothing is read but those
side files), the tokenizer's and the token dtype, so two runs on the same prepared data show the
same digest and any change of text, tokenizer or split shows a new one. The source says where the
text came from (a local path, a URL or a Hub dataset, and the tokenizer); the profile gives tokens,
shards, documents, vocabulary and dtype. The descriptions are written to the run folder
(datasets.json), from which MLflow gets them live and `gptlab.sync` later.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from gptlab.errors import GptlabError
from gptlab.records import layout

SPLITS = (("train", "training"), ("val", "validation"))  # (folder, MLflow's context)
DIGEST_CHARS = 16  # MLflow keeps a dataset digest of at most 36 characters
WEIGHT_TAG = "mixture_weight"  # a mixture source's input tag: its normalised weight in this run


def split_digest(folder: Path, meta: Dict[str, Any]) -> str:
    """The digest of one split: its shards' SHA-256s in order, the tokenizer's and the dtype."""
    h = hashlib.sha256()
    for side in sorted(folder.glob("shard_*.json")):
        h.update(shard_sha256(side).encode())
    h.update(str(meta.get("tokenizer_sha256")).encode())
    h.update(str(meta.get("dtype")).encode())
    return h.hexdigest()[:DIGEST_CHARS]


def shard_sha256(side: Path) -> str:
    """The SHA-256 a shard's side file records of its tokens.

    A side file without one (damaged, edited) is one line naming it and the way out, as a missing
    one is (data/shards.py).
    """
    try:
        digest = json.loads(side.read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        digest = None
    if not isinstance(digest, str) or not digest:
        root = side.parent.parent
        raise GptlabError(
            f"{side}: no sha256 of its shard (the side file is damaged); delete {root} to "
            f"prepare it again"
        )
    return digest


def source_of(data: Any, meta: Dict[str, Any]) -> Dict[str, Any]:
    """Where the text came from, in the data config's words, and how it was tokenized."""
    if data.source == "hf":
        where: Dict[str, Any] = {
            "hf_dataset": data.hf_dataset,
            "hf_config": data.hf_config,
            "hf_split": data.hf_split,
        }
        if data.path:
            where["path"] = str(data.path)
    elif data.path:
        where = {"path": str(Path(data.path).expanduser().resolve())}
    else:
        where = {"url": data.url}
    if meta.get("source_sha256"):
        where["sha256"] = meta["source_sha256"]
    return {"source": data.source, **where, "tokenizer": data.tokenizer.kind}


def describe(root: Path, meta: Dict[str, Any], data: Any) -> List[Dict[str, Any]]:
    """One description per split of the prepared data at `root` (its meta.json `meta`)."""
    source = source_of(data, meta)
    kind = "hugging_face" if data.source == "hf" else ("local" if data.path else "http")
    out = []
    for split, context in SPLITS:
        profile = {
            "tokens": meta.get(f"{split}_tokens"),
            "shards": meta.get(f"{split}_shards"),
            "documents": meta.get("documents"),
            "vocab_size": meta.get("vocab_size"),
            "dtype": meta.get("dtype"),
            "prepared": str(root),
        }
        out.append(
            {
                "name": f"{data.name}-{split}",
                "digest": split_digest(root / split, meta),
                "context": context,
                "source_type": kind,
                "source": json.dumps(source, sort_keys=True),
                "profile": json.dumps(profile, sort_keys=True),
            }
        )
    return out


def describe_mixture(mixture: Any) -> List[Dict[str, Any]]:
    """A mixture's datasets: each source's splits as datasets of their own.

    Each is named `<source>-<split>`, with the source's weight (normalised) in its source and
    profile.
    """
    out = []
    for s, d in zip(mixture.sources, mixture.data):
        for entry in describe(d.root, d.meta, s.cfg):
            entry["name"] = f"{s.name}-{entry['name'].rsplit('-', 1)[1]}"
            profile = {**json.loads(entry["profile"]), "mixture_source": s.name}
            entry["profile"] = json.dumps(profile, sort_keys=True)
            entry["weight"] = s.weight  # per run (an input tag): weights change, the data not
            out.append(entry)
    return out


def write(run_dir: Path, datasets: List[Dict[str, Any]]) -> None:
    text = json.dumps({"datasets": datasets}, indent=1) + "\n"
    (Path(run_dir) / layout.DATASETS).write_text(text)


def read(run_dir: Path) -> Optional[List[Dict[str, Any]]]:
    """The run folder's dataset descriptions (None for a run from before they were written)."""
    record = layout.read_json(Path(run_dir) / layout.DATASETS)
    return record.get("datasets") if record else None


def mlflow_dataset(d: Dict[str, Any]) -> Any:
    """One description as an MLflow Dataset entity."""
    from mlflow.entities import Dataset

    return Dataset(d["name"], d["digest"], d["source_type"], d["source"], None, d["profile"])


def dataset_inputs(datasets: List[Dict[str, Any]]) -> List[Any]:
    """The descriptions as MLflow DatasetInputs (the context as MLflow's own input tag)."""
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    return [
        DatasetInput(
            mlflow_dataset(d),
            [InputTag(MLFLOW_DATASET_CONTEXT, d["context"])]
            + ([InputTag(WEIGHT_TAG, f"{d['weight']:g}")] if "weight" in d else []),
        )
        for d in datasets
    ]
