"""`ToolRunner`: runs tool calls on worker threads where a timeout can really end them.

A tool's methods are coroutines (verl's interface), but nothing stops a tool from blocking inside one:
``time.sleep``, a synchronous HTTP client, a ``threading.Event.wait`` that never returns. On the agent loop's
own event loop such a call stalls every trajectory and escapes ``asyncio.wait_for`` (the timeout fires only
when the loop gets control back), and a call awaiting ``asyncio.to_thread`` on a thread that never ends keeps
``asyncio.run`` waiting for that thread at exit. So each call runs here instead:

- on a daemon worker thread of a pool (at most `max_threads` running calls; more wait for a free thread),
  in an event loop of its own whose default executor (``asyncio.to_thread``) also runs daemon threads;
- the caller awaits the result with a deadline counted from the moment the call starts on its thread;
- at the deadline the call is *abandoned*: the caller gets `ToolTimeout`, the call's task is cancelled (which
  ends a tool that awaits), its thread leaves the pool (a fresh thread replaces it) and, while it is still
  blocked, it is counted by `stuck_threads()` (the agent loop reports it as ``tool/stuck_threads`` and warns).

Python cannot kill a thread: an abandoned thread that never returns stays until the process exits (it is a
daemon thread, so it does not keep the process alive). When more than `max_stuck` are stuck, `run` raises
`ToolThreadsExhausted`, naming the tool, instead of leaking threads without end.

What this changes for a tool: its calls run on other threads than the agent loop, each in a fresh event loop.
State a tool shares between calls must be thread-safe (a ``threading.Lock``, not an ``asyncio.Lock``, which
belongs to one event loop).

Ending the process. A tool runs in the trainer's process (one tool object serves every trajectory, its state is
shared, its calls get the trajectory's `agent_data`: moving it to another process would change what a verl tool
may do). While a call runs, ``os._exit`` and ``posix._exit`` (the same function under its other name) raise
`ProcessExitCalled` instead of ending the process (`guard_exits`, built on `hyflow.rewards.pool`'s guard), and
``SystemExit`` is the call's exception like any other, so the trajectory gets an error text and the run goes on.
Not stopped, because nothing in one process can stop them: ``os.kill(os.getpid(), SIGKILL)`` (or any signal
whose default action ends the process), ``os.abort()``, ``ctypes`` calls into libc's ``_exit`` / ``exit``, a
segfault in a C extension, and ``os._exit`` from a thread the tool started that runs on after the call that
started it has ended (the guard is lifted then). An environment (`hyflow.rollout.env_host`) runs in a process of
its own, where all of these cost only its episode.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import itertools
import os
import posix
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

from hyflow.rewards.pool import ProcessExitCalled, guard_process_exit

IDLE_EXIT_S = 30.0  # an idle worker thread ends after this long


MAX_ERROR_CHARS = 2000  # of the text that describes a call's exception

_POSIX_LOCK = threading.Lock()
_POSIX_USERS = 0
_REAL_POSIX_EXIT = posix._exit


@contextlib.contextmanager
def guard_exits(what: str) -> Iterator[None]:
    """While the block runs, ``os._exit`` and ``posix._exit`` in this process raise `ProcessExitCalled` instead of
    ending it (reference-counted across threads; a forked child still exits for real). ``os._exit`` is
    `hyflow.rewards.pool.guard_process_exit`'s, so that the reward pool and the tools never undo each other's
    guard; ``posix._exit`` is set to the same function while both are held."""
    global _POSIX_USERS
    with guard_process_exit(what):
        with _POSIX_LOCK:
            if _POSIX_USERS == 0:
                posix._exit = os._exit
            _POSIX_USERS += 1
        try:
            yield
        finally:
            with _POSIX_LOCK:
                _POSIX_USERS -= 1
                if _POSIX_USERS == 0:
                    posix._exit = _REAL_POSIX_EXIT


def describe(err: BaseException) -> str:
    """What a tool's or an environment's exception says, after its name: ``raised Type: message``, cut to
    `MAX_ERROR_CHARS`, or ``called os._exit(N), ...`` for an exit the guard stopped."""
    if isinstance(err, ProcessExitCalled):
        found = re.search(r"_exit\((.*?)\)", str(err))
        return (f"called os._exit({found.group(1) if found else ''}), which would have ended the trainer; hyflow "
                "stopped it (raise an exception to report a failure)")
    try:
        message = str(err)[:MAX_ERROR_CHARS]
    except Exception:  # a __str__ that raises
        message = "(its message cannot be printed)"
    return f"raised {type(err).__name__}: {message}"[:MAX_ERROR_CHARS]


def truncate_text(text: str, limit: int, side: str = "middle") -> str:
    """`text` cut to `limit` characters at `side` (left, right or middle), with "(truncated)" where it was cut."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]


