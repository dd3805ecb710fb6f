"""The `ray` executor: one Ray actor process per rank, with torch.distributed rendezvous set up for them.

`RayWorkerGroup(worker_cls, *args, world_size=N)` has the interface of `LocalWorkerGroup` (see `group.py`):
registered methods become group methods, split and collected by their dispatch mode. Underneath:

1. a `RayResourcePool` (given, or a 1-node CPU pool of `world_size` slots that the group owns) fixes
   where rank r runs;
2. one generic host actor per slot is started in that slot's placement-group bundle (`num_gpus=1` per
   rank on a GPU pool, so Ray sets `CUDA_VISIBLE_DEVICES` to one device, and the pool's fractional
   `num_cpus`), with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` and the caller's `env` in its
   process environment from the start;
3. rank 0's host reports a free TCP port on its node; every host exports `MASTER_ADDR` (127.0.0.1 when
   all ranks share one node, else rank 0's node IP) and `MASTER_PORT`, moves into the driver's working
   directory (as torchrun's ranks share one: a relative model path or `trainer.default_local_dir` then names
   the same files on every node; Ray starts workers in the directory `ray start` ran in, which on another node
   is anything; skipped under a Ray `runtime_env` `working_dir`, and said when the node has no such
   directory), then constructs `worker_cls(*args, **kwargs)`, so `Worker.__init__` reads its placement from
   the environment as under torchrun and `Worker.init_process_group()` joins gloo/nccl with no further
   arguments.

`placement()` says where each rank runs (node id and IP as the rank's own process reports them, pid);
`describe_placement(groups)` is the start-up line the trainers print when the ranks span several nodes.

A call sends every rank its arguments (each distinct `Batch` is `ray.put` once and passed by reference,
so a replicated batch is serialised once, not once per rank), then waits on all ranks at once and
reports the first failure as soon as it happens:

- the method raised on rank r -> `WorkerError(r, class, method, "Type: message" + remote traceback)`;
- rank r's process died (killed, out of memory, segfault) -> `WorkerDiedError` naming the rank, pid and
  node, within the time Ray needs to notice (about a second); the group refuses further calls;
- no answer within `timeout_s` -> `WorkerTimeoutError` naming the ranks still running; the group refuses
  further calls (the ranks may be stuck in a collective).

- the Ray node of this driver died (its raylet was killed or ran out of memory) -> `RayNodeDiedError`
  naming the raylet's pid and its log, before the call touches the object store (a driver whose raylet is
  gone is terminated by Ray, without a word, at its next object-store access) and while waiting on a call.

Ranks that did not fail keep running their part of a failed call; a rank waiting in a collective for
the failed one waits until torch.distributed's own timeout. `shutdown()` kills the actors and removes
the placement groups the group created (a pool passed in belongs to the caller: `pool.remove()`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyflow.batch import Batch
from hyflow.controller.group import WorkerError, WorkerGroup
from hyflow.controller.resources import LOOPBACK, RayResourcePool, Slot, import_ray, require_ray
from hyflow.controller.worker import Placement, Worker, free_port
from hyflow.threads import configure_worker_threads, worker_thread_env

DEFAULT_CPUS_PER_WORKER = 1.0
_RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_POLL_S = 1.0
_TRACEBACK_ATTR = "_hyflow_remote_traceback"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerDiedError(WorkerError):
    """A rank's worker process died during (or before) a call; the group cannot be used any more."""

    def __str__(self) -> str:
        """`worker rank R (Cls.method): the worker process ... died ...`."""
        return f"worker rank {self.rank} ({self.worker_class}.{self.method}): {self.detail}"


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A call did not finish on every rank within the group's `timeout_s`."""

    def __str__(self) -> str:
        """`worker rank R (Cls.method) did not finish ...`."""
        return f"worker rank {self.rank} ({self.worker_class}.{self.method}) {self.detail}"


class RayNodeDiedError(RuntimeError):
    """The Ray node this driver runs on died (its raylet is gone): no worker can be reached any more."""


