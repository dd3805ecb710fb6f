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

logger = logging.getLogger(__name__)

Status = Literal["ok", "timeout", "error", "memory"]

MEMORY_ERROR_EXIT_CODE = 201
"""Exit code the prelude uses for an uncaught MemoryError (checked together with 'MemoryError' in stderr)."""

DEADLINE_EXIT_CODE = 202
"""Exit code of the supervisor when it killed the solution at the wall-clock limit (a solution that exits with
it is reported as a timeout: a failure either way)."""

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

# The supervisor (S0), the init of the PID namespace and the solution process, in one program, compiled once
# per hyflow process into a .pyc that `python -I -S` runs (compiling it on every call cost ~5 ms). argv[1] is
# the settings dict as a Python literal (json's import costs more than the rest of the start-up). Only
# built-in/stdlib modules are imported (python -S); the protections each stage applied are written, one per
# line, to the report pipe.
_PRELUDE = r'''
import builtins, ctypes, os, resource, signal, struct, sys, time, types, _posixsubprocess, _socket

_C = eval(sys.argv[1], {"__builtins__": {}})  # a literal written by run_code
_LIBC = ctypes.CDLL(None, use_errno=True)
_NEWNS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = 0x20000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
_ALL_NEW_NAMESPACES = 0x7E020080  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 8, 32, 4096, 16384
_MS_NOATIME, _MS_NODIRATIME, _MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1024, 2048, 1 << 18, 1 << 21, 1 << 24
_REPORT = _C["report_fd"]
_LINUX = sys.platform.startswith("linux")  # elsewhere: rlimits, the wall clock and the Python guards only
# Real paths, resolved while the host's files are still in view: the sandbox binds the interpreter's directories
# back at their real paths, and a symlink on the way (a venv reached through a link under /tmp) is gone there.
sys.path[:] = [os.path.realpath(entry) for entry in sys.path]

def _report(*names):
    os.write(_REPORT, "".join(name + "\n" for name in names).encode())

def _call(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")

def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _call(_LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")

def _write_file(path, text):
    with open(path, "w") as file:
        file.write(text)

# ---- S0, the supervisor -----------------------------------------------------------------------------------

def _enter_namespaces():
    """New PID/net/mount/IPC namespaces (+ a user namespace when not root). False when the kernel refuses."""
    if "namespaces" in _C["disabled"] or not _LINUX:
        return False
    uid, gid = os.getuid(), os.getgid()
    flags = _NEWNS | _NEWPID | _NEWNET | _NEWIPC | (0 if uid == 0 else _NEWUSER)
    if _LIBC.unshare(flags) != 0:
        return False
    if uid != 0:
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
        _report("user_namespace")
    _report("pid_namespace", "net_namespace")
    return True

def _scan_processes():
    """(pid, ppid, state, real uid) of every process (from /proc/PID/status: a process that changed its uid
    is not dumpable, and its /proc directory then belongs to root)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as file:
                fields = dict(line.split(b":", 1) for line in file.read().splitlines() if b":" in line)
            yield int(name), int(fields[b"PPid"]), fields[b"State"].split()[0], int(fields[b"Uid"].split()[0])
        except (OSError, KeyError, ValueError):
            continue

def _kill_leftovers(uid):
    """SIGKILL every descendant (they come back to us: we are a subreaper) and every process of `uid`."""
    if not _LINUX:
        return
    me = os.getpid()
    give_up = time.monotonic() + 2.0  # only a process stuck in the kernel (state D) could hold us longer
    while time.monotonic() < give_up:
        victims = [pid for pid, ppid, state, owner in _scan_processes()
                   if pid != me and (ppid == me or (uid is not None and owner == uid and state != b"Z"))]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in victims:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    while True:  # reap what is left
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break

def _stay_root():
    """Give the work directory back to root (run_code chowned it to the sandbox uid); returns no uid."""
    for path in (_C["workdir"], _C["solution"]):
        os.chown(path, 0, 0)
    return None

def _mirror(status):
    """Exit like the solution did: same exit code, or killed by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)

def _supervise():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    in_namespaces = _enter_namespaces()
    uid = _C["uid"]
    if uid is not None and _C["exposures"] and not in_namespaces:
        uid = _stay_root()  # the interpreter's directories cannot be re-exposed without a mount namespace
        _report("no separate_uid: the interpreter's directories are closed to other users and there is no "
                "mount namespace to re-expose them")
    if not in_namespaces and _LINUX:
        _call(_LIBC.prctl(36, 1, 0, 0, 0), "PR_SET_CHILD_SUBREAPER")
        _report("subreaper")
    status_r, status_w = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    deadline = time.monotonic() + _C["timeout_s"]
    child = os.fork()
    if child == 0:
        os.close(status_r)
        if in_namespaces:
            uid = _init(uid, status_w)  # returns in the solution process only
        os.close(status_w)
        _solution(uid, userns=in_namespaces and not _C["root"])
        return
    os.close(status_w)
    status = None
    while status is None:
        pid, raw = os.waitpid(child, os.WNOHANG)
        if pid:
            status = raw
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        signal.sigtimedwait([signal.SIGCHLD], left)
    if status is None:  # past the wall clock: killing the init tears down its whole PID namespace
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    if not in_namespaces:
        _kill_leftovers(uid)
    if status is None:
        os._exit(DEADLINE_EXIT)
    if in_namespaces:
        reported = os.read(status_r, 64)
        if not reported:  # the init died without a word: its namespace is gone, report it as a crash
            os._exit(1)
        status = int(reported)
    _mirror(status)

# ---- the init (pid 1 of the new PID namespace) ------------------------------------------------------------

def _expose(exposures):
    """Replace each directory others may not search by a tmpfs and bind the needed paths back into it."""
    os.umask(0o022)
    for mask, paths in exposures:
        fds = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in paths]
        _mount("tmpfs", mask, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=755,size=64k")
        for path, fd in fds:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            os.close(fd)

def _hide_files(paths):
    """Put /dev/null over each credential file (a bind mount: the file reads as empty, its name stays)."""
    for path in paths:
        _mount("/dev/null", path, None, _MS_BIND)

def _readonly_root():
    """Make every mount of this mount namespace read-only: mount_setattr(2) with AT_RECURSIVE (Linux 5.12+),
    else a read-only bind remount of each mount point, keeping its nosuid/nodev/noexec/atime flags (a user
    namespace may not clear those: they are locked)."""
    if "mount_setattr" not in _C["disabled"]:
        attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # struct mount_attr: attr_set = MOUNT_ATTR_RDONLY
        result = _LIBC.syscall(ctypes.c_long(442), ctypes.c_long(-100), b"/", ctypes.c_long(0x8000),
                               ctypes.byref(attr), ctypes.c_long(32))  # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE)
        if result == 0:
            return
        if ctypes.get_errno() not in (38, 22):  # ENOSYS, EINVAL: an older kernel, remount one by one
            _call(result, "mount_setattr /")
    with open("/proc/self/mountinfo", "rb") as file:
        points = [line.split()[4].decode("unicode_escape") for line in file]  # octal escapes (\040 = space)
    for point in points:
        try:
            flags = os.statvfs(point).f_flag
        except OSError:  # under a directory hidden by a tmpfs: unreachable from here
            continue
        if flags & os.ST_RDONLY:
            continue
        kept = flags & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
        kept |= _MS_RELATIME if flags & os.ST_RELATIME else 0 if flags & os.ST_NOATIME else _MS_STRICTATIME
        _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)

def _scratch(uid):
    """A fresh tmpfs on /tmp and /dev/shm (mode 1777) and a private working directory, each capped at
    `scratch_bytes` bytes and 4096 files, gone when the namespace ends."""
    options = f"size={_C['scratch_bytes']},nr_inodes=4096"
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    scratch = [path for path in ("/tmp", "/dev/shm") if os.path.isdir(path)]
    for path in scratch:
        # the interpreter may live there (a venv in a checkout under /tmp): keep its directories, read-only
        below = [p for p in _C["interpreter"] if p.startswith(path + "/")]
        kept = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in below
                if not any(p.startswith(q + "/") for q in below if q != p)]
        _mount("tmpfs", path, "tmpfs", flags, options + ",mode=1777")
        for inner, fd in kept:
            os.makedirs(inner, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", inner, None, _MS_BIND | _MS_REC)  # a bind keeps the read-only flag
            os.close(fd)
    workdir = _C["workdir"]
    if any(workdir.startswith(path + "/") for path in scratch):
        os.makedirs(workdir, mode=0o700)
    else:  # its mount point exists (the host directory, or one made in a hiding tmpfs before `/` became read-only)
        _mount("tmpfs", workdir, "tmpfs", flags, options + ",mode=700")
    if uid is not None:
        os.chown(workdir, uid, uid)

def _filesystem(uid):
    """The solution's view of the files: homes and credentials hidden, `/` read-only, private scratch space.

    Each step that held is reported; one that failed is reported with its error, and the call goes on with
    the weaker guarantee (the warning names it). Returns the uid to switch to (None: stay)."""
    with open(_C["solution"], "rb") as file:  # the host's work directory is about to be covered
        source = file.read()
    try:
        _expose(_C["masks"])
        _hide_files(_C["hidden_files"])
        _report("hidden_home")
    except OSError as error:
        _report("no hidden_home: " + str(error))
        if uid is not None and _C["exposures"]:  # the sandbox uid may not reach the interpreter
            _report("no separate_uid: " + str(error))
            uid = _stay_root()
    workdir = _C["workdir"]
    if not any(workdir.startswith(path + "/") for path in ("/tmp", "/dev/shm")):
        try:  # the mount point of the private working directory, while it can still be made
            os.makedirs(workdir, exist_ok=True)
        except OSError:
            pass
    try:
        _readonly_root()
        _report("readonly_root")
    except OSError as error:
        _report("no readonly_root: " + str(error))
    try:
        _scratch(uid)
        _report("private_scratch")
    except OSError as error:
        _report("no private_scratch: " + str(error))
    try:
        with open(_C["solution"], "wb") as file:
            file.write(source)
        if uid is not None:
            os.chown(_C["solution"], uid, uid)
    except OSError:  # no private working directory: the host's copy is still in place
        pass
    return uid

def _init(uid, status_w):
    """Pid 1 of the new PID namespace: a private /proc, the solution's file system view, then fork the
    solution and reap.

    Returns (the uid to switch to) in the forked solution process only; the init itself never returns."""
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here propagates to the host
        try:
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            _report("private_proc")
        except OSError as error:  # e.g. a user namespace inside a container that masks parts of /proc
            _report("no private_proc: " + str(error))
        if "filesystem" not in _C["disabled"]:
            uid = _filesystem(uid)
        elif uid is not None and _C["exposures"]:  # only what the sandbox uid needs to reach the interpreter
            try:
                _expose(_C["exposures"])
            except OSError as error:
                _report("no separate_uid: " + str(error))
                uid = _stay_root()
        child = os.fork()
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)
    if child == 0:
        return uid
    try:
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                os.write(status_w, str(status).encode())
                break
    finally:
        os._exit(0)  # the kernel now kills whatever is left in the namespace

# ---- the solution process ---------------------------------------------------------------------------------

_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH, denied syscalls, socket, socketpair, clone, clone3)
    "x86_64": (0xC000003E, (101, 155, 161, 165, 166, 175, 176, 246, 248, 249, 250, 272, 298, 303, 304, 308, 310,
                            311, 312, 313, 320, 321, 323, 425, 426, 427, 428, 429, 430, 431, 432, 433, 438, 442),
               41, 53, 56, 435),
    "aarch64": (0xC00000B7, (39, 40, 41, 51, 97, 104, 105, 106, 117, 217, 218, 219, 241, 264, 265, 268, 270, 271,
                             273, 280, 282, 294, 425, 426, 427, 428, 429, 430, 431, 432, 433, 438, 442),
                198, 199, 220, 435),
}

def _seccomp_program():
    """Classic BPF: wrong arch -> kill; x32 -> ENOSYS; socket and the denied calls -> EPERM; clone3 -> ENOSYS;
    socketpair other than (AF_UNIX, SOCK_STREAM) -> EPERM; clone with a CLONE_NEW* flag -> EPERM; everything
    else allowed.

    A connected stream pair cannot reach anything else (connect: EISCONN; sendto with an address: EISCONN);
    a datagram or seqpacket pair can: sendto(path) or a second connect(path) deliver to any datagram socket
    the uid may write to, and no namespace stops that (a read-only mount does not guard socket files)."""
    arch, denied, socket_nr, socketpair_nr, clone_nr, clone3_nr = _SECCOMP_ARCH[os.uname().machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    and_ = 0x54  # BPF_ALU|BPF_AND|BPF_K
    allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000
    eperm, enosys = errno | 1, errno | 38
    af_unix, sock_stream, sock_flags = 1, 1, 0o4000 | 0o2000000  # SOCK_NONBLOCK | SOCK_CLOEXEC
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if arch == 0xC000003E:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, enosys)]
    for nr in (socket_nr, *denied):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, clone3_nr), (ret, 0, 0, enosys),
             (jeq, 0, 7, socketpair_nr),  # the 7 instructions below decide socketpair
             (ld, 0, 0, 16), (jeq, 0, 4, af_unix),  # args[0] (low 32 bits): the domain
             (ld, 0, 0, 24), (and_, 0, 0, ~sock_flags & 0xFFFFFFFF), (jeq, 0, 1, sock_stream),  # args[1]: type
             (ret, 0, 0, allow), (ret, 0, 0, eperm),
             (jeq, 0, 3, clone_nr), (ld, 0, 0, 16), (jset, 0, 1, _ALL_NEW_NAMESPACES), (ret, 0, 0, eperm),
             (ret, 0, 0, allow)]
    return b"".join(struct.pack("HBBI", *op) for op in prog), len(prog)

def _install_seccomp():
    if not _LINUX:
        return False
    _call(_LIBC.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    if "seccomp" in _C["disabled"] or os.uname().machine not in _SECCOMP_ARCH:
        return False
    code, length = _seccomp_program()
    buffer = ctypes.create_string_buffer(code)
    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = _Prog(length, ctypes.addressof(buffer))
    return _LIBC.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER

def _drop_capabilities():
    if not _LINUX:
        return
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _call(_LIBC.capset(header, data), "capset")

def _user_task_count(uid):
    if not _LINUX:
        return 1 << 20  # no /proc to count with: no fork limit (not reported as one)
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return count

def _solution(uid, userns):
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    protections = []
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        protections += ["separate_uid", "fork_limit"]
        nproc = _C["max_processes"]
    elif os.getuid() != 0 and userns:
        _drop_capabilities()
        protections.append("fork_limit")
        nproc = _C["max_processes"] + 2  # the supervisor and the init share this user namespace's count
    elif os.getuid() != 0:
        protections += ["fork_limit"] if _LINUX else []
        nproc = _user_task_count(os.getuid()) + _C["max_processes"]
    else:  # root that could not switch uid: no capabilities at least (root is exempt from RLIMIT_NPROC)
        _drop_capabilities()
        nproc = _C["max_processes"]
    os.chdir(_C["workdir"])
    resource.setrlimit(resource.RLIMIT_AS, (_C["memory_bytes"], _C["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (_C["cpu_s"], _C["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_C["fsize"], _C["fsize"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if all(os.path.isdir(path) for path in _C["import_paths"]):
        protections.append("interpreter_visible")
    if _install_seccomp():
        protections.append("seccomp")
    _report(*protections)
    os.closerange(3, 1 << 16)  # the report pipe and anything else the supervisor held
    signal.alarm(_C["alarm_s"])  # one more self-destruct, in case both supervisors are gone
    _run_solution_code()

def _blocked(what):
    def deny(*args, **kwargs):
        raise PermissionError(f"{what} is disabled in the hyflow sandbox")
    return deny

class _NoNetworkSocket(_socket.socket):
    __slots__ = ()  # like its C base: socket.socket adds __weakref__ itself and fails if it exists
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None:  # wrapping an existing descriptor (socketpair(), which asyncio needs) stays allowed
            raise PermissionError("network access is disabled in the hyflow sandbox")
        super().__init__(family, type, proto, fileno)

def _run_solution_code():
    """Friendly Python-level guards, then the solution as a clean __main__ module."""
    sys.path.extend(_C["site_packages"])
    # `socket.socket` subclasses `_socket.socket` and copies `_socket`'s functions when first imported, so
    # patching `_socket` first makes every later `import socket` (urllib, http, asyncio...) inherit the block.
    _socket.socket = _socket.SocketType = _NoNetworkSocket
    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        setattr(_socket, name, _blocked("network access"))
    stream_pair = _socket.socketpair
    def socketpair(family=_socket.AF_UNIX, type=_socket.SOCK_STREAM, proto=0):  # what seccomp lets through
        if family != _socket.AF_UNIX or type & ~(_socket.SOCK_NONBLOCK | _socket.SOCK_CLOEXEC) != _socket.SOCK_STREAM:
            raise PermissionError("socketpair other than (AF_UNIX, SOCK_STREAM) is disabled in the hyflow sandbox")
        return stream_pair(family, type, proto)
    _socket.socketpair = socketpair
    for name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp", "execlpe",
                 "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
                 "spawnvpe", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _blocked("starting processes"))
    _posixsubprocess.fork_exec = _blocked("starting processes")  # what subprocess.Popen uses

    def _quit(code=None):  # `exit()`/`quit()` normally come from the `site` module, skipped by -S
        raise SystemExit(code)
    builtins.exit = builtins.quit = _quit

    path = _C["solution"]
    sys.argv = [path]
    with open(path, encoding="utf-8") as file:
        source = file.read()
    main = types.ModuleType("__main__")  # a clean __main__ module for the solution, as `runpy` makes
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    try:
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exit_:
        code = exit_.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _finish(code or 0)
    except BaseException as error:
        import traceback
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)  # hide the prelude frame
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(MEMORY_EXIT if isinstance(error, MemoryError) else 1)
    _finish(0)

def _finish(code):
    """Exit as the interpreter would (join non-daemon threads, atexit handlers, flush), minus its finalization:
    in a forked child that touches every object and copies every page (~6 ms a call)."""
    import atexit
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            code = 120  # what Python exits with when flushing stdout fails at shutdown
        except Exception:  # closed or replaced by the solution: Python ignores it too
            pass
    os._exit(code & 0xFF)

_supervise()
'''.replace("MEMORY_EXIT", str(MEMORY_ERROR_EXIT_CODE)).replace("DEADLINE_EXIT", str(DEADLINE_EXIT_CODE))


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
            code = compile(_PRELUDE, "<hyflow sandbox prelude>", "exec")
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
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or max_processes <= 0 or scratch_mb <= 0:
        raise ValueError(
            f"run_code needs positive limits, got timeout_s={timeout_s}, memory_mb={memory_mb}, "
            f"max_output_bytes={max_output_bytes}, max_processes={max_processes}, scratch_mb={scratch_mb}"
        )
    cpu_limit_s = max(1, math.ceil(cpu_time_s if cpu_time_s is not None else timeout_s + 1))
    workdir = tempfile.mkdtemp(prefix="hyflow_sandbox_")
    notes: list[str] = []
    report_r = report_w = -1
    try:
        solution_path = os.path.join(workdir, "solution.py")
        with open(solution_path, "w", encoding="utf-8") as file:
            file.write(code)
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
        hidden_dirs, hidden_files = _hidden_paths()
        masks = [mask for mask, _ in exposures or []] if uid is not None else []
        import_paths = _interpreter_paths()
        kept = import_paths + [p for p in _prefix_paths(hidden_dirs) if p not in import_paths]
        settings = {
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
            process = subprocess.Popen(
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
        if timed_out or returncode == -signal.SIGALRM:
            stderr += f"\n[hyflow sandbox] killed after the wall-clock limit of {timeout_s:g} s"
        elif status == "timeout":
            stderr += f"\n[hyflow sandbox] killed after the CPU-time limit of {cpu_limit_s:g} s"
        if truncated:
            stderr += f"\n[hyflow sandbox] output reached the limit of {max_output_bytes} bytes"
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


# Run inside the sandbox by `sandbox_guarantees`: tries what each guarantee forbids (or reads the kernel state
# that enforces it) and prints {guarantee: held} as a literal. _P is the parent's settings, a literal.
_GUARANTEE_PROBE = r'''
import ctypes, hashlib, os, resource
_P = PROBE_SETTINGS

def _fails(action):
    try:
        action()
    except OSError:
        return True
    return False

def _read(path):
    with open(path, "rb") as file:
        return file.read()

def _fork_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    caps = [line for line in _read("/proc/self/status").splitlines() if line.startswith(b"CapEff:")]
    return soft != resource.RLIM_INFINITY and hard != resource.RLIM_INFINITY and int(caps[0].split()[1], 16) == 0

def _outlives():  # a PID namespace whose init is the sandbox's own, or a uid of its own to kill
    try:
        init_is_ours = _P["prelude"].encode() in _read("/proc/1/cmdline")
    except OSError:
        init_is_ours = False
    return init_is_ours or os.getuid() not in (0, _P["uid"])

def _environ_unreadable():  # the same pid may exist in the sandbox's own /proc (e.g. a trainer that is pid 1)
    try:
        content = _read(_P["environ"])
    except OSError:
        return True
    return hashlib.sha256(content).hexdigest() != _P["environ_sha256"]

def _no_sockets():
    libc = ctypes.CDLL(None, use_errno=True)
    for family, kind in ((2, 1), (10, 2), (1, 1), (1, 2), (16, 3)):  # inet, inet6, unix stream/dgram, netlink
        fd = libc.socket(family, kind, 0)
        if fd >= 0:
            os.close(fd)
            return False
    return True

def _readonly():
    scratch = {"/tmp", "/dev/shm", os.getcwd()}
    for line in _read("/proc/self/mountinfo").decode("unicode_escape").splitlines():
        point = line.split()[4]
        try:  # the mount in view at that point (one covered by another is out of reach)
            writable = not os.statvfs(point).f_flag & os.ST_RDONLY
        except OSError:  # under a hidden directory
            continue
        # a mount below a scratch directory is scratch too (a checkout in a 0700 folder under /tmp: covered by the
        # sandbox's own /tmp, its point counted writable)
        if writable and not any(point == d or point.startswith(d.rstrip("/") + "/") for d in scratch):
            return False
    for directory in _P["import_paths"]:
        target = os.path.join(directory, "hyflow_guarantee_probe.pth")
        if not _fails(lambda: os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))):
            os.unlink(target)
            return False
    return True

def _scratch():
    if any(os.path.lexists(marker) for marker in _P["markers"]):
        return False
    for path in ("/tmp", "/dev/shm", os.getcwd()):
        if os.path.isdir(path):
            info = os.statvfs(path)
            if info.f_blocks * info.f_frsize > _P["scratch_bytes"]:
                return False
    return True

def _hidden():
    if any(os.path.lexists(entry) for entry in _P["home_entries"]):
        return False
    return all(_fails(lambda: _read(path)) or _read(path) == b"" for path in _P["hidden_files"])

def _importable():
    for path in _P["import_paths"]:
        if _fails(lambda: os.listdir(path)) or (_P["import_listings"][path] and not os.listdir(path)):
            return False
    return True

held = {}
for name, check in (("fork limit", _fork_limit), ("no process outlives the call", _outlives),
                    ("no sockets", _no_sockets),
                    ("trainer environment unreadable", _environ_unreadable),
                    ("read-only filesystem", _readonly),
                    ("private size-limited /tmp, /dev/shm and working directory", _scratch),
                    ("home directories and credentials hidden", _hidden),
                    ("the interpreter's standard library and site-packages importable", _importable)):
    try:
        held[name] = bool(check())
    except Exception as error:
        print(f"{name}: {type(error).__name__}: {error}", file=__import__("sys").stderr)
        held[name] = False
print(repr(held))
'''


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
        result = run_code(_GUARANTEE_PROBE.replace("PROBE_SETTINGS", repr(settings)), timeout_s=20.0)
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
