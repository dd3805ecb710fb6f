"""One generation round of the RL trainer's rollout (`RLTrainer.generate_round`): the prompts' samples, the
round's column producers (`hyflow.trainer.producers`: `generated` before scoring, `scored` after), the scores.
`RLTrainer.rollout_and_score` runs the rounds the batch filters ask for (`hyflow.trainer.filters.fill_batch`).
"""

from __future__ import annotations

from hyflow.algos import reduce_metrics
from hyflow.batch import Batch
from hyflow.trainer.producers import StepState


def generate_round(trainer, prompts: Batch, rounds: int, metrics: dict) -> Batch:
    """One generation round: the rollout, the producers of the round (hyflow.trainer.producers), the scores."""
    cfg = trainer.config
    prompts["uid"] = [f"step{trainer.global_step}-round{rounds}-{i}" for i in range(len(prompts))]
    seed = (cfg.trainer.seed * 1_000_003 + trainer.global_step) * 101 + rounds
    if trainer.use_reward_loop:  # each trajectory scored as it finishes, while the rest generate
        from hyflow.rewards.reward_loop import generate_and_score, reward_loop_unsupported

        why = reward_loop_unsupported(trainer.reward_manager,
                                      rule_scores=trainer.reward_model is None or trainer.reward_fn is not None)
        if why is not None:
            print(f"reward_model.use_reward_loop: {why}; scoring after the rollout instead")
            trainer.use_reward_loop = False
    loop_scores = None
    if trainer.use_reward_loop:
        batch, loop_scores = generate_and_score(trainer.reward_manager, trainer.actor, prompts,
                                                trainer.sampling_params(seed=seed), executor=trainer.executor)
    else:
        batch = trainer.actor.generate_sequences(prompts, trainer.sampling_params(seed=seed))
    metrics.update(reduce_metrics(batch.meta.pop("metrics", {})))  # the agent loop's and the engine's
    state = StepState(metrics, prompts=prompts)
    for producer in trainer.producers["generated"]:  # rewritten samples: the reward loop's scores are stale
        batch, loop_scores = producer.make(trainer, batch, state), None
    metrics.update(trainer.score(batch, trainer.reward_manager, loop_scores))
    for producer in trainer.producers["scored"]:
        batch = producer.make(trainer, batch, state)
    return batch
