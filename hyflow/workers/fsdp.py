"""Multi-rank training for hyflow's workers: the process group, full and sharded checkpoints, bucketed weight
gathering, offload moves.

The wrapping itself (FSDP2 `fully_shard` over the mesh's `dp_shard_sp` dimension, DDP, decoder-layer discovery,
mixed precision, activation checkpointing) is `hyflow.parallel`'s (`hyflow.parallel.fsdp`, applied in order by
`hyflow.parallel.parallelize`). Under FSDP2 every parameter is a DTensor sharded on dim 0, which is what the state
dicts, the weight gathering and the offload moves here read and write.

State dicts (`torch.distributed.checkpoint.state_dict`):

- full: `get_model_state_dict(full_state_dict=True, cpu_offload=True)`: a collective (every rank calls it, each
  tensor is all-gathered); rank 0 receives the whole unsharded dict on the CPU with the same keys as the
  unwrapped model's `state_dict()`, the other ranks receive `{}` (W host copies of the model are never made).
  One process without a process group gets the dict too. `load_full_state_dict` takes a full dict into a model
  sharded over any number of ranks (each keeps its shard), so a checkpoint written with N ranks loads with M.
- optimizer: the same, keyed by parameter name (`{"state": {fqn: {...}}, "param_groups": [{"params": [fqn,
  ...], ...}]}`) instead of by position, so it does not depend on the sharding. A positional (plain
  `optimizer.state_dict()`) dict is converted by parameter order on load.
- sharded: `save_sharded` / `load_sharded` write and read a torch.distributed.checkpoint (DCP) directory: every
  rank writes its own shards plus shared metadata, and loading reshards to the current world size (also to a
  single process without a process group), so nothing is ever gathered on one rank.

Weight sync for a separate rollout copy: `iter_full_tensors` all-gathers one parameter at a time
(`DTensor.full_tensor()` is a collective: every rank walks the same names in the same order),
`full_tensor_buckets` packs them into buckets of at most `bucket_bytes` (a single larger tensor is a bucket
of its own), so the extra memory is one bucket.

Offload (verl's `param_offload` / `optimizer_offload`): `move_model` moves a model's parameters (under FSDP2 each
rank's shard: the local tensor of every DTensor), gradients and buffers between the device and host memory in
place, as verl's `offload_fsdp_model_to_cpu` / `load_fsdp_model_to_gpu` do (`model.to(device)`);
`optimizer_state_to_host` / `optimizer_state_back` move the optimizer's state tensors out and back to where each was
(verl's `offload_fsdp_optimizer` / `load_fsdp_optimizer`). `TrainEngine` runs the state machine around them. FSDP2's
own `CPUOffloadPolicy` (`fsdp_config.offload_policy`) instead keeps the shards, their gradients and the optimizer
step on the host for good and copies each layer's parameters to the device for its forward and backward
(`hyflow.parallel.fsdp.apply_fsdp(offload_policy=True)`); its pinned host memory needs an accelerator, so on a CPU model it runs unpinned.

Timeouts. `maybe_init_distributed` creates the process group with `timeout_s` (DIST_TIMEOUT_S by default): a
collective that a peer never joins raises (gloo: a RuntimeError after the timeout; NCCL: the watchdog aborts the
communicator and raises, with TORCH_NCCL_ASYNC_ERROR_HANDLING on, its default) instead of hanging the job.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hyflow.models.forward import unwrap_model
from hyflow.serialization import (
    CheckpointSecurityError,
    load_plain_data,
    read_dcp_metadata,
    safe_dcp_planner,
    safe_dcp_reader,
)
from hyflow.specs import FSDP2_STRATEGIES

DIST_TIMEOUT_S = 600.0
WEIGHT_BUCKET_BYTES = 256 << 20


# ---------------------------------------------------------------------------------------------- process group


def is_distributed() -> bool:
    """True when this process is in an initialised torch.distributed group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def maybe_init_distributed(worker, *, timeout_s: float = DIST_TIMEOUT_S) -> bool:
    """Join the worker's process group when it has several ranks; returns whether the run is multi-rank.

    Backend: gloo for CPU models; `cpu:gloo,cuda:nccl` for CUDA models (NCCL for the model's collectives, gloo
    for the small CPU all-reduces of loss normalisers and metrics). Collectives raise after `timeout_s`.
    A group this process already joined is reused (it must have the worker's rank and size).
    """
    if worker.world_size <= 1:
        return False
    device = getattr(worker, "model_device", None) or worker.device
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    worker.init_process_group(backend, timeout_s=timeout_s)
    return True


