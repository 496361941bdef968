"""gptlab.data's preparation (prepare, sources, shards): documents -> equal token shards with
sidecars; idempotent, crash-safe, offline-readable. The command itself: test_prepare.py."""

import collections
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, data_config

from gptlab.data import DataConfig, prepare_data
from gptlab.data.shards import FORMAT_VERSION, TokenShards
from gptlab.data.sources import clean_gutenberg
from gptlab.errors import GptlabError

EXTRA = [
    "emoji 👋🏽 and CJK 世界\r\n",
    "tabs\tand\x00control\x1b chars",
    "combining e\u0301\n\n\n\nend",
]


def write_corpus(folder: Path, shakespeare: Path, n_docs: int = 120) -> list:
    """n_docs text files: Shakespeare's speeches grouped, a few hostile ones mixed in."""
    speeches = shakespeare.read_text().split("\n\n")
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(n_docs):
        doc = "\n\n".join(speeches[i * 10 : i * 10 + 10]) + EXTRA[i % 3]
        (folder / f"doc{i:04d}.txt").write_text(doc, encoding="utf-8", newline="")
        docs.append(doc)
    return docs


def bpe_cfg(path, cache, **kw) -> DataConfig:
    args = dict(
        name="corpus",
        source="text_files",
        path=str(path),
        cache_dir=str(cache),
        tokenizer=dict(kind="bpe", vocab_size=512),
        split="documents",
        val_fraction=0.1,
        separator="eos",
        shard_divisor=8,
        workers=0,
        progress=False,
    )
    args.update(kw)
    return data_config(**args)


def split_docs(data, split):
    tok = data.tokenizer
    text = tok.decode(np.asarray(data.shards(split)[0 : len(data.shards(split))]).tolist())
    return text.split("<|eos|>")


@pytest.mark.integration
def test_shards_hold_every_document_exactly_once(tmp_path, shakespeare):
    docs = write_corpus(tmp_path / "corpus", shakespeare)
    data = prepare_data(
        bpe_cfg(tmp_path / "corpus", tmp_path / "cache", shard_divisor=1, workers=2),
        log=lambda *_: None,
    )
    train, val = split_docs(data, "train"), split_docs(data, "val")
    assert train[-1] == "" and val[-1] == ""  # every document ends with <|eos|>
    # exact round trip
    assert collections.Counter(train[:-1] + val[:-1]) == collections.Counter(docs)
    assert 0 < len(val) - 1 < 30 and data.meta["dropped_tokens"] == 0
    assert train[:-1] != [d for d in docs if d in set(train)]  # the documents were shuffled


@pytest.mark.integration
def test_shards_are_equal_with_sidecars_and_a_multiple_of_the_divisor(tmp_path, shakespeare):
    write_corpus(tmp_path / "corpus", shakespeare)
    data = prepare_data(
        bpe_cfg(tmp_path / "corpus", tmp_path / "cache", shard_tokens=4000), log=lambda *_: None
    )
    m = data.meta
    assert (
        m["dtype"] == "uint16" and m["vocab_size"] == 512 and m["format_version"] == FORMAT_VERSION
    )
    # 4000-token cap: more than one group
    assert m["train_shards"] % 8 == 0 and m["train_shards"] >= 16
    bins = sorted((data.root / "train").glob("shard_*.bin"))
    assert len(bins) == m["train_shards"] and not list(data.root.rglob("*.partial"))
    sizes = {p.stat().st_size for p in bins}
    assert len(sizes) == 1  # balanced: every shard the same number of tokens
    per = sizes.pop() // 2
    assert m["train_tokens"] == per * len(bins) and per <= 4000
    side = json.loads(bins[0].with_suffix(".json").read_text())
    assert side == {
        **side,
        "dtype": "uint16",
        "vocab_size": 512,
        "tokens": per,
        "format_version": FORMAT_VERSION,
        "tokenizer_sha256": m["tokenizer_sha256"],
        "split": "train",
        "index": 0,
    }
    assert side["sha256"] == hashlib.sha256(bins[0].read_bytes()).hexdigest()
    assert (
        m["tokenizer_sha256"]
        == hashlib.sha256((data.root / "tokenizer.tiktoken").read_bytes()).hexdigest()
    )
    tokens = data.tokens("train")
    assert isinstance(tokens, TokenShards) and len(tokens) == m["train_tokens"]
    flat = np.concatenate([np.fromfile(p, dtype=np.uint16) for p in bins])
    # a slice across shards
    assert np.array_equal(tokens[per - 5 : per + 5], flat[per - 5 : per + 5])
    assert int(flat.max()) < 512