class _Raylet:
    """The raylet of this driver's Ray node, when it runs on this machine and can be found: is it alive?"""

    def __init__(self, pid: int, alive, logs: str | None) -> None:
        self.pid, self._alive, self.logs = pid, alive, logs

    def alive(self) -> bool:
        try:
            return bool(self._alive())
        except Exception:  # cannot tell: assume alive, the call itself will report what it can
            return True

    @classmethod
    def find(cls) -> _Raylet | None:
        """The local raylet: the one this process started (a local cluster), else the process on this machine
        that serves the driver's raylet socket (a cluster started with `ray start`); None when not found."""
        try:
            import ray

            node = ray._private.worker._global_node
        except Exception:
            return None
        if node is None:
            return None
        logs = None
        with contextlib.suppress(Exception):
            logs = node.get_logs_dir_path()
        started = (getattr(node, "all_processes", None) or {}).get("raylet") or []
        process = getattr(started[0], "process", None) if started else None
        if process is not None:
            return cls(process.pid, lambda: process.poll() is None, logs)
        socket = getattr(node, "raylet_socket_name", None)
        if not socket:
            return None
        try:
            import psutil

            for proc in psutil.process_iter(["name", "cmdline"]):
                if proc.info["name"] == "raylet" and any(socket in arg for arg in proc.info["cmdline"] or []):
                    found = psutil.Process(proc.pid)
                    return cls(proc.pid, lambda found=found: found.is_running()
                               and found.status() != psutil.STATUS_ZOMBIE,
                               logs)
        except Exception:
            return None
        return None


class _WorkerHost:
    """The Ray actor behind one rank: builds the worker in its own process and calls its methods by name."""

    def __init__(self):
        self.worker = None

    def locate(self, loopback: bool) -> tuple[int, str, int, str]:
        """(pid, node IP, a TCP port free now on 127.0.0.1 if `loopback`, else on the node IP, node id)."""
        import ray

        node_ip = ray.util.get_node_ip_address()
        return (os.getpid(), node_ip, free_port(LOOPBACK if loopback else node_ip),
                ray.get_runtime_context().get_node_id())

    def construct(self, worker_cls: type[Worker], args: tuple, kwargs: dict, env: dict[str, str],
                  cwd: str | None = None) -> None:
        """Export `env` (rendezvous address), move into `cwd` (the driver's working directory), size torch's
        threads (hyflow.threads), then build `worker_cls(*args, **kwargs)` in this process."""
        os.environ.update(env)
        _follow_driver_cwd(cwd)
        configure_worker_threads()
        worker = _traced(worker_cls, *args, **kwargs)
        if not isinstance(getattr(worker, "placement", None), Placement):
            raise TypeError(f"{worker_cls.__name__}.__init__ did not run Worker.__init__; call "
                            "super().__init__() at the start of it")
        self.worker = worker

    def run(self, method: str, *args, **kwargs):
        """`worker.<method>(*args, **kwargs)`; under torch.profiler (verl's profiler keys) the call shows as the
        range `hyflow/worker/<method>` in this process's trace."""
        with torch.profiler.record_function(f"hyflow/worker/{method}"):
            return _traced(getattr(self.worker, method), *args, **kwargs)


def _follow_driver_cwd(cwd: str | None) -> None:
    """chdir to the driver's working directory `cwd`, unless Ray's runtime_env put this process in a `working_dir`
    (the job's files, shipped there on purpose); a printed note when this node has no directory `cwd`."""
    import ray

    if not cwd or os.getcwd() == cwd or (ray.get_runtime_context().runtime_env or {}).get("working_dir"):
        return
    if os.path.isdir(cwd):
        os.chdir(cwd)
        return
    print(f"rank {os.environ.get('RANK', '?')}: the driver's working directory {cwd} does not exist on this node "
          f"({ray.util.get_node_ip_address()}): relative paths in the config (model, data, "
          f"trainer.default_local_dir) resolve against {os.getcwd()} here; use absolute paths on a filesystem "
          "every node sees", flush=True)


