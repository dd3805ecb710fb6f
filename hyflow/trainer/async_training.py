"""The RL trainer's asynchronous step (async_training.mode; `RLTrainer.async_step`) and the scheduler it runs
over (hyflow.trainer.async_scheduler): the rollout side works on the next prompts while the trainer trains.
"""

from __future__ import annotations

import time

from hyflow.trainer.metrics import timer


def async_scheduler(trainer):
    """The rollout side of an asynchronous run (its own worker group on `rollout.*` devices, or the actor's
    workers) and the scheduler over it."""
    from hyflow.trainer.async_scheduler import AsyncScheduler

    cfg = trainer.config
    separate = trainer.roles.rollout is not None  # the rollout pool of its own (build_roles), or the actor's
    rollout = trainer.roles.rollout if separate else trainer.actor
    r = cfg.actor_rollout_ref.rollout
    return AsyncScheduler(rollout, trainer.loader, cfg.async_training, separate=separate,
                          batch_prompts=cfg.data.train_batch_size, n=r.n, response_length=r.response_length,
                          prompt_length=r.prompt_length, critic_warmup=cfg.trainer.critic_warmup,
                          seed=cfg.trainer.seed, sampling_params=trainer.sampling_params,
                          export_weights=trainer.actor.export_weights)


def async_step(trainer) -> dict[str, float]:
    """One asynchronous RL step (async_training.mode; hyflow.trainer.async_scheduler): take a batch the rollout
    has finished, start the rollout's next work, train on the batch meanwhile, collect, push weights."""
    timing: dict[str, float] = {}
    metrics: dict[str, float] = {}
    scheduler = trainer.scheduler
    with timer("step", timing):
        with trainer.timed("gen", timing):  # the trainer waits for a batch (the rollout runs alone)
            batch = scheduler.next_batch(metrics)
            metrics.update(scheduler.batch_metrics(batch))
            metrics.update(trainer.score(batch, trainer.reward_manager))
        pending = scheduler.launch()  # the rollout works on the next prompts ...
        start = time.perf_counter()
        batch = trainer.train_on(batch, metrics, timing)  # ... while this trains
        train_s = time.perf_counter() - start
        with trainer.timed("async_collect", timing):
            scheduler.land(pending, metrics)
        scheduler.updated(trainer.global_step > trainer.config.trainer.critic_warmup, metrics)
    # With a rollout pool of its own the rollout's advance ran while the trainer trained; in one process it ran
    # first (same samples, no overlap).
    busy = metrics.get("async/rollout_busy_s", 0.0)
    overlapped = min(busy, train_s) if pending is not None and scheduler.separate else 0.0
    metrics["async/overlap_share"] = overlapped / timing["step"]
    metrics["async/rollout_wait_s"] = max(0.0, timing["step"] - busy)
    metrics["trainer/idle_ratio"] = metrics["async/trainer_wait_s"] / timing["step"]
    metrics["rollouter/idle_ratio"] = metrics["async/rollout_wait_s"] / timing["step"]
    return trainer.step_metrics(batch, metrics, timing)
