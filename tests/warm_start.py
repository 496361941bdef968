"""Commands the tests run, started warm: `python -m gptlab.<command>` forked from a server that
has imported torch, MLflow and Hydra once, instead of a fresh interpreter paying for them each time.

Every command the suite runs pays several CPU-seconds of imports before its first line, and the
suite on two cores is bound by CPU (docs/testing.md). The fork server is a fresh interpreter that
only imports (it runs nothing), one per test process, started at the first command. Each command is
a forked copy of it that runs the module as `python -m` would (`runpy`, `__main__`), with the
command's own arguments, folder, environment and stdin/stdout/stderr; it ends as an interpreter
does (atexit, threads joined, streams flushed), and its exit status (a signal's too) and CPU come
back to the test. What a fresh interpreter proves and a fork cannot (what a command imports, how
long its start takes) is tested with plain processes (tests/system/test_startup.py); run_cli's
fresh=True and GPTLAB_TEST_WARM=0 start plain processes too.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

# what the server imports: the heavy libraries and gptlab's modules below its commands (a
# command's own module is run fresh as __main__, as `python -m` does)
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "numpy",
    "mlflow",
    "mlflow.tracking",
    "hydra",
    "omegaconf",
    "submitit",
    "optuna",
    "tiktoken",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "gptlab.cli",
    "gptlab.config",
    "gptlab.training.build",
    "gptlab.training.loop",
    "gptlab.records.tracker",
    "gptlab.records.runfolder",
    "gptlab.distributed.world",
    "gptlab.records.sinks",
    "gptlab.search.sweeper",
]

CPU = [0.0]  # CPU seconds of the warm commands that ended: tests/conftest.py's recorder adds them
_lock = threading.Lock()
_server: Optional["_Server"] = None


def enabled() -> bool:
    return os.environ.get("GPTLAB_TEST_WARM", "1") != "0"


class _Server:
    """The fork server of this test process: its process and the socket it listens on."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="gptlab-warm-")
        self.path = os.path.join(self.dir, "s")
        here = str(Path(__file__).resolve().parent)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); "
             "import warm_start; warm_start.serve(sys.argv[1])", self.path],
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path + ".ready"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the warm-start server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("the warm-start server did not start in 300 s")
            time.sleep(0.05)
        CPU[0] += float(Path(self.path + ".ready").read_text())  # its imports: counted once
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)  # its socket, and the shim python_env wrote


def _get_server() -> _Server:
    global _server
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        return _server


class WarmProcess:
    """A started warm command: its pid, and its exit status once it ended (Popen's returncode).

    stdin, stdout, stderr are file descriptors the command gets (stdin None: /dev/null); the
    caller keeps its own copies.
    """

    def __init__(
        self, argv: List[str], cwd: Path, env: Dict[str, str], stdin: Optional[int], stdout: int,
        stderr: int, server: Optional[str] = None, start_new_session: bool = False,
    ):  # fmt: skip
        self.args = argv
        self.returncode: Optional[int] = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(server or _get_server().path)
        request = {"argv": argv, "cwd": str(cwd), "env": env, "session": start_new_session}
        request = json.dumps(request).encode()
        null = os.open(os.devnull, os.O_RDONLY) if stdin is None else None
        try:
            fds = [null if stdin is None else stdin, stdout, stderr]
            socket.send_fds(self._sock, [request + b"\n"], fds)
        finally:
            if null is not None:
                os.close(null)
        self._buffer = b""
        self.pid = json.loads(self._line(None))["pid"]

    def _line(self, timeout: Optional[float]) -> bytes:
        """The server's next line about this command (TimeoutError when none came in time)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._sock.settimeout(left)  # 0: one look, as poll() takes
            try:
                chunk = self._sock.recv(4096)
            except (socket.timeout, BlockingIOError):
                raise TimeoutError from None
            if not chunk:  # the server went away: the command's fate is unknown
                raise RuntimeError(f"the warm-start server ended while {self.args} ran")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            try:
                status = json.loads(self._line(timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self.returncode = status["returncode"]
            CPU[0] += status["cpu"]
            self._sock.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmPopen(WarmProcess):
    """subprocess.Popen([python, "-m", *argv], stdout=PIPE, stderr=PIPE or STDOUT, text=True),
    started warm: what tests use of Popen (pid, poll, wait, communicate, send_signal, kill)."""

    def __init__(
        self, argv: List[str], cwd: Path, env: Dict[str, str], merge_stderr: bool,
        start_new_session: bool = False,
    ):  # fmt: skip
        out_r, out_w = os.pipe()
        err_r, err_w = (None, out_w) if merge_stderr else os.pipe()
        try:
            super().__init__(
                argv, cwd, env, None, out_w, err_w, start_new_session=start_new_session
            )
        finally:
            for fd in {out_w, err_w}:
                os.close(fd)
        self.stdout = open(out_r, encoding="utf-8", errors="replace")  # noqa: SIM115 - as Popen's
        self.stderr = None if err_r is None else open(err_r, encoding="utf-8", errors="replace")  # noqa: SIM115

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: Optional[float] = None):
        """(stdout, stderr) once the command ended; TimeoutExpired (it goes on) after timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        texts: Dict[int, str] = {}
        readers = [
            threading.Thread(target=lambda i=i, s=s: texts.__setitem__(i, s.read()), daemon=True)
            for i, s in enumerate(streams)
        ]
        for r in readers:
            r.start()
        for r in readers:
            r.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if r.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.1, deadline - time.monotonic()))
        for stream in streams:
            stream.close()
        return texts.get(0), (texts.get(1) if self.stderr is not None else None)


