"""A generative reward model (a judge behind reward_model.rollout.name)."""

from __future__ import annotations

import dataclasses

from hyflow.config.catalog import component_catalog, frozen_engines
from hyflow.config.checks import check
from hyflow.config.keys import not_one_of
from hyflow.config.schema import HyflowConfig


@check(690)
def judge(cfg: HyflowConfig) -> list[str]:
    """A generative reward model: an engine name with reward_model.enable, a model path, a manager the judge can
    mix with (naive or dapo), and judge settings that hang together; judge settings without a judge are refused."""
    from hyflow.config.schema.reward import JudgeConfig

    rm = cfg.reward_model
    problems = []
    judge_set = sorted(f.name for f in dataclasses.fields(JudgeConfig)
                       if getattr(rm.judge, f.name) != getattr(JudgeConfig(), f.name))
    if not rm.rollout.name:
        if judge_set:
            problems.append(f"reward_model.judge.{{{', '.join(judge_set)}}} set, but the reward model is not "
                            "generative: set reward_model.rollout.name=hf or vllm (and reward_model.enable=true, "
                            "reward_model.model.path=a causal LM) to score with a judge, or drop them")
        return problems
    frozen = frozen_engines()  # the engines that declare they serve a frozen model (hf, vllm)
    if component_catalog() is not None and rm.rollout.name not in frozen:
        return [not_one_of("reward_model.rollout.name", rm.rollout.name, [None, *frozen])]
    if not rm.enable:
        problems.append(f"reward_model.rollout.name={rm.rollout.name} serves a generative reward model, but "
                        "reward_model.enable is false; set reward_model.enable=true (or drop reward_model.rollout)")
        return problems
    if not rm.model.path:
        problems.append(f"reward_model.rollout.name={rm.rollout.name} serves the reward model: set "
                        "reward_model.model.path (verl: reward.reward_model.model_path) to it (a causal LM that "
                        "writes a score, or a sequence classifier)")
    if rm.rollout.load_format == "dummy":
        problems.append("reward_model.rollout.load_format=dummy would give the judge random weights; drop it")
    if rm.judge.template is not None and rm.judge.template_path is not None:
        problems.append("reward_model.judge.template and reward_model.judge.template_path both set; give one")
    if rm.judge.normalize and rm.judge.score_range is None:
        problems.append("reward_model.judge.normalize=true maps score_range onto [0, 1]: set "
                        "reward_model.judge.score_range=[LOW,HIGH] too")
    if rm.judge.score_range is not None and (len(rm.judge.score_range) != 2
                                             or not rm.judge.score_range[0] < rm.judge.score_range[1]):
        problems.append(f"reward_model.judge.score_range={list(rm.judge.score_range)} must be [low, high] with "
                        "low < high")
    return problems
