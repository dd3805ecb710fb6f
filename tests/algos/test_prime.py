"""PRIME (hyflow/algos/prime.py) against restatements of verl-recipe `prime`'s own code on fixed inputs.

The `verl_*` functions below follow verl-recipe's `prime_core_algos.py` and `prime_dp_rm.py` line by line (loops
over contiguous groups of n_samples rows, `valid_response_length - 1` indexing, sigmoid-then-BCE, the unbiased
masked whitening), written out here without importing verl. They cover only what the module docstring claims to
match: lambda = 0, rows with at least one response token, scores in [0, 1], non-saturated PRM logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos import get_advantage_estimator
from hyflow.algos.prime import (
    check_outcome_range,
    implicit_process_rewards,
    masked_rloo,
    prime_advantage,
    prime_ce_loss,
    prime_dpo_abs_accuracy,
    prime_dpo_accuracy,
)

FAST = settings(max_examples=15, deadline=None, derandomize=True)
SEEDS = [0, 1, 2, 3, 4]
COEFS = [(5.0, 5.0), (1.0, 0.0), (0.0, 2.0), (0.5, 3.0), (0.0, 0.0)]  # (reward_gt_coef, reward_dpo_coef)


# ----------------------------------------------------------------------------------------------------------
# verl-recipe prime, restated


def verl_token_level_score(q, valid_response_length, beta, granularity):
    """`_forward_micro_batch` with lambda = 0: zero q past each row's length, r = q * beta, then the granularity."""
    q = q.clone()
    for i in range(q.shape[0]):
        q[i, valid_response_length[i]:] = 0
    r = q * beta
    token_level_score = torch.zeros_like(q)
    for i in range(q.shape[0]):
        last = int(valid_response_length[i])
        if granularity == "token":
            token_level_score[i, : last - 1] = r[i, : last - 1]
        elif granularity == "whole":
            token_level_score[i, last - 1] = r[i, :last]  # (assigns a vector to one position: runs for last == 1)
        else:
            raise NotImplementedError
    return token_level_score


def verl_prime_norm(token_level_scores, norm):
    if norm == "batch_norm":
        reverse_cumsum = torch.cumsum(token_level_scores.flip(dims=[1]), dim=-1).flip(dims=[1])
        token_level_scores = token_level_scores / (reverse_cumsum.abs().max() + 1e-6)
    return token_level_scores


def verl_masked_rloo(reward_tensor_original, mask_tensor, n_samples):
    reward_tensor = reward_tensor_original.clone()
    reward_tensor[~mask_tensor] = 0
    for start_pos in range(0, reward_tensor.shape[0], n_samples):
        cur_rewards_mean = torch.cat(
            [
                reward_tensor[pos : pos + 1][mask_tensor[pos : pos + 1]].mean(dim=0, keepdim=True)
                for pos in range(start_pos, start_pos + n_samples)
            ],
            dim=0,
        )
        cur_reward_baseline = cur_rewards_mean.sum() / (n_samples - 1)
        rows = slice(start_pos, start_pos + n_samples)
        # (a basic slice is a view: the boolean assignment writes through to reward_tensor, as in verl)
        reward_tensor[rows][mask_tensor[rows]] = (
            reward_tensor[rows][mask_tensor[rows]] * (n_samples / (n_samples - 1)) - cur_reward_baseline
        )
    return reward_tensor