@pytest.mark.integration
def test_prepare_is_idempotent_and_keyed_by_settings(tmp_path, shakespeare):
    write_corpus(tmp_path / "corpus", shakespeare, n_docs=40)
    logs = []
    cfg = bpe_cfg(tmp_path / "corpus", tmp_path / "cache")
    a = prepare_data(cfg, log=logs.append)
    n_logs = len(logs)
    stamp = {p: p.stat().st_mtime_ns for p in a.root.rglob("*")}
    b = prepare_data(cfg, log=logs.append)
    assert b.root == a.root and len(logs) == n_logs  # nothing rebuilt, nothing logged
    assert {p: p.stat().st_mtime_ns for p in a.root.rglob("*")} == stamp
    c = prepare_data(
        bpe_cfg(tmp_path / "corpus", tmp_path / "cache", separator="bos"), log=logs.append
    )
    assert c.root != a.root  # a different split setting is a different folder
    assert np.asarray(c.shards("train")[0:1])[0] == c.tokenizer.bos_id


def test_vocabulary_above_65536_switches_to_uint32(tmp_path):
    # astral code points: all valid UTF-8
    chars = "".join(map(chr, range(0x10000, 0x10000 + 70_000)))
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "a.txt").write_text(chars + chars[::-1])
    cfg = data_config(
        name="wide",
        source="text_files",
        path=str(tmp_path / "wide"),
        cache_dir=str(tmp_path),
        shard_divisor=1,
        progress=False,
    )
    data = prepare_data(cfg, log=lambda *_: None)
    assert data.vocab_size == 70_000 and data.meta["dtype"] == "uint32"
    train = data.tokens("train")
    assert train.dtype == np.uint32 and int(np.max(train)) == 69_999
    assert data.tokenizer.decode(train[:5].tolist()) == chars[:5]
    side = json.loads(next((data.root / "train").glob("*.json")).read_text())
    assert side["dtype"] == "uint32" and (
        data.root / "train" / "shard_00000.bin"
    ).stat().st_size == 4 * len(train)


def test_shards_from_another_tokenizer_or_version_are_refused(tmp_path, shakespeare):
    write_corpus(tmp_path / "corpus", shakespeare, n_docs=40)
    cfg = bpe_cfg(tmp_path / "corpus", tmp_path / "cache")
    data = prepare_data(cfg, log=lambda *_: None)
    side = data.root / "val" / "shard_00003.json"
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "tokenizer_sha256": "f" * 64}))
    with pytest.raises(GptlabError, match="tokenizer_sha256.*delete"):
        data.tokens("val")
    side.write_text(json.dumps(meta))
    (data.root / "meta.json").write_text(json.dumps({**data.meta, "format_version": 1}))
    with pytest.raises(GptlabError, match="format 1.*delete"):
        prepare_data(cfg)


BOOK = """\ufeffThe Project Gutenberg EBook of A Test Book, by Some Author\r
\r
This eBook is for the use of anyone anywhere at no cost and with\r
almost no restrictions whatsoever.\r
\r
Title: A Test Book\r
\r
*** START OF THIS PROJECT GUTENBERG EBOOK A TEST BOOK ***\r
\r
\r
\r
Produced by Jane Doe and the Online Distributed\r
Proofreading Team at http://www.pgdp.net\r
\r
\r
CHAPTER I   \r
\r
\r
\r
\r
It was a dark and stormy night.\t\r
The end came soon.\r
\r
\r
\r
*** END OF THIS PROJECT GUTENBERG EBOOK A TEST BOOK ***\r
\r
***** This file should be named 12345.txt or 12345.zip *****\r
Updated editions will replace the previous one.\r
"""


def test_gutenberg_cleaner_strips_boilerplate_and_normalises_whitespace():
    assert (
        clean_gutenberg(BOOK) == "CHAPTER I\n\nIt was a dark and stormy night.\nThe end came soon."
    )
    legacy = BOOK.replace(
        "*** END OF THIS PROJECT GUTENBERG EBOOK A TEST BOOK ***",
        "End of the Project Gutenberg EBook of A Test Book, by Some Author",
    )
    assert clean_gutenberg(legacy) == clean_gutenberg(BOOK)
    assert clean_gutenberg("no markers\n\n\n\nat all  ") == "no markers\n\nat all"


def write_parquet(path: Path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table({"id": [str(i) for i in range(len(texts))], "text": texts}), path, row_group_size=7
    )


