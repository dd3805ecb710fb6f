"""benchmarks/bench_grpo.py runs end to end (crash check only: no timing assertions) and rejects bad options."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_grpo.py"
SMALLEST = ["--prompts", "2", "--group", "2", "--max-new-tokens", "4", "--steps", "1", "--warmup", "1",
            "--threads", "1", "--rounds", "1"]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_grpo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_script(tmp_path, *extra):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMALLEST, "--workdir", str(tmp_path / "work"),
                           "--json", str(out), *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_hyflow_only_run_prints_the_table_and_writes_json(tmp_path):
    stdout, report = run_script(tmp_path, "--skip-trl")
    assert "GRPO benchmark: preset=tiny P=2 G=2 T=4" in stdout
    assert "hyflow" in stdout and "ratio" not in stdout
    summary = report["summaries"]["hyflow"]
    assert summary["measured_steps"] == 1
    assert summary["step_s_median"] > 0 and summary["gen_tokens_per_step"] > 0
    assert set(report["summaries"]) == {"hyflow"}
    assert (tmp_path / "work" / "run-hyflow-0.log").exists()  # the library's own output went to a file


@pytest.mark.slow
def test_side_by_side_run_with_trl_reports_a_ratio(tmp_path):
    """The real TRL GRPOTrainer (hyflow[bench], installed by `make venv` at the lock's version), smallest run."""
    import trl

    stdout, report = run_script(tmp_path, "--rounds", "2")
    assert "ratio hyflow/TRL steps per second" in stdout
    assert report["summaries"]["trl"]["measured_steps"] == 2  # one measured step per round
    assert len(report["per_round_ratio"]) == 2 and report["ratio_steps_per_s"] > 0
    assert report["summaries"]["trl"]["gen_tokens_per_step"] > 0
    assert report["machine"]["trl"] == trl.__version__


def test_trl_reward_wraps_the_arithmetic_scorer():
    bench = load_bench()
    completions = [[{"role": "assistant", "content": "2 + 3 = 5\n#### 5"}], [{"role": "assistant", "content": "6"}]]
    assert bench.trl_arithmetic_reward(prompts=[None, None], completions=completions,
                                       ground_truth=["5", "6"]) == [1.0, 0.0]
    assert bench.trl_arithmetic_reward(prompts=[None], completions=["#### -3"], ground_truth=["-3"]) == [1.0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--group", "1"], "--group must be >= 2"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--threads", "-1"], "--threads must be >= 0"),
])
def test_bad_options_are_named(argv, message, capsys):
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
