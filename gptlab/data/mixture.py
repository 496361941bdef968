"""Mixtures (``data=mixture``): several prepared datasets, each its own source, drawn by weight.

``data.sources`` maps a source's name to ``{data: CHOICE, weight: W, ...}``: CHOICE is a file of
conf/data/ (its defaults followed, as Hydra composes them) and the other keys override that file's
data keys. Each source is prepared as a dataset of its own (``prepare_data``: its folder is keyed by
its text, settings and tokenizer, never by the mixture or the weights), so a mixture that names it
again, or the same mixture with other weights, reads the shards already there. The tokenizer is one
for all: GPT-2's, the one ranks file every source names, or one built over every source's text
(``char``: the union of their characters; ``bpe``: trained on each source's training text in turn),
kept in the cache under the sources' digest. Every bad input is one line before anything is
prepared (``resolve``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gptlab.data.config import DataConfig
from gptlab.errors import GptlabError

logger = logging.getLogger(__name__)

CONF_DATA = Path(__file__).resolve().parent.parent.parent / "conf" / "data"
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a source's name is part of metric and dataset names
# the mixture's machine settings a source takes unless it sets them itself
INHERITED = ("cache_dir", "progress", "workers")


@dataclass
class Source:
    """One source of a mixture: its name, normalised weight and data config."""

    name: str
    weight: float
    cfg: DataConfig


def _choice_tree(choice: str, where: str) -> Any:
    """conf/data/<choice>.yaml with its defaults list merged in (its own keys win)."""
    path = CONF_DATA / f"{choice}.yaml"
    if not NAME.match(str(choice)) or not path.is_file():
        known = sorted(p.stem for p in CONF_DATA.glob("*.yaml") if p.stem != "mixture")
        raise GptlabError(f"{where}={choice}: no such data choice; one of {', '.join(known)}")
    node = OmegaConf.load(path)
    merged = OmegaConf.create()
    for parent in node.pop("defaults", []):
        if parent != "_self_":
            merged = OmegaConf.merge(merged, _choice_tree(parent, where))
    return OmegaConf.merge(merged, node)


def _source_config(
    name: str, spec: Any, mixture: DataConfig, block_size: Optional[int]
) -> Tuple[float, DataConfig]:
    """(raw weight, data config) of one entry of data.sources."""
    key = f"data.sources.{name}"
    if not NAME.match(name):
        raise GptlabError(f"{key}: a source's name may hold only letters, digits, '_', '-', '.'")
    if not isinstance(spec, dict) or "data" not in spec or "weight" not in spec:
        raise GptlabError(f"{key}: give {{data: CHOICE, weight: W, ...}}, got {spec!r}")
    spec = dict(spec)
    choice, weight = spec.pop("data"), spec.pop("weight")
    if choice == "mixture":
        raise GptlabError(f"{key}.data=mixture: a mixture's sources are datasets, not mixtures")
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise GptlabError(f"{key}.weight={weight}: must be a number")
    if weight < 0:
        raise GptlabError(f"{key}.weight={weight}: weights must be >= 0")
    length = spec.pop("block_size", None)
    if length is not None and block_size is not None and length != block_size:
        raise GptlabError(
            f"{key}.block_size={length}: the sources of a mixture share one sequence length, "
            f"model.block_size={block_size}"
        )
    tree = _choice_tree(str(choice), f"{key}.data")
    for k in INHERITED:
        if k not in spec:
            tree[k] = getattr(mixture, k)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(DataConfig), tree, spec)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise GptlabError(f"{key}: {str(e).strip().splitlines()[0]}") from None
    if not 0.0 < cfg.val_fraction < 1.0:
        raise GptlabError(
            f"{key}.val_fraction={cfg.val_fraction}: each source needs a validation split "
            f"(0 < val_fraction < 1): a mixture measures every source on its own"
        )
    return float(weight), cfg


def resolve(mixture: DataConfig, block_size: Optional[int] = None) -> List[Source]:
    """The mixture's sources, their weights normalised; every bad input is one line, here."""
    if not mixture.sources:
        raise GptlabError(
            "data=mixture: data.sources is empty; give "
            "'data.sources={NAME: {data: CHOICE, weight: W}, ...}'"
        )
    raw = {n: _source_config(str(n), s, mixture, block_size) for n, s in mixture.sources.items()}
    total = sum(w for w, _ in raw.values())
    if total <= 0:
        raise GptlabError("data.sources: every weight is 0; give at least one a positive weight")
    toks = {n: _tokenizer_identity(c) for n, (_, c) in raw.items()}
    if len(set(toks.values())) > 1:
        listed = ", ".join(f"{n}: {t}" for n, t in toks.items())
        raise GptlabError(
            f"data.sources: the sources have different tokenizers ({listed}); a mixture has one "
            f"tokenizer: set the same data.sources.NAME.tokenizer.* on each"
        )
    return [Source(str(n), w / total, c) for n, (w, c) in raw.items()]


