"""Run untrusted-ish Python in a separate, resource-limited process: the executor behind the code scorer.

`run_code(code, stdin)` writes `code` to ``solution.py`` in a fresh temporary directory and runs it with
``python -I -S -X utf8`` (isolated mode: no PYTHON* variables, no user site, script directory not on
sys.path; no `site` start-up, which halves the start-up time: the parent's site-packages directories are put
on sys.path directly, so numpy & co. import, but their ``.pth`` files are not run) as the leader of a new
session, reading stdin from a file, and returns a `SandboxResult`:

- ``status``: ``"ok"`` (exit code 0), ``"timeout"`` (wall clock past `timeout_s`, or CPU time past the
  limit: SIGXCPU), ``"memory"`` (a MemoryError under the address-space limit), ``"error"`` (any other
  non-zero exit: exception, syntax error, blocked network or process call, output limit).
- ``stdout``, ``stderr`` (decoded, each capped at `max_output_bytes`), ``returncode`` (negative = signal),
  ``wall_s``.

Limits, set with `resource.setrlimit` (soft = hard, so the code cannot raise them unless run as root) by the
child's prelude before the solution runs. Not in a `preexec_fn`: that hook can deadlock the fork when the
parent has threads (CPython's documented caveat), and reward scoring runs in thread pools. The cost is that
the interpreter's own start-up (tens of ms, a few MiB) runs before the limits apply.

- RLIMIT_AS = `memory_mb` MiB of address space (Python raises MemoryError when an allocation fails);
- RLIMIT_CPU = `cpu_time_s` seconds, rounded up (default: `timeout_s` + 1), then SIGXCPU;
- RLIMIT_FSIZE = `max_output_bytes`: the child's stdout and stderr are files in the temporary directory, so
  the kernel itself caps the output (a write past the cap fails with EFBIG), and files it writes are capped
  the same way; the parent never buffers unbounded output;
- RLIMIT_CORE = 0 (no core dumps);
- the wall clock: past `timeout_s` the whole process group gets SIGKILL (`os.killpg`); and in case the
  parent dies first (a reward worker killed for its own timeout), the child sets ``alarm(ceil(timeout_s) + 2)``
  on itself, so no sleeping orphan outlives it for long.

RLIMIT_NPROC is not used: it counts every process and thread of the user, not of the sandbox, so a useful
value depends on what else runs; a low one breaks the common ``threading.Thread`` deep-recursion idiom of
competitive programmers; and it does not apply to root.

No network and no child processes, best effort: a prelude run before the solution replaces
``_socket.socket`` (the base class of ``socket.socket``, so urllib, http.client, asyncio... inherit it) with a
class whose constructor raises PermissionError for every family but AF_UNIX (local socket pairs, which
asyncio's event loop needs), and ``getaddrinfo``/``gethostbyname*``,
``os.system``, ``os.popen``, ``os.fork``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*`` and
``_posixsubprocess.fork_exec`` (behind ``subprocess``/``multiprocessing``) with functions that raise
PermissionError. The environment is replaced by a minimal one (no proxy variables, no credentials,
``HOME``/``TMPDIR`` = the temporary directory, one BLAS/OpenMP thread).

THIS IS NOT A SECURITY BOUNDARY. Code that wants out can reach the original objects (``type()`` of a C-made
socket, ``importlib.reload``), call libc through ``ctypes``, or read any file the user running hyflow can read. It stops honest mistakes
and accidents of generated code (runaway loops, memory blow-ups, stray network calls, huge outputs), not an
adversary. For hostile code use a container/VM sandbox (e.g. a SandboxFusion server, gVisor, firejail,
nsjail) and keep this as the cheap default for local experiments.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "timeout", "error", "memory"]

MEMORY_ERROR_EXIT_CODE = 201
"""Exit code the prelude uses for an uncaught MemoryError (checked together with 'MemoryError' in stderr)."""

DEFAULT_MAX_OUTPUT_BYTES = 1 << 20

# The parent's package directories, so solutions can import numpy & co.; `.pth` files there are not run.
_SITE_PACKAGES = os.pathsep.join(
    p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")
)

# Runs in the child before the solution (python -S: only builtin modules are imported here, which keeps start-up
# near 25 ms). argv: solution path, address-space bytes, CPU seconds, file-size bytes, site-packages dirs,
# alarm seconds.
# Sets the rlimits, blocks sockets and process creation, executes solution.py as a clean __main__ module and
# maps an uncaught MemoryError to MEMORY_ERROR_EXIT_CODE.
_PRELUDE = r"""
import builtins, os, resource, sys, types, _posixsubprocess, _signal, _socket

_path, _memory_bytes, _cpu_s, _fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.extend(p for p in sys.argv[5].split(os.pathsep) if p)
_signal.alarm(int(sys.argv[6]))  # self-destruct (SIGALRM) even if the parent dies before killing us
resource.setrlimit(resource.RLIMIT_AS, (_memory_bytes, _memory_bytes))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu_s, _cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

def _blocked(what):
    def deny(*args, **kwargs):
        raise PermissionError(f"{what} is disabled in the hyflow sandbox")
    return deny

class _NoNetworkSocket(_socket.socket):
    __slots__ = ()  # like its C base: socket.socket adds __weakref__ itself and fails if it exists
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if family != _socket.AF_UNIX:  # local pairs stay allowed: asyncio's event loop needs socketpair()
            raise PermissionError("network access is disabled in the hyflow sandbox")
        super().__init__(family, type, proto, fileno)

