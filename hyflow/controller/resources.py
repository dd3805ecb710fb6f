"""Ray clusters and resource pools for the `ray` executor.

`ensure_ray()` attaches to a running Ray cluster (`address="auto"` or `"host:port"`, or with no address the
`RAY_ADDRESS` environment variable, as `ray.init()` and `ray job submit` use it) or starts a local one whose every
socket listens on 127.0.0.1. Ray picks its node address when `ray` is *imported*
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`, read into `ray._private.ray_constants.ENABLE_RAY_CLUSTER`): with the
variable unset it binds the machine's external interface even when told `_node_ip_address="127.0.0.1"`.
So the variable is exported before the cluster starts (its processes inherit it) and the constant is
pinned in this process too, in case `ray` was imported earlier.

`RayResourcePool(nnodes, devices_per_node)` reserves the devices of a training job the way HybridFlow
(arXiv 2409.19256, verl's `RayResourcePool`) does: one Ray placement group per node, one bundle per
device (`{"GPU": 1, "CPU": cpus_per_worker}`, or `{"CPU": cpus_per_worker}` on a CPU pool), packed onto
one node (`STRICT_PACK`). The groups are sorted by (node IP, node ID), so global rank
r = node_index * devices_per_node + local_rank is the same on every start of the same cluster (sharded
checkpoints resume onto the same ranks). Unlike a bare `placement_group(...).ready()`, a pool that the
cluster can never hold fails at once, and one that it cannot hold *now* fails after `ready_timeout_s`,
both naming the missing resources, instead of waiting forever.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any

LOOPBACK = "127.0.0.1"
_STARTED_LOCAL = False
_FIX_HINT = ("lower trainer.n_gpus_per_node or trainer.nnodes (or the pool's cpus_per_worker), or give Ray "
             "more resources (ray_kwargs.ray_init.num_cpus / num_gpus, or more nodes)")


def import_ray():
    """The `ray` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("the ray executor needs Ray: pip install 'ray[default]>=2.40' (or use the local "
                          "executor)") from err
    return ray


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolve_auto(address: str) -> str:
    """"auto" -> the address Ray would use (RAY_ADDRESS or the last cluster started here), else unchanged."""
    if address != "auto":
        return address
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment("auto", None) or address
    except Exception:
        return address


def _pin_loopback() -> None:
    """Keep Ray on 127.0.0.1 in this process and in every process it starts (see the module docstring).

    Also turns Ray's metrics collection off for a loopback cluster unless `RAY_enable_metrics_collection` is set:
    a cluster on 127.0.0.1 has no dashboard to show them (hyflow starts its own without one), and Ray 2.60's
    OpenTelemetry reader thread crashed a CPU example's driver with SIGSEGV (`TemporalMetricStorage::buildMetrics`,
    once in CI). Export RAY_enable_metrics_collection=1 to keep them.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def ensure_ray(address: str | None = None, *, num_cpus: float | None = None,
               ray_init: dict | None = None) -> bool:
    """Connect this process to Ray; True when it started a new local cluster (stop it with `shutdown_ray`).

    address: "auto" or "host:port" attaches to a running cluster; None attaches to `RAY_ADDRESS` when that
    environment variable is set (as `ray.init()` does: `ray job submit` sets it for its entrypoint, and a driver
    on a node of a `ray start` cluster can export it), else starts a local cluster on 127.0.0.1 (no dashboard,
    usage stats off) with `num_cpus` logical CPUs (Ray's default: the machine's cores; ask for more than the
    cores to fit several fractional-CPU workers); `RAY_ADDRESS=local` also starts one. `ray_init` holds extra
    `ray.init` keyword arguments (verl's `ray_kwargs.ray_init`); an explicit `num_cpus` wins over
    `ray_init["num_cpus"]`. Does nothing and returns False when Ray is already initialised.
    """
    from_env = address is None and os.environ.get("RAY_ADDRESS", "local") not in ("", "local")
    if from_env:
        address = os.environ["RAY_ADDRESS"]
    local_instead = "unset RAY_ADDRESS" if from_env else "leave the address unset"
    options = dict(ray_init or {})
    runtime_env = _runtime_env(options.pop("runtime_env", None))
    if runtime_env:
        options["runtime_env"] = runtime_env
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    sized = sorted(k for k in ("num_cpus", "num_gpus", "resources") if k in options)
    if address is not None and sized:
        raise ValueError(f"{sized} size a local cluster and cannot be set when attaching to the cluster at "
                         f"{address!r}{' (RAY_ADDRESS)' if from_env else ''}; drop them, or {local_instead} to "
                         "start a local cluster")
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address is not None:
        _connect(ray, address, options, local_instead)
        return False
    _start_local(ray, options)
    return True


def _runtime_env(runtime_env: dict | None) -> dict:
    """verl's `ray_kwargs.ray_init.runtime_env` for ray.init, without its null entries (verl's scripts pass
    `runtime_env.py_executable=null` to mean "this Python"): what remains applies to every worker of the job."""
    if runtime_env is None:
        return {}
    if not isinstance(runtime_env, dict):
        raise ValueError(f"ray_kwargs.ray_init.runtime_env must be a mapping (py_executable, env_vars, "
                         f"working_dir, ...), got {runtime_env!r}")
    return {key: value for key, value in runtime_env.items() if value is not None}


def _connect(ray, address: str, options: dict, local_instead: str) -> None:
    resolved = _resolve_auto(address)
    if _is_loopback(resolved):
        _pin_loopback()
    try:
        _check_reachable(resolved)
        ray.init(address=address, **options)
    except Exception as err:
        raise RuntimeError(f"Ray could not connect to the cluster at {address!r}: {type(err).__name__}: "
                           f"{err}; start it first (ray start --head --node-ip-address=127.0.0.1 "
                           f"--port=6379) or {local_instead} to start a local cluster") from err


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds when nothing listens at "host:port" (ray.init retries for minutes)."""
    if "://" in address or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    if not port.isdigit():
        return
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
        pass


