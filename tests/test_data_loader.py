"""The loaders: the sequential one deterministic, resumable from global token positions and
topology-independent; random windows a function of seed and step."""

import numpy as np
import pytest
import torch

from gptlab.data import (
    RandomWindowLoader,
    SequentialLoader,
    TokenShards,
    build_train_loader,
    eval_batches,
)
from gptlab.data.loader import window_starts
from gptlab.errors import GptlabError

T, B = 8, 8


def shards(n_shards=8, per=100):
    """Token value = its index in the unshuffled stream, so a batch shows where it was read from."""
    flat = np.arange(n_shards * per, dtype=np.uint32)
    return TokenShards([flat[i * per : (i + 1) * per] for i in range(n_shards)])


def loader(tokens, mb=2, rank=0, world=1, **kw):
    return SequentialLoader(tokens, T, B, mb, rank, world, seed=5, **kw)


def global_batch(loaders):
    """One step of every rank, rows in global order."""
    return torch.cat([torch.cat([x for x, _ in ld.next_step()]) for ld in loaders])


def test_token_shards_slice_across_boundaries():
    s = shards(4, 10)
    assert len(s) == 40 and s.dtype == np.uint32
    assert s[8:23].tolist() == list(range(8, 23)) and s[39] == 39 and len(s[5:5]) == 0
    assert s.reordered([2, 0, 1, 3])[8:13].tolist() == [28, 29, 0, 1, 2]


def test_sequential_reads_contiguous_rows_and_targets_shift_by_one():
    tokens = shards()
    ld = loader(tokens)
    # epoch 0's shard order
    stream = tokens.reordered(np.random.default_rng([5, 2, 0]).permutation(8))
    for step in range(3):
        micro = ld.next_step()
        assert ld.accum_steps == 4 and len(micro) == 4 and micro[0][0].shape == (2, T)
        x = torch.cat([m[0] for m in micro]).flatten()
        y = torch.cat([m[1] for m in micro])
        start = step * B * T
        assert x.tolist() == stream[start : start + B * T].tolist()
        assert y[:, -1].tolist() == [int(stream[start + (r + 1) * T]) for r in range(B)]
        assert (y[:, :-1] == x.view(B, T)[:, 1:]).all()
    assert ld.state_dict() == {"kind": "sequential", "epoch": 0, "position": 3 * B * T, "seed": 5}


def test_an_epoch_sees_every_token_once_then_reshuffles_shards():
    tokens = shards()
    ld = loader(tokens)
    steps_per_epoch = (len(tokens) - 1) // (B * T)  # 12 full steps of 64 tokens in 800
    epochs = []
    for epoch in range(2):
        seen = torch.cat([global_batch([ld]).flatten() for _ in range(steps_per_epoch)])
        assert len(set(seen.tolist())) == len(seen) == steps_per_epoch * B * T  # no token twice
        epochs.append(seen)
        # the short tail (32 tokens) is skipped at the next step
        assert ld.state_dict()["epoch"] == epoch
    assert ld.state_dict()["position"] == steps_per_epoch * B * T
    assert not epochs[0].equal(epochs[1])  # epoch 1 reads the shards in another (seeded) order


def test_same_global_tokens_on_1_rank_x_4_accum_and_2_ranks_x_2():
    tokens = shards()
    one = [loader(tokens, mb=2)]
    two = [loader(tokens, mb=2, rank=r, world=2) for r in range(2)]
    assert one[0].accum_steps == 4 and two[0].accum_steps == 2
    for _ in range(15):  # across an epoch boundary
        assert global_batch(one).equal(global_batch(two))


def test_resume_continues_exactly_even_on_another_topology():
    tokens = shards()
    ref = loader(tokens)
    expected = [global_batch([ref]) for _ in range(20)]
    a = loader(tokens)
    for _ in range(7):
        global_batch([a])
    state = a.state_dict()
    b = loader(tokens)  # same topology
    b.load_state_dict(state)
    assert all(global_batch([b]).equal(e) for e in expected[7:])
    c = [loader(tokens, mb=1, rank=r, world=4) for r in range(4)]  # 4 ranks x 2 accum
    for ld in c:
        ld.load_state_dict(state)
    assert all(global_batch(c).equal(e) for e in expected[7:])


def test_prefetch_gives_the_same_batches_and_state():
    tokens = shards()
    plain, ahead = loader(tokens), loader(tokens, prefetch=True)
    for _ in range(14):
        assert global_batch([plain]).equal(global_batch([ahead]))
        # the consumer's position, not the prefetcher's
        assert plain.state_dict() == ahead.state_dict()
    state = plain.state_dict()
    # a restore discards what was prefetched
    ahead.load_state_dict({**state, "position": 0, "epoch": 0})
    assert global_batch([ahead]).equal(global_batch([loader(tokens)]))


