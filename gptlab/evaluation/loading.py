"""Loading lm_eval's tasks: from the Hub, else the local cache, with failures named by cause.

The Hugging Face Hub is used when it answers, the local cache when it does not; a failure is named
by its cause, and progress bars are shown only where someone watches them.

- ``hub_access``: a task whose data live on the Hub first asks whether the Hub answers (one request,
  seconds at most). When it does not, the Hub's and datasets' offline modes are turned on for the
  rest of the command (and the processes it starts), so a dataset in the local cache loads and one
  that is not fails at once, instead of after the hub client's retries.
- ``failure``: one line for a task that could not be loaded, naming what went wrong: the network
  only when it is the network.
- ``progress_bars``: tqdm's bars (lm_eval's, datasets') off where nobody watches: another rank than
  0, or a stderr that is not a terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Iterator, Optional

log = logging.getLogger(__name__)

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# exception classes (by name, across requests, httpx, urllib, huggingface_hub, datasets) that mean
# the network, in an error or what caused it
NETWORK_ERRORS = frozenset(
    (
        "ConnectionError",
        "OfflineModeIsEnabled",
        "LocalEntryNotFoundError",
        "Timeout",
        "TimeoutError",
        "ConnectTimeout",
        "ReadTimeout",
        "ConnectError",
        "TransportError",
        "ProxyError",
        "SSLError",
        "URLError",
        "gaierror",
    )
)
NOT_FOUND_ERRORS = frozenset(
    ("DatasetNotFoundError", "RepositoryNotFoundError", "FileNotFoundError")
)
HOW_OFFLINE = (
    "copy the data into a file and point a task YAML at it (dataset_path: json, "
    "dataset_kwargs.data_files: the file) in conf/eval_tasks or a folder given as eval.include=DIR "
    "(docs/evaluation.md)"
)
_unreachable = {"reason": None}  # why this process turned the Hub off (hub_access)


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def offline_already() -> bool:
    """The user turned the Hub off (HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1)."""
    values = [os.environ.get(v, "").upper() for v in OFFLINE_VARIABLES]
    return any(v in ("1", "ON", "YES", "TRUE") for v in values)


def hub_unreachable(timeout: float = 3.0) -> Optional[str]:
    """Why the Hub does not answer (None: it answers, with any HTTP status).

    It asks in one request that takes `timeout` seconds at most (a proxy in the environment is used,
    as the hub client uses it).
    """
    url = hub_endpoint()
    host = urllib.parse.urlsplit(url).netloc or url
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{host}: {getattr(reason, 'strerror', None) or reason}"
    return None


@contextlib.contextmanager
def offline_mode(reason: Optional[str]) -> Iterator[None]:
    """The Hub's and datasets' offline modes on while the block runs; all as they were afterwards.

    It sets the variables (for modules not yet imported, and for the processes started here) and the
    flags of those already imported. reason: why the Hub is off (None: the user said so).
    """
    flags = [
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_DATASETS_OFFLINE"),
    ]
    saved_env = {v: os.environ.get(v) for v in OFFLINE_VARIABLES}
    saved = [(m, f, getattr(sys.modules[m], f)) for m, f in flags if m in sys.modules]
    os.environ.update(dict.fromkeys(OFFLINE_VARIABLES, "1"))
    for module, flag, _ in saved:
        setattr(sys.modules[module], flag, True)
    _unreachable["reason"] = reason
    try:
        yield
    finally:
        _unreachable["reason"] = None
        for module, flag, value in saved:
            setattr(sys.modules[module], flag, value)
        for variable, value in saved_env.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


@contextlib.contextmanager
def hub_access(needed: bool) -> Iterator[None]:
    """The block with the Hub online if it answers, else offline (the local cache only).

    One question when a task needs the Hub, none when the user turned it off (HF_HUB_OFFLINE=1,
    which then holds for libraries imported before it was set, too).
    """
    user_off = offline_already()
    reason = hub_unreachable() if needed and not user_off else None
    if not needed or (reason is None and not user_off):
        yield
        return
    if reason is not None:  # a task that fails says so in its one line; one that loads, nothing
        log.debug(f"eval: the Hugging Face Hub does not answer ({reason}): the local cache only")
    with offline_mode(reason):
        yield


def _causes(error: BaseException) -> set:
    """The class names of an error and of what caused it (a few levels)."""
    names, seen = set(), 0
    while error is not None and seen < 6:
        names.update(c.__name__ for c in type(error).__mro__)
        error, seen = error.__cause__ or error.__context__, seen + 1
    return names


def failure(task: str, error: BaseException, dataset: Optional[str]) -> str:
    """One line for a task whose data could not be loaded, naming the cause."""
    said = str(error).splitlines()[0][:200] if str(error).strip() else type(error).__name__
    causes = _causes(error)
    data = f"its data ({dataset})" if dataset else "its data"
    if "UndefinedError" in causes:
        return f"task {task!r}: its YAML reads a field its documents lack ({said})"
    if causes & NETWORK_ERRORS:
        if _unreachable["reason"] or offline_already():
            why = (
                f"the Hugging Face Hub does not answer ({_unreachable['reason']})"
                if _unreachable["reason"]
                else "HF_HUB_OFFLINE=1 keeps the Hub off"
            )
            return f"task {task!r}: {data} are not in the local cache, and {why}; {HOW_OFFLINE}"
        return f"task {task!r}: {data} could not be downloaded ({said}); offline, {HOW_OFFLINE}"
    if causes & NOT_FOUND_ERRORS:
        return f"task {task!r}: {data} were not found ({said})"
    return f"task {task!r}: {data} could not be loaded ({type(error).__name__}: {said})"


@contextlib.contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """tqdm's bars as they are when `shown`, else off while the block runs.

    Off: every bar made meanwhile (lm_eval's, datasets', the harness's) is made disabled.
    """
    if shown:
        yield
        return
    from tqdm import std

    raw = std.tqdm.__dict__["__init__"]
    make = std.tqdm.__init__

    def disabled(self, *args, **kwargs) -> None:
        make(self, *args, **{**kwargs, "disable": True})

    std.tqdm.__init__ = disabled
    try:
        yield
    finally:
        std.tqdm.__init__ = raw


def terminal() -> bool:
    """Whether stderr (where tqdm draws) is a terminal."""
    return bool(getattr(sys.stderr, "isatty", None) and sys.stderr.isatty())


@contextlib.contextmanager
def no_environment_report() -> Iterator[None]:
    """lm_eval's simple_evaluate without its environment report, which eval.json does not keep.

    The report runs `git describe` in the working folder (outside a repository it prints "fatal: not
    a git repository" on stderr) and torch's collect_env (seconds of subprocesses).
    """
    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    saved = evaluator.get_git_commit_hash, evaluator.add_env_info
    evaluator.get_git_commit_hash = lambda: get_commit_from_path(os.getcwd())
    evaluator.add_env_info = lambda storage: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash, evaluator.add_env_info = saved
