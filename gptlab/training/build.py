"""build(config) -> Run: the one place that turns typed config into objects and derived figures."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from gptlab import console
from gptlab.checkpoint import state as checkpoint
from gptlab.config import SHARDED, Config
from gptlab.console import Reporter
from gptlab.data import build_train_loader, eval_batches, prepare_data
from gptlab.data.mixture import (
    Mixture,
    check_sources,
    epochs_planned,
    epochs_warning,
    prepare_mixture,
)
from gptlab.data.mixture_loader import MixtureLoader
from gptlab.distributed import slurm
from gptlab.distributed import world as distributed
from gptlab.distributed.world import Dist
from gptlab.errors import GptlabError
from gptlab.evaluation import hellaswag
from gptlab.model import pretrained
from gptlab.model.gpt import GPT, GPTConfig
from gptlab.model.inference import generate_text
from gptlab.optim.factory import build_optimizer
from gptlab.optim.schedule import lr_at, scaled_lr
from gptlab.perf import fastpath, runtime
from gptlab.perf.costs import (
    device_peak,
    flops_for,
    loss_chunk,
    resolve_auto,
    resolve_budget,
    resolve_micro_batch,
)
from gptlab.perf.measure import expectation_met
from gptlab.records import identity, layout, lineage, runfolder
from gptlab.records.layout import last_logged_step
from gptlab.records.store import flatten, local_uri
from gptlab.records.tracker import NullTracker, Tracker
from gptlab.registry import serving
from gptlab.search import trial as search_trial
from gptlab.training import profiling
from gptlab.training.run import Run

log = logging.getLogger(__name__)

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_factory(
    device_type: str, precision: str, attention_backend: str = "auto"
) -> Callable[[], contextlib.AbstractContextManager]:
    """The context every forward runs in: the hardware's autocast precision and SDPA kernels."""
    dtype = _AUTOCAST[precision]

    def context() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if dtype is not None:
            stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype))
        stack.enter_context(runtime.attention_context(attention_backend))
        return stack

    return context


def record_expectation(run: "Run", expected: Dict[str, Any], results: Dict[str, Any]) -> None:
    """Records whether the run met its recipe's `expected:` block, in results and as an MLflow tag.

    For a recipe with an `expected:` block only.
    """
    met = expectation_met(expected, results) if expected else None
    if met is not None:
        results["expected_met"] = met
        run.tracker.set_tag("expected_met", str(met).lower())


def build(
    cfg: Config, run_dir: Path, resolved: Dict[str, Any], auto_steps: Optional[int] = None
) -> Run:
    """Build every object of a training run from a validated Config.

    This process's place in the job, the data, the model and its wrapping, the optimizer, the
    loaders, the resumed state, the records. auto_steps: the run length compile=auto decides for
    (default train.max_steps; a benchmark passes the run it stands for)."""
    d = distributed.setup(cfg.hardware, cfg.parallelism)
    cfg, source = pretrained_source(cfg, d, run_dir)  # model.init_from's shape, before the data
    cfg, choices = resolve_auto(cfg, auto_steps)  # precision and compile: auto's choices
    cfg = resolve_micro_batch(cfg)  # train.micro_batch_size=auto: the planner's choice, once
    console.for_rank(d.rank)
    # a search trial's line to its study: a bad link, or a job superseded by a later launch of its
    # trial, stops before the folder is claimed or any training
    trial = search_trial.open_link(cfg.hparams_search, d.is_main)
    run_dir = shared_run_dir(run_dir)
    resume_from, loaded = shared_claim(
        run_dir, cfg.train.resume, resolved, d.is_main, log.info, None, cfg.train.verify_checkpoints
    )
    data, train_tokens, val_tokens = build_data(cfg, d)
    hellaswag = build_hellaswag(cfg, d, data.tokenizer)  # a run that cannot have it stops here
    if source is not None:
        pretrained.check_vocab(source, data.tokenizer, data.vocab_size)
    mcfg = dataclasses.replace(cfg.model, vocab_size=data.vocab_size)
    # a resumed run's checkpoint holds its weights: the source's are not read again
    raw_model, model = build_model(cfg, mcfg, d, source if resume_from is None else None)
    loader, val, val_sets = build_loaders(cfg, d, train_tokens, val_tokens, data)
    run = new_run(cfg, d, mcfg, data, raw_model, model, loader, val, run_dir, resolved)
    run.val_sets = val_sets
    if hellaswag is not None:
        run.hellaswag, run.hellaswag_config = hellaswag, cfg.eval.hellaswag
        run.derived["hellaswag_examples"] = len(hellaswag)
    run.derived.update(
        {
            "data_dir": str(data.root),
            "train_tokens": _count(train_tokens),
            "val_tokens": _count(val_tokens),
            "tokenizer_sha256": data.tokenizer_sha256,
            "vocab_size": data.vocab_size,
            **fastpath.derived(choices),
            **init_from_figures(cfg.model),
        }
    )
    mlflow_run_id = resume(run, resume_from, loaded)
    run.trial = trial
    if d.is_main:
        run.tracker = open_tracker(cfg, run, resolved, mlflow_run_id)
        slurm.write_job_record(run_dir)
        datasets = describe_data(cfg, data)  # the shards' side files only
        lineage.write(run_dir, datasets)
        run.tracker.log_inputs(datasets)
    prof = cfg.train.profile
    if prof.steps or (prof.oom_snapshot and d.device.type == "cuda"):
        run.profiler = profiling.StepProfiler(
            prof, run_dir, d.device, d.rank, run.tracker, d.is_main
        )
    run.summary = summary_line(cfg, run.derived) + mixture_summary(cfg, data)
    return run


