"""HellaSwag's validation set, scored completion-style in the training loop.

Each example is a context and four endings; the model "picks" the ending it finds likeliest after
the context: ``acc`` by the summed cross-entropy of the ending's tokens, ``acc_norm`` by their mean
per token (as build-nanogpt measures GPT-2 124M: 0.2955). The ending is scored as it would follow
the context in text: the tokens of " " + ending. lm-evaluation-harness's ``acc`` is the same
figure; its ``acc_norm`` divides by the ending's bytes instead, and differs.

The file is the official ``hellaswag_val.jsonl`` (10,042 examples), downloaded once into
``<cache>/hellaswag/`` (the data cache: data.cache_dir, $GPTLAB_CACHE_DIR, ~/.cache/gptlab), or a
local copy (eval.hellaswag.path). Its SHA-256 is checked against eval.hellaswag.sha256, or, when
that is null, against the one recorded beside the download when it was made; its structure always.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from gptlab.data.sources import cache_root, download, sha256_file
from gptlab.errors import GptlabError
from gptlab.evaluation.scoring import batches_for, score_pairs

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
FILE = "hellaswag_val.jsonl"
OFFICIAL_EXAMPLES = 10_042
ENDINGS = 4
HOW = f"pass a local copy with eval.hellaswag.path=/path/to/{FILE}"

# one rendered example: (context ids, the ids of each " " + ending, the right ending's index)
Rendered = Tuple[List[int], List[List[int]], int]


def cached_file(cache_dir: Optional[str]) -> Path:
    return cache_root(cache_dir) / "hellaswag" / FILE


def fetch(cfg: Any, cache_dir: Optional[str]) -> Path:
    """The file to read (cfg: eval.hellaswag): its path, else the download into the cache.

    The download is made once, atomically, its SHA-256 checked.
    """
    if cfg.path:
        f = Path(cfg.path).expanduser()
        if not f.is_file():
            raise GptlabError(f"eval.hellaswag.path={cfg.path}: no such file; give {FILE}'s path")
        check_sha256(f, cfg.sha256, f"eval.hellaswag.path={cfg.path}", "give the right file")
        return f.resolve()
    dest = cached_file(cache_dir)
    record = dest.with_name(dest.name + ".sha256")
    if not dest.is_file():
        record.unlink(missing_ok=True)  # a record outliving its file is of no download to come
    try:
        download(URL, dest, cfg.sha256)
    except GptlabError as e:  # its first clause says why; the advice is this key's
        raise GptlabError(f"HellaSwag: {str(e).split(';')[0]}; {HOW}") from None
    expected = cfg.sha256 or recorded_sha256(dest, record)
    check_sha256(dest, expected, f"the cached {dest}", f"delete it to download it again, or {HOW}")
    return dest


def recorded_sha256(f: Path, record: Path) -> str:
    """The SHA-256 recorded (in record) when f was downloaded; recorded now if none is."""
    if record.is_file():
        return record.read_text().strip()
    digest = sha256_file(f)
    tmp = record.with_name(record.name + f".part{os.getpid()}")
    tmp.write_text(digest + "\n")
    os.replace(tmp, record)
    return digest


def check_sha256(f: Path, expected: Optional[str], what: str, advice: str) -> None:
    if expected is not None and (got := sha256_file(f)) != expected.lower():
        raise GptlabError(f"HellaSwag: {what} has SHA-256 {got}, expected {expected}; {advice}")


def read_examples(f: Path, official: bool) -> List[Dict[str, Any]]:
    """Every example of f, each checked: a JSON object with a context, 4 endings and a label.

    official: the downloaded file, which must hold all 10,042 examples."""
    examples = []
    with open(f, encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
            except json.JSONDecodeError:
                ex = None
            if not is_example(ex):
                raise GptlabError(
                    f"HellaSwag: {f}:{n} is not an example (a JSON object with ctx, {ENDINGS} "
                    f"endings and a label 0-{ENDINGS - 1}); {HOW}"
                )
            examples.append(ex)
    if not examples or (official and len(examples) != OFFICIAL_EXAMPLES):
        raise GptlabError(
            f"HellaSwag: {f} holds {len(examples):,} examples, not {OFFICIAL_EXAMPLES:,}; {HOW}"
        )
    return examples


def is_example(ex: Any) -> bool:
    if not isinstance(ex, dict):
        return False
    ctx, endings, label = ex.get("ctx"), ex.get("endings"), ex.get("label")
    return (
        isinstance(ctx, str)
        and bool(ctx)
        and isinstance(endings, list)
        and len(endings) == ENDINGS
        and all(isinstance(e, str) for e in endings)
        and isinstance(label, int)
        and not isinstance(label, bool)
        and 0 <= label < ENDINGS
    )


def render(example: Dict[str, Any], tokenizer: Any) -> Rendered:
    """(context ids, [ids of " " + ending] x 4, label): the endings as they follow the context."""
    ctx = tokenizer.encode(example["ctx"])
    return ctx, [tokenizer.encode(" " + e) for e in example["endings"]], int(example["label"])


def load(cfg: Any, tokenizer: Any, cache_dir: Optional[str]) -> List[Rendered]:
    """eval.hellaswag's examples (the first `limit`), checked and rendered with tokenizer.

    A tokenizer that cannot encode one (a character vocabulary without its letters) is one line.
    """
    f = fetch(cfg, cache_dir)
    examples = read_examples(f, official=not cfg.path)[: cfg.limit]
    rendered = []
    for n, ex in enumerate(examples):
        try:
            rendered.append(render(ex, tokenizer))
        except GptlabError as e:
            raise GptlabError(
                f"HellaSwag: example {n} of {f}: {e}; score it with a tokenizer that encodes its "
                f"text, or set eval.hellaswag.every=0"
            ) from None
    return rendered


@torch.no_grad()
def score(
    model: torch.nn.Module,
    examples: Sequence[Rendered],
    block_size: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 16,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    sharded: bool = False,
) -> Dict[str, float]:
    """acc and acc_norm over all ranks; each rank scores a stride of the examples (rank::world).

    model: in eval mode, as the caller wants it scored (model(x) returns (logits, ...)). sharded:
    its forwards are collectives, so every rank runs as many as the rank with the most examples.
    """
    mine = examples[rank::world_size]
    pairs = [(ctx, ending) for ctx, endings, _ in mine for ending in endings]
    most = ENDINGS * -(-len(examples) // world_size)  # the pairs of the rank with the most
    rounds = batches_for(most, batch_size) if sharded else None
    scores = score_pairs(model, pairs, block_size, device, batch_size, 64, autocast, rounds)
    right = right_norm = 0  # examples picked right by summed nats, by nats per token
    for i, (_, _, label) in enumerate(mine):
        s = scores[ENDINGS * i : ENDINGS * (i + 1)]
        right += min(range(ENDINGS), key=lambda k: s[k].nats) == label
        right_norm += min(range(ENDINGS), key=lambda k: s[k].nats / s[k].tokens) == label
    counts = torch.tensor([len(mine), right, right_norm], dtype=torch.float64, device=device)
    if world_size > 1:
        torch.distributed.all_reduce(counts)
    n, right, right_norm = counts.tolist()  # every rank's
    return {"hellaswag_acc": right / n, "hellaswag_acc_norm": right_norm / n}
