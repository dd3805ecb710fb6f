"""Pick an executor by name: `make_worker_group("local" | "ray", worker_cls, *args, world_size=N, **kwargs)`.

The trainer builds every role's group through this one call, so switching a run between one debuggable
process (`local`) and N Ray actor processes with torch.distributed (`ray`) is a config value
(`trainer.executor`), not a code change.
"""

from __future__ import annotations

from hyflow.controller.group import LocalWorkerGroup, WorkerGroup
from hyflow.controller.worker import Worker

EXECUTORS = ("local", "ray")


def make_worker_group(executor: str, worker_cls: type[Worker], *args, world_size: int, pool=None,
                      env: dict[str, str] | None = None, timeout_s: float | None = None,
                      **kwargs) -> WorkerGroup:
    """A `LocalWorkerGroup` ("local") or `RayWorkerGroup` ("ray") of `worker_cls(*args, **kwargs)`.

    `pool` (a `RayResourcePool`), `env` and `timeout_s` are options of the ray executor only; the ray
    executor needs a Ray connection first (`ensure_ray()`).
    """
    if executor == "local":
        given = [name for name, value in (("pool", pool), ("env", env), ("timeout_s", timeout_s))
                 if value is not None]
        if given:
            raise ValueError(f"{given} are options of the ray executor; drop them for executor='local'")
        return LocalWorkerGroup(worker_cls, *args, world_size=world_size, **kwargs)
    if executor == "ray":
        from hyflow.controller.ray_group import RayWorkerGroup

        return RayWorkerGroup(worker_cls, *args, world_size=world_size, pool=pool, env=env,
                              timeout_s=timeout_s, **kwargs)
    raise ValueError(f"unknown executor {executor!r}; valid: {list(EXECUTORS)}")
