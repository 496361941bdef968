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
        except GptlabError as e:
            # One line, before Hydra writes "Error executing job with overrides: ..." (a sweep's
            # failed job is reported when the sweep ends, after the other jobs ran).
            if HydraConfig.get().mode == RunMode.RUN and not _TRACEBACK["wanted"]:
                fail(prog, e)
            raise

    sys.argv[1:] = hydra_words(sys.modules[task.__module__], sys.argv[1:])
    run_entry(hydra.main(version_base="1.3", config_path=str(CONF), config_name=config_name)(job), prog)
    return None
