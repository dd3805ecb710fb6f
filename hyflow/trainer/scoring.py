"""The RL trainer's scoring: the reward managers it builds from `reward_model.*` and how a batch is scored.

verl's priority: a custom reward function, else the reward model (`reward_model.enable`: a discriminative one
scored by hyflow's forward, or a generative judge), else the built-in scorer of each sample's data_source.
"""

from __future__ import annotations

import time

from hyflow.batch import Batch
from hyflow.config import config_to_dict
from hyflow.models.loading import load_tokenizer
from hyflow.rewards.managers import make_reward_manager, require_finite_scores, score_with_agent_rewards
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.build import pad_token_id


def reward_manager(trainer, num_examine: int):
    """The reward manager `reward_model.reward_manager` names (the judge's when a generative reward model judges),
    with the trainer's reward function; `num_examine` samples printed per call."""
    cfg = trainer.config
    rm = cfg.reward_model
    kwargs = dict(num_workers=rm.num_workers, timeout_s=rm.timeout_s, reward_kwargs=dict(rm.reward_kwargs or {}),
                  num_examine=num_examine, max_response_length=cfg.actor_rollout_ref.rollout.response_length,
                  overlong_buffer=config_to_dict(cfg)["reward_model"]["overlong_buffer"],
                  max_error_fraction=rm.max_error_fraction)
    if trainer.judged:  # the judge's score (mixed with the rule scorer's by weight), hyflow.rewards.judge
        from hyflow.rewards.judge import JudgeRewardManager

        return JudgeRewardManager(trainer.tokenizer, compute_score=trainer.reward_fn, judge=judge(trainer),
                                  judge_weight=rm.judge.weight, rule_weight=rm.judge.rule_weight, **kwargs)
    return make_reward_manager(rm.reward_manager, trainer.tokenizer, compute_score=trainer.reward_fn, **kwargs,
                               experiment_name=cfg.trainer.experiment_name)


def judge(trainer):
    """The generative reward model: prompts from `reward_model.judge`, answers from the judge's worker group
    (`generate`, the engine's call), sampled with `reward_model.rollout`'s settings."""
    from hyflow.rewards.judge import GenerativeJudge, JudgeSampling, engine_generate

    rm = trainer.config.reward_model
    r, j = rm.rollout, rm.judge
    tokenizer = load_tokenizer(rm.model.path, trust_remote_code=rm.model.trust_remote_code,
                               config_key="reward_model.model.path")
    pad = pad_token_id(tokenizer)
    sampling = JudgeSampling(max_new_tokens=r.response_length, temperature=r.temperature, top_p=r.top_p,
                             top_k=r.top_k, do_sample=r.do_sample, seed=r.seed)
    return GenerativeJudge(tokenizer, engine_generate(trainer.reward_model, pad, SamplingParams), template=j.template,
                           template_path=j.template_path, sampling=sampling, score_pattern=j.score_pattern,
                           score_range=tuple(j.score_range) if j.score_range else None, normalize=j.normalize,
                           system_prompt=j.system_prompt, max_prompt_length=r.prompt_length)


def score(trainer, batch: Batch, manager, loop_scores=None) -> dict[str, float]:
    """Write `token_level_scores` (and the scorer's extra columns) into `batch`; return reward metrics.

    verl's priority: a custom reward function, else the reward model (`reward_model.enable`), else the
    built-in scorer of each sample's data_source. `loop_scores`: what the reward loop scored during the rollout
    (`hyflow.rewards.reward_loop`), which gives the same result as scoring now; `timing_s/reward` is the time
    spent scoring either way.
    """
    if trainer.reward_model is not None and not trainer.judged:  # a discriminative reward model
        rm_scores = trainer.reward_model.compute_rm_score(batch)["rm_scores"]
        require_finite_scores(rm_scores, source="the reward model (reward_model.model.path)", column="rm_scores")
        batch["rm_scores"] = rm_scores
        if trainer.reward_fn is None:
            batch["token_level_scores"] = rm_scores
            return {"reward/rm_score/mean": float(rm_scores.sum(-1).mean())}
    if loop_scores is not None:
        result = loop_scores.result(batch)
    else:
        start = time.perf_counter()
        result = score_with_agent_rewards(manager, batch)  # rows an agent loop scored keep that score
        result.metrics["timing_s/reward"] = time.perf_counter() - start
    batch["token_level_scores"] = result.token_level_scores
    for key, values in result.extra.items():
        batch[f"reward_extra/{key}"] = values
    return result.metrics
