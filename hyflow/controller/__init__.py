"""Control layer: worker base class, dispatch decorators, worker groups, executors. Knows no RL."""

from hyflow.controller.dispatch import (
    Collect,
    Dispatch,
    DispatchMode,
    collect_results,
    register,
    registered_methods,
    split_args,
)
from hyflow.controller.factory import EXECUTORS, make_worker_group
from hyflow.controller.group import LocalWorkerGroup, PendingCall, RoleView, WorkerError, WorkerGroup
from hyflow.controller.ray_group import (
    RankLocation,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerTimeoutError,
    describe_placement,
)
from hyflow.controller.resources import RayResourcePool, ensure_ray, shutdown_ray
from hyflow.controller.worker import (
    Placement,
    Worker,
    free_port,
    make_colocated_class,
    placement_from_env,
    use_placement,
)

__all__ = [
    "EXECUTORS",
    "Collect",
    "Dispatch",
    "DispatchMode",
    "LocalWorkerGroup",
    "PendingCall",
    "Placement",
    "RankLocation",
    "RayResourcePool",
    "RayWorkerGroup",
    "RoleView",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerTimeoutError",
    "collect_results",
    "describe_placement",
    "ensure_ray",
    "free_port",
    "make_colocated_class",
    "make_worker_group",
    "placement_from_env",
    "register",
    "registered_methods",
    "shutdown_ray",
    "split_args",
    "use_placement",
]
