"""Data: sources (download / local), tokenizers, prepare (text -> token files) and batch loaders.

The public surface is ``DataConfig``, ``prepare_data(cfg)`` and the loaders; ``build.py`` wires them.
"""

from gptlab.data.config import DataConfig
from gptlab.data.loader import RandomWindowLoader, build_train_loader, eval_batches
from gptlab.data.prepare import PreparedData, prepare_data
from gptlab.data.tokenizers import CharTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "DataConfig",
    "PreparedData",
    "prepare_data",
    "RandomWindowLoader",
    "build_train_loader",
    "eval_batches",
    "CharTokenizer",
    "Tokenizer",
    "load_tokenizer",
]
