"""The ``data`` config group's schema (and its ``tokenizer`` sub-config).

Types only: the values are in conf/data/.
"""

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class TokenizerConfig:
    kind: str  # char | bpe | gpt2
    vocab_size: int  # bpe: every id, the 3 special tokens <|bos|> <|eos|> <|pad|> included
    train_bytes: int  # bpe: trained on the first this many bytes of training documents
    path: Optional[str]  # bpe: a ranks file (.tiktoken) to use instead of training one


@dataclass
class DataConfig:
    name: str
    source: str  # shakespeare | text_files | hf
    path: Optional[str]  # a local copy (file, folder or glob; for hf: parquet or save_to_disk)
    url: str
    sha256: Optional[str]  # checked on downloaded files
    # Hugging Face datasets (source=hf)
    hf_dataset: Optional[str]  # Hub id, e.g. HuggingFaceFW/fineweb-edu
    hf_config: Optional[str]  # e.g. sample-10BT
    hf_split: str
    text_column: str
    cleaner: str  # none | gutenberg (strip Project Gutenberg boilerplate, normalise blank lines)
    dedup: bool  # drop documents whose (cleaned) text was seen before
    max_documents: Optional[int]  # only the first N documents (smoke runs, measurements)
    tokenizer: TokenizerConfig
    # Splitting and shards
    split: str  # tail: the last val_fraction of the token stream | documents: by document
    val_fraction: float
    seed: int  # the document split and shuffle (split=documents)
    shuffle: bool  # split=documents: shuffle documents (seeded) before sharding
    separator: str  # eos: <|eos|> after each document | bos: <|bos|> before | none
    shard_divisor: int  # the number of shards per split is a multiple of this (balanced ranks)
    shard_tokens: int  # at most this many tokens per shard
    workers: int  # tokenizer processes (0: tokenize in this process)
    progress: bool  # a progress bar on stderr (documents/s, MB/s, ETA)
    # Loading
    sampling: str  # random: random windows | sequential: epochs over the shards in order
    cache_dir: Optional[str]  # null: $GPTLAB_CACHE_DIR, else ~/.cache/gptlab
    # Mixtures (data=mixture): {name: {data: CHOICE, weight: W, ...that choice's data keys}}, or
    # null; typed Any so that a command-line dict replaces the null (Hydra merges into a dict node)
    sources: Any
    max_epochs: float  # a mixture whose run would repeat a source more often than this warns
