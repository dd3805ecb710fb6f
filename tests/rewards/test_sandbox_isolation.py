"""The sandbox's file-system and IPC isolation, run for real as root and as an ordinary user.

Each test runs the same probe twice as the same identity: unsandboxed (the control: the write, read or
delivery works, so the probe is a real attack) and through `run_code` (it must not). The "user" identity is a
real unprivileged uid: when the test process is root it forks a launcher that drops to uid/gid 65534 (after
exposing the interpreter, if it lives in a directory others may not search, the way the sandbox does for its
own fresh uid); when the test process is not root, it is that user already. Targets live under /var/tmp,
outside every directory the sandbox replaces (/tmp, /dev/shm, the homes), so what stops a write there is the
read-only `/` and nothing else.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from hyflow.rewards import sandbox

REPO = Path(__file__).resolve().parents[2]
USER_UID = USER_GID = 65534  # "nobody": an unprivileged uid that owns nothing of the test's

# Runs as root: a private mount namespace that re-exposes the interpreter's directories (only when some are
# closed to others, e.g. a pyenv under a 0700 /root), then drops to the uid and execs the command.
LAUNCHER = r"""
import ctypes, os, sys
uid, gid, plan = int(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")
if plan:
    if libc.unshare(0x20000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, 16384 | (1 << 18))  # MS_REC | MS_PRIVATE
    for mask, paths in plan:
        fds = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in paths]
        mount("tmpfs", mask, "tmpfs", 2 | 4, "mode=755,size=64k")
        for path, fd in fds:
            os.makedirs(path, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, None, 4096 | 16384)  # MS_BIND | MS_REC
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
os.execv(sys.argv[4], sys.argv[4:])
"""

# Calls run_code in the identity's own process and prints the result as JSON.
DRIVER = r"""
import json, sys
from hyflow.rewards import sandbox
sandbox._DISABLED_MECHANISMS = frozenset(json.loads(sys.argv[2]))
result = sandbox.run_code(sys.argv[1], **json.loads(sys.argv[3]))
print(json.dumps({"status": result.status, "stdout": result.stdout, "stderr": result.stderr,
                  "protections": sorted(result.protections), "guarantees": sandbox.sandbox_guarantees()}))