def _traced(func, *args, **kwargs):
    """Call `func`; an exception leaves with its formatted traceback attached (it pickles with the error)."""
    try:
        return func(*args, **kwargs)
    except Exception as err:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(err, _TRACEBACK_ATTR, traceback.format_exc())
        raise


_HOST_ACTOR = None


def _host_actor_class():
    global _HOST_ACTOR
    if _HOST_ACTOR is None:
        _HOST_ACTOR = import_ray().remote(max_restarts=0, max_task_retries=0)(_WorkerHost)
    return _HOST_ACTOR


def _check_env(env: dict | None) -> dict[str, str]:
    env = dict(env or {})
    reserved = sorted(set(env) & set(_RESERVED_ENV))
    if reserved:
        raise ValueError(f"env sets {reserved}, which the ray executor sets for each rank; remove them")
    bad = sorted(repr(k) for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str))
    if bad:
        raise TypeError(f"env must map str to str (process environment variables); fix {', '.join(bad)}")
    return env


@dataclass(frozen=True)
class RankLocation:
    """Where one rank of a Ray worker group runs, as its own process reports it."""

    rank: int
    node_id: str
    node_ip: str
    pid: int


def describe_placement(groups: Sequence) -> str | None:
    """Lines saying on which Ray node (id, IP) and in which process each rank of the Ray worker groups among
    `groups` runs, or None when they all run on one node:

        Ray placement: 3 worker processes on 2 nodes
          HybridWorker: rank 0 -> node 2e76fcea (10.0.0.1) pid 4242, rank 1 -> node f7d6b9cf (10.0.0.2) pid 977
          RolloutHost: rank 0 -> node f7d6b9cf (10.0.0.2) pid 978
    """
    located = [(group.worker_cls.__name__, group.placement()) for group in groups
               if isinstance(group, RayWorkerGroup)]
    nodes = {where.node_id for _, ranks in located for where in ranks}
    if len(nodes) < 2:
        return None
    lines = [f"Ray placement: {sum(len(ranks) for _, ranks in located)} worker processes on {len(nodes)} nodes"]
    lines += [f"  {name}: " + ", ".join(f"rank {w.rank} -> node {w.node_id[:8]} ({w.node_ip}) pid {w.pid}"
                                        for w in ranks)
              for name, ranks in located]
    return "\n".join(lines)


