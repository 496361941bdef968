"""The ``data`` config group's schema."""

from dataclasses import dataclass
from typing import Optional

TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@dataclass
class DataConfig:
    name: str = "shakespeare_char"
    source: str = "shakespeare"  # shakespeare
    tokenizer: str = "char"  # char
    path: Optional[str] = None  # a local copy of the text, used instead of downloading
    url: str = TINY_SHAKESPEARE_URL
    sha256: Optional[str] = TINY_SHAKESPEARE_SHA256  # checked on downloaded files
    val_fraction: float = 0.1  # the last fraction of the text is the validation split
    cache_dir: Optional[str] = None  # null: $GPTLAB_CACHE_DIR, else ~/.cache/gptlab
