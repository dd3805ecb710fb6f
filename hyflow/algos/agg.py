"""Loss aggregation: reduce a per-token loss matrix [B, T] to the scalar that is back-propagated.

Five modes (verl's names), with `L` the per-token loss, `m` the response mask, `S_i = Σ_t L_it m_it` the
token sum of sample i and `n_i = Σ_t m_it` its length:

| mode                      | value                                            |
|---------------------------|--------------------------------------------------|
| `token-mean`              | `Σ_i S_i / N_tok`                                 |
| `token-sum`               | `Σ_i S_i` (no normaliser: the loss grows with the batch's tokens) |
| `seq-mean-token-sum`      | `Σ_i S_i / N_seq`                                 |
| `seq-mean-token-mean`     | `Σ_i (S_i / n_i) / N_seq`                         |
| `seq-mean-token-sum-norm` | `Σ_i (S_i / loss_scale_factor) / N_seq` (Dr.GRPO) |

Sums over i run over non-empty samples (n_i > 0); empty samples contribute nothing.

Global normalisation (the point of this module). `N_tok` and `N_seq` are the token count and the non-empty
sequence count of the WHOLE mini-batch on ALL data-parallel ranks when the caller passes them
(`global_token_count`, `global_seq_count`); otherwise the local counts of `loss_mask` are used (a plain local
mean). With the global counts every micro-batch loss is its exact share of the mini-batch loss, so

    Σ_micro-batches Σ_ranks agg_loss(L_mb, m_mb, global counts) == agg_loss(L_all, m_all)

and gradient accumulation (sum of micro-batch gradients) followed by an all-reduce SUM of gradients across
ranks gives the gradient of the global mean, whatever the micro-batch sizes, dynamic batching or DP size. A
worker gets the counts from `loss_normalisers` on its micro-batches, sums them over its mini-batch and
all-reduces (SUM) them across ranks before the first micro-batch. There is deliberately NO `dp_size` factor
here (verl multiplies by `dp_size` to undo FSDP's gradient averaging): the worker owns that choice, and must
sum gradients across ranks rather than average them (or multiply by `dp_size` itself if its engine averages).

Difference from verl for `seq-mean-token-sum-norm`: verl returns the plain sum `Σ_i S_i / loss_scale_factor`,
so its size grows with the number of sequences in a micro-batch. hyflow divides by `N_seq` as well, making it a
true mean over sequences of Dr.GRPO's constant-normalised sums (arXiv 2503.20783, `1/G Σ_i 1/L_max Σ_t`),
invariant to micro-batching like the other modes. It equals verl's value divided by the number of sequences.
`loss_scale_factor` defaults to the padded response length `loss_mask.shape[-1]`; pass a constant (e.g.
`max_response_length`) when micro-batches may be padded to different lengths, or the invariance is lost.
"""

from __future__ import annotations

import torch

from hyflow.algos.masked import masked_sum

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = int | float | torch.Tensor


def check_loss_agg_mode(loss_agg_mode: str) -> str:
    """Return `loss_agg_mode` if it is one of `LOSS_AGG_MODES`, else raise a ValueError listing them."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes are: {', '.join(LOSS_AGG_MODES)}."
        )
    return loss_agg_mode


def loss_normalisers(
    response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> dict[str, torch.Tensor]:
    """Local normaliser counts of one micro-batch, to be summed over a mini-batch and all-reduced (SUM).

    Returns `{"global_token_count": Σ m, "global_seq_count": #{i: Σ_t m_it > 0}}` as 0-d int64 tensors (no
    device sync). Both counts are returned whatever `loss_agg_mode` is (it is validated only): losses that
    force their own aggregation (`gspo`, `sapo`: seq-mean-token-mean; `geo_mean`: mean over sequences) need
    the sequence count even when the configured mode is `token-mean`. After summing over all micro-batches
    and ranks, pass the dict back as keyword arguments: `agg_loss(L, m, mode, **totals)`.
    """
    check_loss_agg_mode(loss_agg_mode)
    mask_BT = response_mask.bool()
    return {
        "global_token_count": mask_BT.sum(),
        "global_seq_count": mask_BT.any(dim=-1).sum(),
    }


def _count(given: Count | None, local: torch.Tensor, name: str) -> Count:
    """The global count when given, else the local one; at least 1, so an all-masked batch gives 0, not NaN."""
    if given is None:
        return local.clamp(min=1)
    if isinstance(given, torch.Tensor):
        return given.clamp(min=1)
    if given < 0:
        raise ValueError(
            f"{name} must be >= 0, got {given}; pass the count summed over the mini-batch on all ranks "
            f"(see hyflow.algos.agg.loss_normalisers) or None for the local count."
        )
    return max(given, 1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] to a scalar (see the module docstring for the four formulas).

    `global_token_count` (N_tok, used by `token-mean`) and `global_seq_count` (N_seq, used by the `seq-mean-*`
    modes) are the counts over the whole mini-batch on all DP ranks; None means the local counts of
    `loss_mask`. `loss_scale_factor` is Dr.GRPO's constant for `seq-mean-token-sum-norm` (default
    `loss_mask.shape[-1]`). Counts below 1 count as 1: an all-masked (mini-)batch has a zero numerator and
    gives loss 0. Masked entries never affect the result, even if they hold NaN or inf.
    """
    check_loss_agg_mode(loss_agg_mode)
    mask_BT = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        n_tok = _count(global_token_count, mask_BT.sum(), "global_token_count")
        return masked_sum(loss_mat, mask_BT) / n_tok
    if loss_agg_mode == "token-sum":  # verl's: the sum over every valid token of the mini-batch on all ranks
        return masked_sum(loss_mat, mask_BT)

    sums_B = masked_sum(loss_mat, mask_BT, dim=-1)
    lengths_B = mask_BT.sum(dim=-1)
    n_seq = _count(global_seq_count, (lengths_B > 0).sum(), "global_seq_count")
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq_B = sums_B
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq_B = sums_B / lengths_B.clamp(min=1)
    else:
        scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        if scale <= 0:
            raise ValueError(
                f"loss_scale_factor must be > 0, got {scale}; use a constant such as the maximum response "
                f"length, or None for the padded response length."
            )
        per_seq_B = sums_B / scale
    return per_seq_B.sum() / n_seq
