"""`EnvHost`: one environment episode in a forked child process, driven over a pipe, killed when it misbehaves.

An environment is user code, and the env_agent loop must survive whatever it does. Threads cannot: Python cannot
kill one, and ``os._exit``, ``posix._exit`` or ``os.kill(os.getpid(), SIGKILL)`` on any thread ends the whole
process. So each episode's environment lives in a process of its own, forked from the rollout worker when the
episode starts:

- the child inherits the environment class, its constructor kwargs and the dataset row (nothing is pickled on
  the way in but the model's actions), builds the environment and then serves ``reset`` / ``step`` / ``close``
  requests one at a time (sync or ``async def`` methods: an awaitable result runs on the child's own event loop);
- every request has a deadline (`timeout`, ``multi_turn.tool_timeout``); the parent waits for the answer on its
  event loop (no thread), so a hang holds only its own episode;
- past the deadline the child's process group is sent SIGKILL (whatever the environment started goes with it),
  and the call fails as a timeout; a child that dies (``os._exit``, ``posix._exit``, a signal, a segfault, the
  kernel's OOM killer) fails its call as "ended its process (exit code N)";
- the child checks and bounds what it sends back: ``step``'s result becomes ``(observation text cut to
  `max_observation_chars` with a note, reward a finite number, done, the finite numbers of info)``, an error's
  text is cut to `MAX_ERROR_CHARS`, and the parent reads at most `max_message_bytes`, so an observation of 2 GB
  costs its child the time to make it, and the trainer a few kilobytes;
- the child is its own session (Ctrl-C in the terminal reaches the parent, which ends its children); the kernel
  kills it when its parent dies (Linux ``PR_SET_PDEATHSIG``) and first when memory runs out (``oom_score_adj``
  1000: an environment that allocates without end costs its episode, not the trainer); it takes locks of its own
  for tqdm's progress bars, whose lock is otherwise a semaphore shared with the parent that a killed child would
  leave taken.

Every failure is an `EnvCallFailed` whose `kind` says which: ``error`` (the method raised, ``SystemExit``
included, or returned something that is not a step result), ``timeout`` or ``died``; its message reads after
"environment <method> " ("raised ValueError: ...", "timed out after 30 s", "ended its process (exit code 5; ...)").

Cost: one fork per episode, whose time grows with the parent's resident memory, and one pipe round trip per call.
Measured on 2 cores shared with a load of ~15: start + reset + close of an episode 0.08 s in a process with torch
imported, 0.5 s with 4 GB resident (the fork: the child's exit, as long again, is awaited off the event loop); a
step 0.4-0.7 ms (a call through `ToolRunner`'s threads: 2-3 ms). What this changes for an environment: its state lives
in the child, so a module-level cache it fills is filled per episode, and the parent never sees the environment
object itself. The child must not use CUDA or torch's threads (an environment is plain Python: the contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import pickle
import signal
import sys
import time
from multiprocessing.connection import Pipe
from typing import Any

from hyflow.tools.runner import MAX_ERROR_CHARS, describe, truncate_text

_UNREAPED: set[int] = set()  # killed children whose exit status was not collected yet


class EnvCallFailed(Exception):
    """An environment call that did not produce its result: `kind` is "error", "timeout" or "died"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class BadStepResult(Exception):
    """What ``step`` returned is not a step result (the message says what is wrong and what to return)."""


def number(value: Any) -> float:
    """A step's reward as a finite float (None is 0.0); a bool, a string, anything else or a NaN / infinity raises
    `BadStepResult`."""
    if value is None:
        return 0.0
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise BadStepResult(f"returned the reward {_short(value)} ({type(value).__name__}), not a number: return a "
                            "finite float")
    result = float(value)
    if not math.isfinite(result):
        raise BadStepResult(f"returned the reward {result}, not a finite number: return a finite float")
    return result


