import os
import time

import pytest

from hyflow.rewards.pool import run_calls


def square(x):
    return x * x


def flaky(x):
    if x % 3 == 2:
        raise RuntimeError(f"bad sample {x}")
    return float(x)


def sleepy(x):
    if x == 1:
        time.sleep(60)
    return x


def dies(x):
    if x == 2:
        os._exit(7)
    return x


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_results_in_order(workers):
    out = run_calls(square, [{"x": i} for i in range(7)], num_workers=workers, timeout_s=10)
    assert [o.value for o in out] == [i * i for i in range(7)]
    assert all(o.ok for o in out)


@pytest.mark.parametrize("workers", [0, 2])
def test_raising_calls_are_recorded_per_sample(workers):
    out = run_calls(flaky, [{"x": i} for i in range(9)], num_workers=workers, timeout_s=10)
    failed = [i for i, o in enumerate(out) if not o.ok]
    assert failed == [2, 5, 8]
    assert "bad sample 5" in out[5].error
    assert out[4].value == 4.0


def test_closure_works_without_pickling():
    offset = 10
    out = run_calls(lambda x: x + offset, [{"x": 1}, {"x": 2}], num_workers=2)
    assert [o.value for o in out] == [11, 12]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_hanging_call_times_out_and_the_rest_finish(workers):
    start = time.monotonic()
    out = run_calls(sleepy, [{"x": i} for i in range(4)], num_workers=workers, timeout_s=0.5)
    assert time.monotonic() - start < 10
    assert out[1].timed_out and not out[1].ok
    assert [o.value for i, o in enumerate(out) if i != 1] == [0, 2, 3]


def test_dead_worker_is_replaced():
    out = run_calls(dies, [{"x": i} for i in range(5)], num_workers=1, timeout_s=5)
    assert "died" in out[2].error and "7" in out[2].error
    assert [o.value for i, o in enumerate(out) if i != 2] == [0, 1, 3, 4]


@pytest.mark.timeout(40)  # the pool once waited on such a worker forever
def test_a_worker_stuck_before_its_first_sample_is_started_again(monkeypatch, tmp_path):
    """A fork can deadlock before its first sample (a lock the trainer's generation thread held at the fork stays
    held in the child): the pool starts it again instead of waiting on it forever (a CI run hung on this: its
    Ctrl-C never ended the run)."""
    from hyflow.rewards import pool

    real_worker = pool._worker

    def stuck_once(fn, calls, indices, conn):
        try:  # the first process to start hangs before it announces a sample, the rest work
            os.close(os.open(tmp_path / "first", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return real_worker(fn, calls, indices, conn)
        time.sleep(600)

    monkeypatch.setattr(pool, "_worker", stuck_once)
    start = time.monotonic()
    out = run_calls(square, [{"x": i} for i in range(6)], num_workers=2, timeout_s=1.0)
    assert time.monotonic() - start < 15
    assert [o.value for o in out] == [i * i for i in range(6)] and all(o.ok for o in out)


@pytest.mark.timeout(40)
def test_a_worker_that_never_starts_costs_its_samples_not_the_call(monkeypatch):
    from hyflow.rewards import pool

    real_worker = pool._worker

    def never_for_worker_zero(fn, calls, indices, conn):
        if 0 in indices:
            time.sleep(600)
        return real_worker(fn, calls, indices, conn)

    monkeypatch.setattr(pool, "_worker", never_for_worker_zero)
    start = time.monotonic()
    out = run_calls(square, [{"x": i} for i in range(6)], num_workers=2, timeout_s=0.5)
    assert time.monotonic() - start < 15
    assert [o.value for o in out[1::2]] == [1, 9, 25]
    assert all("silent outside a sample" in o.error for o in out[0::2]), [o.error for o in out[0::2]]