class ToolTimeout(TimeoutError):
    """A tool call did not finish within its deadline and was abandoned."""


class ToolThreadsExhausted(RuntimeError):
    """Too many tool threads are stuck in calls that never returned."""


class DaemonExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread per submitted function, daemon, never joined: `shutdown` returns at once.

    The default executor of a tool call's event loop, so that ``asyncio.to_thread`` work left running by an
    abandoned call neither blocks the loop's shutdown nor the interpreter's exit (a plain ThreadPoolExecutor
    joins its threads in both). It subclasses ThreadPoolExecutor only because asyncio's
    `set_default_executor` asks for one; none of its pool machinery is used."""

    def __init__(self, name: str = "hyflow-tool-thread") -> None:
        super().__init__(max_workers=1, thread_name_prefix=name)
        self._name = name
        self._counter = itertools.count()
        self.threads: set[threading.Thread] = set()

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # handed to the awaiting coroutine
                future.set_exception(err)
            finally:
                self.threads.discard(threading.current_thread())

        thread = threading.Thread(target=work, name=f"{self._name}-{next(self._counter)}", daemon=True)
        self.threads.add(thread)
        thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to wait for: the threads are daemon threads and may be abandoned."""


class _Call:
    """One submitted call: its coroutine factory, where it runs, and the futures the caller awaits."""

    def __init__(self, make: Callable[[], Any], label: str) -> None:
        self.make, self.label = make, label
        self.started: concurrent.futures.Future = concurrent.futures.Future()
        self.result: concurrent.futures.Future = concurrent.futures.Future()
        self.state = "queued"  # queued -> running -> done | abandoned; queued -> cancelled
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.executor: DaemonExecutor | None = None


def _settle(future: concurrent.futures.Future, value: Any = None, error: BaseException | None = None) -> None:
    """Resolve `future` unless the caller has cancelled it meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


async def _outcome(make: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, value)`` of `make()`, awaited when it is awaitable (a duck-typed tool may define plain methods),
    or ``(False, error)`` for any exception but cancellation. SystemExit and KeyboardInterrupt are caught here
    too: raised out of an asyncio task, they would escape the event loop itself."""
    try:
        value = make()
        if inspect.isawaitable(value):
            value = await value
        return True, value
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # handed to the caller, which decides
        return False, err


