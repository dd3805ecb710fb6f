"""benchmarks/bench_rollout.py runs end to end with all three paths (crash check only: no timing
assertions) and rejects bad options before it loads vLLM (that test runs in the main venv too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rollout.py"
SMALLEST = ["--presets", "tiny", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4", "--rounds", "1"]


def run_script(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.vllm
@pytest.mark.slow
def test_three_paths_run_and_write_json(tmp_path):
    out = tmp_path / "result.json"
    proc = run_script(*SMALLEST, "--require-vllm", "--workdir", str(tmp_path / "work"), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    paths = report["results"]["tiny"]["paths"]
    assert set(paths) == {"hf", "vllm", "transformers"}
    for name, summary in paths.items():
        assert len(summary["rounds"]) == 1, name
        assert summary["median_tokens_per_s"] > 0, name
        assert 0 < summary["median_tokens"] <= 2 * 2 * 4, name
    assert set(report["results"]["tiny"]["ratios"]) == {"vllm/hf", "vllm/transformers", "hf/transformers"}
    assert report["machine"]["vllm"] and report["machine"]["torch_threads"] >= 1
    assert report["vllm_problem"] is None
    assert "vllm/transformers" in proc.stdout  # the printed table names the ratios


@pytest.mark.parametrize(("argv", "message"), [
    (["--presets", "nope"], "valid presets: "),
    (["--presets", "tiny,huge"], "'huge'"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--samples", "0"], "--samples must be >= 1"),
])
def test_bad_options_exit_nonzero_before_vllm_loads(argv, message):
    proc = run_script(*argv, "--require-vllm", timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    if argv[0] == "--presets":
        assert all(name in proc.stderr for name in ("tiny", "small", "qwen2.5-0.5b-shape"))
    assert "vLLM" not in proc.stderr and "vllm" not in proc.stderr.replace("--require-vllm", "")
