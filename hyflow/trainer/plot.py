"""Training curves of a run as PNG files, from its metrics.jsonl (`hyflow plot RUN`).

`plot_run(run_dir)` draws one panel per group of metrics the run logged — reward, validation accuracy,
response length, KL, entropy, time per stage — against the step, into `run_dir/plots/training_curves.png`
(all panels) and one PNG per panel (`reward.png`, `val.png`, ...). A group whose keys were never logged gets
no panel. Steps whose value was NaN/inf (stored as null) are gaps in the line. Matplotlib draws without
pyplot (a bare `Figure` renders with Agg), so no display and no global backend switch are needed.
"""

from __future__ import annotations

import fnmatch
import math
import os
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from hyflow.trainer.tracking import read_metrics

# (file stem, title, key patterns): fnmatch patterns, `*` also matches `/`.
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "Reward", ("critic/score/mean", "critic/rewards/mean")),
    ("val", "Validation accuracy", ("val-core/*/mean@*",)),
    ("response_length", "Response length (tokens)", ("response_length/mean",)),
    ("kl", "KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")),
    ("entropy", "Entropy", ("actor/entropy",)),
    ("timing", "Time per stage (s)", ("timing_s/*",)),
)
COMBINED_FILE = "training_curves.png"
MARKER_MAX_POINTS = 50  # draw point markers on short series (validation, a single step) so they show


def panel_keys(keys: set[str]) -> list[tuple[str, str, list[str]]]:
    """(stem, title, keys) for each panel with at least one logged key; keys in pattern order, then sorted."""
    panels = []
    for stem, title, patterns in PANELS:
        matched: list[str] = []
        for pattern in patterns:
            matched += sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern) and k not in matched)
        if matched:
            panels.append((stem, title, matched))
    return panels


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows that logged it, sorted by step; null -> NaN (a gap)."""
    points = sorted(
        (row["step"], math.nan if row[key] is None else float(row[key]))
        for row in rows
        if key in row and (row[key] is None or isinstance(row[key], (int, float)))
    )
    return [s for s, _ in points], [v for _, v in points]


def _draw(ax, rows: list[dict], title: str, keys: list[str]) -> None:
    for key in keys:
        steps, values = series(rows, key)
        marker = "o" if len(steps) <= MARKER_MAX_POINTS else None
        ax.plot(steps, values, label=key, marker=marker, markersize=3, linewidth=1.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2 if len(keys) > 6 else 1)


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write `training_curves.png` (every panel) and `<panel>.png` per panel into `out_dir`
    (default `run_dir/plots`); returns their paths, the combined figure first.

    No metrics.jsonl is a FileNotFoundError; a file with no rows or none of the plotted metrics a ValueError.
    """
    rows = read_metrics(run_dir)
    keys = {k for row in rows for k in row if k != "step"}
    panels = panel_keys(keys)
    if not panels:
        wanted = ", ".join(p for _, _, patterns in PANELS for p in patterns)
        found = ", ".join(sorted(keys)[:10]) or "nothing"
        raise ValueError(
            f"{Path(run_dir)}/metrics.jsonl has no metric to plot ({len(rows)} rows; found: {found}); "
            f"plotted metrics: {wanted}"
        )
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.5 * ncols, 3.8 * nrows), layout="constrained")
    fig.suptitle(Path(run_dir).resolve().name)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (_, title, panel) in zip(axes, panels):
        _draw(ax, rows, title, panel)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    paths = [out / COMBINED_FILE]
    fig.savefig(paths[0], dpi=100)

    for stem, title, panel in panels:
        single = Figure(figsize=(6, 4), layout="constrained")
        _draw(single.add_subplot(), rows, title, panel)
        paths.append(out / f"{stem}.png")
        single.savefig(paths[-1], dpi=100)
    return paths
