"""Run untrusted Python in a separate, kernel-confined, resource-limited process: the executor behind the code scorer.

`run_code(code, stdin)` writes `code` to ``solution.py`` in a fresh temporary directory and runs it with
``python -I -S -X utf8`` (isolated mode: no PYTHON* variables, no user site, script directory not on
sys.path; no `site` start-up, which halves the start-up time: the parent's site-packages directories are put
on sys.path directly, so numpy & co. import, but their ``.pth`` files are not run), reading stdin from a file,
and returns a `SandboxResult`:

- ``status``: ``"ok"`` (exit code 0), ``"timeout"`` (wall clock past `timeout_s`, or CPU time past the
  limit: SIGXCPU), ``"memory"`` (a MemoryError under the address-space limit), ``"error"`` (any other
  non-zero exit: exception, syntax error, blocked network or process call, output limit).
- ``stdout``, ``stderr`` (decoded, each capped at `max_output_bytes`), ``returncode`` (negative = signal),
  ``wall_s``, ``protections`` (the kernel mechanisms that held for this call, see below).

Processes. The interpreter started by `run_code` is a trusted supervisor (S0, a new session) that never runs
the solution itself:

- S0 enters new PID, network, mount and IPC namespaces (``unshare(2)`` through ctypes: Python 3.11 has no
  ``os.unshare``), plus a user namespace when not root (mapping only its own uid), and forks an init process
  (pid 1 of the new PID namespace). The init mounts a fresh ``/proc`` that shows only the sandbox's processes,
  forks the solution process and reaps. When the init exits or is killed, the kernel SIGKILLs every process
  of the namespace: nothing the solution starts (``setsid()``, double forks) outlives the call.
- The init then builds the solution's view of the files, in the mount namespace only: every home (``$HOME``,
  the user's home, ``/root``, ``/home``), ``/run/user``, ``/run/secrets``, ``/var/run/secrets`` and the
  credential directories named by the environment are covered by an empty tmpfs (the interpreter's standard
  library, site-packages and installation prefixes bound back into it when they live there), credential files named by the
  environment (``NETRC``, ``HF_TOKEN_PATH``, the Hugging Face token under ``HF_HOME``/``XDG_CACHE_HOME``, cloud
  and agent paths) by ``/dev/null``; then every mount is made read-only (``mount_setattr`` with
  ``AT_RECURSIVE``; before Linux 5.12 a read-only bind remount of each mount point); then ``/tmp``, ``/dev/shm``
  and the working directory get a fresh tmpfs each (``scratch_mb`` MiB, 4096 files, nosuid/nodev/noexec; the
  working directory is a directory of the ``/tmp`` one when it lies under ``/tmp``), which the solution file
  is copied into; the interpreter's directories and prefixes under ``/tmp`` (a venv in a checkout there) are
  bound back into it, read-only, at their real paths, and the supervisor resolves its ``sys.path`` to real
  paths before any of this (a venv reached through a symlink under ``/tmp`` stays importable). All of it disappears with the namespace. So the solution can write nowhere but its scratch
  space, whether it runs as a fresh uid (root) or as the user itself (user namespace), and cannot read the
  user's ``~/.netrc``, ``~/.ssh`` or Hugging Face token.
- S0 keeps the wall clock: past `timeout_s` it SIGKILLs the init (or, without namespaces, everything below
  it). S0 is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so without a PID namespace orphans come back to
  it, and after the solution ends it kills its remaining descendants (and, when root, every process of the
  sandbox uid). `run_code` itself waits `timeout_s` + 2 s as a backstop and then SIGKILLs S0's process group.
- The solution process, before the solution runs: when hyflow runs as root, it switches to a fresh random
  unprivileged uid/gid (no supplementary groups; all capabilities lost), so it can neither signal nor
  ptrace hyflow's processes, nor read ``/proc/<pid>/environ`` of a root process, and RLIMIT_NPROC counts
  only the sandbox; directories on the interpreter's paths that others may not search (e.g. a venv under a
  0700 ``/root``) are replaced, inside the sandbox's mount namespace, by an empty tmpfs into which only the
  needed directories are bind-mounted back (the rest of the directory stays hidden). In a user namespace it
  drops all capabilities instead. Then it sets the rlimits and ``PR_SET_NO_NEW_PRIVS`` and installs a
  seccomp filter (classic BPF, built here for x86_64 and aarch64) that makes ``socket(2)`` fail with EPERM
  for every address family and ``socketpair(2)`` for everything but (AF_UNIX, SOCK_STREAM), which asyncio's
  event loop needs and which, connected, cannot be pointed anywhere else (a datagram pair could ``sendto`` or
  re-``connect`` to any unix datagram socket its uid may write, and no namespace stops that), and denies
  ``ptrace``, ``process_vm_readv/writev``, ``pidfd_getfd``, the mount and namespace calls
  (``mount``, ``umount2``, ``pivot_root``, ``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag;
  ``clone3`` returns ENOSYS so libc falls back to ``clone``), ``io_uring_*`` (which could open sockets behind
  the filter), ``bpf``, ``perf_event_open``, ``userfaultfd``, the key-ring, module and kexec calls.

Limits, set with `resource.setrlimit` (soft = hard, so the code cannot raise them) in the solution process:

- RLIMIT_AS = `memory_mb` MiB of address space (Python raises MemoryError when an allocation fails);
- RLIMIT_CPU = `cpu_time_s` seconds, rounded up (default: `timeout_s` + 1), then SIGXCPU;
- RLIMIT_FSIZE = `max_output_bytes`: the child's stdout and stderr are files in the temporary directory, so
  the kernel itself caps the output (a write past the cap fails with EFBIG), and files it writes are capped
  the same way; the parent never buffers unbounded output;
- RLIMIT_CORE = 0 (no core dumps);
- RLIMIT_NPROC = `max_processes` tasks (processes + threads) for the sandbox's own uid (root: the fresh uid;
  user namespace: the kernel counts per namespace; otherwise: the user's current count + `max_processes`).

The environment is replaced by an explicit minimal one (no proxy variables, no credentials, nothing of the
trainer's; ``HOME``/``TMPDIR`` = the temporary directory, one BLAS/OpenMP thread). Python-level guards stay
in front of the kernel for clear messages: ``_socket.socket`` refuses to create sockets ("network access is
disabled"), and ``os.system``, ``os.fork``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*`` and
``_posixsubprocess.fork_exec`` raise PermissionError ("starting processes is disabled"). They are not what
holds: ``posix.fork`` or ctypes bypass them and meet the kernel's limits.

Degraded modes (each missing guarantee is named once in a warning, and `sandbox_guarantees()` reports them;
it runs one probe program that tries what each guarantee forbids, and reports a guarantee held only when
the probe's attempt failed too, not on the mechanisms' word alone):
not root and unprivileged user namespaces disabled (``sysctl kernel.unprivileged_userns_clone`` /
``user.max_user_namespaces``, AppArmor's ``kernel.apparmor_restrict_unprivileged_userns``): no PID namespace
and no separate uid, so the solution runs as hyflow's user: it can read ``/proc/<trainer>/environ`` and can
kill the supervisor to escape the clean-up. Root without CAP_SYS_ADMIN (a default Docker container): no
namespaces; the separate uid, the rlimits, seccomp and the uid-based clean-up still hold, unless the
interpreter's directories are not readable by others (then it stays root, without capabilities: no fork
limit, and it can signal hyflow's root processes).

What remains: this is not a VM. The solution shares the kernel (a kernel bug is an escape), can read every
file its uid may read outside the hidden directories (root: what is world-readable; a user: the user's own
files too, e.g. a run directory outside the home), can write to device nodes and FIFOs its uid may open (a
read-only mount does not cover them), and can use the CPU of its cores, `memory_mb` per process and its
scratch tmpfs for the duration of the call. Without a mount namespace (the degraded modes) it sees the host's
files: it can write wherever its uid may (``/tmp``, ``/dev/shm``; as a user, the user's own files). For hostile code at
scale use a container/VM sandbox (SandboxFusion, gVisor, nsjail, firecracker).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import hashlib
import importlib.util
import logging
import marshal
import math
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

from hyflow.rewards.sandbox_programs import (
    DEADLINE_EXIT_CODE,
    GUARANTEE_PROBE,
    MEMORY_ERROR_EXIT_CODE,
    PRELUDE,
)

logger = logging.getLogger(__name__)

Status = Literal["ok", "timeout", "error", "memory"]


DEFAULT_MAX_OUTPUT_BYTES = 1 << 20
DEFAULT_MAX_PROCESSES = 64

# The parent's package directories, so solutions can import numpy & co.; `.pth` files there are not run.
_SITE_PACKAGES = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]

# Fresh sandbox uids are drawn from here (root only): far above the ranges distributions hand out to users,
# system services and the usual subordinate-uid blocks, and unlikely to collide between concurrent calls.
_SANDBOX_UID_RANGE = (1_500_000_000, 2_000_000_000)

# Mechanisms a test may switch off to exercise the fallbacks: "namespaces", "separate_uid", "seccomp",
# "mount_setattr" (then `/` is made read-only one mount at a time, as on kernels before 5.12) and "filesystem"
# (no hiding, no read-only `/`, no private scratch: the host's files, for tests that need a channel out).
_DISABLED_MECHANISMS: frozenset[str] = frozenset()

DEFAULT_SCRATCH_MB = 64

GUARANTEES = {
    "fork limit": ("fork_limit",),
    "no process outlives the call": ("pid_namespace", "separate_uid"),
    "no sockets": ("seccomp",),
    "trainer environment unreadable": ("private_proc", "separate_uid"),
    "read-only filesystem": ("readonly_root",),
    "private size-limited /tmp, /dev/shm and working directory": ("private_scratch",),
    "home directories and credentials hidden": ("hidden_home",),
    "the interpreter's standard library and site-packages importable": ("interpreter_visible",),
}
"""Each guarantee and the mechanisms (any one suffices) that provide it."""

# Directories hidden behind an empty tmpfs besides the user's own home: every home, the per-user runtime
# directories (agent sockets) and the secrets that container platforms mount (Kubernetes service-account
# tokens, Docker secrets).
_HIDDEN_DIRS = ("/root", "/home", "/run/user", "/run/secrets", "/var/run/secrets")

# Environment variables that name a credential file or directory, possibly outside any home; each existing
# one is hidden too (a file behind /dev/null, a directory behind an empty tmpfs).
_CREDENTIAL_ENV = (
    "NETRC", "HF_TOKEN_PATH", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "GOOGLE_APPLICATION_CREDENTIALS",
    "KUBECONFIG", "DOCKER_CONFIG", "SSH_AUTH_SOCK", "GNUPGHOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR",
)



_prelude_lock = threading.Lock()
_prelude_path: str | None = None


def _prelude_file() -> str:
    """Path of the compiled prelude (written once per process into a private temporary directory)."""
    global _prelude_path
    with _prelude_lock:
        if _prelude_path is None or not os.path.exists(_prelude_path):
            directory = tempfile.mkdtemp(prefix="hyflow_sandbox_prelude_")
            atexit.register(shutil.rmtree, directory, True)
            path = os.path.join(directory, "prelude.pyc")
            code = compile(PRELUDE, "<hyflow sandbox prelude>", "exec")
            with open(path, "wb") as file:  # a .pyc header (magic, flags, mtime, size: unchecked for a script)
                file.write(importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code))
            _prelude_path = path
        return _prelude_path


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one `run_code` call (see the module docstring for the meaning of `status`)."""

    status: Status
    stdout: str
    stderr: str
    returncode: int | None
    wall_s: float
    output_truncated: bool = False
    protections: frozenset[str] = frozenset()

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


