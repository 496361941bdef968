"""Score continuations: the summed cross-entropy of each continuation's tokens after its context.

One pair is (context ids, continuation ids). Pairs are cropped from the left to the model's window
(the continuation is kept whole when it fits), sorted by length and batched; each batch is padded on
the right to a length rounded up to ``bucket`` tokens, so a compiled model sees few shapes, and
right padding cannot change a causal model's earlier positions. Used by the in-loop HellaSwag and by
the lm-evaluation-harness model of ``gptlab.eval``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

Pair = Tuple[Sequence[int], Sequence[int]]


@dataclass
class Score:
    nats: float  # summed cross-entropy of the continuation's tokens (minus their log-likelihood)
    tokens: int  # continuation tokens scored
    greedy: bool  # every continuation token is the model's argmax at its position


def crop(pair: Pair, block_size: int) -> Tuple[List[int], int]:
    """(model input, continuation length) for a context and continuation, cropped to block_size.

    Context + continuation without its last token, cropped from the left to block_size tokens, as
    lm-evaluation-harness crops for a causal model.
    """
    context, continuation = list(pair[0]), list(pair[1])
    if not continuation:
        raise ValueError("a continuation to score has no tokens")
    whole = (context + continuation)[-(block_size + 1) :]
    return whole[:-1], min(len(continuation), len(whole) - 1)


def batches_for(n_pairs: int, batch_size: int) -> int:
    return -(-n_pairs // max(1, batch_size))


@torch.no_grad()
def score_pairs(
    model: torch.nn.Module,
    pairs: Sequence[Pair],
    block_size: int,
    device: torch.device,
    batch_size: int = 8,
    bucket: int = 64,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    rounds: Optional[int] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> List[Score]:
    """The Score of each pair, in the pairs' order. model(x) must return (logits, ...).

    rounds: forwards to run in all (at least the batches needed): a sharded model's forwards are
    collectives, so every rank runs as many, the extra ones on a padding batch and uncounted.
    progress(n): called with the number of pairs each batch scored.
    """
    cropped = [crop(p, block_size) for p in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -len(cropped[i][0]))
    out: List[Optional[Score]] = [None] * len(pairs)
    n_batches = batches_for(len(pairs), batch_size)
    for b in range(max(n_batches, rounds or 0)):
        idx = order[b * batch_size : (b + 1) * batch_size]
        if not idx:  # padding forward for the collectives
            x = torch.zeros(
                (1, min(bucket, block_size) or block_size), dtype=torch.long, device=device
            )
            with autocast():
                model(x)
            continue
        longest = len(cropped[idx[0]][0])
        length = min(block_size, -(-longest // bucket) * bucket) if bucket else longest
        # built on the host, then one copy to the device
        x = torch.zeros((len(idx), length), dtype=torch.long, device="cpu")
        for row, i in enumerate(idx):
            ids = cropped[i][0]
            x[row, : len(ids)] = torch.tensor(ids, dtype=torch.long, device="cpu")
        with autocast():
            logits = model(x.to(device, non_blocking=True))[0]
        for row, i in enumerate(idx):
            ids, n = cropped[i]
            end = len(ids)
            picked = logits[row, end - n : end].float()
            target = torch.tensor(list(pairs[i][1])[-n:], device=picked.device)
            logp = F.log_softmax(picked, dim=-1)
            nats = -logp.gather(1, target[:, None]).sum().item()
            greedy = bool((picked.argmax(dim=-1) == target).all())
            out[i] = Score(nats, n, greedy)
        if progress is not None:
            progress(len(idx))
    return out  # type: ignore[return-value]