def gutenberg_books(shakespeare, n=30):
    speeches = shakespeare.read_text().split("\n\n")
    return [
        BOOK.replace("It was a dark and stormy night.", "\n\n".join(speeches[i * 8 : i * 8 + 8]))
        for i in range(n)
    ]


@pytest.mark.integration
def test_gutenberg_from_a_local_parquet_copy(tmp_path, shakespeare):
    from helpers import compose_config

    from gptlab.config import to_config

    books = gutenberg_books(shakespeare)
    write_parquet(tmp_path / "pg" / "en" / "part-0.parquet", books[:20])
    # one duplicate
    write_parquet(tmp_path / "pg" / "en" / "part-1.parquet", books[20:] + [books[3]])
    cfg = to_config(
        compose_config(
            [
                "data=gutenberg",
                f"data.path={tmp_path / 'pg'}",
                "data.tokenizer.vocab_size=512",
                "data.val_fraction=0.2",
                "data.shard_divisor=2",
                "data.workers=0",
                f"data.cache_dir={tmp_path / 'cache'}",
                "data.progress=false",
            ]
        )
    ).data
    data = prepare_data(cfg, log=lambda *_: None)
    m = data.meta
    assert m["documents"] == 31 and m["duplicate_documents"] == 1
    assert m["settings"]["source"]["kind"] == "hf_parquet"
    text = "".join(split_docs(data, "train") + split_docs(data, "val"))
    assert (
        "CHAPTER I" in text
        and "Gutenberg" not in text
        and "Produced by" not in text
        and "\r" not in text
    )


@pytest.mark.integration
def test_hf_save_to_disk_copy_and_offline_hub_error(tmp_path, monkeypatch, shakespeare):
    import datasets

    books = gutenberg_books(shakespeare, 12)
    datasets.DatasetDict({"en": datasets.Dataset.from_dict({"text": books})}).save_to_disk(
        str(tmp_path / "saved")
    )
    cfg = bpe_cfg(
        tmp_path / "saved",
        tmp_path / "cache",
        source="hf",
        hf_split="en",
        cleaner="gutenberg",
        val_fraction=0.3,
        shard_divisor=1,
    )
    data = prepare_data(cfg, log=lambda *_: None)
    assert data.meta["documents"] == 12 and data.meta["settings"]["source"]["kind"] == "hf_saved"
    with pytest.raises(GptlabError, match="data.hf_split=train"):
        prepare_data(bpe_cfg(tmp_path / "saved", tmp_path / "cache", source="hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        GptlabError, match="data.hf_dataset=HuggingFaceFW/fineweb-edu.*data.path="
    ) as e:
        prepare_data(
            data_config(
                source="hf",
                hf_dataset="HuggingFaceFW/fineweb-edu",
                hf_config="sample-10BT",
                cache_dir=str(tmp_path / "cache"),
            )
        )
    assert "\n" not in str(e.value)


def snapshot(root: Path) -> dict:
    """Every shard, sidecar and tokenizer byte (meta.json minus its timings)."""
    out = {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "meta.json"
    }
    meta = json.loads((root / "meta.json").read_text())
    out["meta"] = {k: v for k, v in meta.items() if not k.startswith("prepare_")}
    return out


@pytest.mark.slow
def test_killed_prepare_leaves_nothing_complete_and_rerun_is_byte_identical(tmp_path, shakespeare):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, shakespeare, n_docs=60)
    big = (shakespeare.read_text() + "".join(EXTRA)) * 12  # ~13 MB of documents: seconds to encode
    for i in range(1, 2):
        (corpus / f"big{i}.txt").write_text(big)
    cache = tmp_path / "killed"
    args = [
        "-m",
        "gptlab.prepare",
        "data=text_files",
        f"data.path={corpus}",
        "data.tokenizer.vocab_size=512",
        "data.tokenizer.train_bytes=300000",
        "data.val_fraction=0.1",
        "data.workers=2",
        "data.progress=false",
        f"data.cache_dir={cache}",
        "hydra.run.dir=" + str(tmp_path / "hydra"),
    ]
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once encoding has written tokens, well before the end
        flat = (
            list((cache / "tokens").glob("*.tmp*/train.flat"))
            if (cache / "tokens").is_dir()
            else []
        )
        if flat and flat[0].stat().st_size > 0:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [p for p in (cache / "tokens").iterdir() if ".tmp" not in p.name]
    assert done == []  # nothing that looks complete
    assert not list((cache / "tokens").rglob("shard_*.bin"))
    cfg = data_config(
        name="text_files",
        source="text_files",
        path=str(corpus),
        cache_dir=str(cache),
        tokenizer=dict(kind="bpe", vocab_size=512, train_bytes=300000),
        split="documents",
        val_fraction=0.1,
        separator="eos",
        workers=2,
        progress=False,
        sampling="sequential",
    )
    rerun = prepare_data(cfg, log=lambda *_: None)
    # the dead run's tmp swept
    assert [p.name for p in rerun.root.parent.iterdir()] == [rerun.root.name]
    clean = prepare_data(
        DataConfig(**{**cfg.__dict__, "cache_dir": str(tmp_path / "clean"), "workers": 0}),
        log=lambda *_: None,
    )
    assert snapshot(rerun.root) == snapshot(clean.root)  # and 2 workers or none: the same bytes


