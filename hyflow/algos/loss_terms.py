"""The actor's loss, composed of registered terms that the role's spec names, in order.

    L = L_pg - c * H + beta * KL                 terms "policy" (or "pair_preference"), "entropy", "kl"
    L = L + coef * L_d   (or L_d alone)          term "distillation" (verl's `distillation_ppo_loss`)

A term is a function registered in `ACTOR_LOSS_TERMS` by name,

    term(loss, x, **knobs) -> (loss, metrics)

taking the loss so far (None before the first term), the micro-batch's `TermInputs` and the term's knobs (plain
keyword arguments: the spec's `ActorLossSpec.term_knobs()[name]`), returning the new loss and its metric parts.
`compose_actor_loss(terms, x, knobs)` applies them in the spec's order (`ActorLossSpec.terms`) and adds the
metrics that are not terms: `actor/entropy` on-policy, and the off-policy metrics against `rollout_log_probs`.

The terms:
- `policy`: L_pg, the registered policy loss named `loss_mode` (`get_policy_loss`), on pi_old (`old_log_prob`);
  `actor/pg_loss` and the policy loss's own metrics (token-weighted);
- `pair_preference`: online DPO's pair loss in the policy loss's place (`online_preference.pair_preference_loss`),
  its `dpo/*` metrics; `actor/pg_loss` = the pair loss;
- `entropy`: - c * agg(entropy_BT), `actor/entropy_loss` (a term only with c = entropy_coeff != 0);
- `kl`: + beta * agg(kl_penalty(log_prob_BT, ref_log_prob_BT, kl_loss_type)), `actor/kl_loss` (with use_kl_loss);
- `distillation`: on-policy distillation's L_d (`hyflow.algos.distillation`) joined to the loss so far: with
  `use_task_rewards` L + coef * L_d, else L_d alone; `distillation/*` metrics.

Every term aggregates as the policy loss does (`agg_loss` with `loss_agg_mode`, the mini-batch's global
normalisers and `loss_scale_factor`), so the sum keeps micro-batch and data-parallel invariance. Metric parts are
this micro-batch's share of the mini-batch's value: summed over micro-batches and ranks they are the mini-batch's
(names ending in `_min` / `_max` are ranges: the least / greatest over micro-batches and ranks).

A new term = a function here (or in the algorithm's own module) registered by name, the knobs it reads in the
spec's `term_knobs`, and its name in the spec's `terms` where the config asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyflow.algos.agg import agg_loss
from hyflow.algos.distillation import (
    combine_with_policy_loss,
    distillation_loss,
    distillation_token_losses,
    masked_range,
    topk_overlap,
)
from hyflow.algos.kl import kl_penalty
from hyflow.algos.metrics import MAX_SUFFIXES, MIN_SUFFIXES
from hyflow.algos.online_preference import pair_preference_loss
from hyflow.algos.registry import get_policy_loss
from hyflow.algos.rollout_correction import compute_offpolicy_metrics
from hyflow.registry import Registry

ACTOR_LOSS_TERMS = Registry("actor loss term",
                            hint="register one with @ACTOR_LOSS_TERMS.register(name) in hyflow.algos.loss_terms")


@dataclass(frozen=True)
class MicroBatchShare:
    """Where one micro-batch sits in its mini-batch: the global normalisers (`global_token_count`,
    `global_seq_count`: `agg_loss`'s), its share of the mini-batch's response tokens (`token_weight`, the weight of
    a per-token mean metric), the micro-batch count of this rank, the data-parallel world size and the counted rows
    of the mini-batch over all ranks (`counts`: column -> rows, e.g. `pair_sign`)."""

    norms: dict
    token_weight: float = 1.0
    n_micro: int = 1
    world_size: int = 1
    counts: dict = field(default_factory=dict)

    def mean_part(self, value: float) -> float:
        """This micro-batch's part of a mean over the mini-batch's micro-batches and ranks."""
        return value / (self.n_micro * self.world_size)


@dataclass(frozen=True)
class TermInputs:
    """One micro-batch as the terms read it: the forward's outputs (`log_probs` [B, T], `entropy`, with top-k
    distillation `topk_log_probs` / `own_topk_ids`), its columns (`advantages`, `ref_log_prob`,
    `rollout_is_weights`, `teacher_*`, the pair columns, ...), pi_old's log-probs, the response mask (float) and
    how the terms aggregate (`loss_agg_mode`, `loss_scale_factor`)."""

    outputs: dict
    columns: dict
    old_log_prob: torch.Tensor
    response_mask: torch.Tensor
    share: MicroBatchShare
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None

    @property
    def log_prob(self) -> torch.Tensor:
        return self.outputs["log_probs"]

    def agg(self, values_BT: torch.Tensor) -> torch.Tensor:
        """`agg_loss` of per-token values as every term aggregates (the mode, the global normalisers)."""
        return agg_loss(values_BT, self.response_mask, loss_agg_mode=self.loss_agg_mode,
                        loss_scale_factor=self.loss_scale_factor, **self.share.norms)


def compose_actor_loss(terms: Sequence[str], x: TermInputs, knobs: dict[str, dict], *,
                       on_policy: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's loss of one micro-batch: the `terms` (names in `ACTOR_LOSS_TERMS`) applied in order, each
    called with `knobs[name]`; returns (loss, metric parts). Besides the terms' metrics: `actor/entropy` (the
    token-weighted mean entropy) when `on_policy`, and the off-policy metrics against `rollout_log_probs` (means
    over micro-batches and ranks) when the columns hold them."""
    mask, share = x.response_mask, x.share
    parts: dict[str, float] = {}
    if on_policy:
        entropy = x.outputs["entropy"]
        parts["actor/entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1)) * share.token_weight
    loss = None
    for name in terms:
        loss, metrics = ACTOR_LOSS_TERMS.get(name)(loss, x, **knobs.get(name, {}))
        parts.update(metrics)
    if "rollout_log_probs" in x.columns:
        for name, value in compute_offpolicy_metrics(x.log_prob.detach(), x.columns["rollout_log_probs"],
                                                     mask).items():
            parts[name] = share.mean_part(float(value))
    return loss, parts


# ------------------------------------------------------------------------------------------ the task's loss


@ACTOR_LOSS_TERMS.register("policy")
def policy_term(loss: torch.Tensor | None, x: TermInputs, *, loss_mode: str = "vanilla",
                policy_loss_kwargs: dict | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """L_pg: the policy loss registered as `loss_mode`, on pi_old with the batch's advantages (and
    `rollout_is_weights`), called with `policy_loss_kwargs`; the first term (`loss` is None)."""
    pg_loss, pg_metrics = get_policy_loss(loss_mode)(
        old_log_prob=x.old_log_prob, log_prob=x.log_prob, advantages=x.columns["advantages"],
        response_mask=x.response_mask, rollout_is_weights=x.columns.get("rollout_is_weights"),
        loss_agg_mode=x.loss_agg_mode, **x.share.norms, **(policy_loss_kwargs or {}))
    weight = x.share.token_weight
    metrics = {"actor/pg_loss": float(pg_loss.detach())}
    metrics.update({f"actor/{name}": float(value) * weight for name, value in pg_metrics.items()})
    return pg_loss, metrics


@ACTOR_LOSS_TERMS.register("pair_preference")
def pair_preference_term(loss: torch.Tensor | None, x: TermInputs, *, loss_type: str = "sigmoid", beta: float = 0.1,
                         label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Online DPO's pair loss in the policy loss's place (`pair_preference_loss` on the pair columns, divided by the
    mini-batch's sequences; its `dpo/*` metrics divided by the mini-batch's paired rows over all ranks)."""
    term, metrics = pair_preference_loss(x.log_prob, x.columns["ref_log_prob"], x.response_mask, x.columns,
                                         beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                                         global_seq_count=x.share.norms["global_seq_count"],
                                         global_paired_rows=x.share.counts["pair_sign"])
    return term, {**metrics, "actor/pg_loss": float(term.detach())}


@ACTOR_LOSS_TERMS.register("entropy")
def entropy_term(loss: torch.Tensor, x: TermInputs, *, entropy_coeff: float) -> tuple[torch.Tensor, dict[str, float]]:
    """L - c * H with H = agg(entropy_BT) (a bonus: subtracted)."""
    entropy_loss = x.agg(x.outputs["entropy"])
    return loss - entropy_coeff * entropy_loss, {"actor/entropy_loss": float(entropy_loss.detach())}


@ACTOR_LOSS_TERMS.register("kl")
def kl_term(loss: torch.Tensor, x: TermInputs, *, kl_loss_coef: float,
            kl_loss_type: str = "low_var_kl") -> tuple[torch.Tensor, dict[str, float]]:
    """L + beta * KL with KL = agg(kl_penalty(log_prob_BT, ref_log_prob_BT, kl_loss_type)) (GRPO's KL loss)."""
    kl = x.agg(kl_penalty(x.log_prob, x.columns.get("ref_log_prob"), kl_loss_type))
    return loss + kl_loss_coef * kl, {"actor/kl_loss": float(kl.detach())}


# ------------------------------------------------------------------------------------------ distillation


@ACTOR_LOSS_TERMS.register("distillation")
def distillation_term(loss: torch.Tensor | None, x: TermInputs, *, loss_mode: str = "k3", topk: int = 32,
                      use_task_rewards: bool = True, distillation_loss_coef: float = 1.0,
                      loss_max_clamp: float | None = None, log_prob_min_clamp: float | None = None,
                      use_policy_gradient: bool = False, policy_loss_mode: str = "vanilla",
                      policy_loss_kwargs: dict | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy distillation's L_d joined to the loss so far (`combine_with_policy_loss`: L + coef * L_d with
    `use_task_rewards`, else L_d). Metrics: the per-token diagnostics as token-weighted means (the `_mass` ones'
    ranges too), `distillation/overlap_token_advantage` (top-k: the mean over the positions that share a token),
    `distillation_loss`'s metrics and `distillation/loss` (this micro-batch's share of the mini-batch's L_d)."""
    out, cols, mask, share = x.outputs, x.columns, x.response_mask, x.share
    parts: dict[str, float] = {}
    losses, diagnostics = distillation_token_losses(
        loss_mode, log_prob=x.log_prob, teacher_log_prob=cols.get("teacher_log_probs"),
        student_topk_log_probs=out.get("topk_log_probs"), teacher_topk_log_probs=cols.get("teacher_topk_log_probs"),
        log_prob_min_clamp=log_prob_min_clamp)
    if "teacher_topk_ids" in cols and "own_topk_ids" in out:
        count, advantage = topk_overlap(cols["teacher_topk_ids"], out["own_topk_ids"],
                                        cols["teacher_topk_log_probs"], out["topk_log_probs"])
        diagnostics["overlap_ratio"] = count.float() / topk
        shared = mask * (count > 0)
        if float(shared.sum()) > 0:  # mean over the positions that share a token (verl's), weighted by them
            parts["distillation/overlap_token_advantage"] = share.mean_part(
                float((advantage * shared).sum()) / float(shared.sum()))
    else:
        diagnostics["abs_loss"] = losses.detach().abs()
    denominator = mask.sum().clamp(min=1)
    for name, values in diagnostics.items():
        parts[f"distillation/{name}"] = float((values.detach().float() * mask).sum() / denominator) * share.token_weight
        if name.endswith("_mass"):  # verl's student_mass_min|max, teacher_mass_min|max
            parts[f"distillation/{name}_min"], parts[f"distillation/{name}_max"] = masked_range(values, mask)
    distill_loss, metrics = distillation_loss(
        losses, mask, loss_agg_mode=x.loss_agg_mode, loss_max_clamp=loss_max_clamp,
        use_policy_gradient=use_policy_gradient,
        policy_loss=get_policy_loss(policy_loss_mode) if use_policy_gradient else None,
        policy_loss_kwargs=policy_loss_kwargs, log_prob=x.log_prob, old_log_prob=x.old_log_prob,
        rollout_is_weights=cols.get("rollout_is_weights"), loss_scale_factor=x.loss_scale_factor, **share.norms)
    # a range over the mini-batch's tokens stays as it is (least / greatest over micro-batches and ranks)
    parts.update({name: value if name.endswith(MIN_SUFFIXES + MAX_SUFFIXES) else value * share.token_weight
                  for name, value in metrics.items()})
    parts["distillation/loss"] = float(distill_loss.detach())
    return combine_with_policy_loss(loss, distill_loss, use_task_rewards=use_task_rewards,
                                    distillation_loss_coef=distillation_loss_coef), parts
