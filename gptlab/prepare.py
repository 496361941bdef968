"""python -m gptlab.prepare data=... [overrides]: tokenize a dataset into token shards once.

``gptlab.train`` prepares on demand too; running this first (on one node, say) keeps tokenization
out of a job's time limit. Prints where the shards are and their figures. The root config is
conf/prepare.yaml: the training config (its `data` section), and no run folder.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig

from gptlab.cli import command
from gptlab.config import to_config
from gptlab.data import prepare_data


def run_prepare(cfg: DictConfig) -> Dict[str, Any]:
    """Prepare the data section's shards and print one JSON line.

    cfg: composed from conf/prepare.yaml.
    """
    config = to_config(cfg)
    if config.data.sources:  # a mixture: each source prepared, with their one tokenizer
        from gptlab.data.mixture import prepare_mixture

        mixed = prepare_mixture(config.data, block_size=config.model.block_size)
        return {s.name: _prepared(d) for s, d in zip(mixed.sources, mixed.data)}
    return _prepared(prepare_data(config.data))


def _prepared(data: Any) -> Dict[str, Any]:
    """Print one prepared dataset's JSON line; its summary."""
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


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    """python -m gptlab.prepare data=... [overrides]: a Hydra app on conf/prepare.yaml.

    argv: overrides, to prepare in this process (returns the summary; errors raise GptlabError).
    """
    return command("prepare", run_prepare, argv)


if __name__ == "__main__":
    main()
