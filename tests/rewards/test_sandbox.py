"""Local Python sandbox: status classification, limits, blocked network/processes, clean environment, and the
escapes it must stop (fork bomb, setsid survivor, raw and ctypes sockets, AF_UNIX, the trainer's environ)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from hyflow.rewards import sandbox
from hyflow.rewards.sandbox import SandboxResult, run_code, sandbox_guarantees


def test_ok_program_reads_stdin_and_captures_stdout():
    result = run_code("a, b = map(int, input().split())\nprint(a + b)\nprint('done')", "2 3\n")
    assert isinstance(result, SandboxResult)
    assert (result.status, result.stdout, result.stderr, result.returncode) == ("ok", "5\ndone\n", "", 0)
    assert result.ok and 0 < result.wall_s < 5


def test_stderr_is_captured_separately():
    result = run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (result.stdout, result.stderr) == ("out\n", "err\n")


def test_syntax_error_is_an_error_with_the_message():
    result = run_code("def f(:\n    pass")
    assert result.status == "error" and result.returncode == 1
    assert "SyntaxError" in result.stderr and "solution.py" in result.stderr


def test_exception_traceback_shows_the_solution_line_not_the_prelude():
    result = run_code("x = 1\nraise ValueError('boom')")
    assert result.status == "error"
    assert "line 2" in result.stderr and "ValueError: boom" in result.stderr
    assert "<string>" not in result.stderr


def test_exit_codes():
    assert run_code("import sys\nsys.exit(3)").returncode == 3
    assert run_code("import sys\nsys.exit(3)").status == "error"
    assert run_code("exit(0)").status == "ok"  # exit()/quit() exist although `site` is skipped
    assert run_code("quit(2)").returncode == 2


def test_infinite_loop_times_out_within_bound():
    start = time.monotonic()
    result = run_code("while True:\n    pass", timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert result.status == "timeout" and result.returncode == -9
    assert 0.5 <= result.wall_s < 1.5 and elapsed < 2.0
    assert "wall-clock limit of 0.5 s" in result.stderr


def test_sleeping_program_times_out():
    result = run_code("import time\ntime.sleep(30)", timeout_s=0.3)
    assert result.status == "timeout" and result.wall_s < 1.5


@pytest.mark.slow
def test_cpu_time_limit_kills_with_sigxcpu():
    result = run_code("while True:\n    pass", timeout_s=10, cpu_time_s=1)
    assert result.status == "timeout" and result.returncode == -24  # SIGXCPU
    assert "CPU-time limit of 1 s" in result.stderr and result.wall_s < 5


@pytest.mark.parametrize("hog", ["x = bytearray(2 * 1024**3)", "x = [0] * 10**9", "s = 'a' * (1 << 31)"])
def test_memory_hog_is_a_memory_status(hog):
    result = run_code(hog, memory_mb=256)
    assert result.status == "memory", result.stderr
    assert "MemoryError" in result.stderr


def test_memory_limit_leaves_room_for_normal_programs():
    result = run_code("x = bytearray(50 * 1024**2)\nprint(len(x))", memory_mb=256)
    assert result.status == "ok" and result.stdout == f"{50 * 1024**2}\n"


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.socket()",
        "import socket\nsocket.socket(socket.AF_INET6, socket.SOCK_DGRAM)",
        "import socket\nsocket.create_connection(('127.0.0.1', 9))",
        "import socket\nsocket.getaddrinfo('example.com', 80)",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')",
    ],
)
def test_network_is_blocked(code):
    result = run_code(code)
    assert result.status == "error"
    assert "network access is disabled in the hyflow sandbox" in result.stderr


def test_local_socketpair_and_asyncio_still_work():
    code = textwrap.dedent(
        """
        import asyncio, socket
        a, b = socket.socketpair()
        a.send(b"x")
        async def main():
            return b.recv(1)
        print(asyncio.run(main()))
        """
    )
    result = run_code(code)
    assert result.status == "ok", result.stderr
    assert result.stdout == "b'x'\n"


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('echo hi')",
        "import subprocess\nsubprocess.run(['echo', 'hi'])",
        "import os\nos.fork()",
        "import multiprocessing as mp\np = mp.Process(target=print)\np.start()",
    ],
)
def test_starting_processes_is_blocked(code):
    result = run_code(code)
    assert result.status == "error" and "hi" not in result.stdout
    assert "starting processes is disabled in the hyflow sandbox" in result.stderr


def test_output_is_capped_by_the_kernel():
    result = run_code("while True:\n    print('x' * 1000)", timeout_s=5, max_output_bytes=10_000)
    assert result.status == "error" and result.output_truncated
    assert len(result.stdout) == 10_000 and result.wall_s < 5
    assert "output reached the limit of 10000 bytes" in result.stderr


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    result = run_code("import os\nprint(sorted(os.environ))\nprint(os.getcwd() == os.environ['HOME'])")
    assert "HTTPS_PROXY" not in result.stdout and "SECRET_TOKEN" not in result.stdout
    assert result.stdout.endswith("True\n")


def test_runs_in_a_fresh_directory_that_is_removed():
    result = run_code("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))")
    first = result.stdout.splitlines()
    second = run_code("import os\nprint(os.getcwd())").stdout.splitlines()
    assert first[0] != second[0]
    if "private_scratch" in result.protections:  # a tmpfs of its own that holds only the program
        assert first[1] == "['solution.py']"
    else:  # the host's temporary directory, with the files its standard streams are
        assert first[1] == "['solution.py', 'stderr', 'stdin', 'stdout']"
    assert not os.path.exists(first[0]) and not os.path.exists(second[0])


def test_solution_runs_as_a_real_main_module():
    code = "from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\nimport pickle\nprint(__name__, pickle.loads(pickle.dumps(P(2))))"
    assert run_code(code).stdout == "__main__ P(x=2)\n"


def test_thread_with_large_stack_for_deep_recursion_works():
    code = textwrap.dedent(
        """
        import sys, threading
        sys.setrecursionlimit(10**6)
        threading.stack_size(2**26)
        def depth(n):
            return 0 if n == 0 else 1 + depth(n - 1)
        out = []
        t = threading.Thread(target=lambda: out.append(depth(50_000)))
        t.start(); t.join()
        print(out[0])
        """
    )
    assert run_code(code).stdout == "50000\n"


def test_site_packages_are_importable():
    result = run_code("import numpy\nprint(int(numpy.arange(4).sum()))")
    assert result.status == "ok" and result.stdout == "6\n"


def test_invalid_limits_are_errors():
    with pytest.raises(ValueError, match="run_code needs positive limits, got timeout_s=0"):
        run_code("print(1)", timeout_s=0)


# ---- escapes: each runs the real exploit through run_code and checks that the kernel stopped it ----------


# The escapes below need a channel out of the sandbox (a marker file a surviving process writes on the
# host) to show whether they worked, so they switch off the file-system view ("filesystem": no read-only `/`,
# no private /tmp) that would otherwise stop the marker itself; test_sandbox_isolation.py tests that view.
NO_FILESYSTEM_VIEW = frozenset({"filesystem"})


@pytest.fixture
def open_dir():
    """A directory every uid may write to (the sandbox may run as a fresh uid), removed afterwards."""
    path = tempfile.mkdtemp(prefix="hyflow_sandbox_test_")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _require(guarantee: str) -> None:
    if not sandbox_guarantees()[guarantee]:
        pytest.skip(f"the sandbox cannot guarantee '{guarantee}' on this machine (see the warning it logged)")


def _wait_for(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return os.path.exists(path)


FORK_BOMB = """
import posix, time
forked = 0
for _ in range(200):
    try:
        pid = posix.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        posix._exit(0)
    forked += 1
