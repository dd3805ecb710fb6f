"""benchmarks/bench_grpo.py's contended case and thread options: the busy processes it starts are pinned and
killed by their PIDs, the thread choice is printed, bad values are named (crash checks: no timing assertions)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_grpo.py"
SMALLEST = ["--prompts", "2", "--group", "2", "--max-new-tokens", "4", "--steps", "1", "--warmup", "0",
            "--rounds", "1"]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_grpo_threads", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_busy_processes_are_pinned_and_killed_by_pid():
    bench = load_bench()
    busy = bench.start_busy_processes(1)
    try:
        (proc, core), = busy
        assert alive(proc.pid) and proc.poll() is None
        assert core == max(os.sched_getaffinity(0))
        assert os.sched_getaffinity(proc.pid) == {core}
    finally:
        bench.stop_busy_processes(busy)
    assert proc.returncode is not None and not alive(proc.pid)


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "many"], "--threads must be a number or auto"),
    (["--threads", "-2"], "--threads must be >= 0"),
    (["--contended", "-1"], "--contended must be >= 0"),
    (["--skip-trl", "--skip-hyflow"], "leave nothing to run"),
])
def test_bad_options_are_named(argv, message, capsys):
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_contended_run_prints_the_thread_choice_and_leaves_no_busy_process(tmp_path):
    out = tmp_path / "result.json"
    # as from a shell: not the OMP_WAIT_POLICY this test process got from importing hyflow
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "HYFLOW_NUM_THREADS", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMALLEST, "--skip-trl", "--contended", "1", "--threads",
                           "auto", "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    cores = len(os.sched_getaffinity(0))
    assert f"threads: torch threads: {cores} ({cores} core" in proc.stdout
    assert "idle threads sleep: OMP_WAIT_POLICY=PASSIVE" in proc.stdout
    contended = report["machine"]["contended"]
    assert contended.startswith("1 busy process(es), pid/core ")
    pid = int(contended.rsplit(" ", 1)[1].split("/")[0])
    assert not alive(pid)
    assert report["summaries"]["hyflow"]["measured_steps"] == 1
    log = (tmp_path / "work" / "run-hyflow-0.log").read_text()
    assert f"torch threads: {cores} (" in log  # the trainer's own start line, same rule
