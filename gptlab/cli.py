"""Entry-point plumbing shared by the ``python -m gptlab.*`` commands: one grammar, one kind of error.

Every command is a Hydra app with a root config of its own under conf/ (``conf/<command>.yaml``;
train's is ``conf/config.yaml``), so every command takes the same words: ``key=value`` and
``group=option`` overrides, ``-m`` for a sweep, ``--help`` for the command and its keys, ``--cfg job``
for the composed config. ``command`` runs one; tests and other code run the same command in
process with ``command(..., argv=[...])`` or get its config with ``compose``.

Hydra prints config errors over several lines with a hint about HYDRA_FULL_ERROR; gptlab's
contract is one line naming the key, ``gptlab.<command>: error: <message>``, and exit code 2. We ask
Hydra to re-raise (by setting HYDRA_FULL_ERROR for it) and print the condensed message ourselves. A
user who sets HYDRA_FULL_ERROR=1 still gets the full traceback.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import importlib
import os
import re
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from gptlab import console
from gptlab.errors import GptlabError

CONF = Path(__file__).resolve().parent.parent / "conf"

_TRACEBACK = {"wanted": False}  # the user's HYDRA_FULL_ERROR=1, seen by run_entry before it sets it
_SKIP = ("object_type=", "reference_type=", "Set the environment variable HYDRA_FULL_ERROR")


def condense(message: str) -> str:
    """Fold a multi-line Hydra / OmegaConf message into one readable line."""
    parts, options = [], []
    in_options = False
    for raw in str(message).splitlines():
        line = raw.strip()
        if not line or line.startswith(_SKIP):
            continue
        if line.startswith("Available options"):
            in_options = True
            continue
        if in_options and raw.startswith(("\t", "  ")):
            options.append(line)
            continue
        in_options = False
        parts.append(line.rstrip(".") if not line.startswith("full_key:") else f"({line})")
    text = ": ".join(p for p in parts if not p.startswith("(")) + "".join(f" {p}" for p in parts if p.startswith("("))
    if options:
        text += f" (available: {', '.join(options)})"
    return text


def describe(error: BaseException) -> str:
    """One line for a Hydra / OmegaConf error and the errors that caused it (the cause names the key)."""
    messages, seen = [], set()
    while error is not None and id(error) not in seen and len(messages) < 4:
        seen.add(id(error))
        if str(error).strip():
            messages.append(str(error))
        error = error.__cause__
    return condense("\n".join(messages))


def fail(prog: str, error: Exception) -> None:
    """Print a user error as one line and exit 2 (SystemExit passes Hydra's job logging silently)."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    sys.exit(2)


# OSErrors that come from the user's paths or the machine, not from a bug: errno -> (what, what to do)
_WRITE_ELSEWHERE = "choose a folder you can write to, or fix its permissions"
_OS_ERRORS = {
    errno.EACCES: ("permission denied", _WRITE_ELSEWHERE),
    errno.EPERM: ("operation not permitted", _WRITE_ELSEWHERE),
    errno.EROFS: ("read-only file system", "choose a folder on a writable disk"),
    errno.ENOSPC: ("no space left on the device", "free some space or choose a folder on another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free some space or choose a folder on another disk"),
    errno.ENOTDIR: ("a part of this path is a file, not a folder", "choose another path"),
    errno.EISDIR: ("is a folder, where a file is needed", "give a file"),
    errno.EEXIST: ("already exists", "choose another path"),
    errno.ENOENT: ("no such file or folder", "check the path"),
    errno.ENAMETOOLONG: ("file name too long", "choose a shorter path"),
    errno.EIO: ("input/output error", "check the disk"),
}
_SPACE_OR_RIGHTS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)
_FOLDERS = " (the run folder is hydra.run.dir=..., the data cache data.cache_dir=...)"


def _override_naming(path: str) -> Optional[str]:
    """The command-line `key=value` (or $GPTLAB_CACHE_DIR) that `path` comes from: its value is `path`
    or a folder above it, else (a folder made on the way to it) a path below `path`."""
    target = Path(path).expanduser().absolute()
    words = [*sys.argv[1:], f"$GPTLAB_CACHE_DIR={os.environ.get('GPTLAB_CACHE_DIR', '')}"]
    found = []
    for word in words:
        key, sep, value = word.partition("=")
        if sep and value.strip("'\"") and not key.startswith("-"):
            where = Path(value.strip("'\"")).expanduser().absolute()
            if where == target or where in target.parents:
                return f"{key.lstrip('+~')}={value}"
            if target in where.parents and target != target.parent:
                found.append(f"{key.lstrip('+~')}={value}")
    return found[0] if found else None


def os_error_message(error: OSError) -> Optional[str]:
    """One line for an OSError caused by a path or the machine (None: a bug, which keeps its traceback).

    It names the path, the override it came from when there is one, and what to do.
    """
    if error.errno not in _OS_ERRORS:
        return None
    what, todo = _OS_ERRORS[error.errno]
    if error.filename is None:  # a write to an open file: the disk, not a path
        return f"{error.strerror or what}; {todo}{_FOLDERS if error.errno in _SPACE_OR_RIGHTS else ''}"
    path = os.fsdecode(error.filename)
    source = _override_naming(path)
    if error.errno == errno.EEXIST and Path(path).exists() and not Path(path).is_dir():
        what = "is a file, where a folder is needed"
    if error.filename2 is not None:
        path = f"{path} -> {os.fsdecode(error.filename2)}"
    if source:
        return f"{path}: {what} (from {source}); {todo}"
    return f"{path}: {what}; {todo}{_FOLDERS if error.errno in _SPACE_OR_RIGHTS else ''}"


