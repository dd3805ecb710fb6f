"""hyflow.algos.tinker_losses: the gradient of each Tinker loss with respect to the trained model's log-probs is the
one its documented formula implies (the values are checked through the service, tests/serve); config checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos.tinker_losses import LOSS_CONFIG, elementwise, loss_settings

floats = st.floats(-3.0, 3.0, allow_nan=False, width=32)


def grad_of(loss_fn: str, lp: torch.Tensor, inputs: dict, config: dict | None = None) -> torch.Tensor:
    lp = lp.clone().requires_grad_(True)
    elementwise(loss_fn, lp, inputs, loss_settings(loss_fn, config)).sum().backward()
    return lp.grad


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(floats, floats, floats), min_size=1, max_size=12))
def test_gradients_are_the_documented_ones(rows):
    lp = torch.tensor([r[0] for r in rows], dtype=torch.float64) - 3.5  # log-probs < 0
    q = torch.tensor([r[1] for r in rows], dtype=torch.float64) * 0.3 + lp.detach()  # sampler near the learner
    adv = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    weights = adv.abs()
    ratio = torch.exp(lp - q)
    inputs = {"logprobs": q, "advantages": adv, "weights": weights}
    torch.testing.assert_close(grad_of("cross_entropy", lp, inputs), -weights)
    torch.testing.assert_close(grad_of("importance_sampling", lp, inputs), -ratio * adv)
    # PPO: d/dlp of -min(rA, clip(r)A) is -rA where the unclipped term is the smaller one, else 0
    unclipped_active = ratio * adv <= ratio.clamp(0.8, 1.2) * adv
    torch.testing.assert_close(grad_of("ppo", lp, inputs), torch.where(unclipped_active, -ratio * adv, 0.0))
    # CISPO: the clipped ratio is a constant coefficient (stop-gradient): -clip(r) A
    torch.testing.assert_close(grad_of("cispo", lp, inputs), -ratio.clamp(0.8, 1.2) * adv)
    # DRO: -(A - beta (lp - q))
    torch.testing.assert_close(grad_of("dro", lp, inputs, {"beta": 0.1}), -(adv - 0.1 * (lp - q)))


def test_ppo_thresholds_are_ratios_from_the_config():
    lp, q, adv = torch.tensor([0.0]), torch.tensor([-0.5]), torch.tensor([1.0])  # ratio e^0.5 = 1.65
    inputs = {"logprobs": q, "advantages": adv}
    assert grad_of("ppo", lp, inputs).item() == 0.0  # clipped at 1.2
    assert grad_of("ppo", lp, inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}).item() == \
        pytest.approx(-1.6487, abs=1e-4)


def test_settings_are_checked_by_name():
    assert loss_settings("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_settings("dro", {"beta": 0.05}) == {"beta": 0.05}
    with pytest.raises(ValueError, match="unknown loss_fn 'grpo'"):
        loss_settings("grpo", None)
    with pytest.raises(ValueError, match=r"\['clip_eps'\] are not read by 'ppo'"):
        loss_settings("ppo", {"clip_eps": 0.2})
    with pytest.raises(ValueError, match="needs loss_fn_config"):
        loss_settings("dro", None)
    with pytest.raises(ValueError, match="ratios, not epsilons"):
        loss_settings("cispo", {"clip_low_threshold": 0.2, "clip_high_threshold": 0.2})
    with pytest.raises(ValueError, match="must be a number"):
        loss_settings("dro", {"beta": "small"})
    assert set(LOSS_CONFIG) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"}
