"""Reading checkpoint files without running code from them.

`torch.load(weights_only=False)` and `pickle.load` execute whatever a crafted file asks for (a `__reduce__`
that calls `os.system`); a sha256 manifest does not help, since whoever can write the file can rewrite the
manifest. Everything hyflow reads back from a checkpoint goes through this module instead:

- `load_plain_data(path)`: `torch.load(weights_only=True)`, torch's restricted unpickler, which builds tensors
  and plain containers only (dict, list, tuple, str, numbers, bool, None);
- `read_dcp_metadata(path)` / `SafeDCPReader`: the `.metadata` of a torch.distributed.checkpoint directory, which
  torch unpickles unrestricted, through an unpickler that admits only DCP's own metadata classes and the few
  torch values they hold (torch.Size, dtypes, layouts);
- `SafeDCPPlanner`: DCP's default load planner with its non-tensor items ("bytes": optimizer hyperparameters,
  step counts) read by `torch.load(weights_only=True)` instead of `weights_only=False`.

Anything else in such a file is a `CheckpointSecurityError` naming the file and what it asked for.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch


class CheckpointSecurityError(ValueError):
    """A checkpoint file holds something other than tensors and plain data (a pickled object or call)."""


_CHECKPOINT_FIX = ("Load checkpoints only from hyflow runs; a checkpoint written by an older hyflow that pickled "
                   "objects cannot be resumed: start a new run from its exported model instead")


def refusal(path: str | os.PathLike, what: str, fix: str = _CHECKPOINT_FIX) -> CheckpointSecurityError:
    """The error for a file that asks the unpickler for more than plain data: names the file, what it asked for
    (`what`) and `fix`. torch's own advice (reload with `weights_only=False`) is never repeated: that runs the code."""
    return CheckpointSecurityError(
        f"{path} holds more than tensors and plain data, so hyflow refuses to load it (loading it could run code "
        f"from the file): {what}. {fix}"
    )


_refusal = refusal


def load_plain_data(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """`torch.load(path, weights_only=True)`; a file that needs more is a `CheckpointSecurityError`."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal(path, weights_only_reason(exc)) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def weights_only_reason(exc: BaseException) -> str:
    """What a `torch.load(weights_only=True)` refusal was about ("it asks for posix.system"), without torch's
    advice around it (to reload with `weights_only=False`, which would run the file's code)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if (match := re.search(r"GLOBAL (\S+) was not an allowed global", text)) is not None:
        return f"it asks for {match.group(1)}"
    if (match := re.search(r"WeightsUnpickler error: ([^\n]*)", text)) is not None:
        return match.group(1).split(". Please")[0].strip().rstrip(".")
    first = _first_line(exc)
    if "weights_only" in first or "can still be loaded" in first:
        return "it holds a pickled object or call, not only tensors and plain containers"
    return first


_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Exact names only: that module also imports `os`, `torch`, `dataclass`, ..., and a dotted name such as
# (module, "os.system") resolves attribute by attribute from pickle protocol 4, so admitting the whole module
# would admit every function those imports reach.
_DCP_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                         "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
_ALLOWED_GLOBALS = {
    *((_DCP_METADATA_MODULE, name) for name in _DCP_METADATA_CLASSES),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _Refused(pickle.UnpicklingError):
    """The restricted unpickler refused a global (as opposed to a damaged file)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses and enum, torch.Size, dtypes and layouts, each by its exact name;
    refuses every other global, and every dotted name (which pickle would resolve attribute by attribute)."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _ALLOWED_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise _Refused(f"it asks for {module}.{name}")


def read_dcp_metadata(path: str | os.PathLike):
    """The `Metadata` in `<path>/.metadata` (a DCP directory), read by the restricted unpickler."""
    file = Path(path) / ".metadata"
    with open(file, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except _Refused as exc:
            raise _refusal(file, _first_line(exc)) from None


def _safe_reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeDCPReader(FileSystemReader):
        """DCP's file reader with `.metadata` read by `read_dcp_metadata`."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:
                raise CheckpointSecurityError(f"{self.path}: per-rank metadata files are not supported")
            metadata = read_dcp_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeDCPReader


def _safe_planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeDCPPlanner(DefaultLoadPlanner):
        """DCP's default load planner; non-tensor items are read with `weights_only=True`."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise _refusal(f"item {read_item.dest_index.fqn} of a sharded checkpoint",
                               weights_only_reason(exc)) from None
            super().load_bytes(read_item, _as_stream(obj))

    return SafeDCPPlanner


def _as_stream(obj: Any) -> io.BytesIO:
    """`obj` re-serialised, for the base planner's `load_bytes` (which then unpickles plain data only)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def safe_dcp_reader(path: str | os.PathLike):
    """A `SafeDCPReader` on the DCP directory `path`."""
    return _safe_reader_class()(str(path))


def safe_dcp_planner():
    """A `SafeDCPPlanner` (a DefaultLoadPlanner)."""
    return _safe_planner_class()()
