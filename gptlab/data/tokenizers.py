"""Tokenizers: text <-> token ids. Each one can be rebuilt from the metadata saved with the tokens.

Three kinds, chosen by ``data.tokenizer.kind``:

- ``char``: one id per distinct character of the corpus (plus ``<|eos|>`` / ``<|bos|>`` when the
  documents are separated by one).
- ``bpe``: a byte-level BPE trained on the dataset's own text with Hugging Face ``tokenizers`` and
  saved as a tiktoken ranks file (``base64(token) rank`` per line), so encoding runs through
  ``tiktoken.Encoding``. Byte-level means every UTF-8 string round-trips exactly.
- ``gpt2``: tiktoken's GPT-2 encoding, read from tiktoken's cache (``TIKTOKEN_CACHE_DIR``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Protocol

import numpy as np

from gptlab.errors import GptlabError, as_user_error

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
# GPT-2's pre-tokenisation pattern: the one Hugging Face's ByteLevel pre-tokenizer applies while
# training, so tiktoken splits text exactly as the trainer saw it.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# tiktoken's GPT-2
R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_RANKS_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOT = 50256


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eos_id: Optional[int]
    bos_id: Optional[int]

    def encode(self, text: str) -> List[int]: ...

    def decode(self, ids: List[int]) -> str: ...

    def to_meta(self) -> Dict[str, Any]: ...

    def token_bytes(self) -> np.ndarray: ...


class CharTokenizer:
    """One token per distinct character of the corpus, ids in sorted character order.

    ``specials`` (``<|eos|>``, ``<|bos|>``) get the ids after the characters; they are only present
    when the prepared documents need a separator, so the classic 65-symbol Shakespeare stays 65.
    """

    kind = "char"

    def __init__(self, chars: str, specials: Iterable[str] = ()):
        self.chars = chars
        self.specials = list(specials)
        self.vocab_size = len(chars) + len(self.specials)
        self._stoi = {c: i for i, c in enumerate(chars)}
        self._lut = np.array([ord(c) for c in chars], dtype=np.int64)
        self._order = np.argsort(self._lut)
        ids = {s: len(chars) + i for i, s in enumerate(self.specials)}
        self.eos_id = ids.get("<|eos|>")
        self.bos_id = ids.get("<|bos|>")

    @classmethod
    def fit(cls, text: str, specials: Iterable[str] = ()) -> "CharTokenizer":
        return cls("".join(sorted(set(text))), specials)

    def encode(self, text: str) -> List[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError as e:
            raise GptlabError(
                f"character {e.args[0]!r} is not in this model's vocabulary of {self.vocab_size} "
                f"characters"
            ) from None

    def encode_array(self, text: str) -> np.ndarray:
        """Vectorised encode for whole corpora (about 100x faster than a Python loop)."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        if len(self._lut) == 0:
            if len(codes):
                raise GptlabError(f"character {text[0]!r} is not in the vocabulary")
            return np.zeros(0, dtype=np.int64)
        pos = np.searchsorted(self._lut[self._order], codes)
        pos = np.clip(pos, 0, len(self._order) - 1)
        ids = self._order[pos]
        if not np.array_equal(self._lut[ids], codes):
            bad = text[int(np.argmax(self._lut[ids] != codes))]
            raise GptlabError(f"character {bad!r} is not in the vocabulary")
        return ids

    def encode_ordinary_batch(self, texts: List[str]) -> List[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: List[int]) -> str:
        n = len(self.chars)
        return "".join(self.chars[i] if i < n else self.specials[i - n] for i in ids)

    def token_bytes(self) -> np.ndarray:
        """Each id's UTF-8 length in bytes (special tokens: 0), the denominator of bits per byte."""
        lengths = [len(c.encode("utf-8")) for c in self.chars] + [0] * len(self.specials)
        return np.array(lengths, dtype=np.int64)

    def to_meta(self) -> Dict[str, Any]:
        meta: Dict[str, Any] = {"kind": self.kind, "chars": self.chars}
        if self.specials:
            meta["specials"] = self.specials
        return meta

    def sha256(self) -> str:
        return hashlib.sha256(repr(self.to_meta()).encode()).hexdigest()


class TiktokenTokenizer:
    """A byte-level BPE (trained here, or GPT-2's) encoded and decoded by ``tiktoken``."""

    def __init__(
        self, kind: str, ranks_text: str, specials: Dict[str, int], pat_str: str, eos: str, bos: str
    ):
        import tiktoken

        self.kind = kind
        self.ranks_text = ranks_text
        ranks = parse_ranks(ranks_text)
        self.specials = dict(specials)
        self.pat_str = pat_str
        self.enc = tiktoken.Encoding(
            name=f"gptlab-{kind}",
            pat_str=pat_str,
            mergeable_ranks=ranks,
            special_tokens=self.specials,
        )
        self.vocab_size = self.enc.n_vocab
        self.eos_id = self.specials[eos]
        self.bos_id = self.specials[bos]
        self._sha = hashlib.sha256(ranks_text.encode()).hexdigest()

    def encode(self, text: str) -> List[int]:
        # Special-token strings in the text are ordinary text: a corpus can't inject an <|eos|>.
        return self.enc.encode_ordinary(text)

    def encode_ordinary_batch(self, texts: List[str]) -> List[List[int]]:
        return [self.enc.encode_ordinary(t) for t in texts]

    def decode(self, ids: List[int]) -> str:
        return self.enc.decode_bytes(list(ids)).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        """Each id's length in bytes, the denominator of bits per byte.

        Special tokens and unused ids: 0.
        """
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        special = set(self.specials.values())
        for i in range(self.vocab_size):
            if i not in special:
                # an id no merge produced (a gap below the specials) keeps 0
                with contextlib.suppress(KeyError):
                    lengths[i] = len(self.enc.decode_single_token_bytes(i))
        return lengths

    def sha256(self) -> str:
        """The hash of the ranks file: what the shards record to refuse a different tokenizer."""
        return self._sha

    def to_meta(self) -> Dict[str, Any]:
        if self.kind == "gpt2":  # a public, fixed encoding: the name and hash suffice
            return {"kind": "gpt2", "sha256": self._sha}
        return {
            "kind": self.kind,
            "sha256": self._sha,
            "ranks": self.ranks_text,
            "specials": self.specials,
            "pat_str": self.pat_str,
        }