class RayWorkerGroup(WorkerGroup):
    """The `ray` executor: rank r of `worker_cls(*args, **kwargs)` runs in its own Ray actor process."""

    def __init__(self, worker_cls: type[Worker], *args, world_size: int | None = None,
                 pool: RayResourcePool | None = None, env: dict[str, str] | None = None,
                 timeout_s: float | None = None, **kwargs):
        """Start one actor per slot of `pool` and construct the worker in each (see the module docstring).

        world_size: number of ranks; with a pool it defaults to (and must equal) `pool.world_size`; without
        one, the group reserves a 1-node CPU pool of `world_size` slots of `DEFAULT_CPUS_PER_WORKER` CPUs and
        removes it on shutdown (pass a pool for GPUs, several nodes or fractional CPUs). env: extra
        environment variables for every rank's process. timeout_s: the longest any one call (and the
        construction) may take before `WorkerTimeoutError`; None waits as long as the ranks are alive.
        """
        if pool is None and world_size is None:
            raise ValueError("RayWorkerGroup needs world_size=N, or a RayResourcePool (pool=...)")
        if pool is not None and world_size not in (None, pool.world_size):
            raise ValueError(f"world_size={world_size} differs from the pool's {pool.world_size} slots "
                             f"({pool!r}); drop world_size or size the pool to it")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds or None, got {timeout_s!r}")
        super().__init__(worker_cls, pool.world_size if pool is not None else world_size)
        self._env = _check_env(env)
        self._ray = require_ray()
        self.timeout_s = timeout_s
        self._actors: list = []
        self._locations: list[RankLocation] = []
        self._broken: str | None = None
        self._raylet = _Raylet.find()
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self._owns_pool = pool is None
        self._pool = pool if pool is not None else RayResourcePool(
            1, self.world_size, use_gpu=False, cpus_per_worker=DEFAULT_CPUS_PER_WORKER)
        try:
            self._pool.acquire(self)
            self._start(args, kwargs)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pool(self) -> RayResourcePool:
        """The resource pool the ranks run in."""
        return self._pool

    def worker_pids(self) -> list[int]:
        """Process id of each rank's actor, in rank order (for tests and debugging)."""
        return [where.pid for where in self._locations]

    def placement(self) -> list[RankLocation]:
        """Where each rank runs (node id and IP as its process reports them, pid), in rank order."""
        return list(self._locations)

    def _start(self, args: tuple, kwargs: dict) -> None:
        slots = self._pool.slots
        one_node = len({slot.node_id for slot in slots}) == 1
        self._actors = [self._spawn(slot) for slot in slots]
        located = self._wait([actor.locate.remote(one_node) for actor in self._actors], "__init__")
        self._locations = [RankLocation(rank, node_id, node_ip, pid)
                           for rank, (pid, node_ip, _, node_id) in enumerate(located)]
        self.master_addr = LOOPBACK if one_node else located[0][1]
        self.master_port = located[0][2]
        rendezvous = {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        args_ref, kwargs_ref = self._ray.put(args), self._ray.put(kwargs)
        self._wait([actor.construct.remote(self.worker_cls, args_ref, kwargs_ref, rendezvous, os.getcwd())
                    for actor in self._actors], "__init__")

    def _spawn(self, slot: Slot):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = {**worker_thread_env(self._pool.devices_per_node), **self._env,
               "RANK": str(slot.rank), "WORLD_SIZE": str(self.world_size),
               "LOCAL_RANK": str(slot.local_rank), "LOCAL_WORLD_SIZE": str(self._pool.devices_per_node)}
        strategy = PlacementGroupSchedulingStrategy(slot.placement_group,
                                                    placement_group_bundle_index=slot.bundle_index)
        return _host_actor_class().options(
            num_cpus=self._pool.cpus_per_worker, num_gpus=1 if self._pool.use_gpu else 0,
            scheduling_strategy=strategy, runtime_env={"env_vars": env},
        ).remote()

    def _execute(self, method: str, per_rank_args: list[tuple], per_rank_kwargs: list[dict]) -> list:
        """Call `method` on ranks 0..len(per_rank_args)-1 at once; results in rank order."""
        return self._launch(method, per_rank_args, per_rank_kwargs)()

    def _launch(self, method: str, per_rank_args: list[tuple], per_rank_kwargs: list[dict]):
        """Launch `method` on the ranks now; the returned function waits for the results (rank order)."""
        if self._broken:
            raise RuntimeError(f"{self!r} cannot run {method}: {self._broken}")
        self._check_node(method)  # before ray.put: Ray terminates a driver that writes to a dead node's store
        shared: dict[int, object] = {}
        refs = [self._actors[rank].run.remote(method, *self._put_batches(args, shared),
                                              **self._put_batches(kwargs, shared))
                for rank, (args, kwargs) in enumerate(zip(per_rank_args, per_rank_kwargs))]
        return lambda: self._wait(refs, method)

    def _put_batches(self, values: Sequence | dict, shared: dict[int, object]):
        """Each distinct Batch put in the object store once, passed by reference (Ray resolves it)."""
        def put(value):
            if not isinstance(value, Batch):
                return value
            if id(value) not in shared:
                shared[id(value)] = self._ray.put(value)
            return shared[id(value)]

        if isinstance(values, dict):
            return {k: put(v) for k, v in values.items()}
        return [put(v) for v in values]

    def _wait(self, refs: list, method: str) -> list:
        """Results of per-rank calls in rank order; the first failure is raised as soon as Ray reports it."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while pending:
            wait_s = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            ready, _ = self._ray.wait(list(pending), num_returns=1, timeout=wait_s)
            if not ready:
                self._check_node(method)
            for ref in ready:
                rank = pending.pop(ref)
                results[rank] = self._get(ref, rank, method)
            if pending and deadline is not None and time.monotonic() >= deadline:
                ranks = sorted(pending.values())
                self._broken = f"a call to {method} timed out on ranks {ranks}; shut the group down"
                raise WorkerTimeoutError(ranks[0], self.worker_cls.__name__, method,
                                         f"did not finish within timeout_s={self.timeout_s:g} s (ranks "
                                         f"still running: {ranks}); a rank may be stuck in a collective "
                                         "that another rank never entered. Raise timeout_s if the work is "
                                         "just slow; shut this group down and create a new one")
        return results

    def _get(self, ref, rank: int, method: str):
        from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError

        cls_name = self.worker_cls.__name__
        try:
            return self._ray.get(ref)
        except RayTaskError as err:
            cause = err.cause
            remote = getattr(cause, _TRACEBACK_ATTR, None) or _ANSI.sub("", str(err))
            detail = f"{type(cause).__name__}: {cause}\n\nremote {self._where(rank)}:\n{remote.rstrip()}"
            raise WorkerError(rank, cls_name, method, detail) from cause
        except ActorUnavailableError as err:
            self._check_node(method)
            self._broken = f"rank {rank}'s worker process became unreachable; shut the group down"
            raise WorkerError(rank, cls_name, method,
                              f"{type(err).__name__}: {err} ({self._where(rank)}); whether the call ran is "
                              "unknown: shut this group down and create a new one") from err
        except RayActorError as err:
            self._check_node(method)
            self._broken = f"rank {rank}'s worker process died; shut the group down and create a new one"
            raise WorkerDiedError(rank, cls_name, method,
                                  f"the worker process ({self._where(rank)}) died during the call ("
                                  f"{type(err).__name__}: {err}). A killed process is often out of memory "
                                  "(check dmesg and Ray's memory monitor logs); shut this group down and "
                                  "create a new one") from err
        except RayError as err:
            raise WorkerError(rank, cls_name, method, f"{type(err).__name__}: {err}") from err

    def _check_node(self, method: str) -> None:
        """Raise `RayNodeDiedError` when the raylet of this driver's node is gone."""
        raylet = self._raylet
        if raylet is None or raylet.alive():
            return
        self._broken = f"the Ray node died (raylet pid {raylet.pid} is gone); start the run again"
        logs = f" and {raylet.logs}/raylet.out" if raylet.logs else ""
        raise RayNodeDiedError(
            f"the Ray node of this driver died during {self.worker_cls.__name__}.{method}: its raylet (pid "
            f"{raylet.pid}) is gone (killed, or out of memory: check dmesg{logs}), and every worker on the node "
            "with it. Start the run again: it resumes from its last checkpoint (a cluster started with `ray "
            "start` needs `ray stop; ray start --head` first)")

    def _where(self, rank: int) -> str:
        pid = f"pid {self._locations[rank].pid}, " if rank < len(self._locations) else ""
        slots = self._pool.slots
        return f"{pid}node {slots[rank].node_ip if rank < len(slots) else '?'}"

    def shutdown(self) -> None:
        """Kill the actors and remove the placement groups the group created; idempotent."""
        actors, self._actors = self._actors, []
        self._broken = self._broken or "the group was shut down; create a new one"
        ray = import_ray()
        if ray.is_initialized():
            for actor in actors:
                ray.kill(actor, no_restart=True)
        self._pool.release(self)
        if self._owns_pool:
            self._pool.remove()

    def __enter__(self) -> RayWorkerGroup:
        """`with RayWorkerGroup(...) as group:` shuts the group down on exit."""
        return self

    def __exit__(self, *exc) -> None:
        """Shut the group down."""
        self.shutdown()

