"""User mistakes end as one line, `gptlab.<command>: error: <message>`, exit code 2, no traceback.

Each case is checked where it is decided (in process, fast) and as the user meets it (a subprocess
of the real command, marked slow): unwritable output folders and other OS errors, empty or misplaced
data files, files that are not checkpoints, GPU hardware without GPUs, impossible micro-batches, and
how the tests themselves find Tiny Shakespeare.
"""

from __future__ import annotations

import errno
import hashlib
import http.server
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import compose_config, data_config, find_shakespeare, nano_overrides, run_cli, typed

from gptlab.checkpoint import state as checkpoint
from gptlab.cli import os_error_message, run_entry
from gptlab.config import to_config
from gptlab.data import prepare_data
from gptlab.distributed import world as distributed
from gptlab.errors import GptlabError


def one_line_error(r, *fragments: str, prog: str = "gptlab.train") -> str:
    """The one stderr line of a command that failed as the contract says; it contains every
    fragment."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def train(tmp_path: Path, shakespeare: Path, *extra: str, timeout: float = 120):
    args = ["gptlab.train", *nano_overrides(shakespeare, "train.max_steps=2", *extra)]
    if not any(a.startswith("hydra.run.dir=") for a in extra):
        args.append(f"hydra.run.dir={tmp_path / 'run'}")
    return run_cli(args, cwd=tmp_path, timeout=timeout)


# ---- 1. OS errors: an output folder that cannot be made or written -----------------------------


def _entry(monkeypatch, capsys, error: BaseException, argv=("gptlab.train",)) -> str:
    """run_entry on a main that raises `error`: the one line it printed (and it exited with code
    2)."""
    # run_entry sets it for Hydra; monkeypatch restores it
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setattr(sys, "argv", list(argv))

    def main():
        raise error

    with pytest.raises(SystemExit) as e:
        run_entry(main, "gptlab.train")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("gptlab.train: error: "), err
    return err.strip()


def test_permission_and_disk_errors_are_one_line_naming_the_path(monkeypatch, capsys):
    denied = PermissionError(errno.EACCES, "Permission denied", "/ro/outputs/run")
    line = _entry(monkeypatch, capsys, denied, ("gptlab.train", "hydra.run.dir=/ro/outputs/run"))
    assert "/ro/outputs/run: permission denied (from hydra.run.dir=/ro/outputs/run)" in line
    full = OSError(
        errno.ENOSPC, "No space left on device", "/data/cache/tokens/x/train/shard_00000.bin"
    )
    line = _entry(monkeypatch, capsys, full, ("gptlab.prepare", "data.cache_dir=/data/cache"))
    assert "shard_00000.bin: no space left on the device (from data.cache_dir=/data/cache)" in line
    # a write: no path
    line = _entry(monkeypatch, capsys, OSError(errno.ENOSPC, "No space left on device"))
    assert "No space left on device; free some space" in line
    line = _entry(monkeypatch, capsys, OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x"))
    # says which keys move it
    assert "/mnt/ro/x: read-only file system" in line and "hydra.run.dir=" in line


def test_an_os_error_that_is_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")

    def main():
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    with pytest.raises(ConnectionRefusedError):
        run_entry(main, "gptlab.train")
    assert os_error_message(OSError(errno.EBADF, "Bad file descriptor")) is None


def test_hydra_full_error_brings_the_traceback_back(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")

    def main():
        raise PermissionError(errno.EACCES, "Permission denied", "/ro/run")

    with pytest.raises(PermissionError):
        run_entry(main, "gptlab.train")


@pytest.mark.slow
def test_a_run_folder_under_a_file_is_one_line(tmp_path, shakespeare):
    # mkdir below a regular file fails for root too (NotADirectoryError), unlike chmod
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder\n")
    r = train(tmp_path, shakespeare, f"hydra.run.dir={blocker / 'run'}")
    one_line_error(r, str(blocker / "run"), "not a folder", f"hydra.run.dir={blocker / 'run'}")
    r = train(tmp_path, shakespeare, f"hydra.run.dir={blocker}")
    one_line_error(r, str(blocker), "is a file, where a folder is needed")


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process may not create things in: a chmod 0o500 one, or, as root (whom chmod
    does not stop), one under /sys (sysfs refuses mkdir to everybody)."""
    if os.geteuid() != 0:
        ro = tmp_path / "read_only"
        ro.mkdir(mode=0o500)
        return ro / "run"
    probe = Path("/sys/gptlab-test-probe")
    try:
        probe.mkdir()
    except PermissionError:
        return probe / "run"
    except OSError:
        pass
    else:
        probe.rmdir()
    pytest.skip("running as root and /sys accepts mkdir here: no folder refuses root")


