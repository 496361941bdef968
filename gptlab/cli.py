"""Entry-point plumbing shared by the ``python -m gptlab.*`` commands.

One grammar, one kind of error.

Every command is a Hydra app with a root config of its own under conf/ (``conf/<command>.yaml``;
train's is ``conf/config.yaml``), so every command takes the same words: ``key=value`` and
``group=option`` overrides, ``-m`` for a sweep, ``--help`` for the command and its keys, ``--cfg
job`` for the composed config. ``command`` runs one; tests and other code run the same command in
process with ``command(..., argv=[...])`` or get its config with ``compose``.

Hydra prints config errors over several lines with a hint about HYDRA_FULL_ERROR; gptlab's
contract is one line naming the key, ``gptlab.<command>: error: <message>``, and exit code 2. We ask
Hydra to re-raise (by setting HYDRA_FULL_ERROR for it) and print the condensed message ourselves. A
user who sets HYDRA_FULL_ERROR=1 still gets the full traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import functools
import importlib
import os
import re
import shutil
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
# Hydra's list of where it looked: no help to a user who mistyped a name
_SEARCH_PATH = "Config search path"


def condense(message: str) -> str:
    """Fold a multi-line Hydra / OmegaConf message into one readable line."""
    parts, options = [], []
    in_options = in_search_path = False
    for raw in str(message).splitlines():
        line = raw.strip()
        if not line or line.startswith(_SKIP):
            continue
        if line.startswith(_SEARCH_PATH) or (in_search_path and raw.startswith(("\t", "  "))):
            in_search_path = True
            continue
        in_search_path = False
        if line.startswith("Available options"):
            in_options = True
            continue
        if in_options and raw.startswith(("\t", "  ")):
            options.append(line)
            continue
        in_options = False
        parts.append(line.rstrip(".") if not line.startswith("full_key:") else f"({line})")
    text = ": ".join(p for p in parts if not p.startswith("(")) + "".join(
        f" {p}" for p in parts if p.startswith("(")
    )
    if options:
        text += f" (available: {', '.join(options)})"
    return text


def describe(error: BaseException) -> str:
    """One line for a Hydra / OmegaConf error and the errors that caused it.

    The cause names the key.
    """
    options, missing = getattr(error, "options", None), getattr(error, "missing_cfg_file", None)
    # a group's choice that does not exist: the choices, nothing else
    if options and missing and "/" in missing:
        group, _, choice = missing.rpartition("/")
        return f"{group}={choice}: no such choice; choose one of {', '.join(options)}"
    messages, seen = [], set()
    while error is not None and id(error) not in seen and len(messages) < 4:
        seen.add(id(error))
        if str(error).strip():
            messages.append(str(error))
        error = error.__cause__
    return condense("\n".join(messages))


def fail(prog: str, error: Exception) -> None:
    """Print a user error as one line and exit 2.

    SystemExit passes Hydra's job logging silently.
    """
    print(f"{prog}: error: {error}", file=sys.stderr)
    sys.exit(2)


# OSErrors from the user's paths or the machine, not from a bug: errno -> (what, what to do)
_WRITE_ELSEWHERE = "choose a folder you can write to, or fix its permissions"
_OS_ERRORS = {
    errno.EACCES: ("permission denied", _WRITE_ELSEWHERE),
    errno.EPERM: ("operation not permitted", _WRITE_ELSEWHERE),
    errno.EROFS: ("read-only file system", "choose a folder on a writable disk"),
    errno.ENOSPC: (
        "no space left on the device",
        "free some space or choose a folder on another disk",
    ),
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
    """The command-line `key=value` (or $GPTLAB_CACHE_DIR) that `path` comes from.

    Its value is `path` or a folder above it, else (a folder made on the way to it) a path below
    `path`.
    """
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
    """One line for an OSError caused by a path or the machine.

    None: a bug, which keeps its traceback.

    It names the path, the override it came from when there is one, and what to do.
    """
    if error.errno not in _OS_ERRORS:
        return None
    what, todo = _OS_ERRORS[error.errno]
    if error.filename is None:  # a write to an open file: the disk, not a path
        return (
            f"{error.strerror or what}; {todo}{_FOLDERS if error.errno in _SPACE_OR_RIGHTS else ''}"
        )
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
    except KeyboardInterrupt as e:  # the task may say where the next start resumes (gptlab.train)
        print(f"{prog}: interrupted{f'; {e}' if str(e) else ''}", file=sys.stderr)
        sys.exit(130)


# ---- text settings -------------------------------------------------------------------------------


def text_keys(schema: type, prefix: str = "") -> Dict[str, bool]:
    """The text fields of a dataclass schema, each with whether it may be null.

    `prefix + name` -> whether it may be null (Optional[str]).
    """
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
    # a quote, and backslashes before it
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    # backslashes before the closing quote
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)
    return f"'{escaped}'"


def quote_text(args: Sequence[str], keys: Mapping[str, bool]) -> List[str]:
    """Arguments with the value of each `key=value` of a text key quoted for Hydra.

    Hydra reads an unquoted value as YAML-ish: `prompt=true` would be a bool, `prompt=Hello, world`
    a sweep, `prompt=€` a parse error. A text setting takes the rest of its argument as it is
    instead (`null` still means null where the key may be null).
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


