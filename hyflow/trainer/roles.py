"""Building an RL run's roles: worker groups on devices, each worker given its role's spec.

HybridFlow's placement, as the trainer runs it:

- one process per device (`trainer.nnodes` x `trainer.n_gpus_per_node`) hosts every colocated role: the actor
  (+ its rollout engine and reference policy), the critic and the reward model unless they have pools of their
  own (one colocated Worker class, `make_colocated_class`, the trainer talks to one view per role);
- PRIME's implicit process reward model (algorithm.adv_estimator=prime) is the reward model's role: colocated,
  or in the reward model's own pool with reward_model.enable_resource_pool;
- a critic or reward model with `<role>.enable_resource_pool` runs in worker processes of its own, on its own
  `<role>.nnodes` x `<role>.n_gpus_per_node` devices; so does on-policy distillation's teacher with
  `distillation.nnodes` > 0 (else it is colocated);
- an asynchronous run with `rollout.n_gpus_per_node` > 0 generates on a rollout pool of its own
  (`RolloutWorker`s on `rollout.nnodes` x `rollout.n_gpus_per_node` devices).

With `executor=local` every group is one worker in this process; with `ray` each group reserves a Ray resource
pool of its devices. The models are loaded (`init_model`) in the order actor, critic, reward model, rollout pool.
Every worker receives its spec (`hyflow.config.roles.role_specs`, derived once) and never the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hyflow.config.arithmetic import own_pool_roles, role_pool_shape, uses_prm
from hyflow.config.roles import judge_spec, prm_spec, reward_model_spec, teacher_spec
from hyflow.config.schema import HyflowConfig
from hyflow.controller import make_colocated_class, make_worker_group
from hyflow.specs import RoleSpecs
from hyflow.workers.actor import ActorRolloutRefWorker
from hyflow.workers.critic import CriticWorker
from hyflow.workers.judge import JudgeWorker
from hyflow.workers.prm import ImplicitPRMWorker
from hyflow.workers.reward_model import RewardModelWorker
from hyflow.workers.teacher import TeacherWorker

SECTIONS = {"critic": "critic", "rm": "reward_model", "prm": "reward_model", "teacher": "distillation"}  # worker role -> its config section (own pools)


def has_rollout_pool(cfg: HyflowConfig) -> bool:
    """Whether an asynchronous run generates on devices of its own (`rollout.n_gpus_per_node` > 0)."""
    return cfg.async_training.mode != "sync" and cfg.rollout.n_gpus_per_node > 0


@dataclass
class Roles:
    """The role views the trainer calls (`actor`, `critic` / `reward_model` when the run has them, `rollout` for
    the rollout pool of an asynchronous run, else None), the colocated group (`workers`), every worker group in
    creation order (`groups`) and the Ray resource pools (`pools`)."""

    actor: Any = None
    critic: Any = None
    reward_model: Any = None
    prm: Any = None
    teacher: Any = None
    rollout: Any = None
    workers: Any = None
    groups: list = field(default_factory=list)
    pools: list = field(default_factory=list)

    def shutdown(self) -> None:
        """Stop every worker group, then release the Ray resource pools."""
        for group in self.groups:
            group.shutdown()
        self.groups, self.workers = [], None
        for pool in self.pools:
            pool.remove()
        self.pools = []


def build_roles(cfg: HyflowConfig, specs: RoleSpecs, *, executor: str, tokenizer=None, judge: bool = False,
                total_steps: int = 1) -> Roles:
    """Start the worker groups of `cfg`'s roles on `executor` (local or ray), hand each worker its spec from
    `specs`, load every model (`init_model`) and return the `Roles`. `tokenizer`: the policy's, handed to the
    workers that need it; `judge`: the reward model is generative (a `JudgeWorker` instead of the classifier's
    worker); `total_steps`: the run's training steps (the implicit PRM's LR schedule). A failure part-way stops
    what was started before it is raised."""
    roles = Roles()
    try:
        _start(roles, cfg, specs, executor, tokenizer, judge, total_steps)
    except BaseException:
        roles.shutdown()
        raise
    return roles


def _start(roles: Roles, cfg: HyflowConfig, specs: RoleSpecs, executor: str, tokenizer, judge: bool,
           total_steps: int) -> None:
    classes = {"actor": ActorRolloutRefWorker}
    role_kwargs = {"actor": {"spec": specs.actor, "tokenizer": tokenizer}}
    if specs.critic is not None:
        classes["critic"], role_kwargs["critic"] = CriticWorker, {"spec": specs.critic}
    if uses_prm(cfg):  # PRIME: the reward model section is the implicit PRM, trained beside the actor
        classes["prm"], role_kwargs["prm"] = ImplicitPRMWorker, {
            "spec": prm_spec(cfg, n_devices=specs.batches.n_devices, total_steps=total_steps)}
    elif judge:  # a generative reward model: a judge on an engine of its own (hyflow.workers.judge)
        classes["rm"], role_kwargs["rm"] = JudgeWorker, {"spec": judge_spec(cfg)}
    elif cfg.reward_model.enable:  # the reward model's spec is derived here (`reward_model_spec`)
        rm_spec = reward_model_spec(cfg, n_devices=specs.batches.n_devices)
        classes["rm"], role_kwargs["rm"] = RewardModelWorker, {"spec": rm_spec, "tokenizer": tokenizer}
    if cfg.distillation.enabled:  # on-policy distillation's teachers (hyflow.workers.teacher)
        classes["teacher"], role_kwargs["teacher"] = TeacherWorker, {"spec": teacher_spec(cfg)}
    separate = [role for role in classes if SECTIONS.get(role) in own_pool_roles(cfg)]
    colocated = {role: cls for role, cls in classes.items() if role not in separate}
    t = cfg.trainer
    roles.workers = _group(roles, cfg, executor, make_colocated_class(colocated, name="HybridWorker"), t.nnodes,
                           t.n_gpus_per_node, **{role: role_kwargs[role] for role in colocated})
    views = {role: roles.workers.role(role) for role in colocated}
    for role in separate:
        group = _group(roles, cfg, executor, make_colocated_class({role: classes[role]},
                                                                  name=f"{classes[role].__name__}Host"),
                       *role_pool_shape(cfg, SECTIONS[role]), **{role: role_kwargs[role]})
        views[role] = group.role(role)
    roles.actor, roles.critic, roles.reward_model = views["actor"], views.get("critic"), views.get("rm")
    roles.teacher, roles.prm = views.get("teacher"), views.get("prm")
    roles.actor.init_model()
    if roles.critic is not None:
        roles.critic.init_model()
    if roles.reward_model is not None:
        roles.reward_model.init_model()
    if roles.prm is not None:
        roles.prm.init_model()
    if roles.teacher is not None:
        roles.teacher.init_model()
    if has_rollout_pool(cfg):
        from hyflow.workers.rollout import RolloutWorker

        group = _group(roles, cfg, executor, make_colocated_class({"rollout": RolloutWorker}, name="RolloutHost"),
                       cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node,
                       rollout={"spec": specs.rollout, "tokenizer": tokenizer})
        roles.rollout = group.role("rollout")
        roles.rollout.init_model()


def _group(roles: Roles, cfg: HyflowConfig, executor: str, worker_cls, nnodes: int = 1, devices_per_node: int = 1,
           **kwargs):
    """One worker per device: in this process (`local`), or as Ray actors on a pool of `nnodes` x
    `devices_per_node` devices reserved for this group (`ray`); recorded in `roles.groups` (and `roles.pools`)."""
    if executor == "local":
        group = make_worker_group("local", worker_cls, world_size=1, **kwargs)
    else:
        from hyflow.controller.resources import RayResourcePool

        t = cfg.trainer
        use_gpu = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
        pool = RayResourcePool(nnodes, devices_per_node, use_gpu=use_gpu, cpus_per_worker=1.0,
                               ready_timeout_s=float(t.ray_wait_register_center_timeout))
        roles.pools.append(pool)
        group = make_worker_group("ray", worker_cls, world_size=nnodes * devices_per_node, pool=pool, **kwargs)
    roles.groups.append(group)
    return group
