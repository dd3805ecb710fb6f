"""Dispatch modes: how one driver call becomes per-rank worker calls, and how the results come back.

The single-controller pattern of HybridFlow (arXiv 2409.19256; verl's `@register(dispatch_mode=...)`): a
worker method declares with `@register(dispatch, collect, pad)` how a call on the worker *group* is split
across the group's ranks and how the per-rank results are merged, so the driver writes
`group.compute_log_prob(batch)` as if there were one worker.

Dispatch (how the arguments reach the ranks; D = the data-parallel size: the world size, or with `mesh=` the
data-parallel size of that mesh, see "Data-parallel layout" below):

- `REPLICATE`: every rank gets the same arguments.
- `DP_SPLIT`: every `Batch` argument (positional or keyword) of B rows is padded to B' = ceil(B / D) * D rows
  (`pad=True`; pad_count = B' - B rows copied cyclically from the front, `Batch.pad_to_multiple`) and cut
  into D equal parts of B' / D rows; part i goes to rank i. Other arguments are replicated. With `pad=False`
  a B that D does not divide is an error.
- `DP_MINI_BATCHES`: `DP_SPLIT` for a method that walks its rows in mini-batches of M rows, M given by each
  `Batch` argument's `meta["mini_batch_rows"]` (`MINI_BATCH_ROWS`; `with_mini_batch_rows(batch, M)` sets it on
  a view). The rows are laid out mini-batch-major before the cut: the B rows are B / M mini-batches of M
  rows, each cut into D slices of M / D rows, and rank r gets slice r of every mini-batch, in mini-batch
  order (row order `arange(B).view(B / M, D, M / D).transpose(0, 1)`). Rank r's k-th local mini-batch of
  M / D rows is then its share of the k-th global one, and the D ranks together walk the same mini-batches
  as one process over the B rows. When B is not a whole number of mini-batches, or D does not divide M,
  the rows keep their order (the plain `DP_SPLIT` cut). A `Batch` without the meta key is an error when
  D > 1 (D = 1 needs no layout). Registered with `pad=False` only: padding rows would join the last
  mini-batch.
- `RANK_ZERO`: only rank 0 runs (not for methods that enter a collective: the other ranks never call it).
- `DIRECT`: the caller passes every argument as a list of D values; rank i gets element i of each.

Collect (how the per-rank results come back):

- `CONCAT`: results concatenated in rank order (`Batch.concat`, `torch.cat`, or list concatenation), then
  the padding's outputs dropped (`Batch.unpad`): a result of R rows for B' padded input rows gives each
  input row k = R / B' rows, in input order (k = 1 for a row-wise method; k = n for one that samples n
  responses per prompt), so the last pad_count x k rows are the padding's; R must be a multiple of B'.
  `Batch.concat` merges each rank's `meta["metrics"]` into `{name: [rank 0 value(s), rank 1 value(s), ...]}`.
  A result without rows (a metrics-only Batch) is returned as is.
- `FIRST`: rank 0's result.
- `ALL`: the list of every rank's result, in rank order.

Default collect: CONCAT for DP_SPLIT and DP_MINI_BATCHES, FIRST for RANK_ZERO, ALL for REPLICATE and DIRECT.

Data-parallel layout (`@register(..., mesh="actor")`): a method whose work runs on a parallelized model names the
mesh it runs on. Each rank reports its place in that mesh (`DataLayout`: data-parallel rank, data-parallel size,
whether its result is the one collected; the worker's `data_layouts()`, asked once by the group after the engines
exist). A batch is then cut into D = dp_size parts, not one per rank: every rank of data-parallel group d (the
sequence x tensor-parallel ranks that compute on the same rows) receives part d, and CONCAT / ALL read one result per
group (the rank with `collects`), in data-parallel order. Without `mesh` (or before the worker reports that mesh)
every rank is its own data-parallel rank. A generation method of the same worker keeps `mesh=None`: every rank
decodes its own share.

Padding rows are real rows to the worker: a DP_SPLIT method whose effect depends on every row once (a
training update) should be registered with `pad=False`, so an indivisible batch fails loudly instead.

`split_args` and `collect_results` are pure functions, testable without workers; an executor only moves
the per-rank arguments and results. The merged per-rank metric lists (`meta["metrics"]`) are reduced to one
number per metric by the trainer, with the one rule-set of `hyflow.algos.reduce_metrics` (the controller knows no
metric names).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hyflow.batch import Batch

DISPATCH_ATTR = "__hyflow_dispatch__"
LAYOUT_METHOD = "data_layouts"  # the Worker method a group asks for its ranks' DataLayouts
MINI_BATCH_ROWS = "mini_batch_rows"  # Batch.meta key: the rows of one mini-batch, for Dispatch.DP_MINI_BATCHES


class Dispatch(str, enum.Enum):
    """How a group call's arguments reach the ranks (see the module docstring)."""

    REPLICATE = "replicate"
    DP_SPLIT = "dp_split"
    DP_MINI_BATCHES = "dp_mini_batches"
    RANK_ZERO = "rank_zero"
    DIRECT = "direct"