def parallel_strategy(strategy: str, world_size: int) -> str:
    """How a role trains on `world_size` ranks: "single" (one rank), "fsdp2" (strategy fsdp or fsdp2, and verl's
    megatron / veomni / torchtitan engines: `hyflow.config.engine_compat`) or "ddp"."""
    if world_size <= 1:
        return "single"
    if strategy in FSDP2_STRATEGIES:  # verl's megatron / veomni / torchtitan engines run on FSDP2 here
        return "fsdp2"
    if strategy == "ddp":
        return "ddp"
    raise ValueError(f"strategy={strategy!r} is not supported for {world_size} ranks; use fsdp, fsdp2 or ddp")


# ---------------------------------------------------------------------------------------------- wrapping


def uses_offload_policy(strategy: str, fsdp_config) -> bool:
    """Whether `parallelize` gives the model FSDP2's CPUOffloadPolicy: `fsdp_config.offload_policy` under FSDP2 (a
    model run unwrapped or under DDP has no such policy; the config refuses asking for it there)."""
    return strategy == "fsdp2" and bool(getattr(fsdp_config, "offload_policy", False))


def is_fsdp2(model: nn.Module) -> bool:
    """True when `model` was sharded by `fully_shard`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free every gathered FSDP2 group of `model` (the root stays gathered after a forward without backward)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# ---------------------------------------------------------------------------------------------- offload

HOST = torch.device("cpu")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard, a tensor-parallel split), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """This rank's tensors of `model` that an offload moves: every parameter (FSDP2: the local shard of each
    DTensor), its gradient, every buffer; tied tensors once."""
    seen: set[int] = set()
    for tensor in (*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()):
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            yield local_tensor(tensor)


def model_bytes(model: nn.Module, device: torch.device | None = None) -> int:
    """Bytes of `model_tensors` (on `device` only, when given): what this rank holds of the model there."""
    return sum(t.numel() * t.element_size() for t in model_tensors(model)
               if device is None or t.device == torch.device(device))


def _sync_after_copy(source: torch.device, target: torch.device) -> None:
    """Wait for asynchronous device-to-host copies (the host tensors are read after this), then give the freed
    blocks of the device's caching allocator back (verl's empty_cache after an offload)."""
    if source.type == "cuda" and target.type == "cpu":
        torch.cuda.synchronize(source)
        torch.cuda.empty_cache()


def _mover(device: torch.device, copy: bool):
    """The function that moves one tensor to `device`: asynchronous between host and accelerator (a device-to-host
    copy lands in pinned memory, as in verl; `_sync_after_copy` waits for it), a fresh copy with `copy` even on
    the same device."""
    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == device and not copy:
            return tensor
        return tensor.to(device, non_blocking=tensor.device.type != device.type, copy=copy)
    return move


@torch.no_grad()
def move_model(model: nn.Module, device: torch.device | str, *, copy: bool = False) -> int:
    """Move `model`'s parameters (FSDP2: this rank's shard of each), gradients and buffers to `device` in place;
    returns the bytes moved (0 when everything already was there and not `copy`).

    `nn.Module._apply` does the move (verl's offload_fsdp2_model_to_cpu is `model.to("cpu")`): a plain parameter
    keeps its `Parameter` object (`param.data = moved`), a DTensor parameter of FSDP2 is swapped in place
    (`torch.utils.swap_tensors`) and each FSDP2 module re-registers its padded shard afterwards
    (`FSDPModule._apply` -> `FSDPParam.reset_sharded_param`, after freeing any gathered parameters), so the
    optimizer's state (keyed by parameter object) stays attached. DDP's reducer keeps its gradient buckets on the
    device it was built on, so a DDP model is moved by its wrapped module the same way and must be back on the
    device before its backward. `copy`: every tensor gets a new storage even where it already is on `device`,
    which is what a move between two devices does; it lets that path run on a CPU-only machine.
    """
    device = torch.device(device)
    tensors = list(model_tensors(model))
    if not copy and all(t.device == device for t in tensors):
        return 0
    source = next((t.device for t in tensors if t.device != device), device)
    model._apply(_mover(device, copy))
    _sync_after_copy(source, device)
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[tuple[int, str], dict, str]]:
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            for key, value in (state or {}).items():
                if isinstance(value, torch.Tensor):
                    yield (id(param), key), state, key


@torch.no_grad()
def optimizer_state_to_host(optimizer: torch.optim.Optimizer, *, copy: bool = False
                            ) -> tuple[dict[tuple[int, str], torch.device], int]:
    """Move every tensor of `optimizer`'s state (Adam's moments, FSDP2: DTensor shards) to host memory in place
    (verl's offload_fsdp_optimizer); returns (where each tensor was, by (parameter id, key), for
    `optimizer_state_back`; the bytes moved). An optimizer that has not stepped has no state: nothing moves."""
    devices, moved, source = {}, 0, HOST
    move = _mover(HOST, copy)
    for where, state, key in _state_tensors(optimizer):
        value = state[key]
        devices[where] = value.device
        if value.device != HOST or copy:
            source = value.device if value.device != HOST else source
            moved += _nbytes(value)
            state[key] = move(value)
    _sync_after_copy(source, HOST)
    return devices, moved


@torch.no_grad()
def optimizer_state_back(optimizer: torch.optim.Optimizer, devices: dict[tuple[int, str], torch.device], *,
                         copy: bool = False) -> int:
    """Move each state tensor back to the device `optimizer_state_to_host` recorded for it (verl's
    load_fsdp_optimizer; a host-side tensor such as Adam's step count stays on the host, where the optimizer
    keeps it unless capturable or fused); returns the bytes moved. A tensor without a record stays where it is."""
    moved = 0
    for where, state, key in _state_tensors(optimizer):
        device = devices.get(where)
        if device is not None and (state[key].device != device or copy):
            moved += _nbytes(state[key])
            state[key] = _mover(device, copy)(state[key])
    return moved


# ---------------------------------------------------------------------------------------------- full tensors


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter (tied ones once) and persistent buffer of `model`.

    Collective under FSDP2: each sharded parameter is all-gathered (`full_tensor()`); every rank must consume
    the whole iterator. Names are those of the unwrapped model. Plain models yield their own tensors (no copy).
    """
    model = unwrap_model(model)
    reshard(model)
    persistent = set(model.state_dict().keys())
    for name, param in model.named_parameters():
        yield name, _full(param.detach())
    for name, buffer in model.named_buffers():
        if name in persistent:
            yield name, _full(buffer.detach())


