"""Where text comes from. Every source ends as a re-iterable stream of documents (strings).

- ``shakespeare``: one file, downloaded once (or ``data.path``); the whole text is one document.
- ``text_files``: a local file, a folder (every ``*.txt`` below it) or a glob; one document per
file.
- ``hf``: a Hugging Face dataset's text column: streamed from the Hub, or read from a local copy in
  the same format (parquet files, or a ``save_to_disk`` folder) given as ``data.path``.

Cleaning (``data.cleaner``) is a pure function of one document, applied by the tokenizer workers.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import os
import re
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from gptlab.errors import GptlabError, as_user_error


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root(cache_dir: Optional[str]) -> Path:
    """The folder for downloads and prepared tokens.

    data.cache_dir, else $GPTLAB_CACHE_DIR, else ~/.cache/gptlab.
    """
    root = cache_dir or os.environ.get("GPTLAB_CACHE_DIR") or "~/.cache/gptlab"
    return Path(root).expanduser().resolve()


SHAKESPEARE_FILE = "tinyshakespeare.txt"  # the download's name in <cache>/downloads/


def local_text_file(path: str, name: str = "shakespeare_char") -> Path:
    """data.path for a source that reads one text file: an existing, non-empty file."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise GptlabError(
            f"data.path={path} is a folder, but data={name} reads one text file: give the file "
            f"(data.path=/path/to/{SHAKESPEARE_FILE}), or use data=text_files for a folder of "
            f".txt files"
        )
    if not p.is_file():
        raise GptlabError(f"data.path={path}: no such file; give the path of a text file")
    if p.stat().st_size == 0:
        raise GptlabError(f"data.path={path}: the file is empty; give a file with text")
    return p.resolve()


def download(url: str, dest: Path, sha256: Optional[str], timeout: float = 30.0) -> Path:
    """Download url to dest once (atomically), checking its SHA-256 when one is given."""
    if dest.is_file() and (sha256 is None or sha256_file(dest) == sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".part{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp, open(tmp, "wb") as f:
            while chunk := resp.read(1 << 20):
                f.write(chunk)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", e)
        raise GptlabError(
            f"could not download {url} ({reason}); offline? pass a local copy with "
            f"data.path=/path/to/{dest.name}"
        ) from None
    if sha256 is not None and (got := sha256_file(tmp)) != sha256:
        tmp.unlink(missing_ok=True)
        raise GptlabError(
            f"{url} has SHA-256 {got}, expected {sha256}; pass a good copy with data.path="
        )
    os.replace(tmp, dest)
    return dest


def remember(given: Path, dest: Path, sha256: str) -> None:
    """Copy a local copy of a download into the cache (atomically), when it is the verified file.

    Only when the cache has none; a cache that cannot be written is left as it is.
    """
    if dest.is_file() or given.stat().st_size > (1 << 30) or sha256_file(given) != sha256:
        return
    tmp = dest.with_name(dest.name + f".part{os.getpid()}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(given, tmp)
        os.replace(tmp, dest)
    except OSError:
        tmp.unlink(missing_ok=True)


def fetch_text_file(
    path: Optional[str],
    url: str,
    sha256: Optional[str],
    cache: Path,
    filename: str,
    name: str = "shakespeare_char",
) -> Path:
    """The local file to read: data.path when given, else the cached download of url.

    A data.path whose SHA-256 is the download's (data.sha256) is that file: it is copied into the
    cache once, so later commands find it without data.path, offline."""
    if path:
        given = local_text_file(path, name)
        if sha256 is not None:
            remember(given, cache / "downloads" / filename, sha256)
        return given
    f = download(url, cache / "downloads" / filename, sha256)
    if f.stat().st_size == 0:
        raise GptlabError(
            f"data.url={url}: the downloaded file {f} is empty; pass a good copy with data.path="
        )
    return f


def shakespeare_file(cfg, cache: Optional[Path] = None) -> Path:
    """The text file of source=shakespeare, verified: data.path when given, else data.url fetched.

    data.url is downloaded once into <cache>/downloads/ (default: the data cache, see cache_root)
    and checked against data.sha256.

    What `python -m gptlab.train` reads by default; the tests find Tiny Shakespeare the same way.
    """
    cache = cache if cache is not None else cache_root(cfg.cache_dir)
    return fetch_text_file(cfg.path, cfg.url, cfg.sha256, cache, SHAKESPEARE_FILE, cfg.name)


# --- document streams ---------------------------------------------------------------------------


@dataclass
class Source:
    """A stream of raw documents plus what identifies it (for the prepared folder's key)."""

    fingerprint: Dict[str, Any]
    documents: Callable[[], Iterator[str]]  # a fresh iterator per call
    total_bytes: Optional[int] = None  # for the progress bar's ETA, when cheap to know
    total_docs: Optional[int] = None


def _stat_fingerprint(files: List[Path]) -> str:
    # Hashing every byte of a 40 GB corpus on each start would cost minutes; name, size and mtime
    # identify a local file set well enough (a single file is hashed in full: see open_source).
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _expand(path: str, pattern: str, key: str = "data.path") -> List[Path]:
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(q for q in p.rglob(pattern) if q.is_file())
    else:
        files = sorted(Path(q) for q in globlib.glob(str(p), recursive=True) if Path(q).is_file())
    if not files:
        if p.is_dir():
            raise GptlabError(
                f"{key}={path}: the folder has no {pattern} files (searched below it too)"
            )
        if any(c in str(p) for c in "*?["):
            raise GptlabError(f"{key}={path}: the glob matches no files")
        raise GptlabError(f"{key}={path}: no such file or folder")
    return [f.resolve() for f in files]


def _read_text(path: Path) -> str:
    try:
        # not read_text: its universal newlines would eat \r\n
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise GptlabError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert or remove it"
        ) from None


def _fingerprint_files(files: List[Path]) -> Dict[str, Any]:
    if len(files) == 1:
        return {"file_sha256": sha256_file(files[0])}
    return {"files": len(files), "stat_sha256": _stat_fingerprint(files)}


def text_files_source(path: Optional[str]) -> Source:
    if not path:
        raise GptlabError(
            "data.path: text_files needs a file, folder or glob of UTF-8 text (data.path=...)"
        )
    files = _expand(path, "*.txt")
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        what = "the file is empty" if len(files) == 1 else f"all {len(files)} files are empty"
        raise GptlabError(f"data.path={path}: {what}; give UTF-8 text to train on")
    return Source(
        fingerprint={"kind": "text_files", **_fingerprint_files(files)},
        documents=lambda: (_read_text(f) for f in files),
        total_bytes=total,
        total_docs=len(files),
    )


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file())