def test_random_mode_over_shards_and_mode_mismatch_is_clear():
    tokens = shards()
    rnd = build_train_loader(tokens, T, B, 2, 0, 1, seed=5, sampling="random")
    x, y = rnd.next_step()[0]
    assert (y[:, :-1] == x[:, 1:]).all()
    with pytest.raises(GptlabError, match="data.sampling"):
        loader(tokens).load_state_dict(rnd.state_dict())
    with pytest.raises(GptlabError, match="data.sampling=shuffled"):
        build_train_loader(tokens, T, B, 2, 0, 1, seed=5, sampling="shuffled")
    with pytest.raises(GptlabError, match="train.batch_size x model.block_size"):
        SequentialLoader(shards(1, 30), T, B, 2, 0, 1, seed=5)


def test_a_step_needs_its_tokens_plus_one_target_exactly():
    """A step of B x T tokens needs B x T + 1 (the last target): that many is enough, one fewer is
    refused; in an epoch the last window may end on the stream's last token, one token further
    starts the next."""
    span = B * T
    SequentialLoader(shards(1, span + 1), T, B, 2, 0, 1, seed=5)  # exactly enough
    with pytest.raises(GptlabError, match="train.batch_size x model.block_size"):
        SequentialLoader(shards(1, span), T, B, 2, 0, 1, seed=5)
    ld = loader(shards(1, 2 * span + 1))  # one shard: every epoch reads the same order
    first, second, third = (global_batch([ld]) for _ in range(3))
    assert first.flatten().tolist() == list(range(span))
    # its last target is the last token
    assert second.flatten().tolist() == list(range(span, 2 * span))
    # no room for a third: the next epoch
    assert third.equal(first) and ld.state_dict()["epoch"] == 1
    ld = loader(shards(1, 2 * span))  # one token short of a second step
    first, second = global_batch([ld]), global_batch([ld])
    assert second.equal(first) and ld.state_dict()["epoch"] == 1


def test_two_shards_are_reordered_per_epoch_and_an_epochs_order_is_kept():
    tokens = shards(2, 100)
    ld = loader(tokens)
    firsts = {int(ld._stream(epoch)[0]) for epoch in range(8)}
    assert firsts == {0, 100}  # each shard leads some epoch (seeded, so always the same epochs)
    assert ld._stream(7) is ld._stream(7)  # the epoch's reordered view is made once
    assert list(ld._streams) == [7]  # and only the current epoch's is kept


def test_loader_states_name_their_kind_and_old_checkpoints_were_random_windows():
    tokens = shards()
    rnd = build_train_loader(tokens, T, B, 2, 0, 1, seed=5, sampling="random")
    rnd.next_step()
    assert rnd.state_dict() == {"kind": "random_windows", "step": 1, "seed": 5}
    # a checkpoint from before loaders named their kind holds a random-window position
    rnd.load_state_dict({"step": 3, "seed": 5})
    assert rnd.state_dict()["step"] == 3
    with pytest.raises(GptlabError, match="'random_windows' but this run samples 'sequential'"):
        loader(tokens).load_state_dict({"step": 3, "seed": 5})


def test_eval_batches_are_fixed_their_own_stream_and_split_across_ranks():
    """The same validation windows at every evaluation, drawn from stream 1 (never the training
    stream 0), batch i on rank i % world."""
    tokens = np.arange(1000, dtype=np.uint16)
    a = eval_batches(tokens, 8, 4, 5, seed=1)
    b = eval_batches(tokens, 8, 4, 5, seed=1)
    assert len(a) == 5 and all(x.equal(y) for (x, _), (y, _) in zip(a, b))
    for i, (x, y) in enumerate(a):
        starts = window_starts(1000, 8, 4, seed=1, step=i, stream=1)
        assert x[:, 0].tolist() == starts.tolist() and (y[:, :-1] == x[:, 1:]).all()
        assert not np.array_equal(starts, window_starts(1000, 8, 4, seed=1, step=i, stream=0))
    r0 = eval_batches(tokens, 8, 4, 5, seed=1, rank=0, world_size=2)
    r1 = eval_batches(tokens, 8, 4, 5, seed=1, rank=1, world_size=2)
    assert (len(r0), len(r1)) == (3, 2)
    got = [x for x, _ in r0] + [x for x, _ in r1]
    assert all(g.equal(a[i][0]) for g, i in zip(got, (0, 2, 4, 1, 3)))


