"""Advantage estimators: hand-computed cases, masking and singleton rules, and loop references."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos import advantages as adv
from hyflow.algos.masked import masked_whiten
from hyflow.algos.registry import ADVANTAGE_ESTIMATORS, get_advantage_estimator

ESTIMATORS = {
    "gae",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "optimal_token_baseline",
}
GROUP_ESTIMATORS = [
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus_baseline",
    "opo",
    "gpg",
    "optimal_token_baseline",
]
FAST = settings(max_examples=25, deadline=None, derandomize=True)


def outcome_batch(scores, lengths, T):
    """Rewards [B, T] with each score on the last valid token, and the right-padded mask."""
    B = len(scores)
    rewards = torch.zeros(B, T, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        mask[i, :length] = 1
        rewards[i, length - 1] = score
    return rewards, mask


def full_kwargs(rewards, mask, index, seed=0):
    """The uniform keyword set the trainer passes, with plausible random tensors."""
    gen = torch.Generator().manual_seed(seed)
    B, T = rewards.shape
    probs = torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    return dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        values=torch.randn(B, T, generator=gen, dtype=torch.float64),
        gamma=0.9,
        lam=0.8,
        reward_baselines=torch.randn(B, generator=gen, dtype=torch.float64),
        norm_adv_by_std_in_grpo=True,
        epsilon=1e-6,
        old_log_prob=probs.log(),
        sum_pi_squared=probs**2 + 0.01,
        rollout_is_weights=torch.rand(B, T, generator=gen, dtype=torch.float64) + 0.5,
    )


@st.composite
def random_batches(draw, discrete=False):
    """A random batch: B samples in random groups, masks with padding and gaps, rewards on valid tokens."""
    B = draw(st.integers(1, 8))
    T = draw(st.integers(1, 6))
    index = draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = (torch.rand(B, T, generator=gen) < 0.75).double()
    if discrete:
        rewards = torch.tensor([0.0, 0.5, 1.0, 2.0], dtype=torch.float64)[
            torch.randint(0, 4, (B, T), generator=gen)
        ]
        rewards = rewards * (torch.rand(B, T, generator=gen) < 0.4)
    else:
        rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    return full_kwargs(rewards, mask, index, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))


# ----------------------------------------------------------------------------------------------------------
# registry and calling convention


def test_registry_holds_exactly_the_ten_estimators_and_verls_vectorized_names():
    mine = {name for name, fn in ADVANTAGE_ESTIMATORS.items() if fn.__module__ == adv.__name__}
    assert mine == ESTIMATORS | {"grpo_vectorized", "rloo_vectorized", "gdpo", "tir_optimal_token_baseline"}
    assert ADVANTAGE_ESTIMATORS["grpo_vectorized"] is adv.grpo and ADVANTAGE_ESTIMATORS["rloo_vectorized"] is adv.rloo
    assert get_advantage_estimator("grpo") is adv.grpo


def test_every_estimator_accepts_the_uniform_kwargs_and_zeroes_masked_tokens():
    rewards, mask = outcome_batch([1.0, 0.0, 2.0, 1.0], [3, 2, 4, 1], T=4)
    mask[2, 1] = 0  # a tool-token gap inside a multi-turn response
    kwargs = full_kwargs(rewards, mask, ["a", "a", "b", "b"])
    for name in ESTIMATORS:
        advantages, returns = get_advantage_estimator(name)(**kwargs, config=None, num_repeat=2)
        assert advantages.shape == returns.shape == rewards.shape, name
        assert torch.isfinite(advantages).all() and torch.isfinite(returns).all(), name
        assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all(), name


def test_outputs_carry_no_autograd_graph():
    rewards, mask = outcome_batch([1.0, 0.0], [2, 2], T=2)
    kwargs = full_kwargs(rewards, mask, [0, 0])
    kwargs["values"].requires_grad_(True)
    kwargs["token_level_rewards"].requires_grad_(True)
    for name in ESTIMATORS:
        advantages, returns = get_advantage_estimator(name)(**kwargs)
        assert not advantages.requires_grad and not returns.requires_grad, name


@pytest.mark.parametrize(
    ("name", "drop", "match"),
    [
        ("gae", "values", r"gae needs `values`.*critic \(critic\.enable=True\)"),
        ("remax", "reward_baselines", r"remax needs `reward_baselines`.*greedy rollout.*adv_estimator=remax"),
        ("optimal_token_baseline", "old_log_prob", r"optimal_token_baseline needs `old_log_prob`.*actor"),
        (
            "optimal_token_baseline",
            "sum_pi_squared",
            r"needs `sum_pi_squared`.*calculate_sum_pi_squared=True",
        ),
    ]
    + [(name, "index", rf"{name} needs `index`.*`uid` column.*rollout\.n") for name in GROUP_ESTIMATORS],
)
def test_missing_argument_names_it_and_its_source(name, drop, match):
    rewards, mask = outcome_batch([1.0, 0.0], [2, 2], T=2)
    kwargs = full_kwargs(rewards, mask, [0, 0])
    del kwargs[drop]
    with pytest.raises(ValueError, match=match):
        get_advantage_estimator(name)(**kwargs)


def test_mismatched_sizes_are_named():
    rewards, mask = outcome_batch([1.0, 0.0, 1.0], [2, 2, 2], T=2)
    with pytest.raises(ValueError, match=r"`index` has 2 entries but the batch has 3 samples"):
        adv.grpo(rewards, mask, index=[0, 0])
    with pytest.raises(
        ValueError, match=r"gae: `values` has shape \(3, 1\) but token_level_rewards has \(3, 2\)"
    ):
        adv.gae(rewards, mask, values=torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"remax: `reward_baselines` has 2 entries but the batch has 3"):
        adv.remax(rewards, mask, reward_baselines=torch.zeros(2))


def test_otb_accepts_verl_keyword_old_log_probs():
    rewards, mask = outcome_batch([1.0, 0.0], [2, 2], T=2)
    kwargs = full_kwargs(rewards, mask, [0, 0])
    expected = adv.optimal_token_baseline(**kwargs)
    kwargs["old_log_probs"] = kwargs.pop("old_log_prob")
    assert all(torch.equal(a, b) for a, b in zip(adv.optimal_token_baseline(**kwargs), expected))


def test_index_may_be_uuid_strings_numpy_or_tensor():
    rewards, mask = outcome_batch([1.0, 0.0, 2.0, 5.0], [1, 2, 1, 2], T=2)
    u, v = str(uuid.uuid4()), str(uuid.uuid4())
    as_list = adv.grpo(rewards, mask, index=[u, v, u, v])[0]
    as_numpy = adv.grpo(rewards, mask, index=np.array([u, v, u, v], dtype=object))[0]
    as_tensor = adv.grpo(rewards, mask, index=torch.tensor([7, 3, 7, 3]))[0]
    assert torch.equal(as_list, as_numpy) and torch.equal(as_list, as_tensor)


# ----------------------------------------------------------------------------------------------------------
# hand-computed cases


def test_grpo_hand_values_and_dr_grpo():
    # groups interleaved: a = [1, 2, 3] (mean 2, unbiased std 1), b = [0, 4] (mean 2, std sqrt(8))
    rewards, mask = outcome_batch([1.0, 0.0, 2.0, 3.0, 4.0], [1, 2, 3, 2, 1], T=3)
    index = ["a", "b", "a", "a", "b"]
    advantages, returns = adv.grpo(rewards, mask, index=index, epsilon=1e-6)
    s8 = math.sqrt(8.0)
    expected_B = torch.tensor([-1 / (1 + 1e-6), -2 / (s8 + 1e-6), 0.0, 1 / (1 + 1e-6), 2 / (s8 + 1e-6)])
    torch.testing.assert_close(advantages, expected_B.double()[:, None] * mask)
    assert torch.equal(advantages, returns)
    per_sample = advantages[:, 0]
    assert abs(float(per_sample[[0, 2, 3]].sum())) < 1e-12 and abs(float(per_sample[[1, 4]].sum())) < 1e-12

    dr, _ = adv.grpo(rewards, mask, index=index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(dr, torch.tensor([-1.0, -2.0, 0.0, 1.0, 2.0]).double()[:, None] * mask)


def test_rloo_is_reward_minus_mean_of_the_others():
    rewards, mask = outcome_batch([1.0, 2.0, 6.0, 3.0, 5.0], [2, 1, 2, 2, 1], T=2)
    advantages, returns = adv.rloo(rewards, mask, index=[0, 0, 0, 1, 1])
    expected_B = torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5, 3 - 5.0, 5 - 3.0]).double()
    torch.testing.assert_close(advantages, expected_B[:, None] * mask)
    assert torch.equal(advantages, returns)


def test_grpo_passk_credits_only_the_best_by_its_margin():
    # group 0: [1, 3, 2] -> sample 1 wins by 1, std 1; group 1: tie at the top [2, 2] -> all 0
    rewards, mask = outcome_batch([1.0, 3.0, 2.0, 2.0, 2.0], [1, 2, 2, 1, 1], T=2)
    index = [0, 0, 0, 1, 1]
    normed, returns = adv.grpo_passk(rewards, mask, index=index, epsilon=1e-6)
    torch.testing.assert_close(normed, torch.tensor([0.0, 1 / (1 + 1e-6), 0, 0, 0]).double()[:, None] * mask)
    assert torch.equal(normed, returns)
    raw, _ = adv.grpo_passk(rewards, mask, index=index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(raw, torch.tensor([0.0, 1.0, 0, 0, 0]).double()[:, None] * mask)


def test_gae_with_gamma_lam_one_returns_are_sums_of_future_valid_rewards():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 9.0, 3.0]]).double()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]]).double()
    values = torch.tensor([[0.3, -0.2, 0.5, 4.0, 0.1]]).double()
    advantages, returns = adv.gae(rewards, mask, values=values, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[6.0, 5.0, 5.0, 0.0, 3.0]]).double())
    raw_adv = (returns - values) * mask
    torch.testing.assert_close(advantages, masked_whiten(raw_adv, mask) * mask)


def test_gae_hand_computed_gamma_lam():
    # δ2 = 1 - .4 = .6;  δ1 = .9*.4 - .2 = .16;  δ0 = .9*.2 - .5 = -.32;  γλ = .72
    # A2 = .6;  A1 = .16 + .72*.6 = .592;  A0 = -.32 + .72*.592 = .10624
    rewards = torch.tensor([[0.0, 0.0, 1.0]]).double()
    values = torch.tensor([[0.5, 0.2, 0.4]]).double()
    mask = torch.ones(1, 3).double()
    advantages, returns = adv.gae(rewards, mask, values=values, gamma=0.9, lam=0.8)
    raw_adv = torch.tensor([[0.10624, 0.592, 0.6]]).double()
    torch.testing.assert_close(returns, raw_adv + values)
    torch.testing.assert_close(advantages, masked_whiten(raw_adv, mask))


def test_gae_multi_turn_skips_a_masked_span():
    # the same trajectory as the hand case, with a two-token tool span (junk reward and values) in the middle
    rewards = torch.tensor([[0.0, 0.0, 9.0, -9.0, 1.0]]).double()
    values = torch.tensor([[0.5, 0.2, 7.0, -3.0, 0.4]]).double()
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]]).double()
    advantages, returns = adv.gae(rewards, mask, values=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(returns, torch.tensor([[0.60624, 0.792, 0.0, 0.0, 1.0]]).double())
    raw_adv = torch.tensor([[0.10624, 0.592, 0.0, 0.0, 0.6]]).double()
    torch.testing.assert_close(advantages, masked_whiten(raw_adv, mask) * mask)


def test_reinforce_plus_plus_discounts_and_restarts_at_masked_tokens():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 5.0, 2.0]]).double()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]).double()
    advantages, returns = adv.reinforce_plus_plus(rewards, mask, gamma=0.5)
    # row 0: G2 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5*1 = 1.5; row 1: the gap resets, G0 = 1
    expected_returns = torch.tensor([[1.5, 1.0, 2.0], [1.0, 0.0, 2.0]]).double()
    torch.testing.assert_close(returns, expected_returns)
    valid = torch.tensor([1.5, 1.0, 2.0, 1.0, 2.0]).double()
    whitened = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    torch.testing.assert_close(advantages[mask.bool()], whitened)
    assert (advantages[mask == 0] == 0).all()


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens():
    rewards, mask = outcome_batch([1.0, 3.0, 0.0, 4.0], [2, 1, 1, 1], T=2)
    advantages, returns = adv.reinforce_plus_plus_baseline(rewards, mask, index=[0, 0, 1, 1])
    # centred: [-1, 1, -2, 2] on 2, 1, 1, 1 tokens -> token values [-1, -1, 1, -2, 2]
    tokens = torch.tensor([-1.0, -1.0, 1.0, -2.0, 2.0]).double()
    whitened = (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    torch.testing.assert_close(advantages[mask.bool()], whitened)
    assert torch.equal(advantages, returns)


def test_remax_subtracts_the_greedy_reward_from_the_return_to_go():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.5, 7.0, 1.0]]).double()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]).double()
    advantages, returns = adv.remax(rewards, mask, reward_baselines=torch.tensor([0.25, 1.0]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0], [1.5, 0.0, 1.0]]).double())
    torch.testing.assert_close(advantages, torch.tensor([[0.75, 0.75, 0.0], [0.5, 0.0, 0.0]]).double())


def test_opo_baseline_is_length_weighted():
    # lengths 1 and 3, rewards 1 and 0: b = (1*1 + 3*0) / 4 = .25 (a plain mean would give .5)
    rewards, mask = outcome_batch([1.0, 0.0], [1, 3], T=3)
    advantages, returns = adv.opo(rewards, mask, index=[0, 0])
    torch.testing.assert_close(advantages, torch.tensor([0.75, -0.25]).double()[:, None] * mask)
    assert torch.equal(advantages, returns)


def test_gpg_scales_by_batch_over_nonzero_rewards():
    # B = 4, two nonzero rewards -> alpha = 2; group means .5 and 1
    rewards, mask = outcome_batch([1.0, 0.0, 0.0, 2.0], [1, 1, 2, 2], T=2)
    advantages, _ = adv.gpg(rewards, mask, index=["a", "a", "b", "b"])
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, -2.0, 2.0]).double()[:, None] * mask)
    halved, _ = adv.gpg(rewards, mask, index=["a", "a", "b", "b"], f_norm=2.0)
    torch.testing.assert_close(halved, advantages / 2)
    zero_rewards = torch.zeros_like(rewards)
    assert (adv.gpg(zero_rewards, mask, index=["a", "a", "b", "b"])[0] == 0).all()


def test_otb_hand_case():
    # two samples of one group, one token each: π = .5, Σπ² = .5 -> w = 1 - 1 + .5 = .5 for both, so the
    # baseline is the plain mean of the returns (1 and 3): advantages -1 and +1
    rewards = torch.tensor([[1.0], [3.0]]).double()
    mask = torch.ones(2, 1).double()
    half = torch.full((2, 1), 0.5).double()
    advantages, returns = adv.optimal_token_baseline(
        rewards, mask, index=[0, 0], old_log_prob=half.log(), sum_pi_squared=half, epsilon=0.0
    )
    torch.testing.assert_close(advantages, torch.tensor([[-1.0], [1.0]]).double())
    torch.testing.assert_close(returns, rewards)


# ----------------------------------------------------------------------------------------------------------
# singleton groups, masking


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_singleton_groups_get_zero_advantage(name):
    rewards, mask = outcome_batch([1.0, 0.0, 2.0, 3.0, 4.0], [2, 1, 3, 2, 3], T=3)
    kwargs = full_kwargs(rewards, mask, ["solo", "a", "a", "b", "b"])
    advantages, _ = get_advantage_estimator(name)(**kwargs)
    assert (advantages[0] == 0).all()
    assert advantages[1:].abs().sum() > 0
    kwargs["index"] = ["p", "q", "r", "s", "t"]
    assert (get_advantage_estimator(name)(**kwargs)[0] == 0).all()


def test_nan_and_inf_at_masked_positions_do_not_leak():
    rewards, mask = outcome_batch([1.0, 0.0, 2.0, 3.0], [2, 1, 3, 2], T=4)
    mask[2, 1] = 0
    clean = full_kwargs(rewards, mask, [0, 0, 1, 1])
    dirty = dict(clean)
    for key in ("token_level_rewards", "values", "old_log_prob", "sum_pi_squared", "rollout_is_weights"):
        dirty[key] = clean[key].masked_fill(mask == 0, float("nan"))
    dirty["values"] = dirty["values"].masked_fill((mask == 0) & (torch.arange(4) % 2 == 0), float("inf"))
    for name in ESTIMATORS:
        fn = get_advantage_estimator(name)
        for got, want in zip(fn(**dirty), fn(**clean)):
            assert torch.equal(got, want), name


@FAST
@given(batch=random_batches(), seed=st.integers(0, 2**31 - 1))
def test_masked_positions_never_change_any_result(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    masked = batch["response_mask"] == 0
    changed = dict(batch)
    for key in ("token_level_rewards", "values", "old_log_prob", "sum_pi_squared", "rollout_is_weights"):
        noise = torch.randn(masked.shape, generator=gen, dtype=torch.float64) * 10
        changed[key] = torch.where(masked, noise, batch[key])
    for name in ESTIMATORS:
        fn = get_advantage_estimator(name)
        for got, want in zip(fn(**changed), fn(**batch)):
            assert torch.equal(got, want), name


# ----------------------------------------------------------------------------------------------------------
# loop references: the vectorised estimators against per-group Python loops


def reference_group_advantages(name, scores, lengths, index, epsilon=1e-6, norm=True, f_norm=1.0):
    """Per-sample advantages computed one group at a time, in plain Python."""
    B = len(scores)
    nonzero = sum(1 for s in scores if s != 0)
    out = [0.0] * B
    for g in set(index):
        members = [i for i in range(B) if index[i] == g]
        n = len(members)
        if n == 1:
            continue
        rs = [scores[i] for i in members]
        mean = sum(rs) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1))
        for k, i in enumerate(members):
            if name == "grpo":
                out[i] = (rs[k] - mean) / (std + epsilon) if norm else rs[k] - mean
            elif name == "rloo":
                out[i] = rs[k] - (sum(rs) - rs[k]) / (n - 1)
            elif name == "opo":
                total = sum(lengths[j] for j in members)
                base = sum(lengths[j] * scores[j] for j in members) / total if total > 0 else 0.0
                out[i] = rs[k] - base
            elif name == "gpg":
                out[i] = B / max(nonzero, 1) * (rs[k] - mean) / f_norm
            elif name in ("reinforce_plus_plus_baseline", "grpo_passk"):
                out[i] = rs[k] - mean
        if name == "grpo_passk":
            best = max(range(n), key=lambda k: (rs[k], -k))
            second = max(rs[k] for k in range(n) if k != best)
            for i in members:
                out[i] = 0.0
            out[members[best]] = (rs[best] - second) / ((std + epsilon) if norm else 1.0)
    return out


def reference_whiten_tokens(values_B, lengths, keep):
    """Whitening of per-sample values repeated over `lengths` tokens, over the samples in `keep`."""
    tokens = [values_B[i] for i in range(len(values_B)) if keep[i] for _ in range(lengths[i])]
    if not tokens:
        return [0.0] * len(values_B)
    n = len(tokens)
    mean = sum(tokens) / n
    var = sum((v - mean) ** 2 for v in tokens) / (n - 1) if n > 1 else 0.0
    return [(v - mean) / math.sqrt(var + 1e-8) if keep[i] else 0.0 for i, v in enumerate(values_B)]


@FAST
@given(batch=random_batches(discrete=True), norm=st.booleans(), f_norm=st.sampled_from([1.0, 0.5]))
def test_vectorised_group_estimators_match_per_group_loops(batch, norm, f_norm):
    mask = batch["response_mask"]
    scores = (batch["token_level_rewards"] * mask).sum(-1).tolist()
    lengths = [int(n) for n in mask.sum(-1).tolist()]
    index = batch["index"]
    for name in ("grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"):
        got, _ = get_advantage_estimator(name)(**{**batch, "norm_adv_by_std_in_grpo": norm, "f_norm": f_norm})
        want_B = reference_group_advantages(name, scores, lengths, index, norm=norm, f_norm=f_norm)
        if name == "reinforce_plus_plus_baseline":
            keep = [index.count(g) > 1 for g in index]
            want_B = reference_whiten_tokens(want_B, lengths, keep)
        want = torch.tensor(want_B, dtype=torch.float64)[:, None] * mask
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=name)


def reference_otb(rewards, mask, index, log_prob, sum_pi_sq, is_weights, zero_tail, epsilon):
    """OTB one sample and one position at a time."""
    B, T = len(rewards), len(rewards[0])
    returns = [
        [sum(rewards[i][k] * mask[i][k] for k in range(t, T)) * mask[i][t] for t in range(T)]
        for i in range(B)
    ]
    weights = []
    for i in range(B):
        running, row = 0.0, []
        for t in range(T):
            w = 1 - 2 * math.exp(log_prob[i][t]) + sum_pi_sq[i][t]
            if is_weights is not None:
                w *= is_weights[i][t] ** 2
            running += w * mask[i][t]
            row.append(running)
        weights.append(row)
    lengths = [sum(row) for row in mask]
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        members = [j for j in range(B) if index[j] == index[i]]
        if len(members) == 1:
            continue
        member_lengths = sorted(lengths[j] for j in members)
        longest_alone = lengths[i] == member_lengths[-1] and member_lengths[-1] > member_lengths[-2]
        for t in range(T):
            num = sum(mask[j][t] * weights[j][t] * returns[j][t] for j in members)
            den = sum(mask[j][t] * weights[j][t] for j in members) + epsilon
            baseline = 0.0 if zero_tail and longest_alone and t >= member_lengths[-2] else num / den
            out[i][t] = (returns[i][t] - baseline) * mask[i][t]
    return out, returns


@FAST
@given(batch=random_batches(), zero_tail=st.booleans(), use_is=st.booleans())
def test_otb_matches_slow_reference(batch, zero_tail, use_is):
    is_weights = batch["rollout_is_weights"] if use_is else None
    got_adv, got_returns = adv.optimal_token_baseline(
        **{**batch, "rollout_is_weights": is_weights, "handle_zero_tail": zero_tail, "epsilon": 1e-8}
    )
    want_adv, want_returns = reference_otb(
        batch["token_level_rewards"].tolist(),
        batch["response_mask"].tolist(),
        batch["index"],
        batch["old_log_prob"].tolist(),
        batch["sum_pi_squared"].tolist(),
        None if is_weights is None else is_weights.tolist(),
        zero_tail,
        1e-8,
    )
    torch.testing.assert_close(got_adv, torch.tensor(want_adv, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_returns, torch.tensor(want_returns, dtype=torch.float64))


def reference_gae(rewards, values, mask, gamma, lam):
    """GAE on the valid tokens of one row, compacted (the masked span removed), then scattered back."""
    valid = [t for t in range(len(mask)) if mask[t]]
    adv_row, ret_row = [0.0] * len(mask), [0.0] * len(mask)
    next_value = next_adv = 0.0
    for t in reversed(valid):
        next_adv = rewards[t] + gamma * next_value - values[t] + gamma * lam * next_adv
        next_value = values[t]
        adv_row[t], ret_row[t] = next_adv, next_adv + values[t]
    return adv_row, ret_row


@FAST
@given(batch=random_batches())
def test_gae_matches_a_compacted_per_row_reference(batch):
    mask = batch["response_mask"]
    got_adv, got_returns = adv.gae(**batch)
    rows = [
        reference_gae(r, v, m, batch["gamma"], batch["lam"])
        for r, v, m in zip(batch["token_level_rewards"].tolist(), batch["values"].tolist(), mask.tolist())
    ]
    raw_adv = torch.tensor([a for a, _ in rows], dtype=torch.float64)
    torch.testing.assert_close(got_returns, torch.tensor([r for _, r in rows], dtype=torch.float64))
    torch.testing.assert_close(got_adv, masked_whiten(raw_adv, mask) * mask)
