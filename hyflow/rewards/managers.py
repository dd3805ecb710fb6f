"""Reward managers: turn a generated Batch into token-level scores.

Each manager decodes the valid response tokens of every sample, scores it, and writes the score at the last
valid response token (`token_level_scores[i, len_i - 1]`, zeros elsewhere) — verl's convention. Extra keys
returned by a scorer (a dict with `score` plus e.g. `acc`, `pred`) become per-sample columns and metrics.

- `naive`: one scorer call per sample, in `num_workers` processes, each bounded by `timeout_s`.
- `batch`: one call for the whole batch: `fn(data_sources=, solution_strs=, ground_truths=, extra_infos=)`
  returning a list of scores (or dicts).
- `dapo`: `naive` plus DAPO's overlong penalty (arXiv 2503.14476): with buffer L and maximum length Lmax,
  `penalty = min(0, -(len - (Lmax - L)) / L * factor)`, 0 inside the budget and -factor at Lmax.

A scorer that fails on a sample (raises, returns None / a string / NaN / inf, times out, or kills its
process) gives that sample a score of 0; it is counted in `reward/errors` (every failure) and
`reward/timeouts` (the timed-out ones) and logged once per distinct error together with the sample. When more
than `max_error_fraction` of a batch's samples failed, the batch is not scored: `RewardFunctionError` names the
function, the first failure and the fix, and the run stops instead of training on zeros.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.registry import Registry
from hyflow.rewards.custom import normalize_score
from hyflow.rewards.pool import Outcome, run_calls
from hyflow.rewards.registry import default_compute_score

logger = logging.getLogger(__name__)

REWARD_MANAGERS = Registry("reward manager")


def register_reward_manager(name: str):
    """Register a reward-manager class under `name` (reward_model.reward_manager; verl's decorator)."""
    return REWARD_MANAGERS.register(name)


@dataclass
class RewardResult:
    """Scores of one batch: `token_level_scores` [N, R], per-sample extra columns, and metrics."""

    token_level_scores: torch.Tensor
    scores: list[float]
    extra: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class RewardFunctionError(ValueError):
    """Too many samples of a batch failed in the reward function; the message names it and the first failure."""


def describe_function(fn: Callable) -> str:
    """`file:name` (or `module.name`) of a reward function, through functools.partial."""
    import functools
    import inspect

    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        return f"{inspect.getsourcefile(fn)}:{name}"
    except TypeError:
        return f"{getattr(fn, '__module__', '?')}.{name}"


class _BaseManager:
    def __init__(self, tokenizer, compute_score: Callable | None = None, *, num_workers: int = 1,
                 timeout_s: float = 30.0, reward_kwargs: dict | None = None, num_examine: int = 0,
                 max_response_length: int | None = None, overlong_buffer: dict | None = None,
                 max_error_fraction: float = 0.5) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.max_error_fraction = max_error_fraction
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.reward_kwargs = dict(reward_kwargs or {})
        self.num_examine = num_examine
        self.max_response_length = max_response_length
        self.overlong_buffer = dict(overlong_buffer or {})
        self._take_verl_overlong_kwargs()
        self._logged_errors: set[str] = set()

    def _take_verl_overlong_kwargs(self) -> None:
        """verl's DAPO spelling, `reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor,log}` and
        `reward_kwargs.max_resp_len` (arguments of verl's DAPO manager), configures the same overlong penalty as
        `reward_model.overlong_buffer.*` instead of reaching the scorer as keyword arguments."""
        verl_buffer = self.reward_kwargs.pop("overlong_buffer_cfg", None)
        max_resp_len = self.reward_kwargs.pop("max_resp_len", None)
        if verl_buffer is not None:
            verl_buffer = dict(verl_buffer)
            unknown = sorted(set(verl_buffer) - {"enable", "len", "penalty_factor", "log"})
            if unknown:
                raise ValueError(f"reward_model.reward_kwargs.overlong_buffer_cfg has unknown key(s) {unknown}; verl's "
                                 "keys are enable, len, penalty_factor, log")
            if self.overlong_buffer.get("enable"):
                clash = {k: (self.overlong_buffer.get(k), v) for k, v in verl_buffer.items()
                         if k in self.overlong_buffer and self.overlong_buffer.get(k) != v}
                if clash:
                    raise ValueError(
                        "the overlong penalty is set twice with different values: reward_model.overlong_buffer and "
                        "reward_model.reward_kwargs.overlong_buffer_cfg (verl's spelling) disagree on "
                        + ", ".join(f"{k} ({a!r} vs {b!r})" for k, (a, b) in clash.items()) + "; keep one")
            self.overlong_buffer.update(verl_buffer)
        if max_resp_len is not None:
            self.max_response_length = int(max_resp_len)

    def decode_responses(self, batch: Batch) -> tuple[list[str], torch.Tensor]:
        """The responses as text and their lengths in tokens. A multi-turn response is decoded whole (model turns
        and the tool / user turns between them: the attention mask's response part); single-turn it is the
        response_mask's length, the same thing."""
        lengths = response_lengths(batch)
        texts = [self.tokenizer.decode(ids[: int(n)].tolist(), skip_special_tokens=True)
                 for ids, n in zip(batch["responses"], lengths)]
        return texts, lengths

    @staticmethod
    def _column(batch: Batch, key: str, default=None) -> list:
        return list(batch[key]) if key in batch else [default] * len(batch)

    def _ground_truths(self, batch: Batch) -> list:
        if "ground_truth" in batch:
            return list(batch["ground_truth"])
        return [(rm or {}).get("ground_truth") for rm in self._column(batch, "reward_model", {})]

    def _record_failure(self, outcome: Outcome, sample: dict) -> None:
        kind = "timed out" if outcome.timed_out else (outcome.error or "").splitlines()[0]
        if kind in self._logged_errors:
            return
        self._logged_errors.add(kind)
        detail = f"after {self.timeout_s}s (reward_model.timeout_s)" if outcome.timed_out else outcome.error
        logger.warning("reward function %s on sample %r; it scores 0 and the run goes on. %s",
                       "timed out" if outcome.timed_out else "raised", sample, detail)

    def _finish(self, batch: Batch, outcomes: list[Outcome], calls: list[dict], lengths: torch.Tensor) -> RewardResult:
        scores, extras, errors, timeouts, first = [], [], 0, 0, None
        for index, (outcome, call) in enumerate(zip(outcomes, calls)):
            if outcome.ok:
                try:
                    score, extra = normalize_score(outcome.value)
                except (TypeError, ValueError) as exc:
                    outcome = Outcome(error=str(exc))
            if not outcome.ok:
                errors += 1
                timeouts += outcome.timed_out
                self._record_failure(outcome, {k: call.get(k) for k in ("data_source", "solution_str", "ground_truth")})
                first = first or (index, call.get("data_source"), outcome)
                score, extra = 0.0, {}
            scores.append(score)
            extras.append(extra)
        if errors > self.max_error_fraction * len(calls):
            self._stop(errors, len(calls), first)
        return self._assemble(batch, scores, extras, lengths, errors, timeouts)

    def _stop(self, errors: int, total: int, first: tuple) -> None:
        index, data_source, outcome = first
        what = (f"timed out after {self.timeout_s} s (reward_model.timeout_s)" if outcome.timed_out
                else (outcome.error or "").strip().splitlines()[0])
        raise RewardFunctionError(
            f"the reward function {describe_function(self.compute_score)} failed on {errors} of {total} samples of "
            f"this batch, more than reward_model.max_error_fraction={self.max_error_fraction}; the first: sample "
            f"{index} (data_source={data_source!r}) {what}. Fix the function (run it on a few dataset rows by hand), "
            "raise reward_model.timeout_s if it is slow, or raise reward_model.max_error_fraction to train on "
            "anyway (failed samples score 0)")

    def _assemble(self, batch, scores, extras, lengths, errors, timeouts) -> RewardResult:
        metrics: dict[str, float] = {"reward/errors": float(errors), "reward/timeouts": float(timeouts)}
        if self.overlong_buffer.get("enable"):
            scores, extras = self._overlong_penalty(scores, extras, lengths, metrics)
        keys = sorted({k for e in extras for k in e})
        extra = {k: [e.get(k) for e in extras] for k in keys}
        token_level = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        rows = torch.arange(len(batch))
        last = last_model_token(batch, lengths)  # the score sits on the model's last token (verl's placement)
        token_level[rows, last] = torch.tensor(scores, dtype=torch.float32) * (lengths > 0).float()
        for k, values in extra.items():
            numeric = [float(v) for v in values if isinstance(v, (int, float, bool, np.number)) and v is not None]
            if numeric and len(numeric) == len(values):
                metrics[f"reward/{k}/mean"] = float(np.mean(numeric))
        return RewardResult(token_level, scores, extra, metrics)

    def _overlong_penalty(self, scores, extras, lengths, metrics):
        if not self.max_response_length:
            raise ValueError("the overlong penalty needs the maximum response length (data.max_response_length)")
        buffer_len = int(self.overlong_buffer.get("len", 0))
        factor = float(self.overlong_buffer.get("penalty_factor", 1.0))
        if not 0 < buffer_len <= self.max_response_length:
            raise ValueError(f"reward_model.overlong_buffer.len={buffer_len} must be in (0, max_response_length="
                             f"{self.max_response_length}]")
        expected = self.max_response_length - buffer_len
        new_scores, penalties = [], []
        for score, extra, length in zip(scores, extras, lengths.tolist()):
            penalty = min(-(length - expected) / buffer_len * factor, 0.0)
            extra["overlong_reward"] = penalty
            extra["overlong"] = length > expected
            new_scores.append(score + penalty)
            penalties.append(penalty)
        metrics["reward/overlong_penalty/mean"] = float(np.mean(penalties))
        return new_scores, extras


def response_lengths(batch: Batch) -> torch.Tensor:
    """Tokens per response [B]: the response part of `attention_mask` when the batch has one (it covers tool
    turns too), else the number of `response_mask` tokens."""
    width = batch["responses"].shape[1]
    if "attention_mask" in batch:
        return batch["attention_mask"][:, -width:].sum(-1).long()
    return batch["response_mask"].sum(-1).long()


def last_model_token(batch: Batch, lengths: torch.Tensor) -> torch.Tensor:
    """Index of each response's last model-generated token (response_mask = 1), or length - 1 when it has none."""
    mask = batch["response_mask"].long()
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values
    return torch.where(last >= 0, last, (lengths - 1).clamp(min=0))


@register_reward_manager("naive")
class NaiveRewardManager(_BaseManager):
    """One scorer call per sample: `compute_score(data_source, solution_str, ground_truth, extra_info, **kw)`."""

    def __call__(self, batch: Batch) -> RewardResult:
        texts, lengths = self.decode_responses(batch)
        calls = [
            {"data_source": ds, "solution_str": text, "ground_truth": gt, "extra_info": info, **self.reward_kwargs}
            for ds, text, gt, info in zip(self._column(batch, "data_source"), texts, self._ground_truths(batch),
                                          self._column(batch, "extra_info", {}))
        ]
        outcomes = run_calls(self.compute_score, calls, num_workers=self.num_workers, timeout_s=self.timeout_s)
        for i in range(min(self.num_examine, len(calls))):
            logger.info("[sample %d] %s -> %s", i, calls[i]["solution_str"], outcomes[i].value)
        return self._finish(batch, outcomes, calls, lengths)


@register_reward_manager("dapo")
class DAPORewardManager(NaiveRewardManager):
    """`naive` with DAPO's overlong penalty switched on (reward_model.overlong_buffer)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.overlong_buffer.setdefault("enable", True)


@register_reward_manager("batch")
class BatchRewardManager(_BaseManager):
    """One scorer call for the whole batch; the function returns one score (or dict) per sample."""

    def __call__(self, batch: Batch) -> RewardResult:
        texts, lengths = self.decode_responses(batch)
        call = {"data_sources": self._column(batch, "data_source"), "solution_strs": texts,
                "ground_truths": self._ground_truths(batch), "extra_infos": self._column(batch, "extra_info", {}),
                **self.reward_kwargs}
        (outcome,) = run_calls(self.compute_score, [call], num_workers=self.num_workers, timeout_s=self.timeout_s)
        if outcome.ok and (not isinstance(outcome.value, (list, tuple)) or len(outcome.value) != len(batch)):
            outcome = Outcome(error=f"the batch reward function must return a list of {len(batch)} scores, "
                                    f"got {type(outcome.value).__name__}")
        outcomes = list(outcome.value) if outcome.ok else [outcome] * len(batch)
        outcomes = [o if isinstance(o, Outcome) else Outcome(value=o) for o in outcomes]
        calls = [{"data_source": d, "solution_str": t} for d, t in zip(call["data_sources"], texts)]
        return self._finish(batch, outcomes, calls, lengths)


def make_reward_manager(name: str, tokenizer, **kwargs):
    """The reward manager registered as `name` (reward_model.reward_manager; an unknown name is a ValueError
    naming the closest)."""
    return REWARD_MANAGERS.get(name)(tokenizer, **kwargs)


def score_with_agent_rewards(manager, batch: Batch) -> RewardResult:
    """`manager(batch)`, except for the rows whose agent loop scored its own trajectory (the `agent_reward` column,
    `AgentLoopOutput.reward_score`, verl's field): their score is that value, on the last model token as every
    score is, and the reward function is not called for them (a batch where every loop scored needs none)."""
    agent = list(batch["agent_reward"]) if "agent_reward" in batch else [None] * len(batch)
    given = np.array([value is not None for value in agent], dtype=bool)
    if not given.any():
        return manager(batch)
    lengths = response_lengths(batch)
    token_level = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    scores: list = [None] * len(batch)
    extra: dict[str, list] = {}
    metrics: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
    if not given.all():  # the other rows go through the reward function
        rest = np.flatnonzero(~given)
        result = manager(batch[~given])
        token_level[torch.as_tensor(rest)] = result.token_level_scores
        for i, row in enumerate(rest):
            scores[row] = result.scores[i]
        for key, values in result.extra.items():
            column = extra.setdefault(key, [None] * len(batch))
            for i, row in enumerate(rest):
                column[row] = values[i]
        metrics.update(result.metrics)
    rows = np.flatnonzero(given)
    values = torch.tensor([float(agent[i]) for i in rows], dtype=torch.float32)
    last = last_model_token(batch, lengths)[torch.as_tensor(rows)]
    token_level[torch.as_tensor(rows), last] = values * (lengths[torch.as_tensor(rows)] > 0).float()
    for i, row in enumerate(rows):
        scores[row] = float(values[i])
    metrics["reward/agent_reward/mean"] = float(values.mean())
    metrics["reward/agent_reward/share"] = float(given.mean())
    return RewardResult(token_level, scores, extra, metrics)
