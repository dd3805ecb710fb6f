"""A reward function that fails on most samples stops the run with an error naming it and its first failure;
below reward_model.max_error_fraction the run goes on and counts the failures; hanging functions are served
concurrently (about two timeout_s per batch, not samples x timeout_s)."""

from __future__ import annotations

import math
import os
import time

import pytest

from hyflow.rewards.managers import RewardFunctionError, describe_function, make_reward_manager
from hyflow.rewards.pool import run_calls


def make_batch(tokenizer, responses, R=16):
    import torch

    from hyflow.batch import Batch

    rows = [tokenizer(text, add_special_tokens=False)["input_ids"][:R] for text in responses]
    resp = torch.full((len(rows), R), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), R), dtype=torch.long)
    for i, ids in enumerate(rows):
        resp[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return Batch({"responses": resp, "response_mask": mask},
                 {"data_source": ["src"] * len(rows), "ground_truth": [str(i) for i in range(len(rows))],
                  "extra_info": [{"i": i} for i in range(len(rows))]})


def raises(**kw):
    raise KeyError("answer")


def returns_none(**kw):
    return None


def returns_text(**kw):
    return "correct"


def returns_nan(**kw):
    return math.nan


def returns_inf(**kw):
    return {"score": math.inf}


def hangs(**kw):
    time.sleep(600)


def kills_its_process(**kw):
    os._exit(7)


FAILURES = {
    raises: "KeyError: 'answer'",
    returns_none: "NoneType",
    returns_text: "'correct'",
    returns_nan: "nan",
    returns_inf: "inf",
    hangs: "timed out after 1.0 s (reward_model.timeout_s)",
    kills_its_process: "the scoring process died (exit code 7)",
}


@pytest.mark.parametrize("fn", list(FAILURES), ids=lambda fn: fn.__name__)
def test_a_function_that_fails_on_every_sample_stops_the_run(tiny_tokenizer, fn):
    batch = make_batch(tiny_tokenizer, ["0", "1", "2", "3"])
    manager = make_reward_manager("naive", tiny_tokenizer, compute_score=fn, num_workers=2, timeout_s=1.0)
    with pytest.raises(RewardFunctionError) as err:
        manager(batch)
    message = str(err.value)
    assert f"test_reward_failures.py:{fn.__name__}" in message  # the function, by file and name
    assert "failed on 4 of 4 samples" in message and "reward_model.max_error_fraction=0.5" in message
    assert "sample 0 (data_source='src')" in message and FAILURES[fn] in message


def test_below_the_fraction_the_run_goes_on_and_counts(tiny_tokenizer):
    def every_other(data_source, solution_str, ground_truth, extra_info=None):
        if int(ground_truth) % 2:
            raise ValueError("no")
        return 1.0

    batch = make_batch(tiny_tokenizer, ["0", "1", "2", "3"])
    result = make_reward_manager("naive", tiny_tokenizer, compute_score=every_other, num_workers=0)(batch)
    assert result.scores == [1.0, 0.0, 1.0, 0.0] and result.metrics["reward/errors"] == 2  # 2 of 4 is not > 0.5
    with pytest.raises(RewardFunctionError, match="failed on 2 of 4"):
        make_reward_manager("naive", tiny_tokenizer, compute_score=every_other, num_workers=0,
                            max_error_fraction=0.25)(batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_hanging_samples_time_out_together(workers):
    started = time.monotonic()
    outcomes = run_calls(hangs, [{} for _ in range(8)], num_workers=workers, timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert all(o.timed_out for o in outcomes)
    assert elapsed < 4 * 1.0, elapsed  # one at a time would take 8 s (4 s with two workers)


def test_a_killed_worker_is_counted_and_the_rest_still_score():
    def fn(i):
        if i == 2:
            os._exit(9)
        return i

    outcomes = run_calls(fn, [{"i": i} for i in range(6)], num_workers=2, timeout_s=5.0)
    assert [o.value for o in outcomes] == [0, 1, None, 3, 4, 5]
    assert "exit code 9" in outcomes[2].error


def test_describe_function_sees_through_partial():
    import functools

    assert describe_function(functools.partial(raises, x=1)).endswith("test_reward_failures.py:raises")