def run_entry(main: Callable[[], Any], prog: str) -> None:
    """Call a Hydra main function; user errors become `prog: error: <one line>` and exit code 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    user_wants_traceback = _TRACEBACK["wanted"] = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except GptlabError as e:
        if user_wants_traceback:
            raise
        fail(prog, e)
    except (HydraException, OmegaConfBaseException) as e:
        if user_wants_traceback:
            raise
        print(f"{prog}: error: {describe(e)}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # Hydra's own mkdir / writes (the run folder, .hydra/), and the job's
        line = os_error_message(e)
        if user_wants_traceback or line is None:
            raise
        fail(prog, line)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)


# ---- text settings --------------------------------------------------------------------------------


def text_keys(schema: type, prefix: str = "") -> Dict[str, bool]:
    """The text fields of a dataclass schema: `prefix + name` -> whether it may be null (Optional[str])."""
    hints = typing.get_type_hints(schema)
    keys = {}
    for f in dataclasses.fields(schema):
        if hints[f.name] is str:
            keys[prefix + f.name] = False
        elif hints[f.name] == Optional[str]:
            keys[prefix + f.name] = True
    return keys


def hydra_quote(text: str) -> str:
    """`text` as a quoted string of Hydra's override grammar, which reads back exactly as `text`."""
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)  # a quote, and backslashes before it
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)  # backslashes before the closing quote
    return f"'{escaped}'"


def quote_text(args: Sequence[str], keys: Mapping[str, bool]) -> List[str]:
    """Arguments with the value of each `key=value` of a text key quoted for Hydra.

    Hydra reads an unquoted value as YAML-ish: `prompt=true` would be a bool, `prompt=Hello, world` a
    sweep, `prompt=€` a parse error. A text setting takes the rest of its argument as it is instead
    (`null` still means null where the key may be null).
    """
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key in keys and not (keys[key] and value == "null"):
            arg = f"{key}={hydra_quote(value)}"
        out.append(arg)
    return out


def require(cfg: Any, key: str, what: str) -> None:
    """A mandatory key (`???` in the YAML) that was not given: one line saying what to give."""
    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    if OmegaConf.is_missing(OmegaConf.select(cfg, parent) if parent else cfg, leaf):
        raise GptlabError(f"{key} is missing: give {what}")


# ---- commands -------------------------------------------------------------------------------------


def hydra_words(module: Optional[ModuleType], args: Sequence[str]) -> List[str]:
    """A command's arguments as Hydra is to read them, by what its module declares.

    POSITIONAL: a key that a first argument without `=` (and not an option) is given to, so that
    `python -m gptlab.compare TARGET` means `compare.target=TARGET`. TEXT_KEYS (see `text_keys`): keys
    whose values are taken as they are typed (`quote_text`).
    """
    args = list(args)
    positional = getattr(module, "POSITIONAL", None)
    if positional and args and "=" not in args[0] and not args[0].startswith("-"):
        args[0] = f"{positional}={args[0]}"
    return quote_text(args, getattr(module, "TEXT_KEYS", {}))


def compose(config_name: str, overrides: Sequence[str] = ()) -> Any:
    """The config that `python -m gptlab.<config_name> OVERRIDES` composes, in this process.

    The arguments are read as that command reads them (`hydra_words`). Hydra and OmegaConf errors are
    raised as GptlabError with the one-line message.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import gptlab.config  # noqa: F401 - registers the training schema

    # the command's module registers its schema and says how it reads its arguments
    module = importlib.import_module(f"gptlab.{config_name}") if config_name != "config" else None
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF), job_name=config_name):
            return hydra_compose(config_name=config_name, overrides=hydra_words(module, overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise GptlabError(describe(e)) from None


def command(
    name: str, task: Callable[[Any], Any], argv: Optional[Sequence[str]] = None, *, config_name: Optional[str] = None
) -> Any:
    """Run `task(cfg)` as `python -m gptlab.<name>`: a Hydra app on conf/<config_name or name>.yaml.

    argv None: the command line (sys.argv), every Hydra option included; user errors are printed as
    `gptlab.<name>: error: <one line>` with exit code 2. argv a list of overrides: the same command in
    this process (through Hydra's compose API); it returns what `task` returns and raises GptlabError.
    The arguments are read as `hydra_words` says, by the POSITIONAL / TEXT_KEYS of the task's module.
    """
    config_name = config_name or name
    console.setup_logging()  # gptlab's console, unless Hydra's job logging (train, bench) replaces it
    if argv is not None:
        return task(compose(config_name, argv))

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    import gptlab.config  # noqa: F401 - registers the training schema

    prog = f"gptlab.{name}"

    @functools.wraps(task)  # Hydra names the job after the task's module (hydra.job.name: bench, ...)
    def job(cfg: Any) -> Any:
        try:
            return task(cfg)
        except (GptlabError, OSError) as e:
            # One line, before Hydra writes "Error executing job with overrides: ..." (a sweep's
            # failed job is reported when the sweep ends, after the other jobs ran). An OSError
            # that is not about a path or the machine is a bug and keeps its traceback.
            message = e if isinstance(e, GptlabError) else os_error_message(e)
            if message is not None and HydraConfig.get().mode == RunMode.RUN and not _TRACEBACK["wanted"]:
                fail(prog, message)
            raise

    sys.argv[1:] = hydra_words(sys.modules[task.__module__], sys.argv[1:])
    run_entry(hydra.main(version_base="1.3", config_path=str(CONF), config_name=config_name)(job), prog)
    return None
