import json

import numpy as np
import pytest
from conftest import data_config

from gptlab.data import CharTokenizer, RandomWindowLoader, prepare_data
from gptlab.errors import GptlabError


def test_char_tokenizer_round_trip(shakespeare):
    text = shakespeare.read_text()
    tok = CharTokenizer.fit(text)
    assert tok.vocab_size == 65
    sample = text[:5000]
    ids = tok.encode_array(sample)
    assert ids.tolist() == tok.encode(sample)
    assert tok.decode(ids.tolist()) == sample
    with pytest.raises(GptlabError, match="not in"):
        tok.encode("€")


def test_prepare_writes_uint16_files_and_is_idempotent(shakespeare, tmp_path):
    cfg = data_config(path=str(shakespeare), cache_dir=str(tmp_path), shard_divisor=1, progress=False)
    logs = []
    data = prepare_data(cfg, log=logs.append)
    assert len(logs) == 1
    meta = json.loads((data.root / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 65
    assert meta["source_sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    train, val = data.tokens("train"), data.tokens("val")
    assert train.dtype == np.uint16 and isinstance(train, np.memmap)
    assert len(train) + len(val) == 1_115_394
    assert abs(len(val) / 1_115_394 - 0.1) < 1e-5
    assert data.tokenizer.decode(train[:12].tolist()) == "First Citize"
    mtime = (data.root / "train" / "shard_00000.bin").stat().st_mtime_ns
    again = prepare_data(cfg, log=logs.append)  # second call: nothing rebuilt, nothing logged
    assert again.root == data.root and len(logs) == 1
    assert (data.root / "train" / "shard_00000.bin").stat().st_mtime_ns == mtime


def test_prepare_leaves_no_half_written_folder(shakespeare, tmp_path):
    data = prepare_data(data_config(path=str(shakespeare), cache_dir=str(tmp_path)), log=lambda *_: None)
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


def _loader(tokens, **kw):
    args = dict(block_size=8, batch_size=8, micro_batch_size=2, rank=0, world_size=1, seed=3)
    args.update(kw)
    return RandomWindowLoader(tokens, **args)


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = _loader(tokens), _loader(tokens)
    for _ in range(3):
        for (xa, ya), (xb, yb) in zip(a.next_step(), b.next_step()):
            assert xa.equal(xb) and ya.equal(yb)
            assert (ya[:, :-1] == xa[:, 1:]).all()  # targets are inputs shifted by one
    c = _loader(tokens, seed=4)
    assert not c.next_step()[0][0].equal(_loader(tokens).next_step()[0][0])


def test_resume_position_continues_the_sequence():
    tokens = np.arange(1000, dtype=np.uint16)
    a = _loader(tokens)
    for _ in range(5):
        a.next_step()
    b = _loader(tokens)
    b.load_state_dict(a.state_dict())
    assert all(x.equal(y) for (x, _), (y, _) in zip(a.next_step(), b.next_step()))


def test_ranks_and_micro_steps_split_one_global_batch():
    tokens = np.arange(1000, dtype=np.uint16)
    one = torch_cat(_loader(tokens, micro_batch_size=2).next_step())  # 1 rank x 4 micro-steps
    two = torch_cat(
        _loader(tokens, micro_batch_size=2, world_size=2, rank=0).next_step()
        + _loader(tokens, micro_batch_size=2, world_size=2, rank=1).next_step()
    )
    assert one.equal(two)


def torch_cat(batches):
    import torch

    return torch.cat([x for x, _ in batches])
