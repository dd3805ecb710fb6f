"""Training curves of a run as PNG files, from its metrics.jsonl (`hyflow plot RUN`).

`plot_run(run_dir)` draws one panel per group of metrics the run logged against the step, into
`run_dir/plots/training_curves.png` (all panels) and one PNG per panel (`reward.png`, `val.png`, ...);
`build_figures(run_dir)` makes the same matplotlib Figures without writing anything.

- The run kind comes from the keys: verl's SFT trainer logs `train/loss`, `val/loss`, `train/lr`,
  `train/grad_norm` (panels loss, grad_norm, lr); anything else is an RL run (panels reward, val, pg_loss,
  the critic's vf_loss, values and vf_explained_var when a critic ran (PPO/GAE), grad_norm, clipfrac, entropy,
  kl, lr, response_length, timing). A panel whose keys were never logged (or only as 0) is left out, except
  reward, validation and explained variance: a reward that stays 0 is what a run must show.
- The figure title names the algorithm (`algorithm.adv_estimator`, or `sft`), the model (the last part of
  `actor_rollout_ref.model.path`, or SFT's `model.partial_pretrain` / `model.path`) and the run
  (`trainer.experiment_name`, with the directory's name when it differs), read from `run_dir/config.yaml`;
  without that file the title is the directory's name.
- Every axis is labelled: x the step, y the metric (its key, or the panel's quantity when it draws several)
  with its unit where known (seconds for `timing_s/*`, tokens for lengths).
- A key whose value is 0 at every step (e.g. `actor/pg_clipfrac` with on-policy updates) is not drawn (in
  the panels above that keep zeros it is); every curve of a panel has a colour of its own; a key
  with the same values at the same steps as one drawn before it in the panel is not drawn either, its name is
  added to that one's legend label (`critic/score/mean (= critic/rewards/mean)`).
- A noisy series of at least `SMOOTH_MIN_POINTS` points (its first differences change sign at least
  `NOISY_SIGN_CHANGES` of the time) is drawn faint, with a centered rolling mean over it whose window grows
  with the series' length (`smoothing_window`). Validation and learning-rate curves are never smoothed.
- Loss and grad-norm panels switch to a log y axis when their values span more than `LOG_Y_RATIO`x (an SFT
  loss falling from 6 to 0.1); a legend of more than `LEGEND_BELOW` entries goes under its panel.
- Steps whose value was NaN/inf (stored as null) are gaps in the line.

Matplotlib draws without pyplot (a bare `Figure` renders with Agg), so no display and no global backend switch
are needed.
"""

from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from hyflow.trainer.tracking import read_metrics

CONFIG_FILE = "config.yaml"
COMBINED_FILE = "training_curves.png"
# point markers on short unsmoothed series (validation, a single step) so they show
MARKER_MAX_POINTS = 50
SMOOTH_MIN_POINTS = 8
NOISY_SIGN_CHANGES = 0.3  # share of consecutive differences that change sign above which a series is noisy
SMOOTH_MAX_WINDOW = 41
LOG_Y_RATIO = 20.0  # panels with `log_y` switch to a log y axis when max/min of the values exceeds this
LEGEND_BELOW = 4  # a legend of more entries goes under the panel instead of over the curves
RAW_ALPHA = 0.3


@dataclass(frozen=True)
class Panel:
    """One panel: its file stem, title, y quantity (the y label when it draws several keys) and key patterns
    (fnmatch, `*` also matches `/`); keys matching `exclude` are left out, only keys matching `smooth` may be
    smoothed."""

    stem: str
    title: str
    quantity: str
    patterns: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    smooth: tuple[str, ...] = ("*",)
    log_y: bool = False
    keep_zero: bool = False  # draw a series that is 0 at every step (a reward that stays 0 is the news)
    needs: tuple[str, ...] = ()  # drawn only when one of these keys was logged (returns without values: no panel)


