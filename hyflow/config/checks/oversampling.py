"""Prioritised oversampling (verl-recipe prime's): data.oversample_factor x the step's prompts are generated, and
the accuracy / truncation filters choose among them."""

from __future__ import annotations

from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(520)
def oversampling(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    d = cfg.data
    if d.oversample_factor < 1 or d.train_batch_size * d.oversample_factor != int(d.train_batch_size * d.oversample_factor):
        problems.append(f"data.oversample_factor={d.oversample_factor} must be >= 1 and make data.train_batch_size x "
                        f"oversample_factor (= {d.train_batch_size * d.oversample_factor:g}) a whole number of prompts")
    elif d.oversample_factor != 1 and algo.filter_groups.enable:
        problems.append("data.oversample_factor with algorithm.filter_groups.enable=true: two ways to choose a step's "
                        "prompts from more (PRIME's prioritised oversampling, DAPO's rounds of data.gen_batch_size); "
                        "use one of them")
    if not 0 <= d.accuracy_lower_bound <= d.accuracy_upper_bound <= 1 and d.filter_accuracy:
        problems.append(f"data.accuracy_lower_bound={d.accuracy_lower_bound} and data.accuracy_upper_bound="
                        f"{d.accuracy_upper_bound} must satisfy 0 <= lower <= upper <= 1 (mean scores of a prompt)")
    if not d.filter_accuracy and (d.accuracy_lower_bound, d.accuracy_upper_bound) != (0.0, 1.0):
        problems.append("data.accuracy_lower_bound / accuracy_upper_bound set, but data.filter_accuracy is false: set "
                        "data.filter_accuracy=true (with data.oversample_factor > 1) or drop them")
    if d.oversample_factor != 1 and cfg.async_training.mode != "sync":
        problems.append(f"data.oversample_factor with async_training.mode={cfg.async_training.mode}: the asynchronous "
                        "rollout streams prompts as they are drawn, with no step batch to choose from; use "
                        "async_training.mode=sync or data.oversample_factor=1")
    if (d.filter_accuracy or d.filter_truncate) and d.oversample_factor == 1:
        problems.append("data.filter_accuracy / data.filter_truncate choose among oversampled prompts: with "
                        "data.oversample_factor=1 every generated prompt is trained on and nothing is filtered; set "
                        "data.oversample_factor > 1 (verl-recipe prime's 4)")
    return problems