def new_run(
    cfg: Config,
    d: Dist,
    mcfg: GPTConfig,
    data: Any,
    raw_model: GPT,
    model: nn.Module,
    loader: Any,
    val: List[Any],
    run_dir: Path,
    resolved: Dict[str, Any],
) -> Run:
    """The Run of the built parts, with optimizer, schedule and figures derived from the config."""
    peak_lr = scaled_lr(cfg.optimizer, d.world_size)
    fpt, hfpt = flops_for(mcfg, data.vocab_size, cfg.parallelism.activation_checkpointing)
    # the loop's tokens/s are the whole job's, so MFU compares with the whole job's peak
    peak = device_peak(cfg.hardware)[0] * d.world_size
    hw, opt = cfg.hardware, cfg.optimizer
    run = Run(
        train=cfg.train,
        dist=d,
        model=model,
        raw_model=raw_model,
        optimizer=build_optimizer(raw_model, opt, peak_lr, d.device.type),
        scaler=torch.amp.GradScaler(d.device.type, enabled=hw.precision == "fp16"),
        lr_at=lambda s: lr_at(s, peak_lr, opt, cfg.train.max_steps),
        grad_clip=opt.grad_clip,
        train_loader=loader,
        val_batches=val,
        tokenizer=data.tokenizer,
        token_bytes=torch.as_tensor(data.tokenizer.token_bytes(), device=d.device),
        tracker=NullTracker(),
        reporter=Reporter(d.is_main, cfg.train.max_steps),
        autocast=autocast_factory(d.device.type, hw.precision, hw.attention_backend),
        block_size=cfg.model.block_size,
        num_params=raw_model.num_params(),
        flops_per_token=fpt,
        peak_flops=peak,
        run_dir=run_dir,
        checkpoint_dir=run_dir / layout.CHECKPOINTS,
        resolved_config=resolved,
        model_config=dataclasses.asdict(mcfg),
    )
    run.derived = {
        "params": run.num_params,
        # N as Kaplan et al. count it: without the token and position embeddings
        "params_non_embedding": run.num_params - embedding_params(raw_model),
        "world_size": d.world_size,
        "micro_batch_size": cfg.micro_batch_size,
        "accum_steps": loader.accum_steps,
        "tokens_per_step": cfg.train.batch_size * cfg.model.block_size,
        "peak_lr": peak_lr,
        "flops_per_token": fpt,
        "hardware_flops_per_token": hfpt,
        "peak_flops": peak,
    }
    return run


def budgeted(cfg: Config) -> Config:
    """The config with train.max_steps set from train.max_tokens or train.max_flops, if given."""
    return resolve_budget(cfg)[0]


def embedding_params(model: GPT) -> int:
    """The token embedding's (a tied head's too) and a learned position embedding's parameters."""
    wpe = getattr(model, "wpe", None)
    return model.wte.weight.numel() + (wpe.weight.numel() if isinstance(wpe, nn.Embedding) else 0)


def budget_text(t: Any) -> str:
    """' (train.max_flops=1e+15)' when the steps come from a budget, else ''."""
    if t.max_flops is not None:
        return f" (train.max_flops={t.max_flops:.4g})"
    return f" (train.max_tokens={t.max_tokens:,})" if t.max_tokens is not None else ""


