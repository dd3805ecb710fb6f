"""DAPO's dynamic sampling (algorithm.filter_groups): generation rounds of data.gen_batch_size prompts, and the
metric whose group variance decides which groups are kept."""

from __future__ import annotations

from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(515)
def generation_rounds(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    gen = cfg.data.gen_batch_size
    if gen is not None and gen < 1:
        problems.append(f"data.gen_batch_size={gen} must be >= 1 (prompts per generation round), or null")
    elif gen is not None and gen != cfg.data.train_batch_size and not algo.filter_groups.enable:
        problems.append(
            f"data.gen_batch_size={gen} differs from data.train_batch_size={cfg.data.train_batch_size}, but only "
            "dynamic sampling (algorithm.filter_groups.enable=true) generates rounds of a different size; set "
            "algorithm.filter_groups.enable=true or drop data.gen_batch_size")
    return problems


@check(525)
def filter_metric(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    if algo.filter_groups.enable and not algo.filter_groups.metric:
        return [
            "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric (the per-sample metric whose "
            "group variance decides); set algorithm.filter_groups.metric=acc (or score)."
        ]
    return []
