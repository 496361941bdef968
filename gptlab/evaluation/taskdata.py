"""A local task's data, checked before lm_eval sees it.

A task YAML whose ``dataset_path`` is one of Hugging Face datasets' file builders (json, csv, text,
parquet, arrow) reads the files its ``dataset_kwargs.data_files`` names. Handed to lm_eval as they
are, a broken file fails deep inside datasets (a cut JSON line, a field the YAML names that no row
has, an empty file: ``StopIteration``), after its progress bars and loader lines. ``local_spec``
reads the YAML and its files first, and says in one line which file and row, or which field, is
wrong, or that the task has no documents.

A relative data file is read from the working folder, as datasets reads it, else from the task
YAML's own folder (how the shipped conf/eval_tasks works from anywhere); the latter is handed to
lm_eval as the YAML's config with the absolute path.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import yaml

from gptlab.errors import GptlabError

FILE_BUILDERS = ("json", "csv", "text", "parquet", "arrow")
SPLIT_KEYS = ("test_split", "validation_split", "training_split", "fewshot_split")
FIELD_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice")
Spec = Union[str, Dict[str, Any]]  # what lm_eval loads: a task's name, or its whole config
Rows = List[Tuple[str, Dict[str, Any]]]  # (where in its file: "line 6", "row 3"; the row)


class Function(str):
    """A ``!function`` of a task YAML: code, not a field or a template."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: Function(loader.construct_scalar(node)))