def _read_capped(file, max_bytes: int) -> tuple[str, bool]:
    """The first `max_bytes` of an open file, decoded (invalid UTF-8 replaced), and whether the cap was reached.

    Reads the descriptor `run_code` opened, never the path: the sandbox may own the directory and replace the
    file by a symlink to something only the parent can read.
    """
    file.seek(0)
    data = file.read(max_bytes + 1)
    return data[:max_bytes].decode("utf-8", errors="replace"), len(data) >= max_bytes


def _wait(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for `process` up to `timeout_s`; True when it ended. Wakes up when it ends (a pidfd), where
    `Popen.wait(timeout)` polls with a back-off that reaches 50 ms and adds tens of ms to a short call."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        try:
            process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            if time.monotonic() >= deadline:
                return process.poll() is not None
        process.wait()
        return True
    finally:
        os.close(pidfd)


def _kill_group(pid: int) -> None:
    """SIGKILL the supervisor's process group (the supervisor and what stayed in its session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _real_uid(pid: str) -> int:
    """The real uid of a process (its /proc directory belongs to root once it changed its uid)."""
    with open(f"/proc/{pid}/status", "rb") as file:
        for line in file:
            if line.startswith(b"Uid:"):
                return int(line.split()[1])
    raise ValueError(f"no Uid line for process {pid}")


def _kill_uid(uid: int) -> None:
    """SIGKILL every process owned by the sandbox uid (the backstop when the supervisor itself was killed)."""
    for _ in range(100):
        victims = []
        for name in os.listdir("/proc"):
            with contextlib.suppress(OSError, ValueError):
                if name.isdigit() and _real_uid(name) == uid:
                    victims.append(int(name))
        if not victims:
            return
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _classify(returncode: int, stderr: str, timed_out: bool, truncated: bool) -> Status:
    """Map how the child ended to a status."""
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGALRM):
        return "timeout"
    if returncode == 0 and not truncated:
        return "ok"
    if returncode == MEMORY_ERROR_EXIT_CODE and "MemoryError" in stderr:
        return "memory"
    return "error"


def _first_unsearchable(path: str) -> str | None:
    """The outermost directory on the way to `path` (itself included) that others may not search, if any."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return None
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return current
    return None


def _exposures(paths: list[str], workdir: str) -> list[tuple[str, list[str]]] | None:
    """[(directory others may not search, [needed paths below it])] for the sandbox uid; None if impossible.

    `paths` must be readable by others themselves: impossible when one is closed (binding it back would not
    open it). `workdir` belongs to the sandbox uid: only the directories above it matter.
    """
    groups: dict[str, list[str]] = {}
    for path in [*paths, workdir]:
        mask = _first_unsearchable(path if path != workdir else os.path.dirname(workdir))
        if mask is None:
            continue
        if mask == path:
            return None
        groups.setdefault(mask, []).append(path)
    result = []
    for mask, needed in groups.items():
        kept: list[str] = []
        for path in sorted(set(needed), key=len):  # a path inside one already bound back comes with it
            if not any(path.startswith(outer + "/") for outer in kept):
                kept.append(path)
        result.append((mask, kept))
    return result


def _interpreter_paths() -> list[str]:
    """The directories the solution process imports from (real paths), existing ones only: the standard
    library, its extension modules (lib-dynload), and the parent's site-packages (nothing else of the parent's
    sys.path: its script directory or working directory may be a home that the sandbox hides)."""
    paths = []
    stdlib = [entry for entry in sys.path if os.path.basename(entry) == "lib-dynload" or entry.endswith(".zip")]
    for entry in [os.path.dirname(os.__file__), *stdlib, *_SITE_PACKAGES]:
        if not entry:
            continue
        real = os.path.realpath(entry)
        if os.path.isfile(real):  # python3XX.zip
            real = os.path.dirname(real)
        if os.path.isdir(real) and real not in paths:
            paths.append(real)
    return paths


def _prefix_paths(hidden_dirs: list[str]) -> list[str]:
    """The interpreter's installation prefixes (real paths: the venv's and the base interpreter's), kept readable
    wherever they are (under /tmp included), except a prefix that holds a hidden directory (e.g. `/`, `/home`)."""
    paths = []
    for prefix in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix):
        real = os.path.realpath(prefix)
        if os.path.isdir(real) and real not in paths and not any(_is_within(d, real) for d in hidden_dirs):
            paths.append(real)
    return paths


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _hidden_paths() -> tuple[list[str], list[str]]:
    """(directories, files) to hide from the solution: every home (the user's own from $HOME and the password
    database, /root, /home), runtime and secret directories, and the credentials named by the environment
    (the Hugging Face token wherever HF_HOME/XDG_CACHE_HOME put it, NETRC, cloud and ssh-agent paths ...).
    Real paths of existing entries only; a path inside a hidden directory is covered by it."""
    candidates = [*_HIDDEN_DIRS, os.environ.get("HOME", ""), os.path.expanduser("~")]
    with contextlib.suppress(KeyError, ImportError):
        import pwd

        candidates.append(pwd.getpwuid(os.getuid()).pw_dir)
    candidates += [os.environ.get(name, "") for name in _CREDENTIAL_ENV]
    if os.environ.get("HF_HOME"):
        candidates.append(os.path.join(os.environ["HF_HOME"], "token"))
    if os.environ.get("XDG_CACHE_HOME"):
        candidates.append(os.path.join(os.environ["XDG_CACHE_HOME"], "huggingface", "token"))
    directories: list[str] = []
    files: list[str] = []
    for candidate in candidates:
        if not candidate or not os.path.isabs(candidate) or not os.path.lexists(candidate):
            continue
        real = os.path.realpath(candidate)
        if real == "/" or not os.path.exists(real):
            continue
        (directories if os.path.isdir(real) else files).append(real)
    outer = []
    for directory in sorted(set(directories), key=len):
        if not any(_is_within(directory, kept) for kept in outer):
            outer.append(directory)
    return outer, sorted({f for f in files if not any(_is_within(f, d) for d in outer)})


