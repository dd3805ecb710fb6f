"""The actor's loss composed of registered terms (`hyflow.algos.loss_terms`), named by the spec in order."""

from __future__ import annotations

import pytest
import torch

from hyflow.algos import actor_loss, get_policy_loss
from hyflow.algos.loss_terms import ACTOR_LOSS_TERMS, MicroBatchShare, TermInputs, compose_actor_loss
from hyflow.registry import UnknownNameError

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def inputs(**columns) -> TermInputs:
    g = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(2, 3, generator=g)
    out = {"log_probs": log_prob, "entropy": torch.rand(2, 3, generator=g)}
    cols = {"response_mask": MASK, "advantages": torch.randn(2, 3, generator=g),
            "ref_log_prob": log_prob - 0.3 * torch.rand(2, 3, generator=g), **columns}
    share = MicroBatchShare({"global_token_count": torch.tensor(8.0), "global_seq_count": torch.tensor(3.0)},
                            token_weight=4 / 8, n_micro=2, world_size=1)
    return TermInputs(out, cols, old_log_prob=log_prob + 0.1, response_mask=MASK, share=share)


def test_policy_entropy_and_kl_terms_are_the_policy_loss_minus_c_h_plus_beta_kl():
    """The composed loss equals `actor_loss` on the registered policy loss, to the bit, with the same metrics."""
    x = inputs()
    knobs = {"policy": {"loss_mode": "vanilla", "policy_loss_kwargs": {"clip_ratio": 0.2}},
             "entropy": {"entropy_coeff": 0.01}, "kl": {"kl_loss_coef": 0.3, "kl_loss_type": "low_var_kl"}}
    loss, parts = compose_actor_loss(("policy", "entropy", "kl"), x, knobs)
    pg, pg_metrics = get_policy_loss("vanilla")(old_log_prob=x.old_log_prob, log_prob=x.log_prob,
                                                advantages=x.columns["advantages"], response_mask=MASK,
                                                loss_agg_mode="token-mean", clip_ratio=0.2, **x.share.norms)
    want, terms = actor_loss(pg, log_prob=x.log_prob, entropy=x.outputs["entropy"],
                             ref_log_prob=x.columns["ref_log_prob"], response_mask=MASK, entropy_coeff=0.01,
                             use_kl_loss=True, kl_loss_coef=0.3, **x.share.norms)
    assert torch.equal(loss, want)
    assert {k: parts[f"actor/{k}"] for k in terms} == terms
    assert {k: parts[f"actor/{k}"] for k in pg_metrics} == {k: float(v) * 0.5 for k, v in pg_metrics.items()}


def test_terms_apply_in_the_spec_order_and_only_those_named():
    """A term not named is neither computed nor reported; the entropy metric and the off-policy metrics are
    the composition's own (on-policy; `rollout_log_probs` present)."""
    x = inputs(rollout_log_probs=torch.full((2, 3), -0.5))
    policy = {"policy": {"loss_mode": "vanilla"}}
    loss, parts = compose_actor_loss(("policy",), x, policy, on_policy=True)
    assert "actor/kl_loss" not in parts and "actor/entropy_loss" not in parts
    assert parts["actor/entropy"] == pytest.approx(float((x.outputs["entropy"] * MASK).sum() / 4) * 0.5)
    assert any(name.startswith("rollout_corr/") for name in parts)
    only_policy, _ = ACTOR_LOSS_TERMS.get("policy")(None, x, loss_mode="vanilla")
    assert torch.equal(loss, only_policy)


def test_a_registered_term_joins_the_loss_by_name(monkeypatch):
    """A new term is a function registered by name: the spec names it, the composition calls it with its knobs."""
    def length_penalty(loss, x, *, coef):
        penalty = x.agg(torch.ones_like(x.log_prob))
        return loss + coef * penalty, {"actor/length_penalty": float(penalty)}

    monkeypatch.setitem(ACTOR_LOSS_TERMS, "length_penalty", length_penalty)
    x = inputs()
    base, _ = compose_actor_loss(("policy",), x, {})
    loss, parts = compose_actor_loss(("policy", "length_penalty"), x, {"length_penalty": {"coef": 2.0}})
    assert float(loss) == pytest.approx(float(base) + 2.0 * 0.5)  # token-mean of ones over 4 of the 8 tokens
    assert parts["actor/length_penalty"] == pytest.approx(0.5)


def test_an_unknown_term_names_the_closest():
    with pytest.raises(UnknownNameError, match="Did you mean 'entropy'"):
        compose_actor_loss(("policy", "entropie"), inputs(), {})


def test_distillation_without_task_rewards_is_the_distillation_loss_alone():
    """use_task_rewards=False: the loss is L_d whatever came before (verl's distillation_ppo_loss)."""
    x = inputs(teacher_log_probs=torch.full((2, 3), -1.0))
    knobs = {"distillation": {"loss_mode": "k1", "use_task_rewards": False}}
    alone, parts = compose_actor_loss(("distillation",), x, knobs)
    with_policy, _ = compose_actor_loss(("policy", "distillation"), x, {**knobs, "policy": {"loss_mode": "vanilla"}})
    assert torch.equal(alone, with_policy)
    assert parts["distillation/loss"] == pytest.approx(float(alone))
