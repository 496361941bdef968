"""Tokenizers: text <-> token ids. Each one can be rebuilt from the metadata saved with the tokens."""

from __future__ import annotations

from typing import Any, Dict, List, Protocol

import numpy as np

from gptlab.errors import GptlabError


class Tokenizer(Protocol):
    kind: str
    vocab_size: int

    def encode(self, text: str) -> List[int]: ...

    def decode(self, ids: List[int]) -> str: ...

    def to_meta(self) -> Dict[str, Any]: ...


class CharTokenizer:
    """One token per distinct character of the corpus, ids in sorted character order."""

    kind = "char"

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self._stoi = {c: i for i, c in enumerate(chars)}
        self._lut = np.array([ord(c) for c in chars], dtype=np.int64)

    @classmethod
    def fit(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> List[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError as e:
            raise GptlabError(
                f"character {e.args[0]!r} is not in this model's vocabulary of {self.vocab_size} characters"
            ) from None

    def encode_array(self, text: str) -> np.ndarray:
        """Vectorised encode for whole corpora (about 100x faster than a Python loop)."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        order = np.argsort(self._lut)
        pos = np.searchsorted(self._lut[order], codes)
        pos = np.clip(pos, 0, len(order) - 1)
        ids = order[pos]
        if not np.array_equal(self._lut[ids], codes):
            bad = text[int(np.argmax(self._lut[ids] != codes))]
            raise GptlabError(f"character {bad!r} is not in the vocabulary")
        return ids

    def decode(self, ids: List[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_meta(self) -> Dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars}


def load_tokenizer(meta: Dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer recorded in a prepared dataset's metadata."""
    kind = meta.get("kind")
    if kind == "char":
        return CharTokenizer(meta["chars"])
    raise GptlabError(f"unknown tokenizer kind {kind!r} in dataset metadata")