class ToolRunner:
    """A pool of daemon threads, each running one tool call at a time in an event loop of its own (see the
    module docstring)."""

    def __init__(self, max_threads: int = 64, max_stuck: int = 256, name: str = "hyflow-tool") -> None:
        self.max_threads, self.max_stuck, self.name = max(1, int(max_threads)), int(max_stuck), name
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque[_Call] = collections.deque()
        self._threads = 0  # pool threads, not counting abandoned ones
        self._idle = 0
        self._counter = itertools.count()
        self._abandoned: list[tuple[str, list[threading.Thread]]] = []  # (label, threads it left running)
        self.timeouts = 0

    # ------------------------------------------------------------------ the caller's side
    async def run(self, make: Callable[[], Any], timeout: float, label: str) -> Any:
        """Await `make()` (a tool method's call, made on the worker thread) with `timeout` seconds from its start.

        Raises `ToolTimeout` at the deadline (the call is abandoned), the call's own exception when it raises
        (SystemExit included), or `ToolThreadsExhausted` when too many abandoned threads are stuck."""
        stuck = self.stuck_threads()
        if len(stuck) >= self.max_stuck:
            raise ToolThreadsExhausted(
                f"{len(stuck)} tool threads are stuck in calls that never returned (most recently in {stuck[-1]}); "
                "a tool blocks without end (a wait with no timeout, a synchronous call that hangs). Give the "
                "blocking work its own timeout inside the tool; hyflow abandons a call at "
                "multi_turn.tool_timeout but cannot kill its thread")
        call = _Call(make, label)
        self._submit(call)
        try:
            await asyncio.shield(asyncio.wrap_future(call.started))
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(call.result)), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            if call.result.done() and not call.result.cancelled() and call.result.exception() is None:
                return call.result.result()  # finished at the deadline: not a timeout
            self._abandon(call)
            self.timeouts += 1
            raise ToolTimeout(f"{label} timed out after {timeout:g} s") from None
        except BaseException:  # the caller was cancelled (the rollout failed): let the call go
            if not call.result.done():
                self._abandon(call)
            raise

    def stuck_threads(self) -> list[str]:
        """Labels of the abandoned calls whose threads are still running (one entry per thread)."""
        with self._lock:
            alive = []
            for label, threads in self._abandoned:
                alive += [(label, t) for t in threads if t.is_alive()]
            self._abandoned = [(label, [t]) for label, t in alive]
        return [label for label, _ in alive]

    # ------------------------------------------------------------------ the pool
    def _submit(self, call: _Call) -> None:
        with self._lock:
            self._queue.append(call)
            if self._idle > 0:
                self._work.notify()
                return
            if self._threads >= self.max_threads:
                return  # waits for a thread to finish its call
            self._threads += 1
        threading.Thread(target=self._worker, name=f"{self.name}-{next(self._counter)}", daemon=True).start()

    def _abandon(self, call: _Call) -> None:
        with self._lock:
            if call.state == "queued":
                call.state = "cancelled"
                return
            if call.state != "running":
                return
            call.state = "abandoned"
            self._threads -= 1  # it leaves the pool; a new thread takes the queue if it has to
            threads = [call.thread] if call.thread is not None else []
            threads += list(call.executor.threads) if call.executor is not None else []
            self._abandoned.append((call.label, threads))
            replace = bool(self._queue) and self._idle == 0 and self._threads < self.max_threads
            if replace:
                self._threads += 1
        if replace:
            threading.Thread(target=self._worker, name=f"{self.name}-{next(self._counter)}", daemon=True).start()
        loop, task = call.loop, call.task
        if loop is not None and task is not None:
            # ends a call that awaits; a blocked one ends when it can (RuntimeError: the loop closed, it just ended)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)

    def _worker(self) -> None:
        while True:
            with self._lock:
                call = None
                while call is None:
                    while not self._queue:
                        self._idle += 1
                        woken = self._work.wait(IDLE_EXIT_S)
                        self._idle -= 1
                        if not woken and not self._queue:
                            self._threads -= 1
                            return
                    call = self._queue.popleft()
                    if call.state != "queued":
                        call = None
                call.state = "running"
                call.thread = threading.current_thread()
            self._run_here(call)
            with self._lock:
                if call.state == "abandoned":
                    return  # replaced in the pool when it was abandoned
                call.state = "done"

    @staticmethod
    def _run_here(call: _Call) -> None:
        with guard_exits(call.label):  # held until the call returns, even after it was abandoned
            ToolRunner._run_guarded(call)

    @staticmethod
    def _run_guarded(call: _Call) -> None:
        loop = asyncio.new_event_loop()
        call.executor = DaemonExecutor()
        loop.set_default_executor(call.executor)
        try:
            call.loop = loop
            call.task = loop.create_task(_outcome(call.make))
            _settle(call.started)
            try:
                ok, value = loop.run_until_complete(call.task)
                _settle(call.result, *((value, None) if ok else (None, value)))
            except BaseException as err:  # cancelled when abandoned: nobody waits for it
                _settle(call.result, error=err)
            rest = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in rest:  # tasks the tool left behind
                task.cancel()
            if rest:
                loop.run_until_complete(asyncio.wait(rest, timeout=1.0))
        finally:
            loop.close()
            _settle(call.started)