def parse_ranks(text: str) -> Dict[bytes, int]:
    """A tiktoken ranks file: one ``base64(token) rank`` per line."""
    ranks = {}
    for line in text.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def format_ranks(ranks: Dict[bytes, int]) -> str:
    return "".join(
        f"{base64.b64encode(t).decode()} {r}\n"
        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
    )


def bpe_from_ranks(ranks_text: str) -> TiktokenTokenizer:
    n = len(parse_ranks(ranks_text))
    specials = {s: n + i for i, s in enumerate(SPECIAL_TOKENS)}
    return TiktokenTokenizer("bpe", ranks_text, specials, GPT2_PAT, eos="<|eos|>", bos="<|bos|>")


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet HF's ByteLevel BPE works in)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def train_bpe(texts: Iterator[str], vocab_size: int) -> str:
    """Train a byte-level BPE on texts; returns a tiktoken ranks file's text.

    vocab_size counts the three special tokens, which take the last ids. Merge order becomes rank
    order, which is exactly how tiktoken applies merges (lowest rank first).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    n_merge_vocab = vocab_size - len(SPECIAL_TOKENS)
    if n_merge_vocab < 256:
        raise GptlabError(
            f"data.tokenizer.vocab_size={vocab_size}: a byte-level BPE needs at least "
            f"{256 + len(SPECIAL_TOKENS)} ids (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=n_merge_vocab,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    vocab = tok.get_vocab()  # token string (in the byte alphabet) -> id
    ranks = {bytes(byte_of[c] for c in s): i for s, i in vocab.items()}
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise RuntimeError("trained BPE ids are not contiguous")  # a bug, not a user error
    return format_ranks(ranks)


def _tiktoken_cache_dir() -> Path:
    d = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    return Path(d) if d else Path(tempfile.gettempdir()) / "data-gym-cache"


def gpt2_cache_path() -> Path:
    """Where tiktoken keeps (and gptlab looks for) GPT-2's ranks file."""
    return _tiktoken_cache_dir() / hashlib.sha1(GPT2_RANKS_URL.encode()).hexdigest()


def gpt2_tokenizer() -> TiktokenTokenizer:
    """GPT-2's encoding from tiktoken's cache, downloading it there when the network allows."""
    path = gpt2_cache_path()
    data = path.read_bytes() if path.is_file() else None
    if data is not None and hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        raise GptlabError(
            f"{path} is not GPT-2's ranks file (SHA-256 mismatch); delete it and pre-fill "
            f"TIKTOKEN_CACHE_DIR again"
        )
    if data is None:
        # offline: requests' connection error, or a proxy's
        with as_user_error(
            lambda e: (
                f"data.tokenizer.kind=gpt2: tiktoken's GPT-2 file is not in TIKTOKEN_CACHE_DIR="
                f"{_tiktoken_cache_dir()} and could not be downloaded ({type(e).__name__}); on a "
                f"machine "
                f'with internet run `TIKTOKEN_CACHE_DIR=DIR python -c "import tiktoken; '
                f"tiktoken.get_encoding('r50k_base')\"`, copy DIR here and set "
                f"TIKTOKEN_CACHE_DIR=DIR"
            )
        ):
            import tiktoken.load

            data = tiktoken.load.read_file_cached(GPT2_RANKS_URL, GPT2_RANKS_SHA256)
    ranks_text = data.decode()
    return TiktokenTokenizer(
        "gpt2",
        ranks_text,
        {"<|endoftext|>": GPT2_EOT},
        R50K_PAT,
        eos="<|endoftext|>",
        bos="<|endoftext|>",
    )


def load_tokenizer(meta: Dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer recorded in a prepared dataset's (or a checkpoint's) metadata."""
    kind = meta.get("kind")
    if kind == "char":
        return CharTokenizer(meta["chars"], meta.get("specials", ()))
    if kind == "bpe":
        return TiktokenTokenizer(
            "bpe", meta["ranks"], meta["specials"], meta["pat_str"], eos="<|eos|>", bos="<|bos|>"
        )
    if kind == "gpt2":
        return gpt2_tokenizer()
    raise GptlabError(f"unknown tokenizer kind {kind!r} in dataset metadata")
