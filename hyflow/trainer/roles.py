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

The roles are data: `hyflow.trainer.role_registry.ROLES` lists each one's worker class, spec, config section,
placement and checkpoint section, and `build_roles` starts those whose spec the run's `RoleSpecs` holds. With
`executor=local` every group is one worker in this process; with `ray` each group reserves a Ray resource pool of
its devices. The models are loaded (`init_model`) in the registry's order (actor, critic, reward model / judge /
PRM, teacher), the rollout pool's last. Every worker receives its spec (`hyflow.config.roles.role_specs`, derived
once) and never the whole config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hyflow.config.arithmetic import own_pool_roles, role_pool_shape
from hyflow.config.roles import uses_judge, with_reward_model
from hyflow.config.schema import HyflowConfig
from hyflow.controller import make_colocated_class, make_worker_group
from hyflow.controller.resources import local_cluster_capacity
from hyflow.specs import RoleSpecs
from hyflow.trainer.role_registry import ROLES, RoleDefinition


def has_rollout_pool(cfg: HyflowConfig) -> bool:
    """Whether an asynchronous run generates on devices of its own (`rollout.n_gpus_per_node` > 0)."""
    return cfg.async_training.mode != "sync" and cfg.rollout.n_gpus_per_node > 0


class Roles(Mapping):
    """The role views the trainer calls, by name (`roles["actor"]`, or as attributes: `roles.actor`; a role the
    run does not have reads None as an attribute and is absent from the mapping), the colocated group
    (`workers`), every worker group in creation order (`groups`) and the Ray resource pools (`pools`);
    `definitions`: the present roles' `RoleDefinition`s by name (`hyflow.trainer.role_registry.ROLES`)."""

    def __init__(self) -> None:
        self.views: dict[str, Any] = {}
        self.definitions: dict[str, RoleDefinition] = {}
        self.workers: Any = None
        self.groups: list = []
        self.pools: list = []

    def __getitem__(self, name: str) -> Any:
        return self.views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.views)

    def __len__(self) -> int:
        return len(self.views)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("views", "definitions"):
            raise AttributeError(name)
        if name in self.views:
            return self.views[name]
        if any(definition.view == name for definition in ROLES.values()):
            return None  # a role this run does not have
        raise AttributeError(f"{type(self).__name__} has no role or attribute {name!r}; roles: {', '.join(ROLES)}")

    def checkpointed(self) -> dict[str, tuple[Any, str]]:
        """The roles that hold training state, in the registry's order: name -> (view, the config section whose
        `checkpoint` save/load contents it follows)."""
        return {d.name: (self.views[d.view], d.checkpoint) for d in self.definitions.values()
                if d.checkpoint is not None}

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
    `specs`, load every model (`init_model`) and return the `Roles`. The roles are the registry's
    (`hyflow.trainer.role_registry.ROLES`) whose spec `specs` holds. `tokenizer`: the policy's, handed to the
    workers that need it; `judge`: the reward model is generative (a `JudgeWorker` instead of the classifier's
    worker), when `specs` was derived without saying (`role_specs(judge=None)`); `total_steps`: unused (the
    specs carry the LR schedules' lengths). A failure part-way stops what was started before it is raised."""
    del total_steps
    if uses_judge(cfg) and specs.judge is None and specs.reward_model is None:
        specs = with_reward_model(cfg, specs, judge=judge)  # the model's architecture decided the reward model's kind
    roles = Roles()
    try:
        _start(roles, cfg, specs, executor, tokenizer)
    except BaseException:
        roles.shutdown()
        raise
    return roles


def present_roles(cfg: HyflowConfig, specs: RoleSpecs) -> list[tuple[RoleDefinition, Any]]:
    """(definition, spec) of every registered role this run has, in the registry's order."""
    found = []
    for definition in ROLES.values():
        spec = getattr(specs, definition.spec)
        if spec is None or (definition.placement == "rollout_pool" and not has_rollout_pool(cfg)):
            continue
        found.append((definition, spec))
    return found


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """One worker group a run starts: the roles its processes host, on `nnodes` x `devices_per_node` workers."""

    definitions: tuple[RoleDefinition, ...]
    nnodes: int
    devices_per_node: int
    name: str


def planned_pools(cfg: HyflowConfig, specs: RoleSpecs) -> list[PoolPlan]:
    """The worker groups `build_roles` starts, in its order: the colocated roles (the actor and every role without
    a pool of its own) on trainer.nnodes x trainer.n_gpus_per_node, then each role with a pool of its own, an
    asynchronous run's rollout pool last."""
    present = [d for d, _ in present_roles(cfg, specs)]
    pools = own_pool_roles(cfg)
    colocated = tuple(d for d in present if d.placement == "colocated" and d.section not in pools)
    plans = [PoolPlan(colocated, cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, "HybridWorker")]
    for placement in ("colocated", "rollout_pool"):
        for d in present:
            if d.placement != placement or d in colocated:
                continue
            shape = ((cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) if placement == "rollout_pool"
                     else role_pool_shape(cfg, d.section))
            name = "RolloutHost" if placement == "rollout_pool" else f"{d.worker.__name__}Host"
            plans.append(PoolPlan((d,), *shape, name))
    return plans


def uses_gpu(cfg: HyflowConfig) -> bool:
    """Whether Ray workers reserve a GPU each: trainer.device=cuda, or auto on a machine with CUDA."""
    return cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())