def summary_line(cfg: Config, derived: Dict[str, Any]) -> str:
    """The run in one line, printed when the loop starts."""
    x = derived
    precision, compiled = fastpath.summary(x, cfg.hardware.precision)
    return (
        f"{cfg.model.name}: {x['params'] / 1e6:.2f}M params | data {cfg.data.name} "
        f"({x['train_tokens']:,} train tokens, vocab {x['vocab_size']}) | {cfg.hardware.name} "
        f"x{x['world_size']} {precision}{_sharding(cfg, x['world_size'])}{compiled} | "
        f"batch {cfg.train.batch_size} = {x['micro_batch_size']} x "
        f"{x['accum_steps']} accum x {x['world_size']} ranks of {cfg.model.block_size} tokens | "
        f"peak lr {x['peak_lr']:g} | {cfg.train.max_steps} steps{budget_text(cfg.train)}"
    )


def _sharding(cfg: Config, world: int) -> str:
    """' | fsdp mesh 2 (shard)' for a sharded run: how its ranks split the model."""
    strategy = cfg.parallelism.strategy
    if strategy not in SHARDED:
        return ""
    shape = distributed.mesh_shape(strategy, world, cfg.hardware.nodes)
    names = "replicate x shard" if len(shape) == 2 else "shard"
    return f" | {strategy} mesh {'x'.join(map(str, shape))} ({names})"


def build_loaders(
    cfg: Config, d: Dist, train_tokens: Any, val_tokens: Any, data: Any = None
) -> Tuple[Any, List[Any], Dict[str, Tuple[float, List[Any]]]]:
    """This rank's training loader, its fixed validation batches, and a mixture's per source.

    A mixture's per source is {name: (weight, batches)}; {} for one dataset.
    """
    if isinstance(data, Mixture):
        return mixture_loaders(cfg, d, data, train_tokens, val_tokens)
    mb, T, t = cfg.micro_batch_size, cfg.model.block_size, cfg.train
    loader = build_train_loader(
        train_tokens,
        T,
        t.batch_size,
        mb,
        d.rank,
        d.world_size,
        t.seed,
        sampling=cfg.data.sampling,
        pin_memory=d.device.type == "cuda",
    )
    val = eval_batches(
        val_tokens, T, t.eval_batch_size or mb, t.eval_steps, t.seed, d.rank, d.world_size
    )
    return loader, val, {}


def mixture_loaders(
    cfg: Config, d: Dist, data: Mixture, train_tokens: List[Any], val_tokens: List[Any]
) -> Tuple[Any, List[Any], Dict[str, Tuple[float, List[Any]]]]:
    """A mixture's loader (its sources drawn by weight) and each source's validation batches."""
    mb, T, t = cfg.micro_batch_size, cfg.model.block_size, cfg.train
    samplings = [s.cfg.sampling for s in data.sources]
    loader = MixtureLoader(
        train_tokens,
        data.names,
        data.weights,
        samplings,
        T,
        t.batch_size,
        mb,
        d.rank,
        d.world_size,
        t.seed,
        d.device.type == "cuda",
    )
    sets = {
        s.name: (
            s.weight,
            eval_batches(v, T, t.eval_batch_size or mb, t.eval_steps, t.seed, d.rank, d.world_size),
        )
        for s, v in zip(data.sources, val_tokens)
    }
    return loader, [], sets


def _count(tokens: Any) -> int:
    """Tokens of a split: one dataset's, or the sum of a mixture's sources'."""
    return sum(len(t) for t in tokens) if isinstance(tokens, list) else len(tokens)


def describe_data(cfg: Config, data: Any) -> List[Dict[str, Any]]:
    """The run's MLflow dataset inputs: one per split, or per source and split of a mixture."""
    if isinstance(data, Mixture):
        return lineage.describe_mixture(data)
    return lineage.describe(data.root, data.meta, cfg.data)


