"""Batch: the one data container that flows between every stage of an RL step.

A `Batch` of length B holds three things (the layout of verl's `DataProto`, so verl users read it at once):

- `tensors`: a `tensordict.TensorDict` with `batch_size=[B]`; every tensor has B as its first dimension
  (`input_ids [B, T]`, `response_mask [B, R]`, `position_ids [B, 4, T]`, nested TensorDicts, ...).
- `non_tensors`: per-sample Python objects, each a 1-D numpy object array of length B (`uid`, `data_source`,
  `ground_truth`, `extra_info`, ...). GRPO groups are the `uid` column.
- `meta`: a plain dict for the whole batch (`temperature`, `global_steps`, `metrics`, ...).

Row operations (indexing, `chunk`, `split`, `repeat`, `pad_to_multiple`, `concat`) move tensors and
non-tensors together, so row i of every column always describes the same sample. Slices share storage with
the parent; index arrays, masks and `repeat` copy. Pickling and `save` store only the rows a batch views.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

_FILE_FORMAT = "hyflow.Batch/1"


def _to_object_array(key: str, value) -> np.ndarray:
    """Turn a list, tuple or array into a 1-D object array whose i-th element is the i-th row."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value if value.dtype == object else value.astype(object)
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise TypeError(
            f"non-tensor column {key!r} must be a list, tuple or numpy array with one entry per sample, "
            f"got {type(value).__name__}; put torch tensors in `tensors`"
        )
    out = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):
        out[i] = item
    return out


def _tensor_lengths(key: str, value) -> dict[str, int]:
    """First dimension of a tensor column, or of each leaf of a nested dict/TensorDict ("outer.inner")."""
    if isinstance(value, (dict, TensorDict)):
        lengths = {}
        for k, v in value.items():
            lengths.update(_tensor_lengths(f"{key}.{k}", v))
        return lengths
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"tensor column {key!r} must be a torch.Tensor, got {type(value).__name__}; "
            "use torch.as_tensor(...) or put it in `non_tensors`"
        )
    if value.dim() == 0:
        raise ValueError(f"tensor column {key!r} is 0-dimensional; tensors need the batch dimension first")
    return {key: value.shape[0]}


def _length_error(key: str, length: int, expected: int) -> ValueError:
    return ValueError(f"column {key!r} has length {length}, expected {expected}: "
                      "all columns share the batch length")


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its own data, so serialising a slice does not store the parent."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _values_equal(a, b) -> bool:
    """Equality of tensors, arrays, TensorDicts and plain Python values (containers compared deeply)."""
    if isinstance(a, (torch.Tensor, TensorDict)) or isinstance(b, (torch.Tensor, TensorDict)):
        if type(a) is not type(b):
            return False
        if isinstance(a, TensorDict):
            keys = list(a.keys())
            return set(keys) == set(b.keys()) and all(_values_equal(a[k], b[k]) for k in keys)
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == object or b.dtype == object:
            return a.shape == b.shape and all(map(_values_equal, a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_values_equal, a, b))
    return bool(a == b)


def _merge_metrics(parts: list[dict]) -> dict[str, list]:
    """{name: [value of part 0, value of part 1, ...]}; a part's list value contributes all its items."""
    merged: dict[str, list] = {}
    for metrics in parts:
        for name, value in metrics.items():
            merged.setdefault(name, []).extend(value if isinstance(value, list) else [value])
    return merged