def verl_masked_whiten(values, mask):
    """verl_F.masked_whiten: (x - mean) * rsqrt(unbiased var + 1e-8), moments over the mask."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count
    var = ((values - mean) ** 2 * mask).sum() / count
    var = var * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_rloo_advantage_return(rm_scores, acc, valid_response_length, response_mask, n_samples,
                               reward_gt_coef, reward_dpo_coef):
    """`compute_rloo_advantage_return` with data.batch = {rm_scores, acc} (lengths in place of the prompts and
    attention mask they are read from)."""
    reward_tensors = []
    if reward_dpo_coef != 0.0:
        reward_tensors.append(verl_masked_rloo(rm_scores, response_mask.bool(), n_samples) * reward_dpo_coef)
    if reward_gt_coef != 0.0:
        reward_tensor = torch.zeros_like(response_mask, dtype=torch.float32)
        reward_mask = torch.zeros_like(response_mask, dtype=torch.bool)
        rows = torch.arange(0, valid_response_length.shape[0], dtype=torch.long)
        reward_mask[rows, valid_response_length - 1] = True
        reward_tensor[rows, valid_response_length - 1] = acc
        reward_tensors.append(verl_masked_rloo(reward_tensor, reward_mask, n_samples) * reward_gt_coef)
    final_reward_tensor = sum(reward_tensors)
    returns = (final_reward_tensor * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = verl_masked_whiten(returns.clone(), response_mask)
    return advantages, returns


def verl_ce_dpo_loss_rm(token_level_scores, acc, response_mask, beta):
    cur_scores = ((token_level_scores * response_mask).sum(dim=1) * beta).sigmoid()
    return F.binary_cross_entropy(cur_scores, acc)


def verl_dpo_accuracy(token_level_scores, acc, response_mask, n_samples):
    def upper_triangle(x):
        diff_matrix = x.unsqueeze(1) - x.unsqueeze(0)
        return diff_matrix[torch.triu(torch.ones_like(diff_matrix).bool(), diagonal=1)]

    dpo_acc = []
    for start_id in range(0, token_level_scores.shape[0], n_samples):
        rows = slice(start_id, start_id + n_samples)
        cur_scores = (token_level_scores[rows] * response_mask[rows]).sum(dim=1)
        cur_acc_diff = upper_triangle(acc[rows])
        cur_score_diff = upper_triangle(cur_scores)
        if cur_acc_diff.abs().sum() == 0:
            cur_acc = torch.zeros_like((cur_score_diff > 0).float()[0]) + 0.5
        else:
            cur_acc = (((cur_score_diff > 0) == (cur_acc_diff > 0)).float() * cur_acc_diff.abs()).sum() / (
                cur_acc_diff.abs().sum()
            )
        dpo_acc.append(cur_acc.unsqueeze(0))
    return torch.cat(dpo_acc, dim=0).mean()


def verl_dpo_abs_accuracy(token_level_scores, acc, response_mask):
    return (torch.sign((token_level_scores * response_mask).sum(dim=-1)) == torch.sign(acc * 2 - 1)).float().mean()


# ----------------------------------------------------------------------------------------------------------
# inputs


def make_batch(seed, n_groups=4, n=4, T=10, dtype=torch.float32, min_len=1):
    """Contiguous groups of n rows with uid strings, right-padded masks, q with finite junk off the mask, and 0/1
    or fractional outcomes."""
    gen = torch.Generator().manual_seed(seed)
    B = n_groups * n
    lengths = torch.randint(min_len, T + 1, (B,), generator=gen)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    q = torch.randn(B, T, generator=gen, dtype=dtype)
    acc = torch.tensor([0.0, 0.25, 0.5, 1.0, 1.0, 0.0], dtype=dtype)[torch.randint(0, 6, (B,), generator=gen)]
    index = [f"uid-{seed}-{g}" for g in range(n_groups) for _ in range(n)]
    return q, mask, lengths, acc, index


def outcome_rewards(acc, lengths, T):
    """token_level_rewards: each outcome on its row's last valid token."""
    rewards = torch.zeros(len(acc), T, dtype=acc.dtype)
    rewards[torch.arange(len(acc)), lengths - 1] = acc
    return rewards


def with_garbage(x, mask, fill):
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


# ----------------------------------------------------------------------------------------------------------
# 1. implicit process rewards == verl's token_level_score, then prime_norm


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", ["batch_norm", "none"])
def test_implicit_process_rewards_token_matches_verl(seed, norm):
    q, mask, lengths, _, _ = make_batch(seed)
    beta = 0.05 * (seed + 1)
    expected = verl_prime_norm(verl_token_level_score(q, lengths, beta, "token"), norm)
    got = implicit_process_rewards(q, mask, beta=beta, granularity="token", norm=norm)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("norm", ["batch_norm", "none"])
def test_implicit_process_rewards_whole_matches_verl_on_one_token_responses(norm):
    # the only case verl's `whole` branch runs (it assigns the row's vector to one position)
    q, mask, lengths, _, _ = make_batch(7, T=1)
    assert (lengths == 1).all()
    expected = verl_prime_norm(verl_token_level_score(q, lengths, 0.3, "whole"), norm)
    torch.testing.assert_close(implicit_process_rewards(q, mask, beta=0.3, granularity="whole", norm=norm), expected)