def check_local_ray_cluster(cfg: HyflowConfig, specs: RoleSpecs, ray_init: Mapping[str, Any]) -> None:
    """Before a local Ray cluster starts (executor=ray, no address to attach to): raise ValueError when it can never
    hold the run's worker groups, naming what they need, what this machine gives and the fix, instead of starting
    Ray (and importing everything) to find out. A local cluster is this one machine: ray_init's num_cpus /
    num_gpus, else Ray's own count of its CPUs and torch's of its CUDA devices. Each worker takes 1 CPU (and 1 GPU
    when `uses_gpu`)."""
    plans = planned_pools(cfg, specs)
    groups = "; ".join(f"{' + '.join(d.name for d in p.definitions)}: {p.nnodes} x {p.devices_per_node}"
                       for p in plans)
    nodes = max(p.nnodes for p in plans)
    if nodes > 1:
        raise ValueError(f"the worker groups ({groups}, nodes x devices per node) span {nodes} nodes, but a local "
                         "Ray cluster (ray_kwargs.address unset) is this one machine: start a cluster of "
                         f"{nodes} nodes (ray start --head on one, ray start --address on the others) and set "
                         "ray_kwargs.address to it, or set trainer.nnodes=1")
    workers = sum(p.nnodes * p.devices_per_node for p in plans)
    cpus, gpus, cpu_source, gpu_source = local_cluster_capacity(ray_init)
    if uses_gpu(cfg) and workers > gpus:
        raise ValueError(f"the worker groups ({groups}) need {workers} GPUs (trainer.device={cfg.trainer.device}: "
                         f"one per worker), and this machine has {gpus:g} ({gpu_source}); lower "
                         "trainer.n_gpus_per_node (and the pools' own n_gpus_per_node), or set trainer.device=cpu "
                         "to run the workers on CPU")
    if workers > cpus:
        raise ValueError(f"the worker groups ({groups}) are {workers} worker processes of 1 CPU each, and a local "
                         f"Ray cluster here has {cpus:g} CPU{'s' if cpus != 1 else ''} ({cpu_source}); set "
                         f"ray_kwargs.ray_init.num_cpus={workers} to run them anyway (they share the cores), or "
                         "lower trainer.n_gpus_per_node (and the pools' own n_gpus_per_node)")


def _start(roles: Roles, cfg: HyflowConfig, specs: RoleSpecs, executor: str, tokenizer) -> None:
    present = present_roles(cfg, specs)
    roles.definitions = {d.name: d for d, _ in present}
    kwargs = {d.view: {"spec": spec, **({"tokenizer": tokenizer} if d.tokenizer else {})} for d, spec in present}
    first, *own = planned_pools(cfg, specs)
    roles.workers = _group(roles, cfg, executor, make_colocated_class({d.view: d.worker for d in first.definitions},
                                                                      name=first.name),
                           first.nnodes, first.devices_per_node, **{d.view: kwargs[d.view] for d in first.definitions})
    roles.views.update({d.view: roles.workers.role(d.view) for d in first.definitions})
    # then each role with a pool of its own; an asynchronous run's rollout pool last, after the others loaded
    for placement in ("colocated", "rollout_pool"):
        for plan in own:
            (d,) = plan.definitions
            if d.placement == placement:
                group = _group(roles, cfg, executor, make_colocated_class({d.view: d.worker}, name=plan.name),
                               plan.nnodes, plan.devices_per_node, **{d.view: kwargs[d.view]})
                roles.views[d.view] = group.role(d.view)
        for d, _ in present:  # the models load in the registry's order
            if d.placement == placement:
                roles.views[d.view].init_model()


def _group(roles: Roles, cfg: HyflowConfig, executor: str, worker_cls, nnodes: int = 1, devices_per_node: int = 1,
           **kwargs):
    """One worker per device: in this process (`local`), or as Ray actors on a pool of `nnodes` x
    `devices_per_node` devices reserved for this group (`ray`); recorded in `roles.groups` (and `roles.pools`)."""
    if executor == "local":
        group = make_worker_group("local", worker_cls, world_size=1, **kwargs)
    else:
        from hyflow.controller.resources import RayResourcePool

        pool = RayResourcePool(nnodes, devices_per_node, use_gpu=uses_gpu(cfg), cpus_per_worker=1.0,
                               ready_timeout_s=float(cfg.trainer.ray_wait_register_center_timeout))
        roles.pools.append(pool)
        group = make_worker_group("ray", worker_cls, world_size=nnodes * devices_per_node, pool=pool, **kwargs)
    roles.groups.append(group)
    return group
