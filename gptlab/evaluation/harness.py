"""An lm-evaluation-harness model over gptlab's own model and tokenizer.

It takes any position scheme, MLP or vocabulary: what ``python -m gptlab.eval`` hands to
``lm_eval.simple_evaluate``.

lm_eval's TemplateLM splits each (context, continuation) into tokens as its Hugging Face model
does (trailing spaces of the context move to the continuation; the continuation is what encoding
the whole adds after the context), so both score the same tokens. Data parallel follows lm_eval's
own protocol: each rank gets a stride of the documents (rank, world_size), pads its requests to the
longest rank's, and rank 0 gathers the per-document metrics (all_gather, gather_object).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from gptlab.data import Tokenizer
from gptlab.errors import GptlabError
from gptlab.evaluation.loading import terminal
from gptlab.evaluation.scoring import score_pairs
from gptlab.model.gpt import GPT

log = logging.getLogger(__name__)


def prefix_token(tokenizer: Tokenizer) -> int:
    """What an empty context (and the first rolling window) is conditioned on.

    The beginning-of-text token, else the end-of-text one (as lm_eval's Hugging Face model chooses),
    else a newline (a char model of documents joined by line breaks).
    """
    for tid in (tokenizer.bos_id, tokenizer.eos_id):
        if tid is not None:
            return tid
    with contextlib.suppress(GptlabError):
        ids = tokenizer.encode("\n")
        if len(ids) == 1:
            return ids[0]
    raise GptlabError(
        "this tokenizer has no end-of-text token and no newline to condition an empty context on"
    )


class GptlabLM(TemplateLM):
    """lm_eval's LM interface on a GPT in eval mode (whole on every rank)."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        device: torch.device,
        batch_size: int = 8,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        rank: int = 0,
        world_size: int = 1,
        rolling_context: int = 1,
        progress: bool = True,
    ):
        super().__init__()
        self.model, self.gptlab_tokenizer = model.eval(), tokenizer
        self._device = device
        self.batch_size = batch_size
        self.autocast = autocast
        self._rank, self._world_size = rank, world_size
        self.block_size = model.config.block_size
        self.rolling_context = max(1, rolling_context)
        self.show_progress = progress and rank == 0
        self._prefix = prefix_token(tokenizer)
        self.task = "?"  # named in encoding errors

    # ---- tokens ----------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self.block_size

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kw) -> List[int]:
        try:
            return self.gptlab_tokenizer.encode(string)
        except GptlabError as e:
            raise GptlabError(
                f"{e}: the {self.gptlab_tokenizer.kind} tokenizer cannot encode this task's text "
                f"(evaluate a byte-level bpe or gpt2 model, or a task within the vocabulary)"
            ) from None

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.gptlab_tokenizer.decode(list(ids))

    # ---- requests --------------------------------------------------------------------------

    def _bar(self, total: int, what: str):
        """A progress bar on rank 0's terminal, else one line saying what is scored.

        No bar is drawn when stderr is redirected.
        """
        from tqdm import tqdm

        bar = self.show_progress and terminal()
        if self.show_progress and not bar:
            log.info(f"eval: scoring {total} {what} requests")
        return tqdm(total=total, desc=what, disable=not bar, leave=False)

    def _scores(self, pairs: List[Tuple[List[int], List[int]]], what: str):
        with self._bar(len(pairs), what) as bar:
            return score_pairs(
                self.model,
                pairs,
                self.block_size,
                self.device,
                self.batch_size,
                bucket=0,
                autocast=self.autocast,
                progress=bar.update,
            )

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(context, continuation) for _, context, continuation in requests]
        return [(-s.nats, s.greedy) for s in self._scores(pairs, "loglikelihood")]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        if requests:
            self.task = getattr(requests[0], "task_name", self.task)
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Each text's whole log-likelihood.

        Windows of the model's length, each prediction with as much context as fits, the first after
        the prefix token.
        """
        windows, owner = [], []
        for i, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for w in lm_utils.get_rolling_token_windows(
                tokens, self._prefix, self.block_size, self.rolling_context
            ):
                windows.append(lm_utils.make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, s in zip(owner, self._scores(windows, "loglikelihood_rolling")):
            totals[i] -= s.nats
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Greedy (unless the task samples) KV-cache decoding, cut at the first stop sequence."""
        out = []
        with self._bar(len(requests), "generate_until") as bar:
            for req in requests:
                context, kwargs = req.args
                out.append(self._generate(context, dict(kwargs or {})))
                bar.update(1)
        return out

    def _generate(self, context: str, kwargs: dict) -> str:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", 256))
        temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0
        ids = self.tok_encode(context) or [self._prefix]
        ids = ids[-max(1, self.block_size - max_new) :]
        start = len(ids)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(int(kwargs.pop("seed", 0)))

        eos = self.gptlab_tokenizer.eos_id

        def stop(seq: torch.Tensor) -> bool:
            new = seq[0, start:].tolist()
            return (eos is not None and new[-1] == eos) or any(
                s in self.tok_decode(new) for s in until
            )

        with self.autocast():
            seq = self.model.generate(x, max_new, temperature=temperature, generator=gen, stop=stop)
        new = seq[0, start:].tolist()
        if eos is not None and eos in new:
            new = new[: new.index(eos)]
        text = self.tok_decode(new)
        for s in until:
            text = text.split(s)[0]
        return text

    # ---- data parallel (lm_eval's protocol) ------------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        box = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, box, dst=dst)
        return box

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
