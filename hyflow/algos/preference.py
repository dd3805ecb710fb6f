"""Offline preference-optimisation losses: DPO (sigmoid, IPO, hinge, robust), CPO, SimPO, ORPO and KTO.

Every loss is a pure function of per-sequence statistics: `logps` = the summed log-probability of a completion's
tokens given its prompt, log pi(y|x) = sum_t log pi(y_t | x, y_<t), and `lengths` = its number of tokens |y|.
Paired losses take a chosen (preferred, w) and a rejected (l) completion of the same prompt, one entry per pair
(shape suffix `_P`); KTO takes unpaired completions with a desirable/undesirable label (`_B`). Each returns
(losses, metrics): per-pair (per-completion) losses whose mean over the step is the objective, and TRL's metrics
as 0-d tensors (means over the given pairs): `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`,
`rewards/margins`, `logps/chosen`, `logps/rejected` (+ the loss's own: `nll_loss`, `log_odds_ratio`, `kl`, ...).

With h = beta * [(log pi(w) - log pi_ref(w)) - (log pi(l) - log pi_ref(l))], the implicit-reward margin:

    sigmoid (DPO, Rafailov et al. 2023, arXiv 2305.18290), with label smoothing eps (cDPO):
        L = -(1 - eps) log sigma(h) - eps log sigma(-h)
    robust  (Chowdhury et al. 2024, arXiv 2403.00409):  L = [-(1 - eps) log sigma(h) + eps log sigma(-h)] / (1 - 2 eps)
    hinge   (SLiC, Zhao et al. 2023, arXiv 2305.10425): L = max(0, 1 - h)
    ipo     (Azar et al. 2023, arXiv 2310.12036):       L = (h_avg / beta - 1 / (2 beta))^2, h_avg with each
            log-ratio divided by its completion's length (TRL's normalisation, confirmed with the IPO authors)
    rewards: r = beta * (log pi(y) - log pi_ref(y)).

Reference-free (no pi_ref; rewards r = beta * log pi(y), or beta * the average log-prob where it is used):

    cpo   (Xu et al. 2024, arXiv 2401.08417): L = -log sigma(beta (log pi(w) - log pi(l))) (eps-smoothed as sigmoid)
          + cpo_alpha * NLL(w)
    simpo (Meng et al. 2024, arXiv 2405.14734): L = -log sigma(beta (avg log pi(w) - avg log pi(l)) - gamma)
          (+ cpo_alpha * NLL(w): CPO-SimPO; 0 = the paper's SimPO), avg log pi(y) = log pi(y) / |y|
    orpo  (Hong et al. 2024, arXiv 2403.07691): L = NLL(w) - beta * log sigma(log odds(w) - log odds(l)),
          odds(y) = p / (1 - p) with p = exp(avg log pi(y)) (beta is the paper's lambda)

NLL(w) is the token mean of -log pi over the chosen completions of the whole step (TRL's cross entropy over the
chosen rows): per pair it enters as -log pi(w) / mean_chosen_length, whose mean over the pairs is that token mean;
pass the step's mean chosen length when scoring a part of the step (a micro-batch).

    kto (Ethayarajh et al. 2024, arXiv 2402.01306): z = max(0, KL estimate) (no gradient),
        desirable   L = desirable_weight   * (1 - sigma(beta (log pi(y) - log pi_ref(y) - z)))
        undesirable L = undesirable_weight * (1 - sigma(beta (z - log pi(y) + log pi_ref(y))))
    the KL estimate is the mean of log pi(y'|x) - log pi_ref(y'|x) over mismatched pairs (each prompt with another
    row's completion, `kto_kl`).

The implementations follow TRL 1.16: trl/trainer/dpo_trainer.py (`_compute_loss`), trl/experimental/cpo/
cpo_trainer.py (`cpo_loss`, `concatenated_forward`), trl/experimental/orpo/orpo_trainer.py (`odds_ratio_loss`),
trl/trainer/kto_trainer.py (`_compute_loss`); tests/algos/test_preference.py pins each against the paper's
formula and TRL's code on fixed inputs. `PREFERENCE_LOSSES` holds them by `algorithm.loss_type` name with what
each needs (pairs or labels, a reference model, which knobs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyflow.registry import Registry

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")


def _pair_metrics(chosen_rewards_P: torch.Tensor, rejected_rewards_P: torch.Tensor, chosen_logps_P: torch.Tensor,
                  rejected_logps_P: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's metrics of a paired loss: means over the pairs (accuracy = share of pairs with r(w) > r(l))."""
    chosen, rejected = chosen_rewards_P.detach(), rejected_rewards_P.detach()
    return {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).to(chosen.dtype).mean(), "rewards/margins": (chosen - rejected).mean(),
            "logps/chosen": chosen_logps_P.detach().mean(), "logps/rejected": rejected_logps_P.detach().mean()}