def tensor_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = WEIGHT_BUCKET_BYTES
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs grouped into lists of at most `bucket_bytes` (one larger tensor is a bucket alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def full_tensor_buckets(model: nn.Module, bucket_bytes: int = WEIGHT_BUCKET_BYTES
                        ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`iter_full_tensors` grouped into lists of at most `bucket_bytes` (one larger tensor is a bucket alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return tensor_buckets(iter_full_tensors(model), bucket_bytes)


# ---------------------------------------------------------------------------------------------- state dicts


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state dict on CPU: on rank 0 (and in one process); `{}` on the other ranks.

    Collective: every rank must call it. Keys are the unwrapped model's `state_dict()` keys.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    reshard(model)
    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], *, broadcast_from_rank0: bool = False
                         ) -> None:
    """Load a full (unsharded) state dict into `model`, however it is sharded; collective under FSDP2.

    broadcast_from_rank0=False: every rank passes the full dict. True: only rank 0 needs it (others pass {}),
    rank 0 broadcasts.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    broadcast = broadcast_from_rank0 and is_distributed()
    set_model_state_dict(model, state, options=_options(full_state_dict=True, broadcast_from_rank0=broadcast))


def optimizer_has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` holds state (has taken a step). torch's `get_optimizer_state_dict` gives an optimizer
    without state one with a zero-gradient, zero-lr step, which leaves Adam's step count at 1 and so changes
    the bias correction of the next real step: saving a checkpoint before the first update would change the
    run that saved it. The save functions below therefore write no optimizer state for an unstepped optimizer."""
    return bool(optimizer.state)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The unsharded optimizer state keyed by parameter name, on CPU, on rank 0 (`{}` elsewhere); collective.

    `{}` for an optimizer that has not stepped yet (see `optimizer_has_stepped`); loading `{}` restores that."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not optimizer_has_stepped(optimizer):  # the same on every rank: they step together
        return {}
    return get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, *,
                                   broadcast_from_rank0: bool = False) -> None:
    """Load a full optimizer state (by parameter name, or positional as `optimizer.state_dict()` gives it).

    A state without entries (saved before the first step) leaves the optimizer unstepped, as it was saved."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not state or not state.get("state"):
        optimizer.state.clear()
        return
    state = optimizer_state_by_name(model, optimizer, state)
    broadcast = broadcast_from_rank0 and is_distributed()
    with _tuple_hyperparameters_kept(optimizer):
        set_optimizer_state_dict(model, optimizer, state,
                                 options=_options(full_state_dict=True, broadcast_from_rank0=broadcast))


@contextlib.contextmanager
def _tuple_hyperparameters_kept(optimizer: torch.optim.Optimizer):
    """`set_optimizer_state_dict` turns tuple hyperparameters (AdamW's betas) into lists; turn them back."""
    tuple_keys = [{k for k, v in group.items() if isinstance(v, tuple)} for group in optimizer.param_groups]
    yield
    for group, keys in zip(optimizer.param_groups, tuple_keys, strict=True):
        for key in keys:
            if isinstance(group.get(key), list):
                group[key] = tuple(group[key])


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """A positional optimizer state dict (ids 0, 1, ... in parameter-group order) re-keyed by parameter name.

    Name-keyed or empty dicts are returned unchanged.
    """
    groups = state.get("param_groups") or []
    if not groups or not all(isinstance(i, int) for g in groups for i in g["params"]):
        return state
    names = {id(p): name for name, p in unwrap_model(model).named_parameters()}
    position = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved = [i for g in groups for i in g["params"]]
    if len(saved) != len(position):
        raise ValueError(f"optimizer state has {len(saved)} parameters, the optimizer {len(position)}; it was "
                         "saved for a different model")
    rename = dict(zip(saved, position, strict=True))
    return {"state": {rename[i]: s for i, s in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [rename[i] for i in g["params"]]} for g in groups]}