# ----------------------------------------------------------------------------------------------------------
# 2. prime_advantage == verl's compute_rloo_advantage_return (on the mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gt_coef", "dpo_coef"), COEFS)
@pytest.mark.parametrize("scores", ["implicit", "random"])
def test_prime_advantage_matches_verl(seed, gt_coef, dpo_coef, scores):
    q, mask, lengths, acc, index = make_batch(seed, n=4 if seed % 2 else 3)
    T = mask.shape[1]
    if scores == "implicit":
        prm_scores = verl_prime_norm(verl_token_level_score(q, lengths, 0.05, "token"), "batch_norm")
    else:
        prm_scores = q * 0.7  # any per-token scores: the estimator does not assume the last token is 0
    n = len(index) // len(set(index))
    expected_adv, expected_ret = verl_rloo_advantage_return(prm_scores, acc, lengths, mask, n, gt_coef, dpo_coef)
    adv, ret = prime_advantage(outcome_rewards(acc, lengths, T), mask, index=index, prm_scores=prm_scores,
                               reward_gt_coef=gt_coef, reward_dpo_coef=dpo_coef)
    on = mask.bool()
    torch.testing.assert_close(ret[on], expected_ret[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv[on], expected_adv[on], rtol=1e-4, atol=1e-5)
    assert (adv[~on] == 0).all() and (ret[~on] == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_rloo_matches_verl_per_group_with_uneven_groups(seed):
    # hyflow groups by uid; verl's loop with each group's own n gives the same tokens
    gen = torch.Generator().manual_seed(seed)
    sizes = [2, 5, 3, 4]
    T = 8
    lengths = torch.randint(1, T + 1, (sum(sizes),), generator=gen)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = torch.randn(sum(sizes), T, generator=gen)
    index = [f"g{g}" for g, size in enumerate(sizes) for _ in range(size)]
    got = masked_rloo(rewards, mask, index)
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        torch.testing.assert_close(got[rows], verl_masked_rloo(rewards[rows], mask[rows], size))
        start += size


# ----------------------------------------------------------------------------------------------------------
# 3. the PRM's cross-entropy loss == verl's compute_ce_dpo_loss_rm


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("dtype", "bound", "tol"), [(torch.float64, 10.0, 1e-10), (torch.float32, 4.0, 2e-5)])
def test_prime_ce_loss_matches_verl(seed, dtype, bound, tol):
    q, mask, _, acc, _ = make_batch(seed, dtype=dtype)
    beta = 0.1
    logits = (q * mask).sum(-1) * beta
    q = q * (bound * 0.95 / logits.abs().max()).clamp(max=1.0)  # |beta * sum q| < bound (non-saturated)
    assert ((q * mask).sum(-1) * beta).abs().max() < bound
    expected = verl_ce_dpo_loss_rm(q, acc, mask, beta)
    torch.testing.assert_close(prime_ce_loss(q, acc, mask, beta=beta), expected, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------------------
# 4. the dpo accuracy metrics == verl's


def metric_batch(seed, n_groups=5, n=4, T=9):
    """Per-row score totals on a grid of distinct values (sums well away from 0, pairwise differences >= 0.5),
    spread over each row's valid tokens; group 0 has equal outcomes (verl's 0.5)."""
    q, mask, lengths, acc, index = make_batch(seed, n_groups=n_groups, n=n, T=T)
    gen = torch.Generator().manual_seed(seed + 100)
    grid = torch.cat([torch.arange(1, 21) * 0.5, -torch.arange(1, 21) * 0.5])
    totals = grid[torch.randperm(len(grid), generator=gen)[: len(index)]]
    scores = q * mask
    scores = scores + mask * ((totals - scores.sum(-1)) / lengths).unsqueeze(-1)
    scores = with_garbage(scores, mask, 3.0)  # off-mask junk, multiplied away by verl, skipped by hyflow
    acc[:n] = acc[0]
    return scores, acc, mask, index, n


@pytest.mark.parametrize("seed", SEEDS)
def test_dpo_accuracy_matches_verl(seed):
    scores, acc, mask, index, n = metric_batch(seed)
    got = prime_dpo_accuracy(scores, acc, mask, index)
    expected = verl_dpo_accuracy(scores, acc, mask, n)
    assert got == pytest.approx(float(expected), abs=1e-6)
    # the equal-outcome group alone is 0.5 in both
    assert prime_dpo_accuracy(scores[:n], acc[:n], mask[:n], index[:n]) == 0.5
    assert float(verl_dpo_accuracy(scores[:n], acc[:n], mask[:n], n)) == 0.5


@pytest.mark.parametrize("seed", SEEDS)
def test_dpo_abs_accuracy_matches_verl(seed):
    scores, acc, mask, _, _ = metric_batch(seed)
    got = prime_dpo_abs_accuracy(scores, acc, mask)
    assert got == pytest.approx(float(verl_dpo_abs_accuracy(scores, acc, mask)), abs=1e-7)


def test_dpo_accuracy_hand_case():
    mask = torch.ones(4, 1)
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0])
    scores = torch.tensor([[2.0], [-1.0], [-3.0], [1.0]])
    # group a orders its pair right (1.0); group b has equal outcomes (0.5)
    assert prime_dpo_accuracy(scores, acc, mask, ["a", "a", "b", "b"]) == pytest.approx(0.75)
    # signs: +/1, -/0, -/1, +/1 -> 3 of 4
    assert prime_dpo_abs_accuracy(scores, acc, mask) == pytest.approx(0.75)