print(forked)
"""


def test_fork_bomb_is_bounded_by_the_process_limit():
    _require("fork limit")
    result = run_code(FORK_BOMB, timeout_s=5, max_processes=16)
    assert result.status == "ok", result.stderr
    assert 0 <= int(result.stdout) < 16  # the solution process itself counts
    assert result.wall_s < 5  # the sleeping children did not hold the call open


SETSID_ESCAPE = """
import os, posix, time
if posix.fork() == 0:
    os.setsid()
    if posix.fork() == 0:  # a grandchild in its own session, orphaned at once
        for _ in range(200):  # waits (10 s at most) until the test says the call is over, then shows it lives
            if os.path.exists({go!r}):
                open({marker!r}, "w").write("still alive")
                break
            time.sleep(0.05)
    posix._exit(0)
print("parent done")
"""


def _survivor_check(open_dir: str) -> tuple[dict, callable]:
    """Format keys for SETSID_ESCAPE, and a check to call once run_code returned: is the grandchild alive?"""
    go, marker = os.path.join(open_dir, "go"), os.path.join(open_dir, "alive")

    def survived() -> bool:
        open(go, "w").close()
        return _wait_for(marker, 0.5)

    return {"go": go, "marker": marker}, survived


@pytest.mark.parametrize("disabled", [frozenset(), frozenset({"namespaces"})], ids=["strongest", "no-namespaces"])
def test_setsid_grandchild_does_not_outlive_the_call(open_dir, monkeypatch, disabled):
    monkeypatch.setattr(sandbox, "_DISABLED_MECHANISMS", disabled | NO_FILESYSTEM_VIEW)
    if not disabled:
        _require("no process outlives the call")
    keys, survived = _survivor_check(open_dir)
    result = run_code(SETSID_ESCAPE.format(**keys), timeout_s=5)
    assert (result.status, result.stdout) == ("ok", "parent done\n"), result.stderr
    assert result.wall_s < 4  # returned when the solution ended, without waiting for the grandchild
    assert not survived(), "a process started by the solution was still running after the call"


def test_wall_clock_kill_takes_the_descendants_too(open_dir, monkeypatch):
    _require("no process outlives the call")
    monkeypatch.setattr(sandbox, "_DISABLED_MECHANISMS", NO_FILESYSTEM_VIEW)
    keys, survived = _survivor_check(open_dir)
    code = SETSID_ESCAPE.format(**keys).replace('print("parent done")', "time.sleep(30)")
    result = run_code(code, timeout_s=0.3)
    assert result.status == "timeout"
    assert not survived()


@pytest.fixture
def loopback_listener():
    """A TCP listener on 127.0.0.1 in the test process; yields (port, accepted(): did anyone connect?)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.3)

    def accepted() -> bool:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            return False
        connection.close()
        return True

    yield listener.getsockname()[1], accepted
    listener.close()


