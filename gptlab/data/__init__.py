"""Data: sources, tokenizers, prepare (text -> token shards) and loaders.

Sources: download / local / Hugging Face.

The public surface is ``DataConfig``, ``prepare_data(cfg)`` and the loaders; ``build.py`` wires
them. Names are imported on first use (PEP 562), so the tokenizer worker processes that ``prepare``
spawns import tiktoken and numpy, not torch.
"""

from importlib import import_module
from typing import Any

from gptlab.data.config import DataConfig, TokenizerConfig

_WHERE = {
    "PreparedData": "prepare",
    "prepare_data": "prepare",
    "RandomWindowLoader": "loader",
    "SequentialLoader": "loader",
    "build_train_loader": "loader",
    "eval_batches": "loader",
    "TokenShards": "shards",
    "CharTokenizer": "tokenizers",
    "TiktokenTokenizer": "tokenizers",
    "Tokenizer": "tokenizers",
    "load_tokenizer": "tokenizers",
}

__all__ = ["DataConfig", "TokenizerConfig", *_WHERE]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"gptlab.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'gptlab.data' has no attribute {name!r}")
