"""Ulysses sequence parallelism (DeepSpeed-Ulysses, arXiv 2309.14509; verl's `ulysses_sequence_parallel_size`).

The S ranks of a sequence-parallel group hold the same micro-batch. Its packed row of T tokens (`hyflow.models.
packing`) is padded to a multiple of S and cut into S slices of T/S tokens; rank s runs the model on slice s only,
so every activation outside attention (embeddings, MLPs, norms, the layers' saved tensors) is 1/S of the whole.
Attention needs every token: before it, one all-to-all turns each rank's [h heads, T/S tokens] into [h/S heads,
T tokens] (sequence gathered, heads scattered); attention runs on whole sequences for the rank's heads; a second
all-to-all turns [T tokens, h/S heads] back into [T/S tokens, h heads]. K/V heads fewer than S (or not divisible
by S) are repeated first, as verl does, so each rank's query heads find their K/V heads. Rotary positions are
taken per token from the slice's own position ids, so nothing else changes.

The final hidden states are gathered along the sequence (`gather_sequence`), so what follows (the lm_head,
log-probs, losses) is computed on the whole row by every rank of the group: identical values on all S ranks. In
backward the gather hands each rank the gradient of its own slice, and the all-to-alls route the attention's
gradients to the ranks that own the tokens. A parameter used before the gather (every layer) then has its
gradient split over the group (each rank holds the part its slice computed: the whole is their SUM), while one
used after it (the lm_head, which every rank applies to the whole row) has its whole gradient on every rank.
`grad_scale` (= S, verl's `grad_scaler`) multiplies the gradient the gather hands back by S, so that for both
kinds the group's AVERAGE is the whole gradient: the data-parallel average over all W = dp x S ranks (FSDP's,
DDP's) is then the average over the dp groups of their whole gradients.

Use: `with sequence_parallel(group):` around a packed forward (and its backward, which needs no context).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

Tensor = torch.Tensor

ULYSSES_KWARG = "hyflow_ulysses"  # the attention call's keyword carrying the group (packing's attention reads it)

_ACTIVE: list = []  # the group of the innermost `sequence_parallel` block, with its gradient scale


@contextlib.contextmanager
def sequence_parallel(group, *, grad_scale: float | None = None) -> Iterator[None]:
    """Within the block, packed forwards (`hyflow.models.packing`) run sequence-parallel over `group` (None or a
    group of one rank: no-op). `grad_scale`: the factor on the gradient of the gathered hidden states (default
    the group's size; module docstring)."""
    size = 1 if group is None else dist.get_world_size(group)
    if size <= 1:
        yield
        return
    _ACTIVE.append((group, float(size if grad_scale is None else grad_scale)))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> tuple | None:
    """(group, grad_scale) of the innermost `sequence_parallel` block, None outside one."""
    return _ACTIVE[-1] if _ACTIVE else None


class _AllToAll(torch.autograd.Function):
    """Split dim `scatter` into S chunks, send chunk s to rank s, concatenate what arrives along dim `gather` (in
    rank order). The backward is the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, group, scatter: int, gather: int) -> Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather, ctx.scatter), None, None, None


def _all_to_all(x: Tensor, group, scatter: int, gather: int) -> Tensor:
    size = dist.get_world_size(group)
    if x.shape[scatter] % size:
        raise ValueError(f"all-to-all over {size} ranks needs dim {scatter} of {tuple(x.shape)} divisible by {size}")
    send = torch.stack(x.chunk(size, dim=scatter)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather)


def seq_to_heads(x: Tensor, group, *, head_dim: int = 1, seq_dim: int = 2) -> Tensor:
    """[.., h, T/S, ..] on each rank -> [.., h/S, T, ..]: the whole sequence for this rank's heads."""
    return _AllToAll.apply(x, group, head_dim, seq_dim)


def heads_to_seq(x: Tensor, group, *, head_dim: int = 2, seq_dim: int = 1) -> Tensor:
    """[.., T, h/S, ..] on each rank -> [.., T/S, h, ..]: every head for this rank's tokens."""
    return _AllToAll.apply(x, group, seq_dim, head_dim)


class _Gather(torch.autograd.Function):
    """All-gather along `dim` (rank order); backward: this rank's slice of the gradient, times `scale`."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int, scale: float) -> Tensor:
        ctx.group, ctx.dim, ctx.scale = group, dim, scale
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        own = grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank]
        return (own * ctx.scale if ctx.scale != 1.0 else own).contiguous(), None, None, None


def gather_sequence(x: Tensor, group, *, dim: int = 1, grad_scale: float = 1.0) -> Tensor:
    """The slices of the group's ranks concatenated along `dim` (module docstring for `grad_scale`)."""
    return _Gather.apply(x, group, dim, float(grad_scale))


def kv_repeats(kv_heads: int, size: int) -> int:
    """How many times each K/V head is repeated so that the group's S ranks can each take a whole number of them
    (query heads must divide by S)."""
    return size // math.gcd(kv_heads, size)


def local_slice(total: int, group) -> tuple[int, int, int]:
    """(padded length, start, end) of this rank's slice of a row of `total` tokens (padded to a multiple of S)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = -(-max(total, 1) // size) * size
    width = padded // size
    return padded, rank * width, (rank + 1) * width