"""


@dataclass(frozen=True)
class Identity:
    """Who runs hyflow: its uid/gid and the command prefix that runs a program as it."""

    name: str
    uid: int
    gid: int
    prefix: tuple[str, ...]

    def python(self, args: list[str], env: dict[str, str], cwd: str | Path = "/") -> subprocess.CompletedProcess:
        """Run this interpreter with `args` as this identity, in `cwd` with exactly `env`."""
        return subprocess.run(
            [*self.prefix, sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
        )

    def unsandboxed(self, code: str, env: dict[str, str], cwd: str | Path = "/") -> str:
        """The control: `code` run as this identity without the sandbox; its stdout."""
        process = self.python(["-c", code], env, cwd)
        assert process.returncode == 0, f"the control probe failed as {self.name}: {process.stderr}"
        return process.stdout

    def sandboxed(self, code: str, env: dict[str, str], disabled: tuple[str, ...] = (), **kwargs) -> dict:
        """`code` through run_code called by this identity: status, stdout, stderr, protections, guarantees."""
        process = self.python(["-c", DRIVER, code, json.dumps(list(disabled)), json.dumps(kwargs)], env)
        assert process.returncode == 0, f"run_code itself failed as {self.name}: {process.stderr}"
        return json.loads(process.stdout)


def _interpreter_exposures() -> list[tuple[str, list[str]]] | None:
    """The directories to re-expose for another uid (see `sandbox._exposures`); None when impossible."""
    needed = [*sandbox._interpreter_paths(), *(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, REPO))]
    return sandbox._exposures(needed, "/tmp/hyflow")


@pytest.fixture(params=["root", "user"])
def who(request) -> Identity:
    if request.param == "root":
        if os.geteuid() != 0:
            pytest.skip("the test process is not root: hyflow's root mode cannot be exercised here")
        return Identity("root", 0, 0, ())
    if os.geteuid() != 0:  # an ordinary user already
        return Identity(f"user {os.getuid()}", os.getuid(), os.getgid(), ())
    plan = _interpreter_exposures()
    if plan is None:
        pytest.skip(
            "the interpreter or the checkout is itself closed to other users, so no unprivileged uid can run "
            "it: run the tests as a non-root user, or from a checkout and interpreter others may read"
        )
    launcher = (sys.executable, "-c", LAUNCHER, str(USER_UID), str(USER_GID), repr(plan))
    return Identity(f"uid {USER_UID}", USER_UID, USER_GID, launcher)


@dataclass(frozen=True)
class Victim:
    """Files of the identity that run outside the sandbox later, and its secrets, under /var/tmp."""

    root: Path
    home: Path
    writable: tuple[Path, ...]
    secrets: dict[Path, str]
    token_file: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8", **extra}


@pytest.fixture
def victim(who) -> Victim:
    """A home (.bashrc, .netrc, ssh key, Hugging Face token), a site-packages directory on the identity's
    path, a run directory with the reward file, and a token file outside the home, all owned by the identity.
    For root every entry is also open to all (0777/0666): the sandbox's fresh uid could write and read them,
    so only the sandbox's own file-system view stops it."""
    if not os.path.isdir("/var/tmp"):
        pytest.skip("/var/tmp does not exist: no place outside /tmp and the homes to put the targets")
    root = Path(tempfile.mkdtemp(prefix="hyflow_isolation_", dir="/var/tmp"))
    tag = uuid.uuid4().hex
    home = root / "home"
    files = {
        home / ".bashrc": "# the user's shell start-up\n",
        home / ".netrc": f"machine api.wandb.ai login user password netrc-{tag}\n",
        home / ".ssh" / "id_ed25519": f"ssh-key-{tag}\n",
        home / ".cache" / "huggingface" / "token": f"hf_home_token_{tag}\n",
        root / "site-packages" / "existing.pth": "\n",
        root / "run" / "reward.py": "def compute_score(*args):\n    return 0.0\n",
        root / "run" / "metrics.jsonl": "",
        root / "hf_token_path": f"hf_path_token_{tag}\n",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for path in [root, *root.rglob("*")]:
        if os.geteuid() == 0:
            os.chown(path, who.uid, who.gid)
        if who.uid == 0:
            path.chmod(0o777 if path.is_dir() else 0o666)
    writable = (
        home / ".bashrc",
        root / "site-packages" / "sitecustomize.py",
        root / "site-packages" / "evil.pth",
        root / "run" / "reward.py",
        root / "run" / "metrics.jsonl",
    )
    secrets = {path: text.strip() for path, text in files.items() if tag in text}
    yield Victim(root, home, writable, secrets, root / "hf_token_path")
    shutil.rmtree(root, ignore_errors=True)


WRITE_PROBE = """
import errno
for path in {paths!r}:
    try:
        with open(path, "a") as file:
            file.write("import os  # written by the sandboxed program\\n")
        print("WROTE", path)
    except OSError as error:
        print("REFUSED", path, errno.errorcode[error.errno])
"""


def _contents(paths) -> dict[Path, str | None]:
    return {path: path.read_text() if path.exists() else None for path in paths}


@pytest.mark.parametrize("remount", ["mount_setattr", "one mount at a time"])
def test_files_that_run_outside_the_sandbox_cannot_be_written(who, victim, remount):
    code = WRITE_PROBE.format(paths=[str(path) for path in victim.writable])
    wrote = who.unsandboxed(code, victim.env())
    assert wrote.count("WROTE") == len(victim.writable), wrote  # the targets are writable by this identity
    before = _contents(victim.writable)
    disabled = ("mount_setattr",) if remount != "mount_setattr" else ()
    result = who.sandboxed(code, victim.env(), disabled=disabled)
    assert result["status"] == "ok", result["stderr"]
    assert "WROTE" not in result["stdout"], f"the sandboxed program wrote outside its scratch space:\n{result}"
    assert result["stdout"].count("REFUSED") == len(victim.writable)
    assert "EROFS" in result["stdout"]  # outside the hidden home: refused by the read-only `/` itself
    assert _contents(victim.writable) == before
    assert {"readonly_root", "hidden_home"} <= set(result["protections"])


READ_PROBE = """
import os
for path in {paths!r}:
    try:
        print("READ", path, open(path).read().strip())
    except OSError as error:
        print("UNREADABLE", path, error.__class__.__name__)
    try:
        print("LISTED", os.path.dirname(path), os.listdir(os.path.dirname(path)))
    except OSError as error:
        print("UNLISTABLE", os.path.dirname(path), error.__class__.__name__)
print("ENV", dict(os.environ))
"""


def test_home_and_credentials_cannot_be_read(who, victim):
    token = f"hf_env_token_{uuid.uuid4().hex}"
    env = victim.env(HF_TOKEN=token, HF_TOKEN_PATH=str(victim.token_file))
    code = READ_PROBE.format(paths=[str(path) for path in victim.secrets])
    control = who.unsandboxed(code, env)
    for secret in [token, *victim.secrets.values()]:
        assert secret in control, f"the control cannot read {secret!r}: the probe proves nothing"
    result = who.sandboxed(code, env)
    assert result["status"] == "ok", result["stderr"]
    output = result["stdout"] + result["stderr"]
    leaked = [secret for secret in [token, *victim.secrets.values()] if secret in output]
    assert not leaked, f"the sandboxed program read {leaked}:\n{output}"
    read = [line for line in result["stdout"].splitlines() if line.startswith("READ ")]
    assert all(len(line.split()) == 2 for line in read), read  # a credential file reads as empty, if at all
    assert "hidden_home" in result["protections"]


SCRATCH_PROBE = """
import errno, os
for directory in ("/dev/shm", "/tmp", os.getcwd()):
    with open(os.path.join(directory, {name!r}), "w") as file:
        file.write("left behind")
    print("WROTE", directory)
if {fill}:
    written = 0
    try:
        for index in range(100_000):  # 25 GB unless something stops it
            with open(f"/dev/shm/{name}-fill{{index}}", "wb") as file:
                file.write(bytes(256 * 1024))
            written += 256 * 1024
        print("FILLED", written)
    except OSError as error:
        print("FULL", written, errno.errorcode[error.errno])
"""


def test_scratch_space_is_private_bounded_and_gone_after_the_call(who, victim):
    name = f"hyflow_isolation_{uuid.uuid4().hex}"
    leftovers = [Path("/dev/shm") / name, Path("/tmp") / name]
    try:
        control = who.unsandboxed(SCRATCH_PROBE.format(name=name, fill=False), victim.env(), victim.root / "run")
        assert control.count("WROTE") == 3
        assert all(path.exists() for path in leftovers), "unsandboxed, the files stay: the probe is real"
    finally:
        for path in leftovers:
            path.unlink(missing_ok=True)
    result = who.sandboxed(SCRATCH_PROBE.format(name=name, fill=True), victim.env(), scratch_mb=2)
    assert result["status"] == "ok", result["stderr"]
    assert result["stdout"].count("WROTE") == 3  # /dev/shm, /tmp and the working directory are writable
    full = next(line.split() for line in result["stdout"].splitlines() if line.startswith(("FULL", "FILLED")))
    assert full[0] == "FULL" and full[2] == "ENOSPC" and int(full[1]) <= 2 * 1024 * 1024, full
    survivors = sorted({path for path in [*leftovers, *Path("/dev/shm").glob(name + "*")] if path.exists()})
    for path in survivors:
        path.unlink()
    assert not survivors, f"files written in the sandbox outlived the call: {survivors}"
    assert "private_scratch" in result["protections"]


DATAGRAM_PROBE = """
import ctypes, socket, struct
path = {path!r}
for name, run in [
    ("sendto", lambda a: a.sendto(b"sendto", path)),
    ("connect", lambda a: (a.connect(path), a.send(b"connect"))),
]:
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        run(a)
        print("SENT", name)
    except OSError as error:
        print("REFUSED", name, error)
libc = ctypes.CDLL(None, use_errno=True)  # the same without Python: only the kernel can refuse it
fds = (ctypes.c_int * 2)()
address = struct.pack("=H", socket.AF_UNIX) + path.encode() + bytes(1)
if libc.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM, 0, fds) == 0:
    sent = libc.sendto(fds[0], b"ctypes", 6, 0, address, len(address))
    print("SENT ctypes" if sent == 6 else f"REFUSED ctypes sendto errno={{ctypes.get_errno()}}")
else:
    print("REFUSED ctypes socketpair errno", ctypes.get_errno())
stream, _ = socket.socketpair()  # the allowed pair (asyncio's): connected, it cannot be pointed elsewhere
for name, run in [("stream sendto", lambda: stream.sendto(b"stream", path)), ("stream connect", lambda: stream.connect(path))]:
    try:
        run()
        print("SENT", name)
    except OSError as error:
        print("REFUSED", name, error)
"""


@pytest.fixture
def datagram_receiver():
    """A 0666 unix datagram socket outside /tmp; yields (path, received(): the datagrams that arrived)."""
    directory = tempfile.mkdtemp(prefix="hyflow_isolation_dgram_", dir="/var/tmp")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "receiver.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    os.chmod(path, 0o666)
    receiver.setblocking(False)

    def received() -> list[bytes]:  # unix datagrams are queued by the sender's call itself: no waiting needed
        datagrams = []
        while True:
            try:
                datagrams.append(receiver.recv(100))
            except BlockingIOError:
                return datagrams

    yield path, received
    receiver.close()
    shutil.rmtree(directory, ignore_errors=True)


def test_unix_datagrams_do_not_leave_the_sandbox(who, victim, datagram_receiver):
    path, received = datagram_receiver
    code = DATAGRAM_PROBE.format(path=path)
    control = who.unsandboxed(code, victim.env())
    assert sorted(received()) == [b"connect", b"ctypes", b"sendto"], control  # delivered without the sandbox
    result = who.sandboxed(code, victim.env())
    assert result["status"] == "ok", result["stderr"]
    assert received() == [], f"datagrams left the sandbox:\n{result['stdout']}"
    assert "SENT" not in result["stdout"], result["stdout"]
    assert "seccomp" in result["protections"]


def test_asyncio_and_stream_pairs_still_work(who, victim):
    code = textwrap.dedent(
        """
        import asyncio, socket
        a, b = socket.socketpair()
        a.send(b"x")
        print(asyncio.run(asyncio.sleep(0, result=b.recv(1))))
        """
    )
    result = who.sandboxed(code, victim.env())
    assert (result["status"], result["stdout"]) == ("ok", "b'x'\n"), result["stderr"]


# What the machine supports, probed independently of the sandbox: the same namespaces (a user namespace
# mapping only the caller's uid when not root), a tmpfs, a recursive read-only remount, a seccomp filter.
CAPABILITY_PROBE = r"""
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
def check(result, what):
    if result != 0:
        print("INCAPABLE", what, os.strerror(ctypes.get_errno()), flush=True)
        os._exit(0)
uid, gid = os.getuid(), os.getgid()
check(libc.unshare(0x20000 | 0x08000000 | 0x20000000 | 0x40000000 | (0 if uid == 0 else 0x10000000)),
      "unshare")
if uid != 0:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)
child = os.fork()
if child == 0:  # pid 1 of the new PID namespace
    check(libc.mount(None, b"/", None, ctypes.c_ulong(16384 | (1 << 18)), None), "mount --make-rprivate /")
    check(libc.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(2 | 4 | 8), None), "mount proc")
    check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", ctypes.c_ulong(2 | 4 | 8), b"size=1m"), "mount tmpfs")
    attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)
    result = libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), b"/", ctypes.c_long(0x8000),
                          ctypes.byref(attr), ctypes.c_long(32))
    check(result, "mount_setattr(MOUNT_ATTR_RDONLY, AT_RECURSIVE)")
    check(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    code = struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000)  # one instruction: allow
    buffer = ctypes.create_string_buffer(code)
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    check(libc.prctl(22, 2, ctypes.byref(Prog(1, ctypes.addressof(buffer))), 0, 0), "seccomp filter")
    print("CAPABLE", flush=True)
    os._exit(0)
os.waitpid(child, 0)
"""


def test_the_sandbox_uses_the_strongest_mode_this_machine_supports(who, victim):
    """CI must not pass on a silently weaker sandbox: where the kernel lets this identity do everything the
    strongest mode needs, every guarantee must hold; where it does not, the sandbox must say so."""
    probe = who.unsandboxed(CAPABILITY_PROBE, victim.env())
    guarantees = who.sandboxed("pass", victim.env())["guarantees"]
    assert guarantees.keys() == sandbox.GUARANTEES.keys()
    if "CAPABLE" in probe.split() and platform.machine() in ("x86_64", "aarch64"):
        missing = [name for name, held in guarantees.items() if not held]
        assert not missing, f"the machine supports the strongest sandbox for {who.name}, yet {missing} do not hold"
    else:
        assert not all(guarantees.values()), f"the machine lacks {probe.strip()}, yet every guarantee is reported"
