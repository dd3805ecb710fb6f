"""One trajectory's agent function in a process of its own, so that nothing it does can stall or end the rollout.

`run_agent_process(fn, sample, base_url=..., make_key=..., timeout_s=...)` forks a child for one call of the
user's `async def fn(client, sample)` (the `openai_agent` loop's agent). Forking means the function and the sample
are inherited, never pickled, so a function loaded from a user file works as is. The child

- dies with the trainer (Linux: PR_SET_PDEATHSIG, so a trainer killed outright leaves no agent behind), makes a
  process group of its own (so that ending it ends every process it started), closes the descriptors it
  inherited but stdin, stdout and stderr (it cannot accept connections on the endpoint's socket nor read another
  agent's pipe), ignores Ctrl-C (the trainer handles it and ends the child), and freezes the inherited objects for
  its garbage collector (a collection then neither walks nor copies the trainer's heap);
- builds its own `openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)`, runs `fn(client,
  sample)` under an event loop of its own, and writes to a pipe what it returned (as plain data: numbers,
  strings, bytes, lists, tuples, dicts; numpy and torch values become lists or numbers; at most
  `MAX_RESULT_BYTES` pickled) or the error it raised, `SystemExit` included; then it ends with `os._exit`, so
  threads it started do not keep it alive.

The parent awaits the pipe and the child's exit on its event loop (nothing blocks it), at most `timeout_s`
seconds (not counting the time the caller excludes: the agent's waits for the policy), then kills the child's process group, whatever happened. Every way the call can fail is an `AgentOutcome`
with the error in words: an exception, `SystemExit`, a return that is not plain data or too large, a process that
ended without answering (`os._exit`, a crash, a kill: its exit code or signal), the deadline. What comes back is
read as plain data only (a pickle naming any class or function is refused), so the child cannot make the trainer
build objects or allocate more than `MAX_RESULT_BYTES` for it.

Caveats: one fork per trajectory costs the trainer a copy of its page tables (milliseconds for a few GB); the
child must not use CUDA or torch threads (an agent talks HTTP; that is the contract). Linux and macOS (fork).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import os
import pickle
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_RESULT_BYTES = 16 * 1024 * 1024  # the most an agent's return may take, pickled
MAX_ERROR_CHARS = 4000  # an error's text is cut to this
EXIT_GRACE_S = 2.0  # after its answer, how long the child has to flush its output and exit before it is killed
_HEADER = struct.Struct("<Q")  # the answer's length, before it on the pipe


@dataclass
class AgentOutcome:
    """What one call of the agent function gave: its return value (plain data), or the error in words."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False


class _PlainUnpickler(pickle.Unpickler):
    """Reads plain data only: a pickle that names any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def plain_data(value: Any, where: str = "the return value", depth: int = 0) -> Any:
    """`value` as plain data (None, bool, int, float, str, bytes, and lists, tuples and dicts of them); numpy and
    torch values become numbers or lists (`.tolist()`). Anything else is a TypeError naming where it is."""
    if depth > 100:
        raise TypeError(f"{where} is nested more than 100 levels deep (a cycle?)")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if type(value).__module__.split(".")[0] in ("numpy", "torch") and hasattr(value, "tolist"):
        return plain_data(value.tolist(), where, depth + 1)
    if isinstance(value, (list, tuple)):
        items = [plain_data(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not (key is None or isinstance(key, (bool, int, float, str))):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use strings or numbers as keys")
            out[key] = plain_data(item, f"{where}[{key!r}]", depth + 1)
        return out
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}; an agent returns plain "
                    "data (numbers, strings, lists, dicts) from its process")


def _answer(result: Any) -> bytes:
    """The child's message: ("value", plain data) or ("error", text), pickled, under the size limit."""
    try:
        payload = pickle.dumps(("value", plain_data(result)), protocol=pickle.HIGHEST_PROTOCOL)
    except (TypeError, RecursionError, pickle.PicklingError) as err:
        return pickle.dumps(("error", f"the agent function's return cannot come back from its process: {err}"))
    if len(payload) > MAX_RESULT_BYTES:
        return pickle.dumps(("error", f"the agent function returned {len(payload):,} bytes (pickled), over the "
                                      f"limit of {MAX_RESULT_BYTES:,}: return a score and small extras"))
    return payload


