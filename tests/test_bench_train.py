"""benchmarks/bench_train.py runs end to end on a tiny workload (crash check only: no timing assertions), its two
paths agree on the loss, and bad options are rejected before a model is built."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
TINY = ["--preset", "tiny", "--batch-size", "3", "--min-len", "4", "--max-len", "40", "--rounds", "2",
        "--steps", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = module  # --sp's spawned ranks unpickle their function from it by name
    spec.loader.exec_module(module)
    return module


def test_both_paths_run_and_write_json(bench, tmp_path, capsys):
    out = tmp_path / "result.json"
    report = bench.main([*TINY, "--optimizer-step", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(report["results"]))
    paths = report["results"]["paths"]
    assert set(paths) == {"padded", "packed"}
    for name, summary in paths.items():
        assert len(summary["rounds_tokens_per_s"]) == 2 and summary["median_tokens_per_s"] > 0, name
    assert paths["packed"]["tokens_per_step"] == paths["padded"]["tokens_per_step"]  # same real tokens
    assert paths["packed"]["computed_positions_per_step"] <= paths["padded"]["computed_positions_per_step"]
    assert report["results"]["ratio_packed_over_padded"] > 0
    assert report["loss_check_abs_diff"] < 1e-4
    for row in ("padded ", "packed ", "ratio packed/padded"):
        assert row in printed, printed
    assert report["machine"]["torch_threads"] == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--min-len", "1"], "--min-len"),
    (["--preset", "huge"], "invalid choice"),
    (["--sp", "2", "--tp", "2"], "--sp and --tp cannot be combined"),
    (["--preset", "tiny", "--tp", "4"], "--tp 4 must divide the tiny preset's 2 key-value heads"),
    (["--tp", "2", "--optimizer-step"], "--sp / --tp time the packed forward and backward only"),
    (["--sp", "2", "--compare", "compile"], "--sp / --tp time the packed forward and backward only"),
])
def test_bad_options_exit_before_building_a_model(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


def test_compare_compile_runs_packed_against_packed_compiled(bench, tmp_path, capsys):
    report = bench.main([*TINY, "--compare", "compile", "--warmup", "1", "--workdir", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    assert set(report["results"]["paths"]) == {"packed", "packed+compile"}
    assert report["results"]["ratio_packed+compile_over_packed"] > 0
    assert report["loss_check_abs_diff"] < 1e-4
    assert "ratio packed+compile/packed" in printed, printed


@pytest.mark.slow
def test_sequence_parallel_mode_runs_two_ranks(bench, tmp_path, capsys):
    """--sp 2: one process and a 2-rank sequence-parallel group on the same batches; the losses agree and each
    rank saves fewer activation bytes than the one process."""
    report = bench.main(["--sp", "2", "--preset", "tiny", "--batch-size", "2", "--min-len", "64", "--max-len", "96",
                         "--rounds", "1", "--steps", "1", "--warmup", "0", "--workdir", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    paths = report["results"]["paths"]
    assert set(paths) == {"sp=1", "sp=2"} and paths["sp=2"]["ranks"] == 2
    assert report["results"]["max_loss_abs_diff"] < 1e-4
    assert paths["sp=2"]["activation_mb_per_rank"] < paths["sp=1"]["activation_mb_per_rank"]
    assert "ratio sp=2/sp=1" in printed, printed


@pytest.mark.slow
def test_tensor_parallel_mode_runs_two_ranks(bench, tmp_path, capsys):
    """--tp 2: one process and 2 tensor-parallel ranks on the same batches; every rank computes the one process's
    loss and holds less parameter (and gradient) memory than it (the decoder layers split, embeddings replicated)."""
    report = bench.main(["--tp", "2", "--preset", "tiny", "--batch-size", "2", "--min-len", "32", "--max-len", "48",
                         "--rounds", "1", "--steps", "1", "--warmup", "0", "--workdir", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    results = report["results"]
    paths = results["paths"]
    assert set(paths) == {"tp=1", "tp=2"} and paths["tp=2"]["ranks"] == 2
    assert results["max_loss_abs_diff"] < 1e-4 and paths["tp=2"]["max_loss_spread_across_ranks"] < 1e-6
    assert 0.5 <= results["ratio_parameter_memory"] < 1
    assert paths["tp=2"]["gradient_mb_per_rank"] < paths["tp=1"]["gradient_mb_per_rank"]
    assert "ratio tp=2/tp=1" in printed and "params MB/rank" in printed, printed

