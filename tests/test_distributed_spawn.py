"""gptlab/distributed/world.py's own workers: a worker bound to its launcher, its exit codes, and
spawn's handling of signals and failures, with fake workers."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
from distributed_fakes import recorder

from gptlab.distributed import world as distributed
from gptlab.errors import GptlabError

# ------------------------------------------------------------------ spawned workers


@pytest.fixture
def worker_env(env):
    """distributed._worker in this process: its exit and its binding to the launcher recorded."""
    env.setattr(distributed, "_exit_now", recorder())
    env.setattr(distributed, "follow_launcher", recorder())
    return env


def test_worker_follows_its_launcher_sets_its_rank_runs_and_exits_with_its_code(worker_env):
    seen = []

    def fn(a, b):
        seen.append(
            (
                a,
                b,
                {
                    k: os.environ[k]
                    for k in (
                        "RANK",
                        "LOCAL_RANK",
                        "WORLD_SIZE",
                        "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR",
                        "MASTER_PORT",
                    )
                },
            )
        )

    distributed._worker(1, (3, 29511, 4242), fn, ("x", 2))
    assert distributed.follow_launcher.calls == [(4242,)]
    assert seen == [
        (
            "x",
            2,
            {
                "RANK": "1",
                "LOCAL_RANK": "1",
                "WORLD_SIZE": "3",
                "LOCAL_WORLD_SIZE": "3",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29511",
            },
        )
    ]
    assert distributed._exit_now.calls == [(0,)]


@pytest.mark.parametrize(
    "code, exit_code", [(2, 2), (0, 0), (None, 0), ("a message", 1), (True, True)]
)
def test_worker_turns_systemexit_into_its_exit_code(worker_env, code, exit_code):
    def fn():
        raise SystemExit(code)

    distributed._worker(0, (1, 1234, 1), fn, ())
    exits = distributed._exit_now.calls
    assert exits == [(exit_code,)] and type(exits[0][0]) is type(exit_code)


def test_an_interrupted_worker_exits_130_quietly(worker_env, capsys):
    def fn():
        raise KeyboardInterrupt

    distributed._worker(0, (1, 1234, 1), fn, ())
    assert distributed._exit_now.calls == [(distributed.INTERRUPTED,)] == [(130,)]
    assert capsys.readouterr() == ("", "")  # the launcher says where the run stands


def test_a_crashed_worker_prints_its_traceback_and_exits_with_its_own_code(worker_env, capsys):
    def fn():
        raise ValueError("bug")

    distributed._worker(0, (1, 1234, 1), fn, ())
    assert distributed._exit_now.calls == [(distributed.CRASHED,)]
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.rstrip().endswith(
        "ValueError: bug"
    )


FOLLOWER = """
import os, signal, sys
from gptlab.distributed import world as distributed
distributed.follow_launcher(int(sys.argv[1]))
default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
print(os.getpid(), os.getsid(0), default, flush=True)
signal.pause()
"""

LAUNCHER = """
import os, signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job: the worker inherits it
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=sys.stdout)
signal.pause()
"""


@pytest.mark.slow
def test_a_worker_ends_when_its_launcher_is_killed_and_hears_only_the_launcher(tmp_path):
    """follow_launcher in a real process: its own session, SIGINT back to Python's handler, and
    SIGKILL from the kernel when the launcher dies of SIGKILL (which no handler of the launcher's
    can pass on)."""
    out = tmp_path / "out"
    with out.open("w") as f:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, FOLLOWER], stdout=f)
    try:
        deadline = time.time() + 120
        while not out.read_text().strip():
            assert time.time() < deadline and launcher.poll() is None, "the worker never started"
            time.sleep(0.1)
        pid, sid, handler = out.read_text().split()
        # a session of its own; Ctrl-C would raise KeyboardInterrupt
        assert sid == pid and handler == "True"
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 10
        while _running(int(pid)):
            assert time.time() < deadline, f"worker {pid} outlived its launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()


def _running(pid: int) -> bool:

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_a_worker_whose_launcher_died_before_it_was_bound_ends_at_once():
    """The launcher died between the worker's start and its prctl: the parent is no longer the
    launcher, and the worker kills itself before running anything."""
    code = (
        "import os, sys\nfrom gptlab import distributed\n"
        "distributed.follow_launcher(os.getppid() + 1)\nprint('ran')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL and r.stdout == ""


def test_stop_again_only_for_a_second_user_stop_after_a_second():
    assert distributed.stop_again("SIGINT", 1.5, "SIGINT") and distributed.stop_again(
        "SIGTERM", 1.5, "SIGINT"
    )
    assert distributed.stop_again("SIGINT", 1.5, "SIGTERM")
    assert not distributed.stop_again("SIGINT", 0.5, "SIGINT")  # the same Ctrl-C, delivered twice
    # a scheduler's warning, then its own SIGTERM
    assert not distributed.stop_again("SIGUSR2", 60, "SIGTERM")
    assert not distributed.stop_again("SIGTERM", 60, "SIGUSR2")


class Exited(Exception):
    pass


def test_exit_now_flushes_everything_then_leaves(monkeypatch):
    events = []

    class Stream:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def flush(self):
            events.append(f"flush {self.name}")
            if self.error:
                raise self.error

    def leave(code):
        events.append(("exit", code))
        raise Exited

    monkeypatch.setattr(logging, "shutdown", lambda: events.append("logging"))
    monkeypatch.setattr(os, "_exit", leave)
    monkeypatch.setattr(sys, "stdout", Stream("stdout", OSError("closed pipe")))
    monkeypatch.setattr(sys, "stderr", Stream("stderr"))
    with pytest.raises(Exited):
        distributed._exit_now(3)
    assert events == ["logging", "flush stdout", "flush stderr", ("exit", 3)]
    events.clear()
    monkeypatch.setattr(sys, "stdout", Stream("stdout"))
    monkeypatch.setattr(sys, "stderr", Stream("stderr", ValueError("I/O operation on closed file")))
    with pytest.raises(Exited):
        distributed._exit_now(0)
    assert events == ["logging", "flush stdout", "flush stderr", ("exit", 0)]


class FakeWorker:
    """A worker that ends when the test says (its sentinel is a real pipe, as a process's is)."""

    def __init__(self, pid):
        self.pid, self.exitcode, self.killed = pid, None, False
        self.sentinel, self._end = os.pipe()

    def end(self, code):
        if self.exitcode is None:
            self.exitcode = code
            os.close(self._end)

    def is_alive(self):
        return self.exitcode is None

    def kill(self):
        self.killed = True
        self.end(-signal.SIGKILL)

    def join(self):
        pass


@pytest.fixture
def fake_spawn(monkeypatch):
    """distributed._start gives fake workers; signals sent to them (os.kill) are recorded, and
    `on_signal(pid, sig)` says what a worker does with one (default: stops and exits 0)."""
    started = SimpleNamespace(calls=[], kills=[], workers=[], on_signal=lambda w, sig: w.end(0))

    def start(nprocs, fn, args):
        started.calls.append((nprocs, fn, args))
        started.workers = [FakeWorker(101 + i) for i in range(nprocs)]
        return started.workers

    real_kill = os.kill

    def kill(pid, sig):
        for w in started.workers:
            if w.pid == pid:
                started.kills.append((pid, sig))
                return started.on_signal(w, sig)
        return real_kill(pid, sig)  # this process (the test's signals to itself)

    monkeypatch.setattr(distributed, "_start", start)
    monkeypatch.setattr(os, "kill", kill)
    yield started
    for w in started.workers:
        w.end(0)
        os.close(w.sentinel)


STOPS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)


