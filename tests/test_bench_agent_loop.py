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
    assert row["batched"]["engine_calls"] <= 2 and row["batched"]["mean_batch"] > 1
    assert 0 < row["batched"]["engine_busy_share"] <= 1
    assert "ratio_one-by-one_vs_batched" in row and "one-by-one / batched" in capsys.readouterr().out


def test_the_slow_interaction_workload_compares_eager_with_barrier_batching(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_agent_loop", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (row,) = bench.main(["--prompts", "2", "--n", "2", "--turns", "2", "--turn-tokens", "8", "--rounds", "1",
                         "--ways", "batched,eager", "--latency", "0.2"])
    assert row["latency_s"] == 0.2 and row["eager"]["trajectories_per_s"] > 0
    assert row["eager"]["engine_calls"] >= row["batched"]["engine_calls"]  # eager never waits to fill a call
    assert "eager / batched" in capsys.readouterr().out


def test_bad_ways_are_named(capsys):
    import pytest

    spec = importlib.util.spec_from_file_location("bench_agent_loop", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit):
        bench.main(["--ways", "batched,fast"])
    assert "--ways batched,fast: name 2 to 4 different ways" in capsys.readouterr().err