def _tokenizer_identity(cfg: DataConfig) -> str:
    t = cfg.tokenizer
    if t.kind == "bpe":
        return f"bpe(path={t.path})" if t.path else f"bpe({t.vocab_size})"
    return t.kind


def weights_line(mixture: DataConfig, sources: List[Source]) -> str:
    """What the log says of the weights: as given, and normalised when they do not sum to 1."""
    given = {n: float(s["weight"]) for n, s in mixture.sources.items()}
    parts = ", ".join(f"{s.name} {s.weight:.3g}" for s in sources)
    if abs(sum(given.values()) - 1.0) > 1e-9:
        return f"mixture weights (normalised from a sum of {sum(given.values()):g}): {parts}"
    return f"mixture weights: {parts}"


# --- the shared tokenizer -----------------------------------------------------------------------


def _shared_tokenizer(
    sources: List[Source], log: Optional[Callable[[str], None]]
) -> Optional[Tuple[Any, Optional[str]]]:
    """(tokenizer, ranks text or None) built over every source, or None when not needed.

    None when each source's own is the shared one already (gpt2, or the same bpe ranks file);
    log=None: only one built before (else FileNotFoundError).
    """
    from gptlab.data import prepare as P
    from gptlab.data.sources import cache_root, open_source
    from gptlab.data.tokenizers import bpe_from_ranks, load_tokenizer

    tok = sources[0].cfg.tokenizer
    if tok.kind == "gpt2" or (tok.kind == "bpe" and tok.path):
        return None
    cache = cache_root(sources[0].cfg.cache_dir)
    opened = [open_source(s.cfg, cache) for s in sources]
    keys = sorted(P.dataset_key(s.cfg, o)[0] for s, o in zip(sources, opened))
    digest = hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16]
    path = cache / "tokens" / f"mixture-tokenizer-{tok.kind}-{digest}.json"
    if path.is_file():  # built before for these sources: the same ids, the same shards
        saved = json.loads(path.read_text())
        if saved.get("ranks") is not None:
            return bpe_from_ranks(saved["ranks"]), saved["ranks"]
        return load_tokenizer(saved["meta"]), None
    if log is None:  # only looking (the planner): nothing is built
        raise FileNotFoundError(path)
    built = _build_shared(sources, opened, log)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps({"meta": built[0].to_meta(), "ranks": built[1]}))
    tmp.replace(path)
    return built


def _build_shared(sources: List[Source], opened: List[Any], log: Callable[[str], None]):
    """The shared tokenizer for char (every source's characters) or bpe (trained on every source).

    char: every source's characters, the separators any of them needs; bpe: trained on each source's
    training text in turn.
    """
    from gptlab.data import prepare as P
    from gptlab.data.sources import CLEANERS, limited
    from gptlab.data.tokenizers import CharTokenizer, bpe_from_ranks, train_bpe

    if sources[0].cfg.tokenizer.kind == "char":
        chars: set = set()
        for s, o in zip(sources, opened):
            clean = CLEANERS[s.cfg.cleaner]
            for d in limited(o.documents(), s.cfg.max_documents):
                chars.update(clean(d) if clean else d)
        used = {s.cfg.separator for s in sources}
        specials = [t for sep, t in (("eos", "<|eos|>"), ("bos", "<|bos|>")) if sep in used]
        return CharTokenizer("".join(sorted(chars)), specials), None
    texts = (t for s, o in zip(sources, opened) for t in P._training_texts(s.cfg, o))
    ranks = train_bpe(texts, sources[0].cfg.tokenizer.vocab_size)
    log(f"trained one byte-level BPE over the mixture's {len(sources)} sources")
    return bpe_from_ranks(ranks), ranks


# --- preparing ----------------------------------------------------------------------------------


