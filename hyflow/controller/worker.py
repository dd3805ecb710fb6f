"""Worker base class and colocation of several roles in one worker process.

A `Worker` is one rank of a worker group: it owns models and does the work the driver asks for through the
group's dispatched methods (`@register`, see `dispatch.py`). It knows its place in the group, resolved in
this order (first found wins, per field):

1. constructor arguments `rank`, `world_size`, `local_rank`;
2. the placement an executor sets while it constructs the worker (`use_placement`; the `local` executor);
3. the environment, as torchrun and the Ray executor set it: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
   `MASTER_ADDR`, `MASTER_PORT`;
4. a single rank: rank 0 of 1.

`device` is `cuda:<local_rank mod visible devices>` when CUDA is available, else `cpu`;
`init_process_group()` joins torch.distributed (gloo on CPU, nccl on GPU) over TCP on `MASTER_ADDR`
(default 127.0.0.1, one node).

Colocation (HybridFlow's "one process per device hosts several models"): `make_colocated_class({"actor":
ActorWorker, "rollout": RolloutWorker, "ref": RefWorker})` builds one Worker class whose instance constructs
every role in the same process, with the same rank, and exposes each role's registered method `m` as
`<role>_<m>` with the same dispatch mode. Role instances see each other through `self.peers` (the actor
pushes weights into `self.peers["rollout"]` without leaving the process). On the driver,
`group.role("actor").update_policy(batch)` calls `group.actor_update_policy(batch)`. A hand-written worker
that names its methods `<role>_<method>` gets the same `group.role(...)` views.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import ClassVar

import torch

from hyflow.controller.dispatch import (
    DISPATCH_ATTR,
    LAYOUT_METHOD,
    DataLayout,
    Dispatch,
    DispatchMode,
    register,
    registered_methods,
)


@dataclass(frozen=True)
class Placement:
    """Where a worker sits: rank in the group, group size, device index on its node, rendezvous address.

    `one_process` marks ranks that share one Python process (the in-process `local` executor with
    world_size > 1): they cannot form a torch.distributed group.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    one_process: bool = False


_PLACEMENT: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("hyflow_placement",
                                                                              default=None)


@contextlib.contextmanager
def use_placement(placement: Placement) -> Iterator[None]:
    """Within the block, newly constructed Workers take `placement` (executors wrap construction in it)."""
    token = _PLACEMENT.set(placement)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


