"""Run a scoring function over many samples with a per-sample wall-clock timeout, optionally in parallel.

`num_workers = 0` calls the function in this process (a timeout then needs the main thread: SIGALRM).
`num_workers >= 1` forks that many worker processes for the call. Forking means the function and its arguments
are inherited, never pickled, so a closure or a function loaded from a user file works as is. Each worker
announces the sample it starts; a worker silent past `timeout_s` on one sample is killed, that sample is
recorded as timed out, and a fresh worker takes over its remaining samples. A function that raises records
the error for that sample only. Nothing a scorer does can stop the run.

Caveat: forked workers must not use torch threads or CUDA (scorers are plain Python; that is the contract).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any


@dataclass
class Outcome:
    """What happened to one call: its return value, or the error text, or a timeout."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def _call(fn: Callable, kwargs: dict) -> Outcome:
    try:
        return Outcome(value=fn(**kwargs))
    except Exception as exc:  # the scorer's own bug: recorded, not raised
        return Outcome(error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")


def _worker(fn: Callable, calls: Sequence[dict], indices: list[int], conn) -> None:
    for idx in indices:
        conn.send(("start", idx))
        outcome = _call(fn, calls[idx])
        try:
            conn.send(("done", idx, outcome))
        except Exception as exc:  # an unpicklable return value
            conn.send(("done", idx, Outcome(error=f"the score could not be sent back: {exc}")))
    conn.close()


class _Alarm(BaseException):  # not an Exception, so `_call` does not swallow it
    pass


def _call_with_alarm(fn: Callable, kwargs: dict, timeout_s: float) -> Outcome:
    if threading.current_thread() is not threading.main_thread() or not timeout_s:
        return _call(fn, kwargs)

    def on_alarm(signum, frame):
        raise _Alarm

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return _call(fn, kwargs)
    except _Alarm:
        return Outcome(timed_out=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_calls(fn: Callable, calls: Sequence[dict], *, num_workers: int = 1, timeout_s: float = 30.0) -> list[Outcome]:
    """`[fn(**kwargs) for kwargs in calls]` as Outcomes, each bounded by `timeout_s` seconds."""
    if not calls:
        return []
    if num_workers <= 0:
        return [_call_with_alarm(fn, kwargs, timeout_s) for kwargs in calls]

    ctx = mp.get_context("fork")
    results: list[Outcome | None] = [None] * len(calls)
    pending = {w: list(range(w, len(calls), num_workers)) for w in range(min(num_workers, len(calls)))}
    workers: dict = {}  # conn -> (process, worker id, current index, start time)

    def launch(w: int) -> None:
        todo = [i for i in pending[w] if results[i] is None]
        if not todo:
            return
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(fn, calls, todo, child), daemon=True)
        proc.start()
        child.close()
        workers[parent] = [proc, w, None, time.monotonic()]

    for w in pending:
        launch(w)
    while workers:
        now = time.monotonic()
        deadlines = [start + timeout_s for _, _, idx, start in workers.values() if idx is not None]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else timeout_s
        ready = wait(list(workers), timeout=min(wait_s, 1.0) if timeout_s else None)
        for conn in ready:
            proc, w, current, _ = workers[conn]
            try:
                message = conn.recv()
            except EOFError:  # finished its list, or died
                del workers[conn]
                proc.join(timeout=1)
                if current is not None:  # it died mid-sample (os._exit, segfault, OOM kill)
                    results[current] = Outcome(error=f"the scoring process died (exit code {proc.exitcode})")
                launch(w)  # no-op when its list is done
                continue
            if message[0] == "start":
                workers[conn][2:] = [message[1], time.monotonic()]
            else:
                results[message[1]] = message[2]
                workers[conn][2] = None
        now = time.monotonic()
        for conn, (proc, w, idx, start) in list(workers.items()):
            if idx is not None and timeout_s and now - start > timeout_s:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=5)
                conn.close()
                del workers[conn]
                results[idx] = Outcome(timed_out=True)
                launch(w)
    return [r if r is not None else Outcome(error="no result was produced") for r in results]