def _describe(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return (f"SystemExit: {err.code} (the agent function called sys.exit({err.code!r}) or raised SystemExit; "
                "return a score, or raise an exception to report a failure)")
    return f"{type(err).__name__}: {err}"


async def _call(fn: Callable, sample: dict, base_url: str, api_key: str) -> Any:
    import openai

    # no per-request timeout: the parent's deadline bounds the agent, not counting its waits for the policy (a
    # request timeout of timeout_s killed an agent whose one request a slow engine took longer than that to answer)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=None)
    try:
        return await fn(client, sample)
    finally:
        await client.close()


def _die_with(parent: int) -> None:
    """Linux: this process is killed when the trainer ends, however it ends (prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def _fresh_locks() -> None:
    """Replace the locks the trainer's threads may have held at the fork (a copy held by a thread that does not
    exist here is never released): tqdm's write lock, which datasets and transformers take for every progress bar
    (its trainer-wide semaphore is not used here at all)."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    with contextlib.suppress(Exception):
        lock_class = std.TqdmDefaultWriteLock
        lock_class.th_lock = threading.RLock()
        lock_class.mp_lock = None
        classes = [std.tqdm]
        while classes:  # a subclass (datasets', tqdm.auto's) that took the lock keeps its own reference
            cls = classes.pop()
            classes += cls.__subclasses__()
            if "_lock" in vars(cls):
                delattr(cls, "_lock")
        std.tqdm._lock = lock_class()