def test_random_windows_split_one_global_batch_across_ranks():
    """Random sampling is random windows by default; two ranks read disjoint halves of the rows one
    rank reads, each its own micro-batch x accumulation rows."""
    tokens = shards()
    one = build_train_loader(tokens, T, B, 2, 0, 1, seed=5)
    assert isinstance(one, RandomWindowLoader)
    two = [build_train_loader(tokens, T, B, 2, r, 2, seed=5) for r in range(2)]
    for _ in range(3):
        halves = [torch.cat([x for x, _ in ld.next_step()]) for ld in two]
        assert [h.shape for h in halves] == [(B // 2, T)] * 2
        assert torch.cat(halves).equal(torch.cat([x for x, _ in one.next_step()]))


def test_prefetch_prepares_each_step_once_on_the_loader_thread():
    """The step prepared ahead is the one handed out: each position is read once (the first on the
    caller's thread, every later one on the named loader thread), and a restore to another position
    reads that position afresh instead of handing out the stale one."""
    import threading

    for make in (loader, lambda tokens, **kw: RandomWindowLoader(tokens, T, B, 2, seed=5, **kw)):
        ld = make(shards(), prefetch=True)
        reads = []
        inner = ld._batches_at

        def counted(pos, inner=inner, reads=reads):
            reads.append((pos, threading.current_thread().name))
            return inner(pos)

        ld._batches_at = counted
        first = ld.state_dict()
        for _ in range(4):
            ld.next_step()
        ld._ahead[1].result()  # the fifth step's read has finished
        positions = [pos for pos, _ in reads]
        assert len(positions) == 5 and len(set(map(str, positions))) == 5, reads
        assert reads[0][1] == threading.current_thread().name
        assert all(name.startswith("gptlab-loader_") for _, name in reads[1:]), reads
        ld.load_state_dict(first)  # back to the start: that position is read again, not the fifth
        again = ld.next_step()
        assert (
            str(reads[5][0]) == str(positions[0]) and reads[5][1] == threading.current_thread().name
        )
        fresh = make(shards())
        assert all(a.equal(b) for (a, _), (b, _) in zip(again, fresh.next_step()))


def test_loader_defaults_shapes_and_prefetch_switch():
    """Defaults: rank 0 of one process, seed 0. A batch that micro-batches x ranks do not divide is
    a ValueError naming the rule. The next step is prepared on a thread when asked (prefetch, or
    pin_memory, which a CUDA run sets), and not otherwise."""
    tokens = shards()
    ld = SequentialLoader(tokens, T, B, 2)
    assert (ld.rank, ld.world_size, ld.seed, ld.accum_steps) == (0, 1, 0, 4) and ld._pool is None
    for mb, world in ((3, 1), (4, 4)):  # 4 x 4 rows do not divide 8 (where 4 / 4 would)
        with pytest.raises(
            ValueError, match="^batch_size must be a multiple of micro_batch_size \\* world_size$"
        ):
            SequentialLoader(tokens, T, B, mb, 0, world)
    assert (
        loader(tokens, prefetch=True)._pool is not None
        and loader(tokens, prefetch=False)._pool is None
    )
    # not stepped: no CUDA here
    pinned = build_train_loader(tokens, T, B, 2, 0, 1, seed=5, pin_memory=True)
    assert pinned.pin_memory is True and pinned._pool is not None


def _loader(tokens, **kw):
    args = dict(block_size=8, batch_size=8, micro_batch_size=2, rank=0, world_size=1, seed=3)
    args.update(kw)
    return RandomWindowLoader(tokens, **args)


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = _loader(tokens), _loader(tokens)
    for _ in range(3):
        for (xa, ya), (xb, yb) in zip(a.next_step(), b.next_step()):
            assert xa.equal(xb) and ya.equal(yb)
            assert (ya[:, :-1] == xa[:, 1:]).all()  # targets are inputs shifted by one
    c = _loader(tokens, seed=4)
    assert not c.next_step()[0][0].equal(_loader(tokens).next_step()[0][0])


def test_resume_position_continues_the_sequence():
    tokens = np.arange(1000, dtype=np.uint16)
    a = _loader(tokens)
    for _ in range(5):
        a.next_step()
    b = _loader(tokens)
    b.load_state_dict(a.state_dict())
    assert all(x.equal(y) for (x, _), (y, _) in zip(a.next_step(), b.next_step()))


def test_ranks_and_micro_steps_split_one_global_batch():
    tokens = np.arange(1000, dtype=np.uint16)
    one = torch_cat(_loader(tokens, micro_batch_size=2).next_step())  # 1 rank x 4 micro-steps
    two = torch_cat(
        _loader(tokens, micro_batch_size=2, world_size=2, rank=0).next_step()
        + _loader(tokens, micro_batch_size=2, world_size=2, rank=1).next_step()
    )
    assert one.equal(two)


def torch_cat(batches):
    import torch

    return torch.cat([x for x, _ in batches])
