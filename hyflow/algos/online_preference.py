"""Online preference optimisation inside the RL step: online DPO (pairs from the policy's own samples) and SPPO.

Both run on the rollout batch of an RL step: `rollout.n` samples per prompt (a group, the `uid` column), scored
by the reward. Notation: r_i = the sample's score (the sum of its token-level rewards), log pi(y_i) = the sum of
its response tokens' log-probs (`*_B`: one value per sample).

Online DPO (Guo et al. 2024, arXiv 2402.04792; verl-recipe `spin`: `compute_onlinedpo_pref`,
`compute_online_dpo_loss`; TRL's `OnlineDPOTrainer`). In each group the best- and the worst-scored samples
(the first of each in row order on ties) form a pair (w, l); a group whose samples all scored the same gives
none. The pair is trained with the DPO loss of `hyflow.algos.preference.dpo_loss` (sigmoid, with label smoothing
cDPO; ipo; hinge; robust) against the reference policy pi_ref:

    h = beta * [(log pi(w) - log pi_ref(w)) - (log pi(l) - log pi_ref(l))],   L_pair = -log sigma(h)  (sigmoid)

Each row's loss needs only its own forward: `online_dpo` (the advantage estimator) writes per row its role in
the pair (`pair_sign`: +1 chosen, -1 rejected, 0 in no pair) and its partner's sequence statistics under pi_old
and pi_ref (`pair_partner_log_prob`, `pair_partner_ref_log_prob`, `pair_partner_length`). The chosen row scores
L_pair with the rejected side held at pi_old's log-prob, the rejected row the converse, so the two rows'
gradients add up to grad L_pair exactly while pi_theta = pi_old (the step's first mini-batch), as for every
off-policy ratio of PPO afterwards. The actor's term is sum over paired rows of L_row / S, S = the mini-batch's
sequence count over all ranks, with each row's gradient doubled (`2 L - sg(L)`, `pair_preference_loss`): its value
and gradient are those of the mean of L_pair over the pairs when every group gives a pair with rollout.n = 2;
with more samples per group (or groups without a pair) the other rows count as zero-loss rows, as
zero-advantage samples do in GRPO's token mean. The split keeps the loss invariant to how the
mini-batch is cut into micro-batches and ranks, and the two rows of a pair need not meet.

SPIN (Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak Language Models to Strong Language Models", arXiv
2401.01335): the same DPO loss on pairs of the data's reference answer (chosen) and the policy's own sample
(rejected) of each prompt; the trainer puts the reference answer in place of the last sample of each group
(`spin`'s `reference_answer` input), so rollout.n = 2 is the paper's one sample per prompt.

SPPO (Wu et al. 2024, arXiv 2405.00675; verl-recipe `sppo`: `compute_advantage` in sppo_ray_trainer.py and
`compute_sppo_loss` in dp_actor.py). The estimated win rate's stand-in is the score centred by a soft mean over
the batch (verl's recipe centres over the whole batch, not per prompt):

    A_i = r_i - SoftMean_eta_a(r),  SoftMean_b(x) = (1 / b) log((1 / N) sum_j exp(b x_j))  (the mean when b = 0)
    L_sppo = mean_i (log pi(y_i) - log pi_old(y_i) - eta * A_i)^2

with eta_a = `algorithm.sppo_eta` (the estimator's) and eta = `actor_rollout_ref.actor.sppo_eta` (the loss's):
the log-ratio of each sample is regressed onto eta times its centred reward.
"""

from __future__ import annotations

import torch

from hyflow.algos.masked import group_ids
from hyflow.algos.policy_losses import loss_metrics, ppo_kl_estimate
from hyflow.algos.preference import DPO_LOSS_TYPES, dpo_loss
from hyflow.algos.registry import register_advantage_estimator, register_policy_loss

PAIR_COLUMNS = ("pair_sign", "pair_partner_log_prob", "pair_partner_ref_log_prob", "pair_partner_length")