def step_result(result: Any, limit: int, side: str) -> tuple[str | None, float, bool, dict[str, float]]:
    """(observation text cut to `limit` at `side`, reward, done, info's finite numbers) from what ``step``
    returned: Gymnasium's 4-tuple, its 5-tuple (observation, reward, terminated, truncated, info), or a mapping with
    those keys. A reward that is not a finite number, an info that is not a mapping, or another shape raises
    `BadStepResult` (its message reads after "environment step")."""
    if isinstance(result, dict):
        observation, reward, info = result.get("observation"), result.get("reward"), result.get("info")
        done = bool(result.get("done") or result.get("terminated") or result.get("truncated"))
    elif isinstance(result, tuple) and len(result) == 5:
        observation, reward, terminated, truncated, info = result
        done = bool(terminated or truncated)
    elif isinstance(result, tuple) and len(result) == 4:
        observation, reward, done, info = result
        done = bool(done)
    else:
        raise BadStepResult(f"returned {type(result).__name__}; return (observation, reward, done, info) or "
                            "Gymnasium's (observation, reward, terminated, truncated, info)")
    reward = number(reward)
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise BadStepResult(f"returned the info {_short(info)} ({type(info).__name__}), not a dict: return a dict "
                            "(its numbers are logged as env/<key>/mean) or None")
    numbers = {}
    for key, value in info.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            numbers[str(key)[:200]] = float(value)
    text = None if observation is None else str(observation)
    return (truncate_text(text, limit, side) if text else None), reward, done, numbers


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a repr that raises is the value's own bug
        return "(unprintable)"
    return text if len(text) <= 80 else text[:80] + "..."


class EnvHost:
    """The child process of one environment episode (see the module docstring). `start` forks it, `call` asks
    it one method, `close` ends it (always call it: it kills and reaps the child)."""

    def __init__(self, pid: int, conn, max_message_bytes: int) -> None:
        self.pid, self.conn, self.max_message_bytes = pid, conn, max_message_bytes
        self.dead = False

    @classmethod
    async def start(cls, env_class: type, kwargs: dict, sample: dict, *, timeout: float,
                    max_observation_chars: int, truncate_side: str = "middle") -> EnvHost:
        """Fork the child, which builds ``env_class(**kwargs)`` (its `sample` is what ``reset`` gets); raises
        `EnvCallFailed` (the host already closed) when the constructor raises, hangs or kills its process."""
        _reap()
        parent_end, child_end = Pipe(duplex=True)
        limits = (int(max_observation_chars), truncate_side)
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(child_end, parent_end, env_class, kwargs, sample, limits)
        child_end.close()
        host = cls(pid, parent_end, 4 * int(max_observation_chars) + 64 * 1024)
        try:
            await host._answer("the constructor", timeout)
        except EnvCallFailed:
            await host.wait_closed()
            raise
        except BaseException:  # cancelled
            host.close()
            raise
        return host

    async def call(self, method: str, *args: Any, timeout: float) -> Any:
        """The result of ``env.<method>(*args)`` in the child (for ``step``: the checked tuple of `step_result`;
        ``reset`` and ``close`` return None), or `EnvCallFailed`."""
        if self.dead:
            raise EnvCallFailed("died", "found its process gone")
        try:
            self.conn.send((method, *args))
        except OSError as err:  # the child is gone: its exit status says why
            raise self._died() from err
        return await self._answer(method, timeout)

    async def _answer(self, what: str, timeout: float) -> Any:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, timeout)
        except (asyncio.TimeoutError, TimeoutError):
            self.close()
            raise EnvCallFailed("timeout", f"timed out after {timeout:g} s") from None
        finally:
            loop.remove_reader(fd)
        try:
            data = self.conn.recv_bytes(self.max_message_bytes)
        except EOFError:
            raise self._died() from None
        except OSError as err:  # longer than max_message_bytes (the connection is unusable after it)
            self.close()
            raise EnvCallFailed("error", f"sent an answer of more than {self.max_message_bytes} bytes") from err
        try:
            status, payload = pickle.loads(data)
        except Exception as err:  # the environment wrote into the pipe itself
            self.close()
            raise EnvCallFailed("error", f"sent an answer that cannot be read ({describe(err)})") from None
        if status == "error":
            raise EnvCallFailed("error", payload)
        return payload

    def _died(self) -> EnvCallFailed:
        status = self.close(wait=1.0)  # it has exited: its status is there (or nearly)
        if status is not None and os.WIFSIGNALED(status):
            how = f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
        elif status is not None and os.WIFEXITED(status):
            how = f"exit code {os.WEXITSTATUS(status)}"
        else:
            how = "exit status unknown"
        return EnvCallFailed("died", f"ended its process ({how}; os._exit, a signal or a crash in the environment)")

    def close(self, wait: float = 0.0) -> int | None:
        """Kill the child and its process group; its exit status when it is collected within `wait` seconds (the
        exit of a child of a large process takes a while: the trainer's event loop does not wait for it unless
        asked; `wait_closed` waits without blocking it, `_reap` collects what is left at the next start)."""
        if not self.dead:
            self.dead = True
            with contextlib.suppress(OSError):
                self.conn.close()
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(self.pid, signal.SIGKILL)
            _UNREAPED.add(self.pid)
        give_up = time.monotonic() + wait
        while self.pid in _UNREAPED:
            status = _collect(self.pid)
            if status is not None or time.monotonic() >= give_up:
                return status
            time.sleep(0.001)
        return None

    async def wait_closed(self, timeout: float = 5.0) -> None:
        """Kill the child (`close`) and wait for its exit, on the event loop."""
        self.close()
        give_up = time.monotonic() + timeout
        while self.pid in _UNREAPED and _collect(self.pid) is None and time.monotonic() < give_up:
            await asyncio.sleep(0.005)


