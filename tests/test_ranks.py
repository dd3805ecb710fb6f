"""tests/ranks.py's protections, against ranks written to defeat them: a rank that blocks in C (time.sleep), a rank
that switches its own watchdog off, and the parent failed mid-join the way pytest-timeout fails a test."""

from __future__ import annotations

import faulthandler
import multiprocessing
import signal
import time

import pytest
from ranks import spawn_ranks

pytestmark = pytest.mark.slow  # each spawns two interpreters that import torch: seconds, not milliseconds


def _rank_blocks(rank: int, marker: str) -> None:
    if rank == 1:
        time.sleep(3600)  # in C: no Python-level signal or exception reaches it


def _rank_blocks_without_watchdog(rank: int) -> None:
    faulthandler.cancel_dump_traceback_later()
    time.sleep(3600)


def _rank_raises(rank: int) -> None:
    if rank == 0:
        raise ValueError("rank 0 fails on purpose")
    time.sleep(3600)


def _no_children_left() -> bool:
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not multiprocessing.active_children()


def test_a_blocked_rank_prints_its_stack_and_fails_the_call(capfd):
    started = time.monotonic()
    with pytest.raises(Exception, match="process 1 terminated with exit code 1"):
        spawn_ranks(_rank_blocks, args=("x",), timeout_s=3.0)
    assert time.monotonic() - started < 60
    assert "_rank_blocks" in capfd.readouterr().err  # the watchdog's stack dump names where it blocked
    assert _no_children_left()


def test_a_rank_without_its_watchdog_is_killed_at_the_deadline():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 still run 4 s"):
        spawn_ranks(_rank_blocks_without_watchdog, timeout_s=3.0, grace_s=1.0)
    assert _no_children_left()


def test_a_rank_that_raises_fails_the_call_and_ends_the_others():
    with pytest.raises(Exception, match="rank 0 fails on purpose"):
        spawn_ranks(_rank_raises, timeout_s=300.0)
    assert _no_children_left()


def test_the_parent_failed_mid_join_leaves_no_rank_behind():
    class Expired(Exception):
        pass

    def expire(signum, frame):
        raise Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 3.0)  # what pytest-timeout's signal method does to a test
    try:
        with pytest.raises(Expired):
            spawn_ranks(_rank_blocks_without_watchdog, timeout_s=300.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _no_children_left()