MRO_SOCKET = """
import _socket
raw_socket = _socket.socket.__mro__[-2]  # the C socket type, under the sandbox's Python-level guard if any
s = raw_socket(_socket.AF_INET, _socket.SOCK_STREAM)
s.connect(("127.0.0.1", {port}))
s.send(b"escaped")
print("connected")
"""

CTYPES_SOCKET = """
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
address = struct.pack("=H", 2) + struct.pack(">H", {port}) + bytes([127, 0, 0, 1]) + bytes(8)  # sockaddr_in
connected = fd >= 0 and libc.connect(fd, address, len(address)) == 0
print("connected" if connected else f"refused: fd={{fd}} errno={{ctypes.get_errno()}}")
"""


@pytest.mark.parametrize("exploit", [MRO_SOCKET, CTYPES_SOCKET], ids=["mro-base-class", "ctypes"])
def test_inet_socket_cannot_reach_a_loopback_listener(loopback_listener, exploit):
    _require("no sockets")
    port, accepted = loopback_listener
    code = exploit.format(port=port)
    control = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert accepted(), f"the exploit does not work even unsandboxed: {control.stderr}"  # it is a real exploit
    result = run_code(code)
    assert not accepted()
    assert "connected" not in result.stdout
    if exploit is MRO_SOCKET:
        assert result.status == "error" and "PermissionError" in result.stderr
    else:  # returned normally, and the kernel refused to create the socket
        assert result.status == "ok" and result.stdout.startswith("refused: fd=-1 errno=1"), result.stderr