def read_yaml(path: Path) -> Dict[str, Any]:
    """A task YAML with its ``include:`` files merged under it (as lm_eval merges them)."""
    try:
        cfg = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 - SafeLoader + !function
    except (OSError, yaml.YAMLError) as e:
        raise GptlabError(f"{path}: not a readable task YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise GptlabError(f"{path}: a task YAML holds a mapping (task:, dataset_path:, ...)")
    includes = cfg.pop("include", None) or []
    merged: Dict[str, Any] = {}
    for name in [includes] if isinstance(includes, str) else includes:
        merged.update(read_yaml(path.parent / name))
    return {**merged, **cfg}


def yaml_of(manager: Any, name: str) -> Optional[Path]:
    """The YAML file of a single task in lm_eval's index (None: a group, a tag, a Python task).

    lm_eval 0.4.10+ keeps Entry objects, earlier versions dicts.
    """
    entry = manager.task_index.get(name)
    if isinstance(entry, dict):
        kind, path = entry.get("type"), entry.get("yaml_path")
    else:
        kind, path = str(getattr(getattr(entry, "kind", None), "name", "")), entry.yaml_path
    if str(kind).lower() not in ("task", "python_task") or not isinstance(path, (str, Path)):
        return None
    return Path(path)


def dataset_of(manager: Any, name: str) -> Optional[str]:
    """The dataset_path of a task in lm_eval's index, where the index keeps its config."""
    cfg = getattr(manager.task_index.get(name), "cfg", None)
    path = cfg.get("dataset_path") if isinstance(cfg, dict) else None
    return None if path is None else str(path)


def local_spec(manager: Any, name: str) -> Optional[Spec]:
    """What to hand lm_eval for a task whose data are local files, checked.

    None for a task whose data come from elsewhere (the Hugging Face Hub, a group).
    """
    path = yaml_of(manager, name)
    if path is None:
        return None
    cfg = read_yaml(path)
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if cfg.get("dataset_path") not in FILE_BUILDERS or not files:
        return None
    task = f"task {name!r} ({path})"
    splits, moved = resolve_files(files, path.parent, task)
    if not splits:
        return name  # URLs or patterns: datasets resolves them
    check_splits(cfg, splits, task)
    rows = {p: read_rows(p, cfg, f"task {name!r}") for ps in splits.values() for p in ps}
    used = {str(cfg[k]) for k in SPLIT_KEYS if cfg.get(k) is not None}
    scored = [rows[p] for p in splits[evaluated_split(cfg)]]
    if all(r is not None for r in scored) and not any(scored):
        listed = ", ".join(map(str, splits[evaluated_split(cfg)]))
        raise GptlabError(f"task {name!r}: {listed} holds no rows: the task has no documents")
    if "process_docs" not in cfg:
        check_fields(cfg, {p: rows[p] for s in used for p in splits[s]}, task)
    if not moved:
        return name
    if any(isinstance(v, Function) for v in cfg.values()):
        raise GptlabError(
            f"{task}: a data file relative to the YAML's folder needs a YAML without "
            f"!function; give it from the working folder or as an absolute path"
        )
    found = {s: [str(p) for p in ps] for s, ps in splits.items()}
    return {**cfg, "dataset_kwargs": {**cfg["dataset_kwargs"], "data_files": found}}


def resolve_files(files: Any, folder: Path, task: str) -> Tuple[Dict[str, List[Path]], bool]:
    """data_files as {split: [file]}, each file found, and whether any was in the YAML's folder.

    A bare file or list is datasets' "train" split; each file is found from the working folder, else
    from the YAML's folder, and the flag says whether any was found there. ({}, False) when one is a
    URL or a pattern.
    """
    by_split = files if isinstance(files, dict) else {"train": files}
    splits: Dict[str, List[Path]] = {}
    moved = False
    for split, names in by_split.items():
        splits[str(split)] = []
        for name in [names] if isinstance(names, str) else list(names):
            if re.match(r"^[a-z][a-z0-9+.-]*://", str(name)) or any(c in str(name) for c in "*?["):
                return {}, False
            here, there = Path(name).expanduser(), folder / Path(name).expanduser()
            if not here.is_file() and not there.is_file():
                looked = here if here.is_absolute() else f"{here.resolve()} and {there}"
                raise GptlabError(
                    f"{task}: data file {name} not found (looked for {looked}); "
                    f"fix dataset_kwargs.data_files"
                )
            moved = moved or not here.is_file()
            splits[str(split)].append(here if here.is_file() else there)
    return splits, moved


def check_splits(cfg: Dict[str, Any], splits: Dict[str, List[Path]], task: str) -> None:
    for key in SPLIT_KEYS:
        if cfg.get(key) is not None and str(cfg[key]) not in splits:
            raise GptlabError(
                f"{task}: {key}: {cfg[key]}, but dataset_kwargs.data_files gives "
                f"the split(s) {', '.join(splits)}"
            )
    if evaluated_split(cfg) is None:
        raise GptlabError(f"{task}: name the split to evaluate (test_split or validation_split)")


def evaluated_split(cfg: Dict[str, Any]) -> Optional[str]:
    """The split lm_eval scores: the test split, else the validation split."""
    split = cfg.get("test_split") or cfg.get("validation_split")
    return None if split is None else str(split)


def read_rows(path: Path, cfg: Dict[str, Any], task: str) -> Optional[Rows]:
    """The file's rows, as datasets' builder reads them (None: a binary format, not read here).

    A row it cannot read is one line naming the file and the line.
    """
    builder = cfg["dataset_path"]
    kwargs = cfg.get("dataset_kwargs") or {}
    if builder not in ("json", "csv", "text"):
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise GptlabError(f"{task}: {path} is not UTF-8 text (byte {e.start})") from None
    if builder == "text":
        return [(f"line {i}", {"text": line}) for i, line in enumerate(text.splitlines(), 1)]
    if builder == "csv":
        return csv_rows(text, path, kwargs.get("sep") or kwargs.get("delimiter") or ",", task)
    return json_rows(text, path, kwargs.get("field"), task)


def json_rows(text: str, path: Path, field: Optional[str], task: str) -> Rows:
    """The rows of JSON Lines, or of one JSON document holding a list of objects.

    With dataset_kwargs.field, the document is an object holding the list under that key.
    """
    if field or text.lstrip().startswith("["):
        doc = parse_json(text, 1, path, task)
        rows = doc.get(field) if field and isinstance(doc, dict) else doc
        if not isinstance(rows, list):
            what = f"an object with a list under {field!r}" if field else "a list of objects"
            raise GptlabError(f"{task}: {path} is neither JSON Lines nor {what}")
        numbered = [(f"row {i}", row) for i, row in enumerate(rows, 1)]
    else:
        lines = enumerate(text.splitlines(), 1)
        numbered = [(f"line {i}", parse_json(ln, i, path, task)) for i, ln in lines if ln.strip()]
    for place, row in numbered:
        if not isinstance(row, dict):
            raise GptlabError(f"{task}: {path} {place} is not a JSON object")
    return numbered


def parse_json(text: str, first_line: int, path: Path, task: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GptlabError(
            f"{task}: {path} line {first_line + e.lineno - 1} is not valid JSON "
            f"({e.msg}: column {e.colno}); fix or remove that line"
        ) from None


def csv_rows(text: str, path: Path, sep: str, task: str) -> Rows:
    reader = csv.reader(text.splitlines(), delimiter=sep)
    header = next(reader, None) or []
    rows = []
    for values in reader:
        if len(values) > len(header):
            raise GptlabError(
                f"{task}: {path} line {reader.line_num} has {len(values)} fields, "
                f"its header {len(header)}"
            )
        rows.append((f"line {reader.line_num}", dict(zip(header, values))))
    return rows


def fields_named(value: Any, key: str, task: str) -> List[str]:
    """The document fields a doc_to_* value reads.

    A bare name is a field (lm_eval reads it as one when the rows have it); a Jinja template's
    variables are; code and constants read none.
    """
    if not isinstance(value, str) or isinstance(value, Function):
        return []
    if re.fullmatch(r"[A-Za-z_]\w*", value):
        return [value]
    if "{{" not in value and "{%" not in value:
        return []
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment()
    try:
        parsed = env.parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise GptlabError(f"{task}: {key}: {value!r} is not a valid template ({e})") from None
    return sorted(meta.find_undeclared_variables(parsed) - set(env.globals))


def check_fields(cfg: Dict[str, Any], files: Dict[Path, Optional[Rows]], task: str) -> None:
    """Check that every field the doc_to_* keys read is in the rows.

    Named in no row, the error gives the field and what the rows hold; missing from some, the first
    row without it.
    """
    read = {p: rows for p, rows in files.items() if rows}
    for key in FIELD_KEYS:
        for field in fields_named(cfg.get(key), key, task) if read else []:
            if not any(field in row for rows in read.values() for _, row in rows):
                have = sorted({k for rows in read.values() for _, row in rows for k in row})
                raise GptlabError(
                    f"{task}: {key} reads the field {field!r}, which no row of "
                    f"{', '.join(map(str, read))} has (the rows have "
                    f"{', '.join(have)})"
                )
            for path, rows in read.items():
                lacking = next((place for place, row in rows if field not in row), None)
                if lacking is not None:
                    raise GptlabError(
                        f"{task}: {path} {lacking} has no field {field!r} ({key} reads it)"
                    )
