"""PF-PPO: Policy Filtration for PPO (Zhang et al., arXiv 2409.06957), as verl's `compute_pf_ppo_reweight_data`.

After advantages are computed, the batch is resampled with replacement, to the same size, with probability
proportional to a weight of each sample's total score `s_i = Σ_t token_level_scores_it`:

| reweight_method | weight w_i                                                   |
|-----------------|--------------------------------------------------------------|
| `pow`           | `|s_i| ^ weight_pow`                                         |
| `max_min`       | 1 where `s_i` is the batch's max or min score, else 0        |
| `max_random`    | 0.4 where `s_i` is the batch's max score, else 0.1           |

then `w_i ← max(w_i + 1e-8, 1e-8)` so every sample keeps a tiny chance. The draw uses `generator` (seeded by
the caller), so a run and its resume draw the same samples.
"""

from __future__ import annotations

import torch

PF_PPO_METHODS = ("pow", "max_min", "max_random")


@torch.no_grad()
def pf_ppo_weights(scores_B: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """The resampling weight of every sample [B] from its total score (see the module table), floored at 1e-8."""
    if reweight_method == "pow":
        weights_B = scores_B.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        weights_B = ((scores_B == scores_B.max()) | (scores_B == scores_B.min())).to(scores_B.dtype)
    elif reweight_method == "max_random":
        weights_B = torch.where(scores_B == scores_B.max(), 0.4, 0.1).to(scores_B.dtype)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={reweight_method!r} is not one of "
                         f"{', '.join(PF_PPO_METHODS)}")
    return torch.clamp(weights_B + 1e-8, min=1e-8)


@torch.no_grad()
def pf_ppo_resample_indices(scores_B: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """B row indices drawn with replacement with probability ∝ `pf_ppo_weights(scores_B)` (int64 [B])."""
    weights_B = pf_ppo_weights(scores_B.double(), reweight_method, weight_pow)
    return torch.multinomial(weights_B, scores_B.numel(), replacement=True, generator=generator)
