"""plot_run: PNG training curves from a synthetic metrics.jsonl."""

from __future__ import annotations

import json
import math

import matplotlib.image
import pytest

from hyflow.trainer.plot import panel_keys, plot_run, series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def synthetic_rows(steps=20):
    rows = [{"step": 0, "val-core/gsm8k/acc/mean@4": 0.1}]
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "critic/score/mean": s / steps,
            "critic/rewards/mean": s / steps - 0.01,
            "response_length/mean": 100 + s,
            "actor/ppo_kl": 1e-3 * s,
            "actor/entropy": 1.0 / s,
            "timing_s/step": 2.0,
            "timing_s/gen": 1.2,
            "perf/throughput": 1000.0,
        }
        if s % 5 == 0:
            row["val-core/gsm8k/acc/mean@4"] = 0.1 + s / 100
            row["val-core/gsm8k/acc/maj@4/mean"] = 0.2
        rows.append(row)
    rows[3]["actor/entropy"] = None  # a NaN step
    return rows


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_plot_run_writes_combined_and_per_panel_pngs(tmp_path):
    write_metrics(tmp_path, synthetic_rows())
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [
        "training_curves.png",
        "reward.png",
        "val.png",
        "response_length.png",
        "kl.png",
        "entropy.png",
        "timing.png",
    ]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert_png(path)
    combined = matplotlib.image.imread(paths[0])
    single = matplotlib.image.imread(paths[1])
    assert combined.shape[1] > single.shape[1]  # the grid is wider than one panel


def test_plot_run_only_draws_panels_whose_keys_exist(tmp_path):
    write_metrics(tmp_path, [{"step": 1, "critic/score/mean": 0.5}])  # one point still shows (marker)
    out = tmp_path / "elsewhere"
    paths = plot_run(tmp_path, out_dir=out)
    assert [p.name for p in paths] == ["training_curves.png", "reward.png"]
    assert all(p.parent == out for p in paths)
    assert not (tmp_path / "plots").exists()
    for path in paths:
        assert_png(path)


def test_panel_keys_match_groups_in_order():
    keys = {
        "val-core/b/acc/mean@8",
        "val-core/a/acc/mean@8",
        "val-core/a/acc/best@8/mean",
        "timing_s/gen",
        "x",
    }
    assert panel_keys(keys) == [
        ("val", "Validation accuracy", ["val-core/a/acc/mean@8", "val-core/b/acc/mean@8"]),
        ("timing", "Time per stage (s)", ["timing_s/gen"]),
    ]


def test_series_sorts_by_step_and_turns_null_into_a_gap():
    rows = [{"step": 2, "a": 1.0}, {"step": 1, "a": None}, {"step": 3}, {"step": 4, "a": "text"}]
    steps, values = series(rows, "a")
    assert steps == [1, 2] and math.isnan(values[0]) and values[1] == 1.0


def test_plot_run_missing_metrics_names_the_run_dir(tmp_path):
    with pytest.raises(
        FileNotFoundError,
        match=rf"run directory {tmp_path}: the run has logged no step yet, or trainer.logger lacked 'file'",
    ):
        plot_run(tmp_path)


def test_plot_run_without_plottable_metrics_is_an_error(tmp_path):
    write_metrics(tmp_path, [{"step": 1, "perf/throughput": 3.0}])
    with pytest.raises(ValueError, match=r"has no metric to plot \(1 rows; found: perf/throughput\)"):
        plot_run(tmp_path)