class Collect(str, enum.Enum):
    """How the per-rank results of a group call are merged (see the module docstring)."""

    CONCAT = "concat"
    FIRST = "first"
    ALL = "all"


_DEFAULT_COLLECT = {
    Dispatch.REPLICATE: Collect.ALL,
    Dispatch.DP_SPLIT: Collect.CONCAT,
    Dispatch.DP_MINI_BATCHES: Collect.CONCAT,
    Dispatch.RANK_ZERO: Collect.FIRST,
    Dispatch.DIRECT: Collect.ALL,
}


def _parse(enum_cls: type[enum.Enum], value) -> enum.Enum:
    try:
        return enum_cls(value)
    except ValueError:
        valid = ", ".join(f"{enum_cls.__name__}.{m.name}" for m in enum_cls)
        raise ValueError(f"unknown {enum_cls.__name__} {value!r}; valid: {valid}") from None


@dataclass(frozen=True)
class DataLayout:
    """One rank's place in a mesh's data-parallel split: its data-parallel rank of `dp_size`, and whether its result
    is the one collected for that data-parallel rank (one rank of each group that computes on the same rows)."""

    dp_rank: int
    dp_size: int
    collects: bool


def check_layout(layout: Sequence[DataLayout], mesh: str) -> list[DataLayout]:
    """The ranks' layouts of `mesh`, checked: one dp_size, every data-parallel rank present, each collected by
    exactly one rank. Raises ValueError naming the mesh otherwise."""
    layout = list(layout)
    sizes = {place.dp_size for place in layout}
    if len(sizes) != 1:
        raise ValueError(f"mesh {mesh!r}: the ranks report different data-parallel sizes {sorted(sizes)}")
    size = sizes.pop()
    collectors = sorted(place.dp_rank for place in layout if place.collects)
    if {place.dp_rank for place in layout} != set(range(size)) or collectors != list(range(size)):
        raise ValueError(f"mesh {mesh!r}: data-parallel ranks {[p.dp_rank for p in layout]} of size {size} with "
                         f"collecting ranks {collectors}: every data-parallel rank 0..{size - 1} needs ranks and "
                         "exactly one collecting rank")
    return layout


@dataclass(frozen=True)
class DispatchMode:
    """What `@register` stores on a method: dispatch, collect (None -> the dispatch's default), pad, and the mesh
    whose data-parallel layout splits its batches (None: every rank is a data-parallel rank)."""

    dispatch: Dispatch = Dispatch.REPLICATE
    collect: Collect | None = None
    pad: bool = True
    mesh: str | None = None

    def __post_init__(self):
        dispatch = _parse(Dispatch, self.dispatch)
        collect = _DEFAULT_COLLECT[dispatch] if self.collect is None else _parse(Collect, self.collect)
        if dispatch is Dispatch.RANK_ZERO and collect is not Collect.FIRST:
            raise ValueError(f"Dispatch.RANK_ZERO runs one rank, so its only collect is Collect.FIRST, "
                             f"got {collect}; drop the collect argument")
        if self.mesh is not None and dispatch not in (Dispatch.DP_SPLIT, Dispatch.DP_MINI_BATCHES):
            raise ValueError(f"mesh={self.mesh!r} sets how a batch is split, so it needs Dispatch.DP_SPLIT or "
                             f"Dispatch.DP_MINI_BATCHES, not {dispatch}")
        if dispatch is Dispatch.DP_MINI_BATCHES and self.pad:
            raise ValueError("Dispatch.DP_MINI_BATCHES splits whole mini-batches, which padding rows would change; "
                             "register it with pad=False")
        object.__setattr__(self, "dispatch", dispatch)
        object.__setattr__(self, "collect", collect)


def register(dispatch: Dispatch | str = Dispatch.REPLICATE, collect: Collect | str | None = None,
             pad: bool = True, mesh: str | None = None) -> Callable:
    """Decorator marking a worker method as callable through a worker group.

    Stores `DispatchMode(dispatch, collect, pad, mesh)` on the function as `__hyflow_dispatch__` and returns the
    function itself, so calling it directly on a worker is unchanged.
    """
    if callable(dispatch) and not isinstance(dispatch, str):
        raise TypeError("@register needs parentheses: write @register(Dispatch.DP_SPLIT) (or another "
                        "Dispatch), not a bare @register")
    mode = DispatchMode(dispatch, collect, pad, mesh)

    def decorate(func: Callable) -> Callable:
        if not callable(func):
            raise TypeError(f"@register decorates a method, got {type(func).__name__}")
        setattr(func, DISPATCH_ATTR, mode)
        return func

    return decorate


