"""The `async_training` and `rollout` (rollout pool) sections: asynchronous training modes and the rollout
workers' own devices."""

from __future__ import annotations

from dataclasses import dataclass

from hyflow.config.schema.base import option


@dataclass
class AsyncTrainingConfig:
    """Asynchronous training: generation overlaps training (verl's one_step_off_policy and fully_async_policy
    recipes, here modes of the one trainer with the synchronous trainer's step semantics: a step trains on
    data.train_batch_size prompts x rollout.n samples)."""

    mode: str = option(
        "sync",
        "sync: generate, then train, every step (the default, unchanged); one_step_off: the rollout of step k+1 "
        "runs while step k trains, with the weights from before that update (every sample exactly one version "
        "old); fully_async: the rollout generates continuously into a bounded buffer, the trainer takes a batch "
        "when one is complete, weight updates reach in-flight trajectories between segments (partial_rollout). "
        "hyflow; verl selects these with separate entry points.",
        choices=("sync", "one_step_off", "fully_async"),
    )
    staleness_threshold: float = option(
        0.1, "fully_async: how far the rollout may run ahead of the trainer: prompts in flight plus complete ones "
        "waiting in the buffer are at most ceil((1 + staleness_threshold) x data.train_batch_size) (verl's "
        "freshness control; 0 = no run-ahead beyond the next batch).")
    trigger_parameter_sync_step: int = option(
        1, "fully_async: push the trainer's weights to the rollout every this many training steps (verl counts "
        "its smaller mini-batch steps, default 4; a hyflow step is a whole train_batch_size).")
    partial_rollout: bool = option(
        True, "fully_async: a weight push interrupts in-flight trajectories, which continue under the new weights "
        "(each token keeps the version and log-prob it was sampled with); false: a push waits until nothing is "
        "in flight, and no trajectory starts meanwhile.")
    partial_rollout_chunk: int | None = option(
        None, "fully_async: new tokens a trajectory generates per engine call, between which weights may change "
        "(None = a quarter of rollout.response_length, at least 1). hyflow.")
    max_staleness: int = option(
        1, "The bound on a training sample's staleness: trainer version - the oldest policy version among its "
        "tokens (versions count actor updates). hyflow.")
    stale_policy: str = option(
        "wait",
        "What keeps samples within max_staleness: wait (the trainer holds its next update until the samples "
        "that it would make too stale are trained; the bound is never exceeded) or drop (train as soon as a "
        "batch is ready; samples past the bound are dropped and counted in async/dropped_stale). hyflow.",
        choices=("wait", "drop"),
    )
    off_policy_correction: str = option(
        "bypass",
        "In the asynchronous modes, when algorithm.rollout_correction names no correction of its own: bypass (verl's "
        "fully-async default: pi_old is the rollout's per-token log-probs, so the PPO ratio pi / pi_rollout is "
        "clipped against the policy that sampled each token; no recompute), decoupled (pi_old recomputed by the "
        "trainer, with token-level truncated importance weights pi_old / pi_rollout at rollout_is_threshold: "
        "decoupled PPO, as AReaL; one more forward pass per step) or off. hyflow.",
        choices=("bypass", "decoupled", "off"),
    )


@dataclass
class RolloutPoolConfig:
    """The rollout workers' own devices in the asynchronous modes (verl's fully-async `rollout.nnodes` /
    `rollout.n_gpus_per_node`)."""

    nnodes: int = option(1, "Machines of the rollout pool.")
    n_gpus_per_node: int = option(
        0, "Devices per machine of the rollout pool: separate rollout worker processes beside the trainer's "
        "(trainer.executor=ray). 0 = no pool of its own: the rollout runs on the trainer's workers. verl: 8.")
