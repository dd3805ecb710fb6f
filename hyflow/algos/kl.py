"""KL estimators between the policy and the reference model, KL-coefficient controllers, KL-in-reward.

Per-token estimators of KL(π_θ ‖ π_ref) from sampled tokens (Schulman, "Approximating KL divergence", 2020),
with `x = log π_θ − log π_ref` on the sampled token:

| name              | value                                                      |
|-------------------|------------------------------------------------------------|
| `k1`, `kl`        | `x` (unbiased, high variance, can be negative)             |
| `abs`             | `|x|`                                                      |
| `k2`, `mse`       | `½x²`                                                      |
| `k3`, `low_var_kl`| `e^{−x} + x − 1` with `−x` clamped to ±20, result to ±10   |

A `+` suffix (`k1+`, `kl+`, `abs+`, `k2+`, `k3+`, `low_var_kl+`, ...) is the straight-through variant: the
forward value of the base estimator with the gradient of k2, `k2 − sg(k2) + sg(base)`. k2's gradient
`∇x = ∇ log π_θ · x` is the unbiased gradient of the reverse KL, whatever estimator is logged. Full-vocabulary
KL needs logits, not log-probs of the sampled token, and is not offered here.

Two uses: KL in the reward (`apply_kl_penalty`, driver side, with a KL controller that sets the coefficient)
and a KL loss in the actor (the worker aggregates `kl_penalty(...)` with `agg_loss`). Metrics are 0-d detached
tensors, like every metric from `hyflow.algos`.
"""

from __future__ import annotations

import torch

from hyflow.algos.masked import masked_sum

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_PENALTY_NAMES = KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS)


def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = e^y − y − 1 with y = clamp(log π_ref − log π_θ, ±20), clamped to ±10 (verl's bounds)."""
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)


def _base_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, name: str) -> torch.Tensor:
    """Per-token value of one of the base estimators in `KL_ESTIMATORS`."""
    diff = log_prob - ref_log_prob
    if name in ("k1", "kl"):
        return diff
    if name == "abs":
        return diff.abs()
    if name in ("k2", "mse"):
        return 0.5 * diff.square()
    return _k3(log_prob, ref_log_prob)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str = "kl") -> torch.Tensor:
    """Per-token KL estimate [B, T] by name (see the module table); `name+` = base value with k2's gradient.

    The argument names are verl's (`kl_penalty(logprob, ref_logprob, kl_penalty)`), so verl code calling it by
    keyword ports unchanged. Straight-through: `k2 − sg(k2) + sg(base)`, so the value is the base estimator and
    `∂/∂ log π_θ = log π_θ − log π_ref`. `full` (verl's name for full-vocabulary KL, which verl's own function
    does not implement either) is a ValueError.
    """
    log_prob, ref_log_prob, name = logprob, ref_logprob, kl_penalty
    if name not in KL_PENALTY_NAMES:
        hint = " Full-vocabulary KL needs logits and is not supported;" if name == "full" else ""
        raise ValueError(
            f"unknown kl_penalty {name!r}.{hint} Valid estimators: {', '.join(KL_PENALTY_NAMES)}."
        )
    if not name.endswith("+"):
        return _base_estimate(log_prob, ref_log_prob, name)
    base = _base_estimate(log_prob, ref_log_prob, name[:-1])
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return k2 - k2.detach() + base.detach()


class _KLCoefficient:
    """A KL coefficient `value` that checkpoints as `{"value": float}`."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def state_dict(self) -> dict[str, float]:
        """`{"value": coefficient}` for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient saved by `state_dict`."""
        self.value = float(state["value"])


class FixedKLController(_KLCoefficient):
    """Constant KL coefficient; `update` does nothing."""

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""


class AdaptiveKLController(_KLCoefficient):
    """Adaptive KL coefficient of Ziegler et al. (arXiv 1909.08593), steering the measured KL to `target_kl`.

    `e = clip(current_kl / target_kl − 1, −0.2, 0.2)`; `value ← value · (1 + e · n_steps / horizon)`, with
    `n_steps` the number of samples the KL was measured on.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs horizon > 0 (samples over which the coefficient adapts), got "
                f"{horizon}; use e.g. 10000, or a fixed controller (kl_ctrl.type=fixed)."
            )
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0, got {target_kl}; use e.g. 0.1.")
        super().__init__(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Move the coefficient towards the target: up when the KL is above it, down when below."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLER_TYPES = ("fixed", "adaptive")


def make_kl_controller(
    type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `algorithm.kl_ctrl.type` (`fixed` or `adaptive`), verl's defaults."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl.type {type!r}; valid types: {', '.join(KL_CONTROLLER_TYPES)}.")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward: `token_level_rewards = token_level_scores − kl_coef · kl_t · m_t`.

    `kl_t = kl_penalty(old_log_prob, ref_log_prob, kl_penalty)` (no gradient needed; values at masked tokens
    never matter). Metrics: `actor/reward_kl_penalty` = mean over samples of each sample's mean KL over its
    valid tokens (0 for an empty sample) — the `current_kl` to feed `controller.update(current_kl, n_steps=B)` —
    and `actor/reward_kl_penalty_coeff` = `kl_coef`.
    """
    mask_BT = response_mask.to(token_level_scores.dtype)
    kl_BT = torch.where(mask_BT.bool(), _kl_value(old_log_prob, ref_log_prob, kl_penalty), 0.0)
    token_level_rewards = token_level_scores - kl_coef * kl_BT
    kl_per_sample_B = masked_sum(kl_BT, mask_BT, dim=-1) / mask_BT.sum(dim=-1).clamp(min=1)
    metrics = {
        "actor/reward_kl_penalty": kl_per_sample_B.mean().detach(),
        "actor/reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }
    return token_level_rewards, metrics


def _kl_value(old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, name: str) -> torch.Tensor:
    """Detached per-token KL estimate (the reward path never back-propagates through it)."""
    with torch.no_grad():
        return kl_penalty(old_log_prob, ref_log_prob, name)