def later(*actions):
    """Run (seconds to wait, action) pairs on a thread while spawn waits in the main thread."""

    def run():
        for wait, action in actions:
            time.sleep(wait)
            action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def to_me(sig):
    """Send sig to this process's main thread, where Python runs signal handlers."""
    return lambda: signal.pthread_kill(threading.main_thread().ident, sig)


def test_spawn_starts_the_workers_and_waits_for_all(fake_spawn):
    def target():
        pass

    before = {s: signal.getsignal(s) for s in STOPS}
    later((0.2, lambda: fake_spawn.workers[1].end(0)), (0.2, lambda: fake_spawn.workers[0].end(0)))
    assert distributed.spawn(target, 2, ("a",)) is None
    assert fake_spawn.calls == [(2, target, ("a",))] and fake_spawn.kills == []
    assert {s: signal.getsignal(s) for s in STOPS} == before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2, signal.SIGINT])
@pytest.mark.integration
def test_spawn_forwards_the_first_stop_signal_once_to_every_live_worker(fake_spawn, sig):
    before = {s: signal.getsignal(s) for s in STOPS}
    fake_spawn.on_signal = lambda w, s: None  # the workers stop at their next step: not yet
    later((0.2, lambda: fake_spawn.workers[2].end(0)), (0.1, to_me(sig)), (0.1, to_me(sig)),
          (0.3, lambda: [w.end(0) for w in fake_spawn.workers]))  # fmt: skip
    distributed.spawn(print, 3, ())
    # the same stop delivered twice (a terminal's process group, a SLURM step) is passed on once
    assert fake_spawn.kills == [(101, sig), (102, sig)]
    assert {s: signal.getsignal(s) for s in STOPS} == before


