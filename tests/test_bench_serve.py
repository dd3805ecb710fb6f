"""benchmarks/bench_serve.py runs end to end (a crash check: no timing assertions)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serve.py"


@pytest.mark.slow
def test_the_three_modes_run_and_the_report_has_the_ratios(tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--batch", "2", "--tokens", "16",
                           "--steps", "1", "--rounds", "1", "--clients", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| service (tinker SDK, 1 client) |" in proc.stdout and "service / in process" in proc.stdout
    report = json.loads(out.read_text())
    assert report["service_over_in_process"] > 0 and report["clients_aggregate_over_one"] > 0
    assert set(report["rounds"]) == {"in_process", "service", "clients"} and report["machine"]["cores"]
