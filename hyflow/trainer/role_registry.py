"""The RL run's roles as data: one `RoleDefinition` per role, in `ROLES`, which `build_roles` iterates.

A definition says what the role is built from and where it runs, nothing about what the trainer asks of it:

| field        | meaning                                                                                           |
|--------------|---------------------------------------------------------------------------------------------------|
| `name`       | the role's name: its checkpoint's (`global_step_N/<name>/`, `<name>_model`, ...)                  |
| `view`       | the name the trainer reaches it by, `roles[view]` / `roles.<view>`, and its name in a colocated   |
|              | worker (default `name`; a generative judge serves as the reward model)                            |
| `worker`     | its Worker class                                                                                  |
| `spec`       | the `RoleSpecs` field holding its spec (`hyflow.config.roles.role_specs`); None: not in this run  |
| `section`    | the config section whose `enable_resource_pool` / `nnodes` / `n_gpus_per_node` give it a pool of  |
|              | its own (`hyflow.config.arithmetic.own_pool_roles`); None: always with the actor                  |
| `placement`  | "colocated" (one process per device with the actor, unless `section` has a pool of its own) or    |
|              | "rollout_pool" (an asynchronous run's rollout on devices of its own, only with those devices)     |
| `checkpoint` | the config section whose `checkpoint.save_contents` / `load_contents` its training state follows; |
|              | None: no training state (frozen models, engines)                                                  |
| `tokenizer`  | its worker takes the policy's tokenizer                                                           |

A new role = its worker file, its spec (a `RoleSpecs` field derived by a spec function in
`hyflow.config.roles`) and one entry here; its models load (`init_model`) in this table's order.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyflow.registry import Registry
from hyflow.workers.actor import ActorRolloutRefWorker
from hyflow.workers.critic import CriticWorker
from hyflow.workers.judge import JudgeWorker
from hyflow.workers.prm import ImplicitPRMWorker
from hyflow.workers.reward_model import RewardModelWorker
from hyflow.workers.rollout import RolloutWorker
from hyflow.workers.teacher import TeacherWorker

ROLES = Registry("role", hint="add a RoleDefinition with ROLES.register(name, RoleDefinition(...)) in "
                              "hyflow.trainer.role_registry")


@dataclass(frozen=True)
class RoleDefinition:
    """One role of an RL run (the module docstring's table)."""

    name: str
    worker: type
    spec: str
    section: str | None = None
    placement: str = "colocated"
    checkpoint: str | None = None
    tokenizer: bool = False
    view: str = ""

    def __post_init__(self) -> None:
        if not self.view:
            object.__setattr__(self, "view", self.name)


for definition in (
    RoleDefinition("actor", ActorRolloutRefWorker, spec="actor",
                   checkpoint="actor_rollout_ref.actor", tokenizer=True),
    RoleDefinition("critic", CriticWorker, spec="critic", section="critic",
                   checkpoint="critic"),
    # the reward model's slot: a classifier, a generative judge, or PRIME's implicit PRM (trained; saved with the
    # actor's checkpoint contents, as verl-recipe prime)
    RoleDefinition("reward_model", RewardModelWorker, spec="reward_model",
                   section="reward_model", tokenizer=True),
    RoleDefinition("judge", JudgeWorker, spec="judge", section="reward_model",
                   view="reward_model"),
    RoleDefinition("prm", ImplicitPRMWorker, spec="prm", section="reward_model",
                   checkpoint="actor_rollout_ref.actor"),
    RoleDefinition("teacher", TeacherWorker, spec="teacher", section="distillation"),
    RoleDefinition("rollout", RolloutWorker, spec="rollout", placement="rollout_pool",
                   tokenizer=True),
):
    ROLES.register(definition.name, definition)