def _seq_sum(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """sum_t m_t * x_t per sample [B] (masked positions never count, whatever they hold)."""
    return torch.where(mask_BT.bool(), values_BT, torch.zeros_like(values_BT)).sum(-1)


def best_worst_pairs(scores_B: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rows [P], rejected rows [P]): per group of `index` the first row with the highest score and the
    first with the lowest; groups whose scores are all equal give no pair. Groups in order of first appearance."""
    gid_B = group_ids(index)
    chosen, rejected = [], []
    for g in range(int(gid_B.max()) + 1 if gid_B.numel() else 0):
        rows = (gid_B == g).nonzero().squeeze(-1)
        group = scores_B[rows]
        if bool(group.max() > group.min()):
            chosen.append(int(rows[int(group.argmax())]))
            rejected.append(int(rows[int(group.argmin())]))
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


@register_advantage_estimator("online_dpo", requires=("index", "old_log_prob", "ref_log_prob"), knobs=())
def online_dpo_pairs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, index=None,
                     old_log_prob: torch.Tensor | None = None, ref_log_prob: torch.Tensor | None = None, **_):
    """Online DPO (arXiv 2402.04792; verl-recipe spin): each group's best- and worst-scored samples form a pair
    for the DPO loss against the reference policy, which the actor optimises in the policy loss's place.

    Returns (advantages, returns, columns): there is no advantage, both are zeros. `columns` are the
    `PAIR_COLUMNS`, [B, T] each,
    one value per row broadcast over its positions: `pair_sign` (+1 chosen, -1 rejected, 0 none) and the
    partner's summed log-prob under pi_old and pi_ref, and its response length."""
    if index is None or old_log_prob is None or ref_log_prob is None:
        raise ValueError("online_dpo needs `index` (uid), `old_log_prob` and `ref_log_prob`")
    with torch.no_grad():
        mask = response_mask.bool()
        scores_B = _seq_sum(token_level_rewards.float(), mask)
        chosen, rejected = best_worst_pairs(scores_B, index)
        old_B, ref_B = _seq_sum(old_log_prob.float(), mask), _seq_sum(ref_log_prob.float(), mask)
        length_B = mask.sum(-1).float()
        return _pair_columns(chosen, rejected, old_B, ref_B, length_B, response_mask.shape)


def _pair_columns(chosen: torch.Tensor, rejected: torch.Tensor, old_B: torch.Tensor, ref_B: torch.Tensor,
                  length_B: torch.Tensor, shape: torch.Size):
    """(zero advantages, zero returns, the `PAIR_COLUMNS` [B, T]) of the pairs (chosen[p], rejected[p])."""
    B, T = shape
    sign, partner = torch.zeros(B), torch.arange(B)
    sign[chosen], sign[rejected] = 1.0, -1.0
    partner[chosen], partner[rejected] = rejected, chosen
    columns_B = {"pair_sign": sign, "pair_partner_log_prob": old_B[partner],
                 "pair_partner_ref_log_prob": ref_B[partner], "pair_partner_length": length_B[partner]}
    columns = {name: value.unsqueeze(-1).expand(B, T).contiguous() for name, value in columns_B.items()}
    zeros = torch.zeros(B, T)
    return zeros, zeros.clone(), columns


@register_advantage_estimator("spin", requires=("index", "old_log_prob", "ref_log_prob", "reference_answer"),
                              knobs=())
def spin_pairs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, index=None,
               old_log_prob: torch.Tensor | None = None, ref_log_prob: torch.Tensor | None = None,
               reference_answer: torch.Tensor | None = None, **_):
    """SPIN (arXiv 2401.01335): the data's reference answer (chosen) against the policy's own sample (rejected)
    of each prompt, trained with the DPO loss against the reference policy.

    `reference_answer` [B] marks the rows whose response the trainer replaced by the data's answer (one per
    group); each is paired with its group's first other row. The scores play no part. Returns (advantages,
    returns, columns) as `online_dpo`."""
    if index is None or old_log_prob is None or ref_log_prob is None or reference_answer is None:
        raise ValueError("spin needs `index` (uid), `old_log_prob`, `ref_log_prob` and `reference_answer`")
    with torch.no_grad():
        mask = response_mask.bool()
        gid_B = group_ids(index)
        is_answer = torch.as_tensor(reference_answer).bool()
        chosen, rejected = [], []
        for g in range(int(gid_B.max()) + 1 if gid_B.numel() else 0):
            rows = (gid_B == g).nonzero().squeeze(-1)
            answers, samples = rows[is_answer[rows]], rows[~is_answer[rows]]
            if len(answers) and len(samples):
                chosen.append(int(answers[0]))
                rejected.append(int(samples[0]))
        return _pair_columns(torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long),
                             _seq_sum(old_log_prob.float(), mask), _seq_sum(ref_log_prob.float(), mask),
                             mask.sum(-1).float(), response_mask.shape)