def _parquet_file(f: Path):
    """pyarrow's ParquetFile for f, or one line naming it when it is not a parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise GptlabError(
            f"data.path: {f} is not a parquet file ({str(e).splitlines()[0][:120]}); give parquet "
            f"files "
            f"or a datasets save_to_disk folder"
        ) from None


def _parquet_docs(files: List[Path], column: str) -> Iterator[str]:
    for f in files:
        pf = _parquet_file(f)
        if column not in pf.schema_arrow.names:
            raise GptlabError(
                f"data.text_column={column}: {f} has no such column (columns: "
                f"{', '.join(pf.schema_arrow.names)})"
            )
        # Row-group batches keep memory bounded whatever the file size.
        for batch in pf.iter_batches(batch_size=1024, columns=[column]):
            yield from (t for t in batch.column(0).to_pylist() if t is not None)


def _saved_docs(path: Path, split: str, column: str) -> Iterator[str]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise GptlabError(f"data.hf_split={split}: {path} has splits {', '.join(ds)}")
        ds = ds[split]
    if column not in ds.column_names:
        raise GptlabError(
            f"data.text_column={column}: {path} has columns {', '.join(ds.column_names)}"
        )
    for batch in ds.select_columns([column]).iter(batch_size=1024):
        yield from (t for t in batch[column] if t is not None)


_LOCAL_COPY = "pass a local copy (parquet files or a save_to_disk folder) with data.path="
HUB_CHECK_S = 5.0  # one quick request to the Hub before datasets, which retries each call for ~30 s


def _quiet_hub() -> None:
    """Keep Hugging Face's retry warnings and progress bars off the console.

    gptlab reports the outcome.
    """
    import datasets
    import huggingface_hub

    huggingface_hub.utils.logging.set_verbosity_error()
    huggingface_hub.utils.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def _check_hub(dataset: str) -> None:
    """One line at once when the Hub cannot be reached (offline, no DNS, a proxy refusing)."""
    import huggingface_hub
    from huggingface_hub import constants

    def unreachable(e: BaseException) -> str:  # requests' or httpx's errors, whichever is installed
        reason = str(e).splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return (
            f"data.hf_dataset={dataset}: the Hugging Face Hub ({constants.ENDPOINT}) cannot be "
            f"reached ({reason}); offline? {_LOCAL_COPY}"
        )

    with as_user_error(unreachable):
        huggingface_hub.get_session().head(constants.ENDPOINT, timeout=HUB_CHECK_S)


def _hub_docs(cfg) -> Iterator[str]:
    # Checked here, when documents are first needed, so that shards prepared earlier open offline.
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise GptlabError(
            f"data.hf_dataset={cfg.hf_dataset}: HF_HUB_OFFLINE is set and data.path is empty; "
            f"{_LOCAL_COPY}"
        )
    import datasets

    _quiet_hub()
    _check_hub(cfg.hf_dataset)
    # the Hub is unreachable, the name is wrong, or the stream broke
    with as_user_error(
        lambda e: (
            f"data.hf_dataset={cfg.hf_dataset}: could not stream it from the Hugging Face "
            f"Hub ({type(e).__name__}: {str(e).splitlines()[0][:160]}); offline? {_LOCAL_COPY}"
        )
    ):
        ds = datasets.load_dataset(
            cfg.hf_dataset, name=cfg.hf_config, split=cfg.hf_split, streaming=True
        )
        for row in ds:
            text = row.get(cfg.text_column)
            if text is None and cfg.text_column not in row:
                raise GptlabError(
                    f"data.text_column={cfg.text_column}: {cfg.hf_dataset} rows have "
                    f"{', '.join(row)}"
                )
            if text is not None:
                yield text


def hf_source(cfg) -> Source:
    if cfg.path:
        p = Path(cfg.path).expanduser()
        if _is_saved_dataset(p):
            p = p.resolve()
            files = sorted(q for q in p.rglob("*") if q.is_file())
            return Source(
                {
                    "kind": "hf_saved",
                    "split": cfg.hf_split,
                    "column": cfg.text_column,
                    "stat_sha256": _stat_fingerprint(files),
                },
                lambda: _saved_docs(p, cfg.hf_split, cfg.text_column),
            )
        files = _expand(cfg.path, "*.parquet")
        rows = sum(_parquet_file(f).metadata.num_rows for f in files)
        return Source(
            {"kind": "hf_parquet", "column": cfg.text_column, **_fingerprint_files(files)},
            lambda: _parquet_docs(files, cfg.text_column),
            total_docs=rows,
        )
    if not cfg.hf_dataset:
        raise GptlabError(
            "data.hf_dataset: source=hf needs a Hub dataset id or a local copy in data.path"
        )
    return Source(
        {
            "kind": "hf_hub",
            "dataset": cfg.hf_dataset,
            "config": cfg.hf_config,
            "split": cfg.hf_split,
            "column": cfg.text_column,
        },
        lambda: _hub_docs(cfg),
    )


def open_source(cfg, cache: Path) -> Source:
    """The document stream for a DataConfig."""
    if cfg.source == "shakespeare":
        f = shakespeare_file(cfg, cache)
        return Source(
            {"kind": "file", "file_sha256": sha256_file(f)},
            lambda: iter([_read_text(f)]),
            total_bytes=f.stat().st_size,
            total_docs=1,
        )
    if cfg.source == "text_files":
        return text_files_source(cfg.path)
    if cfg.source == "hf":
        return hf_source(cfg)
    raise GptlabError(
        f"data.source={cfg.source}: unknown source (choose from shakespeare, text_files, hf)"
    )


def limited(docs: Iterator[str], max_documents: Optional[int]) -> Iterator[str]:
    if max_documents is None:
        yield from docs
        return
    for i, d in enumerate(docs):
        if i >= max_documents:
            return
        yield d


# --- cleaning ---------------------------------------------------------------------------------

_PG_START = re.compile(
    r"^[ \t]*\*{3}[ \t]*START OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK[^\n]*$"
    r"|^[ \t]*\*END\*THE SMALL PRINT![^\n]*$",
    re.IGNORECASE | re.MULTILINE,
)
_PG_END = re.compile(
    r"^[ \t]*\*{3}[ \t]*END OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK[^\n]*$"
    r"|^[ \t]*End of (?:the )?Project Gutenberg'?s?\b[^\n]*$",
    re.IGNORECASE | re.MULTILINE,
)
# Credits that sit between the start marker and the text proper.
_PG_CREDITS = re.compile(
    r"\A(?:(?:Produced by|E-text prepared by|Transcribed from|This e-?text was produced by)"
    r"[^\n]*(?:\n[^\n]+)*\n*)+",
    re.IGNORECASE,
)


def clean_gutenberg(text: str) -> str:
    """A Project Gutenberg book without its licence header/footer, with normalised whitespace.

    Keeps what lies between the START and END markers (the whole text when a marker is missing),
    drops the producer credits right after the start marker, turns CRLF into LF, strips trailing
    spaces, collapses runs of blank lines into one and trims the ends.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    start = _PG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _PG_END.search(text)
    if end:
        text = text[: end.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")
    text = _PG_CREDITS.sub("", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


CLEANERS: Dict[str, Optional[Callable[[str], str]]] = {"none": None, "gutenberg": clean_gutenberg}


def doc_hash(text: str) -> int:
    """A 64-bit hash of a document, for dropping duplicates."""
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little"
    )


def is_val_document(seed: int, index: int, val_fraction: float) -> bool:
    """Whether document `index` of the stream belongs to the validation split.

    The split is seeded and streaming.
    """
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < val_fraction