# ---------------------------------------------------------------------------------------------- sharded (DCP)


EXTRA_STATE_FILE = "extra_state.pt"
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
                 extra: dict | None = None, options=None, optimizer_skip: set[str] = frozenset(),
                 names_group=None) -> None:
    """Write the model (and optimizer) shards of every rank into the DCP directory `path`; collective.

    Layout: torch.distributed.checkpoint files (`.metadata` + one `__<rank>_0.distcp` per rank) holding
    {"model": ..., "optimizer": ...} (no optimizer when `optimizer` is None), plus `extra_state.pt` (rank 0's
    `extra`, e.g. the LR scheduler) when given; `load_sharded` reads it back at any world size. `options`
    (`StateDictOptions`, e.g. `ignore_frozen_params` for a LoRA model's adapter only) shapes the model's state.
    `optimizer_skip`: parameter names whose optimizer state this rank does not write (a pipeline's last-stage copy
    of a tied lm_head: the first stage writes the weight's state as one process does, under the embedding's name).
    `names_group`: the ranks whose parameters differ (a pipeline's pp ranks): DCP keeps one rank's copy of the
    optimizer's parameter-name lists, so each writes all of theirs (gathered over the group, in rank order).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    reshard(model)
    state = {MODEL_KEY: get_model_state_dict(model, options=options)}
    if optimizer is not None and optimizer_has_stepped(optimizer):  # unstepped: saved without, loads as fresh
        state[OPTIMIZER_KEY] = get_optimizer_state_dict(model, optimizer)
        for name in optimizer_skip:
            state[OPTIMIZER_KEY]["state"].pop(name, None)
            for group in state[OPTIMIZER_KEY]["param_groups"]:
                group["params"] = [fqn for fqn in group["params"] if fqn != name]
        if names_group is not None:
            groups = state[OPTIMIZER_KEY]["param_groups"]
            lists = [None] * dist.get_world_size(names_group)
            dist.all_gather_object(lists, [group["params"] for group in groups], group=names_group)
            for index, group in enumerate(groups):
                group["params"] = [fqn for names in lists for fqn in names[index]]
    with _single_process_dcp_quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if extra is not None and (not is_distributed() or dist.get_rank() == 0):
        torch.save(extra, path / EXTRA_STATE_FILE)
    barrier()


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
                 options=None, aliases: dict[str, str] | None = None) -> dict:
    """Read a `save_sharded` directory into `model` (and `optimizer`), resharding to this world size; collective.

    The optimizer is left as it is when the directory holds no optimizer state (saved without one). `aliases`
    {name: saved name}: a parameter the directory may hold under another name (a pipeline's last-stage copy of a
    tied lm_head, saved in one process as the embedding), read from that name when its own is not there. Returns
    the saved `extra` dict ({} when none was saved).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    problem = sharded_checkpoint_problem(path)
    if problem is not None:
        raise FileNotFoundError(problem) if not (path / ".metadata").is_file() else ValueError(problem)
    saved = _dcp_metadata(path).state_dict_metadata
    if not any(key.startswith(OPTIMIZER_KEY + ".") for key in saved):
        optimizer = None
    reshard(model)
    state = {MODEL_KEY: get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state[OPTIMIZER_KEY] = get_optimizer_state_dict(model, optimizer)  # creates the state tensors to load into
    renamed = _alias_saved_names(state, saved, aliases or {})
    with _single_process_dcp_quiet():
        dcp.load(state, storage_reader=safe_dcp_reader(path), planner=safe_dcp_planner(),
                 no_dist=not dist.is_initialized())
    _alias_saved_names(state, saved, renamed, back=True)
    set_model_state_dict(model, state[MODEL_KEY], options=options)
    if optimizer is not None:
        with _tuple_hyperparameters_kept(optimizer):
            set_optimizer_state_dict(model, optimizer, state[OPTIMIZER_KEY])
    extra_file = path / EXTRA_STATE_FILE
    return load_plain_data(extra_file) if extra_file.is_file() else {}


def _alias_saved_names(state: dict, saved, aliases, back: bool = False) -> list[tuple[str, str, str]]:
    """Rename the model and optimizer-state entries of `aliases` ({name: saved name}) whose own name the
    checkpoint lacks (`saved`: its keys) to the saved name, in place; `back`: undo the renames `aliases` (the list
    this returned) lists. Returns the renames as (section, name, saved name)."""
    def has(prefix: str) -> bool:
        return prefix in saved or any(key.startswith(prefix + ".") for key in saved)

    sections = {MODEL_KEY: state[MODEL_KEY], f"{OPTIMIZER_KEY}.state": state.get(OPTIMIZER_KEY, {}).get("state", {})}
    if back:
        for section, name, source in aliases:
            sections[section][name] = sections[section].pop(source)
        return []
    done = []
    for name, source in aliases.items():
        for section, entries in sections.items():
            if name in entries and not has(f"{section}.{name}") and has(f"{section}.{source}"):
                entries[source] = entries.pop(name)
                done.append((section, name, source))
    return done


def _dcp_metadata(path: Path):
    """The `.metadata` of a DCP directory, or a ValueError naming the directory and the problem."""
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a sharded checkpoint directory (no .metadata); pass the directory "
                                "that save_sharded / save_sharded_checkpoint wrote")
    try:
        return read_dcp_metadata(path)
    except CheckpointSecurityError:
        raise
    except Exception as e:  # any unpickling or I/O failure means the same thing to the user
        raise ValueError(f"the sharded checkpoint {path} has an unreadable .metadata ({type(e).__name__}: {e}); "
                         "it was damaged after the save: use another checkpoint") from e