RL_PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward", "reward", ("critic/score/mean", "critic/rewards/mean"), keep_zero=True),
    # val-core/<source>/<var>/{mean@N, best@N/mean, maj@N/mean}; the */std keys are bootstrap spreads
    Panel("val", "Validation", "validation score", ("val-core/*",), exclude=("*/std",), smooth=(),
          keep_zero=True),
    Panel("pg_loss", "Policy loss", "pg_loss", ("actor/pg_loss",)),
    # PPO's critic (GAE and the other value-based estimators): its loss, its values against the returns, and the
    # share of the returns' variance the values explain
    Panel("vf_loss", "Critic loss", "value loss", ("critic/vf_loss",), log_y=True),
    Panel("values", "Critic values", "value", ("critic/values/mean", "critic/returns/mean", "critic/vpred_mean"),
          needs=("critic/values/mean", "critic/vpred_mean")),
    Panel("vf_explained_var", "Critic explained variance", "explained variance", ("critic/vf_explained_var",),
          keep_zero=True),
    Panel("grad_norm", "Gradient norm", "grad norm", ("actor/grad_norm", "critic/grad_norm"), log_y=True),
    Panel("clipfrac", "Clip fraction", "clip fraction",
          ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac")),
    Panel("entropy", "Entropy", "entropy", ("actor/entropy",)),
    Panel("kl", "KL", "KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")),
    Panel("lr", "Learning rate", "learning rate", ("actor/lr",), smooth=()),
    Panel("response_length", "Response length", "response length", ("response_length/mean",)),
    Panel("timing", "Time per stage", "time", ("timing_s/*",)),
)
SFT_PANELS: tuple[Panel, ...] = (
    Panel("loss", "Loss", "loss", ("train/loss", "val/loss"), smooth=("train/*",), log_y=True),
    Panel("grad_norm", "Gradient norm", "grad norm", ("train/grad_norm",), log_y=True),
    Panel("lr", "Learning rate", "learning rate", ("train/lr",), smooth=()),
)
PANELS = {"rl": RL_PANELS, "sft": SFT_PANELS}
SFT_KEYS = ("train/loss", "val/loss", "train/lr", "train/grad_norm")
RL_PREFIXES = ("actor/", "critic/", "val-core/", "response_length/")


@dataclass
class Series:
    """One drawn curve: `key`'s values over `steps` (NaN: a gap); `same_as` the keys with identical values."""

    key: str
    steps: list[int]
    values: list[float]
    same_as: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.key} (= {', '.join(self.same_as)})" if self.same_as else self.key


# ------------------------------------------------------------------------------ data


def run_kind(keys: set[str]) -> str:
    """'sft' when the run logged SFT's keys and none of RL's, else 'rl'."""
    if any(k in SFT_KEYS for k in keys) and not any(k.startswith(RL_PREFIXES) for k in keys):
        return "sft"
    return "rl"


def panel_keys(keys: set[str], panels: tuple[Panel, ...] = RL_PANELS) -> list[tuple[str, str, list[str]]]:
    """(stem, title, keys) for each panel with at least one logged key; keys in pattern order, then sorted."""
    result = []
    for panel in panels:
        matched: list[str] = []
        for pattern in panel.patterns:
            matched += sorted(
                k
                for k in keys
                if fnmatch.fnmatchcase(k, pattern)
                and k not in matched
                and not any(fnmatch.fnmatchcase(k, x) for x in panel.exclude)
            )
        if matched:
            result.append((panel.stem, panel.title, matched))
    return result


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows that logged it, sorted by step; null -> NaN (a gap)."""
    points = sorted(
        (row["step"], math.nan if row[key] is None else float(row[key]))
        for row in rows
        if key in row and (row[key] is None or isinstance(row[key], (int, float)))
    )
    return [s for s, _ in points], [v for _, v in points]


def is_zero(values: list[float]) -> bool:
    """True if every finite value is 0 (or there is none): nothing to see."""
    return all(v == 0 for v in values if math.isfinite(v))


def same_series(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> bool:
    """Same steps and the same value at each (NaN equals NaN; floats to 1e-9 relative)."""
    (steps_a, values_a), (steps_b, values_b) = a, b
    if steps_a != steps_b:
        return False
    return all(
        (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
        for x, y in zip(values_a, values_b)
    )


def panel_series(rows: list[dict], keys: list[str], *, keep_zero: bool = False) -> list[Series]:
    """The curves to draw for `keys`, in order: always-zero keys dropped (unless `keep_zero`), a key identical
    to an earlier one folded into that one's `same_as`."""
    drawn: list[Series] = []
    for key in keys:
        steps, values = series(rows, key)
        if not steps or (is_zero(values) and not keep_zero):
            continue
        for s in drawn:
            if same_series((s.steps, s.values), (steps, values)):
                s.same_as.append(key)
                break
        else:
            drawn.append(Series(key, steps, values))
    return drawn


