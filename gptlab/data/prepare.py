"""Text -> token shards, once per (source, tokenizer, split settings).

The pipeline, with memory bounded whatever the corpus size:

1. Tokenizer: ``char`` is fitted on the corpus's characters, ``bpe`` trained on the first
   ``tokenizer.train_bytes`` of training text (or read from ``tokenizer.path``), ``gpt2`` loaded.
2. Encode: documents stream to worker processes in small batches (at most a few in flight), come
   back in order, and are appended to one flat token file per split plus a (start, length) table.
   With ``split=documents`` each document goes to train or val by a seeded hash of its index.
3. Shard: per split, documents are written in a seeded shuffled order (``split=documents``) into
   equal shards whose number is a multiple of ``shard_divisor``; the remainder (fewer tokens than
   there are shards) is dropped.

Everything is written into ``<key>.tmp<pid>/`` and renamed to ``<key>/`` at the end, ``meta.json``
last, so an interrupted run leaves nothing that looks complete and a second run finds the folder
and does nothing. The output is a pure function of the inputs, so a rerun after a crash writes
byte-identical shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
import types
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from gptlab.data.config import DataConfig
from gptlab.data.shards import (
    FORMAT_VERSION,
    ShardWriter,
    TokenShards,
    _write_json,
    open_shards,
    shard_plan,
    token_dtype,
)
from gptlab.data.sources import (
    CLEANERS,
    Source,
    cache_root,
    doc_hash,
    is_val_document,
    limited,
    open_source,
)
from gptlab.data.tokenizers import (
    CharTokenizer,
    Tokenizer,
    bpe_from_ranks,
    gpt2_tokenizer,
    load_tokenizer,
    parse_ranks,
    train_bpe,
)
from gptlab.errors import GptlabError

logger = logging.getLogger(__name__)

SOURCES = ("shakespeare", "text_files", "hf")
TOKENIZERS = ("char", "bpe", "gpt2")
TOKENIZER_FILE = "tokenizer.tiktoken"
# text per worker task: big enough to amortise pickling, small enough to bound memory
BATCH_CHARS = 4 << 20


@dataclass
class PreparedData:
    """A prepared dataset: where its shards are and how to read them."""

    root: Path
    meta: Dict[str, Any]

    @property
    def tokenizer(self) -> Tokenizer:
        t = self.meta["tokenizer"]
        if t["kind"] == "bpe":
            return bpe_from_ranks((self.root / TOKENIZER_FILE).read_text())
        return load_tokenizer(t)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta["tokenizer_sha256"]

    def tokens(self, split: str):
        """The split as one flat read-only token array.

        A memory map when it is one shard, else TokenShards.
        """
        shards = open_shards(self.root / split, self.meta)
        return shards[0] if len(shards) == 1 else TokenShards(shards)

    def shards(self, split: str) -> TokenShards:
        return TokenShards(open_shards(self.root / split, self.meta))


def _check_choices(cfg: DataConfig) -> None:
    def choice(key, value, options):
        if value not in options:
            raise GptlabError(f"data.{key}={value}: must be one of {', '.join(options)}")

    choice("source", cfg.source, SOURCES)
    choice("tokenizer.kind", cfg.tokenizer.kind, TOKENIZERS)
    choice("split", cfg.split, ("tail", "documents"))
    choice("separator", cfg.separator, ("none", "eos", "bos"))
    choice("cleaner", cfg.cleaner, tuple(CLEANERS))
    choice("sampling", cfg.sampling, ("random", "sequential"))
    if not 0.0 < cfg.val_fraction < 1.0:
        raise GptlabError(f"data.val_fraction={cfg.val_fraction}: must be in (0, 1)")
    if cfg.shard_divisor < 1 or cfg.shard_tokens < 1:
        raise GptlabError("data.shard_divisor and data.shard_tokens must be positive")
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise GptlabError(
            f"data.max_documents={cfg.max_documents}: must be positive, or null for all documents"
        )
    if cfg.workers < 0:
        raise GptlabError(f"data.workers={cfg.workers}: must be >= 0 (0 tokenizes in this process)")


def dataset_key(
    cfg: DataConfig, source: Source, given: Optional[Tokenizer] = None
) -> Tuple[str, Dict[str, Any]]:
    """The prepared folder's name: everything that changes the shards, and nothing else.

    given: a tokenizer made elsewhere (a mixture's, over all its sources): keyed by its SHA-256."""
    tok = asdict(cfg.tokenizer)
    if given is not None:
        tok = {"kind": cfg.tokenizer.kind, "sha256": given.sha256()}
    elif cfg.tokenizer.kind != "bpe":
        tok = {"kind": cfg.tokenizer.kind}
    elif cfg.tokenizer.path:
        tok = {"kind": "bpe", "ranks_sha256": _read_ranks_file(cfg.tokenizer.path)[1]}
    settings = {
        "format_version": FORMAT_VERSION,
        "source": source.fingerprint,
        "tokenizer": tok,
        "cleaner": cfg.cleaner,
        "dedup": cfg.dedup,
        "max_documents": cfg.max_documents,
        "split": cfg.split,
        "val_fraction": cfg.val_fraction,
        "separator": cfg.separator,
        "shard_divisor": cfg.shard_divisor,
        "shard_tokens": cfg.shard_tokens,
    }
    if cfg.split == "documents":
        settings.update(seed=cfg.seed, shuffle=cfg.shuffle)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return f"{cfg.name}-{cfg.tokenizer.kind}-{digest}-v{FORMAT_VERSION}", settings


def _read_ranks_file(path: str) -> Tuple[str, str]:
    """The text of a tiktoken ranks file and its SHA-256.

    One line naming data.tokenizer.path when it is not one.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        raise GptlabError(
            f"data.tokenizer.path={path} is a folder: give a tiktoken ranks file (.tiktoken)"
        )
    if not p.is_file():
        raise GptlabError(f"data.tokenizer.path={path}: no such ranks file")
    try:
        text = p.read_bytes().decode("utf-8")
        ranks = parse_ranks(text)
        # a byte-level BPE starts from every byte
        if any(bytes([b]) not in ranks for b in range(256)):
            raise ValueError(f"{len(ranks)} tokens, not all 256 single bytes among them")
    except (UnicodeDecodeError, ValueError) as e:  # binascii.Error is a ValueError
        raise GptlabError(
            f"data.tokenizer.path={path} is not a tiktoken ranks file (one 'base64(token) rank' a "
            f"line: "
            f"{str(e).splitlines()[0][:80]}); give one that gptlab.prepare saved "
            f"(tokenizer.tiktoken)"
        ) from None
    return text, hashlib.sha256(text.encode()).hexdigest()


# --- worker side --------------------------------------------------------------------------------

_W: Dict[str, Any] = {}


def _worker_init(
    tok_meta: Dict[str, Any], cleaner: str, dedup: bool, sep: Optional[Tuple[str, int]], dtype: str
) -> None:
    _W.update(
        tok=load_tokenizer(tok_meta),
        clean=CLEANERS[cleaner],
        dedup=dedup,
        sep=sep,
        dtype=np.dtype(dtype),
    )


def _encode_batch(docs: List[str]) -> Tuple[np.ndarray, np.ndarray, List[int], int]:
    """Clean, hash and encode a batch.

    Returns (tokens of the kept documents, their lengths, hashes, bytes read).
    """
    clean, tok, sep, dtype = _W["clean"], _W["tok"], _W["sep"], _W["dtype"]
    nbytes = sum(len(d.encode("utf-8", "surrogatepass")) for d in docs)
    texts = [clean(d) for d in docs] if clean else docs
    hashes = [doc_hash(t) for t in texts] if _W["dedup"] else []
    encoded = tok.encode_ordinary_batch(texts)
    parts, lengths = [], np.zeros(len(texts), dtype=np.int64)
    for i, (text, ids) in enumerate(zip(texts, encoded)):
        # an empty document (or one the cleaner emptied) adds nothing, not even a separator
        if not text:
            continue
        ids = np.asarray(ids, dtype=dtype)
        if sep is not None:
            one = np.array([sep[1]], dtype=dtype)
            ids = np.concatenate([one, ids] if sep[0] == "bos" else [ids, one])
        parts.append(ids)
        lengths[i] = len(ids)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return tokens, lengths, hashes, nbytes


def _batches(docs: Iterator[str]) -> Iterator[List[str]]:
    batch, size = [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded(docs: Iterator[str], workers: int, init_args: tuple) -> Iterator[tuple]:
    """Encode batches of documents in worker processes, yielding results in input order."""
    if workers == 0:
        _worker_init(*init_args)
        for b in _batches(docs):
            yield _encode_batch(b)
        return
    import multiprocessing as mp

    # spawn, not fork: the parent may hold threads (torch, the BPE trainer's pool) that fork would
    # copy mid-lock. A spawned child re-imports the parent's __main__ (here `gptlab.prepare` or
    # `gptlab.train`, so Hydra and torch: seconds per worker); hiding __main__ while the workers
    # start avoids that, and they import only this module when they unpickle their first task.
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=init_args)
    finally:
        sys.modules["__main__"] = main
    with pool:
        pending: deque = deque()
        for b in _batches(docs):
            pending.append(pool.apply_async(_encode_batch, (b,)))
            if len(pending) >= 2 * workers:  # bounded: at most 2 batches per worker in flight
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    def __init__(
        self, enabled: bool, total_bytes: Optional[int], total_docs: Optional[int], desc: str
    ):
        self.bar = None
        self.docs, self.bytes, self.t0 = 0, 0, time.perf_counter()
        if enabled:
            from tqdm import tqdm

            by_bytes = total_bytes is not None or total_docs is None
            self.by_bytes = by_bytes
            self.bar = tqdm(
                total=total_bytes if by_bytes else total_docs,
                unit="B" if by_bytes else "doc",
                unit_scale=True,
                desc=desc,
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def update(self, docs: int, nbytes: int) -> None:
        self.docs += docs
        self.bytes += nbytes
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.update(nbytes if self.by_bytes else docs)
            self.bar.set_postfix_str(
                f"{self.docs / dt:,.0f} docs/s {self.bytes / dt / 1e6:,.1f} MB/s", refresh=False
            )

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.t0


# --- the pipeline -------------------------------------------------------------------------------


def _training_texts(cfg: DataConfig, source: Source) -> Iterator[str]:
    """Cleaned training documents (never validation ones), up to tokenizer.train_bytes of text."""
    clean = CLEANERS[cfg.cleaner]
    budget = cfg.tokenizer.train_bytes
    for i, d in enumerate(limited(source.documents(), cfg.max_documents)):
        if cfg.split == "documents" and is_val_document(cfg.seed, i, cfg.val_fraction):
            continue
        t = clean(d) if clean else d
        if budget <= 0:
            return
        if len(t) > budget:
            t = t[:budget]
        budget -= len(t.encode("utf-8", "surrogatepass"))
        yield t


def _build_tokenizer(cfg: DataConfig, source: Source, log: Callable[[str], None]):
    """(tokenizer, ranks file text or None)."""
    kind = cfg.tokenizer.kind
    if kind == "gpt2":
        return gpt2_tokenizer(), None
    if kind == "char":
        specials = {"eos": ["<|eos|>"], "bos": ["<|bos|>"], "none": []}[cfg.separator]
        clean = CLEANERS[cfg.cleaner]
        chars: set = set()
        for d in limited(source.documents(), cfg.max_documents):
            chars.update(clean(d) if clean else d)
        return CharTokenizer("".join(sorted(chars)), specials), None
    if cfg.tokenizer.path:
        ranks = _read_ranks_file(cfg.tokenizer.path)[0]
    else:
        t0 = time.perf_counter()
        ranks = train_bpe(_training_texts(cfg, source), cfg.tokenizer.vocab_size)
        log(
            f"trained a byte-level BPE of {len(ranks.splitlines()):,} merges + 3 special tokens "
            f"in {time.perf_counter() - t0:.1f}s"
        )
    return bpe_from_ranks(ranks), ranks


def _separator(cfg: DataConfig, tok) -> Optional[Tuple[str, int]]:
    if cfg.separator == "none":
        return None
    tid = tok.eos_id if cfg.separator == "eos" else tok.bos_id
    return (cfg.separator, int(tid))


def _sweep_stale(root: Path) -> None:
    """Remove temporary folders left by killed runs (their process is gone)."""
    for tmp in root.parent.glob(root.name + ".tmp*"):
        try:
            pid = int(tmp.name.rsplit(".tmp", 1)[1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass


def _open_prepared(root: Path) -> PreparedData:
    try:
        meta = json.loads((root / "meta.json").read_text())
    except ValueError as e:  # edited or damaged by hand: the shards cannot be trusted either
        raise GptlabError(
            f"{root / 'meta.json'} is not valid JSON ({e}); delete {root} to prepare it again"
        ) from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise GptlabError(
            f"{root}: made by token-file format {meta.get('format_version')}, "
            f"this gptlab reads {FORMAT_VERSION}; delete the folder to rebuild it"
        )
    if meta["tokenizer"]["kind"] == "bpe":
        got = hashlib.sha256((root / TOKENIZER_FILE).read_bytes()).hexdigest()
        if got != meta["tokenizer_sha256"]:
            raise GptlabError(
                f"{root / TOKENIZER_FILE}: SHA-256 {got[:12]} differs from the shards' "
                f"{meta['tokenizer_sha256'][:12]}; delete {root} to prepare it again"
            )
    return PreparedData(root, meta)


def prepare_data(
    cfg: DataConfig,
    log: Optional[Callable[[str], None]] = None,
    tokenizer: Optional[Tuple[Tokenizer, Optional[str]]] = None,
) -> PreparedData:
    """Make sure the token shards for cfg exist (building them if needed) and return them.

    log: where progress lines go (default: this module's logger, at INFO).
    tokenizer: (tokenizer, its ranks file text or None) to use instead of building one: a
    mixture's, shared by its sources (data/mixture.py).
    """
    log = log or logger.info
    if cfg.sources:
        raise GptlabError("data=mixture: prepare it with gptlab.data.mixture.prepare_mixture")
    _check_choices(cfg)
    cache = cache_root(cfg.cache_dir)
    source = open_source(cfg, cache)
    key, settings = dataset_key(cfg, source, tokenizer[0] if tokenizer else None)
    root = cache / "tokens" / key
    if (root / "meta.json").is_file():
        return _open_prepared(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(root)
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = _prepare_into(cfg, source, settings, tmp, log, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, root)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        return _open_prepared(root)
    log(
        f"prepared {cfg.name}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
        f"tokens in "
        f"{meta['train_shards']}+{meta['val_shards']} shards, vocab {meta['vocab_size']:,} "
        f"({meta['dtype']}), {meta['prepare_mb_per_s']:.1f} MB/s -> {root}"
    )
    return PreparedData(root, meta)


def _prepare_into(
    cfg: DataConfig,
    source: Source,
    settings: Dict[str, Any],
    tmp: Path,
    log: Callable[[str], None],
    given: Optional[Tuple[Tokenizer, Optional[str]]] = None,
) -> Dict[str, Any]:
    """Tokenize the source into tmp: the tokenizer, pass 1, pass 2, then meta.json last.

    Pass 1: documents into flat files per split; pass 2: flat files into shards.
    """
    tok, ranks = given or _build_tokenizer(cfg, source, log)
    if ranks is not None:
        (tmp / TOKENIZER_FILE).write_text(ranks)
    tok_sha = tok.sha256()
    dtype = token_dtype(tok.vocab_size)
    splits = ("train", "val") if cfg.split == "documents" else ("all",)
    encoded = _encode_documents(cfg, source, tok, dtype, splits, tmp)
    _check_has_text(cfg, encoded)
    header = {
        "format_version": FORMAT_VERSION,
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok_sha,
    }
    counts = _shard_splits(cfg, dtype, header, encoded["written"], tmp)
    for s in splits:
        (tmp / f"{s}.flat").unlink()
        (tmp / f"{s}.docs").unlink()
    seconds, nbytes = encoded["seconds"], encoded["bytes"]
    meta = {
        **header,
        "dataset": cfg.name,
        "settings": settings,
        "tokenizer": tok.to_meta()
        if ranks is None
        else {"kind": "bpe", "file": TOKENIZER_FILE, "sha256": tok_sha},
        "dtype": dtype.name,
        "documents": encoded["documents"],
        "empty_documents": encoded["empty"],
        "duplicate_documents": encoded["duplicates"],
        "train_tokens": counts["train"][0] * counts["train"][1],
        "val_tokens": counts["val"][0] * counts["val"][1],
        "train_shards": counts["train"][0],
        "val_shards": counts["val"][0],
        "dropped_tokens": counts["train"][2] + counts["val"][2],
        "prepare_seconds": round(seconds, 3),
        "prepare_mb_per_s": nbytes / max(seconds, 1e-9) / 1e6,
        "source_bytes": nbytes,
    }
    if "file_sha256" in settings["source"]:
        meta["source_sha256"] = settings["source"]["file_sha256"]
    _write_json(tmp / "meta.json", meta)  # last: its presence marks the folder complete
    return meta


def _source_key(cfg: DataConfig) -> str:
    """The setting that says where the text came from, as `key=value`."""
    if cfg.path:
        return f"data.path={cfg.path}"
    return f"data.hf_dataset={cfg.hf_dataset}" if cfg.source == "hf" else f"data.url={cfg.url}"


def _check_has_text(cfg: DataConfig, encoded: Dict[str, Any]) -> None:
    """One line naming the source when no document had any text.

    That is, no document had any text at all, not a split that came out empty.
    """
    if sum(encoded["written"].values()) > 0:
        return
    n, empty = encoded["documents"], encoded["empty"]
    if n == 0:
        why = "no documents" + (
            f" (data.max_documents={cfg.max_documents})" if cfg.max_documents is not None else ""
        )
    else:
        cleaned = f" after data.cleaner={cfg.cleaner}" if cfg.cleaner != "none" else ""
        why = f"{n} document(s), {empty} of them empty{cleaned}" + (
            ", the rest duplicates" if empty < n else ""
        )
    raise GptlabError(f"{_source_key(cfg)}: no text to train on ({why}); give text to train on")


def _encode_documents(
    cfg: DataConfig, source: Source, tok: Any, dtype: np.dtype, splits: Tuple[str, ...], tmp: Path
) -> Dict[str, Any]:
    """Pass 1: every document, in order, into a flat token file and a (start, length) table.

    One file and one table per split.
    """
    # open for the whole pass and closed in its `finally:` below
    flat = {s: open(tmp / f"{s}.flat", "wb") for s in splits}  # noqa: SIM115
    tables = {s: open(tmp / f"{s}.docs", "wb") for s in splits}  # noqa: SIM115
    written = {s: 0 for s in splits}
    seen: set = set()
    index, dropped_dups, empty = 0, 0, 0
    progress = _Progress(cfg.progress, source.total_bytes, source.total_docs, f"prepare {cfg.name}")
    # char encoding is one numpy call
    workers = 0 if isinstance(tok, CharTokenizer) else cfg.workers
    init = (tok.to_meta(), cfg.cleaner, cfg.dedup, _separator(cfg, tok), dtype.name)
    docs = limited(source.documents(), cfg.max_documents)
    try:
        for tokens, lengths, hashes, nbytes in _encoded(docs, workers, init):
            offset = 0
            for j, n in enumerate(lengths.tolist()):
                i, index = index, index + 1
                if n == 0:
                    empty += 1
                    continue
                piece = tokens[offset : offset + n]
                offset += n
                if cfg.dedup:
                    if hashes[j] in seen:
                        dropped_dups += 1
                        continue
                    seen.add(hashes[j])
                s = (
                    splits[0]
                    if len(splits) == 1
                    else ("val" if is_val_document(cfg.seed, i, cfg.val_fraction) else "train")
                )
                flat[s].write(piece.tobytes())
                tables[s].write(np.array([written[s], n], dtype=np.int64).tobytes())
                written[s] += n
            progress.update(len(lengths), nbytes)
    finally:
        for f in (*flat.values(), *tables.values()):
            f.close()
    seconds = progress.close()
    return {
        "written": written,
        "documents": index,
        "empty": empty,
        "duplicates": dropped_dups,
        "seconds": seconds,
        "bytes": progress.bytes,
    }


def _shard_splits(
    cfg: DataConfig, dtype: np.dtype, header: Dict[str, Any], written: Dict[str, int], tmp: Path
) -> Dict[str, Tuple[int, int, int]]:
    """Pass 2: per split, its documents in (shuffled) order into equal shards.

    Returns (shards, tokens each, dropped).
    """
    counts: Dict[str, Tuple[int, int, int]] = {}
    if cfg.split == "tail":
        n = written["all"]
        n_val = int(round(n * cfg.val_fraction))
        if n_val == 0 or n_val == n:
            raise GptlabError(
                f"data.val_fraction={cfg.val_fraction}: the {'val' if n_val == 0 else 'train'} "
                f"split of "
                f"{n} tokens ({_source_key(cfg)}) got none; use more text or change "
                f"data.val_fraction"
            )
        ranges = {"train": (0, n - n_val), "val": (n - n_val, n)}
        with open(tmp / "all.flat", "rb") as data:
            for split, (a, b) in ranges.items():
                pieces = (_pread(data, dtype, k, min(1 << 24, b - k)) for k in range(a, b, 1 << 24))
                counts[split] = _write_split(tmp / split, cfg, dtype, header, b - a, pieces)
        return counts
    for split in ("train", "val"):
        table = np.fromfile(tmp / f"{split}.docs", dtype=np.int64).reshape(-1, 2)
        order = np.arange(len(table))
        if cfg.shuffle:
            order = np.random.default_rng([cfg.seed, 7]).permutation(len(table))
        with open(tmp / f"{split}.flat", "rb") as data:
            counts[split] = _write_split(
                tmp / split, cfg, dtype, header, written[split], _gather(data, dtype, table, order)
            )
    return counts


# Reads, not a memory map: mapped pages of a 20 GB flat file would count as this process's memory.
def _pread(f, dtype: np.dtype, start: int, count: int) -> np.ndarray:
    data = os.pread(f.fileno(), count * dtype.itemsize, start * dtype.itemsize)
    return np.frombuffer(data, dtype=dtype)


def _gather(
    f, dtype: np.dtype, table: np.ndarray, order: np.ndarray, chunk: int = 1 << 22
) -> Iterator[np.ndarray]:
    """The documents of `table` in `order`, at most ~`chunk` tokens at a time.

    `table` has (start, length) rows.
    """
    parts: List[np.ndarray] = []
    size = 0
    for k in range(0, len(order), 4096):
        for start, n in table[order[k : k + 4096]].tolist():
            for a in range(start, start + n, chunk):  # a huge document is read in pieces too
                parts.append(_pread(f, dtype, a, min(chunk, start + n - a)))
                size += len(parts[-1])
                if size >= chunk:
                    yield np.concatenate(parts)
                    parts, size = [], 0
    if parts:
        yield np.concatenate(parts)


def _write_split(
    folder: Path,
    cfg: DataConfig,
    dtype: np.dtype,
    header: Dict[str, Any],
    n_tokens: int,
    pieces: Iterator[np.ndarray],
) -> Tuple[int, int, int]:
    n, per = shard_plan(n_tokens, cfg.shard_divisor, cfg.shard_tokens)
    if n_tokens == 0:
        raise GptlabError(
            f"data.val_fraction={cfg.val_fraction}: the {folder.name} split got no documents; "
            f"use more documents or change data.val_fraction"
        )
    if per == 0:
        raise GptlabError(
            f"data.shard_divisor={cfg.shard_divisor}: the {folder.name} split has only {n_tokens} "
            f"tokens, too few "
            f"for {n} shards; use more text, a larger data.val_fraction or a smaller "
            f"data.shard_divisor"
        )
    w = ShardWriter(folder, n, per, dtype, {**header, "split": folder.name})
    for p in pieces:
        w.write(p)
    w.finish()
    return n, per, w.dropped