def _start_local(ray, options: dict) -> None:
    global _STARTED_LOCAL
    _pin_loopback()
    options = {"include_dashboard": False, **options}
    try:
        ray.init(address="local", _node_ip_address=LOOPBACK, **options)
    except Exception as err:
        if ray.is_initialized():
            ray.shutdown()
        raise RuntimeError(f"Ray could not start a local cluster: {type(err).__name__}: {err}; free CPUs "
                           "or set ray_kwargs.ray_init.num_cpus") from err
    _STARTED_LOCAL = True


def shutdown_ray() -> bool:
    """Stop the local cluster `ensure_ray` started (True), or do nothing (False): attached clusters live on."""
    global _STARTED_LOCAL
    if not _STARTED_LOCAL:
        return False
    _STARTED_LOCAL = False
    import_ray().shutdown()
    return True


def require_ray():
    """The `ray` module, if this process is connected to a cluster; else a RuntimeError saying what to call."""
    ray = import_ray()
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised in this process; call hyflow.controller.ensure_ray() "
                           "(local cluster on 127.0.0.1) or ensure_ray(address=...) first")
    return ray


@dataclass(frozen=True)
class Slot:
    """Where one rank of a pool runs: its placement group bundle, node and local rank."""

    rank: int
    local_rank: int
    node_index: int
    node_id: str
    node_ip: str
    placement_group: Any
    bundle_index: int


def _ip_key(ip: str) -> tuple:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def _fmt(value: float) -> str:
    return f"{value:g}"