def _mask_plan(masks: list[str], needed: list[str]) -> list[tuple[str, list[str]]]:
    """[(directory to cover with an empty tmpfs, [needed paths below it, bound back])]: outermost masks only;
    a mask that is itself needed, or lies inside a needed path, is left open (the interpreter must run)."""
    outer: list[str] = []
    for mask in sorted(set(masks), key=len):
        if any(_is_within(mask, path) for path in needed):
            continue
        if not any(_is_within(mask, kept) for kept in outer):
            outer.append(mask)
    plan = []
    for mask in outer:
        below: list[str] = []
        for path in sorted({p for p in needed if _is_within(p, mask)}, key=len):
            if not any(_is_within(path, kept) for kept in below):  # inside one already bound back: comes with it
                below.append(path)
        plan.append((mask, below))
    return plan


_warned_missing: set[str] = set()
_warn_lock = threading.Lock()


def _missing_guarantees(protections: frozenset[str]) -> list[str]:
    return [name for name, mechanisms in GUARANTEES.items() if not protections.intersection(mechanisms)]


def _warn_once(protections: frozenset[str], notes: list[str]) -> None:
    """One warning per process naming the sandbox guarantees that do not hold on this machine, and why."""
    missing = _missing_guarantees(protections)
    with _warn_lock:
        new = [name for name in missing if name not in _warned_missing]
        if not new:
            return
        _warned_missing.update(new)
    reason = "; ".join(notes) or (
        "unprivileged user namespaces are disabled"
        if os.geteuid() != 0
        else "no CAP_SYS_ADMIN for namespaces, or the interpreter's directories are closed to other users"
    )
    logger.warning(
        "hyflow code sandbox: these guarantees do NOT hold on this machine: %s (%s). Run hyflow as root, or "
        "enable unprivileged user namespaces (sysctl user.max_user_namespaces>0, "
        "kernel.unprivileged_userns_clone=1), or use a container/VM sandbox for untrusted code.",
        ", ".join(new),
        reason,
    )