def registered_methods(cls: type) -> dict[str, DispatchMode]:
    """{method name: DispatchMode} for every `@register`-ed method of `cls` (inherited ones included)."""
    methods = {}
    for name in dir(cls):
        mode = getattr(getattr(cls, name, None), DISPATCH_ATTR, None)
        if isinstance(mode, DispatchMode):
            methods[name] = mode
    return methods


def _as_mode(mode: DispatchMode | Dispatch | str) -> DispatchMode:
    return mode if isinstance(mode, DispatchMode) else DispatchMode(mode)


def split_args(mode: DispatchMode | Dispatch | str, world_size: int, args: Sequence, kwargs: dict,
               *, method: str = "method", layout: Sequence[DataLayout] | None = None
               ) -> tuple[list[tuple], list[dict], int]:
    """Per-rank arguments of one group call: (per_rank_args, per_rank_kwargs, pad_count).

    The lists have one entry per rank that runs: `world_size` entries, or 1 for RANK_ZERO. pad_count is the
    number of padding rows DP_SPLIT appended, (-B) mod D, else 0 (D: the data-parallel size, `layout`'s when given,
    else world_size). `layout` (one `DataLayout` per rank): rank r gets the part of its data-parallel rank.
    `method` names the call in errors.
    """
    mode = _as_mode(mode)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    args, kwargs = tuple(args), dict(kwargs)
    if mode.dispatch is Dispatch.RANK_ZERO:
        return [args], [kwargs], 0
    if mode.dispatch is Dispatch.REPLICATE:
        return [args] * world_size, [dict(kwargs) for _ in range(world_size)], 0
    if mode.dispatch is Dispatch.DIRECT:
        return _split_direct(world_size, args, kwargs, method)
    if layout is None:
        return _split_batches(mode, world_size, args, kwargs, method)
    if len(layout) != world_size:
        raise ValueError(f"{method}: a layout of {len(layout)} ranks for a group of {world_size}")
    per_dp_args, per_dp_kwargs, pad_count = _split_batches(mode, layout[0].dp_size, args, kwargs, method)
    return ([per_dp_args[place.dp_rank] for place in layout], [per_dp_kwargs[place.dp_rank] for place in layout],
            pad_count)


