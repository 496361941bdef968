"""The run's schema: one typed dataclass per section, composed into ``Config``.

The schema is registered with Hydra.

The rule for defaults: the schema gives types and structure, ``conf/`` gives every value. No field
here has a default (OmegaConf reads a field without one as MISSING, ``???``), so a value lives in
exactly one YAML file and a key that no file sets is a one-line error naming it;
tests/system/test_config_schema.py keeps it so. A package's own section lives in its torch-free
config.py (``GPTConfig`` in model/, ``OptimizerConfig`` in optim/, ``DataConfig`` in data/); the
run-wide sections (train and its profile, hardware, parallelism, tracking, paths) live here.
Nothing this module imports pulls in torch or MLflow, so a command's --help and config errors
answer at once (tests/system/test_startup.py).

``to_config`` is the one DictConfig -> dataclass conversion. Past it, code reads typed objects.
It re-validates the composed config against the schema (a ``+key=value`` override slips past
Hydra's own checks) and then checks the combinations no type can express.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gptlab.data.config import DataConfig
from gptlab.errors import GptlabError
from gptlab.model.config import GPTConfig
from gptlab.optim import OPTIMIZERS
from gptlab.optim.config import OptimizerConfig
from gptlab.records.store import check_uri

# parallelism.strategy (distributed.wrap_model reads it)
STRATEGIES = ("single", "ddp", "fsdp", "hsdp")
# strategies whose weights, gradients and optimizer state are split over ranks
SHARDED = ("fsdp", "hsdp")


@dataclass
class ProfileConfig:
    steps: Optional[List[int]]  # [first, last] step recorded (1-based, inclusive); null: off
    rows: int  # operators in the table
    oom_snapshot: bool  # CUDA: record the allocator's history so an out-of-memory step leaves one


@dataclass
class FaultsConfig:
    """Test-only fault injection (gptlab/training/faults.py; docs/testing.md): not a user option."""

    nonfinite_loss_at: List[int]  # steps (1-based) whose loss is made NaN on every rank
    spike_at: List[int]  # steps (1-based) whose loss is made 100x larger on every rank
    crash_at_step: Optional[int]  # a rank exits abruptly (os._exit) as it reaches this step
    crash_rank: int  # which rank crashes
    crash_once: bool  # true: only the first time in this run folder; false: every time


def check_profile(cfg: ProfileConfig, max_steps: int) -> None:
    """train.profile's settings: one line naming what is wrong."""
    if cfg.steps is None:
        return
    steps = list(cfg.steps)
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise GptlabError(
            f"train.profile.steps={steps}: give the first and last step to record, e.g. [5,7]"
        )
    first, last = steps
    if not 1 <= first <= last:
        raise GptlabError(f"train.profile.steps=[{first},{last}]: need 1 <= first <= last")
    if first > max_steps:
        raise GptlabError(
            f"train.profile.steps=[{first},{last}]: the run ends at step {max_steps} first"
        )
    if cfg.rows < 1:
        raise GptlabError(f"train.profile.rows={cfg.rows}: must be at least 1")


@dataclass
class TrackingConfig:
    mlflow: bool  # false: only the run folder is written
    uri: Optional[str]  # null: the local store sqlite:///<cwd>/outputs/mlflow.db
    experiment: Optional[str]  # null: "<model>-<data>"
    run_name: Optional[str]  # null: "<model>-<data>-<hardware>" (+ the job's overrides in a sweep)
    flush_every: int  # metric points buffered before one batched MLflow call
    system_metrics: bool  # CPU, memory, disk, network (+ GPU with nvidia-ml-py) as system/* metrics
    tensorboard: bool  # also write TensorBoard event files to <run folder>/tensorboard
    plots: bool  # loss.png (train/val loss and lr against tokens) at the end of the run
    log_model: bool  # a finished run's last checkpoint as the MLflow model of its run