def pair_preference_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
                         columns: dict[str, torch.Tensor], *, beta: float = 0.1, loss_type: str = "sigmoid",
                         label_smoothing: float = 0.0, global_seq_count=None,
                         global_paired_rows=None) -> tuple[torch.Tensor, dict]:
    """The actor's online-DPO term on one micro-batch (module docstring): sum over the rows of a pair of
    L_pair(own log pi, the partner's pi_old), gradient doubled, divided by S = `global_seq_count` (this
    micro-batch's sequence count when None). `columns` are the micro-batch's `PAIR_COLUMNS` ([B, r], read at position 0).

    Metrics (TRL's): `dpo/loss`, `dpo/rewards_chosen`, `dpo/rewards_rejected`, `dpo/rewards_margins`,
    `dpo/rewards_accuracies` as this micro-batch's paired rows' sums divided by `global_paired_rows` (the
    mini-batch's paired rows over all ranks; this micro-batch's when None), so that their sum over micro-batches
    and ranks is the mean over the mini-batch's paired rows; `dpo/pairs`: this micro-batch's paired rows / 2."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")
    mask = response_mask.bool()
    sign = columns["pair_sign"][:, 0]
    own, own_ref = _seq_sum(log_prob, mask), _seq_sum(ref_log_prob.to(log_prob.dtype), mask)
    own_length = mask.sum(-1).to(log_prob.dtype)
    partner = columns["pair_partner_log_prob"][:, 0].to(log_prob.dtype)
    partner_ref = columns["pair_partner_ref_log_prob"][:, 0].to(log_prob.dtype)
    partner_length = columns["pair_partner_length"][:, 0].to(log_prob.dtype)
    is_chosen = sign > 0

    def side(mine: torch.Tensor, theirs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(is_chosen, mine, theirs), torch.where(is_chosen, theirs, mine)

    (chosen, rejected), (ref_chosen, ref_rejected) = side(own, partner), side(own_ref, partner_ref)
    chosen_length, rejected_length = side(own_length, partner_length)
    losses, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss_type=loss_type,
                         label_smoothing=label_smoothing, chosen_lengths_P=chosen_length,
                         rejected_lengths_P=rejected_length)
    paired = sign != 0
    seqs = global_seq_count if global_seq_count is not None else mask.any(-1).sum()
    # value: each row carries L_pair once; gradient: twice (both rows of a pair carry it, the gradient of each
    # flows through its own half), so sum over rows / S is the mean over pairs, and its gradient the pairs' mean's
    doubled = 2 * losses - losses.detach()
    loss = (doubled * paired).sum() / torch.as_tensor(seqs, dtype=losses.dtype).clamp(min=1)
    metrics = {"dpo/pairs": float(paired.sum()) / 2}
    n = max(float(global_paired_rows if global_paired_rows is not None else paired.sum()), 1.0)
    with torch.no_grad():
        r_chosen = beta * (chosen - ref_chosen)
        r_rejected = beta * (rejected - ref_rejected)
        metrics.update({
            "dpo/loss": float((losses * paired).sum()) / n,
            "dpo/rewards_chosen": float((r_chosen * paired).sum()) / n,
            "dpo/rewards_rejected": float((r_rejected * paired).sum()) / n,
            "dpo/rewards_margins": float(((r_chosen - r_rejected) * paired).sum()) / n,
            "dpo/rewards_accuracies": float(((r_chosen > r_rejected) & paired).sum()) / n,
        })
    return loss, metrics


# ------------------------------------------------------------------------------------------------ SPPO


def softmean(x: torch.Tensor, beta: float, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """SoftMean_beta(x) = (1 / beta) log((1 / n) sum_i exp(beta x_i)) along `dim`; the arithmetic mean at 0."""
    if beta == 0.0:
        return x.mean(dim=dim, keepdim=keepdim)
    n = torch.tensor(float(x.size(dim)), dtype=x.dtype, device=x.device)
    return (torch.logsumexp(x * beta, dim=dim, keepdim=keepdim) - n.log()) / beta


@register_advantage_estimator("sppo", knobs=("sppo_eta",))
def sppo_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, sppo_eta: float = 1.0,
                    **_) -> tuple[torch.Tensor, torch.Tensor]:
    """SPPO (arXiv 2405.00675; verl-recipe sppo's `compute_advantage`): A_i = r_i - SoftMean_eta(r) over the
    whole batch, eta = algorithm.sppo_eta, for the sppo policy loss.

    Broadcast over each sample's response tokens; returns = advantages."""
    with torch.no_grad():
        mask = response_mask.bool()
        scores_B = _seq_sum(token_level_rewards.float(), mask)
        adv_B = scores_B - softmean(scores_B, float(sppo_eta))
        adv = torch.where(mask, adv_B.unsqueeze(-1).expand(mask.shape), 0.0)
    return adv, adv.clone()


@register_policy_loss("sppo")
def compute_policy_loss_sppo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
                             sppo_eta: float = 1.0, global_seq_count=None, **_) -> tuple[torch.Tensor, dict]:
    """SPPO's square loss (arXiv 2405.00675; verl-recipe sppo's `compute_sppo_loss`): the mean over sequences of
    (log pi(y) - log pi_old(y) - eta A)^2, eta = actor.sppo_eta, A the sample's centred score (adv_estimator=sppo).

    A is the sequence's advantage (the same on every token); the loss is divided by `global_seq_count` (the mini-batch's sequences over all ranks) whatever
    `loss_agg_mode` is (verl's recipe defines only this mean). Metrics (the actor reports them as
    `actor/<name>`): every loss's three (`ppo_kl`; no clipping: the clip fractions are 0) and the recipe's
    `log_ratio_mean`, `preference_mean` (eta * A), means over this micro-batch's sequences."""
    mask = response_mask.bool()
    has_tokens = mask.any(-1)
    log_ratio_B = _seq_sum(log_prob, mask) - _seq_sum(old_log_prob.to(log_prob.dtype), mask)
    adv_B = _seq_sum(advantages.to(log_prob.dtype), mask) / mask.sum(-1).clamp(min=1)
    target_B = sppo_eta * adv_B
    losses_B = (log_ratio_B - target_B) ** 2 * has_tokens
    seqs = global_seq_count if global_seq_count is not None else has_tokens.sum()
    loss = losses_B.sum() / torch.as_tensor(seqs, dtype=losses_B.dtype).clamp(min=1)
    n = max(int(has_tokens.sum()), 1)
    return loss, {**loss_metrics(ppo_kl_estimate(log_prob.detach() - old_log_prob.to(log_prob.dtype), mask)),
                  "log_ratio_mean": float((log_ratio_B.detach() * has_tokens).sum()) / n,
                  "preference_mean": float((target_B.detach() * has_tokens).sum()) / n}
