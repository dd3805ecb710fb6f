"""Run a scoring function over many samples with a per-sample wall-clock timeout, optionally in parallel.

`num_workers = 0` calls the function in this process (a timeout then needs the main thread: SIGALRM).
`num_workers >= 1` forks that many worker processes for the call. Forking means the function and its arguments
are inherited, never pickled, so a closure or a function loaded from a user file works as is. Each worker
announces the sample it starts; a worker silent past `timeout_s` on one sample is killed, that sample is
recorded as timed out, and a fresh worker takes over its remaining samples. A function that raises records
the error for that sample only; whether too many failures stop the run is the reward manager's decision.

Timeouts are served concurrently: once one sample of a call has timed out, the function is taken to hang, and
every sample not finished yet runs at once, each in a forked process of its own with its own `timeout_s` (at
most `HANG_CONCURRENCY` at a time). A function that hangs on every sample therefore costs about two
`timeout_s` per call, not samples x timeout_s. With `num_workers = 0` the first timeout switches the rest of the
call to the same forked mode.

A scoring function cannot end the trainer. `SystemExit` (``sys.exit``) is recorded as that sample's error like
any exception. ``os._exit`` cannot be caught, so while a function runs in this process (`num_workers = 0`)
`os._exit` is replaced by a function that raises `ProcessExitCalled` (the sample's error names the call) and put
back when it returns; in a forked worker it only ends that worker, which is recorded as "the scoring process
died". KeyboardInterrupt is never caught: Ctrl-C still stops the run.

A worker silent past `timeout_s` outside any sample (a fork that deadlocked before its first sample: the trainer
forks while its generation thread runs, and a lock that thread held stays held in the child) is killed and started
again, `STARTUP_RETRIES` times; after that its samples are recorded as errors. Without this, the trainer waited on
it forever (and a Ctrl-C then never ended the run).

Caveat: forked workers must not use torch threads or CUDA (scorers are plain Python; that is the contract).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
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


class ProcessExitCalled(Exception):
    """A scoring function running in the trainer's process called ``os._exit`` (see the module docstring)."""


_EXIT_GUARD_LOCK = threading.Lock()
_EXIT_GUARD_USERS = 0
_REAL_OS_EXIT = os._exit


@contextlib.contextmanager
def guard_process_exit(what: str = "the reward function") -> Iterator[None]:
    """While the block runs, ``os._exit(code)`` in this process raises `ProcessExitCalled` instead of ending it.

    Reference-counted across threads; a process forked meanwhile (whose pid differs) still exits for real, so
    multiprocessing children inside the guarded code end normally."""
    global _EXIT_GUARD_USERS
    owner = os.getpid()

    def guarded_exit(code: int = 0) -> None:
        if os.getpid() != owner:
            _REAL_OS_EXIT(code)
        raise ProcessExitCalled(f"{what} called os._exit({code}), which would have ended the trainer without a "
                                "word; hyflow stopped it. Return a score, or raise an exception to report a failure")

    with _EXIT_GUARD_LOCK:
        if _EXIT_GUARD_USERS == 0:
            os._exit = guarded_exit
        _EXIT_GUARD_USERS += 1
    try:
        yield
    finally:
        with _EXIT_GUARD_LOCK:
            _EXIT_GUARD_USERS -= 1
            if _EXIT_GUARD_USERS == 0:
                os._exit = _REAL_OS_EXIT