@pytest.mark.integration
def test_prepare_writes_uint16_files_and_is_idempotent(shakespeare, tmp_path):
    cfg = data_config(
        path=str(shakespeare), cache_dir=str(tmp_path), shard_divisor=1, progress=False
    )
    logs = []
    data = prepare_data(cfg, log=logs.append)
    assert len(logs) == 1
    meta = json.loads((data.root / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 65
    assert (
        meta["source_sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    )
    train, val = data.tokens("train"), data.tokens("val")
    assert train.dtype == np.uint16 and isinstance(train, np.memmap)
    assert len(train) + len(val) == 1_115_394
    assert abs(len(val) / 1_115_394 - 0.1) < 1e-5
    assert data.tokenizer.decode(train[:12].tolist()) == "First Citize"
    mtime = (data.root / "train" / "shard_00000.bin").stat().st_mtime_ns
    again = prepare_data(cfg, log=logs.append)  # second call: nothing rebuilt, nothing logged
    assert again.root == data.root and len(logs) == 1
    assert (data.root / "train" / "shard_00000.bin").stat().st_mtime_ns == mtime


@pytest.mark.integration
def test_prepare_leaves_no_half_written_folder(shakespeare, tmp_path):
    data = prepare_data(
        data_config(path=str(shakespeare), cache_dir=str(tmp_path)), log=lambda *_: None
    )
    names = [p.name for p in data.root.parent.iterdir()]
    assert names == [data.root.name]  # the temporary folder was renamed into place


def test_missing_local_file_is_one_clear_error(tmp_path):
    with pytest.raises(GptlabError, match="data.path=.*no such file"):
        prepare_data(data_config(path=str(tmp_path / "nope.txt"), cache_dir=str(tmp_path)))


def test_offline_download_says_how_to_pass_a_local_copy(tmp_path):
    cfg = data_config(url="http://127.0.0.1:9/tinyshakespeare.txt", cache_dir=str(tmp_path))
    with pytest.raises(GptlabError, match=r"data.path=/path/to/tinyshakespeare.txt"):
        prepare_data(cfg)
    assert not list((tmp_path / "downloads").glob("*"))  # no partial download left behind


@pytest.mark.integration
def test_download_checks_sha256(tmp_path, shakespeare):
    # a local HTTP server stands in for the public URL
    import http.server
    import threading
    from functools import partial

    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(shakespeare.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{shakespeare.name}"
        ok = prepare_data(data_config(url=url, cache_dir=str(tmp_path / "a")), log=lambda *_: None)
        assert ok.vocab_size == 65
        with pytest.raises(GptlabError, match="SHA-256"):
            prepare_data(data_config(url=url, sha256="0" * 64, cache_dir=str(tmp_path / "b")))
    finally:
        server.shutdown()


@pytest.mark.integration
def test_a_verified_data_path_is_remembered_for_later_commands_offline(tmp_path, shakespeare):
    """data.path=<a good copy> once: later runs without data.path find it in the cache, offline;
    a file that is not the download (another SHA-256) is not taken for it."""
    from gptlab.data.sources import shakespeare_file

    offline = "http://127.0.0.1:9/tinyshakespeare.txt"
    cfg = data_config(path=str(shakespeare), url=offline, cache_dir=str(tmp_path))
    assert shakespeare_file(cfg) == shakespeare.resolve()
    cached = tmp_path / "downloads" / "tinyshakespeare.txt"
    assert cached.read_bytes() == shakespeare.read_bytes()
    assert shakespeare_file(data_config(path=None, url=offline, cache_dir=str(tmp_path))) == cached
    other = tmp_path / "other.txt"
    other.write_text("not the download\n")
    elsewhere = tmp_path / "elsewhere"
    shakespeare_file(data_config(path=str(other), url=offline, cache_dir=str(elsewhere)))
    assert not (elsewhere / "downloads").exists()