@pytest.mark.integration
def test_a_second_ctrl_c_kills_the_workers_and_interrupts_at_once(fake_spawn):
    fake_spawn.on_signal = lambda w, s: None  # saving: they would take their time
    later((0.2, to_me(signal.SIGINT)), (distributed.SAME_STOP_S + 0.3, to_me(signal.SIGINT)))
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        distributed.spawn(print, 2, ())
    assert time.monotonic() - t0 < distributed.SAME_STOP_S + 3
    assert fake_spawn.kills == [(101, signal.SIGINT), (102, signal.SIGINT)]
    assert all(w.killed for w in fake_spawn.workers)


def test_a_launcher_started_with_sigint_ignored_leaves_it_ignored(fake_spawn):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen = []
        later((0.2, lambda: seen.append(signal.getsignal(signal.SIGINT))),
              (0, lambda: [w.end(0) for w in fake_spawn.workers]))  # fmt: skip
        distributed.spawn(print, 2, ())
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    "code, how",
    [(-9, "(pid 102) was killed by SIGKILL"), (-6, "(pid 102) was killed by SIGABRT"),
     (3, "(pid 102) exited with code 3"), (distributed.CRASHED, "failed (traceback above)")],
)  # fmt: skip
def test_a_failed_worker_ends_the_others_at_once_and_is_named(fake_spawn, code, how):
    before = {s: signal.getsignal(s) for s in STOPS}
    later((0.2, lambda: fake_spawn.workers[1].end(code)))
    with pytest.raises(GptlabError) as e:
        distributed.spawn(print, 3, ())
    assert str(e.value) == f"worker rank 1 {how}; all workers were stopped"
    assert e.value.__cause__ is None and e.value.__suppress_context__
    # killed, not sent SIGTERM: a worker would take that for a stop and try to save with a peer gone
    assert [w.killed for w in fake_spawn.workers] == [True, False, True] and fake_spawn.kills == []
    assert {s: signal.getsignal(s) for s in STOPS} == before


def test_spawn_passes_on_a_workers_user_error_exit(fake_spawn):
    later((0.2, lambda: fake_spawn.workers[0].end(2)))
    with pytest.raises(SystemExit) as e:
        distributed.spawn(print, 2, ())
    assert e.value.code == 2 and e.value.__suppress_context__
    assert fake_spawn.workers[1].killed


def test_a_worker_interrupted_before_training_interrupts_the_launcher(fake_spawn):
    later((0.2, lambda: fake_spawn.workers[0].end(130)))
    with pytest.raises(KeyboardInterrupt):
        distributed.spawn(print, 2, ())
    # a worker killed by the stop signal it was sent (before its loop took that signal over)
    fake_spawn.on_signal = lambda w, s: w.end(-s)
    later((0.2, to_me(signal.SIGTERM)))
    with pytest.raises(KeyboardInterrupt):
        distributed.spawn(print, 2, ())
