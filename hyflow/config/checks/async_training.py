"""Asynchronous training (async_training.mode one_step_off / fully_async): keys that only mean something in an
asynchronous mode are not set in the synchronous one (never accepted and ignored), and an asynchronous run has what
its scheduler needs."""

from __future__ import annotations

import dataclasses

from hyflow.config.catalog import algorithm_catalog, engine_capabilities
from hyflow.config.checks import ROLLOUT, check
from hyflow.config.schema import HyflowConfig


@check(670)
def rollout_pool(cfg: HyflowConfig) -> list[str]:
    """The rollout's own pool: rollout.nnodes >= 1, rollout.n_gpus_per_node >= 0."""
    pool = cfg.rollout
    if pool.nnodes < 1 or pool.n_gpus_per_node < 0:
        return [f"rollout.nnodes={pool.nnodes} must be >= 1 and rollout.n_gpus_per_node="
                f"{pool.n_gpus_per_node} >= 0 (0 = no rollout pool of its own)"]
    return []


@check(671, applies=lambda cfg: cfg.async_training.mode == "sync")
def asynchronous_keys_in_sync_mode(cfg: HyflowConfig) -> list[str]:
    at, pool = cfg.async_training, cfg.rollout
    defaults = type(at)()
    problems = []
    set_keys = [f"async_training.{f.name}" for f in dataclasses.fields(at)
                if f.name != "mode" and getattr(at, f.name) != getattr(defaults, f.name)]
    if pool.n_gpus_per_node > 0:
        set_keys.append("rollout.n_gpus_per_node")
    if set_keys:
        problems.append(f"{', '.join(set_keys)} only apply(ies) to asynchronous training, but "
                        "async_training.mode=sync; set async_training.mode=one_step_off or fully_async, or "
                        "drop them")
    return problems


@check(672, applies=lambda cfg: cfg.async_training.mode != "sync")
def asynchronous_mode(cfg: HyflowConfig) -> list[str]:
    at, pool = cfg.async_training, cfg.rollout
    defaults = type(at)()
    problems = []
    where = f"async_training.mode={at.mode}"
    if cfg.trainer.replay_rollouts:
        problems.append(f"trainer.replay_rollouts replays the batches of a synchronous run; {where} generates while "
                        "it trains: use async_training.mode=sync to replay")
    if not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        problems.append(f"{where} needs the rollout's per-token log-probs (each token's behaviour policy): set "
                        f"{ROLLOUT}.calculate_log_probs=true")
    if at.max_staleness < 1:
        problems.append(f"async_training.max_staleness={at.max_staleness}: an asynchronous sample is at least one "
                        "version old; use >= 1 (or async_training.mode=sync for on-policy training)")
    if at.trigger_parameter_sync_step < 1:
        problems.append(f"async_training.trigger_parameter_sync_step={at.trigger_parameter_sync_step} must be >= 1")
    elif at.trigger_parameter_sync_step > at.max_staleness:
        problems.append(f"async_training.trigger_parameter_sync_step={at.trigger_parameter_sync_step} pushes weights "
                        f"less often than max_staleness={at.max_staleness} allows: samples would always be too "
                        "stale; raise max_staleness to at least trigger_parameter_sync_step")
    if at.staleness_threshold < 0:
        problems.append(f"async_training.staleness_threshold={at.staleness_threshold} must be >= 0")
    if at.partial_rollout_chunk is not None and at.partial_rollout_chunk < 1:
        problems.append(f"async_training.partial_rollout_chunk={at.partial_rollout_chunk} must be >= 1 token (or "
                        "null: a quarter of the response length)")
    batching = cfg.actor_rollout_ref.rollout.agent.batching
    if batching == "eager":
        problems.append(f"{ROLLOUT}.agent.batching=eager with {where}: its rollout stream decodes either in deterministic "
                        f"segments of async_training.partial_rollout_chunk tokens (barrier, the default) or with "
                        f"a token stream, aborted and resumed at weight pushes (continuous); choose one")
    if batching == "continuous" and at.partial_rollout_chunk is not None:
        problems.append(f"async_training.partial_rollout_chunk={at.partial_rollout_chunk} with {ROLLOUT}.agent.batching="
                        "continuous: requests run with their whole budget and are aborted and resumed at weight "
                        "pushes, not cut into segments; drop partial_rollout_chunk (or use batching=barrier)")
    if at.mode == "one_step_off":
        changed = [f"async_training.{name}" for name in ("staleness_threshold", "partial_rollout",
                                                         "partial_rollout_chunk", "trigger_parameter_sync_step")
                   if getattr(at, name) != getattr(defaults, name)]
        if changed:
            problems.append(f"{', '.join(changed)} tune(s) async_training.mode=fully_async; one_step_off always "
                            "generates the next batch whole while this one trains (drop them, or use fully_async)")
    if cfg.algorithm.filter_groups.enable:
        problems.append(f"algorithm.filter_groups (DAPO dynamic sampling) is not built for {where} yet; use "
                        "async_training.mode=sync with it")
    catalog = algorithm_catalog()
    if catalog is not None and "reward_baselines" in catalog.estimator_requires(cfg.algorithm.adv_estimator):
        problems.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a greedy rollout of the same "
                        f"prompts with the same weights, which {where} does not make; use async_training.mode=sync")
    separate = pool.n_gpus_per_node > 0
    if separate and cfg.trainer.executor == "local":
        problems.append(f"rollout.n_gpus_per_node={pool.n_gpus_per_node} runs the rollout in processes of its own, "
                        "which trainer.executor=local cannot do; set trainer.executor=ray (or auto), or "
                        "rollout.n_gpus_per_node=0 to roll out in the trainer's process")
    if not separate:
        if cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node > 1:
            problems.append(f"{where} with the rollout on the trainer's workers (rollout.n_gpus_per_node=0) runs on "
                            "one device; with several training devices give the rollout a pool of its own: "
                            "rollout.n_gpus_per_node=N (trainer.executor=ray)")
        caps = engine_capabilities(cfg.actor_rollout_ref.rollout.name)
        if caps is not None and caps.loads_model:  # only an engine on a copy of the trainer's module fits beside it
            problems.append(f"{where} with the rollout in the trainer's process builds a second engine beside the "
                            f"trainer's: only the hf engine does that; for {ROLLOUT}.name="
                            f"{cfg.actor_rollout_ref.rollout.name} give the rollout a pool of its own "
                            "(rollout.n_gpus_per_node=N, trainer.executor=ray)")
    return problems
