"""Text -> token files: ``train.bin`` / ``val.bin`` (flat uint16 arrays) plus ``meta.json``.

The output folder is keyed by (dataset, tokenizer, source hash, split), is written into a temporary
folder and renamed into place, so a second call is free and an interrupted one leaves nothing that
looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

import numpy as np

from gptlab.data.config import DataConfig
from gptlab.data.sources import cache_root, fetch_text_file, sha256_file
from gptlab.data.tokenizers import CharTokenizer, Tokenizer, load_tokenizer
from gptlab.errors import GptlabError

FORMAT_VERSION = 1
SOURCES = ("shakespeare",)
TOKENIZERS = ("char",)


@dataclass
class PreparedData:
    """A prepared dataset: where its token files are and how to read them."""

    root: Path
    meta: Dict[str, Any]

    @property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.meta["tokenizer"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens as a read-only memory map (nothing is loaded into RAM)."""
        return np.memmap(self.root / f"{split}.bin", dtype=np.dtype(self.meta["dtype"]), mode="r")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _write_array(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(arr.tobytes())
        f.flush()
        os.fsync(f.fileno())


def prepare_data(cfg: DataConfig, log=print) -> PreparedData:
    """Make sure the token files for cfg exist (building them if needed) and return them."""
    if cfg.source not in SOURCES:
        raise GptlabError(f"data.source={cfg.source}: unknown source (choose from {', '.join(SOURCES)})")
    if cfg.tokenizer not in TOKENIZERS:
        raise GptlabError(
            f"data.tokenizer={cfg.tokenizer}: unknown tokenizer (choose from {', '.join(TOKENIZERS)})"
        )
    cache = cache_root(cfg.cache_dir)
    text_path = fetch_text_file(cfg.path, cfg.url, cfg.sha256, cache, "tinyshakespeare.txt")
    digest = sha256_file(text_path)
    key = f"{cfg.name}-{cfg.tokenizer}-{digest[:12]}-val{cfg.val_fraction:g}-v{FORMAT_VERSION}"
    root = cache / "tokens" / key
    meta_path = root / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise GptlabError(f"{root}: made by token-file format {meta.get('format_version')}, "
                              f"this gptlab reads {FORMAT_VERSION}; delete the folder to rebuild it")
        return PreparedData(root, meta)

    text = text_path.read_text(encoding="utf-8")
    tok = CharTokenizer.fit(text)
    ids = tok.encode_array(text)
    dtype = token_dtype(tok.vocab_size)
    n_val = int(round(len(ids) * cfg.val_fraction))
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    if len(val) == 0 or len(train) == 0:
        raise GptlabError(f"data.val_fraction={cfg.val_fraction} leaves an empty split of {text_path}")
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_array(tmp / "train.bin", train.astype(dtype))
    _write_array(tmp / "val.bin", val.astype(dtype))
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": cfg.name,
        "source": str(text_path),
        "source_sha256": digest,
        "tokenizer": tok.to_meta(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp, root)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        return PreparedData(root, json.loads(meta_path.read_text()))
    log(f"prepared {cfg.name}: {len(train):,} train + {len(val):,} val tokens, "
        f"vocab {tok.vocab_size} -> {root}")
    return PreparedData(root, meta)
