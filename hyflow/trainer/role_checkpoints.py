"""The roles' part of an RL checkpoint: what each trained role saves into `global_step_N/` and loads back.

`CheckpointManager` (checkpoint.py) stores named components atomically and knows no roles; `RoleCheckpoints`
sits beside it and knows the roles that hold training state: those of the role registry with a `checkpoint`
section (`hyflow.trainer.role_registry`: the actor, the critic, PRIME's PRM) that the run has (`role_states`):

- save: per role, `trainer.checkpoint_format` picks the layout: `full` (rank 0 gathers the role's state dict
  into components `<role>_model`, `<role>_optimizer`, ...) or `sharded` (every rank writes its shards with
  torch.distributed.checkpoint into `global_step_N/<role>/`, which must then hold every rank's files); `auto`
  is sharded for a role with more than one worker, else full. The role's `checkpoint.save_contents` says what
  is saved. The trainer's own state (`trainer_state`), the run config, the tokenizer and the policy's model
  and generation configs go into the same directory; `hf_model` in the actor's save_contents adds a full
  Hugging Face model directory (a collective gather of the policy).
- load: each role from its shards or its full components, whatever world size wrote them; what the role's
  `checkpoint.load_contents` asks for and the checkpoint lacks starts fresh, with a warning that names it. A
  role the checkpoint does not hold is an error. Returns the trainer's own state for the trainer to restore.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyflow.trainer.checkpoint import CheckpointManager
from hyflow.workers.fsdp import sharded_checkpoint_problem


@dataclass(frozen=True)
class RoleState:
    """A role whose training state checkpoints hold: its worker group (view) and what to save and load of it
    (`checkpoint.save_contents` / `load_contents`: model, optimizer, extra, hf_model)."""

    group: Any
    save_contents: tuple[str, ...]
    load_contents: tuple[str, ...]


def role_states(roles, cfg) -> dict[str, RoleState]:
    """name -> RoleState of every role of `roles` (`hyflow.trainer.roles.Roles`) that holds training state, in the
    registry's order (the actor first): its view and the save / load contents of its checkpoint section's
    `checkpoint` (e.g. `actor_rollout_ref.actor.checkpoint`) in `cfg`."""
    states = {}
    for name, (group, section) in roles.checkpointed().items():
        ckpt = functools.reduce(getattr, section.split("."), cfg).checkpoint
        states[name] = RoleState(group, tuple(ckpt.save_contents), tuple(ckpt.load_contents))
    return states


def checkpoint_layout(checkpoint_format: str, world_size: int) -> str:
    """`trainer.checkpoint_format` for a role of `world_size` workers: auto -> sharded when it has more than one."""
    return ("sharded" if world_size > 1 else "full") if checkpoint_format == "auto" else checkpoint_format


def write_shards(name: str, group, contents: list[str], directory: Path) -> dict:
    """Have every rank of `group` write its shards into `directory`; check that all of them arrived."""
    group.save_sharded_checkpoint(str(directory), contents)
    problem = sharded_checkpoint_problem(directory)
    if problem is not None:
        raise RuntimeError(
            f"the {name}'s sharded checkpoint is incomplete: {problem}. Every rank writes its shards into the "
            "run directory, so it must be one that every node sees: put trainer.default_local_dir on a shared "
            "filesystem, or set trainer.checkpoint_format=full (rank 0 gathers and writes everything)")
    return {"format": "torch.distributed.checkpoint", "world_size": group.world_size, "contents": contents,
            "model_component": f"{name}_model"}


def policy_model_configs(model_cfg) -> tuple:
    """(hf_config, generation_config) of the policy at `model_cfg.path` (with `override_config` applied), for
    exportable checkpoints; a model without generation_config.json gets one derived from its config."""
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
    for key, value in dict(model_cfg.override_config or {}).items():
        setattr(hf_config, key, value)
    try:
        generation_config = GenerationConfig.from_pretrained(model_cfg.path)
    except OSError:  # a checkpoint without generation_config.json
        generation_config = GenerationConfig.from_model_config(hf_config)
    return hf_config, generation_config


class RoleCheckpoints:
    """Save and load the roles' state beside the trainer's own (see the module docstring).

    `roles`: role name -> RoleState, the actor first (its group exports the full policy for `hf_model`);
    `model_cfg`: the policy's model section (`path`, `trust_remote_code`, `override_config`), read once, at the
    first save; `tokenizer`: saved with every checkpoint.
    """

    def __init__(self, manager: CheckpointManager, roles: dict[str, RoleState], *, checkpoint_format: str,
                 model_cfg, tokenizer=None) -> None:
        self.manager, self.roles, self.checkpoint_format = manager, roles, checkpoint_format
        self.model_cfg, self.tokenizer = model_cfg, tokenizer
        self._configs: tuple | None = None

    def save(self, step: int, trainer_state: dict, *, config_yaml: str | None = None) -> Path:
        """`global_step_<step>/`: the roles' state (full state dicts, or every rank's shards), `trainer_state`,
        the config, tokenizer and the policy's configs (+ the full model with `hf_model`); atomic."""
        components: dict = {}
        sharded: dict = {}
        for name, role in self.roles.items():
            contents = list(role.save_contents)
            if checkpoint_layout(self.checkpoint_format, role.group.world_size) == "sharded":
                sharded[name] = functools.partial(write_shards, name, role.group, contents)
            else:
                components.update(role.group.state_dict(contents))
        components["trainer_state"] = trainer_state
        policy = next(iter(self.roles.values()))
        model = None
        if "hf_model" in policy.save_contents:
            model, _ = policy.group.hf_model()  # a collective gather of the full model: only when asked
        if self._configs is None:
            self._configs = policy_model_configs(self.model_cfg)
        hf_config, generation_config = self._configs
        return self.manager.save(step, components, hf_model=model, tokenizer=self.tokenizer, hf_config=hf_config,
                                 generation_config=generation_config, config_yaml=config_yaml, sharded=sharded)

    def load(self, path: Path) -> dict:
        """Load every role from `global_step_N/` (full or sharded, written by any number of workers); returns the
        trainer's own state (`trainer_state`)."""
        components = self.manager.load(path, verify=False)
        sharded = self.manager.sharded_dirs(path)
        for name, role in self.roles.items():
            group, contents = role.group, list(role.load_contents)
            if name in sharded:
                saved = sharded[name].get("contents", [])
                group.load_sharded_checkpoint(str(sharded[name]["path"]), contents)
            elif f"{name}_model" in components:
                saved = ["model"] + [part for part, key in (("optimizer", "optimizer"), ("extra", "scheduler"))
                                     if f"{name}_{key}" in components]
                group.load_state_dict({k: v for k, v in components.items() if k.startswith(f"{name}_")}, contents)
            else:
                raise ValueError(
                    f"checkpoint {path} holds no {name} state (it was saved by a run without a {name}), but this "
                    f"config has one; resume with the config of the run that saved it, or start a new run "
                    "(trainer.resume_mode=disable or another trainer.default_local_dir)")
            fresh = [part for part in ("optimizer", "extra") if part in contents and part not in saved]
            if fresh:
                warnings.warn(f"checkpoint {path} has no {name} {' or '.join(fresh)} state (saved with "
                              f"save_contents={saved}): {', '.join(fresh)} start(s) fresh", stacklevel=3)
        return components["trainer_state"]
