"""Reward managers: turn a generated Batch into token-level scores.

Each manager decodes the valid response tokens of every sample, scores it, and writes the score at the last
valid response token (`token_level_scores[i, len_i - 1]`, zeros elsewhere) — verl's convention. Extra keys
returned by a scorer (a dict with `score` plus e.g. `acc`, `pred`) become per-sample columns and metrics.

- `naive`: one scorer call per sample, in `num_workers` processes, each bounded by `timeout_s`.
- `batch`: one call for the whole batch: `fn(data_sources=, solution_strs=, ground_truths=, extra_infos=)`
  returning a list of scores (or dicts).
- `dapo`: `naive` plus DAPO's overlong penalty (arXiv 2503.14476): with buffer L and maximum length Lmax,
  `penalty = min(0, -(len - (Lmax - L)) / L * factor)`, 0 inside the budget and -factor at Lmax.
- `prime` (verl's PrimeRewardManager): `naive` without reward_kwargs, a tuple result scoring its first element,
  the score also the `acc` column.
- `gdpo` (verl's GDPO manager): `naive` with `extra_info["experiment_name"]`, a plain-number score also `acc`.
- `rate_limited` / `limited` (verl's RateLimitedRewardManager, for scorers behind an API): calls on threads, let
  through by token buckets of `max_rpm` requests and `max_tpm` tokens a minute and at most `max_concurrent` at once.

Every manager but `batch` scores one sample per call (`sample_call` -> `score_calls` -> `finish`), which is what
the reward loop (`hyflow.rewards.reward_loop`) calls on each trajectory as it finishes; both paths share them.

A scorer that fails on a sample (raises, returns None / a string / NaN / inf, times out, or kills its
process) gives that sample a score of 0; it is counted in `reward/errors` (every failure) and
`reward/timeouts` (the timed-out ones) and logged once per distinct error together with the sample. When more
than `max_error_fraction` of a batch's samples failed, the batch is not scored: `RewardFunctionError` names the
function, the first failure and the fix, and the run stops instead of training on zeros. Every result carries the
column `reward_error`: the failure of each failed sample ("" for the others), which the trainer keeps as
`reward_extra/reward_error` beside the sample.

Scores an agent loop gave its own trajectory (the `agent_reward` column) pass the same policy in
`score_with_agent_rewards`: a value that is not a finite number fails that sample (score 0, counted, the column
says why), and too many failures stop the run. Whatever the source, `require_finite_scores` stops the run before a
NaN or inf reaches training, naming the column, the rows and where the scores came from.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
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

REWARD_MANAGERS = Registry("reward manager", lazy={"http": "hyflow.rewards.remote:RemoteRewardManager"})


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


class NonFiniteScoreError(ValueError):
    """A batch's token-level scores hold NaN or inf; the message names the column, the rows and the source."""


ERROR_COLUMN = "reward_error"  # per sample: why its scoring failed, "" when it did not


def failure_text(outcome: Outcome, timeout_s: float | None) -> str:
    """One line saying why `outcome` failed (its error's first line, or its timeout)."""
    if outcome.error:
        return outcome.error.strip().splitlines()[0] if outcome.error.strip() else outcome.error
    return f"timed out after {timeout_s} s (reward_model.timeout_s)"


def require_finite_scores(scores: torch.Tensor, *, source: str, column: str = "token_level_scores") -> None:
    """Raise NonFiniteScoreError when `scores` ([B, ...]) holds a NaN or inf: the message names `column`, the first
    rows that hold one with their values, and `source` (what produced them). Training on such a score gives a NaN
    loss and a skipped update that no metric explains, so the run stops here instead."""
    finite = torch.isfinite(scores)
    if bool(finite.all()):
        return
    bad_rows = (~finite).reshape(len(scores), -1).any(-1).nonzero().flatten().tolist()
    shown = []
    for row in bad_rows[:8]:
        values = scores[row].reshape(-1)
        shown.append(f"row {row}: {values[~torch.isfinite(values)][0].item()}")
    more = f" and {len(bad_rows) - 8} more" if len(bad_rows) > 8 else ""
    raise NonFiniteScoreError(
        f"{column} holds non-finite values in {len(bad_rows)} of {len(scores)} rows ({'; '.join(shown)}{more}), "
        f"from {source}; training on them would make the loss NaN. Make the source return finite numbers (a reward "
        "function or agent loop should fail the sample by raising instead of returning NaN / inf)")


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