# ----------------------------------------------------------------------------------------------------------
# 5. properties


@st.composite
def prime_batches(draw):
    n_groups = draw(st.integers(1, 4))
    n = draw(st.integers(2, 5))
    T = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    q, mask, lengths, acc, index = make_batch(seed, n_groups=n_groups, n=n, T=T)
    return q, mask, lengths, acc, index, n


def all_outputs(q, rewards, prm_scores, mask, acc, index):
    out = {}
    for granularity in ("token", "whole"):
        for norm in ("batch_norm", "none"):
            out[granularity, norm] = implicit_process_rewards(q, mask, beta=0.2, granularity=granularity, norm=norm)
    out["adv"], out["ret"] = prime_advantage(rewards, mask, index=index, prm_scores=prm_scores,
                                             reward_gt_coef=2.0, reward_dpo_coef=3.0)
    out["ce"] = prime_ce_loss(q, acc, mask, beta=0.2)
    out["dpo_acc"] = torch.tensor(prime_dpo_accuracy(q, acc, mask, index))
    out["dpo_acc_abs"] = torch.tensor(prime_dpo_abs_accuracy(q, acc, mask))
    return out


@FAST
@given(prime_batches(), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -7.0]))
def test_masked_positions_never_change_any_output(batch, fill):
    q, mask, lengths, acc, index, _ = batch
    T = mask.shape[1]
    rewards = outcome_rewards(acc, lengths, T)
    prm_scores = q * 0.3
    clean = all_outputs(q * mask, rewards, prm_scores * mask, mask, acc, index)
    dirty = all_outputs(with_garbage(q, mask, fill), with_garbage(rewards, mask, fill),
                        with_garbage(prm_scores, mask, fill), mask, acc, index)
    for key, value in clean.items():
        assert torch.isfinite(value).all(), key
        torch.testing.assert_close(dirty[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


@FAST
@given(prime_batches())
def test_outcome_rloo_sums_to_zero_over_each_groups_last_tokens(batch):
    _, mask, lengths, acc, index, n = batch
    T = mask.shape[1]
    rewards = outcome_rewards(acc, lengths, T)
    last = torch.zeros_like(mask, dtype=torch.bool)
    last[torch.arange(len(lengths)), lengths - 1] = True
    part = masked_rloo(rewards, last, index)
    assert (part[~last] == 0).all()
    per_group = part.sum(-1).view(-1, n).sum(-1)
    torch.testing.assert_close(per_group, torch.zeros_like(per_group), rtol=0, atol=1e-6)
    # it is acc_i minus the mean of the group's other outcomes
    acc_G = acc.view(-1, n)
    loo = acc_G - (acc_G.sum(-1, keepdim=True) - acc_G) / (n - 1)
    torch.testing.assert_close(part.sum(-1), loo.reshape(-1), rtol=0, atol=1e-6)
    # through the estimator (dpo weight 0): each row's return at token 0 is reward_gt_coef times that part
    _, ret = prime_advantage(rewards, mask, index=index, prm_scores=None, reward_gt_coef=2.0, reward_dpo_coef=0.0)
    torch.testing.assert_close(ret[:, 0], 2.0 * loo.reshape(-1), rtol=0, atol=1e-5)


@FAST
@given(prime_batches())
def test_implicit_rloo_row_means_sum_to_zero_per_group(batch):
    q, mask, _, _, index, n = batch
    part = masked_rloo(q, mask, index)
    per_group = (part.sum(-1) / mask.sum(-1)).view(-1, n).sum(-1)
    torch.testing.assert_close(per_group, torch.zeros_like(per_group), rtol=0, atol=1e-5)


@FAST
@given(prime_batches(), st.randoms(use_true_random=False))
def test_permuting_whole_groups_permutes_the_outputs(batch, rng):
    q, mask, lengths, acc, index, n = batch
    T = mask.shape[1]
    rewards = outcome_rewards(acc, lengths, T)
    prm_scores = implicit_process_rewards(q, mask, beta=0.2)
    groups = list(range(len(index) // n))
    rng.shuffle(groups)
    rows = torch.tensor([g * n + k for g in groups for k in range(n)])
    before = all_outputs(q, rewards, prm_scores, mask, acc, index)
    after = all_outputs(q[rows], rewards[rows], prm_scores[rows], mask[rows], acc[rows],
                        [index[i] for i in rows.tolist()])
    for key, value in before.items():
        expected = value[rows] if value.dim() == 2 else value
        torch.testing.assert_close(after[key], expected, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@FAST
@given(prime_batches(), st.randoms(use_true_random=False))
def test_rows_need_not_be_contiguous_for_hyflow(batch, rng):
    # hyflow groups by uid, so shuffling rows across groups (which verl's contiguous loop could not take) only
    # permutes the per-token outputs
    q, mask, lengths, acc, index, _ = batch
    rewards = outcome_rewards(acc, lengths, mask.shape[1])
    prm_scores = q * 0.3
    order = list(range(len(index)))
    rng.shuffle(order)
    rows = torch.tensor(order)
    adv, ret = prime_advantage(rewards, mask, index=index, prm_scores=prm_scores)
    adv_p, ret_p = prime_advantage(rewards[rows], mask[rows], index=[index[i] for i in order],
                                   prm_scores=prm_scores[rows])
    torch.testing.assert_close(adv_p, adv[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret_p, ret[rows], rtol=1e-5, atol=1e-5)


@FAST
@given(prime_batches(), st.floats(0.01, 2.0))
def test_whole_granularity_puts_the_sum_on_the_last_valid_token(batch, beta):
    q, mask, lengths, _, _, _ = batch
    B = len(lengths)
    got = implicit_process_rewards(q, mask, beta=beta, granularity="whole", norm="none")
    total = (q * beta * mask).sum(-1)
    expected = torch.zeros_like(q)
    expected[torch.arange(B), lengths - 1] = total
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    normed = implicit_process_rewards(q, mask, beta=beta, granularity="whole", norm="batch_norm")
    torch.testing.assert_close(normed, expected / (total.abs().max() + 1e-6), rtol=1e-5, atol=1e-6)


@FAST
@given(prime_batches())
def test_token_granularity_is_beta_q_but_the_last_token(batch):
    q, mask, lengths, _, _, _ = batch
    got = implicit_process_rewards(q, mask, beta=0.5, granularity="token", norm="none")
    expected = q * 0.5 * mask
    expected[torch.arange(len(lengths)), lengths - 1] = 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------
# 6. errors


def test_a_group_of_one_sample_names_rollout_n():
    q, mask, lengths, acc, _ = make_batch(0, n_groups=3, n=1)
    index = ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"rollout\.n"):
        masked_rloo(q, mask.bool(), index)
    with pytest.raises(ValueError, match=r"rollout\.n"):
        masked_rloo(q, mask.bool(), ["a", "a", "c"])  # one singleton among pairs
    with pytest.raises(ValueError, match=r"rollout\.n"):
        prime_advantage(outcome_rewards(acc, lengths, mask.shape[1]), mask, index=index, prm_scores=q)
    with pytest.raises(ValueError, match=r"rollout\.n"):
        prime_advantage(outcome_rewards(acc, lengths, mask.shape[1]), mask, index=index, prm_scores=None,
                        reward_dpo_coef=0.0)


def test_prime_advantage_needs_index():
    q, mask, lengths, acc, _ = make_batch(0)
    with pytest.raises(ValueError, match="index"):
        prime_advantage(outcome_rewards(acc, lengths, mask.shape[1]), mask, prm_scores=q)


@pytest.mark.parametrize("bad", [1.5, -0.1, 2.0])
def test_check_outcome_range_rejects_scores_outside_0_1(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_outcome_range(torch.tensor([0.0, 1.0, bad]))


def test_check_outcome_range_passes_on_0_1_and_empty():
    check_outcome_range(torch.tensor([0.0, 1.0, 1.0, 0.0]))
    check_outcome_range(torch.tensor([0.0, 0.25, 1.0]))
    check_outcome_range(torch.zeros(0))


def test_implicit_process_rewards_rejects_unknown_granularity_and_norm():
    q, mask, _, _, _ = make_batch(0)
    with pytest.raises(ValueError, match="prime_granularity"):
        implicit_process_rewards(q, mask, beta=0.05, granularity="step")
    with pytest.raises(ValueError, match="prime_norm"):
        implicit_process_rewards(q, mask, beta=0.05, norm="group_norm")


# ----------------------------------------------------------------------------------------------------------
# 7. registry


def test_prime_estimator_is_registered():
    estimator = get_advantage_estimator("prime")
    assert estimator is prime_advantage
    assert estimator.requires == ("index", "prm_scores")
