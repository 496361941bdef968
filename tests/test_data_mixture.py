"""data=mixture: sources drawn by weight, each measured on its own (gptlab/data/mixture.py,
gptlab/data/mixture_loader.py)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import compose_config, run_cli, typed

from gptlab.data.loader import RandomWindowLoader, SequentialLoader
from gptlab.data.mixture import planned_sources, prepare_mixture, resolve
from gptlab.data.mixture_loader import MixtureLoader, step_counts
from gptlab.errors import GptlabError
from gptlab.train import run_training

T, B = 8, 8


def sources(n=3, size=4000):
    """Source i's tokens all lie in [1000 i, 1000 i + 999]: a row names its source."""
    rng = np.random.default_rng(0)
    return [(1000 * i + rng.integers(0, 1000, size)).astype(np.uint16) for i in range(n)]


def loader(weights, sampling=("random",) * 3, rank=0, world=1, mb=B, toks=None, **kw):
    toks = toks or sources(len(weights))
    names = [f"s{i}" for i in range(len(weights))]
    return MixtureLoader(
        toks, names, weights, sampling[: len(weights)], T, B, mb, rank, world, 7, **kw
    )


def global_batch(loaders):
    """The step's rows, concatenated over ranks and micro-batches."""
    return torch.cat([x for ld in loaders for x, _ in ld.next_step()])


@pytest.mark.parametrize("sampling", [("random",) * 3, ("sequential", "random", "sequential")])
def test_drawn_proportions_over_1000_sequences_are_the_weights(sampling):
    ld = loader([0.5, 0.3, 0.2], sampling)
    rows = torch.cat([global_batch([ld]) for _ in range(125)])  # 1,000 sequences
    share = np.bincount(rows[:, 0].numpy() // 1000, minlength=3) / len(rows)
    assert np.all(np.abs(share - [0.5, 0.3, 0.2]) <= 0.03), share
    # each step's counts sum to the batch, and a micro-batch holds the sources in proportion too
    assert all(step_counts(np.array([0.5, 0.3, 0.2]), B, 7, s).sum() == B for s in range(50))


def test_weights_need_not_sum_to_one_and_a_zero_weight_is_never_read():
    ld = loader([3.0, 0.0, 1.0])
    rows = torch.cat([global_batch([ld]) for _ in range(50)])
    share = np.bincount(rows[:, 0].numpy() // 1000, minlength=3) / len(rows)
    assert share[1] == 0 and abs(share[0] - 0.75) <= 0.03


@pytest.mark.parametrize("sampling", [("random",) * 3, ("sequential",) * 3])
def test_ranks_and_micro_batches_slice_the_one_process_global_batch(sampling):
    one = loader([0.5, 0.3, 0.2], sampling)
    two = [loader([0.5, 0.3, 0.2], sampling, rank=r, world=2, mb=2) for r in range(2)]
    for _ in range(6):
        assert torch.equal(global_batch([one]), global_batch(two))


def test_resume_is_exact_across_a_change_of_world_size():
    sampling = ("sequential", "random", "sequential")
    ref = loader([0.5, 0.3, 0.2], sampling)
    first = loader([0.5, 0.3, 0.2], sampling, prefetch=True)
    for _ in range(5):
        global_batch([ref]), global_batch([first])
    state = first.state_dict()
    assert state["kind"] == "mixture" and set(state["sources"]) == {"s0", "s1", "s2"}
    resumed = [loader([0.5, 0.3, 0.2], sampling, rank=r, world=2, mb=4) for r in range(2)]
    for ld in resumed:
        ld.load_state_dict(json.loads(json.dumps(state)))  # what a checkpoint keeps
    for _ in range(5):
        assert torch.equal(global_batch([ref]), global_batch(resumed))


def test_a_one_source_mixture_draws_what_the_single_source_loader_draws():
    toks = sources(1, 5000)
    for cls, mode in ((RandomWindowLoader, "random"), (SequentialLoader, "sequential")):
        single = cls(toks[0], T, B, 4, 0, 1, 7)
        mixed = loader([1.0], (mode,), mb=4, toks=toks)
        for _ in range(30):  # sequential: several epochs of 5,000 tokens
            a, b = single.next_step(), mixed.next_step()
            assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))


def test_a_source_that_runs_out_repeats_and_its_epochs_are_counted():
    toks = sources(2, 200)  # 200 tokens: a new epoch of a source every few steps
    ld = loader([0.5, 0.5], ("sequential", "sequential"), toks=toks)
    for _ in range(20):
        ld.next_step()
    epochs = ld.epochs()
    # 20 steps x 4 rows x 8 tokens = 640 tokens of each, in epochs of at most 192 read
    assert 3.0 <= epochs["s0"] <= 4.0 and 3.0 <= epochs["s1"] <= 4.0


def mixture_overrides(shakespeare, notes, w_plays=0.7, w_notes=0.3):
    return [
        "data=mixture",
        f"data.sources={{plays: {{data: shakespeare_char, weight: {w_plays}, path: {shakespeare}}},"
        f" notes: {{data: text_files, path: {notes}, weight: {w_notes}, tokenizer: {{kind: char}},"
        f" shard_divisor: 1, val_fraction: 0.1}}}}",
    ]


@pytest.fixture
def notes(tmp_path):
    rng = np.random.default_rng(1)
    words = ["data", "mixture", "source", "weight", "token", "epoch", "shard", "batch"]
    folder = tmp_path / "notes"
    folder.mkdir()
    for i in range(30):
        (folder / f"n{i}.txt").write_text(" ".join(rng.choice(words, 300)))
    return folder


