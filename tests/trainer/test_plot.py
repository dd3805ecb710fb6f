"""plot_run / build_figures: PNG training curves from synthetic metrics.jsonl files (RL and SFT)."""

from __future__ import annotations

import json
import math
import random

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest

from hyflow.trainer.plot import (
    RAW_ALPHA,
    build_figures,
    is_noisy,
    is_zero,
    panel_keys,
    panel_series,
    plot_run,
    rolling_mean,
    run_kind,
    series,
    series_colors,
    smoothing_window,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_config(run_dir, text):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(text)


RL_CONFIG = """\
algorithm:
  adv_estimator: grpo
actor_rollout_ref:
  model:
    path: Qwen/Qwen2.5-0.5B-Instruct
trainer:
  experiment_name: gsm8k_try
  default_local_dir: checkpoints/${trainer.project_name}/${trainer.experiment_name}
"""

SFT_CONFIG = """\
model:
  partial_pretrain: /models/Qwen2.5-0.5B/
trainer:
  experiment_name: sft_run
"""


def rl_rows(steps=40, seed=0):
    """An RL run: a noisy reward logged twice (critic/rewards/mean == critic/score/mean), always-zero clip
    fractions and ppo_kl, smooth entropy and kl_loss, a constant lr, noisy lengths, timings and validation."""
    rng = random.Random(seed)
    rows = [{"step": 0, "val-core/gsm8k/acc/mean@4": 0.1, "val-core/gsm8k/acc/maj@4/std": 0.01}]
    for s in range(1, steps + 1):
        score = 0.2 + 0.5 * s / steps + rng.uniform(-0.1, 0.1)
        row = {
            "step": s,
            "critic/score/mean": score,
            "critic/rewards/mean": score,
            "actor/pg_loss": rng.uniform(-0.5, 0.5),
            "actor/grad_norm": 1.0 + rng.uniform(-0.3, 0.3),
            "actor/pg_clipfrac": 0.0,
            "actor/pg_clipfrac_lower": 0,
            "actor/ppo_kl": 0.0,
            "actor/kl_loss": 1e-3 * s,
            "actor/entropy": 1.0 / s,
            "actor/lr": 1e-6,
            "response_length/mean": 100 + s + rng.uniform(-20, 20),
            "timing_s/step": 2.0 + rng.uniform(-0.5, 0.5),
            "timing_s/gen": 1.2 + rng.uniform(-0.3, 0.3),
            "perf/throughput": 1000.0,
        }
        if s % 10 == 0:
            row["val-core/gsm8k/acc/mean@4"] = 0.1 + s / 100
            row["val-core/gsm8k/acc/maj@4/std"] = 0.01
        rows.append(row)
    rows[3]["actor/entropy"] = None  # a NaN step
    return rows


def sft_rows(steps=60, seed=1):
    rng = random.Random(seed)
    rows = []
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "train/loss": 2.0 * math.exp(-s / 20) + 0.3 + rng.uniform(-0.15, 0.15),
            "train/lr": 1e-5 * min(1.0, s / 10),
            "train/grad_norm": 3.0 + rng.uniform(-1, 1),
        }
        if s % 20 == 0:
            row["val/loss"] = 2.0 * math.exp(-s / 20) + 0.35
        rows.append(row)
    return rows


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def panels_of(fig):
    """{axes title: axes} of the visible panels of a Figure."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def gids(ax):
    return [line.get_gid() for line in ax.get_lines()]


def legend_texts(ax):
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


# ---------------------------------------------------------------------------------------------- RL


def test_rl_run_writes_combined_and_per_panel_pngs(tmp_path):
    run = tmp_path / "rl_run"
    write_metrics(run, rl_rows())
    write_config(run, RL_CONFIG)
    paths = plot_run(run)
    assert [p.name for p in paths] == [
        "training_curves.png",  # first: what the quickstart prints
        "reward.png",
        "val.png",
        "pg_loss.png",
        "grad_norm.png",
        "entropy.png",
        "kl.png",
        "lr.png",
        "response_length.png",
        "timing.png",
    ]  # no clipfrac.png: both clip fractions are 0 at every step
    for path in paths:
        assert path.parent == run / "plots"
        assert_png(path)
    combined = matplotlib.image.imread(paths[0])
    single = matplotlib.image.imread(paths[1])
    assert combined.shape[1] > single.shape[1]  # the grid is wider than one panel


def test_rl_figure_title_and_axis_labels(tmp_path):
    run = tmp_path / "rl_run"
    write_metrics(run, rl_rows())
    write_config(run, RL_CONFIG)
    figures = dict(build_figures(run))
    fig = figures["training_curves.png"]
    title = fig.get_suptitle()
    assert (
        title.splitlines()[0]
        == "algorithm: grpo  ·  model: Qwen2.5-0.5B-Instruct  ·  run: gsm8k_try (dir rl_run)"
    )
    assert "centered rolling mean over 5 points" in title  # 40 points -> a 5-point window
    axes = panels_of(fig)
    assert list(axes) == [
        "Reward",
        "Validation",
        "Policy loss",
        "Gradient norm",
        "Entropy",
        "KL",
        "Learning rate",
        "Response length",
        "Time per stage",
    ]
    assert all(ax.get_xlabel() == "step" for ax in axes.values())
    assert {title: ax.get_ylabel() for title, ax in axes.items()} == {
        "Reward": "critic/score/mean",
        "Validation": "val-core/gsm8k/acc/mean@4",
        "Policy loss": "actor/pg_loss",
        "Gradient norm": "actor/grad_norm",
        "Entropy": "actor/entropy",
        "KL": "actor/kl_loss",
        "Learning rate": "actor/lr",
        "Response length": "response_length/mean (tokens)",
        "Time per stage": "time (seconds)",
    }
    # each per-panel PNG carries the run's title and its own labels
    single = figures["response_length.png"]
    assert single.get_suptitle().startswith("algorithm: grpo  ·  model: Qwen2.5-0.5B-Instruct")
    (ax,) = single.axes
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "response_length/mean (tokens)"


def test_rl_figure_skips_duplicate_and_zero_series_and_smooths_noisy_ones(tmp_path):
    run = tmp_path / "rl_run"
    write_metrics(run, rl_rows())
    fig = dict(build_figures(run))["training_curves.png"]
    axes = panels_of(fig)
    all_gids = [g for ax in axes.values() for g in gids(ax)]
    # the duplicate is not drawn, only named in the legend of the series it repeats
    assert not any(g.startswith("critic/rewards/mean") for g in all_gids)
    assert gids(axes["Reward"]) == ["critic/score/mean:raw", "critic/score/mean:smooth"]
    assert legend_texts(axes["Reward"]) == ["critic/score/mean (= critic/rewards/mean)"]
    # always-zero series are not drawn (no clip fraction panel; ppo_kl left out of the KL panel)
    assert not any("clipfrac" in g or "ppo_kl" in g for g in all_gids)
    assert "Clip fraction" not in axes
    assert gids(axes["KL"]) == ["actor/kl_loss:raw"]  # a straight line: not noisy, not smoothed
    # noisy series: a faint raw line and a smoothed one of the same color
    for title, key in [
        ("Reward", "critic/score/mean"),
        ("Policy loss", "actor/pg_loss"),
        ("Gradient norm", "actor/grad_norm"),
        ("Response length", "response_length/mean"),
    ]:
        raw, smooth = axes[title].get_lines()
        assert (raw.get_gid(), smooth.get_gid()) == (f"{key}:raw", f"{key}:smooth")
        assert raw.get_alpha() == RAW_ALPHA and smooth.get_alpha() is None
        assert raw.get_color() == smooth.get_color()
        assert list(raw.get_xdata()) == list(smooth.get_xdata())
        assert np.nanstd(np.diff(smooth.get_ydata())) < 0.5 * np.nanstd(np.diff(raw.get_ydata()))
    assert gids(axes["Time per stage"]) == [
        "timing_s/gen:raw",
        "timing_s/gen:smooth",
        "timing_s/step:raw",
        "timing_s/step:smooth",
    ]
    # smooth, constant or sparse series: one line each
    assert gids(axes["Entropy"]) == ["actor/entropy:raw"]
    assert gids(axes["Learning rate"]) == ["actor/lr:raw"]
    assert gids(axes["Validation"]) == ["val-core/gsm8k/acc/mean@4:raw"]  # the */std spread is left out
    (val,) = axes["Validation"].get_lines()
    assert list(val.get_xdata()) == [0, 10, 20, 30, 40] and val.get_marker() == "o"
    # the NaN entropy step stays a gap
    (entropy,) = axes["Entropy"].get_lines()
    assert math.isnan(entropy.get_ydata()[2])  # rows[3] is step 3, the series starts at step 1


def test_smoothed_line_keeps_gaps(tmp_path):
    rows = [{"step": s, "actor/pg_loss": (-1) ** s * 0.5 + s / 100} for s in range(1, 31)]
    rows[10]["actor/pg_loss"] = None
    write_metrics(tmp_path, rows)
    fig = dict(build_figures(tmp_path))["training_curves.png"]
    (ax,) = panels_of(fig).values()
    raw, smooth = ax.get_lines()
    assert math.isnan(raw.get_ydata()[10]) and math.isnan(smooth.get_ydata()[10])
    assert np.isfinite(np.delete(smooth.get_ydata(), 10)).all()


def test_plot_run_only_draws_panels_whose_keys_exist(tmp_path):
    write_metrics(tmp_path, [{"step": 1, "critic/score/mean": 0.5}])  # one point still shows (marker)
    out = tmp_path / "elsewhere"
    paths = plot_run(tmp_path, out_dir=out)
    assert [p.name for p in paths] == ["training_curves.png", "reward.png"]
    assert all(p.parent == out for p in paths)
    assert not (tmp_path / "plots").exists()
    for path in paths:
        assert_png(path)


# ---------------------------------------------------------------------------------------------- SFT


def test_sft_run_is_plotted(tmp_path):
    run = tmp_path / "sft_run"
    write_metrics(run, sft_rows())
    write_config(run, SFT_CONFIG)
    paths = plot_run(run, out_dir=tmp_path / "out")
    assert [p.name for p in paths] == ["training_curves.png", "loss.png", "grad_norm.png", "lr.png"]
    for path in paths:
        assert_png(path)

    figures = dict(build_figures(run))
    fig = figures["training_curves.png"]
    assert fig.get_suptitle().splitlines()[0] == "algorithm: sft  ·  model: Qwen2.5-0.5B  ·  run: sft_run"
    axes = panels_of(fig)
    assert list(axes) == ["Loss", "Gradient norm", "Learning rate"]
    assert [ax.get_xlabel() for ax in axes.values()] == ["step"] * 3
    assert [ax.get_ylabel() for ax in axes.values()] == ["loss", "train/grad_norm", "train/lr"]
    # train/loss is noisy: raw + smoothed; val/loss (every 20 steps) and the lr schedule are drawn as logged
    assert gids(axes["Loss"]) == ["train/loss:raw", "train/loss:smooth", "val/loss:raw"]
    assert legend_texts(axes["Loss"]) == ["train/loss", "val/loss"]
    assert gids(axes["Gradient norm"]) == ["train/grad_norm:raw", "train/grad_norm:smooth"]
    assert gids(axes["Learning rate"]) == ["train/lr:raw"]


def test_sft_title_uses_model_path_and_dir_name_without_config(tmp_path):
    run = tmp_path / "my_sft"
    write_metrics(run, sft_rows(steps=5))
    fig = dict(build_figures(run))["training_curves.png"]
    assert fig.get_suptitle() == "algorithm: sft  ·  run: my_sft"  # 5 points: nothing smoothed, no note
    write_config(run, "model:\n  path: org/tiny-model\ntrainer:\n  experiment_name: my_sft\n")
    fig = dict(build_figures(run))["training_curves.png"]
    assert fig.get_suptitle() == "algorithm: sft  ·  model: tiny-model  ·  run: my_sft"


def test_rl_title_without_or_with_a_broken_config_is_the_dir_name(tmp_path):
    run = tmp_path / "grpo_run"
    write_metrics(run, [{"step": 1, "critic/score/mean": 0.5}])
    assert dict(build_figures(run))["training_curves.png"].get_suptitle() == "run: grpo_run"
    write_config(run, "algorithm: [unclosed\n")
    assert dict(build_figures(run))["training_curves.png"].get_suptitle() == "run: grpo_run"


def test_run_kind_from_keys():
    assert run_kind({"train/loss", "train/lr"}) == "sft"
    assert run_kind({"val/loss"}) == "sft"
    assert run_kind({"critic/score/mean", "train/loss"}) == "rl"
    assert run_kind({"actor/pg_loss"}) == "rl"
    assert run_kind(set()) == "rl"


# ---------------------------------------------------------------------------------------------- helpers


def test_panel_keys_match_groups_in_order():
    keys = {
        "val-core/b/acc/mean@8",
        "val-core/a/acc/mean@8",
        "val-core/a/acc/best@8/mean",
        "val-core/a/acc/best@8/std",
        "timing_s/gen",
        "x",
    }
    assert panel_keys(keys) == [
        (
            "val",
            "Validation",
            ["val-core/a/acc/best@8/mean", "val-core/a/acc/mean@8", "val-core/b/acc/mean@8"],
        ),
        ("timing", "Time per stage", ["timing_s/gen"]),
    ]


def test_panel_series_drops_zero_and_folds_duplicates():
    rows = [{"step": s, "a": s, "b": float(s), "z": 0.0, "n": None, "c": s * 2} for s in range(1, 4)]
    rows[1]["z"] = None  # zero and NaN only: still nothing to see
    drawn = panel_series(rows, ["z", "a", "n", "b", "c"])
    assert [(s.key, s.same_as, s.label) for s in drawn] == [("a", ["b"], "a (= b)"), ("c", [], "c")]
    assert is_zero([0.0, math.nan, 0]) and not is_zero([0.0, 1e-9])


def test_series_sorts_by_step_and_turns_null_into_a_gap():
    rows = [{"step": 2, "a": 1.0}, {"step": 1, "a": None}, {"step": 3}, {"step": 4, "a": "text"}]
    steps, values = series(rows, "a")
    assert steps == [1, 2] and math.isnan(values[0]) and values[1] == 1.0


def test_rolling_mean_is_centered_and_cut_at_the_ends():
    out = rolling_mean([1.0, 2.0, 3.0, 10.0, math.nan, 4.0], 3)
    np.testing.assert_allclose(out[:4], [1.5, 2.0, 5.0, 6.5])  # window 3, cut to 2 at the start
    assert math.isnan(out[4]) and out[5] == 4.0  # the gap stays; NaN neighbours are left out of the mean


def test_smoothing_window_grows_with_the_run_length():
    assert smoothing_window(8) == 3
    assert smoothing_window(40) == 5
    assert smoothing_window(200) == 21
    assert smoothing_window(100_000) == 41  # capped
    assert all(smoothing_window(n) % 2 == 1 for n in range(1, 500))


def test_is_noisy():
    rng = random.Random(0)
    assert is_noisy([rng.random() for _ in range(30)])
    assert is_noisy([s / 30 + (-1) ** s * 0.1 for s in range(30)])
    assert not is_noisy([float(s) for s in range(30)])  # a trend
    assert not is_noisy([1.0 / s for s in range(1, 30)])  # a smooth curve
    assert not is_noisy([1e-4] * 30)  # a constant
    assert not is_noisy([1.0, 0.0] * 3)  # too short to smooth


# ---------------------------------------------------------------------------------------------- errors


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


def test_plot_run_with_only_zero_metrics_is_an_error(tmp_path):
    write_metrics(tmp_path, [{"step": s, "actor/pg_clipfrac": 0.0} for s in range(1, 5)])
    with pytest.raises(ValueError, match=r"no metric to plot .*when not 0 at every step"):
        plot_run(tmp_path)
    assert not (tmp_path / "plots").exists()


# ---------------------------------------------------------------------------------------------- issue 22


def test_a_reward_that_stays_zero_still_gets_its_panels(tmp_path):
    rows = [{"step": 0, "val-core/arith/acc/mean@1": 0.0}]
    rows += [{"step": s, "critic/score/mean": 0.0, "actor/pg_clipfrac": 0.0, "actor/pg_loss": 0.1 * s}
             for s in range(1, 11)]
    rows[-1]["val-core/arith/acc/mean@1"] = 0.0
    write_metrics(tmp_path, rows)
    axes = panels_of(dict(build_figures(tmp_path))["training_curves.png"])
    assert list(axes) == ["Reward", "Validation", "Policy loss"]  # the zero clip fraction stays out
    (reward,) = axes["Reward"].get_lines()
    assert reward.get_gid() == "critic/score/mean:raw" and list(reward.get_ydata()) == [0.0] * 10
    (val,) = axes["Validation"].get_lines()
    assert list(val.get_xdata()) == [0, 10] and list(val.get_ydata()) == [0.0, 0.0]


def ppo_rows(steps=12):
    rows = []
    for s in range(1, steps + 1):
        rows.append({
            "step": s,
            "critic/score/mean": 0.1 * s,
            "actor/pg_loss": 0.01 * s,
            "actor/grad_norm": 1.0 + 0.01 * s,
            "critic/grad_norm": 2.0 + 0.02 * s,
            "critic/vf_loss": 1.0 / s,
            "critic/vf_clipfrac": 0.0,
            "critic/values/mean": 0.05 * s,
            "critic/returns/mean": 0.1 * s,
            "critic/advantages/mean": 0.0,
            "critic/vf_explained_var": -0.5 + 0.1 * s,
        })
    return rows


def test_a_ppo_run_gets_critic_panels(tmp_path):
    write_metrics(tmp_path, ppo_rows())
    write_config(tmp_path, "algorithm:\n  adv_estimator: gae\n")
    axes = panels_of(dict(build_figures(tmp_path))["training_curves.png"])
    assert list(axes) == ["Reward", "Policy loss", "Critic loss", "Critic values", "Critic explained variance",
                          "Gradient norm"]
    assert gids(axes["Critic loss"]) == ["critic/vf_loss:raw"]
    assert axes["Critic loss"].get_ylabel() == "critic/vf_loss"
    assert gids(axes["Critic values"]) == ["critic/values/mean:raw", "critic/returns/mean:raw"]
    assert legend_texts(axes["Critic values"]) == ["critic/values/mean", "critic/returns/mean"]
    assert gids(axes["Critic explained variance"]) == ["critic/vf_explained_var:raw"]
    assert gids(axes["Gradient norm"]) == ["actor/grad_norm:raw", "critic/grad_norm:raw"]
    assert "Clip fraction" not in axes  # the critic's clip fraction was 0 throughout


def test_returns_without_a_critic_draw_no_critic_panel(tmp_path):
    rows = [{k: v for k, v in row.items() if not k.startswith(("critic/v", "critic/grad"))} for row in ppo_rows()]
    assert "critic/returns/mean" in rows[0]  # GRPO logs returns (= advantages) but has no critic
    write_metrics(tmp_path, rows)
    axes = panels_of(dict(build_figures(tmp_path))["training_curves.png"])
    assert not any(title.startswith("Critic") for title in axes)


def test_every_timing_curve_has_a_colour_of_its_own(tmp_path):
    stages = ["gen", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights",
              "testing", "save_checkpoint", "step", "step_total", "generate_sequences", "reward"]
    rng = random.Random(0)
    rows = [{"step": s, **{f"timing_s/{name}": i + rng.uniform(0, 0.5) for i, name in enumerate(stages)}}
            for s in range(1, 21)]
    write_metrics(tmp_path, rows)
    for name, fig in build_figures(tmp_path):
        if name not in ("training_curves.png", "timing.png"):
            continue
        (ax,) = [a for a in fig.axes if a.get_title() == "Time per stage"]
        lines = [line for line in ax.get_lines() if line.get_label() != "_raw"]  # one per series
        assert len(lines) == len(stages)
        colors = {matplotlib.colors.to_hex(line.get_color()) for line in lines}
        assert len(colors) == len(stages)
        for raw in (line for line in ax.get_lines() if line.get_label() == "_raw"):  # raw and smooth pair up
            key = raw.get_gid().rsplit(":", 1)[0]
            (smooth,) = [line for line in lines if line.get_gid() == f"{key}:smooth"]
            assert raw.get_color() == smooth.get_color()


def test_series_colors_are_distinct():
    for n in (1, 10, 11, 20, 21, 40):
        colors = series_colors(n)
        assert len({matplotlib.colors.to_hex(c) for c in colors}) == n
