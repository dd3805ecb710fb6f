"""verl's reward managers prime, gdpo and rate_limited (`limited`), on hand-made batches; the rate limiter's limits
measured on a simulated clock (no timing in the assertions)."""

import threading
import time

import numpy as np
import pytest
import torch

from hyflow.batch import Batch
from hyflow.rewards.managers import (
    GDPORewardManager,
    RateLimitedRewardManager,
    TokenBucket,
    make_reward_manager,
)


def make_batch(tokenizer, texts, R=12, **columns):
    """Responses `texts` (model tokens up to their length), data_source "src", each text its own ground truth,
    extra_info {"i": row}; `columns` added or replaced."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:R] for t in texts]
    responses = torch.full((len(ids), R), tokenizer.pad_token_id)
    mask = torch.zeros((len(ids), R), dtype=torch.long)
    for i, row in enumerate(ids):
        responses[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return Batch({"responses": responses, "response_mask": mask},
                 {"data_source": ["src"] * len(ids), "reward_model": [{"ground_truth": t} for t in texts],
                  "extra_info": [{"i": i} for i in range(len(ids))], **columns})


class FakeClock:
    """A clock that only moves when someone sleeps on it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


# ------------------------------------------------------------------ prime
def tuple_scorer(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(30)
    return (float(solution_str == ground_truth), "PRIME's scorers return (score, detail)")


def test_prime_scores_the_first_element_in_processes_with_a_timeout(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["7", "hang", "12"])
    batch["reward_model"] = [{"ground_truth": "7"}, {"ground_truth": "x"}, {"ground_truth": "3"}]
    manager = make_reward_manager("prime", tiny_tokenizer, compute_score=tuple_scorer, num_workers=2, timeout_s=1.0,
                                  max_error_fraction=1.0)
    result = manager(batch)
    assert result.scores == [1.0, 0.0, 0.0]
    assert result.extra["acc"] == [1.0, None, 0.0]  # verl's `acc`; the timed-out sample has none
    assert result.metrics["reward/timeouts"] == 1 and result.metrics["reward/errors"] == 1
    lengths = batch["response_mask"].sum(-1)
    assert result.token_level_scores[0, lengths[0] - 1] == 1.0 and result.token_level_scores.sum() == 1.0


def test_prime_refuses_reward_kwargs_by_name(tiny_tokenizer):
    with pytest.raises(ValueError, match="reward_manager=prime calls compute_score.*without keyword arguments"):
        make_reward_manager("prime", tiny_tokenizer, compute_score=tuple_scorer, reward_kwargs={"alpha": 1})


# ------------------------------------------------------------------ gdpo
def components(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["i"] == 0:
        return float(len(solution_str))  # a plain number: verl's GDPO manager also reports it as `acc`
    return {"score": 1.0, "accuracy_reward": 1.0, "format_reward": 0.5, "run": extra_info["experiment_name"]}


def test_gdpo_adds_the_experiment_name_and_acc(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["abc", "de"])
    manager = make_reward_manager("gdpo", tiny_tokenizer, compute_score=components, num_workers=0,
                                  experiment_name="exp-7")
    assert isinstance(manager, GDPORewardManager)
    result = manager(batch)
    assert result.scores == [3.0, 1.0]
    assert result.extra["acc"] == [3.0, None]
    assert result.extra["run"] == [None, "exp-7"]
    assert result.extra["accuracy_reward"] == [None, 1.0] and result.extra["format_reward"] == [None, 0.5]
    assert batch["extra_info"][1] == {"i": 1}  # the dataset's dict is not changed in place (verl's is)


def test_gdpo_components_feed_the_gdpo_estimator(tiny_tokenizer):
    """The columns the gdpo manager writes are what algorithm.adv_estimator=gdpo normalises per component."""
    from hyflow.algos.advantages import gdpo

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        i = extra_info["i"]
        return {"score": 0.0, "accuracy_reward": float(i % 2), "format_reward": float(i // 2)}

    batch = make_batch(tiny_tokenizer, ["a", "b", "c", "d"])
    result = make_reward_manager("gdpo", tiny_tokenizer, compute_score=scorer, num_workers=0)(batch)
    extras = {k: torch.tensor(v, dtype=torch.float32) for k, v in result.extra.items()}
    adv, _ = gdpo(result.token_level_scores, batch["response_mask"], index=np.array(["g"] * 4, dtype=object), reward_extras=extras,
                  gdpo_reward_keys=["accuracy_reward", "format_reward"])
    assert not torch.allclose(adv, torch.zeros_like(adv))


def test_gdpo_refuses_reward_kwargs_by_name(tiny_tokenizer):
    with pytest.raises(ValueError, match="reward_manager=gdpo"):
        make_reward_manager("gdpo", tiny_tokenizer, compute_score=components, reward_kwargs={"alpha": 1})


# ------------------------------------------------------------------ the token bucket and rate_limited
def test_token_bucket_admits_a_burst_then_the_rate():
    clock = FakeClock()
    bucket = TokenBucket(2.0, clock=clock, sleep=clock.sleep)  # 120 a minute, a burst of 2
    times = []
    for _ in range(7):
        bucket.acquire(1.0)
        times.append(clock())
    assert times == pytest.approx([0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5])


def test_token_bucket_request_larger_than_its_capacity_waits_its_share():
    clock = FakeClock()
    bucket = TokenBucket(500.0, clock=clock, sleep=clock.sleep)  # capacity 500, requests of 1000 (verl's rule)
    times = []
    for _ in range(4):
        bucket.acquire(1000.0)
        times.append(clock())
    assert times == pytest.approx([1.0, 3.0, 5.0, 7.0])  # after the first, one request per 1000 / 500 s


def within_limit(times: list[float], per_minute: float, burst: float, cost: float = 1.0) -> bool:
    """The token bucket's guarantee: between admissions i < j, (j - i + 1) * cost <= burst + rate * (t_j - t_i)."""
    rate = per_minute / 60.0
    return all((j - i + 1) * cost <= burst + rate * (times[j] - times[i]) + 1e-9
               for i in range(len(times)) for j in range(i + 1, len(times)))


def counting_scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    assert not kwargs, kwargs  # the limits are the manager's, not the scorer's arguments
    return 1.0


@pytest.mark.parametrize("limits, expected", [
    ({"max_rpm": 120}, [0.0, 0.0, 0.5, 1.0, 1.5, 2.0]),
    ({"max_tpm": 60_000, "estimated_tokens_per_request": 1000}, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
    ({"max_rpm": 600, "max_tpm": 120_000}, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),  # tpm binds: 2000 tokens each, 2000 /s
])
def test_rate_limited_manager_holds_its_limits(tiny_tokenizer, limits, expected):
    clock = FakeClock()
    manager = make_reward_manager("rate_limited", tiny_tokenizer, compute_score=counting_scorer,
                                  reward_kwargs=limits, clock=clock, sleep=clock.sleep)
    result = manager(make_batch(tiny_tokenizer, list("abcdef")))
    assert result.scores == [1.0] * 6
    assert manager.admitted_at == pytest.approx(expected)
    if "max_rpm" in limits:
        assert within_limit(manager.admitted_at, limits["max_rpm"], burst=limits["max_rpm"] / 60)
    # a second batch shares the buckets: no fresh burst
    manager(make_batch(tiny_tokenizer, ["g"]))
    assert manager.admitted_at[0] > expected[-1]


def test_rate_limited_manager_runs_at_most_max_concurrent_calls():
    active, peak, lock = [0], [0], threading.Lock()
    pair = threading.Barrier(2, timeout=10)  # passes only when two calls run at once

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            pair.wait()
            return 1.0
        finally:
            with lock:
                active[0] -= 1

    from hyflow.rewards.managers import RateLimitedRewardManager as Manager

    manager = Manager(None, scorer, reward_kwargs={"max_concurrent": 2})
    calls = [{"data_source": "s", "solution_str": str(i), "ground_truth": "", "extra_info": {}} for i in range(6)]
    outcomes = manager.score_calls(calls)
    assert [o.value for o in outcomes] == [1.0] * 6  # every pair met at the barrier: 2 ran at once
    assert peak[0] == 2  # and never 3


def test_rate_limited_timeout_frees_the_slot_and_is_counted(tiny_tokenizer):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "a":
            threading.Event().wait(30)  # hangs past reward_model.timeout_s
        return 2.0

    manager = make_reward_manager("limited", tiny_tokenizer, compute_score=scorer, timeout_s=0.3,
                                  max_error_fraction=1.0)
    assert isinstance(manager, RateLimitedRewardManager) and manager.concurrency == 1
    result = manager(make_batch(tiny_tokenizer, ["a", "b", "c"]))
    assert result.scores == [0.0, 2.0, 2.0]
    assert result.metrics["reward/timeouts"] == 1


def test_rate_limited_rejects_a_bad_concurrency(tiny_tokenizer):
    with pytest.raises(ValueError, match="max_concurrent must be a whole number >= 1"):
        make_reward_manager("rate_limited", tiny_tokenizer, compute_score=counting_scorer,
                            reward_kwargs={"max_concurrent": -1})
