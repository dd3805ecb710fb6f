"""Worker groups: one driver-side object that looks like a single worker and runs each call on every rank.

A group binds every `@register`-ed method of its worker class as a method of the same name. Calling it
runs: `split_args` (per-rank arguments by the method's dispatch mode) -> the executor runs the method on
each rank -> `collect_results` (merge by the collect mode, drop DP padding rows). See `dispatch.py`.

`WorkerGroup` is the interface; an executor implements one method, `_execute(method, per_rank_args,
per_rank_kwargs) -> results in rank order`, raising `WorkerError` (cause chained) when a rank fails.

`LocalWorkerGroup` (the `local` executor) constructs the worker(s) in this process and calls them directly:
world_size 1 is the normal case (a `breakpoint()` anywhere in a worker works); world_size > 1 builds N
instances called one after another, with no torch.distributed, to exercise dispatch in tests. Arguments are
passed by reference, as in a plain call: a worker must not modify its input batch in place (under Ray it
receives a copy, so such edits would silently differ between executors).

`group.role("actor")` is a view whose method `m` calls the group's `actor_m` (colocated workers, see
`worker.make_colocated_class`).

`group.submit(name, *args, **kwargs)` starts a call without waiting and returns a `PendingCall`; its `result()`
waits and collects as the blocking call would. The `ray` executor runs the ranks meanwhile (the driver can call
another group: that is how asynchronous training overlaps rollout and training); the `local` executor runs the
call at `submit`, so the order of a one-process run is the order of the driver's submits, deterministic.
"""

from __future__ import annotations

import abc
import bdb
from collections.abc import Sequence

from hyflow.batch import Batch
from hyflow.controller.dispatch import (
    LAYOUT_METHOD,
    DataLayout,
    DispatchMode,
    check_layout,
    collect_results,
    registered_methods,
    split_args,
)
from hyflow.controller.worker import Placement, Worker, use_placement


class WorkerError(RuntimeError):
    """A worker method (or constructor) raised on some rank; `__cause__` is the original exception."""

    def __init__(self, rank: int, worker_class: str, method: str, detail: str):
        super().__init__(rank, worker_class, method, detail)
        self.rank, self.worker_class, self.method, self.detail = rank, worker_class, method, detail

    def __str__(self) -> str:
        """`worker rank R (Cls.method) raised Type: message`."""
        return f"worker rank {self.rank} ({self.worker_class}.{self.method}) raised {self.detail}"


def _check_worker_class(worker_cls) -> None:
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        raise TypeError(f"a worker group needs a subclass of hyflow.controller.Worker, got {worker_cls!r}")


def _batch_rows(args: tuple, kwargs: dict) -> int:
    return next(len(a) for a in (*args, *kwargs.values()) if isinstance(a, Batch))