def _env_int(environ, name: str, default: int) -> int:
    value = environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def placement_from_env(environ=None) -> Placement | None:
    """The placement torchrun or the Ray executor put in the environment; None if RANK, WORLD_SIZE unset."""
    environ = os.environ if environ is None else environ
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return None
    port = _env_int(environ, "MASTER_PORT", -1)
    return Placement(
        rank=_env_int(environ, "RANK", 0),
        world_size=_env_int(environ, "WORLD_SIZE", 1),
        local_rank=_env_int(environ, "LOCAL_RANK", 0),
        master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
        master_port=None if port < 0 else port,
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Worker:
    """One rank of a worker group. Subclasses call `super().__init__()` first, then build their models.

    `MESHES` ({mesh name: attribute}): the meshes this worker's `@register(..., mesh=name)` methods split their
    batches by, each the attribute holding the object (a `TrainEngine`) whose `data_layout()` says this rank's place
    in it; `data_layouts()` reports those that exist (see `hyflow.controller.dispatch`)."""

    MESHES: ClassVar[dict[str, str]] = {}

    def __init__(self, rank: int | None = None, world_size: int | None = None, local_rank: int | None = None):
        """Resolve rank, world_size, local_rank: arguments, else executor placement, else env, else 0 of 1."""
        base = _PLACEMENT.get() or placement_from_env() or Placement()
        given = {"rank": rank, "world_size": world_size, "local_rank": local_rank}
        overrides = {k: v for k, v in given.items() if v is not None}
        placement = replace(base, **overrides)
        if placement.world_size < 1 or not 0 <= placement.rank < placement.world_size:
            raise ValueError(f"{type(self).__name__}: rank {placement.rank} is not in [0, world_size="
                             f"{placement.world_size}); check RANK and WORLD_SIZE")
        if placement.local_rank < 0:
            raise ValueError(f"{type(self).__name__}: local_rank must be >= 0, got {placement.local_rank}")
        self.placement: Placement = placement
        self.rank: int = placement.rank
        self.world_size: int = placement.world_size
        self.local_rank: int = placement.local_rank
        self.peers: dict[str, Worker] = {}

    @property
    def device(self) -> torch.device:
        """`cuda:<local_rank mod visible GPUs>` with CUDA (Ray shows each actor one GPU), else `cpu`."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def init_process_group(self, backend: str | None = None, timeout_s: float = 600.0) -> None:
        """Join the default torch.distributed group as (rank, world_size) over tcp://MASTER_ADDR:MASTER_PORT.

        backend: "gloo" on CPU, "nccl" on CUDA unless given. A 1-rank group picks a free port when
        MASTER_PORT is unset. Does nothing when this process already joined a group of the same size.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                                   f"{dist.get_world_size()}, but this worker is rank {self.rank} of "
                                   f"{self.world_size}; destroy the old group first")
            return
        if self.placement.one_process and self.world_size > 1:
            raise RuntimeError(f"{type(self).__name__}: the {self.world_size} ranks of this group live in "
                               "one process (local executor), so they cannot form a torch.distributed group; "
                               "use world_size=1 locally or the ray executor for multi-rank runs")
        port = self.placement.master_port
        if port is None:
            if self.world_size > 1:
                raise RuntimeError(f"{type(self).__name__}: MASTER_PORT is not set for a "
                                   f"{self.world_size}-rank group; the executor sets it (or export "
                                   "MASTER_PORT on every rank)")
            port = free_port(self.placement.master_addr)
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        addr, timeout = self.placement.master_addr, timedelta(seconds=timeout_s)
        if addr.startswith("127.") or addr == "localhost":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets stay on loopback too
        if self.rank == 0:
            # torch's TCPStore would listen on every interface; bind the rendezvous socket to MASTER_ADDR only.
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((addr, port))
            listener.listen(max(self.world_size, 8))
            self._store_listener = listener  # the store serves from this socket: keep it open
            store = dist.TCPStore(addr, port, self.world_size, True, timeout=timeout,
                                  master_listen_fd=listener.fileno())
        else:
            store = dist.TCPStore(addr, port, self.world_size, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)

    @register(Dispatch.REPLICATE)
    def data_layouts(self) -> dict[str, DataLayout]:
        """{mesh name: this rank's `DataLayout`} of every `MESHES` entry whose engine exists (none before
        `init_model`)."""
        engines = {name: getattr(self, attribute, None) for name, attribute in self.MESHES.items()}
        return {name: engine.data_layout() for name, engine in engines.items() if engine is not None}

    @register(Dispatch.REPLICATE)
    def start_profile(self, spec: dict) -> str | None:
        """Start torch.profiler in this process when `spec["ranks"]` (None = all) holds this rank
        (`hyflow.trainer.profiling`); returns the trace's path, or None (not selected, or this process already
        profiles: one profiler per process, whichever group asked first)."""
        ranks = spec.get("ranks")
        if (ranks is not None and self.rank not in ranks) or _PROFILE:
            return None
        contents = set(spec.get("contents") or ())
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and (not contents or "cuda" in contents):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        stamp = datetime.now(tz=timezone.utc).strftime("%Y%m%d%H%M%S%f")[:-3]
        name = (f"{spec.get('prefix') or 'worker'}_step{spec['step']}_rank{self.rank}-of-{self.world_size}"
                f"_pid{os.getpid()}_{stamp}.json.gz")
        profiler = torch.profiler.profile(activities=activities, record_shapes="shapes" in contents,
                                          profile_memory="memory" in contents, with_stack="stack" in contents)
        profiler.start()
        _PROFILE["active"] = (profiler, os.path.join(spec["save_path"], name))
        return _PROFILE["active"][1]

    @register(Dispatch.REPLICATE)
    def stop_profile(self) -> str | None:
        """Stop this process's torch.profiler and write its Chrome trace (gzipped JSON); its path, or None when
        this process was not profiling."""
        active = _PROFILE.pop("active", None)
        if active is None:
            return None
        profiler, path = active
        profiler.stop()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        profiler.export_chrome_trace(path)
        return path

    def __repr__(self) -> str:
        """`Cls(rank=r, world_size=n)`."""
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


