"""The RL trainer's checkpoints: its roles' state (hyflow.trainer.role_checkpoints) and its own.

`save(trainer)` / `load(trainer, path)` are `RLTrainer.save_checkpoint` / `load_checkpoint`: the trainer's own
state is its step, the data loader's position, the KL controller, the asynchronous scheduler and the RNG.
"""

from __future__ import annotations

from pathlib import Path

from hyflow.config import config_to_yaml
from hyflow.trainer.checkpoint import capture_rng_state, restore_rng_state
from hyflow.trainer.role_checkpoints import RoleCheckpoints, role_states


def role_checkpoints(trainer) -> RoleCheckpoints:
    """The roles' part of checkpoints (hyflow.trainer.role_checkpoints): every role that holds training state (the
    role registry's `checkpoint` entries: the actor, a critic, PRIME's implicit PRM), each with its checkpoint
    section's save and load contents."""
    if getattr(trainer, "_role_checkpoints", None) is None:
        cfg = trainer.config
        trainer._role_checkpoints = RoleCheckpoints(
            trainer.checkpoints, role_states(trainer.roles, cfg),
            checkpoint_format=cfg.trainer.checkpoint_format, model_cfg=cfg.actor_rollout_ref.model,
            tokenizer=trainer.processor or trainer.tokenizer)  # a VLM's image processor travels with its tokenizer
    return trainer._role_checkpoints


def save(trainer) -> Path:
    """`global_step_N/`: the roles' state and the trainer's own (step, data-loader position, KL controller,
    asynchronous scheduler, RNG), the configs and tokenizer; atomic."""
    state = {"global_step": trainer.global_step, "loader": trainer.loader.state_dict(),
             "kl_ctrl": trainer.kl_ctrl.state_dict()}
    if trainer.scheduler is not None:
        state["async"] = trainer.scheduler.state_dict()
    if "extra" in trainer.config.actor_rollout_ref.actor.checkpoint.save_contents:
        state["rng"] = capture_rng_state()
    return role_checkpoints(trainer).save(trainer.global_step, state, config_yaml=config_to_yaml(trainer.config))


def load(trainer, path: Path) -> None:
    """Resume from `global_step_N/` (full or sharded, written by any number of workers)."""
    state = role_checkpoints(trainer).load(path)
    trainer.global_step = int(state["global_step"])
    trainer.loader.load_state_dict(state["loader"])
    trainer.kl_ctrl.load_state_dict(state["kl_ctrl"])
    if trainer.scheduler is None and "async" in state:
        raise ValueError(f"checkpoint {path} was saved by an asynchronous run (async_training.mode) with prompts "
                         "admitted but not trained yet, which a synchronous run would skip; resume it with the "
                         "async_training settings it was saved with")
    if trainer.scheduler is not None:
        if "async" not in state:
            raise ValueError(f"checkpoint {path} was saved by a synchronous run; resume it with "
                             "async_training.mode=sync, or start the asynchronous run in a new directory")
        trainer.scheduler.load_state_dict(state["async"], step=trainer.global_step)
    if "rng" in state and "extra" in trainer.config.actor_rollout_ref.actor.checkpoint.load_contents:
        restore_rng_state(state["rng"])
    freq = trainer.config.trainer.ref_update_freq
    if freq > 0 and trainer.global_step >= freq:  # the reference took the actor's weights at the last multiple
        if trainer.global_step % freq:
            raise ValueError(f"checkpoint {path} is of step {trainer.global_step}, not a multiple of "
                             f"trainer.ref_update_freq={freq}: the reference policy of that step (the actor of "
                             f"step {trainer.global_step - trainer.global_step % freq}) is not in it; resume from a "
                             "checkpoint of a multiple")
        trainer.actor.update_reference()
    print(f"resumed from {path} at step {trainer.global_step}")
