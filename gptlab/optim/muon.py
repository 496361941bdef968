"""Muon: momentum updates orthogonalised by Newton-Schulz, split over ranks; AdamW for the rest."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.adam import adam as adam_step

from gptlab import is_dtensor
from gptlab.optim import width_mult
from gptlab.optim.config import OptimizerConfig

if TYPE_CHECKING:  # imported where a sharded run uses it: every run's start would pay for it
    from torch.distributed.tensor import DTensor


# a quintic Newton-Schulz iteration tuned to converge in ~5 steps
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximately U V^T of each matrix's SVD, by a Newton-Schulz iteration in g's dtype.

    Singular values are pushed into about [0.7, 1.2]; the iteration runs on a (..., rows, cols)
    stack with rows <= cols.
    """
    a, b, c = NS_COEFFS
    x = g / (g.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    flat = x.dim() == 2
    if flat:
        x = x.unsqueeze(0)
    for _ in range(steps):
        gram = x @ x.mT
        # b * gram + c * gram @ gram, one kernel
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        # a * x + poly @ x as (a I + poly) @ x: baddbmm would first copy all of x into its output (a
        # fifth of the iteration's time on the CPU); the identity term touches only the small gram.
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        x = poly @ x
    return x.squeeze(0) if flat else x


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are native here (CUDA; a CPU with AVX-512-BF16 or AMX).

    Not oneDNN's "bf16 supported", which is true on any AVX-512 CPU: without the bf16 instructions
    it emulates them, and a Newton-Schulz iteration runs 3-4x slower than in fp32 (measured on an
    AVX-512 Xeon without either: a (8, 128, 512) stack, 4 steps, 23.5 ms in bf16 against 6.9 ms in
    fp32).
    """
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool(
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )


def ns_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The dtype of Muon's Newton-Schulz iteration: auto is bf16 where bf16 matmuls are native."""
    if choice == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]


# ------------------------------------------------------------ Muon's Newton-Schulz split over ranks
#
# Alone, a process orthogonalises every matrix. With others, each rank orthogonalises its share of
# the matrices (muon_owners) and the results are exchanged, one flat buffer per collective: with
# replicated parameters (DDP) each owner broadcasts its results in turn; FSDP2's row shards
# (DTensors, Shard(0) over the mesh's last dimension: fsdp's one, hsdp's within-node one) go to each
# matrix's owner in one all-to-all and its rows come back in another. Each matrix is orthogonalised
# whole, in stacks by shape as alone, so the step equals one process's.


def ns_flops(shape: Sequence[int], steps: int) -> float:
    """FLOPs of orthogonalize on one matrix of this shape (either way round; r <= c).

    Per iteration: the gram (2 r^2 c), gram @ gram (2 r^3) and poly @ x (2 r^2 c).
    """
    r, c = sorted(shape)
    return steps * (4.0 * r * r * c + 2.0 * r**3)


def muon_owners(shapes: Sequence[Sequence[int]], ranks: int) -> List[int]:
    """The rank that orthogonalises each matrix, the costliest first to the least loaded rank.

    Ties go to the lowest of equally loaded ranks. A function of the shapes alone, so every rank
    computes the same; equal shapes go round the ranks, so each rank's share still stacks by shape.
    """
    load, owners = [0.0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i], 1), i)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += ns_flops(shapes[i], 1)
    return owners