class Batch:
    """B samples: `tensors` (TensorDict, batch_size [B]), `non_tensors` (object arrays), `meta` (dict)."""

    def __init__(self, tensors: dict | TensorDict | None = None, non_tensors: dict | None = None,
                 meta: dict | None = None):
        """Build a batch; lists, tuples and arrays in `non_tensors` become 1-D object arrays of length B.

        B is the TensorDict's batch size when one is given, else the first column's length.
        Raises ValueError naming a column whose length differs from B.
        """
        tensors = {} if tensors is None else tensors
        columns = {k: _to_object_array(k, v) for k, v in (non_tensors or {}).items()}
        lengths = {}
        for key, value in tensors.items():
            lengths.update(_tensor_lengths(key, value))
        lengths.update({k: len(v) for k, v in columns.items()})
        if isinstance(tensors, TensorDict) and tensors.batch_dims >= 1:
            length = tensors.batch_size[0]
        else:
            length = next(iter(lengths.values()), 0)
        for key, n in lengths.items():
            if n != length:
                raise _length_error(key, n, length)
        if isinstance(tensors, TensorDict):
            tensors = tensors.copy()
            tensors.batch_size = [length]
        else:
            tensors = TensorDict(dict(tensors), batch_size=[length])
        self.tensors: TensorDict = tensors
        self.non_tensors: dict[str, np.ndarray] = columns
        self.meta: dict = dict(meta or {})

    @classmethod
    def from_dict(cls, data: dict, meta: dict | None = None) -> Batch:
        """Split one dict by value type: tensors and TensorDicts to `tensors`, the rest to `non_tensors`."""
        tensors = {k: v for k, v in data.items() if isinstance(v, (torch.Tensor, TensorDict))}
        non_tensors = {k: v for k, v in data.items() if k not in tensors}
        return cls(tensors, non_tensors, meta)

    # ---- columns ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        """B, the number of samples (0 for an empty batch)."""
        return self.tensors.batch_size[0]

    @property
    def batch_size(self) -> int:
        """B, the number of samples (same as `len(batch)`)."""
        return len(self)

    def keys(self) -> list[str]:
        """Column names: tensor keys, then non-tensor keys."""
        return list(self.tensors.keys()) + list(self.non_tensors.keys())

    def __contains__(self, key: str) -> bool:
        """Whether `key` is a tensor or non-tensor column."""
        return key in self.tensors or key in self.non_tensors

    def _missing(self, key) -> KeyError:
        return KeyError(f"no column {key!r} in Batch; available columns: {self.keys()}")

    def __setitem__(self, key: str, value) -> None:
        """Set a column: a torch tensor becomes a tensor column, anything else a non-tensor column.

        A batch without columns takes the new column's length; otherwise the length must equal B.
        """
        is_tensor = isinstance(value, (torch.Tensor, TensorDict))
        if is_tensor:
            lengths = _tensor_lengths(key, value)
        else:
            value = _to_object_array(key, value)
            lengths = {key: len(value)}
        if not self.keys():
            self.tensors = TensorDict({}, batch_size=[next(iter(lengths.values()), 0)])
        for name, length in lengths.items():
            if length != len(self):
                raise _length_error(name, length, len(self))
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if is_tensor:
            self.tensors[key] = value
        else:
            self.non_tensors[key] = value

    def __getitem__(self, item):
        """`batch["key"]` -> the column; `batch[i]` -> one row as a dict; slice, index array or bool mask
        (list, numpy or torch) -> a new Batch of those rows (meta shallow-copied)."""
        if isinstance(item, str):
            if item in self.tensors:
                return self.tensors[item]
            if item in self.non_tensors:
                return self.non_tensors[item]
            raise self._missing(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            if not -len(self) <= item < len(self):
                raise IndexError(f"row {item} out of range for Batch of length {len(self)}")
            row = {k: self.tensors[k][item] for k in list(self.tensors.keys())}
            row.update({k: v[item] for k, v in self.non_tensors.items()})
            return row
        if isinstance(item, slice) and (item.step or 1) > 0:
            return self._take(item, item)
        if isinstance(item, slice):  # torch has no negative-step slices
            item = np.arange(len(self))[item]
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            index = self._index_array(item)
            return self._take(torch.from_numpy(index), index)
        raise TypeError(f"Batch indices must be str, int, slice, list, numpy array or torch tensor, "
                        f"got {type(item).__name__}")

    def _index_array(self, item) -> np.ndarray:
        """Normalise an index list/array/tensor or a bool mask to an int64 numpy array of row numbers."""
        index = item.cpu().numpy() if isinstance(item, torch.Tensor) else np.asarray(item)
        if index.dtype == bool:
            if index.shape != (len(self),):
                raise IndexError(f"boolean mask has shape {index.shape}, expected ({len(self)},)")
            return np.flatnonzero(index)
        if index.size == 0:
            return np.zeros(0, dtype=np.int64)
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise IndexError(f"row index must be a 1-D array of ints or bools, got {index.dtype} "
                             f"{index.shape}")
        if index.min() < -len(self) or index.max() >= len(self):
            raise IndexError(f"row index out of range for Batch of length {len(self)}: "
                             f"{index.min()}..{index.max()}")
        return index.astype(np.int64)

    def _take(self, tensor_index, array_index) -> Batch:
        tensors = self.tensors[tensor_index]
        non_tensors = {k: v[array_index] for k, v in self.non_tensors.items()}
        return Batch(tensors, non_tensors, self.meta)

    def __iter__(self):
        """Iterate over rows (dicts), as `batch[i]` for i in range(B)."""
        return (self[i] for i in range(len(self)))

    # ---- column sets -----------------------------------------------------------------------------

    def select(self, *keys: str, meta_keys: list[str] | None = None) -> Batch:
        """A new Batch with only `keys` (all columns if none given) and `meta_keys` of meta (all if None).

        Shares the column data with this batch.
        """
        keys = keys or tuple(self.keys())
        for key in keys:
            if key not in self:
                raise self._missing(key)
        for key in meta_keys or []:
            if key not in self.meta:
                raise KeyError(f"no meta key {key!r} in Batch; available meta keys: {list(self.meta)}")
        tensors = self.tensors.select(*[k for k in keys if k in self.tensors])
        non_tensors = {k: self.non_tensors[k] for k in keys if k in self.non_tensors}
        meta = self.meta if meta_keys is None else {k: self.meta[k] for k in meta_keys}
        return Batch(tensors, non_tensors, meta)

    def pop(self, *keys: str) -> Batch:
        """Remove `keys` from this batch in place and return them as a new Batch (meta stays here)."""
        for key in keys:
            if key not in self:
                raise self._missing(key)
        popped = Batch(TensorDict({}, batch_size=[len(self)]))
        for key in keys:
            popped[key] = self.tensors.pop(key) if key in self.tensors else self.non_tensors.pop(key)
        return popped

    def union(self, other: Batch) -> Batch:
        """Add `other`'s columns and meta to this batch in place; returns self.

        Keys present in both must hold equal values; lengths must match (a batch without columns takes any).
        """
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"cannot union Batches of lengths {len(self)} and {len(other)}; "
                             "lengths must match")
        other_keys = other.keys()
        for key in other_keys:
            if key in self and not _values_equal(self[key], other[key]):
                raise ValueError(f"cannot union: column {key!r} differs between the two Batches")
        for key, value in other.meta.items():
            if key in self.meta and not _values_equal(self.meta[key], value):
                raise ValueError(f"cannot union: meta[{key!r}] differs ({self.meta[key]!r} vs {value!r})")
        for key in other_keys:
            if key not in self:
                self[key] = other[key]
        self.meta.update({k: v for k, v in other.meta.items() if k not in self.meta})
        return self

    # ---- row operations --------------------------------------------------------------------------

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Stack batches row-wise. Columns must match; meta values must be equal in every part, except
        `meta["metrics"]` which is merged: metrics[name] -> list of every part's value(s), in order."""
        if not batches:
            raise ValueError("Batch.concat needs at least one Batch, got an empty list")
        first = batches[0]
        meta_keys = set(first.meta) - {"metrics"}
        for i, part in enumerate(batches[1:], start=1):
            if set(part.keys()) != set(first.keys()):
                raise ValueError(f"Batch.concat: part {i} has columns {part.keys()}, "
                                 f"part 0 has {first.keys()}")
            if set(part.meta) - {"metrics"} != meta_keys:
                raise ValueError(f"Batch.concat: part {i} has meta keys {sorted(part.meta)}, part 0 has "
                                 f"{sorted(first.meta)}")
            for key in meta_keys:
                if not _values_equal(first.meta[key], part.meta[key]):
                    raise ValueError(f"Batch.concat: meta[{key!r}] differs between part 0 and part {i}")
        tensors = torch.cat([part.tensors for part in batches], dim=0)
        non_tensors = {k: np.concatenate([p.non_tensors[k] for p in batches]) for k in first.non_tensors}
        meta = {k: first.meta[k] for k in meta_keys}
        metrics_parts = [part.meta["metrics"] for part in batches if "metrics" in part.meta]
        if metrics_parts:
            meta["metrics"] = _merge_metrics(metrics_parts)
        return Batch(tensors, non_tensors, meta)

    def chunk(self, n: int) -> list[Batch]:
        """Split into `n` equal parts (views); B must be divisible by n (see `pad_to_multiple`)."""
        if n < 1:
            raise ValueError(f"chunk count must be >= 1, got {n}")
        if len(self) % n:
            raise ValueError(f"cannot chunk a Batch of length {len(self)} into {n} equal parts; "
                             f"call pad_to_multiple({n}) first and unpad the results after")
        size = len(self) // n
        return [self[i * size:(i + 1) * size] for i in range(n)]

    def split(self, size: int) -> list[Batch]:
        """Split into consecutive parts of `size` rows (views); the last part may be smaller."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self[start:start + size] for start in range(0, len(self), size)]

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Repeat every row `n` times: interleave gives rows a,a,b,b (GRPO samples), else a,b,a,b."""
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, got {n}")
        rows = np.arange(len(self))
        return self[np.repeat(rows, n) if interleave else np.tile(rows, n)]

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Append rows 0, 1, 2, ... (cyclically) until B is a multiple of `k`; returns (padded, pad_count).

        pad_count = (-B) mod k. Returns self unchanged when pad_count is 0.
        """
        if k < 1:
            raise ValueError(f"pad_to_multiple needs k >= 1, got {k}")
        pad_count = -len(self) % k
        if pad_count == 0:
            return self, 0
        rows = np.concatenate([np.arange(len(self)), np.arange(pad_count) % len(self)])
        return self[rows], pad_count

    def unpad(self, pad_count: int) -> Batch:
        """Drop the last `pad_count` rows: the inverse of `pad_to_multiple`."""
        if not 0 <= pad_count <= len(self):
            raise ValueError(f"pad_count must be in [0, {len(self)}] for this Batch, got {pad_count}")
        return self[:len(self) - pad_count]

    def reorder(self, indices) -> Batch:
        """A new Batch whose row i is this batch's row `indices[i]`."""
        return self[self._index_array(indices)]

    # ---- copies, devices, serialisation --------------------------------------------------------

    def to(self, device) -> Batch:
        """A new Batch with tensors on `device` (non-tensors and meta shared)."""
        return Batch(self.tensors.to(device), self.non_tensors, self.meta)

    def clone(self) -> Batch:
        """A deep copy: tensors cloned, non-tensor objects and meta deep-copied."""
        return Batch(self.tensors.clone(), copy.deepcopy(self.non_tensors), copy.deepcopy(self.meta))

    def __getstate__(self) -> dict:
        """Plain-Python state (compacted tensors, object arrays, meta) for pickle, Ray and `save`."""
        tensors = self.tensors.apply(_compact).to_dict()
        return {"length": len(self), "tensors": tensors, "non_tensors": dict(self.non_tensors),
                "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        """Rebuild from `__getstate__` output."""
        self.tensors = TensorDict(state["tensors"], batch_size=[state["length"]])
        self.non_tensors = {k: _to_object_array(k, v) for k, v in state["non_tensors"].items()}
        self.meta = state["meta"]

    def save(self, path) -> None:
        """Write the batch to one file at `path` (torch.save of plain state; written atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"format": _FILE_FORMAT, **self.__getstate__()}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> Batch:
        """Read a batch written by `save`. The file is unpickled: load only files you trust."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Batch file not found: {path}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:
            raise ValueError(f"could not read Batch file {path} (corrupt or not written by Batch.save): "
                             f"{err}") from err
        if not isinstance(state, dict) or state.get("format") != _FILE_FORMAT:
            raise ValueError(f"{path} is not a Batch file written by Batch.save (format {_FILE_FORMAT})")
        batch = cls.__new__(cls)
        batch.__setstate__(state)
        return batch

    def __repr__(self) -> str:
        """`Batch(len=B, tensors={name: shape dtype}, non_tensors=[...], meta=[...])`."""
        tensors = ", ".join(
            f"{'.'.join(k) if isinstance(k, tuple) else k}: {tuple(v.shape)} {str(v.dtype)[len('torch.'):]}"
            for k, v in self.tensors.items(include_nested=True, leaves_only=True)
        )
        return (f"Batch(len={len(self)}, tensors={{{tensors}}}, non_tensors={list(self.non_tensors)}, "
                f"meta={list(self.meta)})")