class WorkerGroup(abc.ABC):
    """N ranks of one worker class behind one object; registered methods are bound as group methods."""

    def __init__(self, worker_cls: type[Worker], world_size: int):
        """Bind every registered method of `worker_cls`; subclasses then create the workers."""
        _check_worker_class(worker_cls)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self._worker_cls = worker_cls
        self._world_size = world_size
        self._methods = registered_methods(worker_cls)
        self._layouts: dict[str, list[DataLayout]] = {}  # {mesh name: each rank's DataLayout}, once reported
        for name, mode in self._methods.items():
            if hasattr(type(self), name):
                raise ValueError(f"{worker_cls.__name__}.{name} collides with the {type(self).__name__} "
                                 f"attribute of that name; rename the worker method")
            setattr(self, name, self._make_method(name, mode))

    @property
    def world_size(self) -> int:
        """Number of ranks (= data-parallel size for DP_SPLIT)."""
        return self._world_size

    @property
    def worker_cls(self) -> type[Worker]:
        """The worker class every rank runs."""
        return self._worker_cls

    @property
    def methods(self) -> dict[str, DispatchMode]:
        """{registered method name: its DispatchMode}."""
        return dict(self._methods)

    @property
    def roles(self) -> tuple[str, ...]:
        """Role names of a colocated worker class (`make_colocated_class`), else ()."""
        return tuple(getattr(self._worker_cls, "__hyflow_roles__", ()))

    def layout(self, mesh: str | None) -> list[DataLayout] | None:
        """Each rank's `DataLayout` in `mesh` (the workers' `data_layouts()`, asked once: the first call after the
        engines exist), or None for mesh None or while no rank reports it (every rank is then its own
        data-parallel rank)."""
        if mesh is None:
            return None
        if mesh not in self._layouts and LAYOUT_METHOD in self._methods:
            reports = self._execute(LAYOUT_METHOD, [()] * self._world_size, [{}] * self._world_size)
            if all(mesh in report for report in reports):
                self._layouts[mesh] = check_layout([report[mesh] for report in reports], mesh)
        return self._layouts.get(mesh)

    def data_parallel_size(self, mesh: str | None = None) -> int:
        """How many different shares of a batch `mesh`'s ranks compute on (the world size without a mesh)."""
        layout = self.layout(mesh)
        return self._world_size if layout is None else layout[0].dp_size

    def role(self, name: str) -> RoleView:
        """A view of this group whose method `m` calls the group's method `<name>_m`."""
        return RoleView(self, name)

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the workers and their resources; the group cannot be called afterwards."""

    @abc.abstractmethod
    def _execute(self, method: str, per_rank_args: list[tuple], per_rank_kwargs: list[dict]) -> list:
        """Run `method` on ranks 0..len(per_rank_args)-1 with those arguments; results in rank order.

        A failing rank raises `WorkerError(rank, class name, method, "Type: message")` from the original.
        """

    def _launch(self, method: str, per_rank_args: list[tuple], per_rank_kwargs: list[dict]):
        """Start `method` on the ranks and return a zero-argument function that waits for the results (in rank
        order). The default runs the call now (`_execute`); an executor with real concurrency overrides it."""
        results = self._execute(method, per_rank_args, per_rank_kwargs)
        return lambda: results

    def submit(self, name: str, *args, **kwargs) -> PendingCall:
        """Start registered method `name` without waiting for it; `.result()` returns what `group.name(...)`
        would have returned (see the module docstring)."""
        if name not in self._methods:
            raise AttributeError(f"{self._worker_cls.__name__} has no registered method {name!r}; registered "
                                 f"methods: {sorted(self._methods)}")
        mode = self._methods[name]
        label = f"{self._worker_cls.__name__}.{name}"
        layout = self.layout(mode.mesh)
        per_rank_args, per_rank_kwargs, pad_count = split_args(mode, self._world_size, args, kwargs, method=label,
                                                               layout=layout)
        wait = self._launch(name, per_rank_args, per_rank_kwargs)
        padded_size = _batch_rows(args, kwargs) + pad_count if pad_count else None
        return PendingCall(label, lambda: collect_results(mode, wait(), pad_count, padded_size=padded_size,
                                                          method=label, layout=layout))

    def _make_method(self, name: str, mode: DispatchMode):
        def call(*args, **kwargs):
            return self._call(name, mode, args, kwargs)

        call.__name__ = name
        call.__qualname__ = f"{type(self).__name__}.{name}"
        call.__doc__ = getattr(self._worker_cls, name).__doc__
        return call

    def _call(self, name: str, mode: DispatchMode, args: tuple, kwargs: dict):
        label = f"{self._worker_cls.__name__}.{name}"
        layout = self.layout(mode.mesh)
        per_rank_args, per_rank_kwargs, pad_count = split_args(mode, self._world_size, args, kwargs,
                                                               method=label, layout=layout)
        results = self._execute(name, per_rank_args, per_rank_kwargs)
        padded_size = _batch_rows(args, kwargs) + pad_count if pad_count else None
        return collect_results(mode, results, pad_count, padded_size=padded_size, method=label, layout=layout)

    def __getattr__(self, name: str):
        """Only reached for names that are not registered methods: explain what can be called."""
        if name.startswith("_"):
            raise AttributeError(name)
        worker_cls = self.__dict__.get("_worker_cls")
        registered = sorted(self.__dict__.get("_methods", {}))
        cls_name = getattr(worker_cls, "__name__", "?")
        if callable(getattr(worker_cls, name, None)):
            raise AttributeError(f"{cls_name}.{name} is not registered for dispatch, so the group cannot "
                                 "call it; decorate it with @register(Dispatch...). Registered methods: "
                                 f"{registered}")
        raise AttributeError(f"{type(self).__name__} of {cls_name} has no method {name!r}; registered "
                             f"methods: {registered}")

    def __repr__(self) -> str:
        """`Group(Cls, world_size=N, methods=[...])`."""
        return (f"{type(self).__name__}({self._worker_cls.__name__}, world_size={self._world_size}, "
                f"methods={sorted(self._methods)})")


class PendingCall:
    """A group call started by `WorkerGroup.submit`: `result()` waits for it (once; later calls return the same
    result or raise the same error); `label` names the worker method."""

    def __init__(self, label: str, wait) -> None:
        self.label = label
        self._wait = wait
        self._done = False
        self._value = None
        self._error: BaseException | None = None

    def result(self):
        if not self._done:
            try:
                self._value = self._wait()
            except BaseException as err:
                self._error = err
                raise
            finally:
                self._done = True
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        return f"PendingCall({self.label}, {'done' if self._done else 'running'})"


class RoleView:
    """The methods `<role>_<m>` of a group, callable as `view.m(...)`."""

    def __init__(self, group: WorkerGroup, role: str):
        """Bind `group.<role>_<m>` as `self.<m>`; an unknown role raises ValueError listing the roles."""
        prefix = f"{role}_"
        self._group, self._role = group, role
        self._methods = {name[len(prefix):]: name for name in group.methods if name.startswith(prefix)}
        if (group.roles and role not in group.roles) or not self._methods:
            raise ValueError(f"{group.worker_cls.__name__} has no role {role!r}: no registered method starts "
                             f"with {prefix!r}; roles: {list(group.roles)}, methods: {sorted(group.methods)}")
        for short, full in self._methods.items():
            setattr(self, short, getattr(group, full))

    def submit(self, name: str, *args, **kwargs) -> PendingCall:
        """`group.submit("<role>_<name>", ...)`: start the role's method without waiting."""
        if name not in self._methods:
            raise AttributeError(f"role {self._role!r} has no registered method {name!r}; its methods: "
                                 f"{sorted(self._methods)}")
        return self._group.submit(self._methods[name], *args, **kwargs)

    @property
    def world_size(self) -> int:
        """The group's number of ranks."""
        return self._group.world_size

    def __getattr__(self, name: str):
        """Only reached for names the role does not have: list the ones it has."""
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"role {self.__dict__.get('_role')!r} has no registered method {name!r}; its "
                             f"methods: {sorted(self.__dict__.get('_methods', {}))}")

    def __repr__(self) -> str:
        """`RoleView(role, methods=[...])`."""
        return f"RoleView({self._role!r}, methods={sorted(self._methods)})"


