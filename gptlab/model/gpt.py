"""A decoder-only GPT, readable top to bottom.

Token embedding + positions -> dropout -> N pre-LayerNorm blocks -> final LayerNorm -> LM head
(tied to the token embedding). Attention goes through ``F.scaled_dot_product_attention`` so that
PyTorch picks the flash / memory-efficient kernels where the hardware has them.

The module knows nothing about devices, ranks, precision or logging: those live in
``distributed.py`` and ``loop.py``.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# the section lives in torch-free model/config.py (the schema imports it); importable from here too
from gptlab.model.config import GPTConfig, padded_vocab  # noqa: F401

KVCache = List[Tuple[torch.Tensor, torch.Tensor]]


def sinusoidal_table(n_pos: int, dim: int) -> torch.Tensor:
    """Fixed sin/cos position table of shape (n_pos, dim), as in the original Transformer."""
    pos = torch.arange(n_pos, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_pos, dim)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: dim // 2])
    return table


def rotary_tables(n_pos: int, head_dim: int, base: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (n_pos, head_dim // 2) for rotary position embeddings."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(n_pos, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary in real arithmetic: (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos) per pair."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, nh, T, hs) by position-dependent angles.

    The pairs are channels (0, 1), (2, 3), ...

    Each pair is a complex number multiplied by cos + i sin: one kernel each way, 2.4x faster on the
    CPU than rotating the two halves of the pairs apart and stacking them (fwd + bwd, 16 x 4 x 64 x
    32). Under torch.compile, which generates no code for complex numbers, the same rotation in real
    arithmetic, which it fuses into one kernel.
    """
    if torch.compiler.is_compiling():
        return rotate_pairs(x, cos, sin)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).type_as(x)


def attention_scale(cfg: GPTConfig) -> Optional[float]:
    """The attention's softmax scale: None (SDPA's 1/sqrt(d_head)) in the standard form.

    Under muP sqrt(d_base) / d_head, d_base = mup_base_width / n_head, i.e. 1/d_head as the width
    grows.

    Written as (1/sqrt(d)) * sqrt(d_base/d) so that at the base width it is SDPA's own default bit
    for bit (the second factor is exactly 1.0), and training there equals the standard form's.
    """
    if cfg.parametrization != "mup":
        return None
    d = cfg.n_embd // cfg.n_head
    return (1.0 / math.sqrt(d)) * math.sqrt((cfg.mup_base_width / cfg.n_head) / d)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.scale = attention_scale(cfg)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True  # marks the residual projection for the init rule
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3 * self.n_head, self.head_dim)
        if rope is not None:
            # q and k rotated together in their (B, T, heads, hs) layout: one kernel each way for
            # both, on contiguous memory (two rotations on transposed views cost more: see
            # docs/measurements/2026-11-30-cpu-speed.md)
            cos, sin = rope
            qk = apply_rotary(qkv[:, :, : 2 * self.n_head], cos[:, None], sin[:, None])
            q, k = qk.transpose(1, 2).split(self.n_head, dim=1)
            v = qkv[:, :, 2 * self.n_head :].transpose(1, 2)
        else:
            q, k, v = qkv.transpose(1, 2).split(self.n_head, dim=1)  # (B, nh, T, hs) each
        if cache is not None:
            k = torch.cat((cache[0], k), dim=2)
            v = torch.cat((cache[1], v), dim=2)
        # A layer's cache is never empty (GPT.forward passes None for an empty cache list), so with
        # one the T new queries sit after the cached keys: one new query may see every key and needs
        # no mask; several need the causal mask shifted by the cached length.
        if cache is None:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                dropout_p=self.dropout if self.training else 0.0,
                scale=self.scale,
            )
        elif T == 1:
            y = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        else:
            past = k.size(2) - T
            mask = torch.ones(T, k.size(2), dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        # GPT-2's published weights were trained with the tanh form: gelu_tanh reproduces them
        self.approximate = "tanh" if cfg.mlp == "gelu_tanh" else "none"
        hidden = cfg.hidden_dim
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.approximate)  # erf: measured faster than tanh on CPU
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

        # recompute the block in backward instead of storing its activations (training only); set
        # through GPT.activation_checkpointing. Inside forward, so that compiling a block compiles
        # its checkpointing too: compile(checkpoint(block)), the order torch.compile supports.
        self.checkpointed = False

    def forward(self, x, rope=None, cache=None):
        if self.checkpointed and self.training and cache is None:
            return checkpoint(self._forward, x, rope, None, use_reentrant=False)
        return self._forward(x, rope, cache)

    def _forward(self, x, rope, cache):
        a, new_cache = self.attn(self.ln_1(x), rope, cache)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, new_cache


