"""Control layer: worker base class, dispatch decorators, worker groups, executors. Knows no RL."""

from hyflow.controller.dispatch import (
    Collect,
    Dispatch,
    DispatchMode,
    collect_results,
    reduce_metrics,
    register,
    registered_methods,
    split_args,
)
from hyflow.controller.group import LocalWorkerGroup, RoleView, WorkerError, WorkerGroup
from hyflow.controller.worker import (
    Placement,
    Worker,
    free_port,
    make_colocated_class,
    placement_from_env,
    use_placement,
)

__all__ = [
    "Collect",
    "Dispatch",
    "DispatchMode",
    "LocalWorkerGroup",
    "Placement",
    "RoleView",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "collect_results",
    "free_port",
    "make_colocated_class",
    "placement_from_env",
    "reduce_metrics",
    "register",
    "registered_methods",
    "split_args",
    "use_placement",
]
