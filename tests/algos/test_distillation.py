"""On-policy distillation's losses against restatements of verl's code (verl/trainer/distillation/losses.py and
fsdp/losses.py, verl 0.10), on fixed inputs away from the clamps' edges."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.algos.distillation import (
    DISTILLATION_LOSS_MODES,
    combine_with_policy_loss,
    distillation_loss,
    distillation_token_losses,
    forward_kl_topk,
    topk_overlap,
    uses_topk,
)
from hyflow.algos.kl import kl_penalty
from hyflow.algos.registry import get_policy_loss


def verl_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp=None):
    """verl's fsdp compute_forward_kl_topk (non-chunked path), restated for one [B, T, V] batch."""
    student_log_probs = torch.log_softmax(student_logits, dim=-1)
    student_topk_ids = torch.topk(student_log_probs, k=teacher_topk_ids.shape[-1], dim=-1).indices
    student_topk = raw = torch.gather(student_log_probs, dim=-1, index=teacher_topk_ids)
    student_mass = student_topk.exp().sum(-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(-1)
    teacher = teacher_topk_log_probs
    if log_prob_min_clamp is not None:
        student_topk = student_topk.clamp_min(log_prob_min_clamp)
        teacher = teacher.clamp_min(log_prob_min_clamp)
    p = teacher.float().exp()
    losses = (p * (teacher.float() - student_topk.float())).sum(-1)
    overlap = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    token_kl = teacher.exp() * (teacher - student_topk)
    advantage = (-token_kl * overlap).sum(-1) / count.clamp_min(1)
    advantage = torch.where(count > 0, advantage, torch.zeros_like(advantage))
    return losses, student_mass, teacher_mass, count, advantage, raw, student_topk_ids


def _inputs(seed=0, B=3, T=5, V=11, K=4):
    g = torch.Generator().manual_seed(seed)
    student_logits = torch.randn(B, T, V, generator=g) * 2
    teacher_logits = torch.randn(B, T, V, generator=g) * 2
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    top = teacher_lp.topk(K, dim=-1)
    return student_logits, top.values, top.indices


@pytest.mark.parametrize("clamp", [None, -2.0])
def test_forward_kl_topk_matches_verl(clamp):
    student_logits, teacher_lp, teacher_ids = _inputs()
    losses, s_mass, t_mass, count, advantage, student_topk, student_ids = verl_forward_kl_topk(
        student_logits, teacher_lp, teacher_ids, clamp)
    out = forward_kl_topk(student_topk, teacher_lp, log_prob_min_clamp=clamp)
    torch.testing.assert_close(out["losses"], losses)
    torch.testing.assert_close(out["student_mass"], s_mass)
    torch.testing.assert_close(out["teacher_mass"], t_mass)
    ours_count, ours_adv = topk_overlap(teacher_ids, student_ids, teacher_lp, student_topk)
    if clamp is None:  # verl computes the overlap advantage on the clamped log-probs; ours on the unclamped ones
        torch.testing.assert_close(ours_adv, advantage)
    assert torch.equal(ours_count, count)
    # verl clamps the top-k loss at 0 (truncated distributions can give a negative KL)
    token, _ = distillation_token_losses("forward_kl_topk", student_topk_log_probs=student_topk,
                                         teacher_topk_log_probs=teacher_lp, log_prob_min_clamp=clamp)
    torch.testing.assert_close(token, losses.clamp_min(0.0))


def test_forward_kl_topk_is_the_full_kl_when_k_is_the_vocabulary():
    student_logits, _, _ = _inputs(V=7, K=7)
    teacher_logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(5))
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    ids = torch.arange(7).expand(3, 5, 7)
    student_lp = torch.log_softmax(student_logits, -1)
    out = forward_kl_topk(student_lp.gather(-1, ids), teacher_lp.gather(-1, ids))
    full = torch.nn.functional.kl_div(student_lp, teacher_lp, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(out["losses"], full)
    torch.testing.assert_close(out["teacher_mass"], torch.ones(3, 5))


@pytest.mark.parametrize("mode", [m for m in DISTILLATION_LOSS_MODES if not uses_topk(m)])
def test_estimator_modes_are_verls_kl_penalty(mode):
    g = torch.Generator().manual_seed(1)
    student, teacher = -torch.rand(2, 6, generator=g) * 3, -torch.rand(2, 6, generator=g) * 3
    losses, extra = distillation_token_losses(mode, log_prob=student, teacher_log_prob=teacher)
    torch.testing.assert_close(losses, kl_penalty(student, teacher, mode))
    assert extra == {}


def test_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="forward_kl_topk"):
        uses_topk("reverse_kl")