def token_nats(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, chunk: int = 4096
) -> torch.Tensor:
    """Cross-entropy of each target (N,) in fp32, `chunk` tokens at a time.

    From the final LayerNorm's output x (N, C) and the head's weight, `chunk` tokens at a time so
    that the (N, vocab) logits never exist at once.
    """
    w = weight[:vocab]
    out = []
    for s in range(0, x.shape[0], chunk):
        logits = (x[s : s + chunk] @ w.t()).float()
        picked = logits.gather(1, targets[s : s + chunk, None]).squeeze(1)
        out.append(torch.logsumexp(logits, dim=-1) - picked)
    return torch.cat(out)


class ChunkedHeadLoss(torch.autograd.Function):
    """LM head + mean cross-entropy over chunks of tokens, never holding every token's logits.

    Forward walks the tokens `chunk` at a time: logits of the chunk, their log-sum-exp, the loss,
    and at once the gradient of the summed loss (softmax - one-hot) pushed back to the head's input
    and weight; only those two gradients are kept for backward, which scales them by the incoming
    gradient / N. So the (N, vocab) fp32 logits, their log-softmax and their gradient exist for one
    chunk at a time, at no extra FLOPs (the head's backward matmuls move into forward). The result
    equals F.cross_entropy(x @ weight[:vocab].T, targets) and its gradients
    (tests/test_model_gpt.py).
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, chunk: int
    ):
        # x (N, C): the final LayerNorm's output; weight (padded vocab, C); targets (N,)
        n = x.shape[0]
        w = weight[:vocab]
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, n, chunk):
            xc, tc = x[s : s + chunk], targets[s : s + chunk]
            # (chunk, vocab); computed in the compute dtype under autocast
            logits = (xc @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            g = logits.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
            g[torch.arange(len(tc), device=g.device), tc] -= 1.0
            # the head's backward matmuls, in the forward's autocast dtype (as autograd would)
            grad_x[s : s + chunk] = g.to(w.dtype) @ w
            grad_w[:vocab] += g.t().to(xc.dtype) @ xc
        ctx.save_for_backward(grad_x, grad_w)
        ctx.n, ctx.weight_dtype = n, weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        return grad_x * scale, (grad_w * scale).to(ctx.weight_dtype), None, None, None


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError(
                "GPTConfig.vocab_size is null: set it from the tokenizer before building"
            )
        self.config = cfg
        # tokens per chunk of head + loss when training (ChunkedHeadLoss); 0: whole
        self.loss_chunk = 0
        V, C = cfg.padded_vocab_size, cfg.n_embd
        self.wte = nn.Embedding(V, C)
        if cfg.pos_emb == "learned":
            self.wpe = nn.Embedding(cfg.block_size, C)
        elif cfg.pos_emb == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.block_size, C), persistent=False)
        elif cfg.pos_emb == "rotary":
            cos, sin = rotary_tables(cfg.block_size, C // cfg.n_head, cfg.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            raise ValueError(f"unknown pos_emb {cfg.pos_emb!r}")
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(C, bias=cfg.bias)
        self.lm_head = nn.Linear(C, V, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 initialisation: N(0, 0.02), with the projections that write into the residual stream
        # scaled by 1/sqrt(2 * n_layer) so the residual's variance does not grow with depth.
        # muP: the hidden matrices' std also by 1/sqrt(m) (fan-in scaling relative to the base
        # width; the same std at m=1); the head (tied or not) and the embeddings keep theirs.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_scale", False):
                std /= math.sqrt(2 * self.config.n_layer)
            if self.config.parametrization == "mup" and module is not self.lm_head:
                std /= math.sqrt(self.config.width_mult)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters counted once (the tied LM head shares the embedding)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def activation_checkpointing(self) -> bool:
        """Whether every block recomputes its activations in backward.

        Switched on by distributed.wrap_model for large models.
        """
        return all(block.checkpointed for block in self.h)

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        for block in self.h:
            block.checkpointed = on

    def forward(
        self,
        idx: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
        per_token: bool = False,
    ):
        """idx (B, T) token ids -> logits (B, T, vocab); with targets, also the mean cross-entropy.

        ``per_token=True`` (with targets, no cache): ``(None, nats)``, each target's cross-entropy
        in fp32, shape (B, T), without holding every token's logits (what evaluation sums).

        With ``cache`` (one (k, v) per layer, possibly empty), positions continue after the cached
        tokens and the updated cache is returned as a third value.
        """
        B, T = idx.shape
        past = cache[0][0].size(2) if cache else 0
        if past + T > self.config.block_size:
            raise ValueError(
                f"sequence of {past + T} tokens exceeds block_size {self.config.block_size}"
            )
        x = self.wte(idx)  # (B, T, C)
        rope = None
        if self.config.pos_emb == "learned":
            x = x + self.wpe(torch.arange(past, past + T, device=idx.device))
        elif self.config.pos_emb == "sinusoidal":
            x = x + self.pos_table[past : past + T].to(x.dtype)
        else:
            rope = (self.rope_cos[past : past + T], self.rope_sin[past : past + T])
        x = self.drop(x)
        new_cache: KVCache = []
        for i, block in enumerate(self.h):
            x, kv = block(x, rope, cache[i] if cache else None)
            if cache is not None:
                new_cache.append(kv)
        x = self.ln_f(x)
        if self.config.parametrization == "mup":
            # muP's output multiplier 1/m on the logits, applied to the head's input: the same
            # logits, and it reaches the chunked losses too (x * 1.0 at the base width: exact)
            x = x * (1.0 / self.config.width_mult)
        # the loss only (logits are None): every target's, or their mean in chunks (training)
        if targets is not None and (per_token or self.loss_chunk) and cache is None:
            flat, w, V = x.reshape(-1, x.size(-1)), self.lm_head.weight, self.config.vocab_size
            if per_token:
                return None, token_nats(flat, w, targets.reshape(-1), V).view(targets.shape)
            return None, ChunkedHeadLoss.apply(flat, w, targets.reshape(-1), V, self.loss_chunk)
        # The head is padded for fast matmuls; the padded ids are never real tokens, so drop them.
        logits = self.lm_head(x)[..., : self.config.vocab_size]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        if cache is not None:
            return logits, loss, new_cache
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        stop: Optional[Callable[[torch.Tensor], bool]] = None,
    ) -> torch.Tensor:
        """Sample max_new_tokens after idx (B, T) using a KV cache; returns (B, T + max_new_tokens).

        stop(out): called after each new token with the sequence so far; True ends it there.

        temperature 0 means greedy decoding. When the context fills the block, the cache is rebuilt
        from the last block_size // 2 tokens (learned positions cannot extrapolate).
        """
        was_training = self.training
        self.eval()
        block = self.config.block_size
        out = idx
        cache: KVCache = []
        logits, _, cache = self(out[:, -block:], cache=cache)
        for _ in range(max_new_tokens):
            last = logits[:, -1, :].float()
            if temperature <= 0:
                nxt = last.argmax(dim=-1, keepdim=True)
            else:
                last = last / temperature
                if top_k is not None and top_k > 0:
                    kth = torch.topk(last, min(top_k, last.size(-1))).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                probs = F.softmax(last, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            out = torch.cat((out, nxt), dim=1)
            if stop is not None and stop(out):
                break
            if cache[0][0].size(2) + 1 > block:
                cache = []
                logits, _, cache = self(out[:, -(block // 2) :], cache=cache)
            else:
                logits, _, cache = self(nxt, cache=cache)
        self.train(was_training)
        return out
