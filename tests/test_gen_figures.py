"""tools/gen_figures.py: the figure blocks of README.md and docs/ come from the artefacts real runs wrote."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gen_figures", ROOT / "tools" / "gen_figures.py")
gen_figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_figures)

MACHINE = {"cpu": "Test CPU", "cores": 2, "torch": "2.13.0+cpu", "torch_threads": 1, "hyflow_commit": "abc1234",
           "hyflow_tree_dirty": False}
QUICKSTART = {"accuracy_after_sft": 0.23, "accuracy_after_rl": 0.825, "answer_line_rate_after_sft": 0.5,
              "answer_line_rate_after_rl": 0.99, "sft_steps": 600, "rl_steps": 40, "wall_time_s": 206.4,
              "command": "python examples/quickstart/run.py", "date": "2026-11-25 19:00 UTC",
              "load_average_before": [1.0, 1.0, 1.0], "load_average_after": [2.0, 1.5, 1.0], "machine": MACHINE}
DOC = """# page

<!-- figures:quickstart -->
hand-written text
<!-- /figures -->

| piece | state |
|---|---|
| packing | <!-- figures:packing-status -->hand-written cell<!-- /figures -->; more |

<!-- figures:async -->
async text kept
<!-- /figures -->
"""


def bench_train_report(ratio, min_len, max_len, batch, preset):
    return {"args": {"batch_size": batch, "min_len": min_len, "max_len": max_len, "preset": preset},
            "machine": {**MACHINE, "load_average_before": [0.5, 0.5, 0.5]},
            "results": {"paths": {"padded": {"tokens_per_step": 4000, "computed_positions_per_step": 8000},
                                  "packed": {"tokens_per_step": 4000, "computed_positions_per_step": 4000}},
                        "ratio_packed_over_padded": ratio, "per_round_ratios": [ratio, ratio]}}


def repo(tmp_path, artefacts: dict) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(DOC)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name, data in artefacts.items():
        (results / name).write_text(json.dumps(data))
    return tmp_path


def test_the_committed_docs_match_the_committed_artefacts():
    assert gen_figures.main(["--check"]) == 0


def test_blocks_are_written_from_artefacts_and_missing_ones_are_kept(tmp_path, capsys):
    root = repo(tmp_path, {"quickstart.json": QUICKSTART,
                           "packing_wide.json": bench_train_report(2.2, 8, 512, 16, "small"),
                           "packing_grpo.json": bench_train_report(1.01, 40, 88, 64, "tiny")})
    assert gen_figures.main(["--root", str(root), "--check"]) == 1  # hand-written blocks differ from the artefacts
    assert gen_figures.main(["--root", str(root)]) == 0
    text = (root / "README.md").read_text()
    assert "hand-written" not in text
    assert max(len(line) for line in text.splitlines() if "figures" not in line) <= 115  # wrapped as the docs are
    flat = " ".join(text.split())
    assert ("**23.0 % after SFT (600 steps) -> 82.5 % after GRPO (40 steps)**; the `#### answer` line written "
            "50.0 % -> 99.0 %; wall time 3 min 26 s.") in flat
    assert 'a 2-core "Test CPU" machine, no GPU (1 torch thread, torch 2.13.0+cpu) at commit abc1234' in flat
    assert "1-min load average 1 before, 2 after" in flat and "What varies by machine" in flat
    # an inline block stays inside its table cell
    cell = next(line for line in text.splitlines() if line.startswith("| packing |"))
    assert "2.20x the padded tokens/s on sequences of 8-512 tokens, 1.01x on 40-88" in cell and cell.endswith(
        "<!-- /figures -->; more |")
    # no bench_async artefact: its block keeps its text and the command that makes one is named
    assert "async text kept" in text
    err = capsys.readouterr().err
    assert "not written (artefact missing): async:" in err and "benchmarks/bench_async.py --seed N" in err
    assert gen_figures.main(["--root", str(root), "--check"]) == 0
    # a new artefact makes the committed block stale
    (root / "benchmarks/results/quickstart.json").write_text(json.dumps({**QUICKSTART, "accuracy_after_rl": 0.6}))
    assert gen_figures.main(["--root", str(root), "--check"]) == 1
    assert "README.md: figure blocks out of date" in capsys.readouterr().err


def test_collect_copies_what_the_runs_wrote(tmp_path):
    root = repo(tmp_path, {})
    (root / "runs" / "quickstart").mkdir(parents=True)
    (root / "runs" / "quickstart" / "summary.json").write_text(json.dumps(QUICKSTART))
    (root / "runs" / "bench").mkdir()
    for seed in (0, 1):
        (root / "runs" / "bench" / f"async_seed{seed}.json").write_text("{}")
    assert gen_figures.collect(root, Path("benchmarks/results")) == [
        "runs/quickstart/summary.json -> benchmarks/results/quickstart.json",
        "runs/bench/async_seed0.json -> benchmarks/results/async_seed0.json",
        "runs/bench/async_seed1.json -> benchmarks/results/async_seed1.json",
    ]


def test_the_async_figure_gives_every_seed(tmp_path):
    def report(seed, sync_target, async_target):
        summary = {"samples_per_s": 400.0, "time_to_target_s": sync_target}
        return {"args": {"seed": seed, "rounds": 1}, "machine": MACHINE,
                "summaries": [{"mode": "sync", **summary},
                              {"mode": "one_step_off", "samples_per_s": 392.0, "time_to_target_s": async_target},
                              {"mode": "fully_async", "samples_per_s": 380.0, "time_to_target_s": None}]}

    root = repo(tmp_path, {"async_seed0.json": report(0, 10.0, 9.0), "async_seed1.json": report(1, 4.0, 5.0)})
    text = gen_figures.async_speed(root / "benchmarks" / "results")
    assert "seed 0 (1 round(s), `async_seed0.json`): one_step_off 0.98x samples/s, target 9.0 s vs 10.0 s " \
           "(sooner by 10 %); fully_async 0.95x samples/s, target not reached by one of them" in text
    assert "seed 1 (1 round(s), `async_seed1.json`): one_step_off 0.98x samples/s, target 5.0 s vs 4.0 s " \
           "(later by 25 %)" in text
