"""The rest of verl's algorithm names: token-sum aggregation, the *_vectorized estimators, DPPO-TV/KL, DRO,
PF-PPO resampling, kl_penalty's verl argument names; each against its published formula (hand-computed on small
tensors, float64) and verl's code (verl/trainer/ppo/core_algos.py at verl-project/verl 1dda039)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos import agg_loss, kl_penalty, pf_ppo_resample_indices, pf_ppo_weights
from hyflow.algos.registry import get_advantage_estimator, get_policy_loss

D = torch.float64


def test_token_sum_is_the_masked_sum_and_micro_batch_invariant():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-sum").item() == 1 + 2 + 4
    parts = agg_loss(loss[:1], mask[:1], "token-sum") + agg_loss(loss[1:], mask[1:], "token-sum")
    assert parts.item() == agg_loss(loss, mask, "token-sum").item()


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_vectorized_names_compute_the_same_advantages(name):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.zeros(8, 5, dtype=D)
    rewards[:, -1] = torch.randn(8, generator=gen, dtype=D)
    mask = torch.ones(8, 5, dtype=torch.long)
    index = [0, 0, 0, 0, 1, 1, 1, 1]
    plain = get_advantage_estimator(name)(rewards, mask, index=index)
    vectorized = get_advantage_estimator(f"{name}_vectorized")(rewards, mask, index=index)
    for a, b in zip(plain, vectorized):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert get_advantage_estimator(f"{name}_vectorized").requires == ("index",)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12), st.integers(0, 2**31 - 1), st.booleans())
def test_vectorized_names_equal_their_twins_on_any_grouping(groups, seed, norm_by_std):
    # verl registers compute_grpo_vectorized_outcome_advantage / compute_rloo_vectorized_outcome_advantage as
    # vectorised rewrites of grpo / rloo: same advantages for any group layout, singletons included.
    gen = torch.Generator().manual_seed(seed)
    B = len(groups)
    mask = (torch.rand(B, 4, generator=gen) < 0.8).long()
    mask[:, 0] = 1
    rewards = torch.randn(B, 4, generator=gen, dtype=D) * mask
    for name in ("grpo", "rloo"):
        plain = get_advantage_estimator(name)(rewards, mask, index=groups, norm_adv_by_std_in_grpo=norm_by_std)
        twin = get_advantage_estimator(f"{name}_vectorized")(rewards, mask, index=groups,
                                                             norm_adv_by_std_in_grpo=norm_by_std)
        for a, b in zip(plain, twin):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def _dppo_case():
    # token 0: A>0, p rises 0.30 -> 0.60 (TV 0.30 > 0.2: outside); token 1: A>0, p 0.30 -> 0.40 (inside);
    # token 2: A<0, p falls 0.50 -> 0.20 (TV -0.30 < -0.2: outside); token 3: A<0, p 0.50 -> 0.45 (inside)
    p_old = torch.tensor([[0.30, 0.30, 0.50, 0.50]], dtype=D)
    p_new = torch.tensor([[0.60, 0.40, 0.20, 0.45]], dtype=D)
    adv = torch.tensor([[1.0, 2.0, -1.0, -3.0]], dtype=D)
    return p_old.log(), p_new.log().requires_grad_(), adv, torch.ones(1, 4)


def test_dppo_tv_masks_tokens_outside_the_tv_region():
    old, new, adv, mask = _dppo_case()
    loss, metrics = get_policy_loss("dppo_tv")(old, new, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    ratio = (new - old).exp().detach()
    valid = torch.tensor([[0.0, 1.0, 0.0, 1.0]], dtype=D)
    want = (-adv * ratio.clamp(max=3.0) * new.detach() * valid).mean()
    assert loss.item() == pytest.approx(want.item())
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()  # gradient -A·sg(r)/N on valid tokens only
    torch.testing.assert_close(new.grad, -adv * ratio * valid / 4)


def test_dppo_kl_uses_the_binary_kl_region():
    old, new, adv, mask = _dppo_case()
    p, q = new.detach().exp(), old.exp()
    binary_kl = q * (old - new.detach()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    # verl: A>0 valid if KL_b <= δ or p <= p_old; A<0 valid if KL_b <= δ or p >= p_old (δ = 0.05 here)
    want_valid = torch.where(adv > 0, (binary_kl <= 0.05) | (p <= q), (binary_kl <= 0.05) | (p >= q))
    assert want_valid.tolist() == [[False, True, False, True]]  # hand check: KL_b = 0.184, 0.022, 0.223, 0.005
    loss, metrics = get_policy_loss("dppo_kl")(old, new, adv, mask, clip_ratio=0.05, clip_ratio_c=3.0)
    ratio = (new - old).exp().detach()
    want = (-adv * ratio * new.detach() * want_valid.to(D)).mean()
    assert loss.item() == pytest.approx(want.item())
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)


def test_dppo_truncates_the_importance_ratio_at_clip_ratio_c():
    old = torch.tensor([[math.log(0.01)]], dtype=D)
    new = torch.tensor([[math.log(0.2)]], dtype=D, requires_grad=True)  # ratio 20, TV 0.19 < 0.2: inside
    adv = torch.tensor([[1.0]], dtype=D)
    loss, metrics = get_policy_loss("dppo_tv")(old, new, adv, torch.ones(1, 1), clip_ratio=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(-3.0 * math.log(0.2))
    assert metrics["pg_clipfrac_lower"].item() == 1.0


def test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty():
    old = torch.tensor([[-1.0, -2.0]], dtype=D)
    new = torch.tensor([[-0.5, -2.5]], dtype=D, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]], dtype=D)
    loss, metrics = get_policy_loss("dro")(old, new, adv, torch.ones(1, 2), dro_beta=0.4)
    want = -((new.detach() * adv) - 0.5 * 0.4 * (new.detach() - old) ** 2).mean()
    assert loss.item() == pytest.approx(want.item())
    assert metrics["ppo_kl"].item() == pytest.approx(0.0)  # mean(-(log π − log π_old)) = -(0.5 - 0.5)/2
    loss.backward()  # d/dlogp = -(A - β(logp - logp_old)) / N
    torch.testing.assert_close(new.grad, -(adv - 0.4 * (new.detach() - old)) / 2)
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        get_policy_loss("dro")(old, new, adv, torch.ones(1, 2))


def test_pf_ppo_weights_follow_the_three_methods():
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=D)
    torch.testing.assert_close(pf_ppo_weights(scores, "pow", 2.0), scores.abs() ** 2 + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(scores, "max_min"), torch.tensor([0, 1, 0, 1], dtype=D) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(scores, "max_random"), torch.tensor([.1, .1, .1, .4], dtype=D) + 1e-8)
    with pytest.raises(ValueError, match="reweight_method='nope'"):
        pf_ppo_weights(scores, "nope")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=12), st.integers(0, 2**31 - 1))
def test_pf_ppo_resamples_to_the_same_size_and_never_draws_a_zero_weight_sample_often(scores, seed):
    scores_B = torch.tensor(scores, dtype=D)
    rows = pf_ppo_resample_indices(scores_B, "max_min", generator=torch.Generator().manual_seed(seed))
    assert rows.shape == (len(scores),) and rows.dtype == torch.int64
    assert int(rows.min()) >= 0 and int(rows.max()) < len(scores)
    extreme = (scores_B == scores_B.max()) | (scores_B == scores_B.min())
    assert bool(extreme[rows].all())  # the others have weight 1e-8: drawn with probability ~1e-8 each
    again = pf_ppo_resample_indices(scores_B, "max_min", generator=torch.Generator().manual_seed(seed))
    assert torch.equal(rows, again)  # seeded: a run and its resume draw the same samples


def test_kl_penalty_takes_verl_argument_names():
    logprob = torch.tensor([[-1.0, -0.5]], dtype=D)
    ref_logprob = torch.tensor([[-1.5, -0.5]], dtype=D)
    by_keyword = kl_penalty(logprob=logprob, ref_logprob=ref_logprob, kl_penalty="k1")
    torch.testing.assert_close(by_keyword, logprob - ref_logprob)
    with pytest.raises(ValueError, match="Full-vocabulary KL"):
        kl_penalty(logprob, ref_logprob, "full")


def test_config_accepts_the_new_names_and_refuses_what_is_not_built():
    import warnings

    from hyflow.config import load_config, validate_config
    from hyflow.config.keys import ConfigError

    base = ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.n=2"]
    for extra in (["algorithm.adv_estimator=grpo_vectorized"], ["algorithm.adv_estimator=rloo_vectorized"],
                  ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv"],
                  ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_kl"],
                  ["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
                  ["actor_rollout_ref.actor.loss_agg_mode=token-sum"],
                  ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]"],
                  ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
                   "algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=true"],
                  ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min"]):
        validate_config(load_config([*base, *extra]))
    for extra, message in (
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "needs actor_rollout_ref.actor.policy_loss.dro_beta > 0"),
        (["algorithm.kl_penalty=full", "algorithm.use_kl_in_reward=true"], "algorithm.kl_penalty=full (full-vocabulary KL) is not supported"),
        (["algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=true"], "PF-PPO resamples the batch after GAE"),
        (["algorithm.adv_estimator=gdpo"], "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], "needs algorithm.rollout_correction.bypass_mode=true"),
    ):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            validate_config(load_config([*base, *extra]))
    with pytest.warns(UserWarning, match="aggregates its loss with seq-mean-token-mean"):
        validate_config(load_config([*base, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_config(load_config([*base, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                                     "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]))


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo_vectorized", "gpg", "opo"])
def test_a_group_estimator_with_one_sample_per_prompt_warns_from_the_registry(name):
    from hyflow.config import load_config, validate_config

    with pytest.warns(UserWarning, match="every group is a singleton"):
        validate_config(load_config(["actor_rollout_ref.model.path=/m", f"algorithm.adv_estimator={name}",
                                     "actor_rollout_ref.rollout.n=1"]))


def test_gdpo_normalises_each_component_in_its_group_then_whitens_the_weighted_sum():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    index = ["a", "a", "b", "b"]
    fmt = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D)
    acc = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=D)
    adv, returns = get_advantage_estimator("gdpo")(
        torch.zeros(4, 3, dtype=D), mask, index=index, reward_extras={"format": fmt, "acc": acc},
        gdpo_reward_keys=["format", "acc"], gdpo_reward_weights=[1.0, 2.0])
    # GRPO per component (unbiased std of two values 0,1 is 0.7071; equal values give 0):
    z = 1 / (0.5 ** 0.5 + 1e-6) * 0.5
    a_format = torch.tensor([z, -z, 0.0, 0.0], dtype=D)
    a_acc = torch.tensor([-z, z, z, -z], dtype=D)
    combined = (a_format + 2.0 * a_acc)[:, None].expand(4, 3) * mask
    valid = mask.bool()
    mean = combined[valid].mean()
    var = combined[valid].var(unbiased=True)
    want = (combined - mean) / torch.sqrt(var + 1e-8) * mask
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(returns, adv)
    with pytest.raises(ValueError, match=r"returned no \['missing'\]"):
        get_advantage_estimator("gdpo")(torch.zeros(4, 3, dtype=D), mask, index=index, reward_extras={"acc": acc},
                                        gdpo_reward_keys=["missing"])


def _tir_reference(rewards, mask, index, logp, spp, zero_tail=True, eps=1e-8):
    """verl's loop (compute_multi_turn_optimal_token_baseline_advantage), restated: per group, baselines over the
    k-th valid token of each trajectory; returns on the original layout."""
    B = rewards.shape[0]
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w_cum = ((1 - 2 * logp.exp() + spp) * mask).cumsum(-1)
    lengths = [int(m.sum()) for m in mask]
    L = max(lengths)
    W = torch.zeros(B, L, dtype=D)
    G = torch.zeros(B, L, dtype=D)
    for i in range(B):
        W[i, : lengths[i]] = w_cum[i, mask[i].bool()]
        G[i, : lengths[i]] = returns[i, mask[i].bool()]
    base = torch.zeros(B, L, dtype=D)
    for g in set(index):
        rows = [i for i in range(B) if index[i] == g and lengths[i] > 0]
        if len(rows) == 1:
            continue
        b = (G[rows] * W[rows]).sum(0) / (W[rows].sum(0) + eps)
        base[rows] = b
        if zero_tail:
            ls = sorted(lengths[i] for i in rows)
            longest = [i for i in rows if lengths[i] == ls[-1]]
            if len(longest) == 1 and ls[-1] > ls[-2]:
                base[longest[0], ls[-2]:] = 0.0
    adv = torch.zeros_like(rewards)
    for i in range(B):
        adv[i, mask[i].bool()] = (G[i] - base[i])[: lengths[i]]
    # verl leaves the return-to-go at the gap (tool) positions; hyflow zeroes every masked position, which no
    # loss or metric reads
    return adv * mask, returns * mask


def test_tir_optimal_token_baseline_aligns_model_tokens_across_tool_gaps():
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0],   # two turns with a 2-token tool response between them
                         [1, 1, 1, 1, 1, 0, 0],
                         [1, 0, 0, 1, 1, 1, 1],
                         [1, 1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 1, 0, 0, 0]])
    index = ["a", "a", "a", "b", "b"]
    rewards = torch.zeros(5, 7, dtype=D)
    for i, m in enumerate(mask):
        rewards[i, int(m.nonzero().max())] = float(torch.randn((), generator=gen))
    logp = -torch.rand(5, 7, generator=gen, dtype=D)
    spp = torch.rand(5, 7, generator=gen, dtype=D) * 0.5
    adv, returns = get_advantage_estimator("tir_optimal_token_baseline")(
        rewards, mask, index=index, old_log_prob=logp, sum_pi_squared=spp)
    want_adv, want_returns = _tir_reference(rewards, mask, index, logp, spp)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(returns, want_returns)


def test_tir_equals_the_optimal_token_baseline_on_single_turn_responses():
    gen = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    rewards = torch.zeros(4, 4, dtype=D)
    rewards[torch.arange(4), mask.sum(-1) - 1] = torch.randn(4, generator=gen, dtype=D)
    kw = dict(index=[0, 0, 1, 1], old_log_prob=-torch.rand(4, 4, generator=gen, dtype=D),
              sum_pi_squared=torch.rand(4, 4, generator=gen, dtype=D))
    tir = get_advantage_estimator("tir_optimal_token_baseline")(rewards, mask, **kw)
    otb = get_advantage_estimator("optimal_token_baseline")(rewards, mask, handle_zero_tail=True, **kw)
    for a, b in zip(tir, otb):
        torch.testing.assert_close(a, b)
