"""The root config: the modules' own dataclasses composed into one schema, registered with Hydra.

``to_config`` is the one DictConfig -> dataclass conversion. Past it, code reads typed objects.
It re-validates the composed config against the schema (a ``+key=value`` override slips past
Hydra's own checks) and then checks the combinations no type can express.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gptlab.data.config import DataConfig
from gptlab.distributed import HardwareConfig, ParallelismConfig
from gptlab.errors import GptlabError
from gptlab.loop import TrainConfig
from gptlab.model import GPTConfig
from gptlab.optim import OptimizerConfig
from gptlab.tracking import TrackingConfig


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # a recipe's expected result (conf/experiment/*.yaml); see metrics.expectation_met for the keys
    expected: Dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.hardware.nproc_per_node * self.hardware.nodes

    @property
    def micro_batch_size(self) -> int:
        """Per-process sequences per forward: train's override, else the hardware's, else all of it."""
        setting = self.train.micro_batch_size
        if setting == "auto":
            from gptlab.plan import auto_micro_batch  # the memory planner (imports this module)

            return auto_micro_batch(self)
        if setting is not None and (isinstance(setting, bool) or not isinstance(setting, int)):
            raise GptlabError(f"train.micro_batch_size={setting}: must be a positive integer, null or auto")
        per_rank = self.train.batch_size // self.world_size
        mb = setting or self.hardware.micro_batch_size or per_rank
        return min(mb, per_rank) if setting is None else mb

    @property
    def accum_steps(self) -> int:
        return self.train.batch_size // (self.micro_batch_size * self.world_size)


ConfigStore.instance().store(name="gptlab_schema", node=Config)


def _one_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else type(e).__name__
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    return f"{first} (key: {key})" if key and key not in first else first


def to_config(cfg: DictConfig) -> Config:
    """Validate a composed DictConfig and convert it to the typed Config (raises GptlabError)."""
    try:
        # Merge a plain copy: a DictConfig node already typed by Hydra would carry `+key=` extras along.
        plain = OmegaConf.to_container(cfg, resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise GptlabError(f"invalid config: {_one_line(e)}") from None
    assert isinstance(config, Config)
    validate(config)
    return config


def _choice(key: str, value: Any, options: List[str]) -> None:
    if value not in options:
        raise GptlabError(f"{key}={value}: must be one of {', '.join(options)}")


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise GptlabError(f"{key}: {message}")


def validate(c: Config) -> None:
    """Cross-field checks; each failure names the key to change."""
    m, t, o, h, p, d = c.model, c.train, c.optimizer, c.hardware, c.parallelism, c.data
    _check(m.n_layer > 0, "model.n_layer", f"must be positive, got {m.n_layer}")
    _check(m.n_head > 0, "model.n_head", f"must be positive, got {m.n_head}")
    _check(
        m.n_embd > 0 and m.n_embd % m.n_head == 0,
        "model.n_embd",
        f"{m.n_embd} is not divisible by model.n_head={m.n_head}",
    )
    _check(m.block_size > 0, "model.block_size", f"must be positive, got {m.block_size}")
    _check(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
    _check(m.vocab_multiple >= 1, "model.vocab_multiple", "must be >= 1")
    _choice("model.pos_emb", m.pos_emb, ["learned", "sinusoidal", "rotary"])
    _choice("model.mlp", m.mlp, ["gelu", "swiglu"])
    if m.pos_emb == "rotary":
        _check((m.n_embd // m.n_head) % 2 == 0, "model.n_embd", "rotary positions need an even head size")
    _check(m.ffn_dim is None or m.ffn_dim > 0, "model.ffn_dim", "must be positive")

    _check(o.lr > 0, "optimizer.lr", f"must be > 0, got {o.lr}")
    _check(0.0 <= o.min_lr_ratio <= 1.0, "optimizer.min_lr_ratio", "must be in [0, 1]")
    _check(o.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
    _check(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    _check(o.grad_clip >= 0, "optimizer.grad_clip", "must be >= 0 (0 disables clipping)")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimizer.betas", "must be two numbers in [0, 1)")
    _choice("optimizer.schedule", o.schedule, ["cosine", "linear", "constant"])
    _choice("optimizer.lr_scaling", o.lr_scaling, ["none", "sqrt", "linear"])

    _choice("hardware.device", h.device, ["cpu", "cuda"])
    _choice("hardware.precision", h.precision, ["fp32", "bf16", "fp16"])
    _choice("hardware.attention_backend", h.attention_backend, ["auto", "flash", "efficient", "math"])
    _check(h.nproc_per_node >= 1, "hardware.nproc_per_node", "must be >= 1")
    _check(h.nodes >= 1, "hardware.nodes", "must be >= 1")
    _choice("parallelism.strategy", p.strategy, ["single", "ddp"])
    _check(p.timeout_s > 0, "parallelism.timeout_s", "must be positive")

    _check(0.0 < d.val_fraction < 1.0, "data.val_fraction", f"must be in (0, 1), got {d.val_fraction}")

    _check(t.max_steps > 0, "train.max_steps", f"must be positive, got {t.max_steps}")
    _check(t.batch_size > 0, "train.batch_size", f"must be positive, got {t.batch_size}")
    _check(
        t.batch_size % c.world_size == 0,
        "train.batch_size",
        f"{t.batch_size} sequences do not split over {c.world_size} processes",
    )
    mb = c.micro_batch_size
    _check(mb > 0, "train.micro_batch_size", "must be positive")
    _check(
        t.batch_size % (mb * c.world_size) == 0,
        "train.micro_batch_size",
        f"{mb} x {c.world_size} processes does not divide train.batch_size={t.batch_size}",
    )
    for key in ("eval_every", "eval_steps", "log_every", "checkpoint_every", "keep_checkpoints", "sample_tokens"):
        _check(getattr(t, key) >= 0, f"train.{key}", "must be >= 0")
    _check(t.eval_batch_size is None or t.eval_batch_size > 0, "train.eval_batch_size", "must be positive")
    _check(
        t.resume in ("auto", "never") or t.resume.endswith(".pt") or "/" in t.resume,
        "train.resume",
        f"{t.resume!r} must be auto, never, or a checkpoint path",
    )
    _check(c.tracking.flush_every > 0, "tracking.flush_every", "must be positive")