def _collect(pid: int) -> int | None:
    """The exit status of the killed child `pid` once it has exited (then forgotten), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # collected already
        _UNREAPED.discard(pid)
        return None
    if done:
        _UNREAPED.discard(pid)
        return status
    return None


def _reap() -> None:
    """Collect the exit status of killed children that have exited since."""
    for pid in list(_UNREAPED):
        _collect(pid)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child(conn, parent_end, env_class: type, kwargs: dict, sample: dict, limits: tuple[int, str]) -> None:
    """The child's whole life: build the environment, serve requests until ``close`` or the parent's end, exit."""
    try:
        parent_end.close()
        with contextlib.suppress(OSError):
            os.setsid()
        _die_with_parent()
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # out of memory, the kernel kills this process first, not the trainer
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the CLI's handler, which raises into inherited code
        asyncio.events._set_running_loop(None)  # forked from the parent's running event loop
        _own_locks()
        _serve(conn, env_class, kwargs, sample, limits)
    except BaseException:  # nothing may escape into the parent's code, which this process inherited
        pass
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


def _own_locks() -> None:
    """tqdm's write lock (every progress bar takes it) is a multiprocessing semaphore shared with the parent across
    the fork: a child killed while holding it would leave the trainer's progress bars blocked for good. The child
    gets locks of its own."""
    std = sys.modules.get("tqdm.std")
    if std is None or "mp_lock" not in vars(std.TqdmDefaultWriteLock):
        return
    lock_class = std.TqdmDefaultWriteLock
    lock_class.th_lock = std.TRLock()
    del lock_class.mp_lock
    fresh = lock_class()
    classes = [std.tqdm]
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        if "_lock" in vars(cls):
            cls._lock = fresh


def _serve(conn, env_class: type, kwargs: dict, sample: dict, limits: tuple[int, str]) -> None:
    limit, side = limits
    loop: asyncio.AbstractEventLoop | None = None

    def settled(value: Any) -> Any:
        nonlocal loop
        if inspect.isawaitable(value):
            if loop is None:
                loop = asyncio.new_event_loop()

            async def wait() -> Any:
                return await value

            value = loop.run_until_complete(wait())
        return value

    def reply(status: str, payload: Any) -> None:
        conn.send((status, payload))

    try:
        env = env_class(**kwargs)
    except BaseException as err:  # SystemExit included: the episode's error, not the child's end
        reply("error", describe(err))
        return
    reply("ok", None)
    while True:
        try:
            method, *args = conn.recv()
        except EOFError:  # the parent closed the episode
            return
        try:
            payload = None
            if method == "reset":
                reset = getattr(env, "reset", None)  # optional: an environment may need no preparation
                if reset is not None:
                    settled(reset(sample))
            elif method == "step":
                payload = step_result(settled(env.step(*args)), limit, side)
            elif method == "close":
                close = getattr(env, "close", None)
                if close is not None:
                    settled(close())
            else:
                raise ValueError(f"unknown request {method!r}")
        except BadStepResult as err:
            reply("error", str(err)[:MAX_ERROR_CHARS])
            continue
        except BaseException as err:
            reply("error", describe(err))
            continue
        reply("ok", payload)
        if method == "close":
            return