def _check_limits(**limits: float) -> None:
    """Every limit of a `run_code` call must be positive."""
    if any(value <= 0 for value in limits.values()):
        raise ValueError("run_code needs positive limits, got " + ", ".join(f"{k}={v}" for k, v in limits.items()))


def _sandbox_uid(workdir: str, solution_path: str,
                 notes: list[str]) -> tuple[int | None, list[tuple[str, list[str]]] | None]:
    """(the fresh uid the solution runs as, the directories re-exposed to it): root only, (None, []) otherwise;
    (None, None) when a directory on the interpreter's path is closed to other users (added to `notes`)."""
    uid = None
    exposures: list[tuple[str, list[str]]] | None = []
    if os.geteuid() == 0 and "separate_uid" not in _DISABLED_MECHANISMS:
        exposures = _exposures(_interpreter_paths(), os.path.realpath(workdir))
        if exposures is None:
            notes.append("a directory on the interpreter's path is closed to other users")
        else:
            uid = _SANDBOX_UID_RANGE[0] + secrets.randbelow(_SANDBOX_UID_RANGE[1] - _SANDBOX_UID_RANGE[0])
            os.chown(workdir, uid, uid)
            os.chown(solution_path, uid, uid)
    return uid, exposures


def _settings(solution_path: str, workdir: str, uid: int | None, exposures: list[tuple[str, list[str]]] | None, *,
              scratch_mb: int, memory_mb: int, cpu_limit_s: int, max_output_bytes: int, max_processes: int,
              timeout_s: float) -> dict:
    """The prelude's settings (its argv[1]) for one call, without the report pipe's descriptor."""
    hidden_dirs, hidden_files = _hidden_paths()
    masks = [mask for mask, _ in exposures or []] if uid is not None else []
    import_paths = _interpreter_paths()
    kept = import_paths + [p for p in _prefix_paths(hidden_dirs) if p not in import_paths]
    return {
        "solution": solution_path,
        "workdir": workdir,
        "masks": _mask_plan(masks + hidden_dirs, kept),
        "hidden_files": hidden_files,
        "scratch_bytes": scratch_mb * 1024 * 1024,
        "memory_bytes": memory_mb * 1024 * 1024,
        "cpu_s": cpu_limit_s,
        "fsize": max_output_bytes,
        "max_processes": max_processes,
        "site_packages": [os.path.realpath(path) for path in _SITE_PACKAGES],
        "interpreter": kept,
        "import_paths": import_paths,
        "timeout_s": timeout_s,
        "alarm_s": math.ceil(timeout_s) + 2,
        "uid": uid,
        "root": os.geteuid() == 0,
        "exposures": exposures or [],
        "disabled": sorted(_DISABLED_MECHANISMS),
    }