# ---- mistyped words: the key that was meant ----------------------------------------------------

# Hydra's own options (hydra._internal.utils.get_args_parser; tests/test_cli.py checks the list),
# and those of them that take a value, which argparse also reads attached (-cjob)
HYDRA_OPTIONS = (
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--cfg",
    "-c",
    "--resolve",
    "--package",
    "-p",
    "--run",
    "-r",
    "--multirun",
    "-m",
    "--shell-completion",
    "-sc",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--info",
    "-i",
)
_VALUE_SHORT = ("-c", "-p", "-i")
# the options that take the next word as their value (--info takes one only when it is a topic)
VALUE_OPTIONS = frozenset(
    ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn")
    + ("--config-dir", "-cd", "--experimental-rerun")
)
# Hydra's ValueErrors for its options
_HYDRA_USAGE = ("Only one of --run, --multirun", "Expecting one subcommand")
_CLOSE_KEY, _CLOSE_NAME = 0.75, 0.7  # difflib ratios: a whole dotted key, one part of one


def _leaves(node: Mapping[str, Any], prefix: str = "") -> List[str]:
    keys = []
    for name, value in node.items():
        if isinstance(value, Mapping) and value:
            keys += _leaves(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def config_keys(
    config_name: str, overrides: Sequence[str] = ()
) -> "tuple[List[str], Dict[str, List[str]]]":
    """Every key of the config `python -m gptlab.<config_name> OVERRIDES` composes.

    hydra.* included, and its config groups with their options. The overrides are dropped when they
    do not compose.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import gptlab.config  # noqa: F401 - registers the training schema

    if config_name != "config":  # the command's module registers its own schema
        importlib.import_module(f"gptlab.{config_name}")
    for attempt in (list(overrides), []) if overrides else ([],):
        GlobalHydra.instance().clear()  # a failed Hydra app leaves its own set
        try:
            with initialize_config_dir(
                version_base="1.3", config_dir=str(CONF), job_name=config_name
            ):
                cfg = hydra_compose(
                    config_name=config_name, overrides=attempt, return_hydra_config=True
                )
                loader = GlobalHydra.instance().config_loader()
                groups = [g for g in cfg.hydra.runtime.choices if not str(g).startswith("hydra/")]
                options = {str(g): loader.get_group_options(str(g)) for g in groups}
                return _leaves(OmegaConf.to_container(cfg, resolve=False)), options
        # another mistake among the overrides: the keys of the defaults
        except (HydraException, OmegaConfBaseException):
            if not attempt:
                raise
    return [], {}


def nearest_keys(word: str, keys: Sequence[str], groups: Mapping[str, Sequence[str]]) -> List[str]:
    """The keys or config groups that `word` most likely means.

    None, one, or the few equally likely: itself, the keys that end in it (`seed` -> `data.seed`,
    `train.seed`; a deeper one, `train.profile.steps`, only when nothing else fits), the closest
    whole key by difflib (`train.max_step`), else a key whose last part holds it as a word (`steps`
    -> `train.max_steps`) or is close to it. hydra.* keys are candidates only for a word that starts
    with hydra; a section is never offered for a key below it.
    """
    word = word.replace("-", "_")
    keys = [
        k
        for k in keys
        if (word.startswith("hydra.") or not k.startswith("hydra."))
        and not word.startswith(f"{k}.")
    ]
    if word in groups or word in keys:
        return [word]
    ending = sorted((k for k in keys if k.endswith(f".{word}")), key=len)
    # a key of a section's own section (train.profile.steps) only when nothing nearer fits
    shallow = [k for k in ending if k.count(".") <= max(1, word.count(".") + 1)]
    if shallow:
        return shallow[:3]
    # the same name in another section (train.precision -> hardware.precision; a Hydra Optuna
    # sweeper's hydra.sweeper.n_trials -> hparams_search.n_trials), outside hydra.* first
    name = word.rpartition(".")[2]
    across = sorted(
        (k for k in keys if "." in word and k.rpartition(".")[2] == name),
        key=lambda k: (k.startswith("hydra."), len(k)),
    )
    if across:
        return across[:3]
    close = difflib.get_close_matches(word, [*groups, *keys], n=1, cutoff=_CLOSE_KEY)
    if close:
        return close
    parent, _, name = word.rpartition(".")
    scope = [k for k in keys if parent and k.startswith(f"{parent}.")] or keys

    def likeness(key: str) -> "tuple[float, int]":
        return difflib.SequenceMatcher(None, name, key.rpartition(".")[2]).ratio(), -len(key)

    # heads: n_head
    holding = [k for k in scope if {name, name.rstrip("s")} & set(k.rpartition(".")[2].split("_"))]
    holding = [k for k in holding if k not in ending] or holding
    best = max(holding or scope, key=likeness, default=None)
    if best is not None and (holding or likeness(best)[0] >= _CLOSE_NAME):
        return [best]
    return ending[:3]


def _is_hydra_option(word: str) -> bool:
    name = word.split("=", 1)[0]
    if name in HYDRA_OPTIONS or (not name.startswith("--") and name[:2] in _VALUE_SHORT):
        return True
    # argparse takes a unique prefix of a long option (--multi for --multirun)
    return name.startswith("--") and len([o for o in HYDRA_OPTIONS if o.startswith(name)]) == 1


def _flags(args: Sequence[str]) -> List["tuple[str, str, str]"]:
    """The words of args that look like options but are not Hydra's: (as typed, name, value)."""
    found = []
    for i, word in enumerate(args):
        if word == "--":
            break
        if not word.startswith("-") or re.match(r"-\d", word) or _is_hydra_option(word):
            continue
        name, eq, value = word.partition("=")
        after = args[i + 1] if i + 1 < len(args) else ""
        if not eq and after and not after.startswith("-") and "=" not in after:
            value, word = after, f"{word} {after}"
        found.append((word, name.lstrip("-"), value))
    return found


def flag_error(config_name: str, command_name: str, args: Sequence[str]) -> Optional[str]:
    """One line for options that are not Hydra's, naming the key=value meant.

    `--steps 3` -> `bench.steps=3`: Hydra's argparse would print its usage instead. None when every
    option is Hydra's.
    """
    flags = _flags(args)
    if not flags:
        return None
    keys, groups = config_keys(config_name, [a for a in args if "=" in a and not a.startswith("-")])
    long_options = [o for o in HYDRA_OPTIONS if o.startswith("--")]
    fixes = []
    for typed, name, value in flags:
        hydra_option = difflib.get_close_matches(f"--{name}", long_options, n=1, cutoff=0.8)
        near = [] if hydra_option else nearest_keys(name, keys, groups)
        if hydra_option:
            fixes.append(f"{hydra_option[0]}, not {typed}")
        elif near and near[0] in groups and not value:
            fixes.append(f"{near[0]}=NAME (one of {', '.join(groups[near[0]])}), not {typed}")
        elif near:
            fixes.append(f"{' or '.join(f'{k}={value or chr(46) * 3}' for k in near)}, not {typed}")
        else:
            fixes.append(f"no key is like {typed}")
    return f"settings are key=value, not options: {'; '.join(fixes)} ({_help_line(command_name)})"


def optional_groups(config_name: str) -> List[str]:
    """The optional config groups a command's root config names in its defaults list.

    Found through the root configs it builds on (`config`); read from the YAML files, without Hydra.
    """
    import yaml

    groups: List[str] = []
    entries = yaml.safe_load((CONF / f"{config_name}.yaml").read_text()).get("defaults") or []
    for entry in entries:
        if isinstance(entry, str):
            if (CONF / f"{entry}.yaml").is_file() and entry != config_name:
                groups += optional_groups(entry)
            continue
        for key in entry:
            optional, _, name = str(key).partition("optional ")
            if not optional and name and (CONF / name).is_dir():
                groups.append(name)
    return list(dict.fromkeys(groups))


def group_options(group: str) -> List[str]:
    """A config group's options: its files under conf/<group>/, without .yaml."""
    root = CONF / group
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def group_choice_error(config_name: str, args: Sequence[str]) -> Optional[str]:
    """One line for `group=name` of an optional group where no file of the group has that name.

    The optional groups are experiment, hparams_search, local, debug. Hydra says nothing there and
    runs the default job. A sweep's comma list is checked name by name.
    """
    groups = optional_groups(config_name)
    for word in args:
        if word.startswith("-") or "=" not in word:
            continue
        key, _, value = word.partition("=")
        group = key.lstrip("+~")
        if group not in groups or value.strip() in ("", "null"):
            continue
        options = group_options(group)
        for name in (v.strip().strip("'\"") for v in value.split(",")):
            if name not in options:
                near = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
                hint = f"did you mean {group}={near[0]}? " if near else ""
                shown = ", ".join(o for o in options if not o.startswith("base/"))
                return f"{group}={name}: no such choice; {hint}choose one of {shown}"
    return None


def typo_error(error: BaseException, config_name: str, overrides: Sequence[str]) -> Optional[str]:
    """One line for an override of a key the config lacks, naming the nearest key.

    `did you mean train.max_steps=10?`, in place of Hydra's advice to add it with `+`, which only a
    free-form section (`expected`) takes. None for other errors.
    """
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    found = re.match(r"Could not override '([^']+)'", str(error))
    if not found or not isinstance(error.__cause__, (ConfigAttributeError, ConfigKeyError)):
        return None
    key = found.group(1)
    typed = next((w for w in overrides if w.partition("=")[0].lstrip("+~") == key), key)
    value = typed.partition("=")[2]
    others = [w for w in overrides if w != typed and "=" in w and not w.startswith("-")]
    near = nearest_keys(key, *config_keys(config_name, others))
    if near:
        suggestions = " or ".join(k + ("=" if value else "") + value for k in near)
        return f"{key}: no such key; did you mean {suggestions}?"
    # a section without a schema: any key goes
    if getattr(error.__cause__, "object_type", None) is dict:
        return f"{key}: no such key; to add it to the free-form section, give +{key}={value}"
    command_name = _command_name(config_name)
    return f"{key}: no such key in gptlab.{command_name}'s config ({_help_line(command_name)})"


def _command_name(config_name: str) -> str:
    return "train" if config_name == "config" else config_name  # train's root is conf/config.yaml


def _help_line(command_name: str) -> str:
    return f"python -m gptlab.{command_name} --help lists the keys"


# ---- commands ------------------------------------------------------------------------------------


def hydra_words(module: Optional[ModuleType], args: Sequence[str]) -> List[str]:
    """A command's arguments as Hydra is to read them, by what its module declares.

    POSITIONAL: a key that a first argument without `=` (and not an option) is given to, so that
    `python -m gptlab.compare TARGET` means `compare.target=TARGET`. TEXT_KEYS (see `text_keys`):
    keys whose values are taken as they are typed (`quote_text`).
    """
    args = list(args)
    positional = getattr(module, "POSITIONAL", None)
    if positional and args and "=" not in args[0] and not args[0].startswith("-"):
        args[0] = f"{positional}={args[0]}"
    return quote_text(args, getattr(module, "TEXT_KEYS", {}))


def compose(config_name: str, overrides: Sequence[str] = ()) -> Any:
    """The config that `python -m gptlab.<config_name> OVERRIDES` composes, in this process.

    The arguments are read as that command reads them (`hydra_words`). Hydra and OmegaConf errors
    are raised as GptlabError with the one-line message.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import gptlab.config  # noqa: F401 - registers the training schema

    # the command's module registers its schema and says how it reads its arguments
    module = importlib.import_module(f"gptlab.{config_name}") if config_name != "config" else None
    words = hydra_words(module, overrides)
    flags = flag_error(config_name, _command_name(config_name), words)
    flags = flags or group_choice_error(config_name, words)
    if flags:
        raise GptlabError(flags)
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF), job_name=config_name):
            return hydra_compose(config_name=config_name, overrides=words)
    except (HydraException, OmegaConfBaseException) as e:
        raise GptlabError(typo_error(e, config_name, words) or describe(e)) from None


def command(
    name: str,
    task: Callable[[Any], Any],
    argv: Optional[Sequence[str]] = None,
    *,
    config_name: Optional[str] = None,
) -> Any:
    """Run `task(cfg)` as `python -m gptlab.<name>`: a Hydra app on conf/<config_name or name>.yaml.

    argv None: the command line (sys.argv), every Hydra option included; user errors are printed as
    `gptlab.<name>: error: <one line>` with exit code 2. argv a list of overrides: the same command
    in this process (through Hydra's compose API); it returns what `task` returns and raises
    GptlabError. The arguments are read as `hydra_words` says, by the POSITIONAL / TEXT_KEYS of the
    task's module.
    """
    config_name = config_name or name
    # gptlab's console, unless Hydra's job logging (train, bench) replaces it
    console.setup_logging()
    if argv is not None:
        return task(compose(config_name, argv))

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    import gptlab.config  # noqa: F401 - registers the training schema

    prog = f"gptlab.{name}"

    # Hydra names the job after the task's module (hydra.job.name: bench, ...)
    @functools.wraps(task)
    def job(cfg: Any) -> Any:
        fresh = made_for_this_start()
        try:
            return task(cfg)
        # exit code 2: a worker reported the user's error itself (distributed.spawn)
        except SystemExit as e:
            if e.code == 2 and fresh is not None:
                remove_failed_start(fresh)
            raise
        except (GptlabError, OSError) as e:
            # One line, before Hydra writes "Error executing job with overrides: ..." (a sweep's
            # failed job is reported when the sweep ends, after the other jobs ran). An OSError
            # that is not about a path or the machine is a bug and keeps its traceback.
            message = e if isinstance(e, GptlabError) else os_error_message(e)
            if message is not None and fresh is not None:
                remove_failed_start(fresh)
            if (
                message is not None
                and HydraConfig.get().mode == RunMode.RUN
                and not _TRACEBACK["wanted"]
            ):
                fail(prog, message)
            raise

    sys.argv[1:] = hydra_words(sys.modules[task.__module__], sys.argv[1:])
    app = hydra.main(version_base="1.3", config_path=str(CONF), config_name=config_name)(job)
    run_entry(functools.partial(_start, app, config_name, name), prog)
    return None


def _start(app: Callable[[], Any], config_name: str, name: str) -> None:
    """Run a command's Hydra app, raising GptlabError for a misused command line.

    Options that are not Hydra's, mistyped keys and misused Hydra options raise GptlabError, which
    run_entry prints as one line.
    """
    from hydra.errors import ConfigCompositionException

    flags = flag_error(config_name, name, sys.argv[1:])  # before Hydra's argparse prints its usage
    flags = flags or group_choice_error(config_name, sys.argv[1:])
    if flags:
        raise GptlabError(flags)
    try:
        app()
    except ConfigCompositionException as e:
        typo = None if _TRACEBACK["wanted"] else typo_error(e, config_name, sys.argv[1:])
        if typo is None:
            raise
        raise GptlabError(typo) from None
    except ValueError as e:  # Hydra's own options combined as it does not take them (-m --cfg job)
        if _TRACEBACK["wanted"] or not str(e).startswith(_HYDRA_USAGE):
            raise
        raise GptlabError(f"{e} (python -m gptlab.{name} --hydra-help)") from None


# ---- the run folder of a start that failed -------------------------------------------------------


def _log_files() -> List[Path]:
    """The files Hydra's job logging writes (the command's .log in the run folder)."""
    import logging

    handlers = [*logging.getLogger().handlers, *logging.getLogger("gptlab").handlers]
    return [Path(h.baseFilename) for h in handlers if isinstance(h, logging.FileHandler)]


def made_for_this_start() -> Optional[Path]:
    """This job's output folder when it holds only what Hydra wrote for this start.

    That is .hydra/ and an empty log file: the folder a start that fails may remove. None for a
    folder that held anything before (a run, whose files are kept), in a process that is not the
    job's rank 0 (which decides), and for commands that write no folder (`common/read_only`).
    """
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    other_rank = os.environ.get("RANK", "0") != "0" or os.environ.get("SLURM_PROCID", "0") != "0"
    if hydra_cfg.output_subdir is None or other_rank:
        return None
    folder = Path(hydra_cfg.runtime.output_dir).resolve()
    subdir = folder / Path(hydra_cfg.output_subdir).parts[0]
    logs = [f for f in _log_files() if f.parent == folder]
    for entry in folder.iterdir():
        if entry != subdir and not (entry in logs and entry.stat().st_size == 0):
            return None
    return folder


def remove_failed_start(folder: Path) -> None:
    """Remove what a start that failed left in `folder` (made_for_this_start).

    Removes .hydra/, its log and the run folder's lock, then the folder and the empty folders above
    it up to the working directory. A folder that now holds anything else (records this start wrote)
    is kept whole.
    """
    from hydra.core.hydra_config import HydraConfig

    from gptlab.records.layout import LOCK

    ours = {Path(HydraConfig.get().output_subdir).parts[0], LOCK, *(f.name for f in _log_files())}
    entries = list(folder.iterdir()) if folder.is_dir() else []
    if any(entry.name not in ours for entry in entries):
        return
    for entry in entries:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    cwd = Path.cwd().resolve()
    for above in [folder, *folder.parents]:
        if above == cwd or above in cwd.parents or (above != folder and cwd not in above.parents):
            return  # the working directory and what lies outside it are the user's
        try:
            above.rmdir()
        except OSError:  # not empty (another run's folder), or gone already
            return