# `socket.socket` subclasses `_socket.socket` and copies `_socket`'s functions when first imported, so
# patching `_socket` first makes every later `import socket` (urllib, http, asyncio...) inherit the block.
_socket.socket = _socket.SocketType = _NoNetworkSocket
for _name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    setattr(_socket, _name, _blocked("network access"))
for _name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp", "execlpe",
              "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
              "spawnvpe", "posix_spawn", "posix_spawnp"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked("starting processes"))
_posixsubprocess.fork_exec = _blocked("starting processes")  # what subprocess.Popen uses

def _quit(code=None):  # `exit()`/`quit()` normally come from the `site` module, skipped by -S
    raise SystemExit(code)
builtins.exit = builtins.quit = _quit

sys.argv = [_path]
with open(_path, encoding="utf-8") as _file:
    _source = _file.read()
_main = types.ModuleType("__main__")  # a clean __main__ module for the solution, as `runpy` makes
_main.__file__ = _path
_main.__builtins__ = builtins
sys.modules["__main__"] = _main
try:
    exec(compile(_source, _path, "exec"), _main.__dict__)
except SystemExit:
    raise
except BaseException as _error:
    import traceback
    traceback.print_exception(type(_error), _error, _error.__traceback__.tb_next)  # hide the prelude frame
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(MEMORY_EXIT if isinstance(_error, MemoryError) else 1)
""".replace("MEMORY_EXIT", str(MEMORY_ERROR_EXIT_CODE))


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one `run_code` call (see the module docstring for the meaning of `status`)."""

    status: Status
    stdout: str
    stderr: str
    returncode: int | None
    wall_s: float
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        """True when the program exited with code 0 within its limits."""
        return self.status == "ok"


def _child_env(workdir: str) -> dict[str, str]:
    """A minimal environment: nothing inherited from the parent (no proxies, tokens, PYTHONPATH)."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _read_capped(path: str, max_bytes: int) -> tuple[str, bool]:
    """The first `max_bytes` of a file, decoded (invalid UTF-8 replaced), and whether the cap was reached."""
    with open(path, "rb") as file:
        data = file.read(max_bytes + 1)
    return data[:max_bytes].decode("utf-8", errors="replace"), len(data) >= max_bytes


def _kill_group(pid: int) -> None:
    """SIGKILL the sandbox's process group (the leader and anything it managed to start)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _classify(returncode: int, stderr: str, timed_out: bool, truncated: bool) -> Status:
    """Map how the child ended to a status."""
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGALRM):
        return "timeout"
    if returncode == 0 and not truncated:
        return "ok"
    if returncode == MEMORY_ERROR_EXIT_CODE and "MemoryError" in stderr:
        return "memory"
    return "error"


def run_code(
    code: str,
    stdin: str = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_time_s: float | None = None,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> SandboxResult:
    """Run Python `code` with `stdin` in a separate, limited process; never raises for anything the code does.

    Limits: wall clock `timeout_s`; CPU time `cpu_time_s` (default ceil(timeout_s) + 1); address space
    `memory_mb` MiB; stdout, stderr and written files `max_output_bytes` each. An output that reaches the cap
    makes the status "error" (the answer cannot be judged) with `output_truncated=True`.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
        raise ValueError(
            f"run_code needs positive limits, got timeout_s={timeout_s}, memory_mb={memory_mb}, "
            f"max_output_bytes={max_output_bytes}"
        )
    cpu_limit_s = max(1, math.ceil(cpu_time_s if cpu_time_s is not None else timeout_s + 1))
    workdir = tempfile.mkdtemp(prefix="hyflow_sandbox_")
    try:
        paths = {name: os.path.join(workdir, name) for name in ("solution.py", "stdin", "stdout", "stderr")}
        with open(paths["solution.py"], "w", encoding="utf-8") as file:
            file.write(code)
        with open(paths["stdin"], "w", encoding="utf-8") as file:
            file.write(stdin)
        with (
            open(paths["stdin"], "rb") as stdin_file,
            open(paths["stdout"], "wb") as stdout_file,
            open(paths["stderr"], "wb") as stderr_file,
        ):
            start = time.monotonic()
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-X",
                    "utf8",
                    "-c",
                    _PRELUDE,
                    paths["solution.py"],
                    str(memory_mb * 1024 * 1024),
                    str(cpu_limit_s),
                    str(max_output_bytes),
                    _SITE_PACKAGES,
                    str(math.ceil(timeout_s) + 2),
                ],
                stdin=stdin_file,
                stdout=stdout_file,
                stderr=stderr_file,
                cwd=workdir,
                env=_child_env(workdir),
                start_new_session=True,
                close_fds=True,
            )
            timed_out = False
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(process.pid)
                process.wait()
            wall_s = time.monotonic() - start
            _kill_group(process.pid)  # stragglers the solution may have left behind
        stdout, stdout_truncated = _read_capped(paths["stdout"], max_output_bytes)
        stderr, stderr_truncated = _read_capped(paths["stderr"], max_output_bytes)
        truncated = stdout_truncated or stderr_truncated
        status = _classify(process.returncode, stderr, timed_out, truncated)
        if timed_out or process.returncode == -signal.SIGALRM:
            stderr += f"\n[hyflow sandbox] killed after the wall-clock limit of {timeout_s:g} s"
        elif status == "timeout":
            stderr += f"\n[hyflow sandbox] killed after the CPU-time limit of {cpu_limit_s:g} s"
        if truncated:
            stderr += f"\n[hyflow sandbox] output reached the limit of {max_output_bytes} bytes"
        return SandboxResult(status, stdout, stderr, process.returncode, wall_s, truncated)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
