"""From a search to the big run: a sweep's or search's best configuration as an experiment file.

The file is a Hydra experiment file (`# @package _global_`), for `python -m gptlab.train
experiment=<name> model.n_embd=<wide>`.

It carries what was searched (the configuration's overrides) and the parametrization it was
searched under (model.parametrization and model.mup_base_width from the best run's resolved
config: under muP the wide model must keep the search's base width); it leaves out the width,
the seed and where and how long the runs were (NOT_CARRIED), which the big run sets itself.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from gptlab.errors import GptlabError, as_user_error

# the search's width and seed, and where and how long its runs were: the big run's own to set
NOT_CARRIED = (
    "model.n_embd", "model.n_head", "model.name", "train.seed", "train.resume", "train.max_steps",
    "train.eval_every", "train.eval_steps", "train.log_every", "train.checkpoint_every",
    "train.sample_tokens", "data.path",
)  # fmt: skip
NOT_CARRIED_PREFIXES = ("hydra", "paths", "tracking", "hardware", "parallelism", "hparams_search",
                        "local", "debug", "expected")  # fmt: skip
MUP_KEYS = ("parametrization", "mup_base_width")  # read from the best run's resolved model section


def carried(key: str) -> bool:
    """Whether an override's key (group or dotted) belongs in the exported file."""
    bare = key.lstrip("+~")
    head = bare.split("/", 1)[0].split(".", 1)[0]
    return bare not in NOT_CARRIED and head not in NOT_CARRIED_PREFIXES and not key.startswith("~")


def _typed(key: str, text: str) -> Any:
    """An override's value as Hydra's grammar reads it (1e-3 a float, [a,b] a list)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with as_user_error(
        lambda e: f"compare.export_best: cannot read the override {key}={text}: {e}"
    ):
        return OverridesParser.create().parse_override(f"{key}={text}").value()


def sections(
    overrides: Dict[str, str], model: Optional[Dict[str, Any]]
) -> Tuple[List[str], Dict[str, Any], List[str]]:
    """The sections of an experiment file from a configuration's overrides and model section.

    Returns (the defaults list's group choices, the nested values, the keys left out) of a
    configuration's overrides and the best run's resolved model section.
    """
    defaults: List[str] = []
    nested: Dict[str, Any] = {}
    left_out = [k for k in overrides if not carried(k)]
    for key, text in overrides.items():
        if key in left_out:
            continue
        bare = key.lstrip("+")
        if "." not in bare:  # a group's choice: model=gpt_nano, optimizer=adamw, experiment=x
            defaults.append(f"- {text}" if bare == "experiment" else f"- override /{bare}: {text}")
            continue
        *parents, leaf = bare.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _typed(bare, text)
    for key in MUP_KEYS if model else ():
        if key in model:  # type: ignore[operator]
            nested.setdefault("model", {})[key] = model[key]  # type: ignore[index]
    # Hydra wants a defaults list's overrides after its other entries (a parent experiment)
    return sorted(defaults, key=lambda d: d.startswith("- override")), nested, left_out


def experiment_text(
    overrides: Dict[str, str], model: Optional[Dict[str, Any]], about: str, usage: str
) -> Tuple[str, List[str]]:
    """The experiment file's text (and the keys left out)."""
    from omegaconf import OmegaConf

    defaults, nested, left_out = sections(overrides, model)
    words = about + (f" Left out (the big run's own): {' '.join(left_out)}." if left_out else "")
    head = ["# @package _global_", *[f"# {line}" for line in textwrap.wrap(words, 98)]]
    head.append(f"#   {usage}")
    body = ["defaults:", *[f"  {d}" for d in defaults], "  - _self_", ""] if defaults else []
    values = OmegaConf.to_yaml(OmegaConf.create(nested)) if nested else "{}\n"
    return "\n".join(head + body) + "\n" + values, left_out


def usage(path: Path) -> str:
    """How the written file is used: experiment=<stem> from conf/experiment/."""
    if path.resolve().parent.name == "experiment":
        return f"python -m gptlab.train experiment={path.stem} model.n_embd=<wide>"
    return (
        f"copy it into conf/experiment/, then: python -m gptlab.train experiment={path.stem} "
        "model.n_embd=<wide>"
    )


def write(
    path: Path, overrides: Dict[str, str], model: Optional[Dict[str, Any]], about: str
) -> str:
    """Write the experiment file; the one line that says what was written."""
    text, _ = experiment_text(overrides, model, about, usage(path))
    if path.suffix not in (".yaml", ".yml"):
        raise GptlabError(f"compare.export_best={path}: give a .yaml path (conf/experiment/x.yaml)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return f"best configuration written to {path}: {usage(path)}"