def verl_distillation_ppo_loss(losses, mask, *, use_task_rewards, use_policy_gradient, coef, loss_max_clamp,
                               ppo_loss, log_prob, old_log_prob):
    """verl's distillation_loss + distillation_ppo_loss, restated with token-mean aggregation."""
    if loss_max_clamp is not None:
        losses = losses.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    if use_policy_gradient:
        ratio = torch.exp(log_prob - old_log_prob)
        adv = -losses.detach()
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        distill = (pg * mask).sum() / mask.sum()
    else:
        distill = (losses * mask).sum() / mask.sum()
    policy = 0.0 if not (use_task_rewards or use_policy_gradient) else ppo_loss
    if not use_task_rewards:
        policy = 0.0
    return policy + distill * (coef if use_task_rewards else 1.0)


@pytest.mark.parametrize("use_task_rewards", [True, False])
@pytest.mark.parametrize("use_policy_gradient", [True, False])
@pytest.mark.parametrize("loss_max_clamp", [None, 0.5])
def test_combination_matches_verls_distillation_ppo_loss(use_task_rewards, use_policy_gradient, loss_max_clamp):
    g = torch.Generator().manual_seed(2)
    losses = torch.rand(3, 7, generator=g) * 2 - 0.3
    mask = (torch.rand(3, 7, generator=g) > 0.2).float()
    old = -torch.rand(3, 7, generator=g)
    log_prob = (old + 0.05 * torch.randn(3, 7, generator=g)).requires_grad_()  # ratios well inside the clip range
    ppo_loss = torch.tensor(0.37)
    distill, metrics = distillation_loss(
        losses, mask, loss_max_clamp=loss_max_clamp, use_policy_gradient=use_policy_gradient,
        policy_loss=get_policy_loss("vanilla"), policy_loss_kwargs={"clip_ratio": 0.2, "clip_ratio_low": 0.2,
                                                                    "clip_ratio_high": 0.2},
        log_prob=log_prob, old_log_prob=old)
    total = combine_with_policy_loss(ppo_loss, distill, use_task_rewards=use_task_rewards, distillation_loss_coef=0.3)
    expected = verl_distillation_ppo_loss(losses, mask, use_task_rewards=use_task_rewards,
                                          use_policy_gradient=use_policy_gradient, coef=0.3,
                                          loss_max_clamp=loss_max_clamp, ppo_loss=ppo_loss, log_prob=log_prob,
                                          old_log_prob=old)
    torch.testing.assert_close(total, torch.as_tensor(expected, dtype=total.dtype))
    assert metrics["distillation/loss_max"] == pytest.approx(float(losses[mask.bool()].max()))
    if use_policy_gradient:
        assert "distillation/pg_clipfrac" in metrics


def test_policy_gradient_form_has_the_supervised_gradient_on_policy():
    """On-policy (ratio 1) and unclipped, the policy-gradient form's gradient is -A * grad log pi = d * grad log pi,
    the score-function gradient of the per-token loss, whatever the loss's own gradient is."""
    log_prob = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    d = torch.tensor([[0.3, 0.1, 0.7]])
    mask = torch.ones(1, 3)
    loss, _ = distillation_loss(d, mask, use_policy_gradient=True, policy_loss=get_policy_loss("vanilla"),
                                log_prob=log_prob, old_log_prob=log_prob.detach())
    loss.backward()
    torch.testing.assert_close(log_prob.grad, d / 3)


@settings(max_examples=40, deadline=None)
@given(st.floats(0.05, 3.0), st.integers(1, 6))
def test_topk_loss_is_zero_when_student_equals_teacher(scale, k):
    g = torch.Generator().manual_seed(int(scale * 1000) + k)
    lp = torch.log_softmax(torch.randn(2, 3, 8, generator=g) * scale, -1)
    top = lp.topk(k, dim=-1)
    losses, extra = distillation_token_losses("forward_kl_topk", student_topk_log_probs=top.values,
                                              teacher_topk_log_probs=top.values)
    assert float(losses.abs().max()) < 1e-6
    torch.testing.assert_close(extra["student_mass"], extra["teacher_mass"])
    assert not math.isnan(float(losses.sum()))


def test_the_configs_loss_names_are_the_algorithms():
    from hyflow.config.schema import distillation as schema

    assert set(schema.DISTILLATION_LOSS_MODES) == set(DISTILLATION_LOSS_MODES)
    assert set(schema.TOPK_LOSS_MODES) == {m for m in DISTILLATION_LOSS_MODES if uses_topk(m)}
