"""Sequence-length balancing across data-parallel ranks (`trainer.balance_batch`).

The driver splits a batch into equal-count contiguous chunks, one per rank. Without balancing, one rank can get
all the long samples and the others wait for it. `balanced_order` returns a row order in which every chunk has
the same number of rows and nearly the same number of real tokens: rows are taken longest first and each goes to
the rank with the fewest tokens that still has room (greedy longest-processing-time with a count cap).
"""

from __future__ import annotations

import torch


def balanced_order(lengths: torch.Tensor, world_size: int) -> torch.Tensor:
    """A permutation of rows such that chunk r of `chunk(world_size)` holds rank r's balanced share."""
    n = len(lengths)
    if world_size <= 1 or n % world_size:
        return torch.arange(n)
    per_rank = n // world_size
    loads = [0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for row in torch.argsort(lengths, descending=True, stable=True).tolist():
        rank = min((r for r in range(world_size) if len(members[r]) < per_rank), key=lambda r: loads[r])
        members[rank].append(row)
        loads[rank] += int(lengths[row])
    return torch.tensor([row for rank in members for row in sorted(rank)])


def imbalance(lengths: torch.Tensor, world_size: int) -> float:
    """max / mean of the per-rank token counts under contiguous chunking (1.0 = perfectly balanced)."""
    loads = torch.stack([part.sum() for part in lengths.float().chunk(world_size)])
    return float(loads.max() / loads.mean().clamp(min=1e-9))