@dataclass
class Mixture:
    """A prepared mixture: its sources (names, weights, configs) and each one's prepared data."""

    sources: List[Source]
    data: List[Any]  # PreparedData, one per source

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.sources]

    @property
    def weights(self) -> List[float]:
        return [s.weight for s in self.sources]

    @property
    def tokenizer(self) -> Any:
        return self.data[0].tokenizer

    @property
    def vocab_size(self) -> int:
        return self.data[0].vocab_size

    @property
    def tokenizer_sha256(self) -> str:
        return self.data[0].tokenizer_sha256

    @property
    def root(self) -> Path:
        """The cache folder that holds every source's shards."""
        return self.data[0].root.parent

    def tokens(self, split: str) -> List[Any]:
        return [d.tokens(split) for d in self.data]

    def train_sizes(self) -> List[int]:
        return [int(d.meta["train_tokens"]) for d in self.data]


def check_sources(mixture: Mixture, block_size: int) -> None:
    """One line naming a source whose validation (or training) split is shorter than a sequence."""
    for s, d in zip(mixture.sources, mixture.data):
        for split in ("val", "train"):
            n = int(d.meta[f"{split}_tokens"])
            if n < block_size + 1:
                raise GptlabError(
                    f"data.sources.{s.name}: its {split} split has {n:,} tokens, fewer than "
                    f"model.block_size={block_size} + 1; each source needs a {split} split of at "
                    f"least one sequence (more text or a larger data.sources.{s.name}.val_fraction)"
                )


def prepare_mixture(
    mixture: DataConfig,
    log: Optional[Callable[[str], None]] = None,
    block_size: Optional[int] = None,
) -> Mixture:
    """Every source's shards (prepared once each, with the one shared tokenizer)."""
    from gptlab.data.prepare import prepare_data

    log = log or logger.info
    sources = resolve(mixture, block_size)
    log(weights_line(mixture, sources))
    shared = _shared_tokenizer(sources, log)
    data = [prepare_data(s.cfg, log=log, tokenizer=shared) for s in sources]
    shas = {s.name: d.tokenizer_sha256 for s, d in zip(sources, data)}
    if len(set(shas.values())) > 1:  # defensive: one tokenizer is what makes the ids comparable
        raise GptlabError(f"data.sources: the prepared sources' tokenizers differ ({shas})")
    return Mixture(sources, data)


def epochs_planned(tokens_per_step: int, steps: int, weight: float, train_tokens: int) -> float:
    """How many times a run of `steps` steps reads a source of `train_tokens` drawn at `weight`."""
    return tokens_per_step * steps * weight / max(train_tokens, 1)


def planned_sources(
    mixture: DataConfig, tokens_per_step: int, steps: int
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Each source's name, weight, training tokens and epochs a run of `steps` takes, with warnings.

    Tokens and epochs are None until it is prepared: nothing is prepared here. The warnings: a
    source repeated more than data.max_epochs times.
    """
    from gptlab.data.prepare import dataset_key
    from gptlab.data.sources import cache_root, open_source

    sources = resolve(mixture)
    try:
        shared = _shared_tokenizer(sources, None)
    except (FileNotFoundError, GptlabError):
        shared = None if sources[0].cfg.tokenizer.kind == "gpt2" else ()
    rows, warnings = [], []
    for s in sources:
        tokens = None
        if shared != ():
            try:
                cache = cache_root(s.cfg.cache_dir)
                key = dataset_key(s.cfg, open_source(s.cfg, cache), shared[0] if shared else None)
                meta = cache / "tokens" / key[0] / "meta.json"
                tokens = int(json.loads(meta.read_text())["train_tokens"])
            except (OSError, ValueError, KeyError, GptlabError):
                tokens = None  # not prepared yet (or its text not here): no count to plan with
        epochs = (
            None if tokens is None else epochs_planned(tokens_per_step, steps, s.weight, tokens)
        )
        rows.append({"name": s.name, "weight": s.weight, "train_tokens": tokens, "epochs": epochs})
        if epochs is not None and epochs > mixture.max_epochs:
            warnings.append(epochs_warning(s.name, epochs, mixture.max_epochs))
    return rows, warnings


def epochs_warning(name: str, epochs: float, max_epochs: float) -> str:
    return (
        f"data.sources.{name}: this run reads it {epochs:.1f} times, more than "
        f"data.max_epochs={max_epochs:g}; lower its weight or add text"
    )


def source_lines(rows: List[Dict[str, Any]]) -> List[str]:
    """The planner's lines: one per source."""
    out = []
    for r in rows:
        size = "not prepared yet" if r["train_tokens"] is None else f"{r['train_tokens']:,} tokens"
        epochs = "" if r["epochs"] is None else f", {r['epochs']:.2f} epochs in this run"
        out.append(f"  source {r['name']}: weight {r['weight']:.3f}, {size}{epochs}")
    return out
