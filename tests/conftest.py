"""pytest's fixtures and hooks for the whole suite; the helpers tests import are in helpers.py.

Run as a script (make test does, first): prints where Tiny Shakespeare is, or one line and exits 2.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import find_shakespeare

# Under xdist more workers than cores share the machine: each test process, and every command it
# starts, multiplies on one thread, so no worker's matmul threads wait on another's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Prepared token files go to a per-session folder, not the user's ~/.cache."""
    os.environ["GPTLAB_CACHE_DIR"] = str(tmp_path_factory.mktemp("gptlab-cache"))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    yield


@pytest.fixture(autouse=True)
def _console_restored(monkeypatch):
    """A test that calls gptlab.bench's main in process leaves the next test's lines on stdout.

    bench's main sends INFO lines to stderr for its whole process (stdout is its JSON line).
    """
    from gptlab.console import ConsoleHandler

    monkeypatch.setattr(
        ConsoleHandler, "info_stream_is_stderr", ConsoleHandler.info_stream_is_stderr
    )


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A run built in this process may set torch's thread count (hardware.threads): the next test
    starts from the same count."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With GPTLAB_TEST_CPU=FILE, each test's CPU and wall seconds are appended to FILE.

    CPU counts the test's process and every process it started and waited for: what makes the
    suite slow on a busy machine is CPU, which wall times under xdist hide (docs/testing.md).
    """
    path = os.environ.get("GPTLAB_TEST_CPU")
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        warm = sys.modules.get("warm_start")  # commands forked from its server: not our children
        total = warm.CPU[0] if warm is not None else 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            total += usage.ru_utime + usage.ru_stime
        return total

    cpu0, wall0 = cpu(), time.monotonic()
    yield
    row = {
        "test": item.nodeid,
        "cpu": round(cpu() - cpu0, 2),
        "wall": round(time.monotonic() - wall0, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "end": round(time.time(), 1),
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    return find_shakespeare()


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--package",
        action="append",
        default=[],
        metavar="NAME",
        help="only the tests of files that import gptlab.NAME (a module or package: records, "
        "search, model, data.loader); repeatable",
    )


@pytest.hookimpl(tryfirst=True)  # before -m selects: the integration mark below must count
def pytest_collection_modifyitems(session, config, items) -> None:
    """Without Tiny Shakespeare the suite stops before its first test, with the one line saying what
    to set (not one error per test that needs it). Under xdist, tests are grouped by what they
    share (xdist_group); a test that reads a shared run or server is an integration test."""
    if any("shakespeare" in item.fixturenames for item in items):
        try:
            find_shakespeare()
        except pytest.fail.Exception as e:
            pytest.exit(str(e), returncode=2)
    packages = config.getoption("package")
    if packages:
        keep = [item for item in items if imports_any(item.path, packages)]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    for item in items:
        if item.path.name in SERVICES_FILES:
            item.add_marker(pytest.mark.services)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if group is not None and group != "slurm" and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.integration)


@functools.lru_cache(maxsize=None)
def _source(path: Path) -> str:
    return path.read_text()


def imports_any(path: Path, packages: "list[str]") -> bool:
    """Whether the test file imports one of gptlab's packages or modules (`gptlab.search`, `from
    gptlab import search`, `from gptlab.search.study import ...`)."""
    text = _source(path)
    for name in packages:
        parent, _, last = f"gptlab.{name}".rpartition(".")
        dotted = re.compile(rf"\bgptlab\.{re.escape(name)}\b")
        from_parent = re.compile(rf"from {re.escape(parent)} import [^\n]*\b{re.escape(last)}\b")
        if dotted.search(text) or from_parent.search(text):
            return True
    return False


# One SLURM cluster for the session, which test_multinode turns into two nodes and back: the tests
# that submit jobs to it run one after another on one worker.
SLURM_FILES = {"test_slurm.py", "test_multinode.py", "test_search_slurm.py"}
# run alone after the rest (make test): SLURM jobs and server restarts with deadlines of their own
SERVICES_FILES = SLURM_FILES | {"test_mlflow_server.py"}
# a test module's shared fixtures that cost nothing to make again
CHEAP_SHARED = {"slurm_cluster", "bpe_ranks"}
# fixtures of several files that return one cached object (test_compare.make_sweep keeps the sweep
# it made): their tests share one group, so the object is made once, on one worker
SHARED_ACROSS_FILES = {"sweep": "test_compare.py:sweep"}


def xdist_group(item) -> "str | None":
    """The group a test runs in under `pytest -n N --dist loadgroup` (make test, make unit): SLURM's
    tests together; the tests that read one module- or session-wide run (a trained model, a sweep,
    a server) on the worker that made it, so it is made once; every other test on any worker."""
    if item.path.name in SLURM_FILES:
        return "slurm"
    for name in item.fixturenames:
        for fixture in item._fixtureinfo.name2fixturedefs.get(name, ()):
            in_a_test_file = fixture.baseid.endswith(".py")  # not pytest's own, not conftest's
            if (
                fixture.scope in ("module", "session")
                and in_a_test_file
                and name not in CHEAP_SHARED
            ):
                return SHARED_ACROSS_FILES.get(name, f"{item.path.name}:{name}")
    return None


@pytest.fixture
def one_rank_group():
    """A gloo process group of one, in memory: enough for DDP, fully_shard and DCP in this
    process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():  # a test may have torn it down itself
        dist.destroy_process_group()


@pytest.fixture
def env(monkeypatch):
    """No launcher variables (distributed_fakes.LAUNCH_VARS); whatever a test sets, or the code
    under test writes, is undone after it."""
    from distributed_fakes import LAUNCH_VARS

    for name in LAUNCH_VARS:
        # recorded, so that a value the code writes itself is removed after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


# make test asks first, before it starts the services: one line and exit 2
if __name__ == "__main__":
    try:
        print(find_shakespeare())
    except pytest.fail.Exception as e:
        print(f"tests: {e}", file=sys.stderr)
        sys.exit(2)