def smoothing_window(n: int) -> int:
    """Odd window of the rolling mean for a series of n points: about n/10, 3 at least, SMOOTH_MAX_WINDOW
    at most."""
    half = min(max(1, round(n / 20)), SMOOTH_MAX_WINDOW // 2)
    return 2 * half + 1


def rolling_mean(values: list[float], window: int) -> np.ndarray:
    """Centered rolling mean over the finite values of each window (cut at both ends of the series, as
    pandas' `rolling(window, center=True, min_periods=1)`); NaN where the raw value is not finite, so gaps
    stay gaps."""
    v = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(v)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, v, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    idx = np.arange(len(v))
    lo, hi = np.clip(idx - window // 2, 0, len(v)), np.clip(idx + window // 2 + 1, 0, len(v))
    out = (sums[hi] - sums[lo]) / np.maximum(counts[hi] - counts[lo], 1)
    out[~ok] = np.nan
    return out


def is_noisy(values: list[float]) -> bool:
    """At least SMOOTH_MIN_POINTS finite values whose consecutive differences change sign at least
    NOISY_SIGN_CHANGES of the time (a trend with small jitter, a schedule or a constant is not noisy)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if len(v) < SMOOTH_MIN_POINTS:
        return False
    d = np.diff(v)
    d = d[d != 0]
    if len(d) < 2:
        return False
    return float(np.mean(np.sign(d[1:]) != np.sign(d[:-1]))) >= NOISY_SIGN_CHANGES


def unit(key: str) -> str | None:
    if key.startswith("timing_s/") or key == "perf/time_per_step":
        return "seconds"
    if key.startswith(("response_length/", "prompt_length/")) and not key.endswith("clip_ratio"):
        return "tokens"
    return None


def y_label(panel: Panel, drawn: list[Series]) -> str:
    label = drawn[0].key if len(drawn) == 1 else panel.quantity
    units = {unit(s.key) for s in drawn}
    return f"{label} ({units.pop()})" if len(units) == 1 and None not in units else label


# ------------------------------------------------------------------------------ title


def read_config(run_dir: str | os.PathLike) -> dict:
    """`run_dir/config.yaml` as a dict; {} when it is missing or not a YAML mapping."""
    import yaml

    path = Path(run_dir) / CONFIG_FILE
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def _get(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def run_title(run_dir: str | os.PathLike, config: dict, kind: str) -> str:
    """'algorithm: grpo  ·  model: Qwen2.5-0.5B  ·  run: gsm8k' from the config; without one, the
    directory's name."""
    dir_name = Path(run_dir).resolve().name
    algorithm = "sft" if kind == "sft" else _get(config, "algorithm.adv_estimator")
    model = None
    for dotted in ("actor_rollout_ref.model.path", "model.partial_pretrain", "model.path"):
        value = _get(config, dotted)
        if isinstance(value, str) and value.strip("/"):
            model = os.path.basename(value.rstrip("/"))
            break
    name = _get(config, "trainer.experiment_name")
    run = dir_name if not name else str(name) if str(name) == dir_name else f"{name} (dir {dir_name})"
    parts = [
        f"algorithm: {algorithm}" if algorithm else None,
        f"model: {model}" if model else None,
        f"run: {run}",
    ]
    return "  ·  ".join(p for p in parts if p)


# ------------------------------------------------------------------------------ drawing


def series_colors(n: int) -> list:
    """n distinct colours: matplotlib's default cycle (C0..C9) up to 10 curves, tab20 up to 20, evenly spaced
    hues of `turbo` beyond (a timing panel logs a dozen stages or more: no two may share a colour)."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    from matplotlib import colormaps

    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["turbo"](x) for x in np.linspace(0.0, 1.0, n)]


def _line(ax, s: Series, color, values, kind: str, **style) -> None:
    """One line of series `s` over its steps, in its colour, with gid `<key>:<kind>`."""
    ax.plot(s.steps, values, color=color, gid=f"{s.key}:{kind}", **style)


def _draw(ax, panel: Panel, drawn: list[Series]) -> list[int]:
    """Draw `drawn` on `ax`; returns the rolling-mean windows used. Lines carry gid `<key>:raw` (the logged
    values) and `<key>:smooth` (their rolling mean); each series has a colour of its own (`series_colors`)."""
    windows = []
    for s, color in zip(drawn, series_colors(len(drawn))):
        smooth = any(fnmatch.fnmatchcase(s.key, p) for p in panel.smooth) and is_noisy(s.values)
        if smooth:
            window = smoothing_window(sum(math.isfinite(v) for v in s.values))
            windows.append(window)
            _line(ax, s, color, s.values, "raw", alpha=RAW_ALPHA, linewidth=0.9, label="_raw")
            _line(ax, s, color, rolling_mean(s.values, window), "smooth", linewidth=1.8, label=s.label)
        else:
            marker = "o" if len(s.steps) <= MARKER_MAX_POINTS else None
            _line(ax, s, color, s.values, "raw", marker=marker, markersize=3, linewidth=1.4, label=s.label)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(y_label(panel, drawn), fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    finite = [v for s in drawn for v in s.values if math.isfinite(v)]
    if panel.log_y and min(finite) > 0 and max(finite) / min(finite) > LOG_Y_RATIO:
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    ax.grid(True, alpha=0.3)
    if len(drawn) > LEGEND_BELOW:
        ax.legend(fontsize="x-small", ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    elif len(drawn) > 1 or drawn[0].same_as:
        ax.legend(fontsize="x-small")
    return windows


def _smoothing_note(windows: list[int]) -> str:
    if not windows:
        return ""
    lo, hi = min(windows), max(windows)
    span = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f"\nfaint: logged values; solid: centered rolling mean over {span} points"


def build_figures(run_dir: str | os.PathLike) -> list[tuple[str, Figure]]:
    """(file name, Figure) for `training_curves.png` (every panel), then `<panel>.png` per panel; writes
    nothing.

    No metrics.jsonl is a FileNotFoundError; a file with no rows or nothing to draw (no plotted metric, or
    only always-zero ones) a ValueError.
    """
    rows = read_metrics(run_dir)
    keys = {k for row in rows for k in row if k != "step"}
    kind = run_kind(keys)
    panels_by_stem = {p.stem: p for p in PANELS[kind]}
    panels = []
    for stem, _, matched in panel_keys(keys, PANELS[kind]):
        panel = panels_by_stem[stem]
        if panel.needs and not keys & set(panel.needs):
            continue
        drawn = panel_series(rows, matched, keep_zero=panel.keep_zero)
        if drawn:
            panels.append((panels_by_stem[stem], drawn))
    if not panels:
        wanted = ", ".join(p for panel in PANELS[kind] for p in panel.patterns)
        found = ", ".join(sorted(keys)[:10]) or "nothing"
        raise ValueError(
            f"{Path(run_dir)}/metrics.jsonl has no metric to plot ({len(rows)} rows; found: {found}); "
            f"plotted metrics (when not 0 at every step): {wanted}"
        )
    title = run_title(run_dir, read_config(run_dir), kind)

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.5 * ncols, 3.8 * nrows + 0.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    windows = []
    for ax, (panel, drawn) in zip(axes, panels):
        windows += _draw(ax, panel, drawn)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title + _smoothing_note(windows), fontsize=11)
    figures = [(COMBINED_FILE, fig)]

    for panel, drawn in panels:
        single = Figure(figsize=(6, 4.3), layout="constrained")
        note = _smoothing_note(_draw(single.add_subplot(), panel, drawn))
        single.suptitle(title + note, fontsize=9)
        figures.append((f"{panel.stem}.png", single))
    return figures


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write `training_curves.png` (every panel) and `<panel>.png` per panel into `out_dir`
    (default `run_dir/plots`); returns their paths, the combined figure first. Errors: see `build_figures`."""
    figures = build_figures(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures:
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=100)
    return paths