def _own_streams() -> None:
    """sys.stdout and sys.stderr write to this process's descriptors 1 and 2. A host that pointed them at another
    descriptor (pytest's output capture, a log file) had it closed with the rest: the agent's first print, or a
    library's logging set-up, would then fail with EBADF (verifiers' environments did, under pytest)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        try:
            own = getattr(sys, name).fileno() == fd
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
            own = False
        if not own:
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False, errors="backslashreplace"))  # noqa: SIM115


def _child(fn: Callable, sample: dict, base_url: str, api_key: str, write_fd: int, parent: int) -> None:
    """The forked child's whole life: run the agent, write its answer, exit. Never returns."""
    code = 0
    try:
        _die_with(parent)
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        # the trainer's descriptors (the endpoint's listening socket, other agents' pipes) are not the agent's
        os.closerange(3, write_fd)
        os.closerange(write_fd + 1, 1 << 20)
        _own_streams()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)  # the trainer's event loop's wake-up pipe is not this process's
        gc.freeze()
        _fresh_locks()
        loop = asyncio.new_event_loop()  # never closed: os._exit ends it, not waiting for what the agent left running
        asyncio.set_event_loop(loop)
        try:
            message = _answer(loop.run_until_complete(_call(fn, sample, base_url, api_key)))
        except BaseException as err:  # SystemExit and KeyboardInterrupt included: this process only reports
            message = pickle.dumps(("error", _describe(err)[:MAX_ERROR_CHARS]))
        data = _HEADER.pack(len(message)) + message
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
    except BaseException:  # nothing may escape the child: above this frame is the trainer's code
        code = 70
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class _Child:
    """The parent's view of one forked child: its answer as it arrives on the pipe, and its exit."""

    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid, self.read_fd = pid, read_fd
        self.loop = asyncio.get_running_loop()
        self.buffer = bytearray()
        self.answer: bytes | None = None
        self.problem: str | None = None  # the pipe carried something that is not an answer
        self.answered = self.loop.create_future()
        self.exited = self.loop.create_future()
        self.status: int | None = None  # os.waitpid's status, once reaped
        os.set_blocking(read_fd, False)
        self.loop.add_reader(read_fd, self._read)
        self.pidfd: int | None = None
        self._poll: asyncio.TimerHandle | None = None
        try:
            self.pidfd = os.pidfd_open(pid)
            self.loop.add_reader(self.pidfd, self._on_exit)
        except (AttributeError, OSError):  # no pidfd (macOS, old kernels): look every 50 ms
            self._poll = self.loop.call_later(0.05, self._check_exit)

    def _read(self) -> None:
        if self.answered.done():  # the answer (or a refusal) is in: nothing after it is read
            return
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 20)
            except BlockingIOError:
                return
            except OSError as err:
                self._stop_reading(f"the pipe from the agent's process failed: {err}")
                return
            if not chunk:
                self._stop_reading(None)
                return
            self.buffer += chunk
            if len(self.buffer) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(self.buffer)
                if length > MAX_RESULT_BYTES + 4096:
                    self._stop_reading(f"the agent's process sent {length:,} bytes, over the limit of "
                                       f"{MAX_RESULT_BYTES:,}")
                    return
                if len(self.buffer) >= _HEADER.size + length:
                    self.answer = bytes(self.buffer[_HEADER.size:_HEADER.size + length])
                    self._stop_reading(None)
                    return

    def _stop_reading(self, problem: str | None) -> None:
        if problem is not None and self.answer is None:
            self.problem = problem
        self.loop.remove_reader(self.read_fd)
        self.buffer = bytearray()
        if not self.answered.done():
            self.answered.set_result(None)

    def _on_exit(self) -> None:
        if self.pidfd is not None:
            self.loop.remove_reader(self.pidfd)
        if not self.exited.done():
            self.exited.set_result(None)

    def _check_exit(self) -> None:
        try:
            exited = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            exited = True
        if exited:
            self._on_exit()
        else:
            self._poll = self.loop.call_later(0.05, self._check_exit)

    async def outcome(self, timeout_s: float, excluded: Callable[[], float]) -> AgentOutcome:
        """Its answer (or why there is none) within `timeout_s` seconds, not counting `excluded()` seconds."""
        start = time.monotonic()
        waiters = [self.answered, self.exited]
        timed_out = False
        while not (self.answered.done() or self.exited.done()):
            left = start + timeout_s + excluded() - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        self._read()  # what it wrote before it ended (or before the deadline) is in the pipe
        if not (timed_out or self.exited.done() or self.problem):  # answered or closed its pipe: let it exit
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.exited), EXIT_GRACE_S)
        if self.answer is None and self.problem is None and timed_out:
            return AgentOutcome(error=f"the agent function did not return within {timeout_s:g} s (timeout_s, not "
                                      "counting its waits for the policy); its process was killed", timed_out=True)
        if self.answer is not None:
            try:
                kind, value = _PlainUnpickler(io.BytesIO(self.answer)).load()
            except Exception as err:  # whatever the bytes are, they cost this sample only
                return AgentOutcome(error=f"the agent's process sent an answer that is not plain data: {err}")
            return AgentOutcome(value=value) if kind == "value" else AgentOutcome(error=str(value)[:MAX_ERROR_CHARS])
        if self.problem is not None:
            return AgentOutcome(error=self.problem)
        return AgentOutcome(error=f"the agent's process ended before the agent function returned "
                                  f"({self._exit_words()}): os._exit, a crash or a kill")

    def _exit_words(self) -> str:
        self.end()
        if self.status is None:
            return "its exit status is unknown"
        if os.WIFSIGNALED(self.status):
            number = os.WTERMSIG(self.status)
            with contextlib.suppress(ValueError):
                return f"killed by signal {number} ({signal.Signals(number).name})"
            return f"killed by signal {number}"
        return f"exit code {os.waitstatus_to_exitcode(self.status)}"

    def end(self) -> None:
        """Kill the child's process group (what it started too) and reap it; idempotent."""
        if self.status is None:
            # the group is killed before the child is reaped: until then its pid (the group's id) cannot be reused
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)
            try:
                _, self.status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.status = -1
        for fd in (self.read_fd, self.pidfd):
            if fd is not None and fd >= 0:
                self.loop.remove_reader(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.read_fd, self.pidfd = -1, None
        if self._poll is not None:
            self._poll.cancel()


async def run_agent_process(fn: Callable, sample: dict, *, base_url: str, make_key: Callable[[], str],
                            timeout_s: float, excluded: Callable[[], float] = lambda: 0.0) -> AgentOutcome:
    """`await fn(openai.AsyncOpenAI(base_url, api_key=make_key()), sample)` in a forked child, at most `timeout_s`
    seconds not counting `excluded()` (the seconds it waited for the policy so far: a slow engine, or a batch
    held back by another trajectory, does not count against an agent); never raises for what the function does.

    The key is made just before the fork and dropped by the parent just after it, with no await between: a child
    forked later (another trajectory's agent) finds no reference to it in the memory it inherits."""
    import openai  # noqa: F401 (imported before the fork: the child inherits it instead of importing it again)

    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    api_key = make_key()
    try:
        pid = os.fork()
    except OSError as err:  # no memory or process slot left: this sample fails, the rollout goes on
        del api_key
        os.close(read_fd)
        os.close(write_fd)
        return AgentOutcome(error=f"the agent's process could not be started: {err}")
    if pid == 0:
        _child(fn, sample, base_url, api_key, write_fd, parent)
    del api_key
    os.close(write_fd)
    with contextlib.suppress(OSError):  # also here: the child may not have run yet when it must be killed
        os.setpgid(pid, pid)
    child = _Child(pid, read_fd)
    try:
        return await child.outcome(timeout_s, excluded)
    finally:
        child.end()
