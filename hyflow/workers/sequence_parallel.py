"""A worker's Ulysses sequence-parallel group (verl's `ulysses_sequence_parallel_size` = S).

The W ranks of a role form W / S data-parallel groups of S ranks (the `sp` dimension of the role's one mesh,
`hyflow.parallel.dims`; with tensor parallelism too, a row group is the `sp_tp` dimension). The controller splits
a batch over all W ranks; the S ranks of a group then exchange their shares (`gather_rows`), so each holds the group's rows, computes on them sequence-parallel
(`hyflow.models.ulysses`: rank s of the group runs the s-th slice of every packed row) and keeps the outputs of its
own share (`own_rows`). An update's mini-batches keep their rows: the dispatcher gave rank r the r-th slice of
every mini-batch (mini-batch-major order), so the gathered rows are put back mini-batch by mini-batch
(`mini_batch_order`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyflow.batch import Batch


def gather_rows(batch: Batch, group) -> tuple[Batch, slice, list[int]]:
    """The rows of every rank of `group`, in group-rank order; the slice of them that is this rank's; each rank's
    number of rows."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    parts: list = [None] * size
    dist.all_gather_object(parts, batch, group=group)
    lengths = [len(p) for p in parts]
    start = sum(lengths[:rank])
    return Batch.concat(parts), slice(start, start + len(batch)), lengths


def mini_batch_order(rows_per_rank: list[int], piece: int) -> torch.Tensor | None:
    """Row order of gathered shares (rank s's `rows_per_rank[s]` rows, each a run of mini-batch slices of `piece`
    rows) that puts, for every mini-batch k, slice k of every rank together in rank order; None when the shares are
    not whole runs of equal pieces (then the rows stay as gathered)."""
    if piece < 1 or len(set(rows_per_rank)) != 1 or rows_per_rank[0] % piece:
        return None
    size, per_rank = len(rows_per_rank), rows_per_rank[0]
    return torch.arange(size * per_rank).view(size, per_rank // piece, piece).transpose(0, 1).reshape(-1)
