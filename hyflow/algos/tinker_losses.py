"""The Tinker API's built-in `forward_backward` losses, token-wise and summed (`hyflow serve`, docs/serve.md).

Each Datum of a Tinker request carries its own per-token inputs, aligned with the next-token targets: position i
of the input predicts `target_tokens[i]`. `target_log_probs` [T] are the trained model's log-probs of those
targets; the other tensors come from the request's `loss_fn_inputs` (`weights`, `logprobs` = the sampler's
log-probs, `advantages`). Every loss is a sum over tokens and data (no mean: a Tinker user scales by weights or
advantages), as the Tinker documentation defines them:

- cross_entropy: sum(-target_log_probs * weights)
- importance_sampling: sum(-exp(target - sampler) * advantages)
- ppo: sum(-min(ratio * A, clip(ratio, low, high) * A)), thresholds `clip_low_threshold` / `clip_high_threshold`
  (ratios, default 0.8 / 1.2)
- cispo: sum(-stopgrad(clip(ratio, low, high)) * target_log_probs * A)
- dro: sum(-(target_log_probs * A - beta / 2 * (target - sampler)^2)), `beta` required

`elementwise(loss_fn, target_log_probs, inputs, config)` returns the per-token loss [T] whose sum is the datum's
loss; `LOSS_INPUTS` names the inputs each loss needs and `LOSS_CONFIG` the config keys it reads, so the service
refuses a missing input or an unknown key by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
LOSS_CONFIG: dict[str, dict[str, float | None]] = {  # key -> default (None: required)
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
}


def loss_settings(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config with defaults filled in; ValueError naming an unknown loss, an unknown or missing key."""
    if loss_fn not in LOSS_CONFIG:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; hyflow serve has {sorted(LOSS_CONFIG)} (custom losses: "
                         "forward_backward_custom runs them on the client)")
    known = LOSS_CONFIG[loss_fn]
    given = dict(config or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"loss_fn_config key(s) {unknown} are not read by {loss_fn!r} (it reads "
                         f"{sorted(known) or 'none'})")
    settings = {}
    for key, default in known.items():
        value = given.get(key, default)
        if value is None:
            raise ValueError(f"{loss_fn!r} needs loss_fn_config={{{key!r}: ...}} (no default)")
        if isinstance(value, str):
            raise ValueError(f"loss_fn_config[{key!r}] must be a number, got the string {value!r}")
        settings[key] = float(value)
    if "clip_low_threshold" in settings and not 0 <= settings["clip_low_threshold"] <= 1 <= \
            settings["clip_high_threshold"]:
        raise ValueError(f"{loss_fn!r} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold (ratios, not "
                         f"epsilons), got {settings['clip_low_threshold']} / {settings['clip_high_threshold']}")
    return settings


def elementwise(loss_fn: str, target_log_probs: Tensor, inputs: Mapping[str, Tensor],
                settings: Mapping[str, float]) -> Tensor:
    """Per-token loss [T] of one datum (module docstring); `settings` from `loss_settings`."""
    if loss_fn == "cross_entropy":
        return -target_log_probs * inputs["weights"]
    advantages = inputs["advantages"]
    log_ratio = target_log_probs - inputs["logprobs"]
    if loss_fn == "dro":
        return -(target_log_probs * advantages - 0.5 * settings["beta"] * log_ratio.pow(2))
    ratio = torch.exp(log_ratio)
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    clipped = ratio.clamp(settings["clip_low_threshold"], settings["clip_high_threshold"])
    if loss_fn == "ppo":
        return -torch.minimum(ratio * advantages, clipped * advantages)
    if loss_fn == "cispo":
        return -clipped.detach() * target_log_probs * advantages
    raise ValueError(f"unknown loss_fn {loss_fn!r}")
