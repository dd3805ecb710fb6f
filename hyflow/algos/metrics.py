"""Validation metrics over n sampled responses per prompt (mean@n, best@k, worst@k, maj@k) and metric reduction.

For a prompt with n scored responses s_1..s_n (and optional extracted answers a_1..a_n):

    mean@n = (1/n) sum_i s_i,   std@n = population std of s_1..s_n (n > 1)
    best@k = E[max of k responses drawn with replacement],  worst@k = E[min of ...]
    maj@k  = E[score of the majority answer among k responses drawn with replacement]

The expectations are bootstrap estimates (`n_bootstrap` draws; `/mean` is the estimate, `/std` the spread over
draws) for k in {2, 4, 8, ...} below n, plus k = n. Per-prompt values are averaged over the prompts of each
data source. Names follow verl's `process_validation_metrics`:

    val-core/<data_source>/<var>/<metric>   for the core variable (`acc` if scored, else `reward`, else the
                                            first numeric variable) and metric mean@N, best@N/*, maj@N/*
                                            with N the largest n of that data source,
    val-aux/<data_source>/<var>/<metric>    for everything else (std@n, worst@k, smaller k, other variables).

The bootstrap is vectorised with numpy over prompts and draws; all prompts with the same n share one
generator seeded from (seed, n, k), so results are deterministic and every variable sees the same draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

CORE_VARIABLE_PRIORITY = ("acc", "reward")
_MAX_BOOTSTRAP_ELEMENTS = 1 << 22  # per vectorised block: prompts x draws x k


def bootstrap_sizes(n: int) -> list[int]:
    """Subset sizes k for best@k / worst@k / maj@k: 2, 4, 8, ... below n, then n itself (none for n = 1)."""
    if n < 2:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def _numeric(values: Sequence, name: str, expected: int) -> np.ndarray | None:
    if len(values) != expected:
        raise ValueError(
            f"scores[{name!r}] has {len(values)} values for {expected} samples; pass one per sample."
        )
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        return None  # non-numeric extra info (e.g. strings) is not a metric
    return array if array.ndim == 1 else None


def _majority_positions(codes_PBk: np.ndarray, n_codes: int) -> np.ndarray:
    """Per draw, the position of the first response carrying the most frequent answer code ([P, B]).

    Ties between answers go to the answer seen first in the draw.
    """
    rows, k = int(np.prod(codes_PBk.shape[:-1])), codes_PBk.shape[-1]
    flat_codes = codes_PBk.reshape(rows, k)
    offsets = np.arange(rows)[:, None] * n_codes
    counts = np.bincount((flat_codes + offsets).ravel(), minlength=rows * n_codes).reshape(rows, n_codes)
    count_at_pos = np.take_along_axis(counts, flat_codes, axis=1)
    first_max = np.argmax(count_at_pos == count_at_pos.max(axis=1, keepdims=True), axis=1)
    return first_max.reshape(codes_PBk.shape[:-1])


def _answer_codes(answers: list) -> np.ndarray:
    """Answers of one prompt -> codes 0..u-1 by first appearance (equal answers share a code)."""
    first_seen: dict = {}
    codes = []
    for answer in answers:
        try:
            code = first_seen.setdefault(answer, len(first_seen))
        except TypeError:  # unhashable answer (e.g. a list): compare by its repr
            code = first_seen.setdefault(repr(answer), len(first_seen))
        codes.append(code)
    return np.array(codes, dtype=np.int64)


def _bucket_metrics(
    values_VPn: np.ndarray,
    codes_Pn: np.ndarray | None,
    n_bootstrap: int,
    seed: int,
) -> list[dict[str, np.ndarray]]:
    """Per variable, metric name -> per-prompt values [P], for P prompts that all have n responses."""
    n_vars, n_prompts, n = values_VPn.shape
    out: list[dict[str, np.ndarray]] = [{f"mean@{n}": values_VPn[v].mean(axis=1)} for v in range(n_vars)]
    if n < 2:
        return out
    for v in range(n_vars):
        out[v][f"std@{n}"] = values_VPn[v].std(axis=1)
    for k in bootstrap_sizes(n):
        rng = np.random.default_rng([seed, n, k])
        block = max(1, _MAX_BOOTSTRAP_ELEMENTS // (n_bootstrap * k))
        stats: dict[str, list[np.ndarray]] = {}
        for start in range(0, n_prompts, block):
            prompts = slice(start, min(start + block, n_prompts))
            # draw axis k first, so max/min/gather reduce over k contiguous [P, B] slabs
            idx_kPB = rng.integers(0, n, size=(k, prompts.stop - prompts.start, n_bootstrap))
            rows_1P1 = np.arange(prompts.start, prompts.stop)[None, :, None]
            picked_VkPB = values_VPn[:, rows_1P1, idx_kPB]
            draws = {"best": picked_VkPB.max(axis=1), "worst": picked_VkPB.min(axis=1)}
            if codes_Pn is not None:
                codes_PBk = np.moveaxis(codes_Pn[rows_1P1, idx_kPB], 0, -1)
                majority_PB = _majority_positions(codes_PBk, n)
                draws["maj"] = np.take_along_axis(picked_VkPB, majority_PB[None, None], axis=1)[:, 0]
            for name, draws_VPB in draws.items():
                stats.setdefault(f"{name}@{k}/mean", []).append(draws_VPB.mean(axis=-1))
                stats.setdefault(f"{name}@{k}/std", []).append(draws_VPB.std(axis=-1))
        for name, parts in stats.items():
            joined_VP = np.concatenate(parts, axis=1)
            for v in range(n_vars):
                out[v][name] = joined_VP[v]
    return out


def _is_core(metric: str, n_max: int) -> bool:
    head, _, _ = metric.partition("/")
    kind, _, size = head.partition("@")
    return kind in ("mean", "best", "maj") and size == str(n_max)


def compute_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence,
    scores: Mapping[str, Sequence[float]],
    preds: Sequence | None = None,
    *,
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> dict[str, float]:
    """`val-core/...` and `val-aux/...` metrics per data source and score variable (see the module docstring).

    Args: one entry per sample in `data_sources`, `sample_uids` (prompt id shared by the n responses of a
    prompt) and every list of `scores` (e.g. `reward`, `acc`, numeric extra info; non-numeric lists are
    skipped); `preds` (extracted answers, hashable) enable maj@k. Per prompt: mean@n, std@n (n > 1), and for k
    in `bootstrap_sizes(n)` best@k/{mean,std}, worst@k/{mean,std}, maj@k/{mean,std}; each averaged over the
    data source's prompts that have it. maj@k scores a draw by the first response carrying its most frequent
    answer (ties: the answer seen first).
    """
    n_samples = len(data_sources)
    if len(sample_uids) != n_samples:
        raise ValueError(
            f"sample_uids has {len(sample_uids)} entries for {n_samples} data_sources; pass one per sample."
        )
    if preds is not None and len(preds) != n_samples:
        raise ValueError(
            f"preds has {len(preds)} entries for {n_samples} samples; pass one per sample or None."
        )
    if n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be >= 1, got {n_bootstrap}.")
    variables = {name: _numeric(values, name, n_samples) for name, values in scores.items()}
    variables = {name: array for name, array in variables.items() if array is not None}
    if not variables or n_samples == 0:
        return {}
    names = list(variables)
    core_var = next((name for name in CORE_VARIABLE_PRIORITY if name in variables), names[0])
    values_VS = np.stack([variables[name] for name in names])

    prompts_by_source: dict[str, dict[Any, list[int]]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, sample_uids)):
        prompts_by_source.setdefault(str(source), {}).setdefault(uid, []).append(i)

    result: dict[str, float] = {}
    for source, prompts in prompts_by_source.items():
        by_n: dict[int, list[list[int]]] = {}
        for samples in prompts.values():
            by_n.setdefault(len(samples), []).append(samples)
        per_prompt: list[dict[str, list[np.ndarray]]] = [{} for _ in names]
        for _, groups in sorted(by_n.items()):
            index_Pn = np.array(groups, dtype=np.int64)
            codes_Pn = None
            if preds is not None:
                codes_Pn = np.stack([_answer_codes([preds[i] for i in row]) for row in groups])
            bucket = _bucket_metrics(values_VS[:, index_Pn], codes_Pn, n_bootstrap, seed)
            for v, metrics in enumerate(bucket):
                for metric, values_P in metrics.items():
                    per_prompt[v].setdefault(metric, []).append(values_P)
        n_max = max(by_n)
        for v, name in enumerate(names):
            for metric, parts in per_prompt[v].items():
                section = "val-core" if name == core_var and _is_core(metric, n_max) else "val-aux"
                result[f"{section}/{source}/{name}/{metric}"] = float(np.concatenate(parts).mean())
    return result


def _flatten_floats(value: Any) -> list[float]:
    if hasattr(value, "detach"):  # torch tensor, without importing torch here
        value = value.detach().float().cpu().numpy()
    if isinstance(value, np.ndarray | np.generic | int | float | bool):
        return np.asarray(value, dtype=np.float64).ravel().tolist()
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return [x for item in value for x in _flatten_floats(item)]
    raise ValueError(f"metric value {value!r} is not numeric; log numbers, arrays or tensors only.")


MIN_SUFFIXES = ("/min", "_min")  # a metric named so is a minimum: reduced by min (verl's AggregationType.MIN)
MAX_SUFFIXES = ("/max", "_max")
# wall times: the slowest rank bounds the step, so per-rank times reduce by max (verl times a worker-group call on
# the driver, around the whole call, which is the slowest rank's time)
TIMING_PREFIXES = ("timing_s/", "timing_per_token_ms/")
TIMING_KEYS = ("perf/time_per_step",)


def is_timing(key: str) -> bool:
    """Whether `key` is a wall time (`timing_s/*`, `timing_per_token_ms/*`, `perf/time_per_step`)."""
    return key.startswith(TIMING_PREFIXES) or key in TIMING_KEYS


def reduce_metrics(metrics: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, float]:
    """Reduce per-micro-batch / per-worker metrics to one float per key: the one reduction rule of hyflow.

    Accepts a list of metric dicts or a dict of value lists (values may be numbers, arrays, tensors or lists
    of them). Keys ending in `/max` or `_max` reduce by max, `/min` or `_min` by min (verl's rule is any "max" /
    "min" in the name; the suffix alone keeps names such as `max_min` weights out), wall times (`is_timing`) by max
    (the slowest rank bounds the step), every other key by the mean. Keys without values are dropped.
    """
    gathered: dict[str, list[float]] = {}
    if isinstance(metrics, Mapping):
        for key, value in metrics.items():
            gathered.setdefault(key, []).extend(_flatten_floats(value))
    else:
        for entry in metrics:
            for key, value in entry.items():
                gathered.setdefault(key, []).extend(_flatten_floats(value))
    reduced: dict[str, float] = {}
    for key, values in gathered.items():
        if not values:
            continue
        if key.endswith(MAX_SUFFIXES) or is_timing(key):
            reduced[key] = float(np.max(values))
        elif key.endswith(MIN_SUFFIXES):
            reduced[key] = float(np.min(values))
        else:
            reduced[key] = float(np.mean(values))
    return reduced
