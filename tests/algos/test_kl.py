"""KL estimators (values, clamps, straight-through gradients), KL controllers, KL-in-reward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)

LOG_PROB = torch.tensor([0.0, -1.0, -2.0], dtype=torch.float64)
REF_LOG_PROB = torch.tensor([-1.0, -1.0, 0.0], dtype=torch.float64)  # x = log π − log π_ref = [1, 0, -2]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("k1", "kl"), [1.0, 0.0, -2.0]),
        (("abs",), [1.0, 0.0, 2.0]),
        (("k2", "mse"), [0.5, 0.0, 2.0]),
        (("k3", "low_var_kl"), [math.exp(-1) + 1 - 1, 0.0, math.exp(2) - 2 - 1]),
    ],
)
def test_estimator_values(names, expected):
    for name in names:
        torch.testing.assert_close(
            kl_penalty(LOG_PROB, REF_LOG_PROB, name), torch.tensor(expected, dtype=torch.float64)
        )


def test_k3_is_clamped_and_finite_far_from_the_reference():
    log_prob = torch.tensor([-1000.0, -25.0, -3.0, 25.0, 1000.0], dtype=torch.float64, requires_grad=True)
    k3 = kl_penalty(log_prob, torch.zeros(5, dtype=torch.float64), "k3")
    # y = ref − logp: 1000 and 25 clamp to 20 -> e^20 − 21 -> 10; y = 3 -> e^3 − 4 = 16.09 -> 10;
    # y = −25, −1000 clamp to −20 -> e^−20 + 19 -> 10
    torch.testing.assert_close(k3, torch.full((5,), 10.0, dtype=torch.float64))
    k3.sum().backward()
    assert torch.all(log_prob.grad == 0)
    small = kl_penalty(torch.tensor([-0.5]), torch.tensor([0.0]), "low_var_kl")
    assert small.item() == pytest.approx(math.exp(0.5) - 0.5 - 1)


@pytest.mark.parametrize("base", KL_ESTIMATORS)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_straight_through_value_is_base_and_gradient_is_k2(base, seed):
    gen = torch.Generator().manual_seed(seed)
    log_prob = (-3 * torch.rand(2, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    ref = -3 * torch.rand(2, 5, generator=gen, dtype=torch.float64)
    value = kl_penalty(log_prob, ref, f"{base}+")
    torch.testing.assert_close(value, kl_penalty(log_prob, ref, base))
    value.sum().backward()
    torch.testing.assert_close(log_prob.grad, (log_prob - ref).detach())


def test_base_gradients_differ_from_k2_where_expected():
    log_prob = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0, -1.0], dtype=torch.float64)
    kl_penalty(log_prob, ref, "k1").sum().backward()
    torch.testing.assert_close(log_prob.grad, torch.ones(2, dtype=torch.float64))


def test_full_and_unknown_names_are_rejected_with_the_valid_list():
    with pytest.raises(ValueError, match=r"'full'.*Full-vocabulary KL needs logits.*k1, kl, abs"):
        kl_penalty(LOG_PROB, REF_LOG_PROB, "full")
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'k4'.*Valid estimators: .*low_var_kl\+"):
        kl_penalty(LOG_PROB, REF_LOG_PROB, "k4")


# ----- controllers -----


def test_fixed_controller_never_changes():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=1000)
    assert ctrl.value == 0.05
    assert ctrl.state_dict() == {"value": 0.05}


def test_adaptive_controller_update_numbers():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=10)  # e = 0.5 -> clipped 0.2; ×(1 + 0.2·10/100)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=torch.tensor(0.05), n_steps=10)  # e = −0.5 -> −0.2; ×0.98
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 0.98)
    ctrl.update(current_kl=0.11, n_steps=50)  # e = 0.1 (inside the clip); ×1.05
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 0.98 * 1.05)


def test_adaptive_controller_checkpoint_round_trip():
    ctrl = AdaptiveKLController(0.2, 0.1, 1000)
    ctrl.update(0.3, 64)
    restored = AdaptiveKLController(0.2, 0.1, 1000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    ctrl.update(0.02, 32)
    restored.update(0.02, 32)
    assert restored.value == ctrl.value


def test_adaptive_controller_rejects_bad_horizon_and_target():
    with pytest.raises(ValueError, match=r"horizon > 0.*got 0.*kl_ctrl.type=fixed"):
        AdaptiveKLController(0.1, 0.1, 0)
    with pytest.raises(ValueError, match=r"target_kl > 0"):
        AdaptiveKLController(0.1, 0.0, 100)


def test_make_kl_controller():
    fixed = make_kl_controller("fixed", kl_coef=0.01)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    adaptive = make_kl_controller("adaptive", kl_coef=0.02, target_kl=0.5, horizon=50)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.02, 0.5, 50)
    with pytest.raises(ValueError, match=r"unknown kl_ctrl.type 'linear'; valid types: fixed, adaptive"):
        make_kl_controller("linear")


# ----- KL in the reward -----


def test_apply_kl_penalty_hand_case():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.full((2, 3), -1.0)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, math.inf]])  # inf sits under the mask
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    # k1 = old − ref = [[0.5, 0, −0.5], [1, 0, masked]]
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [-0.1, 2.0, 0.0]]))
    assert metrics["actor/reward_kl_penalty"].item() == pytest.approx((0.0 + 0.5) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"].item() == pytest.approx(0.1)

    ctrl = AdaptiveKLController(0.1, target_kl=0.5, horizon=10)
    ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=2)  # e = −0.5 -> −0.2; ×(1 − 0.04)
    assert ctrl.value == pytest.approx(0.1 * 0.96)


def test_apply_kl_penalty_uses_the_named_estimator_and_no_gradient():
    scores = torch.zeros(1, 2)
    old = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, torch.ones(1, 2), kl_coef=1.0, kl_penalty="mse")
    torch.testing.assert_close(rewards, torch.tensor([[-0.5, -2.0]]))
    assert not rewards.requires_grad
    assert metrics["actor/reward_kl_penalty"].item() == pytest.approx(1.25)