def mixture_summary(cfg: Config, data: Any) -> str:
    """' | mixture: a 2.1M tok x0.70 (1.3 epochs), ...' on the summary line; '' for one dataset."""
    if not isinstance(data, Mixture):
        return ""
    step_tokens, steps = cfg.train.batch_size * cfg.model.block_size, cfg.train.max_steps
    parts = []
    for s, n in zip(data.sources, data.train_sizes()):
        e = epochs_planned(step_tokens, steps, s.weight, n)
        parts.append(f"{s.name} {n:,} tok x{s.weight:.2f} ({e:.2f} epochs)")
        if e > cfg.data.max_epochs:
            log.warning(epochs_warning(s.name, e, cfg.data.max_epochs))
    return " | mixture: " + ", ".join(parts)


def shared_run_dir(run_dir: Path) -> Path:
    """Rank 0's run folder, on every rank.

    Under torchrun each rank's Hydra picked its own timestamp.
    """
    own_dir, shared = Path(run_dir), Path(distributed.broadcast_object(str(run_dir)))
    if (
        own_dir != shared
        and own_dir.is_dir()
        and {p.name for p in own_dir.iterdir()} <= {layout.HYDRA, layout.LOG}
    ):
        shutil.rmtree(own_dir, ignore_errors=True)  # this rank's unused, empty Hydra folder
    return shared


def build_data(cfg: Config, d: Dist):
    """(prepared data, train tokens, val tokens), the token files prepared by rank 0.

    Rank 0 prepares the token files, the others read them.
    """
    T = cfg.model.block_size
    if cfg.data.sources:
        mixed = main_first(d, lambda: prepare_mixture(cfg.data, log.info, T))
        check_sources(mixed, T)
        return mixed, mixed.tokens("train"), mixed.tokens("val")
    data = main_first(d, lambda: prepare_data(cfg.data, log=log.info))
    train_tokens, val_tokens = data.tokens("train"), data.tokens("val")
    if min(len(train_tokens), len(val_tokens)) < T + 1:
        raise GptlabError(
            f"model.block_size={T} is longer than the data allows ({len(val_tokens):,} validation "
            f"tokens)"
        )
    return data, train_tokens, val_tokens


def main_first(d: Dist, make: Callable[[], Any]) -> Any:
    """make() on rank 0, then on the other ranks: what rank 0 downloads or prepares, they read."""
    if d.is_main:
        made = make()
    if d.world_size > 1:
        torch.distributed.barrier()
    return made if d.is_main else make()


def build_hellaswag(cfg: Config, d: Dist, tokenizer: Any) -> Optional[List[Any]]:
    """eval.hellaswag's examples rendered with the run's tokenizer, on every rank; None when off.

    Rank 0 downloads the file first.
    """
    h = cfg.eval.hellaswag
    if not h.every:
        return None
    examples = main_first(d, lambda: hellaswag.load(h, tokenizer, cfg.data.cache_dir))
    log.info(f"HellaSwag: {len(examples):,} examples, scored every {h.every} steps")
    return examples


def build_model(
    cfg: Config, mcfg: GPTConfig, d: Dist, source: Optional[pretrained.Source] = None
) -> Tuple[GPT, nn.Module]:
    """(the plain model, the model as trained: checkpointing -> compile -> data-parallel wrapper).

    source: model.init_from's weights, loaded whole on every rank before the model is wrapped, so
    that fsdp shards the loaded weights as it shards initialised ones.
    """
    seed_everything(cfg.train.seed)  # identical initialisation on every rank
    raw_model = GPT(mcfg).to(d.device)
    if source is not None:
        start = time.perf_counter()
        pretrained.load_into(raw_model, source)
        log.info(
            f"model.init_from={source.spec}: weights loaded in {time.perf_counter() - start:.1f} s"
        )
    if source is not None and source.temporary is not None:
        shutil.rmtree(source.temporary, ignore_errors=True)
    # training's head + loss in chunks
    raw_model.loss_chunk = loss_chunk(cfg.parallelism, mcfg, mcfg.vocab_size)
    seed_everything(cfg.train.seed + d.rank)  # then per-rank streams
    return raw_model, distributed.wrap_model(
        raw_model, d, cfg.parallelism, cfg.hardware, cfg.compile
    )


def pretrained_source(
    cfg: Config, d: Dist, run_dir: Path
) -> Tuple[Config, Optional[pretrained.Source]]:
    """model.init_from: the source found, its shape made the model's and its tokenizer checked.

    Rank 0 downloads first. This happens before the data is prepared or anything allocated; (cfg,
    None) without one. Only command-line model.* overrides (Hydra's overrides.yaml) are checked
    against it.
    """
    spec = cfg.model.init_from
    if spec is None:
        return cfg, None
    source = main_first(d, lambda: locate_source(cfg, spec))
    pretrained.check_tokenizer(source, cfg.data.tokenizer.kind)
    given = [o.lstrip("+~").split("=")[0] for o in layout.read_overrides(run_dir)]
    explicit = {k.removeprefix("model.") for k in given if k.startswith("model.")}
    model = pretrained.shaped(cfg.model, source, explicit)
    log.info(f"model.init_from={spec}: {source.kind} {source.path}")
    return dataclasses.replace(cfg, model=model), source


