"""benchmarks/bench_reward_loop.py runs end to end on a tiny workload (crash check and result shape only: no timing
assertions)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_reward_loop.py"


def test_both_ways_run_and_report_side_by_side(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_reward_loop", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "result.json"
    row = bench.main(["--prompts", "2", "--n", "2", "--response-length", "8", "--sleep-ms", "5", "--rounds", "1",
                      "--max-num-seqs", "2", "--json", str(out)])
    assert json.loads(out.read_text())["results"] == [row]
    for way in ("batch", "loop"):
        assert row[way]["step_s"] > 0 and row[way]["reward_s"] > 0 and len(row[way]["rounds"]) == 1
    assert row["batch"]["overlap_share"] == 0 and 0 <= row["loop"]["overlap_share"] <= 1
    assert row["ratio_batch_vs_loop_step"] > 0
    assert "batch / loop step time" in capsys.readouterr().out