# registered methods every Worker has that concern the whole process, which a colocated class does not delegate
_PROCESS_METHODS = frozenset({LAYOUT_METHOD, "start_profile", "stop_profile"})
# this process's running torch.profiler and its trace's path (Worker.start_profile / stop_profile)
_PROFILE: dict = {}


def _delegate(role: str, method: str, mode: DispatchMode, doc: str | None):
    def call(self, *args, **kwargs):
        return getattr(self.roles[role], method)(*args, **kwargs)

    call.__name__ = f"{role}_{method}"
    call.__doc__ = doc
    setattr(call, DISPATCH_ATTR, mode)
    return call


def make_colocated_class(roles: dict[str, type[Worker]], name: str | None = None) -> type[Worker]:
    """A Worker class hosting every role of `roles` ({role name: Worker subclass}) in one process.

    Its constructor takes one keyword argument per role, a dict of that role's constructor keyword
    arguments (`actor={"config": cfg}`; a missing role gets none), plus the Worker placement arguments.
    Role `r`'s registered method `m` becomes the registered method `r_m`; `self.roles[r]` is the role
    instance; every role instance's `peers` is the shared `roles` dict.
    """
    if not roles:
        raise ValueError("make_colocated_class needs at least one role, e.g. {'actor': ActorWorker}")
    for role, cls in roles.items():
        if not role.isidentifier():
            raise ValueError(f"role name {role!r} must be a Python identifier (it prefixes method names)")
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"role {role!r}: expected a Worker subclass, got {cls!r}")
    roles = dict(roles)

    def __init__(self, rank=None, world_size=None, local_rank=None, **role_kwargs):
        Worker.__init__(self, rank, world_size, local_rank)
        unknown = sorted(set(role_kwargs) - set(roles))
        if unknown:
            raise TypeError(f"{type(self).__name__} got arguments for unknown roles {unknown}; roles: "
                            f"{list(roles)}")
        self.roles = {}
        with use_placement(self.placement):
            for role, cls in roles.items():
                kwargs = role_kwargs.get(role, {})
                if not isinstance(kwargs, dict):
                    raise TypeError(f"role {role!r}: pass its constructor arguments as a dict, "
                                    f"{role}=dict(...), got {type(kwargs).__name__}")
                self.roles[role] = cls(**kwargs)
        for worker in self.roles.values():
            worker.peers = self.roles

    @register(Dispatch.REPLICATE)
    def data_layouts(self) -> dict[str, DataLayout]:
        """Every role's `data_layouts()`, each mesh named `<role>.<mesh>` (as the role's methods name it)."""
        return {f"{role}.{mesh}": place for role, worker in self.roles.items()
                for mesh, place in worker.data_layouts().items()}

    namespace = {"__init__": __init__, "__hyflow_roles__": tuple(roles), LAYOUT_METHOD: data_layouts,
                 "__doc__": f"Colocated worker hosting roles {list(roles)} in one process."}
    for role, cls in roles.items():
        for method, mode in registered_methods(cls).items():
            if method in _PROCESS_METHODS:  # the colocated class's own: one per process, not per role
                continue
            if mode.mesh is not None:  # the colocated class reports each role's meshes under the role's name
                mode = replace(mode, mesh=f"{role}.{mode.mesh}")
            attr = f"{role}_{method}"
            if attr in namespace:
                raise ValueError(f"colocated method name {attr!r} is produced twice; rename a role or method")
            namespace[attr] = _delegate(role, method, mode, getattr(cls, method).__doc__)
    class_name = name or "Colocated" + "".join(cls.__name__ for cls in roles.values())
    return type(class_name, (Worker,), namespace)
