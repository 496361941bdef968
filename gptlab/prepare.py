"""python -m gptlab.prepare data=... [overrides]: tokenize a dataset into token shards once.

``gptlab.train`` prepares on demand too; running this first (on one node, say) keeps tokenization
out of a job's time limit. Prints where the shards are and their figures.
"""

from __future__ import annotations

import json
from typing import Any, Dict

import hydra
from omegaconf import DictConfig

from gptlab.cli import run_entry
from gptlab.config import to_config
from gptlab.data import prepare_data


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> Dict[str, Any]:
    config = to_config(cfg)
    data = prepare_data(config.data)
    m = data.meta
    summary = {
        k: m[k]
        for k in (
            "dataset",
            "vocab_size",
            "dtype",
            "train_tokens",
            "val_tokens",
            "train_shards",
            "val_shards",
            "tokenizer_sha256",
            "documents",
        )
        if k in m
    }
    print(json.dumps({"root": str(data.root), **summary}), flush=True)
    return summary


if __name__ == "__main__":
    run_entry(main, "gptlab.prepare")