def init_from_figures(m: GPTConfig) -> Dict[str, Any]:
    """derived.json's record of the source and the shape it gave.

    config_resolved.yaml keeps the composed model keys, which the source's replaced.
    """
    if m.init_from is None:
        return {}
    shape = (
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "ffn_dim",
        "pos_emb",
        "mlp",
        "tie_weights",
    )
    return {"init_from": m.init_from, "model_shape": {k: getattr(m, k) for k in shape}}


def locate_source(cfg: Config, spec: str) -> pretrained.Source:
    """model.init_from's source, read from where it is.

    The Hub's cache for a GPT-2 name, a download from the run's MLflow store for a model URI, else a
    local folder or file.
    """
    if spec in pretrained.HUB:
        return pretrained.read_source(spec, pretrained.hub_folder(spec))
    if serving.is_model_uri(spec):
        store = cfg.tracking.uri or local_uri(Path(cfg.paths.mlflow_db))
        temporary = Path(tempfile.mkdtemp(prefix="gptlab-init-from-"))
        try:
            source = pretrained.read_source(spec, serving.download(store, spec, temporary))
        except BaseException as e:  # nothing read: the download goes, and the error is raised
            shutil.rmtree(temporary, ignore_errors=True)
            if isinstance(e, GptlabError):  # sample's wording, in train's keys and on one line
                text = " ".join(str(e).replace("tracking_uri=", "tracking.uri=").split())
                raise GptlabError(f"model.init_from={spec}: {text}") from None
            raise
        source.temporary = temporary
        return source
    return pretrained.read_source(spec, Path(spec).expanduser())


def resume(
    run: Run, path: Optional[Path], loaded: Optional[checkpoint.TrainingState]
) -> Optional[str]:
    """Restore the claimed checkpoint into the run (when there is one); its MLflow run id.

    loaded: the state rank 0 read while claiming the folder (the other ranks read it here)."""
    if path is None:
        return None
    path, state = shared_restore(
        run.run_dir,
        run.train.resume,
        run.resolved_config,
        run.dist.is_main,
        log.info,
        run.stateful(),
        (path, loaded),
        verify=run.train.verify_checkpoints,
    )
    log.info(f"resuming from {path} (step {state.step})")
    run.resumed = state.progress()  # the loop's Progress.load_state_dict reads it
    # steps logged after the checkpoint (a crash) are not logged again: a resume recomputes them
    run.logged_until_step = last_logged_step(run.run_dir)
    return state.mlflow_run_id


def open_tracker(
    cfg: Config, run: Run, resolved: Dict[str, Any], mlflow_run_id: Optional[str]
) -> Tracker:
    """Rank 0's records: the run folder and MLflow.

    The config and derived figures go in as params.
    """
    params = {**flatten(resolved), **{f"derived.{k}": v for k, v in run.derived.items()}}
    ident = identity.identify(resolved, run.run_dir, identity.this_process())
    store = local_uri(Path(cfg.paths.mlflow_db))
    return Tracker(run.run_dir, cfg.tracking, store, ident, params, mlflow_run_id)


def write_sample(run: Run) -> Optional[str]:
    """Generate train.sample_tokens of text from the trained model into samples.txt (rank 0).

    A sharded model generates on every rank in step (each forward is a collective; the same prompt
    and seeded generator give every rank the same tokens); rank 0 writes them."""
    sharded = distributed.is_sharded(run.raw_model)
    if run.train.sample_tokens <= 0 or not (run.dist.is_main or sharded):
        return None
    with run.autocast(), run.evaluated_weights():
        text = generate_text(
            run.raw_model,
            run.tokenizer,
            run.train.sample_prompt,
            run.train.sample_tokens,
            temperature=0.8,
            top_k=200,
            seed=run.train.seed,
        )[0]
    if not run.dist.is_main:
        return None
    path = run.run_dir / layout.SAMPLES
    path.write_text(text)
    run.tracker.log_artifact(path)
    return text