@dataclass
class TrainConfig:
    max_steps: Optional[int]  # null: as many as train.max_tokens or train.max_flops buy
    max_tokens: Optional[int]  # a budget in tokens (with max_steps=null)
    max_flops: Optional[float]  # a budget in model FLOPs, the planner's count (max_steps=null)
    batch_size: int  # global sequences per optimizer step (all processes, all micro-steps)
    # per process per forward (int); null: the hardware's choice; auto: the largest that fits (plan)
    micro_batch_size: Any
    eval_every: int  # steps between evaluations (0: only at the end)
    eval_steps: int  # validation batches per evaluation
    eval_batch_size: Optional[int]  # null: the micro-batch size
    log_every: int
    checkpoint_every: int  # 0: only at the end
    keep_checkpoints: int
    seed: int
    resume: str  # auto (newest checkpoint in the run folder) | never | a checkpoint path
    sample_tokens: int  # text generated at the end into samples.txt (0: none)
    sample_prompt: str
    save_checkpoints: bool  # false: no checkpoints at all (benchmarks)
    profile: ProfileConfig  # torch.profiler over chosen steps (gptlab/training/profiling.py)
    # after a failure: restarts from the latest checkpoint, same run folder and MLflow run
    max_restarts: int
    on_divergence: str  # stop | rollback: a non-finite or spiking loss (docs/checkpoints.md)
    spike_factor: float  # a loss above this x its recent median is a spike (0: only non-finite)
    max_rollbacks: int  # rollbacks before a divergence stops the run
    checkpoint_async: bool  # write checkpoints in the background while training goes on
    verify_checkpoints: bool  # check each checkpoint's recorded digests when loading it
    faults: FaultsConfig  # test-only fault injection


@dataclass
class HardwareConfig:
    name: str
    device: str  # cpu | cuda
    nproc_per_node: int
    nodes: int
    precision: (
        str  # auto | fp32 | bf16 | fp16 (fp16 uses a dynamic GradScaler); gptlab.perf.fastpath
    )
    # per-process sequences per forward; null: as large as the batch allows
    micro_batch_size: Optional[int]
    # per device, bf16/fp16, for MFU; null: measure the CPU's matmul rate
    peak_tflops: Optional[float]
    tf32: bool  # TF32 tensor-core matmuls on Ampere and newer
    compile: Any  # auto | true | false: torch.compile by default on this hardware (fastpath)
    attention_backend: str  # auto | flash | efficient | math
    # CPU threads per process: auto (measured at start: all or 1, whichever multiplies faster), a
    # number, or null (torch's default)
    threads: Any
    peak_tflops_tf32: Optional[float]  # per device, fp32 matmuls as TF32 (when tf32 is on)
    peak_tflops_fp32: Optional[float]  # per device, plain fp32
    memory_gb: Optional[float]  # per device (GiB), for gptlab.plan; null: this machine's RAM on cpu
    # the price of one device for an hour (any currency): results' and plan's `cost`; null: none
    cost_per_device_hour: Optional[float]


@dataclass
class ParallelismConfig:
    name: str
    # single | ddp | fsdp | hsdp: how the model is wrapped across processes (distributed.wrap_model)
    strategy: str
    activation_checkpointing: bool
    # fsdp/hsdp: free gathered weights after forward (ZeRO-3) or keep them (ZeRO-2)
    reshard_after_forward: bool
    # tokens per chunk of LM head + loss; 0: whole; null: costs.loss_chunk's rule
    loss_chunk: Optional[int]
    compile: Any  # null: the hardware's default | auto | true | false
    timeout_s: int  # a collective waiting longer than this ends the job


@dataclass
class PathsConfig:
    outputs: str  # the root of run folders, sweeps, benchmarks and the default MLflow store
    mlflow_db: str  # the default store's SQLite file (tracking.uri: null), artifacts beside it


@dataclass
class HellaSwagConfig:
    every: int  # steps between scorings of HellaSwag's validation set (0: off); also the last step
    limit: Optional[int]  # the first this many examples; null: all 10,042
    path: Optional[str]  # a local copy of hellaswag_val.jsonl; null: downloaded once into the cache
    sha256: Optional[str]  # the file's SHA-256; null: the first download's, recorded beside it
    batch_size: int  # (context, ending) pairs per forward


@dataclass
class LoopEvalConfig:
    """Benchmarks scored in the training loop, beside the validation loss."""

    hellaswag: HellaSwagConfig


@dataclass
class HparamsSearchConfig:
    """A Bayesian search's settings (gptlab/search); a trial's job reads its study and number."""

    study_name: Optional[str]
    metric: str
    direction: Optional[str]
    n_trials: int
    n_jobs: int
    sampler: str
    seed: int
    pruner: str
    pruner_startup_trials: int
    pruner_warmup_steps: int
    max_failure_rate: float
    storage: Optional[str]
    trial: Optional[int]
    attempt: int = 0


