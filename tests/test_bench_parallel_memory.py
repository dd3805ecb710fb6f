"""benchmarks/bench_parallel_memory.py: a reduced run (FSDP2 over 2 on the tiny model, ep=2 on the tiny Qwen3-MoE,
their one-process baselines) writes a JSON whose per-rank bytes agree with the layout and with each other; the
expected-layout arithmetic on shapes that do not divide; bad options rejected."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_parallel_memory.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_parallel_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_parallel_memory"] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 6 spawned processes: about 25 s on 2 idle cores
def test_fsdp2_and_ep2_divide_the_per_rank_bytes_by_two(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "fsdp2,ep2", "--dense-preset", "tiny",
                           "--moe-preset", "tiny-qwen3-moe", "--timeout", "240", "--json", str(out)],
                          capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["cases"]) == ["one", "fsdp2", "one-moe", "ep2"]  # the baselines added, before their cases
    for name in ("| fsdp2 | tiny | 2 |", "| ep2 | tiny-qwen3-moe | 2 |", "measured ratio"):
        assert name in proc.stdout, name
    for name, case in report["cases"].items():
        assert case["steps_taken"], name  # a real AdamW step on every rank
        assert case["layout_matches"] and case["grads_follow_params"], name
        assert case["optimizer_is_2x_params_plus_steps"], name  # exp_avg + exp_avg_sq + one scalar per tensor
        ranks = case["case"]["ranks"]
        assert len(case["per_rank"]) == ranks and (ranks > 1) == bool(case["mesh"]), name
        want = 1.0 if ranks == 1 else 2.0
        assert case["measured_ratio"]["params"] == pytest.approx(want, rel=1e-3), name
        assert case["measured_ratio"]["total"] == pytest.approx(want, rel=1e-3), name
        assert case["measured_ratio"]["total"] == pytest.approx(case["expected_ratio"]["total"], rel=1e-9), name
    one, ep = report["cases"]["one-moe"], report["cases"]["ep2"]
    assert ep["one_process"] == one["one_process"]
    assert ep["mesh"] == ["dp_shard"]  # ep borrows the dp_shard ranks (its own expert mesh)
    moe = report["models"]["moe"]["parameters"]
    assert 0 < moe["experts"] < moe["total"]  # a MoE model: the experts are split by ep, the rest by FSDP2
    assert {"command", "machine", "date"} <= set(report) and report["machine"]["cores"] >= 1


def test_the_expected_layout_rounds_uneven_shards_as_torch_chunk(bench):
    import torch

    for size in (1, 5, 7, 8, 10):
        for parts in (1, 2, 3, 4):
            got = [bench.chunk(size, parts, i) for i in range(parts)]
            want = [len(c) for c in torch.arange(size).chunk(parts)] + [0] * parts
            assert got == want[:parts], (size, parts)
    fsdp4 = bench.Case("x", "dense", 4)
    assert [bench.layout_numel("model.norm.weight", (10,), fsdp4, r) for r in range(4)] == [3, 3, 3, 1]
    tp2xdp2 = bench.Case("x", "dense", 4, tp=2)  # rank = dp_shard index x 2 + tp index
    q = "model.layers.0.self_attn.q_proj.weight"
    assert bench.layout_numel(q, (8, 6), tp2xdp2, 0) == 2 * 6  # 8 rows / tp 2 / dp_shard 2
    assert bench.layout_numel("model.layers.0.mlp.down_proj.weight", (6, 8), tp2xdp2, 3) == 3 * 4
    assert bench.layout_numel("model.embed_tokens.weight", (8, 6), tp2xdp2, 1) == 4 * 6  # not split by tp
    ep2_hsdp = bench.Case("x", "moe", 4, ep=2, fsdp_size=2)
    assert bench.layout_numel("model.layers.1.mlp.experts.gate_up_proj", (8, 4, 2), ep2_hsdp, 3) == 4 * 4 * 2
    assert bench.layout_numel("model.layers.1.mlp.gate.weight", (8, 2), ep2_hsdp, 3) == 4 * 2  # sharded over 2


def test_an_unknown_case_is_named():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cases", "fsdp3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "unknown case(s) ['fsdp3']" in proc.stderr
