"""Clipped value loss of PPO's critic (Schulman et al., arXiv 1707.06347; clipping as in OpenAI baselines).

With `V` the new value predictions, `V_old` the values from the rollout-time critic, `R` the returns and
`c` = `cliprange_value`: `V_clip = V_old + clip(V − V_old, −c, c)` and

    vf_loss = ½ · agg( max((V − R)², (V_clip − R)²) )

aggregated with `hyflow.algos.agg.agg_loss` (global counts give micro-batch invariance, see `agg.py`).
Metric `vf_clipfrac` = fraction of valid tokens where the clipped error is the larger one, a 0-d detached
tensor like every metric of `hyflow.algos`; the worker adds the `critic/` prefix.
"""

from __future__ import annotations

import torch

from hyflow.algos.agg import agg_loss
from hyflow.algos.masked import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    *,
    global_token_count=None,
    global_seq_count=None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`½ · agg(max((V − R)², (V_clip − R)²))` with `V_clip = clip(V, V_old − c, V_old + c)`.

    `vpreds` V [B, T] (with gradient), `returns` R and `values` V_old [B, T] (detached targets),
    `cliprange_value` c ≥ 0 (None: no clipping, plain ½·MSE). Returns `(vf_loss, {"vf_clipfrac": ...})`.
    """
    if cliprange_value is not None and cliprange_value < 0:
        raise ValueError(
            f"cliprange_value must be >= 0, got {cliprange_value}; use e.g. 0.5, or None to disable clipping."
        )
    error_unclipped = (vpreds - returns).square()
    if cliprange_value is None:
        error = error_unclipped
        clipped_BT = torch.zeros_like(error_unclipped, dtype=torch.bool)
    else:
        # clamp(V, V_old - c, V_old + c) returns V itself inside the range, so a token that is not clipped has
        # error_clipped == error_unclipped exactly and never counts in vf_clipfrac. The algebraically equal
        # V_old + clamp(V - V_old, -c, c) differs from V by rounding, which made the metric count ties at random.
        vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        error_clipped = (vpreds_clipped - returns).square()
        error = torch.maximum(error_unclipped, error_clipped)
        clipped_BT = error_clipped > error_unclipped

    vf_loss = 0.5 * agg_loss(
        error,
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    clipfrac = masked_mean(clipped_BT.to(torch.float32), response_mask.to(torch.float32)).detach()
    return vf_loss, {"vf_clipfrac": clipfrac}