def run(argv: List[str], cwd: Path, env: Dict[str, str], timeout: Optional[float]):
    """subprocess.run([python, "-m", *argv], capture_output=True, text=True), started warm."""
    proc = WarmPopen(argv, cwd, env, merge_stderr=False)
    args = [sys.executable, "-m", *argv]
    try:
        stdout, stderr = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # as subprocess.run does on a timeout
        proc.wait()
        raise subprocess.TimeoutExpired(args, timeout) from None
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def python_env() -> Dict[str, str]:
    """Environment under which a script's `$PYTHON -m gptlab.<command>` starts warm: PYTHON is
    an executable that hands `-m gptlab.*` to this test process's server, and runs anything else
    with this interpreter."""
    server = _get_server()
    shim = os.path.join(server.dir, "python")
    if not os.path.exists(shim):
        here = str(Path(__file__).resolve().parent)
        Path(shim + ".tmp").write_text(
            f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {here!r})\n"
            f"import warm_start\nwarm_start.shim({sys.executable!r}, {server.path!r})\n"
        )
        os.chmod(shim + ".tmp", 0o755)
        os.replace(shim + ".tmp", shim)
    return {"PYTHON": shim}


def shim(python: str, server: str) -> None:
    """The PYTHON of python_env(): `-m gptlab.*` runs warm on this process's own stdin, stdout and
    stderr, with the signals it gets passed on, and it ends as the command ended; anything else
    is python itself."""
    args = sys.argv[1:]
    if len(args) < 2 or args[0] != "-m" or not args[1].startswith("gptlab."):
        os.execv(python, [python, *args])
    proc = WarmProcess(args[1:], Path.cwd(), dict(os.environ), 0, 1, 2, server=server)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, _: proc.send_signal(signum))
    code = proc.wait()
    if code < 0:  # killed by a signal: so is this process, as its caller would see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ---- the server ------------------------------------------------------------------------------


def serve(path: str) -> None:
    """The fork server: imports PRELOAD, then forks one child per request on socket path."""
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the collector leaves the imported objects alone: forks share their pages
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(path + ".tmp").write_text(str(usage.ru_utime + usage.ru_stime))
    os.replace(path + ".tmp", path + ".ready")
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    running: Dict[int, socket.socket] = {}  # pid -> the connection its status goes to
    while True:
        if os.getppid() != parent:  # the test process is gone: so are its commands' server
            os._exit(0)
        for key, _ in sel.select(0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                child = _fork(conn, listener, running)
                if child is not None:
                    running[child] = conn
                    sel.register(conn, selectors.EVENT_READ, child)
            elif not key.fileobj.recv(1):  # its client is gone (killed): so is the command
                with contextlib.suppress(ProcessLookupError):
                    os.kill(key.data, signal.SIGKILL)
                sel.unregister(key.fileobj)
        _reap(running, sel)


def _fork(conn: socket.socket, listener: socket.socket, running: Dict[int, socket.socket]):
    """The child's pid, sent to the client; in the child, the command runs and never returns."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(msg)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        return pid
    listener.close()
    conn.close()
    for other in running.values():
        other.close()
    _run_command(request, fds)


def _reap(running: Dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    while running:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is None:
            continue
        with contextlib.suppress(KeyError):  # a client still connected
            sel.unregister(conn)
        reply = {
            "returncode": os.waitstatus_to_exitcode(status),
            "cpu": usage.ru_utime + usage.ru_stime,
        }
        with contextlib.suppress(OSError):  # the test stopped waiting
            conn.sendall(json.dumps(reply).encode() + b"\n")
        conn.close()


def _run_command(request: dict, fds: List[int]) -> None:
    """In the forked child: become `python -m <argv>` with the request's streams, folder and
    environment, run it, and exit as the interpreter would."""
    import io
    import random
    import runpy

    import numpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request["session"]:  # Popen's start_new_session: its own process group to signal
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    here = str(Path(__file__).resolve().parent)
    # as `python -m` has it: the folder, then $PYTHONPATH's, then the interpreter's own
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *(p for p in sys.path if p not in ("", here, *extra))]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), write_through=unbuffered, line_buffering=False
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    random.seed()
    numpy.random.seed()
    module, *args = request["argv"]
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # run fresh as __main__, as `python -m` does
    os._exit(_exit_code(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)))


def _exit_code(main) -> int:
    """main() run as an interpreter runs its program: the exit code an interpreter would end with.

    Its ending is an interpreter's (threads joined, atexit, streams flushed) without tearing down
    every module the server imported, which a fork ended by os._exit need not do.
    """
    import threading
    import traceback

    code = 0
    try:
        main()
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except Exception:  # noqa: BLE001 - uncaught: the interpreter prints it and ends with 1
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code == -signal.SIGINT:  # as an interpreter ends after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF
