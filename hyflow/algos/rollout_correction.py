"""Training/inference mismatch correction: importance weights and rejection sampling against the rollout policy.

The rollout engine (vLLM, a bf16 KV-cache sampler, an older weight version) samples from pi_rollout, while the
trainer's "old" log-probs come from pi_old (the same weights in the training engine). Their per-token log ratio

    l_t = clamp(log pi_old(y_t) - log pi_rollout(y_t), -20, 20)

drives two independent corrections ("When Speed Kills Stability", Liu, Li et al. 2025; Yao et al.,
"Your efficient RL framework secretly brings you off-policy RL training", 2025):

- Importance sampling (`rollout_is`): truncated weights that multiply the policy-gradient loss,
  token: w_t = min(exp(l_t), C);  sequence: w = min(exp(sum_t l_t), C) broadcast to the sequence's tokens.
  Detached, zero on masked tokens, optionally renormalised to mean 1 over the batch.
- Rejection sampling (`rollout_rs`): tokens or whole sequences whose divergence statistic leaves its bounds are
  zeroed in the response mask. Per-token statistics (estimators of KL(pi_rollout || pi_old) on rollout samples):
  k1 = -l,  k2 = l^2 / 2,  k3 = exp(l) - 1 - l; aggregated per token, or per sequence by sum, mean or max.
  k1 options keep log(lo) <= stat <= log(hi) (bounds on the ratio pi_rollout / pi_old); k2/k3 keep stat <= hi.

Masked positions (response_mask == 0) never influence anything, even when they hold NaN or inf.
Option names, thresholds and the `rollout_corr/` metric prefix follow verl's `rollout_corr_helper`.
"""

from __future__ import annotations

import math

import torch

from hyflow.algos.masked import masked_mean, masked_sum

Tensor = torch.Tensor

SAFETY_BOUND = 20.0
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
METRIC_PREFIX = "rollout_corr/"


# ----------------------------------------------------------------------------------------------------------
# Argument parsing
# ----------------------------------------------------------------------------------------------------------


def parse_rollout_rs(rollout_rs: str | None) -> list[str]:
    """Comma-separated option names -> de-duplicated list in the given order ([] for None or "")."""
    if rollout_rs is None:
        return []
    if not isinstance(rollout_rs, str):
        raise ValueError(
            f"rollout_rs must be a comma-separated string of options, got {rollout_rs!r}; "
            f"valid options: {', '.join(ROLLOUT_RS_OPTIONS)}."
        )
    options: list[str] = []
    for name in (part.strip() for part in rollout_rs.split(",")):
        if not name or name in options:
            continue
        if name not in ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"unknown rollout_rs option {name!r}; valid options: {', '.join(ROLLOUT_RS_OPTIONS)} "
                "(combine several with commas, e.g. 'token_k1,seq_max_k3')."
            )
        options.append(name)
    return options


_THRESHOLD_FORMAT = (
    "rollout_rs_threshold takes one entry per rollout_rs option (comma-separated) or one entry shared by all: "
    "for *_k1 options a ratio band 'lo_hi' (e.g. '0.5_2.0') or a single t >= 1 meaning [1/t, t]; "
    "for *_k2/*_k3 options a positive upper bound (e.g. 0.01)"
)


def _positive_float(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"invalid number {text!r} for rollout_rs option {option!r}. {_THRESHOLD_FORMAT}."
        ) from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"threshold {text!r} for rollout_rs option {option!r} must be positive and finite.")
    return value


def parse_rollout_rs_thresholds(
    options: list[str], rollout_rs_threshold: float | str | None
) -> dict[str, tuple[float, float]]:
    """Per option, the (lower, upper) bounds on its statistic: log ratio bounds for k1, (-inf, hi) for k2/k3."""
    if not options:
        return {}
    if rollout_rs_threshold is None or isinstance(rollout_rs_threshold, bool):
        raise ValueError(
            f"rollout_rs={','.join(options)!r} needs rollout_rs_threshold, got {rollout_rs_threshold!r}. "
            f"{_THRESHOLD_FORMAT}."
        )
    if isinstance(rollout_rs_threshold, int | float):
        specs = [repr(float(rollout_rs_threshold))]
    elif isinstance(rollout_rs_threshold, str):
        specs = [part.strip() for part in rollout_rs_threshold.split(",") if part.strip()]
    else:
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {rollout_rs_threshold!r}.")
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} entries for {len(options)} rollout_rs options "
            f"({', '.join(options)}). {_THRESHOLD_FORMAT}."
        )
    bounds: dict[str, tuple[float, float]] = {}
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            if "_" in spec:
                lo_text, hi_text = spec.split("_", 1)
                lo, hi = _positive_float(lo_text, option), _positive_float(hi_text, option)
            else:
                hi = _positive_float(spec, option)
                lo = 1.0 / hi
            if lo > hi:
                raise ValueError(
                    f"ratio band {spec!r} for rollout_rs option {option!r} must have lo <= hi "
                    "(a single value t means [1/t, t], so t >= 1)."
                )
            bounds[option] = (math.log(lo), math.log(hi))
        else:
            if "_" in spec:
                raise ValueError(
                    f"rollout_rs option {option!r} takes a single upper bound, got the band {spec!r}. "
                    f"{_THRESHOLD_FORMAT}."
                )
            bounds[option] = (-math.inf, _positive_float(spec, option))
    return bounds