def _limit_notes(status: Status, returncode: int | None, timed_out: bool, truncated: bool, *, timeout_s: float,
                 cpu_limit_s: int, max_output_bytes: int) -> str:
    """The lines appended to stderr that name the limit a call reached (empty when none)."""
    text = ""
    if timed_out or returncode == -signal.SIGALRM:
        text += f"\n[hyflow sandbox] killed after the wall-clock limit of {timeout_s:g} s"
    elif status == "timeout":
        text += f"\n[hyflow sandbox] killed after the CPU-time limit of {cpu_limit_s:g} s"
    if truncated:
        text += f"\n[hyflow sandbox] output reached the limit of {max_output_bytes} bytes"
    return text


def _start_supervisor(settings: dict, workdir: str, stdin_file, stdout_file, stderr_file,
                      report_w: int) -> subprocess.Popen:
    """The supervisor S0: the compiled prelude with `settings`, in a session of its own (module docstring)."""
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-X", "utf8", _prelude_file(), repr(settings)],
        stdin=stdin_file,
        stdout=stdout_file,
        stderr=stderr_file,
        cwd=workdir,
        env=_child_env(workdir),
        start_new_session=True,
        close_fds=True,
        pass_fds=(report_w,),
    )


def run_code(
    code: str,
    stdin: str = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_time_s: float | None = None,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    scratch_mb: int = DEFAULT_SCRATCH_MB,
) -> SandboxResult:
    """Run Python `code` with `stdin` in a separate, confined process; never raises for anything the code does.

    Limits: wall clock `timeout_s`; CPU time `cpu_time_s` (default ceil(timeout_s) + 1); address space
    `memory_mb` MiB; stdout, stderr and written files `max_output_bytes` each; `max_processes` processes and
    threads; `scratch_mb` MiB (and 4096 files) for each of its private tmpfs: `/tmp`, `/dev/shm` and the working
    directory when it is not under `/tmp`. An output that reaches the cap makes the status "error" (the answer cannot be judged) with
    `output_truncated=True`. Nothing the code starts is alive when this returns (see the module docstring for
    the conditions).
    """
    _check_limits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                  max_processes=max_processes, scratch_mb=scratch_mb)
    cpu_limit_s = max(1, math.ceil(cpu_time_s if cpu_time_s is not None else timeout_s + 1))
    workdir = tempfile.mkdtemp(prefix="hyflow_sandbox_")
    notes: list[str] = []
    report_r = report_w = -1
    try:
        solution_path = os.path.join(workdir, "solution.py")
        with open(solution_path, "w", encoding="utf-8") as file:
            file.write(code)
        uid, exposures = _sandbox_uid(workdir, solution_path, notes)
        settings = _settings(solution_path, workdir, uid, exposures, scratch_mb=scratch_mb, memory_mb=memory_mb,
                             cpu_limit_s=cpu_limit_s, max_output_bytes=max_output_bytes,
                             max_processes=max_processes, timeout_s=timeout_s)
        report_r, report_w = os.pipe()
        settings["report_fd"] = report_w
        with (
            open(os.path.join(workdir, "stdin"), "w+b") as stdin_file,
            open(os.path.join(workdir, "stdout"), "w+b") as stdout_file,
            open(os.path.join(workdir, "stderr"), "w+b") as stderr_file,
        ):
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.flush()
            stdin_file.seek(0)
            start = time.monotonic()
            process = _start_supervisor(settings, workdir, stdin_file, stdout_file, stderr_file, report_w)
            os.close(report_w)
            report_w = -1
            timed_out = not _wait(process, timeout_s + 2)  # the supervisor keeps `timeout_s`; this is the backstop
            if timed_out:
                _kill_group(process.pid)
                process.wait()
            wall_s = time.monotonic() - start
            _kill_group(process.pid)  # stragglers left in the supervisor's session
            if uid is not None and timed_out:
                _kill_uid(uid)
            returncode = process.returncode
            if returncode == DEADLINE_EXIT_CODE:
                timed_out, returncode = True, -signal.SIGKILL
            stdout, stdout_truncated = _read_capped(stdout_file, max_output_bytes)
            stderr, stderr_truncated = _read_capped(stderr_file, max_output_bytes)
        protections = _read_report(report_r, notes)
        truncated = stdout_truncated or stderr_truncated
        status = _classify(returncode, stderr, timed_out, truncated)
        stderr += _limit_notes(status, returncode, timed_out, truncated, timeout_s=timeout_s, cpu_limit_s=cpu_limit_s,
                               max_output_bytes=max_output_bytes)
        if protections:
            _warn_once(protections, notes)
        return SandboxResult(status, stdout, stderr, returncode, wall_s, truncated, protections)
    finally:
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _read_report(report_r: int, notes: list[str]) -> frozenset[str]:
    """The protections the sandbox's stages reported (what did not hold is added to `notes`)."""
    os.set_blocking(report_r, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(report_r, 65536):
            chunks.append(chunk)
    protections = set()
    for line in b"".join(chunks).decode("utf-8", errors="replace").splitlines():
        if line.startswith("no "):
            notes.append(line[3:])
        elif line:
            protections.add(line)
    return frozenset(protections)




def _home_entries(hidden_dirs: list[str], needed: list[str], per_dir: int = 8) -> list[str]:
    """A few entries of each hidden directory as the host sees them, none on the way to a `needed` path."""
    entries: list[str] = []
    for directory in hidden_dirs:
        with contextlib.suppress(OSError):
            names = sorted(os.listdir(directory))
            entries += [
                entry for entry in (os.path.join(directory, name) for name in names)
                if not any(_is_within(path, entry) or _is_within(entry, path) for path in needed)
            ][:per_dir]
    return entries


def _probe_guarantees() -> tuple[dict[str, bool], str]:
    """({guarantee: held}, what went wrong) from one sandboxed call that tries what each guarantee forbids."""
    markers = []
    for directory in ("/tmp", "/dev/shm"):
        if os.path.isdir(directory):
            with contextlib.suppress(OSError):
                handle, marker = tempfile.mkstemp(prefix="hyflow_guarantee_marker_", dir=directory)
                os.close(handle)
                os.chmod(marker, 0o644)
                markers.append(marker)
    import_paths = _interpreter_paths()
    hidden_dirs, hidden_files = _hidden_paths()
    listings = {}
    for path in import_paths:
        try:
            listings[path] = bool(os.listdir(path))
        except OSError:
            listings[path] = False
    environ = f"/proc/{os.getpid()}/environ"
    with open(environ, "rb") as file:
        environ_sha256 = hashlib.sha256(file.read()).hexdigest()
    settings = {
        "uid": os.getuid(),
        "prelude": _prelude_file(),
        "environ": environ,
        "environ_sha256": environ_sha256,
        "markers": markers,
        "scratch_bytes": DEFAULT_SCRATCH_MB * 1024 * 1024,
        "home_entries": _home_entries(hidden_dirs, import_paths + _prefix_paths(hidden_dirs)),
        "hidden_files": hidden_files,
        "import_paths": import_paths,
        "import_listings": listings,
    }
    try:
        result = run_code(GUARANTEE_PROBE.replace("PROBE_SETTINGS", repr(settings)), timeout_s=20.0)
    finally:
        for marker in markers:
            with contextlib.suppress(OSError):
                os.unlink(marker)
    try:
        held = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError, SyntaxError):
        return {name: False for name in GUARANTEES}, f"the probe ended {result.status}: {result.stderr[-2000:]}"
    mechanisms = {name: bool(result.protections.intersection(needed)) for name, needed in GUARANTEES.items()}
    return {name: mechanisms[name] and held.get(name) is True for name in GUARANTEES}, result.stderr.strip()


_guarantees_cache: dict[str, bool] | None = None


def sandbox_guarantees() -> dict[str, bool]:
    """Which of `GUARANTEES` hold on this machine for this user, probed once per process: a sandboxed program
    tries what each guarantee forbids (opens sockets, writes beside site-packages, reads the caller's environ,
    a marker in the host's /tmp, entries of the hidden homes) and imports nothing it cannot list; a guarantee
    is held only when its mechanism was reported and the program's attempt failed as it should."""
    global _guarantees_cache
    if _guarantees_cache is None:
        held, problems = _probe_guarantees()
        if problems and not all(held.values()):
            logger.warning("hyflow code sandbox: the guarantee probe reported: %s", problems)
        _guarantees_cache = held
    return dict(_guarantees_cache)
