"""benchmarks/bench_agent_loop.py runs end to end on a tiny workload (crash check and batching check only: no timing
assertions)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_agent_loop.py"


def test_both_ways_run_and_the_batched_way_decodes_turns_together(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_agent_loop", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "result.json"
    (row,) = bench.main(["--prompts", "3", "--n", "2", "--turns", "2", "--turn-tokens", "12", "--rounds", "1",
                         "--json", str(out)])
    assert json.loads(out.read_text())["results"] == [row]
    assert row["batched"]["model_tokens_per_s"] > 0 and row["one-by-one"]["model_tokens_per_s"] > 0
    # one engine call per turn, each holding every trajectory still going
    assert row["engine_calls"] <= 2 and row["mean_batch"] > 1
    assert "ratio" in capsys.readouterr().out