def _check_inputs(old_log_prob: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> None:
    if not old_log_prob.shape == rollout_log_probs.shape == response_mask.shape or old_log_prob.dim() != 2:
        raise ValueError(
            "old_log_prob, rollout_log_probs and response_mask must all be [batch, response_length]; got "
            f"{tuple(old_log_prob.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(response_mask.shape)}. "
            "Slice rollout_log_probs to the response tokens (the rollout must return per-token logprobs)."
        )


# ----------------------------------------------------------------------------------------------------------
# Masked reductions over valid entries
# ----------------------------------------------------------------------------------------------------------


def _masked_max(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """max over mask==1 entries; 0 where nothing is valid."""
    filled = values.masked_fill(~mask, -math.inf)
    out = filled.amax() if dim is None else filled.amax(dim=dim)
    return torch.where(torch.isfinite(out), out, torch.zeros_like(out))


def _masked_min(values: Tensor, mask: Tensor) -> Tensor:
    return -_masked_max(-values, mask)


def _valid_log_ratio(log_ratio_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """l clamped to +-SAFETY_BOUND on valid tokens, 0 elsewhere (so NaN/inf padding cannot leak)."""
    zeros = torch.zeros_like(log_ratio_BT)
    return torch.where(valid_BT, log_ratio_BT, zeros).clamp(-SAFETY_BOUND, SAFETY_BOUND)


def _weight_stats(w: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """mean, max, min and normalised effective sample size (mean w)^2 / mean(w^2) over valid entries."""
    mean = masked_mean(w, valid)
    mean_sq = masked_mean(w * w, valid)
    ess = torch.where(mean_sq > 0, mean * mean / mean_sq.clamp_min(1e-30), torch.ones_like(mean))
    return {"is_mean": mean, "is_max": _masked_max(w, valid), "is_min": _masked_min(w, valid), "is_ess": ess}


# ----------------------------------------------------------------------------------------------------------
# The three parts
# ----------------------------------------------------------------------------------------------------------


def _is_threshold(rollout_is_threshold: float) -> float:
    try:
        threshold = float(rollout_is_threshold) if not isinstance(rollout_is_threshold, bool) else math.nan
    except (TypeError, ValueError):
        threshold = math.nan
    if not threshold > 0:
        raise ValueError(
            f"rollout_is_threshold must be a positive number (e.g. 2.0), got {rollout_is_threshold!r}."
        )
    return threshold


def compute_rollout_is_weights(
    log_ratio_BT: Tensor,
    response_mask: Tensor,
    rollout_is: str,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights pi_old / pi_rollout, [B, T], detached, zero on masked tokens.

    `log_ratio_BT` = log pi_old - log pi_rollout (clamped to +-20 here; masked entries are ignored).

    token: w_t = min(exp(l_t), C);  sequence: w = min(exp(clamp(sum_t l_t m_t, -20, 20)), C) on every token.
    `rollout_is_batch_normalize` divides by the batch mean (over valid tokens for token weights, over
    sequences with a valid token for sequence weights), after truncation. Statistics (mean, max, min, ESS,
    fraction truncated) are over the same units and describe the weights returned.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; use one of {ROLLOUT_IS_LEVELS} or None (off).")
    threshold = _is_threshold(rollout_is_threshold)
    valid_BT = response_mask.bool()
    log_ratio_BT = _valid_log_ratio(log_ratio_BT, valid_BT)
    if rollout_is == "token":
        raw = log_ratio_BT.exp()
        valid = valid_BT
    else:
        seq_log_B = masked_sum(log_ratio_BT, valid_BT, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        raw = seq_log_B.exp()
        valid = valid_BT.any(dim=-1)
    frac_truncated = masked_mean((raw > threshold).to(raw.dtype), valid)
    w = raw.clamp(max=threshold) * valid
    if rollout_is_batch_normalize:
        w = w / masked_mean(w, valid).clamp_min(1e-30)
    metrics = _weight_stats(w, valid)
    metrics["is_frac_truncated"] = frac_truncated
    weights_BT = w if rollout_is == "token" else w.unsqueeze(-1) * valid_BT
    return weights_BT.detach(), metrics


def _rs_statistic(option: str, log_ratio_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """The option's statistic: [B, T] for token options, [B] for sequence options."""
    estimator = option[-2:]
    if estimator == "k1":
        stat_BT = -log_ratio_BT
    elif estimator == "k2":
        stat_BT = 0.5 * log_ratio_BT.square()
    else:
        stat_BT = torch.expm1(log_ratio_BT) - log_ratio_BT
    if option.startswith("token_"):
        return stat_BT
    if option.startswith("seq_sum_"):
        return masked_sum(stat_BT, valid_BT, dim=-1)
    if option.startswith("seq_mean_"):
        return masked_mean(stat_BT, valid_BT, dim=-1)
    return _masked_max(stat_BT, valid_BT, dim=-1)


def compute_rollout_rejection_mask(
    log_ratio_BT: Tensor,
    response_mask: Tensor,
    rollout_rs: str,
    rollout_rs_threshold: float | str | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Keep mask [B, T] (bool; all options must pass) and per-option rejection metrics.

    Token options reject single tokens, sequence options reject every token of the sequence. Rejection
    fractions count valid tokens (`rs_masked_frac`) and sequences with a valid token (`rs_seq_masked_frac`).
    """
    options = parse_rollout_rs(rollout_rs)
    bounds = parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    valid_BT = response_mask.bool()
    log_ratio_BT = _valid_log_ratio(log_ratio_BT, valid_BT)
    valid_B = valid_BT.any(dim=-1)
    keep_BT = torch.ones_like(valid_BT)
    metrics: dict[str, Tensor] = {}
    for option in options:
        lo, hi = bounds[option]
        stat = _rs_statistic(option, log_ratio_BT, valid_BT)
        option_keep = (stat >= lo) & (stat <= hi)
        stat_valid = valid_BT if stat.dim() == 2 else valid_B
        option_keep_BT = option_keep if stat.dim() == 2 else option_keep.unsqueeze(-1).expand_as(valid_BT)
        keep_BT &= option_keep_BT
        metrics[f"rs_{option}_masked_frac"] = masked_mean((~option_keep_BT).float(), valid_BT)
        metrics[f"rs_{option}_stat_mean"] = masked_mean(stat.float(), stat_valid)
        metrics[f"rs_{option}_stat_max"] = _masked_max(stat.float(), stat_valid)
    rejected_BT = ~keep_BT & valid_BT
    metrics["rs_masked_frac"] = masked_mean(rejected_BT.float(), valid_BT)
    metrics["rs_seq_masked_frac"] = masked_mean(rejected_BT.any(dim=-1).float(), valid_B)
    return keep_BT, metrics


def _offpolicy_metrics(log_ratio_BT: Tensor, old_BT: Tensor, rollout_BT: Tensor, valid_BT: Tensor) -> dict:
    valid_B = valid_BT.any(dim=-1)
    zeros = torch.zeros_like(log_ratio_BT)
    old_BT = torch.where(valid_BT, old_BT, zeros)
    rollout_BT = torch.where(valid_BT, rollout_BT, zeros)
    seq_log_B = masked_sum(log_ratio_BT, valid_BT, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    # float64: a perplexity of exp(100) is a legitimate (if alarming) value, not an overflow
    log_ppl_old_B = -masked_mean(old_BT, valid_BT, dim=-1).double()
    log_ppl_rollout_B = -masked_mean(rollout_BT, valid_BT, dim=-1).double()
    log_ppl_diff_B = log_ppl_old_B - log_ppl_rollout_B
    return {
        "kl": masked_mean(-log_ratio_BT, valid_BT),
        "k3_kl": masked_mean(torch.expm1(log_ratio_BT) - log_ratio_BT, valid_BT),
        "chi2_token": masked_mean(torch.exp(2 * log_ratio_BT), valid_BT) - 1,
        "chi2_seq": masked_mean(torch.exp(2 * seq_log_B), valid_B) - 1,
        "training_ppl": masked_mean(log_ppl_old_B.exp(), valid_B),
        "rollout_ppl": masked_mean(log_ppl_rollout_B.exp(), valid_B),
        "training_log_ppl": masked_mean(log_ppl_old_B, valid_B),
        "rollout_log_ppl": masked_mean(log_ppl_rollout_B, valid_B),
        "log_ppl_diff": masked_mean(log_ppl_diff_B, valid_B),
        "log_ppl_abs_diff": masked_mean(log_ppl_diff_B.abs(), valid_B),
        "ppl_ratio": masked_mean(log_ppl_diff_B.exp(), valid_B),
    }


def _to_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Prefix names with `rollout_corr/` and convert with one device sync."""
    if not metrics:
        return {}
    values = torch.stack(
        [value.detach().to(torch.float64).reshape(()) for value in metrics.values()]
    ).tolist()
    return {METRIC_PREFIX + key: value for key, value in zip(metrics, values)}


def compute_offpolicy_metrics(
    old_log_prob: Tensor, rollout_log_probs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """`rollout_corr/*` mismatch diagnostics between any training-side log-probs and the rollout's.

    With l = clamp(log pi_old - log pi_rollout, -20, 20) over valid tokens, and per sequence
    log PPL = -mean_t log pi:
      kl = E[-l] (k1 estimate of KL(pi_rollout || pi_old));  k3_kl = E[exp(l) - 1 - l];
      chi2_token = E[exp(l)^2] - 1;  chi2_seq = E_seq[exp(2 sum_t l_t)] - 1;
      training_ppl / rollout_ppl = E_seq[PPL];  training_log_ppl / rollout_log_ppl = E_seq[log PPL];
      log_ppl_diff = E_seq[log PPL_old - log PPL_rollout] (and its |.| mean);  ppl_ratio = E_seq[PPL_old / PPL_rollout].
    Sequence means run over sequences with at least one valid token. Usable from the actor with the current
    policy's log-probs in place of `old_log_prob`.
    """
    _check_inputs(old_log_prob, rollout_log_probs, response_mask)
    dtype = torch.float64 if old_log_prob.dtype == torch.float64 else torch.float32
    valid_BT = response_mask.bool()
    old, rollout = old_log_prob.detach().to(dtype), rollout_log_probs.detach().to(dtype)
    log_ratio_BT = _valid_log_ratio(old - rollout, valid_BT)
    return _to_floats(_offpolicy_metrics(log_ratio_BT, old, rollout, valid_BT))


def compute_rollout_correction(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """IS weights, rejection-sampled response mask and `rollout_corr/*` metrics for one batch.

    Args (all [B, T]): `old_log_prob` = log pi_old (training engine), `rollout_log_probs` = log pi_rollout
    (sampler), `response_mask`. l = clamp(old - rollout, -20, 20) on valid tokens.
    - `rollout_is`: None (no weights), "token" or "sequence"; `rollout_is_threshold` C truncates the weights
      (w = min(ratio, C)); `rollout_is_batch_normalize` rescales them to mean 1.
    - `rollout_rs`: None or comma list of ROLLOUT_RS_OPTIONS; `rollout_rs_threshold`: one entry per option or
      one shared ("lo_hi" ratio band or t >= 1 for [1/t, t] on k1 options; an upper bound for k2/k3).

    Returns (weights [B, T] float detached or None, response_mask with rejected tokens zeroed (input dtype),
    metrics). Metrics: is_mean, is_max, is_min, is_ess, is_frac_truncated (with IS); rs_masked_frac,
    rs_seq_masked_frac and rs_<option>_{masked_frac,stat_mean,stat_max} (with RS); the mismatch diagnostics of
    `compute_offpolicy_metrics` (always); all prefixed `rollout_corr/`.
    """
    _check_inputs(old_log_prob, rollout_log_probs, response_mask)
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; use one of {ROLLOUT_IS_LEVELS} or None (off).")
    dtype = torch.float64 if old_log_prob.dtype == torch.float64 else torch.float32
    valid_BT = response_mask.bool()
    old = old_log_prob.detach().to(dtype)
    rollout = rollout_log_probs.detach().to(dtype)
    log_ratio_BT = _valid_log_ratio(old - rollout, valid_BT)

    metrics: dict[str, Tensor] = {}
    weights_BT = None
    if rollout_is is not None:
        weights_BT, is_metrics = compute_rollout_is_weights(
            log_ratio_BT, valid_BT, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics.update(is_metrics)
    modified_mask = response_mask
    if parse_rollout_rs(rollout_rs):
        keep_BT, rs_metrics = compute_rollout_rejection_mask(
            log_ratio_BT, valid_BT, rollout_rs, rollout_rs_threshold
        )
        modified_mask = response_mask * keep_BT.to(response_mask.dtype)
        metrics.update(rs_metrics)
    metrics.update(_offpolicy_metrics(log_ratio_BT, old, rollout, valid_BT))
    return weights_BT, modified_mask, _to_floats(metrics)
