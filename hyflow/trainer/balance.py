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


def balanced_group_order(lengths: torch.Tensor, groups: torch.Tensor, prompt_lengths: torch.Tensor,
                         world_size: int) -> torch.Tensor | None:
    """`balanced_order` that keeps the rows of one prompt together (for `actor.use_prefix_grouper`, which runs a
    prompt once for the samples of it that share a micro-batch), or None where that cannot give every rank the same
    row count (groups of unequal size, or a rank's share not a multiple of the group size).

    `groups[i]` is row i's prompt (`hyflow.models.packing.prompt_group_ids`). A group's load is its packed token
    count with the prompt run once: sum of its rows' lengths - (size - 1) x prompt length. Groups are taken
    largest load first and each goes to the rank with the least load that has room; in the returned order each
    group's rows are contiguous, so any block of a multiple of the group size (a rank's chunk, a rank's share of
    a mini-batch) holds whole groups.
    """
    n = len(lengths)
    members: dict[int, list[int]] = {}
    for row, group in enumerate(groups.tolist()):
        members.setdefault(group, []).append(row)
    sizes = {len(rows) for rows in members.values()}
    if world_size <= 1 or n % world_size or len(sizes) != 1 or (n // world_size) % (size := sizes.pop()):
        return None
    per_rank = n // world_size // size
    load_of = {g: int(lengths[rows].sum()) - (size - 1) * int(prompt_lengths[rows[0]]) for g, rows in members.items()}
    loads = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for group in sorted(members, key=lambda g: (-load_of[g], members[g][0])):
        rank = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: loads[r])
        ranks[rank].append(group)
        loads[rank] += load_of[group]
    return torch.tensor([row for rank in ranks for group in sorted(rank, key=lambda g: members[g][0])
                         for row in members[group]])


def imbalance(lengths: torch.Tensor, world_size: int) -> float:
    """max / mean of the per-rank token counts under contiguous chunking (1.0 = perfectly balanced)."""
    loads = torch.stack([part.sum() for part in lengths.float().chunk(world_size)])
    return float(loads.max() / loads.mean().clamp(min=1e-9))