class RayResourcePool:
    """`nnodes` x `devices_per_node` reserved device slots: one STRICT_PACK placement group per node."""

    def __init__(self, nnodes: int = 1, devices_per_node: int = 1, *, use_gpu: bool,
                 cpus_per_worker: float = 1.0, ready_timeout_s: float = 60.0, name: str = "hyflow"):
        """Reserve the bundles and wait until every placement group is placed.

        Raises RuntimeError at once when the cluster's nodes can never hold the pool (too few nodes, or
        no node with `devices_per_node` GPUs / `devices_per_node * cpus_per_worker` CPUs), and after
        `ready_timeout_s` when the resources exist but are held by others; in both cases the error names
        what is missing, and nothing stays reserved.
        """
        if not isinstance(nnodes, int) or nnodes < 1:
            raise ValueError(f"nnodes must be an int >= 1, got {nnodes!r}")
        if not isinstance(devices_per_node, int) or devices_per_node < 1:
            raise ValueError(f"devices_per_node must be an int >= 1, got {devices_per_node!r}")
        if cpus_per_worker < 0 or (cpus_per_worker == 0 and not use_gpu):
            raise ValueError(f"cpus_per_worker must be > 0 on a CPU pool (>= 0 with GPUs), got "
                             f"{cpus_per_worker!r}")
        self.nnodes, self.devices_per_node = nnodes, devices_per_node
        self.use_gpu, self.cpus_per_worker = bool(use_gpu), float(cpus_per_worker)
        self.name = name
        self._owner: object | None = None
        self._ray = require_ray()
        self._check_cluster()
        self._slots: list[Slot] = self._reserve(ready_timeout_s)

    @property
    def world_size(self) -> int:
        """Number of slots (ranks): nnodes * devices_per_node."""
        return self.nnodes * self.devices_per_node

    @property
    def bundle(self) -> dict[str, float]:
        """The resources of one slot."""
        bundle = {"CPU": self.cpus_per_worker} if self.cpus_per_worker else {}
        return {**bundle, "GPU": 1.0} if self.use_gpu else bundle

    @property
    def slots(self) -> list[Slot]:
        """One Slot per rank, in rank order (nodes sorted by IP, then ID); empty after `remove()`."""
        return list(self._slots)

    @property
    def placement_groups(self) -> list:
        """The per-node placement groups, in rank order."""
        return [s.placement_group for s in self._slots if s.local_rank == 0]

    def _need_per_node(self) -> dict[str, float]:
        return {res: amount * self.devices_per_node for res, amount in self.bundle.items()}

    def _describe_need(self) -> str:
        per_node = ", ".join(f"{_fmt(v)} {k}s" for k, v in self._need_per_node().items())
        return (f"{per_node} on each of {self.nnodes} node(s) ({self.nnodes} x {self.devices_per_node} "
                f"workers of {self.bundle})")

    def _check_cluster(self) -> None:
        nodes = [n for n in self._ray.nodes() if n.get("Alive")]
        need = self._need_per_node()
        fitting = [n for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]
        if len(fitting) >= self.nnodes:
            return
        totals = {k: sum(n["Resources"].get(k, 0.0) for n in nodes) for k in ("CPU", "GPU")}
        largest = {k: max((n["Resources"].get(k, 0.0) for n in nodes), default=0.0) for k in ("CPU", "GPU")}
        raise RuntimeError(
            f"the cluster has {_fmt(totals['CPU'])} CPUs/{_fmt(totals['GPU'])} GPUs on {len(nodes)} node(s) "
            f"(largest node: {_fmt(largest['CPU'])} CPUs/{_fmt(largest['GPU'])} GPUs), the worker groups "
            f"need {self._describe_need()}, and only {len(fitting)} node(s) can hold that: {_FIX_HINT}")

    def _reserve(self, ready_timeout_s: float) -> list[Slot]:
        from ray.util import placement_group, remove_placement_group

        groups = [placement_group([self.bundle] * self.devices_per_node, strategy="STRICT_PACK",
                                  name=f"{self.name}_pg{i}_{os.getpid()}_{id(self):x}")
                  for i in range(self.nnodes)]
        ready, _ = self._ray.wait([g.ready() for g in groups], num_returns=len(groups),
                                  timeout=ready_timeout_s)
        if len(ready) < len(groups):
            available = self._ray.available_resources()
            for group in groups:
                remove_placement_group(group)
            have = ", ".join(f"{_fmt(available.get(k, 0.0))} {k}s" for k in ("CPU", "GPU"))
            raise RuntimeError(
                f"only {len(ready)} of {len(groups)} placement groups were placed within {ready_timeout_s:g} "
                f"s: the worker groups need {self._describe_need()}, the cluster has {have} free now "
                f"(others hold the rest: other worker groups or jobs). Shut those down, raise "
                f"ready_timeout_s to wait for them, or {_FIX_HINT}")
        return self._assign_ranks(groups)

    def _assign_ranks(self, groups: list) -> list[Slot]:
        from ray.util import placement_group_table

        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in self._ray.nodes()}
        located = []
        for group in groups:
            node_id = placement_group_table(group)["bundles_to_node_id"][0]
            located.append((_ip_key(node_ips.get(node_id, "")), node_id, node_ips.get(node_id, ""), group))
        located.sort(key=lambda item: item[:2])
        return [Slot(rank=node_index * self.devices_per_node + local_rank, local_rank=local_rank,
                     node_index=node_index, node_id=node_id, node_ip=node_ip, placement_group=group,
                     bundle_index=local_rank)
                for node_index, (_, node_id, node_ip, group) in enumerate(located)
                for local_rank in range(self.devices_per_node)]

    def acquire(self, owner: object) -> None:
        """Mark the pool as used by `owner` (a worker group): each slot hosts one worker process."""
        if not self._slots:
            raise RuntimeError(f"{self!r} was removed; create a new pool")
        if self._owner is not None and self._owner is not owner:
            raise RuntimeError(f"{self!r} already hosts {self._owner!r}: each slot holds one worker process. "
                               "Put several roles in one process (make_colocated_class) or give the second "
                               "group its own pool")
        self._owner = owner

    def release(self, owner: object) -> None:
        """Free the pool for another group (called by the owner's shutdown)."""
        if self._owner is owner:
            self._owner = None

    def remove(self) -> None:
        """Remove the placement groups (the resources return to the cluster). Idempotent."""
        if not self._slots:
            return
        from ray.util import remove_placement_group

        groups, self._slots, self._owner = self.placement_groups, [], None
        if self._ray.is_initialized():
            for group in groups:
                remove_placement_group(group)

    def __enter__(self) -> RayResourcePool:
        """`with RayResourcePool(...) as pool:` removes the pool on exit."""
        return self

    def __exit__(self, *exc) -> None:
        """Remove the placement groups."""
        self.remove()

    def __repr__(self) -> str:
        """`RayResourcePool(nnodes=.., devices_per_node=.., bundle={...})`."""
        return (f"RayResourcePool(nnodes={self.nnodes}, devices_per_node={self.devices_per_node}, "
                f"bundle={self.bundle})")