class BaseRewardManager:
    def __init__(self, tokenizer, compute_score: Callable | None = None, *, num_workers: int = 1,
                 timeout_s: float = 30.0, reward_kwargs: dict | None = None, num_examine: int = 0,
                 max_response_length: int | None = None, overlong_buffer: dict | None = None,
                 max_error_fraction: float = 0.5, experiment_name: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.experiment_name = experiment_name
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
        detail = outcome.error or f"after {self.timeout_s}s (reward_model.timeout_s)"
        logger.warning("reward function %s on sample %r; it scores 0 and the run goes on. %s",
                       "timed out" if outcome.timed_out else "raised", sample, detail)

    # ---- one sample at a time: what the batch path and the reward loop (hyflow.rewards.reward_loop) share
    streams = True  # one call per sample: the reward loop may score each sample as soon as it finishes

    def sample_call(self, data_source, solution_str: str, ground_truth, extra_info) -> dict:
        """The keyword arguments of the scorer's call for one sample (verl's signature, + reward_kwargs)."""
        return {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                "extra_info": extra_info, **self.reward_kwargs}

    def sample_calls(self, batch: Batch, texts: list[str]) -> list[dict]:
        """`sample_call` for every row of `batch`, whose decoded responses are `texts`."""
        return [self.sample_call(ds, text, gt, info)
                for ds, text, gt, info in zip(self._column(batch, "data_source"), texts, self._ground_truths(batch),
                                              self._column(batch, "extra_info", {}))]

    def score_calls(self, calls: list[dict]) -> list[Outcome]:
        """The scorer on `calls`, each bounded by `timeout_s`, in `num_workers` processes (hyflow.rewards.pool)."""
        return run_calls(self.compute_score, calls, num_workers=self.num_workers, timeout_s=self.timeout_s)

    def _refuse_reward_kwargs(self, name: str, verl_name: str) -> None:
        """A manager whose verl original passes the scorer no keyword arguments refuses reward_kwargs by name."""
        if self.reward_kwargs:
            raise ValueError(f"reward_model.reward_manager={name} calls compute_score(data_source, solution_str, "
                             f"ground_truth, extra_info) without keyword arguments ({verl_name}), but "
                             f"reward_model.reward_kwargs sets {sorted(self.reward_kwargs)}; drop them or use "
                             "reward_manager=naive")

    def normalize(self, value) -> tuple[float, dict]:
        """(score, extra columns) from what the scorer returned; TypeError / ValueError for a value that is none."""
        return normalize_score(value)

    def finish(self, batch: Batch, outcomes: list[Outcome], calls: list[dict],
               lengths: torch.Tensor | None = None) -> RewardResult:
        """The batch's RewardResult from every sample's Outcome (failures counted, `max_error_fraction` checked)."""
        if lengths is None:
            lengths = response_lengths(batch)
        for i in range(min(self.num_examine, len(calls))):
            logger.info("[sample %d] %s -> %s", i, calls[i].get("solution_str"), outcomes[i].value)
        return self._finish(batch, outcomes, calls, lengths)

    def __call__(self, batch: Batch) -> RewardResult:
        texts, lengths = self.decode_responses(batch)
        calls = self.sample_calls(batch, texts)
        return self.finish(batch, self.score_calls(calls), calls, lengths)

    def _finish(self, batch: Batch, outcomes: list[Outcome], calls: list[dict], lengths: torch.Tensor) -> RewardResult:
        scores, extras, failures, timeouts, first = [], [], [], 0, None
        for index, (outcome, call) in enumerate(zip(outcomes, calls)):
            if outcome.ok:
                try:
                    score, extra = self.normalize(outcome.value)
                except (TypeError, ValueError, OverflowError) as exc:
                    outcome = Outcome(error=str(exc))
            failures.append("" if outcome.ok else failure_text(outcome, self.timeout_s))
            if not outcome.ok:
                timeouts += outcome.timed_out
                self._record_failure(outcome, {k: call.get(k) for k in ("data_source", "solution_str", "ground_truth")})
                first = first or (index, call.get("data_source"), outcome)
                score, extra = 0.0, {}
            scores.append(score)
            extras.append(extra)
        errors = sum(bool(text) for text in failures)
        if errors > self.max_error_fraction * len(calls):
            self._stop(errors, len(calls), first)
        return self._assemble(batch, scores, extras, lengths, failures, timeouts)

    def _stop(self, errors: int, total: int, first: tuple) -> None:
        index, data_source, outcome = first
        what = failure_text(outcome, self.timeout_s)
        raise RewardFunctionError(
            f"the reward function {describe_function(self.compute_score)} failed on {errors} of {total} samples of "
            f"this batch, more than reward_model.max_error_fraction={self.max_error_fraction}; the first: sample "
            f"{index} (data_source={data_source!r}) {what}. Fix the function (run it on a few dataset rows by hand), "
            "raise reward_model.timeout_s if it is slow, or raise reward_model.max_error_fraction to train on "
            "anyway (failed samples score 0)")

    def _assemble(self, batch, scores, extras, lengths, failures, timeouts) -> RewardResult:
        errors = sum(bool(text) for text in failures)
        metrics: dict[str, float] = {"reward/errors": float(errors), "reward/timeouts": float(timeouts)}
        if self.overlong_buffer.get("enable"):
            scores, extras = self._overlong_penalty(scores, extras, lengths, metrics)
        keys = sorted({k for e in extras for k in e} - {ERROR_COLUMN})
        extra = {k: [e.get(k) for e in extras] for k in keys}
        extra[ERROR_COLUMN] = list(failures)
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
class NaiveRewardManager(BaseRewardManager):
    """One scorer call per sample: `compute_score(data_source, solution_str, ground_truth, extra_info, **kw)`."""


@register_reward_manager("dapo")
class DAPORewardManager(NaiveRewardManager):
    """`naive` with DAPO's overlong penalty switched on (reward_model.overlong_buffer)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.overlong_buffer.setdefault("enable", True)


@register_reward_manager("batch")
class BatchRewardManager(BaseRewardManager):
    """One scorer call for the whole batch; the function returns one score (or dict) per sample."""

    streams = False  # the function wants the whole batch at once: the reward loop falls back to the batch path

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


@register_reward_manager("prime")
class PrimeRewardManager(BaseRewardManager):
    """verl's PrimeRewardManager (the PRIME recipe, verl.workers.reward_manager.prime): every sample scored by
    `compute_score(data_source, solution_str, ground_truth, extra_info)` in a pool of processes
    (reward_model.num_workers; verl hard-codes 64), each call bounded by reward_model.timeout_s (verl: 300 s).
    A tuple or list result scores its first element (PRIME's scorers return `(score, ...)`); the score is also
    the `acc` column (verl's `batch["acc"]`). As in verl the scorer gets no reward_kwargs. A failed or timed-out
    sample scores 0 as in verl, and is also counted (reward/errors) and bounded by max_error_fraction."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._refuse_reward_kwargs("prime", "verl's PrimeRewardManager")

    def normalize(self, value) -> tuple[float, dict]:
        if isinstance(value, (tuple, list)):
            if not value:
                raise TypeError("the reward function returned an empty sequence; prime scores its first element")
            value = value[0]
        score, extra = normalize_score(value)
        return score, {**extra, "acc": score}


@register_reward_manager("gdpo")
class GDPORewardManager(BaseRewardManager):
    """verl's GDPO reward manager (verl.experimental.reward_loop.reward_manager.gdpo; its GDPO example sets
    `reward_manager.name=gdpo` beside `algorithm.adv_estimator=gdpo`): one call per sample, `extra_info` gains
    `experiment_name` (trainer.experiment_name), and a scorer that returns a plain number gets it as the `acc`
    column too; a dict's keys become columns, which `algorithm.gdpo_reward_keys` names for the GDPO estimator
    (hyflow.algos.advantages.gdpo). As in verl the scorer gets no reward_kwargs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._refuse_reward_kwargs("gdpo", "verl's GDPO manager")

    def sample_call(self, data_source, solution_str: str, ground_truth, extra_info) -> dict:
        return {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                "extra_info": {**dict(extra_info or {}), "experiment_name": self.experiment_name}}

    def normalize(self, value) -> tuple[float, dict]:
        score, extra = normalize_score(value)
        return score, (extra if isinstance(value, dict) else {"acc": score})


class TokenBucket:
    """verl's AsyncTokenBucket, synchronous: `rate` tokens a second refill a bucket of `capacity` (default `rate`)
    that starts full; `acquire(k)` takes k tokens, sleeping until they are there. A request larger than the
    capacity takes what is there, leaves the bucket negative and sleeps for the rest (verl's rule). `clock` and
    `sleep` are injectable (tests drive the bucket on a simulated clock)."""

    def __init__(self, rate: float, capacity: float | None = None, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"a token bucket needs a finite rate > 0, got {rate}")
        self.rate, self.capacity = float(rate), float(capacity or rate)
        self.tokens, self.last = self.capacity, None
        self.clock, self.sleep = clock, sleep
        self.lock = threading.Lock()

    def _refill(self) -> float:
        now = self.clock()
        if self.last is None:
            self.last = now
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now
        return now

    def acquire(self, amount: float = 1.0, deadline: float | None = None) -> bool:
        """Take `amount` tokens, sleeping until the bucket holds them; True once taken. With `deadline` (a time of
        `clock`): False at once, nothing taken, when the tokens would not be there by then."""
        if amount > self.capacity:
            with self.lock:
                now = self._refill()
                wait_s = max(0.0, (amount - self.tokens) / self.rate)
                if deadline is not None and now + wait_s > deadline:
                    return False
                self.tokens -= amount
            if wait_s > 0:
                self.sleep(wait_s)
            return True
        while True:
            with self.lock:
                now = self._refill()
                if self.tokens >= amount:
                    self.tokens -= amount
                    return True
                wait_s = (amount - self.tokens) / self.rate
                if deadline is not None and now + wait_s > deadline:
                    return False
            self.sleep(wait_s)


def _limit(name: str, value, default: float | None, *, integer: bool = False) -> float | None:
    """A rate-limit setting as a positive number (`default` when unset); ValueError naming the key otherwise."""
    if value is None:
        return default
    key = f"reward_model.reward_kwargs.{name}"
    need = "a whole number >= 1" if integer else "a number > 0"
    number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if not number or value <= 0 or (integer and int(value) != value):
        unset = "1" if integer else "no limit"
        raise ValueError(f"{key} must be {need}, got {value!r:.80}; set e.g. +{key}={4 if integer else 60}, or leave "
                         f"it unset for {unset}")
    return float(value)


@register_reward_manager("rate_limited")
class RateLimitedRewardManager(BaseRewardManager):
    """verl's RateLimitedRewardManager (`rate_limited`; hyflow also accepts `limited`), for scorers that call a
    rate-limited API: each sample's call waits for one of `max_concurrent` slots (default 1), then for a request
    token (`max_rpm` requests a minute, a bucket of max_rpm / 60), then for `estimated_tokens_per_request` tokens
    (`max_tpm` tokens a minute, a bucket of max_tpm / 60), and runs on a thread (an API call waits on the network;
    verl runs it in its event loop's executor). The limits are verl's
    `reward.{max_concurrent,max_rpm,max_tpm,estimated_tokens_per_request}`, given here as reward_model.reward_kwargs
    of those names (they are not passed to the scorer); each must be a positive number, and a request must fit in
    a minute's tokens (estimated_tokens_per_request <= max_tpm). The buckets live as long as the manager, so
    consecutive batches share them.

    reward_model.timeout_s bounds each sample from the moment it has a slot: its wait for the buckets and its call
    together (verl bounds the call only). A sample whose tokens would not come before that deadline fails at once
    as timed out (counted in reward/timeouts, the error names the limits), so a limit far below the batch's needs
    costs samples, which max_error_fraction turns into a stop, instead of a silent wait of hours. A timed-out call
    is abandoned (a thread cannot be killed) and its slot freed, as verl's `asyncio.wait_for` does."""

    LIMIT_KEYS = ("max_concurrent", "max_rpm", "max_tpm", "estimated_tokens_per_request")

    def __init__(self, *args, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        max_concurrent, max_rpm, max_tpm, per_request = (self.reward_kwargs.pop(key, None) for key in self.LIMIT_KEYS)
        self.concurrency = int(_limit("max_concurrent", max_concurrent, 1, integer=True))
        self.max_rpm = _limit("max_rpm", max_rpm, None)
        self.max_tpm = _limit("max_tpm", max_tpm, None)
        self.tokens_per_request = _limit("estimated_tokens_per_request", per_request, 2000.0)
        if self.max_tpm is not None and self.tokens_per_request > self.max_tpm:
            raise ValueError(
                f"reward_model.reward_kwargs.estimated_tokens_per_request={self.tokens_per_request:g} is more than "
                f"max_tpm={self.max_tpm:g} tokens a minute: every request would wait "
                f"{60 * self.tokens_per_request / self.max_tpm:.0f} s for its tokens. Raise max_tpm to the API's "
                "tokens-per-minute limit, or lower estimated_tokens_per_request to a request's real size")
        self.clock = clock
        self.rpm_limiter = TokenBucket(self.max_rpm / 60.0, clock=clock, sleep=sleep) if self.max_rpm else None
        self.tpm_limiter = TokenBucket(self.max_tpm / 60.0, clock=clock, sleep=sleep) if self.max_tpm else None
        self.admitted_at: list[float] = []  # the limiter clock when each call of the last score_calls was let through

    def _admit(self, deadline: float | None) -> Outcome | None:
        """Wait for the buckets' tokens until `deadline` (limiter clock); None when admitted, else the sample's
        timed-out Outcome."""
        for bucket, amount, what in ((self.rpm_limiter, 1.0, f"max_rpm={self.max_rpm}"),
                                     (self.tpm_limiter, self.tokens_per_request,
                                      f"max_tpm={self.max_tpm} at estimated_tokens_per_request="
                                      f"{self.tokens_per_request:g}")):
            if bucket is not None and not bucket.acquire(amount, deadline):
                return Outcome(timed_out=True, error=(
                    f"timed out waiting for the rate limiter ({what}): its tokens would come after the sample's "
                    f"reward_model.timeout_s={self.timeout_s} s; raise the limit if the API allows, or raise timeout_s"))
        return None

    def score_calls(self, calls: list[dict]) -> list[Outcome]:
        from concurrent.futures import FIRST_COMPLETED, Future, wait

        from hyflow.rewards.pool import call_scorer, guard_process_exit

        outcomes: list[Outcome | None] = [None] * len(calls)
        running: dict = {}  # future -> (index, deadline on time.monotonic)
        self.admitted_at = []

        def start(call: dict) -> Future:  # a daemon thread of its own: one abandoned at its timeout holds no exit
            future: Future = Future()
            threading.Thread(target=lambda: future.set_result(call_scorer(self.compute_score, call)), daemon=True,
                             name="hyflow-reward-call").start()
            return future

        def reap() -> None:  # wait for a call to end or time out; record what ended
            deadline = min(end for _, end in running.values())
            done, _ = wait(list(running), timeout=None if deadline == math.inf else max(0.0, deadline - time.monotonic()),
                           return_when=FIRST_COMPLETED)
            for future in done:
                outcomes[running.pop(future)[0]] = future.result()
            now = time.monotonic()
            for future, (index, end) in list(running.items()):
                if now >= end:
                    outcomes[index] = Outcome(timed_out=True)
                    del running[future]

        with guard_process_exit():
            for index, call in enumerate(calls):
                while len(running) >= self.concurrency:
                    reap()
                began = self.clock()
                refused = self._admit(began + self.timeout_s if self.timeout_s else None)
                if refused is not None:
                    outcomes[index] = refused
                    continue
                self.admitted_at.append(self.clock())
                left = self.timeout_s - (self.clock() - began) if self.timeout_s else math.inf
                running[start(call)] = (index, time.monotonic() + max(0.0, left))
            while running:
                reap()
        return outcomes


REWARD_MANAGERS.register("limited", RateLimitedRewardManager)


def make_reward_manager(name: str, tokenizer, **kwargs):
    """The reward manager registered as `name` (reward_model.reward_manager; an unknown name is a ValueError
    naming the closest)."""
    return REWARD_MANAGERS.get(name)(tokenizer, **kwargs)


def agent_score(value) -> float:
    """An agent loop's `reward_score` as a finite float; ValueError naming the value (bounded) when it is not a
    number or not finite."""
    shown = repr(value)
    shown = shown if len(shown) <= 120 else shown[:60] + " ... " + shown[-40:]
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"the agent loop's reward_score {shown} is a {type(value).__name__}, not a number; return a "
                         "float from the agent loop or environment (None leaves the sample to the reward function)")
    try:
        score = float(value)
    except (OverflowError, ValueError):
        score = math.nan
    if not math.isfinite(score):
        raise ValueError(f"the agent loop's reward_score {shown} is not a finite number; return a finite float from "
                         "the agent loop or environment (check for 0/0, log(0) or an overflow)")
    return score


def _source_name(manager) -> str:
    fn = getattr(manager, "compute_score", None)
    name = type(manager).__name__ if hasattr(manager, "compute_score") else describe_function(manager)
    return f"the reward manager {name}" + (f" ({describe_function(fn)})" if fn is not None else "")


def score_with_agent_rewards(manager, batch: Batch,
                             score: Callable[[Batch, np.ndarray], RewardResult] | None = None) -> RewardResult:
    """`manager(batch)`, except for the rows whose agent loop scored its own trajectory (the `agent_reward` column,
    `AgentLoopOutput.reward_score`, verl's field): their score is that value, on the last model token as every
    score is, and the reward function is not called for them (a batch where every loop scored needs none).
    `score(rows_batch, rows)` scores the other rows (default `manager(rows_batch)`; the reward loop passes the
    outcomes it already has).

    An agent score that is not a finite number (NaN, inf, a string) fails its sample as a reward function's
    failure does: score 0, counted in `reward/errors`, the reason in the `reward_error` column; more failed samples
    than `manager.max_error_fraction` of the batch stop the run (RewardFunctionError). The result's scores are then
    checked finite whatever produced them (`require_finite_scores`)."""
    score = score or (lambda rows_batch, rows: manager(rows_batch))
    agent = list(batch["agent_reward"]) if "agent_reward" in batch else [None] * len(batch)
    given = np.array([value is not None for value in agent], dtype=bool)
    if not given.any():
        result = score(batch, np.arange(len(batch)))
        require_finite_scores(result.token_level_scores, source=_source_name(manager))
        return result
    lengths = response_lengths(batch)
    token_level = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    scores: list = [None] * len(batch)
    extra: dict[str, list] = {}
    metrics: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
    if not given.all():  # the other rows go through the reward function
        rest = np.flatnonzero(~given)
        result = score(batch[~given], rest)
        token_level[torch.as_tensor(rest)] = result.token_level_scores
        for i, row in enumerate(rest):
            scores[row] = result.scores[i]
        for key, values in result.extra.items():
            column = extra.setdefault(key, [None] * len(batch))
            for i, row in enumerate(rest):
                column[row] = values[i]
        metrics.update(result.metrics)
    rows = np.flatnonzero(given)
    values, failures = [], []
    for row in rows:
        try:
            values.append(agent_score(agent[row]))
            failures.append("")
        except ValueError as exc:
            values.append(0.0)
            failures.append(str(exc))
    errors = sum(bool(text) for text in failures)
    if errors or ERROR_COLUMN in extra or given.all():
        column = extra.setdefault(ERROR_COLUMN, [""] * len(batch))
        for row, text in zip(rows, failures):
            column[row] = text
    if errors:
        first = next(f"sample {row}: {text}" for row, text in zip(rows, failures) if text)
        logger.warning("%d agent-scored sample(s) of this batch have no usable score; they score 0 and the run goes "
                       "on. The first: %s", errors, first)
        metrics["reward/errors"] = metrics.get("reward/errors", 0.0) + errors
        total = metrics["reward/errors"]
        fraction = getattr(manager, "max_error_fraction", 0.5)
        if total > fraction * len(batch):
            raise RewardFunctionError(
                f"{int(total)} of {len(batch)} samples of this batch failed to score ({errors} of them scored by their "
                f"agent loop), more than reward_model.max_error_fraction={fraction}; the first agent-scored one: "
                f"{first}. Fix the agent loop or environment that returns it, or raise "
                "reward_model.max_error_fraction to train on anyway (failed samples score 0)")
    values_t = torch.tensor(values, dtype=torch.float32)
    last = last_model_token(batch, lengths)[torch.as_tensor(rows)]
    token_level[torch.as_tensor(rows), last] = values_t * (lengths[torch.as_tensor(rows)] > 0).float()
    for i, row in enumerate(rows):
        scores[row] = float(values_t[i])
    metrics["reward/agent_reward/mean"] = float(values_t.mean())
    metrics["reward/agent_reward/share"] = float(given.mean())
    require_finite_scores(token_level, source=f"the agent loops' reward_score (agent_reward) and {_source_name(manager)}")
    return RewardResult(token_level, scores, extra, metrics)
