"""Device placement on the paths the CPU suite cannot otherwise check.

A run is built on the CPU, then its model, optimizer and device-side tables move to ``meta``, a
second device, and each path runs under tests/device_guard.DeviceGuard: any operation that meets a
tensor made without naming its device fails, as it would on a GPU. The figures computed on meta
mean nothing; each test checks that its path ran to the end with every tensor placed.
"""

import contextlib
import dataclasses

import pytest
import torch
from device_guard import DeviceGuard, DeviceMix
from helpers import compose_config, nano_overrides

from gptlab.checkpoint import state as checkpoint
from gptlab.config import to_config
from gptlab.evaluation import hellaswag
from gptlab.optim import OPTIMIZERS
from gptlab.optim.average import AVERAGE, UPDATES, WeightAverage, averaged_weights
from gptlab.training import divergence, loop
from gptlab.training.build import build

META = torch.device("meta")


@contextlib.contextmanager
def swapping_params():
    """Module.to() swaps each parameter's contents in place, so the optimizer's references stay."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.fixture
def meta_run(tmp_path, shakespeare):
    """A built nano run (Muon with a weight average, as the root default), moved to meta."""
    built = []

    def make(*extra):
        cfg = compose_config(nano_overrides(shakespeare, "train.eval_steps=2", *extra))
        run = build(to_config(cfg), tmp_path / f"run{len(built)}", {})
        built.append(run)
        with swapping_params():
            run.raw_model.to(META)
        assert run.model is run.raw_model  # one process, eager: the same module
        run.dist = dataclasses.replace(run.dist, device=META)
        run.token_bytes = run.token_bytes.to(META)
        return run

    yield make
    for run in built:
        run.close("FINISHED")


def guarded(fn, *args, **kwargs):
    guard = DeviceGuard()
    with guard:
        out = fn(*args, **kwargs)
    assert guard.ops, "nothing ran under the guard"
    return out, guard


def test_the_guard_fails_a_cpu_count_stacked_with_device_sums():
    """The shape of the first GPU crash: a CPU scalar made without a device, stacked with device
    tensors; naming the device passes."""
    sums = torch.zeros(2, device=META)
    with pytest.raises(DeviceMix, match="meta.*cpu|cpu.*meta"), DeviceGuard():
        torch.stack([sums.sum(), torch.tensor(3)])
    with DeviceGuard():
        torch.stack([sums.sum(), torch.tensor(3.0, device=META)])


@pytest.mark.integration
def test_evaluation_places_every_tensor(meta_run):
    run = meta_run()
    figures, guard = guarded(loop.evaluate, run)
    assert set(figures) == {"val_loss", "val_bpb"}
    assert any("scaled_dot_product" in op or "bmm" in op or "mm" in op for op in guard.ops)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.integration
def test_an_optimizer_step_and_the_weight_average_place_every_tensor(meta_run, optimizer):
    run = meta_run(f"optimizer={optimizer}", "optimizer.ema_decay=0.9", "optimizer.fused=false")
    p = loop.start_progress(run)
    p.loss_sum = torch.zeros((), device=META)
    for _ in range(2):  # the second step updates an existing average
        grad_norm, _ = guarded(loop.optimizer_step, run, 1e-3, p.loss_sum, 1)
    assert grad_norm.device == META
    state = run.optimizer.state
    # torch's own unfused AdamW keeps its step counts on the CPU on purpose (read by the host)
    on_device = [t.device == META for s in state.values() for k, t in s.items() if k != "step"]
    assert on_device and all(on_device)
    with DeviceGuard(), averaged_weights(run.optimizer) as swapped:
        assert swapped


@pytest.mark.parametrize("mode", ["stop", "rollback"])
@pytest.mark.integration
def test_the_divergence_test_of_a_step_places_every_tensor(meta_run, mode):
    """Both modes' per-step test, the spike's median included (meta's host reads come back as
    ones: rollback mode then refuses the step, which runs that path too)."""
    run = meta_run(
        f"train.on_divergence={mode}",
        "train.spike_factor=3",
        "optimizer=adamw",
        "optimizer.fused=false",
    )
    p = loop.start_progress(run)
    p.loss_sum = torch.zeros((), device=META)
    watch = divergence.Watch(run.train, META, True, {"recent_losses": [4.0] * 12})
    for step in (1, 2):
        guarded(loop.optimizer_step, run, 1e-3, p.loss_sum, step, watch)
    assert (watch.pending is not None) == (mode == "rollback")
    assert watch.recent.device == watch.first.device == META


def test_a_weight_average_loaded_from_a_checkpoint_is_read_on_the_device(meta_run):
    run = meta_run("optimizer.ema_decay=0.9")
    average = WeightAverage(0.9)
    p = next(run.raw_model.parameters())
    run.optimizer.state[p].update(
        {AVERAGE: p.detach().clone(), UPDATES: torch.ones(1, device=META)}
    )
    guarded(average.update, run.optimizer)
    assert average.updates == 2


@pytest.mark.integration
def test_hellaswag_scoring_places_every_tensor(meta_run):
    run = meta_run()
    examples = [("To bake a cake, ", [" mix", " run", " sleep", " fly"], 0)] * 3
    rendered = [
        (run.tokenizer.encode(ctx), [run.tokenizer.encode(e) for e in ends], label)
        for ctx, ends, label in examples
    ]
    figures, _ = guarded(hellaswag.score, run.model, rendered, run.block_size, META, batch_size=4)
    assert set(figures) == {"hellaswag_acc", "hellaswag_acc_norm"}


@pytest.mark.integration
def test_lm_eval_scoring_places_every_tensor(meta_run):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from gptlab.evaluation.harness import GptlabLM

    run = meta_run()
    lm = GptlabLM(run.model, run.tokenizer, META, autocast=run.autocast, progress=False)
    requests = [
        Instance("loglikelihood", {}, ("To be or not", " to be"), 0),
        Instance("loglikelihood", {}, ("To be or not", " two bees"), 1),
    ]
    scores, _ = guarded(lm.loglikelihood, requests)
    rolling, _ = guarded(
        lm.loglikelihood_rolling, [Instance("loglikelihood_rolling", {}, ("All the world",), 0)]
    )
    assert len(scores) == 2 and len(rolling) == 1


@pytest.mark.integration
def test_checkpoint_capture_and_restore_place_every_tensor(meta_run, tmp_path):
    run = meta_run("optimizer=adamw", "optimizer.fused=false")
    p = loop.start_progress(run)
    p.loss_sum = torch.zeros((), device=META)
    loop.optimizer_step(run, 1e-3, p.loss_sum, 1)  # optimizer state to save
    state, _ = guarded(
        checkpoint.TrainingState.capture, run.stateful(), step=1, tokens=0, best_val_loss=1.0,
        best_val_bpb=1.0, val_bpb=None, hellaswag={}, loss_window=(0.0, 0), train_loss=1.0,
        val_loss=None, config={}, model_config={}, tokenizer={}, mlflow_run_id=None,
    )  # fmt: skip
    assert all(t.device == META for t in state.model.values())
    # the model and optimizer go back through torch's set_state_dict, which loads into meta
    # tensors by assignment (meta-initialised models): what is gptlab's runs here
    with DeviceGuard():
        for name in ("scaler", "loader"):
            run.stateful()[name].load_state_dict(getattr(state, name))
        checkpoint.restore_rng(state.rng)