def orthogonalized(
    matrices: Sequence[torch.Tensor], steps: int, dtype: torch.dtype
) -> Iterator[Tuple[int, torch.Tensor]]:
    """(index, orthogonalised matrix in dtype) for each matrix, one batched iteration per shape.

    Each pair comes as its stack finishes (the stack is freed when the next begins): every matrix is
    turned wide (rows <= cols) first and back after, so a block's c_fc (4C, C) and its MLP c_proj
    (C, 4C) share one (2 n_layer, C, 4C) stack.
    """
    by_shape: Dict[Tuple[int, ...], List[int]] = {}
    for i, m in enumerate(matrices):
        by_shape.setdefault(tuple(sorted(m.shape)), []).append(i)
    for shape, members in by_shape.items():
        stack = torch.empty((len(members), *shape), dtype=dtype, device=matrices[members[0]].device)
        for j, i in enumerate(members):
            m = matrices[i]
            stack[j].copy_(m.mT if m.shape[0] > m.shape[1] else m)  # cast in the same copy
        ortho = orthogonalize(stack, steps)
        del stack
        for j, i in enumerate(members):
            tall = matrices[i].shape[0] > matrices[i].shape[1]
            yield i, ortho[j].mT if tall else ortho[j]
        del ortho  # before the next stack (a caller holding a result keeps it)


def orthogonalized_updates(
    updates: Sequence[torch.Tensor], steps: int, dtype: torch.dtype
) -> Iterator[Tuple[int, torch.Tensor]]:
    """(index, orthogonalised update) for each update, as its parameter holds it.

    A DTensor's local rows, else the whole matrix. Split over ranks where there are several (see
    above).
    """
    if all(is_dtensor(u) for u in updates):
        mesh = updates[0].device_mesh
        if _row_sharded(updates, mesh) and mesh.size(mesh.ndim - 1) > 1:
            return iter(enumerate(_sharded_split(updates, steps, dtype, mesh)))
        return _whole(updates, steps, dtype)
    replicated = not any(is_dtensor(u) for u in updates)
    if replicated and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _replicated_split(updates, steps, dtype, dist.group.WORLD)
    return _whole(updates, steps, dtype)


def _row_sharded(updates: Sequence[DTensor], mesh) -> bool:
    """Whether every update is split by rows over the mesh's last dimension, on this one mesh.

    Each is also replicated over any other dimension (fsdp, hsdp).
    """
    from torch.distributed.tensor import Replicate, Shard

    wanted = (*[Replicate()] * (mesh.ndim - 1), Shard(0))
    return all(u.device_mesh == mesh and tuple(u.placements) == wanted for u in updates)


def _whole(updates: Sequence[torch.Tensor], steps: int, dtype: torch.dtype):
    """Every matrix orthogonalised here: a DTensor gathered whole first, and its rows kept after."""
    wholes = [u.full_tensor() if is_dtensor(u) else u for u in updates]
    for i, o in orthogonalized(wholes, steps, dtype):
        u = updates[i]
        if is_dtensor(u):  # this rank's rows, sliced here: no communication
            from torch.distributed.tensor import distribute_tensor

            o = distribute_tensor(
                o.contiguous(), u.device_mesh, u.placements, src_data_rank=None
            ).to_local()
        yield i, o


def _replicated_split(
    updates: Sequence[torch.Tensor], steps: int, dtype: torch.dtype, group
) -> Iterator[Tuple[int, torch.Tensor]]:
    """Whole updates on every rank (DDP): each rank orthogonalises its share, then broadcasts it.

    Each rank orthogonalises its share into one flat buffer, then each owner broadcasts its buffer
    in turn and its results are yielded before the next (one owner's buffer held at a time, beside
    this rank's own).
    """
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    owners = muon_owners([u.shape for u in updates], ranks)
    shares = [[i for i, o in enumerate(owners) if o == r] for r in range(ranks)]
    offsets = [_offsets([updates[i].numel() for i in share]) for share in shares]
    device = updates[0].device
    mine = torch.empty(offsets[me][-1], dtype=dtype, device=device)
    _pack(mine, offsets[me], orthogonalized([updates[i] for i in shares[me]], steps, dtype))
    for r, share in enumerate(shares):
        if not share:  # more ranks than matrices
            continue
        flat = mine if r == me else torch.empty(offsets[r][-1], dtype=dtype, device=device)
        dist.broadcast(flat, src=dist.get_global_rank(group, r), group=group)
        for j, i in enumerate(share):
            yield i, flat[offsets[r][j] : offsets[r][j + 1]].view(updates[i].shape)
        del flat


