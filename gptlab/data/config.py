"""The ``data`` config group's schema (and its ``tokenizer`` sub-config)."""

from dataclasses import dataclass, field
from typing import Optional

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@dataclass
class TokenizerConfig:
    kind: str = "char"  # char | bpe | gpt2
    vocab_size: int = 32768  # bpe: every id, the 3 special tokens <|bos|> <|eos|> <|pad|> included
    train_bytes: int = 200_000_000  # bpe: trained on the first this many bytes of training documents
    path: Optional[str] = None  # bpe: a ranks file (.tiktoken) to use instead of training one


@dataclass
class DataConfig:
    name: str = "shakespeare_char"
    source: str = "shakespeare"  # shakespeare | text_files | hf
    path: Optional[str] = None  # a local copy (file, folder or glob; for hf: parquet or save_to_disk)
    url: str = TINY_SHAKESPEARE_URL
    sha256: Optional[str] = TINY_SHAKESPEARE_SHA256  # checked on downloaded files
    # Hugging Face datasets (source=hf)
    hf_dataset: Optional[str] = None  # Hub id, e.g. HuggingFaceFW/fineweb-edu
    hf_config: Optional[str] = None  # e.g. sample-10BT
    hf_split: str = "train"
    text_column: str = "text"
    cleaner: str = "none"  # none | gutenberg (strip Project Gutenberg boilerplate, normalise blank lines)
    dedup: bool = False  # drop documents whose (cleaned) text was seen before
    max_documents: Optional[int] = None  # only the first N documents (smoke runs, measurements)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # Splitting and shards
    split: str = "tail"  # tail: the last val_fraction of the token stream | documents: by document
    val_fraction: float = 0.1
    seed: int = 1337  # the document split and shuffle (split=documents)
    shuffle: bool = True  # split=documents: shuffle documents (seeded) before sharding
    separator: str = "none"  # eos: <|eos|> after each document | bos: <|bos|> before | none
    shard_divisor: int = 8  # the number of shards per split is a multiple of this (balanced ranks)
    shard_tokens: int = 100_000_000  # at most this many tokens per shard
    workers: int = 2  # tokenizer processes (0: tokenize in this process)
    progress: bool = True  # a progress bar on stderr (documents/s, MB/s, ETA)
    # Loading
    sampling: str = "random"  # random: random windows | sequential: epochs over the shards in order
    cache_dir: Optional[str] = None  # null: $GPTLAB_CACHE_DIR, else ~/.cache/gptlab
