"""Defaults live once: the schema gives types, conf/ gives every value, and files inherit.

- the schema (gptlab.config.Config) has no values: every leaf is MISSING;
- the default config and every option of every group compose with no key on one side only (a key
  the schema lacks fails to merge; a schema key no file sets stays MISSING) and validate;
- `--cfg job` of every option equals its snapshot in tests/golden/cfg_job/ (taken before the files
  were made to inherit); a new option needs a snapshot: GPTLAB_UPDATE_SNAPSHOTS=1 writes missing ones.
"""

import os
from pathlib import Path

import pytest
from conftest import CONF, compose_config
from omegaconf import OmegaConf

from gptlab.config import Config, to_config

SNAPSHOTS = Path(__file__).parent / "golden" / "cfg_job"
GROUPS = ["model", "data", "optimizer", "parallelism", "hardware", "experiment"]
CHOICES = [[]] + [[f"{g}={p.stem}"] for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def ids(overrides):
    return overrides[0] if overrides else "default"


def leaves(node, prefix=""):
    """(dotted key, raw value) of every leaf, MISSING ones included."""
    for key in node:
        child = node._get_node(key)
        path = f"{prefix}{key}"
        if OmegaConf.is_dict(child) and not child._is_missing():
            yield from leaves(child, path + ".")
        else:
            yield path, child._value()


def test_the_schema_holds_types_and_no_values():
    schema = OmegaConf.structured(Config)
    assert all(value == "???" for _, value in leaves(schema)), [k for k, v in leaves(schema) if v != "???"]
    # each section's own keys, MISSING until a file of its group sets them
    for section in ("model", "data", "optimizer", "parallelism", "hardware", "train", "tracking"):
        assert OmegaConf.is_missing(schema, section)


@pytest.mark.parametrize("overrides", CHOICES, ids=ids)
def test_every_choice_sets_every_schema_key_and_no_other(overrides):
    cfg = compose_config(overrides)  # a key outside the schema fails here, naming it
    assert not OmegaConf.missing_keys(cfg), f"keys no file sets: {sorted(OmegaConf.missing_keys(cfg))}"
    composed = {k for k, _ in leaves(cfg) if not k.startswith("expected.")}
    typed = OmegaConf.structured(to_config(cfg))
    assert composed == {k for k, _ in leaves(typed) if not k.startswith("expected.")}


@pytest.mark.parametrize("overrides", CHOICES, ids=ids)
def test_cfg_job_matches_its_snapshot(overrides):
    path = SNAPSHOTS / (overrides[0].replace("=", "__") + ".yaml" if overrides else "default.yaml")
    text = OmegaConf.to_yaml(compose_config(overrides))
    if not path.is_file() and os.environ.get("GPTLAB_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    assert path.is_file(), f"no snapshot for {ids(overrides)}: GPTLAB_UPDATE_SNAPSHOTS=1 writes it"
    assert text == path.read_text()


def test_a_key_no_file_sets_is_a_one_line_error():
    from gptlab.errors import GptlabError

    plain = OmegaConf.to_container(compose_config([]))
    del plain["model"]["rope_base"]  # as if conf/model/ forgot it
    with pytest.raises(GptlabError, match="rope_base") as e:
        to_config(OmegaConf.create(plain))
    assert "\n" not in str(e.value)