def _smoothed_sigmoid(logits_P: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - eps) log sigma(x) - eps log sigma(-x): the preference label is flipped with probability eps."""
    return -F.logsigmoid(logits_P) * (1 - label_smoothing) - F.logsigmoid(-logits_P) * label_smoothing


def dpo_loss(chosen_logps_P: torch.Tensor, rejected_logps_P: torch.Tensor, ref_chosen_logps_P: torch.Tensor,
             ref_rejected_logps_P: torch.Tensor, *, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_lengths_P: torch.Tensor | None = None,
             rejected_lengths_P: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO and its sigmoid / robust / hinge / ipo variants (module docstring); `*_lengths_P` are needed by ipo.

    Rewards r(y) = beta * (log pi(y) - log pi_ref(y)); the margin of the losses is h = r(w) - r(l)."""
    chosen_logratios = chosen_logps_P - ref_chosen_logps_P
    rejected_logratios = rejected_logps_P - ref_rejected_logps_P
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid(beta * delta, label_smoothing)
    elif loss_type == "robust":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * delta)
                  + label_smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_lengths_P is None or rejected_lengths_P is None:
            raise ValueError("the ipo loss divides each log-ratio by its completion's length: pass chosen_lengths_P "
                             "and rejected_lengths_P")
        avg_delta = (chosen_logratios / chosen_lengths_P.clamp(min=1)
                     - rejected_logratios / rejected_lengths_P.clamp(min=1))
        losses = (avg_delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")
    return losses, _pair_metrics(beta * chosen_logratios, beta * rejected_logratios, chosen_logps_P,
                                 rejected_logps_P)


def chosen_nll_P(chosen_logps_P: torch.Tensor, chosen_lengths_P: torch.Tensor,
                 mean_chosen_length: float | torch.Tensor | None = None) -> torch.Tensor:
    """Each pair's share of NLL(w), the token mean of -log pi over the step's chosen completions:
    -log pi(w) / mean_chosen_length (default: the mean of `chosen_lengths_P`), so its mean over the pairs is
    sum(-log pi(w)) / sum |w|."""
    if mean_chosen_length is None:
        mean_chosen_length = chosen_lengths_P.float().mean()
    return -chosen_logps_P / torch.as_tensor(mean_chosen_length, dtype=chosen_logps_P.dtype).clamp(min=1e-8)


def cpo_loss(chosen_logps_P: torch.Tensor, rejected_logps_P: torch.Tensor, chosen_lengths_P: torch.Tensor,
             rejected_lengths_P: torch.Tensor, *, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, simpo_gamma: float = 0.5, cpo_alpha: float = 1.0,
             mean_chosen_length: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CPO (loss_type sigmoid) and SimPO (loss_type simpo): reference-free preference loss + cpo_alpha * NLL(w).

    simpo scores average log-probs, log pi(y) / |y|, and subtracts the margin: logits = beta * (avg(w) - avg(l))
    - simpo_gamma (TRL's `logits - simpo_gamma / beta`, times beta). Rewards r(y) = beta * the scored log-prob."""
    if loss_type == "simpo":
        chosen = chosen_logps_P / chosen_lengths_P.clamp(min=1)
        rejected = rejected_logps_P / rejected_lengths_P.clamp(min=1)
        logits = beta * (chosen - rejected) - simpo_gamma
    elif loss_type == "sigmoid":
        chosen, rejected = chosen_logps_P, rejected_logps_P
        logits = beta * (chosen - rejected)
    else:
        raise ValueError(f"unknown CPO loss_type {loss_type!r}; choose sigmoid or simpo")
    nll = chosen_nll_P(chosen_logps_P, chosen_lengths_P, mean_chosen_length)
    losses = _smoothed_sigmoid(logits, label_smoothing) + cpo_alpha * nll
    metrics = _pair_metrics(beta * chosen, beta * rejected, chosen, rejected)
    metrics["nll_loss"] = nll.detach().mean()
    return losses, metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_logps_P: torch.Tensor, rejected_logps_P: torch.Tensor, chosen_lengths_P: torch.Tensor,
              rejected_lengths_P: torch.Tensor, *, beta: float = 0.1,
              mean_chosen_length: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO: NLL(w) - beta * log sigma(log odds(w) - log odds(l)) on average log-probs a(y) = log pi(y) / |y|,
    log odds(y) = a(y) - log(1 - exp(a(y))). Rewards r(y) = beta * a(y)."""
    chosen = chosen_logps_P / chosen_lengths_P.clamp(min=1)
    rejected = rejected_logps_P / rejected_lengths_P.clamp(min=1)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    nll = chosen_nll_P(chosen_logps_P, chosen_lengths_P, mean_chosen_length)
    losses = nll - beta * ratio
    metrics = _pair_metrics(beta * chosen, beta * rejected, chosen, rejected)
    metrics.update({"nll_loss": nll.detach().mean(), "log_odds_ratio": ratio.detach().mean(),
                    "log_odds_chosen": log_odds.detach().mean()})
    return losses, metrics


def kto_kl(kl_logps_B: torch.Tensor, ref_kl_logps_B: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z = max(0, mean(log pi(y'|x) - log pi_ref(y'|x))) over mismatched (x, y'), no grad."""
    return (kl_logps_B - ref_kl_logps_B).detach().mean().clamp(min=0)


def kto_loss(logps_B: torch.Tensor, ref_logps_B: torch.Tensor, labels_B: torch.Tensor, kl: torch.Tensor | float, *,
             beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO on unpaired completions (labels_B true = desirable), module docstring; losses_B in the rows' order.

    Metrics (TRL's): rewards/* and logps/* are means over the desirable (chosen) or undesirable (rejected) rows,
    present when there are such rows; rewards/margins when both; kl = z."""
    desirable = labels_B.bool()
    logratios = logps_B - ref_logps_B
    kl = torch.as_tensor(kl, dtype=logps_B.dtype)
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios))))
    rewards = beta * logratios.detach()
    metrics = {"kl": kl.detach()}
    for name, rows in (("chosen", desirable), ("rejected", ~desirable)):
        if rows.any():
            metrics[f"rewards/{name}"] = rewards[rows].mean()
            metrics[f"logps/{name}"] = logps_B.detach()[rows].mean()
    if desirable.any() and (~desirable).any():
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return losses, metrics


# ------------------------------------------------------------------------------------------ by name


@dataclass(frozen=True)
class PreferenceLoss:
    """A loss of `algorithm.loss_type`: `paired` (chosen/rejected rows) or unpaired with labels (KTO);
    `reference`: needs pi_ref; `knobs`: the `algorithm.*` keys it reads beside beta; `defaults`: their values when
    unset; `fn(stats, knobs) -> (losses, metrics)`."""

    fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    paired: bool
    reference: bool
    knobs: tuple[str, ...]
    defaults: dict


PREFERENCE_LOSSES = Registry("preference loss", hint="algorithm.loss_type names one of these losses")


def _pairs(stats: dict, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of a per-row column: rows alternate chosen, rejected, chosen, ..."""
    return stats[key][0::2], stats[key][1::2]


def _dpo(loss_type: str):
    def run(stats: dict, knobs: dict, mean_chosen_length=None):
        (cw, cl), (rw, rl), (lw, ll) = _pairs(stats, "logps"), _pairs(stats, "ref_logps"), _pairs(stats, "lengths")
        return dpo_loss(cw, cl, rw, rl, loss_type=loss_type, chosen_lengths_P=lw, rejected_lengths_P=ll, **knobs)
    return run


def _cpo(loss_type: str):
    def run(stats: dict, knobs: dict, mean_chosen_length=None):
        (cw, cl), (lw, ll) = _pairs(stats, "logps"), _pairs(stats, "lengths")
        return cpo_loss(cw, cl, lw, ll, loss_type=loss_type, mean_chosen_length=mean_chosen_length, **knobs)
    return run


def _orpo(stats: dict, knobs: dict, mean_chosen_length=None):
    (cw, cl), (lw, ll) = _pairs(stats, "logps"), _pairs(stats, "lengths")
    return orpo_loss(cw, cl, lw, ll, mean_chosen_length=mean_chosen_length, **knobs)


def _kto(stats: dict, knobs: dict, mean_chosen_length=None):
    return kto_loss(stats["logps"], stats["ref_logps"], stats["labels"], stats["kl"], **knobs)


for _name in ("sigmoid", "robust"):
    PREFERENCE_LOSSES.register(_name, PreferenceLoss(_dpo(_name), True, True, ("label_smoothing",),
                                                     {"label_smoothing": 0.0}))
for _name in ("hinge", "ipo"):
    PREFERENCE_LOSSES.register(_name, PreferenceLoss(_dpo(_name), True, True, (), {}))
PREFERENCE_LOSSES.register("cpo", PreferenceLoss(_cpo("sigmoid"), True, False, ("label_smoothing", "cpo_alpha"),
                                                 {"label_smoothing": 0.0, "cpo_alpha": 1.0}))
PREFERENCE_LOSSES.register("simpo", PreferenceLoss(
    _cpo("simpo"), True, False, ("label_smoothing", "simpo_gamma", "cpo_alpha"),
    {"label_smoothing": 0.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}))
PREFERENCE_LOSSES.register("orpo", PreferenceLoss(_orpo, True, False, (), {}))
PREFERENCE_LOSSES.register("kto", PreferenceLoss(_kto, False, True, ("desirable_weight", "undesirable_weight"),
                                                 {"desirable_weight": 1.0, "undesirable_weight": 1.0}))


def preference_loss(loss_type: str, stats: dict, *, beta: float, mean_chosen_length=None,
                    **knobs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss `loss_type` on per-row `stats` ({"logps", "lengths"} [N], + "ref_logps" [N] with a reference,
    + "labels" [N] and "kl" for KTO; paired rows alternate chosen, rejected); `knobs` as the loss's `knobs`
    (unset ones take its defaults). Returns (losses per pair / per row, metrics)."""
    spec = PREFERENCE_LOSSES.get(loss_type)
    values = {**spec.defaults, **{k: v for k, v in knobs.items() if k in spec.knobs and v is not None}}
    return spec.fn(stats, {"beta": beta, **values}, mean_chosen_length=mean_chosen_length)