def sharded_checkpoint_problem(path: str | os.PathLike) -> str | None:
    """What is missing from a `save_sharded` directory, or None when every shard its metadata names is there.

    Catches shards that other nodes wrote to their own local disks (a run directory that is not on a shared
    filesystem) and truncated shard files.
    """
    path = Path(path)
    try:
        metadata = _dcp_metadata(path)
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"shard file {name} is missing from {path}"
        if file.stat().st_size < size:
            return f"shard file {name} in {path} is truncated ({file.stat().st_size} bytes, needs {size})"
    return None


def sharded_shard_files(path: str | os.PathLike) -> list[str]:
    """The shard files (`__<rank>_<n>.distcp`) a `save_sharded` directory's metadata refers to."""
    metadata = _dcp_metadata(Path(path))
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()})


def read_sharded_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full (merged) model state dict of a `save_sharded` directory, on the CPU, in one process.

    Only the model's tensors are read (not the optimizer's), each into one full tensor of its saved shape and
    dtype, however many ranks wrote the shards: this is what `hyflow export` turns into a Hugging Face model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    metadata = _dcp_metadata(path)
    prefix = MODEL_KEY + "."
    model = {
        key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"the sharded checkpoint {path} holds no model tensors (no '{prefix}*' entries)")
    with _single_process_dcp_quiet():
        dcp.load({MODEL_KEY: model}, storage_reader=safe_dcp_reader(path), planner=safe_dcp_planner(), no_dist=True)
    return model


@contextlib.contextmanager
def _single_process_dcp_quiet():
    """DCP warns that it assumes one process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def barrier() -> None:
    """Wait for every rank (nothing to wait for in one process)."""
    if is_distributed():
        dist.barrier()