@pytest.mark.slow
def test_a_read_only_run_folder_is_one_line(tmp_path, shakespeare):
    run_dir = _unwritable_folder(tmp_path)
    r = train(tmp_path, shakespeare, f"hydra.run.dir={run_dir}")
    line = one_line_error(r, f"hydra.run.dir={run_dir}", "choose a folder you can write to")
    assert "permission denied" in line or "operation not permitted" in line


@pytest.mark.slow
def test_a_data_cache_under_a_file_is_one_line(tmp_path, shakespeare):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    r = run_cli(
        [
            "gptlab.prepare",
            f"data.path={shakespeare}",
            "data.progress=false",
            f"data.cache_dir={blocker / 'cache'}",
        ],
        cwd=tmp_path,
    )
    one_line_error(
        r,
        str(blocker / "cache"),
        "not a folder",
        f"data.cache_dir={blocker / 'cache'}",
        prog="gptlab.prepare",
    )


# ---- 2. data files: empty, a folder where a file is wanted, not what the source reads ----------


def _prepare(tmp_path: Path, **changes):
    return prepare_data(
        data_config(cache_dir=str(tmp_path / "cache"), progress=False, **changes),
        log=lambda *_: None,
    )


@pytest.mark.integration
def test_an_empty_data_file_is_named(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(GptlabError, match=f"data.path={empty}: the file is empty"):
        _prepare(tmp_path, path=str(empty))
    with pytest.raises(GptlabError, match=f"data.path={empty}: the file is empty"):
        _prepare(tmp_path, source="text_files", path=str(empty))
    folder = tmp_path / "empties"
    folder.mkdir()
    (folder / "a.txt").write_text("")
    (folder / "b.txt").write_text("")
    with pytest.raises(GptlabError, match="all 2 files are empty"):
        _prepare(tmp_path, source="text_files", path=str(folder))


@pytest.mark.integration
def test_a_folder_for_a_one_file_source_says_so(tmp_path, shakespeare):
    with pytest.raises(
        GptlabError, match=f"data.path={tmp_path} is a folder.*data=text_files"
    ) as e:
        _prepare(tmp_path, path=str(tmp_path))
    assert "\n" not in str(e.value)
    # text_files reads folders: one document per .txt file below it
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = shakespeare.read_text()
    for i in range(4):
        (corpus / f"part{i}.txt").write_text(text[i * 100_000 : (i + 1) * 100_000])
    data = _prepare(tmp_path, source="text_files", path=str(corpus), shard_divisor=1)
    assert data.meta["documents"] == 4


@pytest.mark.integration
def test_text_files_say_whether_the_folder_the_glob_or_the_path_is_wrong(tmp_path):
    with pytest.raises(GptlabError, match=r"the folder has no \*.txt files"):
        _prepare(tmp_path, source="text_files", path=str(tmp_path))
    with pytest.raises(GptlabError, match="the glob matches no files"):
        _prepare(tmp_path, source="text_files", path=str(tmp_path / "*.md"))
    with pytest.raises(GptlabError, match="no such file or folder"):
        _prepare(tmp_path, source="text_files", path=str(tmp_path / "nope"))


def test_too_little_text_names_the_split_and_the_source(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hi\n")
    with pytest.raises(
        GptlabError, match=f"the val split of 3 tokens \\(data.path={tiny}\\) got none"
    ):
        _prepare(tmp_path, path=str(tiny))
    with pytest.raises(GptlabError, match="data.max_documents=0: must be positive"):
        _prepare(tmp_path, source="text_files", path=str(tiny), max_documents=0)


def test_a_corpus_with_no_text_after_cleaning_names_the_source(tmp_path):
    # a Project Gutenberg book that is all licence: the cleaner leaves nothing
    book = tmp_path / "book.txt"
    book.write_text(
        "*** START OF THE PROJECT GUTENBERG EBOOK X ***\n\n*** END OF THE PROJECT GUTENBERG EBOOK "
        "X ***\n"
    )
    with pytest.raises(
        GptlabError, match=f"data.path={book}: no text to train on.*data.cleaner=gutenberg"
    ):
        _prepare(tmp_path, source="text_files", path=str(book), cleaner="gutenberg")


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    text = tmp_path / "books.txt"
    text.write_text("a book\n")
    with pytest.raises(GptlabError, match=f"{text} is not a parquet file"):
        _prepare(tmp_path, source="hf", path=str(text))


def test_a_bad_tokenizer_ranks_file_is_named(tmp_path, shakespeare):
    bad = tmp_path / "ranks.tiktoken"
    bad.write_text("this is not a ranks file\n")
    for path, fragment in ((bad, "is not a tiktoken ranks file"), (tmp_path, "is a folder")):
        with pytest.raises(GptlabError, match=f"data.tokenizer.path={path} {fragment}"):
            _prepare(tmp_path, path=str(shakespeare), tokenizer={"kind": "bpe", "path": str(path)})


@pytest.mark.integration
def test_a_damaged_prepared_folder_says_to_delete_it(tmp_path, shakespeare):
    data = _prepare(tmp_path, path=str(shakespeare))
    (data.root / "meta.json").write_text("{ not json")
    with pytest.raises(GptlabError, match=f"not valid JSON.*delete {data.root}"):
        _prepare(tmp_path, path=str(shakespeare))


@pytest.mark.slow
def test_an_empty_data_path_is_one_line(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    one_line_error(train(tmp_path, empty), f"data.path={empty}: the file is empty")
    # a folder's line is test_a_folder_for_a_one_file_source_says_so's, raised where the empty
    # file's is


# ---- 3. files that are not checkpoints ---------------------------------------------------------


def _not_checkpoints(tmp_path: Path):
    good = checkpoint.save(tmp_path / "good.pt", {"step": 1, "w": torch.arange(4)})
    files = {
        "random.pt": (os.urandom(4096), "not a PyTorch file"),
        "notes.pt": (b"this is a text file\nnot a checkpoint\n", "not a PyTorch file"),
        "hello.pt": (b"hello\n", "not a PyTorch file"),
        "empty.pt": (b"", "an empty file"),
        "truncated.pt": (good.read_bytes()[:300], "a truncated or corrupt PyTorch file"),
    }
    for name, (content, _) in files.items():
        (tmp_path / name).write_bytes(content)
    return {tmp_path / name: why for name, (_, why) in files.items()}


def test_a_file_that_is_not_a_checkpoint_is_one_clear_line(tmp_path):
    for path, why in _not_checkpoints(tmp_path).items():
        with pytest.raises(GptlabError) as e:
            checkpoint.load(path)
        assert str(e.value) == f"checkpoint {path} is not a gptlab checkpoint ({why})"
    with pytest.raises(
        GptlabError, match="is a folder but not a sharded checkpoint .*: give ckpt_<step>.pt or"
    ):
        checkpoint.load(tmp_path)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")  # a PyTorch file, not gptlab's
    with pytest.raises(GptlabError, match="a PyTorch file that gptlab did not write"):
        checkpoint.load(tmp_path / "foreign.pt")


def test_a_pickle_that_would_run_code_is_named_unsafe(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"format_version": checkpoint.FORMAT_VERSION, "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(GptlabError) as e:
        checkpoint.load(tmp_path / "evil.pt")
    assert "evil.pt is not a gptlab checkpoint (unreadable or unsafe: loading it would run" in str(
        e.value
    )
    assert (
        "system" in str(e.value) and "\n" not in str(e.value) and "weights_only" not in str(e.value)
    )


def test_resume_auto_names_why_it_skips_a_checkpoint(tmp_path):
    good = checkpoint.save(checkpoint.checkpoint_path(tmp_path, 5), {"step": 5})
    checkpoint.checkpoint_path(tmp_path, 10).write_bytes(os.urandom(2048))
    warnings = []
    path, _ = checkpoint.load_latest_good(tmp_path, warn=warnings.append)
    assert path == good
    assert warnings == [
        f"warning: checkpoint {checkpoint.checkpoint_path(tmp_path, 10)} is not a gptlab "
        f"checkpoint "
        f"(not a PyTorch file); trying the previous checkpoint"
    ]


@pytest.mark.slow
def test_resuming_from_a_file_that_is_not_a_checkpoint_is_one_line(tmp_path, shakespeare):
    # the data is prepared before the checkpoint is read: prepare it here, so that the command's
    # stderr holds no progress bar (which a first run shows, above the error line)
    prepare_data(typed("data", f"data.path={shakespeare}"), log=lambda *_: None)
    # one kind of file: each kind's line is test_a_file_that_is_not_a_checkpoint_is_one_clear_line's
    path = tmp_path / "random.pt"
    why = _not_checkpoints(tmp_path)[path]
    r = train(tmp_path, shakespeare, f"train.resume={path}")
    one_line_error(r, f"checkpoint {path} is not a gptlab checkpoint ({why})")


# ---- 4. GPU hardware on a machine without GPUs -------------------------------------------------


@pytest.fixture
def not_launched(monkeypatch):
    """A plain process: no torchrun or SLURM variables."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.integration
def test_gpu_hardware_without_gpus_fails_before_any_worker_starts(monkeypatch, not_launched):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(distributed, "spawn", lambda *a, **k: pytest.fail("spawned workers"))
    for preset in ("a100x8", "gpu"):
        with pytest.raises(GptlabError) as e:
            distributed.role(typed("hardware", f"hardware={preset}"))
        assert (
            str(e.value) == f"hardware={preset} needs CUDA, but no GPU is visible; use hardware=cpu"
        )
    # CPU workers: no GPU asked
    assert distributed.role(typed("hardware", "hardware=cpu_x2")) == "parent"


@pytest.mark.integration
def test_fewer_gpus_than_processes_is_one_line(monkeypatch, not_launched):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        GptlabError, match="hardware=a100x8 starts 8 processes.*2 GPU.*hardware.nproc_per_node=2"
    ):
        distributed.role(typed("hardware", "hardware=a100x8"))
    # a worker that torchrun started: its launcher chose the processes
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert distributed.role(typed("hardware", "hardware=a100x8")) == "torchrun"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_a100x8_without_gpus_is_one_line_at_once(tmp_path, shakespeare):
    t0 = time.monotonic()
    r = train(tmp_path, shakespeare, "hardware=a100x8")
    one_line_error(r, "hardware=a100x8 needs CUDA, but no GPU is visible; use hardware=cpu")
    assert "Terminating" not in r.stderr and time.monotonic() - t0 < 60


# ---- 5. micro-batch sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.micro_batch_size=0", "train.micro_batch_size=0: must be a positive integer, null"),
        (
            "train.micro_batch_size=-4",
            "train.micro_batch_size=-4: must be a positive integer, null",
        ),
        (
            "hardware.micro_batch_size=0",
            "hardware.micro_batch_size=0: must be a positive integer or null",
        ),
        (
            "hardware.micro_batch_size=-1",
            "hardware.micro_batch_size=-1: must be a positive integer or null",
        ),
    ],
)
def test_a_micro_batch_of_zero_or_less_is_refused(override, message):
    with pytest.raises(GptlabError) as e:
        to_config(compose_config([override]))
    assert str(e.value).startswith(message), str(e.value)
    if override.startswith("train."):
        assert "or auto" in str(e.value)


@pytest.mark.integration
def test_micro_batch_null_and_auto_still_mean_what_they_say():
    assert to_config(compose_config(["train.micro_batch_size=null"])).micro_batch_size > 0
    assert (
        to_config(compose_config(["train.micro_batch_size=auto"])).train.micro_batch_size == "auto"
    )


@pytest.mark.slow
def test_micro_batch_zero_is_one_line(tmp_path, shakespeare):
    one_line_error(
        train(tmp_path, shakespeare, "train.micro_batch_size=0"), "train.micro_batch_size=0"
    )
    assert not list(tmp_path.rglob("*.pt"))


# ---- 6. how the tests find Tiny Shakespeare ----------------------------------------------------


@pytest.fixture
def text_server(tmp_path):
    """A local HTTP server standing in for the public URL, serving one small text file."""
    served = tmp_path / "served"
    served.mkdir()
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    (served / "input.txt").write_text(text)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/input.txt"
    yield url, hashlib.sha256(text.encode()).hexdigest(), server
    server.shutdown()
    server.server_close()


@pytest.mark.integration
def test_shakespeare_is_downloaded_once_into_gptlabs_cache_and_verified(tmp_path, text_server):
    url, sha, server = text_server
    data = data_config(url=url, sha256=sha)
    missing = tmp_path / "shared" / "tinyshakespeare.txt"
    found = find_shakespeare(env={}, shared=missing, cache=tmp_path / "cache", data=data)
    assert found == tmp_path / "cache" / "downloads" / "tinyshakespeare.txt"
    assert found.read_text().startswith("First Citizen:")
    server.shutdown()  # offline from now on: the verified copy in the cache is used
    assert find_shakespeare(env={}, shared=missing, cache=tmp_path / "cache", data=data) == found


def test_shakespeare_prefers_the_override_then_the_shared_copy(tmp_path):
    mine, shared = tmp_path / "mine.txt", tmp_path / "shared.txt"
    mine.write_text("a")
    shared.write_text("b")
    offline = data_config(url="http://127.0.0.1:9/input.txt")
    assert (
        find_shakespeare({"GPTLAB_SHAKESPEARE": str(mine)}, shared, tmp_path / "c", offline) == mine
    )
    assert find_shakespeare({}, shared, tmp_path / "c", offline) == shared
    with pytest.raises(pytest.fail.Exception) as e:
        find_shakespeare(
            {"GPTLAB_SHAKESPEARE": str(tmp_path / "nope.txt")}, shared, tmp_path / "c", offline
        )
    assert str(e.value) == (
        f"GPTLAB_SHAKESPEARE={tmp_path / 'nope.txt'}: no such file; set "
        f"GPTLAB_SHAKESPEARE=/path/to/tinyshakespeare.txt"
    )


@pytest.mark.integration
def test_shakespeare_offline_without_a_copy_fails_with_one_line_saying_what_to_set(
    tmp_path, text_server
):
    url, _, _ = text_server
    missing = tmp_path / "shared" / "tinyshakespeare.txt"
    for data, reason in (
        (data_config(url="http://127.0.0.1:9/input.txt"), "could not download"),
        (data_config(url=url, sha256="0" * 64), "SHA-256"),  # a bad copy is not used either
    ):
        with pytest.raises(pytest.fail.Exception) as e:
            find_shakespeare(env={}, shared=missing, cache=tmp_path / "cache", data=data)
        message = str(e.value)
        assert "\n" not in message and reason in message
        assert message.endswith("; set GPTLAB_SHAKESPEARE=/path/to/tinyshakespeare.txt")
        # nothing half-downloaded left behind
        assert not list((tmp_path / "cache").rglob("*.part*"))


@pytest.mark.integration
def test_without_shakespeare_the_suite_stops_before_its_first_test_with_one_line(tmp_path):
    """Each test that needs the data used to error with the same line (122 errors in 13 minutes)."""
    import subprocess

    env = {**os.environ, "GPTLAB_SHAKESPEARE": str(tmp_path / "nope.txt")}
    line = f"GPTLAB_SHAKESPEARE={tmp_path / 'nope.txt'}: no such file; set GPTLAB_SHAKESPEARE="
    tests = Path(__file__).parent
    ask = subprocess.run(
        [sys.executable, str(tests / "conftest.py")], env=env, capture_output=True, text=True
    )
    assert ask.returncode == 2 and ask.stdout == ""
    assert ask.stderr.splitlines() == [f"tests: {line}/path/to/tinyshakespeare.txt"]
    suite = [
        sys.executable,
        "-m",
        "pytest",
        str(tests / "test_data_tokenizers.py"),
        "-p",
        "no:cacheprovider",
        "-q",
    ]
    run = subprocess.run(suite, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 2
    assert run.stdout.count(line) == 1 and "no tests ran" in run.stdout
    assert " passed" not in run.stdout and " error" not in run.stdout