@dataclass
class ScalingConfig:
    """An isoFLOP study's grid (-m scaling=FILE; gptlab/scaling/study.py, docs/scaling.md)."""

    name: Optional[str]  # the study's folder under <outputs>/scaling/: the same name continues it
    budgets: List[float]  # compute budgets, model FLOPs (train.max_flops of each point)
    # the family of sizes: model overrides per size ({n_layer: 2, n_embd: 64, n_head: 2, lr: 3e-3})
    sizes: List[Dict[str, Any]]
    depths: List[int]  # or a depth dial: n_layer = depth, n_embd = depth x width_per_depth
    width_per_depth: int
    head_dim: int  # n_head = n_embd / head_dim
    tokens_per_param: List[float]  # [low, high]: points whose D/N falls outside are not run
    objective: str  # best_val_loss | best_val_bpb: the loss the fit reads


@dataclass
class Config:
    model: GPTConfig
    data: DataConfig
    optimizer: OptimizerConfig
    parallelism: ParallelismConfig
    hardware: HardwareConfig
    train: TrainConfig
    tracking: TrackingConfig
    paths: PathsConfig
    eval: LoopEvalConfig
    hparams_search: HparamsSearchConfig
    scaling: ScalingConfig
    # a recipe's expected result (conf/experiment/*.yaml); see metrics.expectation_met for the keys
    expected: Dict[str, Any]

    @property
    def world_size(self) -> int:
        return self.hardware.nproc_per_node * self.hardware.nodes

    @property
    def compile(self) -> bool:
        """torch.compile: the parallelism's choice if it makes one, else the hardware's default."""
        setting = (
            self.parallelism.compile
            if self.parallelism.compile is not None
            else self.hardware.compile
        )
        if not isinstance(setting, bool):
            raise GptlabError("compile=auto: resolve it with costs.resolve_auto first")
        return setting

    @property
    def micro_batch_size(self) -> int:
        """Per-process sequences per forward: train's setting, else the hardware's, else all of it.

        ``auto`` is resolved by the planner when the run is built (costs.resolve_micro_batch).
        """
        setting = self.train.micro_batch_size
        if setting == "auto":
            raise GptlabError(
                "train.micro_batch_size=auto: resolve it with costs.resolve_micro_batch first"
            )
        per_rank = self.train.batch_size // self.world_size
        mb = setting or self.hardware.micro_batch_size or per_rank
        return min(mb, per_rank) if setting is None else mb

    @property
    def accum_steps(self) -> int:
        return self.train.batch_size // (self.micro_batch_size * self.world_size)


# Hydra 1.3 deep-copies the config repository, and with it this whole store, for every config
# group it lists (--help lists them all) and for every composition. The store is a singleton that
# hands out a copy of each node it loads, so a copy may share it: what Hydra's main branch does
# (its StructuredConfigSource reads ConfigStore.instance() on each load).
ConfigStore.__deepcopy__ = lambda self, memo: self
ConfigStore.instance().store(name="gptlab_schema", node=Config)


def _one_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else type(e).__name__
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    return f"{first} (key: {key})" if key and key not in first else first


def to_config(cfg: DictConfig, schema: type = Config) -> Any:
    """Validate a composed DictConfig and convert it to the typed schema (raises GptlabError).

    schema: Config, or a command's subclass of it that adds the command's own section
    (gptlab.bench).
    """
    try:
        # Merge a plain copy: a DictConfig node typed by Hydra would carry `+key=` extras along.
        plain = OmegaConf.to_container(cfg, resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(schema), plain)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise GptlabError(f"invalid config: {_one_line(e)}") from None
    assert isinstance(config, schema)
    if isinstance(config, Config):
        validate(config)
    return config


def _choice(key: str, value: Any, options: List[Any]) -> None:
    if not any(value is o or (isinstance(o, str) and value == o) for o in options):
        shown = ", ".join(_yaml(o) for o in options)
        raise GptlabError(f"{key}={_yaml(value)}: must be one of {shown}")