def _pack(send: torch.Tensor, offsets: Sequence[int], results) -> None:
    """Each (index, result) into send at offsets[index] (a result lives no longer than its copy)."""
    for j, o in results:
        send[offsets[j] : offsets[j + 1]].view(o.shape).copy_(o)
        del o  # its stack is freed before the next one is built


def _offsets(sizes: Sequence[int]) -> List[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def _chunk_rows(rows: int, ranks: int) -> List[Tuple[int, int]]:
    """(first row, row count) of each rank's shard of a Shard(0) DTensor (torch.chunk's split)."""
    size = -(-rows // ranks)
    return [
        (min(r * size, rows), max(0, min(rows, (r + 1) * size) - r * size)) for r in range(ranks)
    ]


def _exchange(
    pieces_for: Sequence[Sequence[torch.Tensor]],
    sizes_from: Sequence[int],
    group,
    dtype: torch.dtype,
    device: torch.device,
) -> List[torch.Tensor]:
    """One all-to-all of flat buffers.

    pieces_for[r] (cast to dtype) go to rank r, and the flat segment each rank sent here
    (sizes_from[r] numbers) comes back.
    """
    sizes_to = [sum(t.numel() for t in pieces) for pieces in pieces_for]
    send = torch.empty(sum(sizes_to), dtype=dtype, device=device)
    at = 0
    for t in (t for pieces in pieces_for for t in pieces):
        send[at : at + t.numel()].view(t.shape).copy_(t)
        at += t.numel()
    received = torch.empty(sum(sizes_from), dtype=dtype, device=device)
    dist.all_to_all_single(received, send, list(sizes_from), sizes_to, group=group)
    return list(received.split(list(sizes_from)))


def _sharded_split(
    updates: Sequence[DTensor], steps: int, dtype: torch.dtype, mesh
) -> List[torch.Tensor]:
    """Row shards (FSDP2): each matrix's owner orthogonalises it whole from every rank's rows.

    Every rank sends each matrix's rows to the matrix's owner (one all-to-all), the owners
    orthogonalise their matrices whole, and every rank gets its rows of every result back (another).
    Under hsdp each node's ranks split the work among themselves.
    """
    dim = mesh.ndim - 1
    group, ranks, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    device = updates[0].to_local().device
    owners = muon_owners([u.shape for u in updates], ranks)
    rows = [_chunk_rows(u.shape[0], ranks) for u in updates]
    mine = [i for i, o in enumerate(owners) if o == me]
    cols = [u.shape[1] for u in updates]
    # what each rank holds of my matrices, and what I hold of each rank's
    of_mine = [sum(rows[i][r][1] * cols[i] for i in mine) for r in range(ranks)]
    of_theirs = [
        sum(rows[i][me][1] * cols[i] for i, o in enumerate(owners) if o == r) for r in range(ranks)
    ]
    to_owner = [[u.to_local() for u, o in zip(updates, owners) if o == r] for r in range(ranks)]
    segments = _exchange(to_owner, of_mine, group, dtype, device)
    wholes = [torch.empty(updates[i].shape, dtype=dtype, device=device) for i in mine]
    for r, segment in enumerate(segments):
        at = 0
        for whole, i in zip(wholes, mine):
            first, count = rows[i][r]
            whole[first : first + count].copy_(
                segment[at : at + count * cols[i]].view(count, cols[i])
            )
            at += count * cols[i]
    del segments
    done = dict(orthogonalized(wholes, steps, dtype))
    del wholes
    back = [[done[j][slice(*_span(rows[i][r]))] for j, i in enumerate(mine)] for r in range(ranks)]
    del done
    segments = _exchange(back, of_theirs, group, dtype, device)
    out: Dict[int, torch.Tensor] = {}
    for r, segment in enumerate(segments):
        at = 0
        for i in (i for i, o in enumerate(owners) if o == r):
            count = rows[i][me][1]
            out[i] = segment[at : at + count * cols[i]].view(count, cols[i])
            at += count * cols[i]
    return [out[i] for i in range(len(updates))]


def _span(first_count: Tuple[int, int]) -> Tuple[int, int]:
    return first_count[0], first_count[0] + first_count[1]


class Muon(torch.optim.Optimizer):
    """Muon for groups with muon=True, and torch's AdamW step for groups with muon=False.

    Muon: Nesterov momentum, then each matrix's update orthogonalised by Newton-Schulz (in bf16
    where bf16 matmuls are native, as the method intends; fp32 elsewhere), scaled by 0.2 *
    sqrt(max(rows, cols)) so that its RMS matches AdamW's. That lets both kinds share one lr, one
    weight decay and one schedule. Groups with muon=False take torch's AdamW step (fused: its fused
    kernel, as build_optimizer chooses for AdamW).
    """

    def __init__(
        self,
        groups,
        lr: float,
        betas,
        eps: float,
        momentum: float,
        ns_steps: int,
        fused: bool,
        ns_dtype: str = "auto",
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, momentum=momentum, ns_steps=ns_steps, fused=fused
        )
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype  # not a group default: a choice of arithmetic, not state to save

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(group, params)

    def _muon(self, group, params):
        states = [self.state[p] for p in params]
        for p, s in zip(params, states):
            if not s:
                s["momentum_buffer"] = torch.zeros_like(p)
        bufs = [s["momentum_buffer"] for s in states]
        grads = [p.grad for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
        updates = torch._foreach_lerp(grads, bufs, group["momentum"])  # Nesterov
        dtype = ns_dtype(self.ns_dtype, updates[0].device)
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        # each orthogonalised update as p holds it (a DTensor's: its own rows), applied as it comes;
        # the 0.2 sqrt(max dim) scale, the lr and the cast back folded into one add per matrix
        for i, o in orthogonalized_updates(updates, group["ns_steps"], dtype):
            p = params[i]
            alpha = -group["lr"] * 0.2 * math.sqrt(max(p.shape))
            (p.to_local() if is_dtensor(p) else p).add_(o, alpha=alpha)
            del o  # its stack is freed before the next one is built

    def _adamw(self, group, params):
        for p in params:
            if not self.state[p]:
                self.state[p].update(
                    step=torch.zeros((), dtype=torch.float32, device=p.device),
                    exp_avg=torch.zeros_like(p),
                    exp_avg_sq=torch.zeros_like(p),
                )
        states = [self.state[p] for p in params]
        b1, b2 = group["betas"]
        adam_step(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=group["fused"],
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def build(
    model: nn.Module,
    decay: List[nn.Parameter],
    no_decay: List[nn.Parameter],
    cfg: OptimizerConfig,
    lr: float,
    fused: bool,
) -> torch.optim.Optimizer:
    """Muon on the blocks' matrices (and an untied head), AdamW on embeddings and the rest."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices = [p for p in decay if p.dim() == 2 and id(p) not in embeddings]
    taken = {id(p) for p in matrices}
    groups: List[Any] = [
        {"params": matrices, "weight_decay": cfg.weight_decay, "muon": True},
        {
            "params": [p for p in decay if id(p) not in taken],
            "weight_decay": cfg.weight_decay,
            "muon": False,
        },
        {"params": no_decay, "weight_decay": 0.0, "muon": False},
    ]
    m = width_mult(model)
    if m is not None:
        # muP: the update's 0.2 sqrt(max dim) scale grows as sqrt(m); 1/sqrt(m) keeps each matrix's
        # step the same spectral size at every width. The AdamW groups (embeddings, gains) keep lr.
        groups[0]["lr_mult"] = 1.0 / math.sqrt(m)
    return Muon(
        groups,
        lr,
        tuple(cfg.betas),
        cfg.eps,
        cfg.muon_momentum,
        cfg.muon_ns_steps,
        fused,
        cfg.muon_ns_dtype,
    )