def log_model(config: Any, tracker: Any, run_dir: Path, results: Dict[str, Any]) -> None:
    """tracking.log_model: the finished run's last checkpoint as the run's MLflow model.

    The last checkpoint holds its evaluated weights; it is logged after the run's records are
    complete. A failure is a warning naming the command that logs it later: the run itself is done.
    """
    if not (config.tracking.mlflow and config.tracking.log_model) or tracker.run_id is None:
        return
    if not config.train.save_checkpoints:
        log.info("no MLflow model logged: train.save_checkpoints=false left no checkpoint")
        return
    from gptlab.records.store import check_reachable, error_text, sync_command
    from gptlab.registry.serving import log_checkpoint

    later = f"python -m gptlab.export run={run_dir} export.mlflow=true"
    if tracker.mlflow.unsent:  # the store went away: the run's own records come first
        log.warning(f"no MLflow model logged: after {sync_command(run_dir)}, log it with: {later}")
        return
    start = time.perf_counter()
    try:
        check_reachable(tracker.uri)  # seconds, where MLflow's own client retries for minutes
        info = log_checkpoint(run_dir, tracker.uri, tracker.run_id, results)
    except KeyboardInterrupt:  # Ctrl-C while it logs: the run is done, only its model is missing
        log.warning(f"the run's MLflow model was not logged (interrupted); log it with: {later}")
        return
    except Exception as e:  # noqa: BLE001 - the run is recorded; only its model is missing
        log.warning(
            f"the run's MLflow model was not logged ({error_text(e)}); log it with: {later}"
        )
        return
    log.info(
        f"logged the run's MLflow model {info.model_uri} (step {results['steps']}) in "
        f"{time.perf_counter() - start:.1f} s"
    )


# ---- the run folder's claim across ranks (records/runfolder decides on rank 0) ----------------


def shared_claim(
    run_dir: Path,
    resume: str,
    resolved: Dict[str, Any],
    is_main: bool,
    log: Callable[[str], None],
    unreadable: Optional[Dict[Path, str]] = None,
    verify: bool = True,
) -> Tuple[Optional[Path], Optional[checkpoint.TrainingState]]:
    """runfolder.claim() on rank 0, its answer on every rank (verify: train.verify_checkpoints).

    Returns (the checkpoint to load, the state rank 0 loaded already, None on the other ranks).
    Rank 0's refusal is raised on every rank. Called before the data is prepared, so another run's
    checkpoint or a bad path stops at once."""
    answer: Tuple[Optional[str], Optional[str]] = (None, None)
    c = None
    if is_main:
        try:
            c = runfolder.claim(run_dir, resume, resolved, log, unreadable, verify)
            answer = (str(c.resume_from) if c.resume_from else None, None)
        except GptlabError as e:
            answer = (None, str(e))
    path, error = distributed.broadcast_object(answer)
    if error is not None:
        raise GptlabError(error)
    return (Path(path) if path else None), (c.state if c is not None else None)


def shared_restore(
    run_dir: Path,
    resume: str,
    resolved: Dict[str, Any],
    is_main: bool,
    log: Callable[[str], None],
    objects: Dict[str, Any],
    claimed: Tuple[Path, Optional[checkpoint.TrainingState]],
    verify: bool = True,
) -> Tuple[Path, checkpoint.TrainingState]:
    """Restore shared_claim's checkpoint into objects: (the checkpoint, its state).

    Every rank calls it.

    A sharded checkpoint an entry of which does not read back (damaged, or crafted) is claimed past:
    named with its cause, moved to checkpoints/broken/, and the previous one restored.
    train.resume=PATH asked for that one: its damage is the error."""
    path, loaded = claimed
    unreadable: Dict[Path, str] = {}
    while True:
        # rank 0 checked the digests while claiming it: the other ranks read the same files
        state = loaded or checkpoint.TrainingState.load(path, verify=False)
        try:
            # restoring is the check (each rank reads its entries once); DCP gives all failures
            state.restore(objects)
            return path, state
        except checkpoint.UnreadableCheckpoint as e:
            if resume != "auto":
                raise
            unreadable[path] = str(e)
        found, loaded = shared_claim(run_dir, resume, resolved, is_main, log, unreadable, verify)
        if found is None:  # not reached: a folder whose checkpoints all fail is refused by claim
            raise GptlabError(unreadable[path])
        path = found
