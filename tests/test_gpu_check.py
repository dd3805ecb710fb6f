"""benchmarks/gpu_check.py (`make gpu-check`): its time plan, its parts' containment, its reports; the whole script at
smoke sizes on CPU; and bench_grpo's partial JSON and profile, which it reads."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return load("gpu_check", SCRIPT)


def test_a_part_that_overruns_cannot_take_the_time_of_the_parts_after_it(gpu_check):
    plan = gpu_check.Plan(500.0, {"tests": 100, "grpo": 200, "rollout": 60}, ["tests", "grpo", "rollout"])
    plan.current = "tests"
    assert plan.timeout() == pytest.approx(500 - 5 - 260, abs=1)  # grpo's and rollout's seconds are kept
    plan.current = "rollout"
    assert plan.timeout() == pytest.approx(495, abs=1)  # the last part gets all that is left
    plan.start -= 400  # 100 s left: grpo no longer fits, and a part never gets less than 1.2x its own seconds
    plan.current = "grpo"
    assert not plan.fits("grpo") and plan.fits("rollout")
    plan.current = "tests"
    assert plan.timeout() == pytest.approx(95, abs=1)  # min(left, max(1.2 x 100, left - kept))


def test_a_part_out_of_time_is_killed_with_its_children(gpu_check, tmp_path):
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    result = gpu_check.run_part(["sh", "-c", f"sleep 20 & echo $! > {pid_file}; echo started; wait"], 1.0)
    assert time.monotonic() - start < 15  # not the 20 s of a child left holding the output pipe
    assert result["status"] == "timed out after 1 s" and "started" in result["stdout_tail"]
    child = int(pid_file.read_text())
    for _ in range(50):  # the killed child is reaped by init shortly after
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the part's child {child} outlived the part")
    failed = gpu_check.run_part([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], 30)
    assert failed["status"] == "failed (rc 3)" and "boom" in failed["stderr_tail"]


def test_junit_failures_and_counts_are_read(gpu_check, tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.a" name="ok"/>'
                   '<testcase classname="tests.a" name="bad"><failure message="assert 1 == 2">trace</failure></testcase>'
                   '<testcase classname="tests.b" name="gone"><skipped message="needs CUDA"/></testcase>'
                   '<testcase classname="tests.b" name="err"><error message="fixture broke"/></testcase>'
                   '</testsuite></testsuites>')
    got = gpu_check.junit_summary(xml)
    assert got["counts"] == {"tests": 4, "failures": 1, "errors": 1, "skipped": 1, "passed": 1}
    assert [f["test"] for f in got["failed"]] == ["tests.a::bad", "tests.b::err"]
    assert got["failed"][0]["message"].startswith("assert 1 == 2")
    assert gpu_check.junit_summary(tmp_path / "missing.xml") == {"counts": None}


def test_unknown_parts_are_refused(gpu_check, capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--parts", "grpo,gpu"])
    assert "unknown part(s) gpu" in capsys.readouterr().err


def test_without_a_cuda_device_it_says_so_and_measures_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device is visible" in proc.stderr and "--device cpu --smoke" in proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["parts"]) == {"device"} and report["parts"]["device"]["cuda_available"] is False


@pytest.mark.slow
def test_every_part_runs_at_smoke_size_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [report["parts"][p]["status"] for p in ("tests", "grpo", "rollout", "threads")] == ["ok"] * 4
    assert report["parts"]["tests"]["counts"]["passed"] >= 1
    grpo = report["parts"]["grpo"]
    assert grpo["partial"] is False and set(grpo["summaries"]) == {"hyflow", "trl"} and grpo["ratio_steps_per_s"] > 0
    assert set(grpo["profile"]) == {"hyflow", "trl"}
    stages = grpo["profile"]["hyflow"]["stages"]
    assert {"hyflow/gen", "hyflow/update_actor"} <= set(stages)  # the trainer's timers are profiler ranges
    assert "hyflow/update_actor" in (tmp_path / "profile" / "profile-hyflow.txt").read_text()
    assert (tmp_path / "profile" / "profile-trl.txt").exists()
    assert report["parts"]["threads"]["auto"]["threads_line"].startswith("torch threads:")
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "ratio hyflow/TRL steps/s" in text and "tests: ok" in text and proc.stdout == text


@pytest.mark.slow
def test_bench_grpo_leaves_what_finished_runs_measured_when_a_later_run_fails(tmp_path, monkeypatch):
    """A run cut short (the GPU machine's time limit, a crash in the second library) keeps the JSON of the runs
    that finished: `"partial": true`, their steps and summaries."""
    bench = load("bench_grpo_partial", ROOT / "benchmarks" / "bench_grpo.py")

    def trl_breaks(*args, **kwargs):
        raise RuntimeError("the second library's run broke")

    monkeypatch.setattr(bench, "run_trl", trl_breaks)
    out = tmp_path / "partial.json"
    with pytest.raises(RuntimeError, match="second library"):
        bench.main(["--prompts", "2", "--group", "2", "--max-new-tokens", "4", "--steps", "1", "--warmup", "1",
                    "--rounds", "2", "--threads", "1", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["partial"] is True and report["rounds_started"] == 1
    assert set(report["summaries"]) == {"hyflow"} and report["summaries"]["hyflow"]["measured_steps"] == 1
    assert len(report["raw"]["hyflow"][0]["step_s"]) == 2 and report["raw"]["trl"] == []
