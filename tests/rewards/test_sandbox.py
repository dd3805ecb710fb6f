"""Local Python sandbox: status classification, limits, blocked network/processes, clean environment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hyflow.rewards.sandbox import SandboxResult, run_code


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
    first = run_code("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))").stdout.splitlines()
    second = run_code("import os\nprint(os.getcwd())").stdout.splitlines()
    assert first[0] != second[0]
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


@pytest.mark.slow
def test_child_destroys_itself_when_the_parent_dies(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent_code = (
        "from hyflow.rewards.sandbox import run_code\n"
        f"run_code(\"import os, time\\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\\ntime.sleep(60)\", "
        "timeout_s=1)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=env)
    deadline = time.monotonic() + 5
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the sandboxed child never started"
        time.sleep(0.05)
    parent.kill()  # the wall-clock kill in run_code never happens now
    parent.wait()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 6  # alarm(ceil(1) + 2) = 3 s after the child started
    while os.path.exists(f"/proc/{child}") and "Z" not in _proc_state(child):
        assert time.monotonic() < deadline, "the orphaned sandbox child is still running"
        time.sleep(0.1)


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