def _yaml(value: Any) -> str:
    """A value as it is written in YAML (true, null), for messages."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise GptlabError(f"{key}: {message}")


def validate(c: Config) -> None:
    """Cross-field checks; each failure names the key to change."""
    _validate_model(c.model)
    _validate_optimizer(c.optimizer)
    _validate_processes(c)
    _check(
        0.0 < c.data.val_fraction < 1.0,
        "data.val_fraction",
        f"must be in (0, 1), got {c.data.val_fraction}",
    )
    _validate_train(c)
    h = c.eval.hellaswag
    _check(h.every >= 0, "eval.hellaswag.every", "must be >= 0 (0: off)")
    _check(h.limit is None or h.limit > 0, "eval.hellaswag.limit", "must be positive or null")
    _check(h.batch_size > 0, "eval.hellaswag.batch_size", "must be positive")
    _check(c.tracking.flush_every > 0, "tracking.flush_every", "must be positive")
    check_uri(c.tracking.uri)  # a mistyped store is one line now, not a run that goes unrecorded


def _validate_model(m: GPTConfig) -> None:
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
    _choice("model.mlp", m.mlp, ["gelu", "gelu_tanh", "swiglu"])
    if m.pos_emb == "rotary":
        _check(
            (m.n_embd // m.n_head) % 2 == 0,
            "model.n_embd",
            "rotary positions need an even head size",
        )
    _check(m.ffn_dim is None or m.ffn_dim > 0, "model.ffn_dim", "must be positive")
    _check(
        m.init_from is None or bool(str(m.init_from).strip()),
        "model.init_from",
        "must name a source (gpt2, a folder, a model URI) or be null",
    )
    _choice("model.parametrization", m.parametrization, ["standard", "mup"])
    _check(
        m.mup_base_width > 0, "model.mup_base_width", f"must be positive, got {m.mup_base_width}"
    )
    _check(
        m.parametrization != "mup" or m.mup_base_width % m.n_head == 0,
        "model.mup_base_width",
        f"{m.mup_base_width} is not divisible by model.n_head={m.n_head} (muP's base head size)",
    )


def _validate_optimizer(o: OptimizerConfig) -> None:
    _check(o.lr > 0, "optimizer.lr", f"must be > 0, got {o.lr}")
    _check(0.0 <= o.min_lr_ratio <= 1.0, "optimizer.min_lr_ratio", "must be in [0, 1]")
    _check(o.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
    _check(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    _check(o.grad_clip >= 0, "optimizer.grad_clip", "must be >= 0 (0 disables clipping)")
    _check(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        "optimizer.betas",
        "must be two numbers in [0, 1)",
    )
    _choice("optimizer.name", o.name, list(OPTIMIZERS))
    _check(0.0 <= o.muon_momentum < 1.0, "optimizer.muon_momentum", "must be in [0, 1)")
    _check(o.muon_ns_steps >= 1, "optimizer.muon_ns_steps", "must be >= 1")
    _choice("optimizer.muon_ns_dtype", o.muon_ns_dtype, ["auto", "bf16", "fp32"])
    _check(
        0.0 <= o.ema_decay < 1.0, "optimizer.ema_decay", "must be in [0, 1) (0: no weight average)"
    )
    _choice("optimizer.schedule", o.schedule, ["cosine", "linear", "constant"])
    _choice("optimizer.lr_scaling", o.lr_scaling, ["none", "sqrt", "linear"])


def _validate_processes(c: Config) -> None:
    h, p = c.hardware, c.parallelism
    _choice("hardware.device", h.device, ["cpu", "cuda"])
    _choice("hardware.precision", h.precision, ["auto", "fp32", "bf16", "fp16"])
    _choice("hardware.compile", h.compile, ["auto", True, False])
    _choice("parallelism.compile", p.compile, [None, "auto", True, False])
    _choice(
        "hardware.attention_backend", h.attention_backend, ["auto", "flash", "efficient", "math"]
    )
    _check(
        not (h.device == "cuda" and h.attention_backend == "flash" and h.precision == "fp32"),
        "hardware.attention_backend",
        "flash runs only in bf16 or fp16 on a GPU: set hardware.precision=bf16, or "
        "hardware.attention_backend=auto (SDPA then picks flash where the inputs allow it)",
    )
    _check(
        h.threads in (None, "auto") or (type(h.threads) is int and h.threads >= 1),
        "hardware.threads",
        f"must be auto, a number >= 1 or null (torch's default), got {h.threads!r}",
    )
    _check(h.nproc_per_node >= 1, "hardware.nproc_per_node", "must be >= 1")
    _check(h.nodes >= 1, "hardware.nodes", "must be >= 1")
    _choice("parallelism.strategy", p.strategy, list(STRATEGIES))
    _check(
        not (p.strategy in SHARDED and h.precision == "fp16"),
        "hardware.precision",
        f"fp16 with parallelism.strategy={p.strategy}: each rank would skip steps on its own "
        f"shard's "
        "overflows; use bf16 (no loss scaling needed) or fp32",
    )
    _check(p.timeout_s > 0, "parallelism.timeout_s", "must be positive")
    _check(
        p.loss_chunk is None or p.loss_chunk >= 0,
        "parallelism.loss_chunk",
        "must be >= 0 (0: no chunks) or null",
    )


def _validate_train(c: Config) -> None:
    t = c.train
    _validate_budget(t)
    _check(t.batch_size > 0, "train.batch_size", f"must be positive, got {t.batch_size}")
    _check(
        t.batch_size % c.world_size == 0,
        "train.batch_size",
        f"{t.batch_size} sequences do not split over {c.world_size} processes",
    )
    _validate_micro_batch(c)
    if t.max_steps is not None:  # a budget's steps are checked once derived (costs.resolve_budget)
        check_profile(t.profile, t.max_steps)
    for key in (
        "eval_every",
        "eval_steps",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "sample_tokens",
    ):
        _check(getattr(t, key) >= 0, f"train.{key}", "must be >= 0")
    _check(
        t.eval_batch_size is None or t.eval_batch_size > 0,
        "train.eval_batch_size",
        "must be positive",
    )
    _check(
        t.resume in ("auto", "never") or t.resume.endswith(".pt") or "/" in t.resume,
        "train.resume",
        f"{t.resume!r} must be auto, never, or a checkpoint path",
    )
    _validate_divergence(t)


def _validate_budget(t: TrainConfig) -> None:
    """train.max_steps, or a budget in tokens or FLOPs that the steps are derived from."""
    _check(
        t.max_tokens is None or t.max_flops is None,
        "train.max_tokens",
        "and train.max_flops are both set: give one budget",
    )
    budget = t.max_tokens if t.max_tokens is not None else t.max_flops
    name = "train.max_tokens" if t.max_tokens is not None else "train.max_flops"
    _check(
        t.max_steps is not None or budget is not None,
        "train.max_steps",
        "null needs a budget: train.max_tokens=N or train.max_flops=N (or give the steps)",
    )
    if t.max_steps is not None:
        _check(t.max_steps > 0, "train.max_steps", f"must be positive, got {t.max_steps}")
    if budget is not None:
        _check(budget > 0, name, f"must be positive, got {budget}")


def _validate_divergence(t: TrainConfig) -> None:
    _check(
        t.on_divergence in ("stop", "rollback"),
        "train.on_divergence",
        f"{t.on_divergence!r} must be stop or rollback",
    )
    _check(
        t.spike_factor == 0 or t.spike_factor > 1,
        "train.spike_factor",
        f"must be 0 (off) or above 1 (a loss that many times its recent median), "
        f"got {t.spike_factor}",
    )
    _check(t.max_rollbacks >= 0, "train.max_rollbacks", "must be >= 0")
    _check(t.max_restarts >= 0, "train.max_restarts", "must be >= 0 (0: a dead rank ends the job)")


def _validate_micro_batch(c: Config) -> None:
    hw_mb = c.hardware.micro_batch_size
    if hw_mb is not None and not (_is_int(hw_mb) and hw_mb > 0):
        raise GptlabError(
            f"hardware.micro_batch_size={hw_mb}: must be a positive integer or null (as large as "
            f"the batch allows)"
        )
    setting = c.train.micro_batch_size
    if setting == "auto":
        # the planner picks a divisor of the per-process batch that fits (costs.resolve_micro_batch)
        return
    if setting is not None and not (_is_int(setting) and setting > 0):
        raise GptlabError(
            f"train.micro_batch_size={setting}: must be a positive integer, null (the hardware's "
            f"choice) "
            f"or auto (the largest that fits)"
        )
    mb = c.micro_batch_size
    _check(mb > 0, "train.micro_batch_size", "must be positive")
    _check(
        c.train.batch_size % (mb * c.world_size) == 0,
        "train.micro_batch_size",
        f"{mb} x {c.world_size} processes does not divide train.batch_size={c.train.batch_size}",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
