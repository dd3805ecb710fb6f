"""Masked reductions shared by every algorithm module.

Shapes: `_BT` suffix = [batch, response tokens]; masks are 0/1 (bool or float) of the same shape.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(v * m); NaN/inf outside the mask are ignored (treated as 0)."""
    mask = mask.to(values.dtype)
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (valid * mask).sum() if dim is None else (valid * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, eps: float = 1e-8) -> torch.Tensor:
    """sum(v * m) / (sum(m) + eps)."""
    mask = mask.to(values.dtype)
    return masked_sum(values, mask, dim) / (mask.sum() if dim is None else mask.sum(dim=dim)).add(eps)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries: mean((v - mean)^2), times N/(N-1) when `unbiased` and N > 1."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.to(values.dtype).sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(v - mean) / sqrt(var + eps) over the masked entries; adds the mean back when `shift_mean` is False.

    With fewer than two valid entries the variance is 0 and only the centring applies.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened if shift_mean else whitened + mean


def group_ids(index, device: torch.device | str | None = None) -> torch.Tensor:
    """Map group labels (ints, strings, uuids; list, numpy array or tensor) to contiguous ids 0..G-1.

    Equal labels share an id; ids follow the order of first appearance.
    """
    labels = index.tolist() if hasattr(index, "tolist") else list(index)
    mapping: dict = {}
    ids = [mapping.setdefault(label, len(mapping)) for label in labels]
    return torch.tensor(ids, dtype=torch.long, device=device)


def group_sum(values_B: torch.Tensor, gid_B: torch.Tensor, num_groups: int | None = None) -> torch.Tensor:
    """Per-group sums [G] of per-sample values [B] (vectorised scatter-add)."""
    num_groups = int(gid_B.max()) + 1 if num_groups is None else num_groups
    return torch.zeros(num_groups, dtype=values_B.dtype, device=values_B.device).index_add_(0, gid_B, values_B)