def with_mini_batch_rows(batch: Batch, rows: int) -> Batch:
    """A view of `batch` (same rows, meta copied) whose `meta["mini_batch_rows"]` says it is walked in
    mini-batches of `rows` rows: the size `Dispatch.DP_MINI_BATCHES` lays the rows out by."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"mini-batch rows must be an int >= 1, got {rows!r}")
    view = batch[:]
    view.meta = {**batch.meta, MINI_BATCH_ROWS: rows}
    return view


def mini_batch_major_order(rows: int, mini_batch_rows: int, world_size: int) -> torch.Tensor | None:
    """The row order that gives rank r (the r-th of `world_size` contiguous chunks) slice r of every mini-batch of
    `mini_batch_rows` rows: `arange(rows).view(rows / M, D, M / D).transpose(0, 1).reshape(-1)`; None when no
    reordering applies (D = 1, rows not a whole number of mini-batches, or D not dividing M)."""
    if world_size == 1 or rows % mini_batch_rows or mini_batch_rows % world_size:
        return None
    return (torch.arange(rows).view(rows // mini_batch_rows, world_size, mini_batch_rows // world_size)
            .transpose(0, 1).reshape(-1))


def _mini_batch_major(slots: dict, rows: int, world_size: int, method: str) -> dict:
    """`Dispatch.DP_MINI_BATCHES`: every Batch argument in mini-batch-major row order (see the module docstring)."""
    if world_size == 1:
        return slots
    sizes = {b.meta.get(MINI_BATCH_ROWS) for b in slots.values()}
    if None in sizes:
        raise ValueError(f"{method} is registered with Dispatch.DP_MINI_BATCHES, so its Batch must say its "
                         f"mini-batch size to be split across {world_size} ranks: set meta[{MINI_BATCH_ROWS!r}] "
                         "(hyflow.controller.dispatch.with_mini_batch_rows(batch, rows))")
    if len(sizes) > 1:
        raise ValueError(f"{method}: Dispatch.DP_MINI_BATCHES got Batch arguments with different "
                         f"meta[{MINI_BATCH_ROWS!r}] {sorted(sizes)}; give them all the same mini-batch size")
    order = mini_batch_major_order(rows, sizes.pop(), world_size)
    if order is None:
        return slots
    return {slot: b[order] for slot, b in slots.items()}


def _split_direct(world_size: int, args: tuple, kwargs: dict, method: str):
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in
                                                                     kwargs.items()]
    for label, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            got = f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) \
                else f"a {type(value).__name__}"
            raise ValueError(f"{method} is registered with Dispatch.DIRECT: {label} must be a list with one "
                             f"value per rank ({world_size}), got {got}")
    per_rank_args = [tuple(a[rank] for a in args) for rank in range(world_size)]
    per_rank_kwargs = [{k: v[rank] for k, v in kwargs.items()} for rank in range(world_size)]
    return per_rank_args, per_rank_kwargs, 0


def _split_batches(mode: DispatchMode, world_size: int, args: tuple, kwargs: dict, method: str):
    slots = {i: a for i, a in enumerate(args) if isinstance(a, Batch)}
    slots.update({k: v for k, v in kwargs.items() if isinstance(v, Batch)})
    if not slots:
        raise TypeError(f"{method} is registered with Dispatch.{mode.dispatch.name} but got no Batch argument; "
                        "pass a Batch, or register it with Dispatch.REPLICATE")
    lengths = {len(b) for b in slots.values()}
    if len(lengths) > 1:
        raise ValueError(f"{method}: Dispatch.DP_SPLIT got Batch arguments of different lengths "
                         f"{sorted(lengths)}; all Batch arguments must have the same number of rows")
    rows = lengths.pop()
    pad_count = 0
    if mode.pad:
        padded = {slot: b.pad_to_multiple(world_size) for slot, b in slots.items()}
        slots = {slot: b for slot, (b, _) in padded.items()}
        pad_count = -rows % world_size
    elif rows % world_size:
        raise ValueError(f"{method}: a Batch of {rows} rows cannot be split evenly across DP size "
                         f"{world_size} (registered with pad=False); use a batch size that is a multiple "
                         f"of {world_size}")
    if mode.dispatch is Dispatch.DP_MINI_BATCHES:
        slots = _mini_batch_major(slots, rows, world_size, method)
    chunks = {slot: b.chunk(world_size) for slot, b in slots.items()}
    per_rank_args = [tuple(chunks[i][rank] if i in chunks else a for i, a in enumerate(args))
                     for rank in range(world_size)]
    per_rank_kwargs = [{k: chunks[k][rank] if k in chunks else v for k, v in kwargs.items()}
                       for rank in range(world_size)]
    return per_rank_args, per_rank_kwargs, pad_count


def collect_results(mode: DispatchMode | Dispatch | str, results: Sequence, pad_count: int = 0, *,
                    padded_size: int | None = None, method: str = "method",
                    layout: Sequence[DataLayout] | None = None):
    """Merge per-rank results (in rank order) as the mode's collect says, dropping `pad_count` padding rows.

    `padded_size` (B', the padded input rows), when given, sets how many result rows each input row has
    (k = result rows / B', which must be whole) and so how many rows the padding's outputs are: pad_count x k.
    Without it k = 1. `layout` (the one `split_args` split by): CONCAT and ALL read the collecting rank of each
    data-parallel rank, in data-parallel order. `method` names the call in errors.
    """
    mode = _as_mode(mode)
    results = list(results)
    if not results:
        raise ValueError(f"{method}: no results to collect (no rank ran)")
    if mode.collect is Collect.FIRST:
        return results[0]
    if layout is not None:
        by_dp = sorted((place.dp_rank, rank) for rank, place in enumerate(layout) if place.collects)
        results = [results[rank] for _, rank in by_dp]
    if mode.collect is Collect.ALL:
        return results
    merged = _concat(results, method)
    if pad_count and merged is not None and len(merged):
        merged = _drop_padding(merged, pad_count, padded_size, method)
    return merged


def _concat(results: list, method: str):
    if all(r is None for r in results):
        return None
    if all(isinstance(r, Batch) for r in results):
        return Batch.concat(results)
    if all(isinstance(r, torch.Tensor) for r in results):
        return torch.cat(results, dim=0)
    if all(isinstance(r, (list, tuple)) for r in results):
        return list(itertools.chain.from_iterable(results))
    types = sorted({type(r).__name__ for r in results})
    raise TypeError(f"{method}: Collect.CONCAT cannot concatenate results of types {types}; return a Batch, "
                    "tensor or list from every rank, or register with collect=Collect.ALL")


def _drop_padding(merged, pad_count: int, padded_size: int | None, method: str):
    rows = len(merged)
    if padded_size is not None and rows % padded_size:
        raise ValueError(f"{method} returned {rows} rows for {padded_size} input rows ({pad_count} of them "
                         "padding); padding can only be removed from row-wise results: return the same number "
                         "of rows for every input row, or register with pad=False and pass a batch divisible by "
                         "the DP size")
    drop = pad_count * (rows // padded_size if padded_size else 1)
    if isinstance(merged, Batch):
        return merged.unpad(drop)
    return merged[:rows - drop]