def call_scorer(fn: Callable, kwargs: dict) -> Outcome:
    try:
        return Outcome(value=fn(**kwargs))
    except ProcessExitCalled as exc:
        return Outcome(error=str(exc))
    except SystemExit as exc:  # sys.exit in the scorer: recorded, it must not end the trainer
        return Outcome(error=f"SystemExit: {exc.code} (the reward function called sys.exit({exc.code!r}) or raised "
                             "SystemExit; return a score, or raise an exception to report a failure)")
    except Exception as exc:  # the scorer's own bug: recorded, not raised
        return Outcome(error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")


def _worker(fn: Callable, calls: Sequence[dict], indices: list[int], conn) -> None:
    # Ctrl-C reaches every process of the job: the trainer handles it (and ends this worker); a worker that
    # raised KeyboardInterrupt too would print a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler (it raises): SIGTERM just ends a worker
    for idx in indices:
        conn.send(("start", idx))
        outcome = call_scorer(fn, calls[idx])
        try:
            conn.send(("done", idx, outcome))
        except Exception as exc:  # an unpicklable return value
            conn.send(("done", idx, Outcome(error=f"the score could not be sent back: {exc}")))
    conn.close()


class _Alarm(BaseException):  # not an Exception, so `call_scorer` does not swallow it
    pass


def _call_with_alarm(fn: Callable, kwargs: dict, timeout_s: float) -> Outcome:
    """`fn(**kwargs)` in this process, os._exit guarded, bounded by SIGALRM when this is the main thread."""
    with guard_process_exit():
        return _call_with_alarm_unguarded(fn, kwargs, timeout_s)


def _call_with_alarm_unguarded(fn: Callable, kwargs: dict, timeout_s: float) -> Outcome:
    if threading.current_thread() is not threading.main_thread() or not timeout_s:
        return call_scorer(fn, kwargs)

    def on_alarm(signum, frame):
        raise _Alarm

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return call_scorer(fn, kwargs)
    except _Alarm:
        return Outcome(timed_out=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C that arrives while the block runs is raised when it ends. Forking runs Python's at-fork callbacks,
    and a KeyboardInterrupt raised inside one of them is printed ("Exception ignored in ...") and dropped, so the
    run would go on. Only in the main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous):
            previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


HANG_CONCURRENCY = 64  # most forked processes at once for the samples of a function that hangs
STARTUP_RETRIES = 2  # fresh starts of a worker that went silent outside a sample, before its samples are errors


def run_calls(fn: Callable, calls: Sequence[dict], *, num_workers: int = 1, timeout_s: float = 30.0) -> list[Outcome]:
    """`[fn(**kwargs) for kwargs in calls]` as Outcomes, each bounded by `timeout_s` seconds."""
    if not calls:
        return []
    if num_workers <= 0:
        results: list[Outcome | None] = [None] * len(calls)
        for i, kwargs in enumerate(calls):
            results[i] = _call_with_alarm(fn, kwargs, timeout_s)
            if results[i].timed_out and i + 1 < len(calls):  # it hangs: the rest concurrently, in forks
                rest = _run_forked(fn, calls, list(range(i + 1, len(calls))), HANG_CONCURRENCY, timeout_s,
                                   one_per_process=True)
                results[i + 1:] = rest[i + 1:]
                break
        return results
    return _run_forked(fn, calls, list(range(len(calls))), num_workers, timeout_s)


def _run_forked(fn: Callable, calls: Sequence[dict], todo_indices: list[int], num_workers: int, timeout_s: float,
                *, one_per_process: bool = False) -> list[Outcome | None]:
    """Outcomes of `todo_indices` (others None) from forked workers; see the module docstring."""
    return _ForkedRun(fn, calls, todo_indices, num_workers, timeout_s, one_per_process).run()


class _ForkedRun:
    """The state of one `_run_forked` call: its workers, their samples, and whether it is in hang mode."""

    def __init__(self, fn: Callable, calls: Sequence[dict], todo_indices: list[int], num_workers: int,
                 timeout_s: float, one_per_process: bool) -> None:
        self.ctx = mp.get_context("fork")
        self.fn, self.calls, self.todo_indices, self.timeout_s = fn, calls, todo_indices, timeout_s
        self.results: list[Outcome | None] = [None] * len(calls)
        self.hanging = one_per_process
        self.pending = {w: todo_indices[w::num_workers] for w in range(min(num_workers, len(todo_indices)))}
        self.workers: dict = {}  # conn -> (process, worker id, current index, start time)
        self.running: set[int] = set()  # samples a live worker has been given
        self.restarts: dict = {}  # worker id -> times it was started again after going silent outside a sample

    def start(self, w, todo: list[int]) -> None:
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_worker, args=(self.fn, self.calls, todo, child), daemon=True)
        with _sigint_deferred():
            proc.start()
            child.close()
            self.workers[parent] = [proc, w, None, time.monotonic()]
        self.running.update(todo)

    def launch(self, w) -> None:
        """Worker `w` (again) for its samples without a result; in hang mode, one process per sample instead."""
        if self.hanging:
            self.spread()
            return
        todo = [i for i in self.pending.get(w, []) if self.results[i] is None]
        if todo:
            self.start(w, todo)

    def spread(self) -> None:
        """Hang mode: every sample without a result and not running gets a process of its own."""
        waiting = [i for i in self.todo_indices if self.results[i] is None and i not in self.running]
        for i in waiting[: max(0, HANG_CONCURRENCY - len(self.workers))]:
            self.start(("single", i), [i])

    def receive(self, conn) -> None:
        """One message of a worker: a sample started or finished, or the worker ended (done, or died)."""
        proc, w, current, _ = self.workers[conn]
        try:
            message = conn.recv()
        except EOFError:  # finished its list, or died
            del self.workers[conn]
            proc.join(timeout=1)
            if current is not None:  # it died mid-sample (os._exit, segfault, OOM kill)
                self.results[current] = Outcome(error=f"the scoring process died (exit code {proc.exitcode})")
            _release(self.running, self.pending, w, self.results)
            self.launch(w)  # no-op when its list is done
            return
        if message[0] == "start":
            self.workers[conn][2:] = [message[1], time.monotonic()]
        else:
            self.results[message[1]] = message[2]
            self.workers[conn][2:] = [None, time.monotonic()]  # silent from now on: stuck between samples

    def kill_overdue(self) -> None:
        """Kill the workers whose current sample ran past `timeout_s` (that sample timed out, hang mode starts) or
        that were silent that long outside a sample (stuck: started again, see the module docstring)."""
        now = time.monotonic()
        for conn, (proc, w, idx, started) in list(self.workers.items()):
            if not self.timeout_s or now - started <= self.timeout_s:
                continue
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5)
            conn.close()
            del self.workers[conn]
            if idx is not None:
                self.results[idx] = Outcome(timed_out=True)
                self.hanging = True
            else:
                self.restarts[w] = self.restarts.get(w, 0) + 1
                if self.restarts[w] > STARTUP_RETRIES:
                    for i in _own_samples(self.pending, w):
                        if self.results[i] is None:
                            self.results[i] = Outcome(error=f"the scoring process was silent outside a sample for "
                                                            f"{self.timeout_s:g} s, {self.restarts[w]} times (stuck "
                                                            "before it could start the sample)")
            _release(self.running, self.pending, w, self.results)
            self.launch(w)

    def run(self) -> list[Outcome | None]:
        timeout_s = self.timeout_s
        try:
            for w in self.pending:
                if self.hanging:
                    self.spread()
                    break
                self.launch(w)
            while self.workers:
                now = time.monotonic()
                deadlines = [start + timeout_s for _, _, idx, start in self.workers.values() if idx is not None]
                wait_s = max(0.0, min(deadlines) - now) if deadlines else timeout_s
                for conn in wait(list(self.workers), timeout=min(wait_s, 1.0) if timeout_s else None):
                    self.receive(conn)
                self.kill_overdue()
                if self.hanging and not self.workers:
                    self.spread()
        except BaseException:  # Ctrl-C (the workers ignore SIGINT) or a failure here: end the workers now
            for proc, *_ in self.workers.values():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=1)
            raise
        for i in self.todo_indices:
            if self.results[i] is None:
                self.results[i] = Outcome(error="no result was produced")
        return self.results


def _own_samples(pending: dict, w) -> list[int]:
    """The samples worker `w` was given: its share of the call, or its one sample in hang mode ("single", i)."""
    return [w[1]] if isinstance(w, tuple) and w[0] == "single" else pending.get(w, [])


def _release(running: set[int], pending: dict, w, results: list) -> None:
    """Forget the unfinished samples of a killed worker `w`, so hang mode gives them processes of their own."""
    running.difference_update(i for i in _own_samples(pending, w) if results[i] is None)
