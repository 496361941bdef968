"""Where text comes from: a local file, or a public URL downloaded once into the cache."""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from gptlab.errors import GptlabError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root(cache_dir: Optional[str]) -> Path:
    """The folder for downloads and prepared tokens: data.cache_dir, $GPTLAB_CACHE_DIR, ~/.cache/gptlab."""
    root = cache_dir or os.environ.get("GPTLAB_CACHE_DIR") or "~/.cache/gptlab"
    return Path(root).expanduser().resolve()


def local_text_file(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise GptlabError(f"data.path={path}: no such file")
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
        raise GptlabError(f"{url} has SHA-256 {got}, expected {sha256}; pass a good copy with data.path=")
    os.replace(tmp, dest)
    return dest


def fetch_text_file(
    path: Optional[str], url: str, sha256: Optional[str], cache: Path, filename: str
) -> Path:
    """The local file to read: data.path when given, else the cached download of url."""
    if path:
        return local_text_file(path)
    return download(url, cache / "downloads" / filename, sha256)