def test_unix_socket_cannot_reach_a_listener(open_dir):
    _require("no sockets")
    path = os.path.join(open_dir, "listener.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.listen(8)
    listener.settimeout(0.3)

    def accepted() -> bool:
        try:
            listener.accept()[0].close()
            return True
        except TimeoutError:
            return False

    code = (
        "import _socket\n"
        "s = _socket.socket.__mro__[-2](_socket.AF_UNIX, _socket.SOCK_STREAM)\n"
        f"s.connect({path!r})\n"
        "print('connected')\n"
    )
    try:
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
        assert accepted(), "the exploit does not work even unsandboxed"
        result = run_code(code)
        assert not accepted()
        assert result.status == "error" and "connected" not in result.stdout
        assert "PermissionError" in result.stderr
    finally:
        listener.close()


ENVIRON_EXPLOIT = """
import os
def read(pid):
    try:
        return open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError as error:
        return f"<{error.__class__.__name__}>"
found = []
pid = os.getppid()
while pid > 1:  # $PPID and every ancestor
    found.append(read(pid))
    try:
        pid = int(next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("PPid:")))
    except (OSError, StopIteration):
        break
found += [read(name) for name in os.listdir("/proc") if name.isdigit()]  # and every process in sight
print("\\n".join(found))
"""


def test_trainer_environment_is_not_readable_from_proc():
    _require("trainer environment unreadable")
    secret = f"hunter2-{os.getpid()}-{time.time_ns()}"
    trainer = (
        "import subprocess, sys\n"
        "from hyflow.rewards.sandbox import run_code\n"
        f"exploit = {ENVIRON_EXPLOIT!r}\n"
        "control = subprocess.run([sys.executable, '-c', exploit], capture_output=True, text=True).stdout\n"
        "print('CONTROL', 'SECRET_TOKEN=' + sys.argv[1] in control)\n"
        "result = run_code(exploit)\n"
        "print('STATUS', result.status)\n"
        "print(result.stdout)\n"
    )
    env = dict(os.environ, SECRET_TOKEN=secret)  # in the trainer's exec environment: /proc/PID/environ shows it
    output = subprocess.run(
        [sys.executable, "-c", trainer, secret], env=env, capture_output=True, text=True, timeout=60
    ).stdout
    assert "CONTROL True" in output  # the exploit reads the secret when it is not sandboxed
    assert "STATUS ok" in output
    assert secret not in output.split("STATUS ok", 1)[1]


@pytest.mark.slow
def test_nothing_survives_when_the_trainer_dies(open_dir, tmp_path):
    started, go, late = (os.path.join(open_dir, name) for name in ("started", "go", "late"))
    solution = (
        f"import os, time\nopen({started!r}, 'w').close()\n"
        f"for _ in range(200):\n    if os.path.exists({go!r}):\n        open({late!r}, 'w').close()\n        break\n"
        "    time.sleep(0.05)\n"
    )
    trainer = (
        f"from hyflow.rewards import sandbox\nsandbox._DISABLED_MECHANISMS = {NO_FILESYSTEM_VIEW!r}\n"
        f"sandbox.run_code({solution!r}, timeout_s=1)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))  # a temporary directory under a 0700 parent, too
    process = subprocess.Popen([sys.executable, "-c", trainer], env=env)
    try:
        assert _wait_for(started, 10), "the sandboxed solution never started"
        process.kill()  # the wall-clock kill in run_code never happens now
        process.wait()
        time.sleep(1.5)  # past the solution's 1 s wall clock
        open(go, "w").close()
        assert not _wait_for(late, 0.5), "the orphaned solution outlived its wall-clock limit"
    finally:
        process.kill()
        process.wait()


def test_a_missing_guarantee_is_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_DISABLED_MECHANISMS", frozenset({"namespaces", "separate_uid", "seccomp"}))
    monkeypatch.setattr(sandbox, "_warned_missing", set())
    with caplog.at_level(logging.WARNING, logger="hyflow.rewards.sandbox"):
        first = run_code("print(1)")
        second = run_code("print(2)")
    assert (first.stdout, second.stdout) == ("1\n", "2\n")
    assert "seccomp" not in first.protections and "pid_namespace" not in first.protections
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1
    assert "do NOT hold on this machine" in warnings[0] and "no sockets" in warnings[0]


def test_protections_on_a_capable_machine_are_all_reported():
    protections = run_code("pass").protections
    if os.geteuid() == 0 and "pid_namespace" in protections:
        assert {"net_namespace", "private_proc", "seccomp", "readonly_root", "private_scratch", "hidden_home"} <= protections
        if "separate_uid" in protections:
            assert "fork_limit" in protections
    assert sandbox_guarantees().keys() == sandbox.GUARANTEES.keys()


def test_an_interpreter_under_tmp_stays_importable_and_read_only(monkeypatch):
    """A venv in a checkout under /tmp (as CI's clone may be): the sandbox's private /tmp must not hide the
    site-packages the solution imports from; they are bound back into it, read-only. Failed before: every
    solution importing from such a venv ended 'error' (ModuleNotFoundError behind the fresh tmpfs)."""
    from pathlib import Path

    from hyflow.rewards import sandbox

    top = Path(tempfile.mkdtemp(prefix="hyflow_site_", dir="/tmp"))
    try:
        os.chmod(top, 0o755)  # the sandbox may run as a fresh uid
        site = top / "site-packages"
        site.mkdir(mode=0o755)
        (site / "hyflow_probe_module.py").write_text("VALUE = 42\n")
        os.chmod(site / "hyflow_probe_module.py", 0o644)
        monkeypatch.setattr(sandbox, "_SITE_PACKAGES", [*sandbox._SITE_PACKAGES, str(site)])
        result = run_code("import hyflow_probe_module\nprint(hyflow_probe_module.VALUE)")
        assert result.status == "ok" and result.stdout == "42\n", result
        result = run_code(f"open({str(site / 'planted.py')!r}, 'w').write('x')\nprint('wrote')")
        assert "wrote" not in result.stdout and not (site / "planted.py").exists()
    finally:
        shutil.rmtree(top, ignore_errors=True)
