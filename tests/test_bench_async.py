"""benchmarks/bench_async.py runs end to end in its smallest setting (crash check only: no timing assertions): the
three modes each train a few steps on two Ray worker processes, and the table and the JSON name them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_async.py"
MODES = ("sync", "one_step_off", "fully_async")


def run_until_done(cmd: list[str], env: dict, workdir: Path) -> subprocess.CompletedProcess:
    """Run the benchmark with no wall-clock limit of its own: on a loaded 2-core machine its three Ray runs took
    past the 300 s this test once allowed, with nothing to say where the time went. The suite's per-test limit
    (pyproject's `timeout`) bounds it; if it fires, or the test fails otherwise, the benchmark's process group is
    ended (each mode runs in a grandchild process with Ray workers) and each mode's log tail is shown."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        logs = "".join(f"\n--- {log.name} (end) ---\n{log.read_text()[-1500:]}" for log in sorted(workdir.glob("*.log")))
        print(f"benchmarks/bench_async.py stopped before it finished; its modes' logs:{logs}")
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_quick_setting_reports_the_three_modes(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = run_until_done([sys.executable, str(SCRIPT), "--quick", "--workdir", str(tmp_path / "work"),
                           "--json", str(out)], env, tmp_path / "work")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    stdout = proc.stdout
    assert "async benchmark: preset=tiny SFT steps=0" in stdout
    assert "samples/s" in stdout and "time to target" in stdout and "CPUs" in stdout and "torch" in stdout
    table = stdout.split("-" * 20, 1)[1]
    for mode in MODES:
        assert f"\n{mode} " in table
    report = json.loads(out.read_text())
    assert [s["mode"] for s in report["summaries"]] == list(MODES)
    assert report["machine"]["cores"] and report["machine"]["torch"]
    for summary in report["summaries"]:
        assert summary["steps"] == 3 and summary["measured_steps"] == 2
        assert summary["samples_per_s"] > 0
        assert "time_to_target_s" in summary  # reported (None: a random model never reaches the target)
    by_mode = {s["mode"]: s for s in report["summaries"]}
    assert by_mode["sync"]["staleness_mean"] is None  # no async metrics in the synchronous mode
    assert by_mode["one_step_off"]["staleness_max"] == 1  # every sample one version old after step 1
    assert by_mode["fully_async"]["staleness_max"] <= 1  # max_staleness=1, stale_policy=wait