def _error(overrides, block_size=None):
    with pytest.raises(GptlabError) as e:
        resolve(typed("data", *overrides), block_size)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_mixtures_are_one_line_each_before_anything_is_prepared(tmp_path):
    def spec(a, b):
        return ["data=mixture", f"data.sources={{a: {{{a}}}, b: {{{b}}}}}"]

    ok = "data: shakespeare_char, weight: 1"
    assert "weights must be >= 0" in _error(spec(ok, "data: shakespeare_char, weight: -1"))
    zero = "data: shakespeare_char, weight: 0"
    assert "every weight is 0" in _error(spec(zero, zero))
    assert "no such data choice" in _error(spec(ok, "data: nonesuch, weight: 1"))
    gpt2 = "data: shakespeare_char, weight: 1, tokenizer: {kind: gpt2}"
    assert "different tokenizers" in _error(spec(ok, gpt2))
    longer = "data: shakespeare_char, weight: 1, block_size: 128"
    assert "share one sequence length" in _error(spec(ok, longer), block_size=64)
    no_val = "data: shakespeare_char, weight: 1, val_fraction: 0"
    assert "needs a validation split" in _error(spec(ok, no_val))
    assert "data.sources is empty" in _error(["data=mixture"])
    assert not list(Path(tmp_path).iterdir())  # nothing prepared anywhere here


def test_changing_weights_re_prepares_nothing_and_char_sources_share_a_vocabulary(
    shakespeare, notes, caplog
):
    lines = []
    first = prepare_mixture(typed("data", *mixture_overrides(shakespeare, notes)), lines.append)
    assert first.data[0].tokenizer_sha256 == first.data[1].tokenizer_sha256
    stamps = [(d.root / "meta.json").stat().st_mtime_ns for d in first.data]
    again = []
    cfg = typed("data", *mixture_overrides(shakespeare, notes, 2, 2))
    second = prepare_mixture(cfg, again.append)
    assert [d.root for d in second.data] == [d.root for d in first.data]
    assert [(d.root / "meta.json").stat().st_mtime_ns for d in second.data] == stamps
    assert not any(line.startswith("prepared") for line in again)
    assert "normalised from a sum of 4" in again[0]
    rows, warnings = planned_sources(cfg, 8 * 32, 20_000)  # the planner reads the counts
    assert [r["train_tokens"] for r in rows] == second.train_sizes()
    assert rows[1]["epochs"] > 10 and len(warnings) == 1 and "notes" in warnings[0]


@pytest.mark.slow  # three short runs: ~35 s on a loaded 2-core machine
def test_per_source_val_loss_is_a_single_source_runs_and_is_recorded(tmp_path, shakespeare, notes):
    base = ["debug=smoke", "train.max_steps=4", "train.eval_every=4", "train.sample_tokens=0"]
    single = run_training(compose_config([*base, f"data.path={shakespeare}"]), tmp_path / "one")
    alone = [
        "data=mixture",
        f"data.sources={{plays: {{data: shakespeare_char, weight: 1, path: {shakespeare}}}}}",
    ]
    mixed = run_training(compose_config([*base, *alone]), tmp_path / "mix1")
    assert abs(mixed["val/plays/loss"] - single["val_loss"]) <= 1e-5
    assert abs(mixed["val_loss"] - single["val_loss"]) <= 1e-5
    run_dir = tmp_path / "mix2"
    two = run_training(compose_config([*base, *mixture_overrides(shakespeare, notes)]), run_dir)
    expected = 0.7 * two["val/plays/loss"] + 0.3 * two["val/notes/loss"]
    assert abs(two["val_loss"] - expected) <= 1e-9
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("val/notes/bpb" in r for r in rows) and any("data/notes/epochs" in r for r in rows)
    results = json.loads((run_dir / "results.json").read_text())
    assert {"val/plays/loss", "val/notes/bpb"} <= set(results)
    datasets = json.loads((run_dir / "datasets.json").read_text())["datasets"]
    assert {d["name"] for d in datasets} == {"plays-train", "plays-val", "notes-train", "notes-val"}
    assert sorted({d["weight"] for d in datasets}) == pytest.approx([0.3, 0.7])


def _logged(run_dir: Path, key: str):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.slow  # four short runs, two of them on two processes
def test_two_processes_equal_one_and_a_run_moves_to_one_process_mid_mixture(
    tmp_path, shakespeare, notes
):
    """The two-source mixture on 2 gloo ranks (spawned by gptlab) gives one process's losses, per
    source too; stopped at step 4 on 2 ranks and continued on 1, it ends where one process that
    ran straight through ends: each source's position comes back from the checkpoint."""
    base = [*mixture_overrides(shakespeare, notes), "debug=smoke", "train.log_every=1",
            "train.eval_every=4", "train.sample_tokens=0", "model.dropout=0.0",
            "optimizer.decay_steps=8", "train.micro_batch_size=4"]  # fmt: skip
    straight, two, moved = tmp_path / "straight", tmp_path / "two", tmp_path / "moved"
    # in this process (its fork server starts both two-process runs' workers)
    for run_dir, hardware, steps in [
        (straight, "hardware=cpu", 8),
        (two, "hardware=cpu_x2", 8),
        (moved, "hardware=cpu_x2", 4),
    ]:
        run_training(compose_config([*base, hardware, f"train.max_steps={steps}"]), run_dir)
    # the continuation as a user runs it: the command says it resumed
    r = run_cli(["gptlab.train", *base, "hardware=cpu", "train.max_steps=8",
                 f"hydra.run.dir={moved}"], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming from" in r.stdout
    for key in ("train_loss", "val/plays/loss", "val/notes/loss"):
        ref = _logged(straight, key)
        assert ref and _logged(two, key) == pytest.approx(ref, abs=1e-5), key
        later = {s: v for s, v in _logged(moved, key).items() if s > 4}
        assert later == pytest.approx({s: ref[s] for s in later}, abs=1e-5), key