class LocalWorkerGroup(WorkerGroup):
    """The `local` executor: `world_size` instances of `worker_cls(*args, **kwargs)` in this process."""

    def __init__(self, worker_cls: type[Worker], *args, world_size: int = 1, **kwargs):
        """Construct rank i's worker under Placement(rank=i, world_size, local_rank=i); bind its methods."""
        super().__init__(worker_cls, world_size)
        self._workers: list[Worker] = []
        for rank in range(world_size):
            placement = Placement(rank=rank, world_size=world_size, local_rank=rank,
                                  one_process=world_size > 1)
            with use_placement(placement):
                worker = self._run(rank, worker_cls.__name__, "__init__", worker_cls, args, kwargs)
            if not isinstance(getattr(worker, "placement", None), Placement):
                raise TypeError(f"{worker_cls.__name__}.__init__ did not run Worker.__init__; call "
                                "super().__init__() at the start of it")
            self._workers.append(worker)

    @property
    def workers(self) -> list[Worker]:
        """The worker instances, in rank order (local executor only)."""
        return list(self._workers)

    @staticmethod
    def _run(rank: int, cls_name: str, method: str, func, args: Sequence, kwargs: dict):
        try:
            return func(*args, **kwargs)
        except bdb.BdbQuit:
            raise
        except Exception as err:
            raise WorkerError(rank, cls_name, method, f"{type(err).__name__}: {err}") from err

    def shutdown(self) -> None:
        """Drop the references to the workers, so their models can be freed."""
        self._workers.clear()

    def _execute(self, method: str, per_rank_args: list[tuple], per_rank_kwargs: list[dict]) -> list:
        """Call `method` on each worker in rank order."""
        if not self._workers:
            raise RuntimeError(f"{self!r} was shut down; create a new group to call {method}")
        calls = zip(self._workers, per_rank_args, per_rank_kwargs)
        return [self._run(rank, type(worker).__name__, method, getattr(worker, method), args, kwargs)
                for rank, (worker, args, kwargs) in enumerate(calls)]
