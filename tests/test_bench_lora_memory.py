"""benchmarks/bench_lora_memory.py runs end to end (crash check only: no memory or timing assertions)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lora_memory.py"


@pytest.mark.slow
def test_both_modes_run_and_the_table_names_the_trainable_parameters(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--batch", "4", "--micro", "2",
                           "--prompt", "8", "--response", "8", "--steps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| full |" in proc.stdout and "| lora |" in proc.stdout and "LoRA / full" in proc.stdout
    report = json.loads(out.read_text())
    full, lora = report["results"]["full"], report["results"]["lora"]
    assert full["trainable_params"] == full["total_params"]  # full fine-tuning trains everything
    assert 0 < lora["trainable_params"] < full["trainable_params"] < lora["total_params"]  # adapters only


def test_a_batch_that_does_not_split_into_micro_batches_is_named():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--batch", "5", "--micro", "2"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--batch 5 must be a multiple of --micro 2" in proc.stderr
