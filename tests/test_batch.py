"""Tests for hyflow.batch.Batch: columns, row operations, merging, serialisation and every error message."""

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from hyflow.batch import Batch


def make_batch(n: int = 4, meta: dict | None = None) -> Batch:
    """Row i: ids [i, i+1, i+2], score i/10, position_ids filled with i, uid 'u{i}', extra {'i': i}."""
    ids = torch.arange(n)[:, None] + torch.arange(3)[None, :]
    return Batch(
        {"input_ids": ids, "score": torch.arange(n, dtype=torch.float32) / 10,
         "position_ids": torch.arange(n)[:, None, None].expand(n, 2, 3).clone()},
        {"uid": [f"u{i}" for i in range(n)], "extra": [{"i": i} for i in range(n)]},
        meta if meta is not None else {"temperature": 1.0},
    )


def row_ids(batch: Batch) -> list[int]:
    """Row identity read from the tensors; asserts non-tensors describe the same rows."""
    ids = batch["input_ids"][:, 0].tolist()
    assert list(batch["uid"]) == [f"u{i}" for i in ids]
    assert [e["i"] for e in batch["extra"]] == ids
    assert batch["position_ids"][:, 0, 0].tolist() == ids
    return ids


# ---- construction -----------------------------------------------------------------------------


def test_construct_and_basic_accessors():
    b = make_batch(4)
    assert len(b) == b.batch_size == 4
    assert b.keys() == ["input_ids", "score", "position_ids", "uid", "extra"]
    assert "uid" in b and "input_ids" in b and "nope" not in b
    assert isinstance(b.tensors, TensorDict) and b.tensors.batch_size == torch.Size([4])
    assert b["uid"].dtype == object and b["uid"].shape == (4,)
    assert b.meta == {"temperature": 1.0}


def test_list_of_lists_stays_one_dimensional_object_array():
    b = Batch(non_tensors={"tools": [[1, 2], [3, 4], [5, 6]], "t": ((1,), (2,), (3,))})
    assert b["tools"].shape == (3,) and b["tools"][1] == [3, 4]
    assert b["t"].shape == (3,) and b["t"][2] == (3,)
    assert len(b) == 3


def test_numeric_and_2d_arrays_become_object_rows():
    b = Batch(non_tensors={"idx": np.arange(3), "m": np.ones((3, 2))})
    assert b["idx"].dtype == object and b["idx"].tolist() == [0, 1, 2]
    assert b["m"].shape == (3,) and np.array_equal(b["m"][0], [1.0, 1.0])


def test_lengths_with_only_tensors_only_non_tensors_and_empty():
    assert len(Batch({"x": torch.zeros(5, 2)})) == 5
    assert len(Batch(non_tensors={"u": ["a", "b"]})) == 2
    assert len(Batch()) == 0 and Batch().keys() == []
    assert len(Batch(TensorDict({}, batch_size=[7]))) == 7


def test_tensordict_input_with_more_or_fewer_batch_dims():
    td2 = TensorDict({"x": torch.zeros(3, 2)}, batch_size=[3, 2])
    assert Batch(td2).tensors.batch_size == torch.Size([3])
    assert td2.batch_size == torch.Size([3, 2])  # caller's TensorDict untouched
    assert Batch(TensorDict({"x": torch.zeros(4, 2)})).tensors.batch_size == torch.Size([4])


def test_nested_tensors_are_supported():
    b = Batch({"x": torch.zeros(4, 2), "mm": {"pixels": torch.ones(4, 3, 5)}})
    assert b["mm"]["pixels"].shape == (4, 3, 5)
    part = b[np.array([3, 1])]
    assert part["mm"]["pixels"].shape == (2, 3, 5)
    assert "mm.pixels: (4, 3, 5) float32" in repr(b)
    assert Batch.concat([b, b])["mm"]["pixels"].shape == (8, 3, 5)


def test_inconsistent_lengths_name_key_and_lengths():
    with pytest.raises(ValueError, match=r"column 'uid' has length 3, expected 4"):
        Batch({"x": torch.zeros(4)}, {"uid": ["a", "b", "c"]})
    with pytest.raises(ValueError, match=r"column 'y' has length 2, expected 4"):
        Batch({"x": torch.zeros(4), "y": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"column 'mm.b' has length 3, expected 4"):
        Batch({"x": torch.zeros(4), "mm": {"b": torch.zeros(3)}})
    with pytest.raises(ValueError, match=r"column 'u' has length 1, expected 5"):
        Batch(TensorDict({}, batch_size=[5]), {"u": ["a"]})


def test_bad_column_types():
    with pytest.raises(TypeError, match=r"tensor column 'x' must be a torch.Tensor, got list; use torch.as_"):
        Batch({"x": [1, 2]})
    with pytest.raises(ValueError, match=r"tensor column 's' is 0-dimensional"):
        Batch({"s": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"non-tensor column 'u' must be a list, tuple or numpy .*got str"):
        Batch(non_tensors={"u": "abc"})


def test_from_dict_splits_by_type():
    data = {"x": torch.zeros(2, 3), "uid": ["a", "b"], "gt": np.array(["1", "2"])}
    b = Batch.from_dict(data, meta={"m": 1})
    assert list(b.tensors.keys()) == ["x"]
    assert set(b.non_tensors) == {"uid", "gt"}
    assert b.meta == {"m": 1}


# ---- indexing ---------------------------------------------------------------------------------


def test_getitem_str_and_missing_key():
    b = make_batch(3)
    assert torch.equal(b["score"], torch.tensor([0.0, 0.1, 0.2]))
    with pytest.raises(KeyError, match=r"no column 'nope' in Batch; available columns: \['input_ids'"):
        b["nope"]


def test_getitem_int_returns_row_dict():
    b = make_batch(3)
    row = b[1]
    assert row["input_ids"].tolist() == [1, 2, 3] and row["uid"] == "u1" and row["extra"] == {"i": 1}
    assert b[-1]["uid"] == "u2" and b[np.int64(0)]["uid"] == "u0"
    with pytest.raises(IndexError, match=r"row 3 out of range for Batch of length 3"):
        b[3]
    assert [r["uid"] for r in b] == ["u0", "u1", "u2"]


def test_getitem_slice_and_meta_shallow_copy():
    b = make_batch(6, meta={"temperature": 0.7, "metrics": {"a": 1}})
    part = b[1:4]
    assert row_ids(part) == [1, 2, 3]
    assert part.meta == b.meta and part.meta is not b.meta
    part.meta["new"] = 1
    assert "new" not in b.meta
    assert row_ids(b[::-2]) == [5, 3, 1]


@pytest.mark.parametrize("index", [
    [3, 0, 3], np.array([3, 0, 3]), torch.tensor([3, 0, 3]), [-1, 0, -1],
])
def test_getitem_index_arrays(index):
    assert row_ids(make_batch(4)[index]) == [3, 0, 3]


@pytest.mark.parametrize("mask", [
    [True, False, True, False], np.array([1, 0, 1, 0], dtype=bool), torch.tensor([1, 0, 1, 0]).bool(),
])
def test_getitem_bool_mask(mask):
    assert row_ids(make_batch(4)[mask]) == [0, 2]


def test_getitem_empty_index_and_errors():
    b = make_batch(4)
    empty = b[[]]
    assert len(empty) == 0 and empty.keys() == b.keys()
    with pytest.raises(IndexError, match=r"boolean mask has shape \(3,\), expected \(4,\)"):
        b[np.array([True, False, True])]
    with pytest.raises(IndexError, match=r"row index out of range for Batch of length 4: 0..4"):
        b[[0, 4]]
    with pytest.raises(IndexError, match=r"1-D array of ints or bools, got float64"):
        b[np.array([0.0, 1.0])]
    with pytest.raises(TypeError, match=r"Batch indices must be str, int, slice.*got float"):
        b[1.5]


def test_setitem_sets_checks_and_moves_between_kinds():
    b = make_batch(3)
    b["adv"] = torch.ones(3, 3)
    b["note"] = ["x", "y", "z"]
    assert "adv" in list(b.tensors.keys()) and b["note"][2] == "z"
    b["note"] = torch.zeros(3)  # replacing a non-tensor with a tensor leaves one column
    assert b.keys().count("note") == 1 and "note" not in b.non_tensors
    with pytest.raises(ValueError, match=r"column 'bad' has length 2, expected 3"):
        b["bad"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"column 'bad' has length 4, expected 3"):
        b["bad"] = [1, 2, 3, 4]
    empty = Batch()
    empty["x"] = torch.zeros(5)
    assert len(empty) == 5


# ---- column sets ------------------------------------------------------------------------------


def test_select_keys_and_meta():
    b = make_batch(3, meta={"temperature": 1.0, "step": 2})
    s = b.select("input_ids", "uid")
    assert s.keys() == ["input_ids", "uid"] and s.meta == b.meta and len(s) == 3
    assert s["input_ids"] is b["input_ids"]  # a view, not a copy
    assert b.select(meta_keys=["step"]).meta == {"step": 2}
    assert b.select().keys() == b.keys()
    with pytest.raises(KeyError, match=r"no column 'missing' in Batch; available columns: \['input_ids'"):
        b.select("uid", "missing")
    with pytest.raises(KeyError, match=r"no meta key 'x' in Batch; available meta keys: \['temp"):
        b.select("uid", meta_keys=["x"])


def test_pop_removes_in_place():
    b = make_batch(3)
    popped = b.pop("score", "uid")
    assert popped.keys() == ["score", "uid"] and len(popped) == 3 and popped.meta == {}
    assert b.keys() == ["input_ids", "position_ids", "extra"] and b.meta == {"temperature": 1.0}
    with pytest.raises(KeyError, match=r"no column 'score' in Batch"):
        b.pop("input_ids", "score")
    assert "input_ids" in b  # nothing removed when one key is missing


def test_union_merges_and_checks_conflicts():
    b = make_batch(3)
    other = Batch({"values": torch.ones(3), "input_ids": b["input_ids"].clone()},
                  {"gt": ["1", "2", "3"], "uid": ["u0", "u1", "u2"]}, {"temperature": 1.0, "step": 5})
    out = b.union(other)
    assert out is b
    assert b.keys() == ["input_ids", "score", "position_ids", "values", "uid", "extra", "gt"]
    assert b.meta == {"temperature": 1.0, "step": 5}

    with pytest.raises(ValueError, match=r"column 'score' differs"):
        make_batch(3).union(Batch({"score": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"column 'uid' differs"):
        make_batch(3).union(Batch(non_tensors={"uid": ["a", "b", "c"]}))
    with pytest.raises(ValueError, match=r"column 'extra' differs"):
        make_batch(3).union(Batch(non_tensors={"extra": [{"i": 0}, {"i": 1}, {"i": 7}]}))
    with pytest.raises(ValueError, match=r"meta\['temperature'\] differs \(1.0 vs 0.5\)"):
        make_batch(3).union(Batch(meta={"temperature": 0.5}))
    with pytest.raises(ValueError, match=r"cannot union Batches of lengths 3 and 2; lengths must match"):
        make_batch(3).union(make_batch(2))
    assert len(Batch().union(make_batch(2))) == 2
    nested = Batch({"mm": {"p": torch.ones(2, 3)}})
    nested.union(Batch({"mm": {"p": torch.ones(2, 3)}}))
    with pytest.raises(ValueError, match=r"column 'mm' differs"):
        nested.union(Batch({"mm": {"p": torch.zeros(2, 3)}}))


# ---- row operations ---------------------------------------------------------------------------


def test_concat_rows_and_metrics_merge():
    a = make_batch(2, meta={"temperature": 1.0, "metrics": {"loss": 0.5, "lr": [1e-3, 1e-3]}})
    b = make_batch(3, meta={"temperature": 1.0, "metrics": {"loss": 0.25, "lr": 1e-3}})
    c = Batch.concat([a, b])
    assert row_ids(c) == [0, 1, 0, 1, 2]
    assert c.meta == {"temperature": 1.0, "metrics": {"loss": [0.5, 0.25], "lr": [1e-3, 1e-3, 1e-3]}}
    assert a.meta["metrics"] == {"loss": 0.5, "lr": [1e-3, 1e-3]}  # parts untouched
    assert len(Batch.concat([make_batch(0), make_batch(2)])) == 2
    only_one = Batch.concat([make_batch(1), make_batch(1, meta={"temperature": 1.0, "metrics": {"x": 3}})])
    assert only_one.meta["metrics"] == {"x": [3]}
    reordered = make_batch(2).select("uid", "extra", "position_ids", "score", "input_ids")
    assert row_ids(Batch.concat([make_batch(1), reordered])) == [0, 0, 1]


def test_concat_errors():
    with pytest.raises(ValueError, match=r"needs at least one Batch"):
        Batch.concat([])
    with pytest.raises(ValueError, match=r"part 1 has meta keys \['step', 'temperature'\], part 0 has"):
        Batch.concat([make_batch(2), make_batch(2, meta={"temperature": 1.0, "step": 1})])
    with pytest.raises(ValueError, match=r"meta\['temperature'\] differs between part 0 and part 1"):
        Batch.concat([make_batch(2), make_batch(2, meta={"temperature": 0.5})])
    short = make_batch(2)
    short.pop("uid")
    with pytest.raises(ValueError, match=r"part 1 has columns .* part 0 has"):
        Batch.concat([make_batch(2), short])


def test_chunk_boundaries_and_error():
    parts = make_batch(6).chunk(3)
    assert [row_ids(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p.meta == {"temperature": 1.0} for p in parts)
    with pytest.raises(ValueError, match=r"cannot chunk a Batch of length 5 into 2 .*pad_to_multiple\(2\)"):
        make_batch(5).chunk(2)
    with pytest.raises(ValueError, match=r"chunk count must be >= 1, got 0"):
        make_batch(5).chunk(0)


def test_split_boundaries():
    parts = make_batch(7).split(3)
    assert [row_ids(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert make_batch(0).split(2) == []
    with pytest.raises(ValueError, match=r"split size must be >= 1, got 0"):
        make_batch(3).split(0)


def test_repeat_interleave_order_exact():
    b = make_batch(3)
    assert row_ids(b.repeat(2)) == [0, 0, 1, 1, 2, 2]
    assert row_ids(b.repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]
    assert row_ids(b.repeat(1)) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"repeat count must be >= 1, got 0"):
        b.repeat(0)


def test_pad_to_multiple_cycles_from_start():
    padded, pad = make_batch(3).pad_to_multiple(8)
    assert pad == 5 and row_ids(padded) == [0, 1, 2, 0, 1, 2, 0, 1]
    same, zero = make_batch(4).pad_to_multiple(2)
    assert zero == 0 and len(same) == 4
    assert make_batch(0).pad_to_multiple(4)[1] == 0
    with pytest.raises(ValueError, match=r"pad_to_multiple needs k >= 1, got 0"):
        make_batch(3).pad_to_multiple(0)
    with pytest.raises(ValueError, match=r"pad_count must be in \[0, 3\] for this Batch, got 4"):
        make_batch(3).unpad(4)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 12), k=st.integers(1, 20))
def test_pad_unpad_inverse(n, k):
    b = make_batch(n)
    padded, pad = b.pad_to_multiple(k)
    assert len(padded) % k == 0 and 0 <= pad < k and len(padded) == n + pad
    assert row_ids(padded)[n:] == [i % n for i in range(pad)] if n else pad == 0
    restored = padded.unpad(pad)
    assert row_ids(restored) == list(range(n))
    assert torch.equal(restored["score"], b["score"])


def test_reorder():
    b = make_batch(4)
    assert row_ids(b.reorder([2, 0, 3, 1])) == [2, 0, 3, 1]
    assert row_ids(b.reorder(torch.tensor([1, 0, 3, 2]))) == [1, 0, 3, 2]
    assert row_ids(b) == [0, 1, 2, 3]  # original unchanged


# ---- copies, devices, serialisation ---------------------------------------------------------


def test_to_and_clone():
    b = make_batch(3)
    moved = b.to("cpu")
    assert moved["input_ids"].device.type == "cpu" and moved.keys() == b.keys()
    assert b.to("meta")["score"].device.type == "meta"
    c = b.clone()
    c["score"][0] = 9.0
    c["extra"][0]["i"] = 9
    c.meta["temperature"] = 2.0
    assert b["score"][0] == 0.0 and b["extra"][0] == {"i": 0} and b.meta["temperature"] == 1.0


def assert_same(a: Batch, b: Batch) -> None:
    assert a.keys() == b.keys() and len(a) == len(b) and a.meta == b.meta
    for key in list(a.tensors.keys()):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key])
    for key in a.non_tensors:
        assert b[key].dtype == object and list(a[key]) == list(b[key])


def rich_batch() -> Batch:
    return Batch(
        {"ids": torch.arange(6).reshape(3, 2), "bf": torch.ones(3, 2, dtype=torch.bfloat16),
         "mask": torch.tensor([True, False, True])},
        {"s": ["a", "b", "c"], "d": [{"k": [1, 2]}, {}, {"x": None}], "n": [None, 1, 2.5],
         "l": [[1], [2, 3], []]},
        {"temperature": 0.6, "metrics": {"loss": [1.0, 2.0]}, "tag": None},
    )


def test_pickle_round_trip():
    b = rich_batch()
    assert_same(b, pickle.loads(pickle.dumps(b)))
    empty = pickle.loads(pickle.dumps(Batch()))
    assert len(empty) == 0 and empty.keys() == []


def test_pickle_of_a_slice_stores_only_its_rows():
    big = Batch({"x": torch.zeros(1000, 256)})
    part = big[:2]
    assert len(pickle.dumps(part)) < len(pickle.dumps(big)) / 50
    assert pickle.loads(pickle.dumps(part))["x"].shape == (2, 256)


def test_save_load_round_trip(tmp_path):
    b = rich_batch()
    path = tmp_path / "sub" / "batch.pt"
    b.save(path)
    assert_same(b, Batch.load(path))
    assert [p.name for p in path.parent.iterdir()] == ["batch.pt"]  # no temp file left


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Batch file not found: .*missing.pt"):
        Batch.load(tmp_path / "missing.pt")
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a torch file at all")
    with pytest.raises(ValueError, match=r"could not read Batch file .*corrupt.pt \(corrupt"):
        Batch.load(corrupt)
    truncated = tmp_path / "truncated.pt"
    rich_batch().save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"could not read Batch file .*truncated.pt"):
        Batch.load(truncated)
    foreign = tmp_path / "foreign.pt"
    torch.save({"x": 1}, foreign)
    with pytest.raises(ValueError, match=r"foreign.pt is not a Batch file written by Batch.save"):
        Batch.load(foreign)


def test_repr_is_short_summary():
    text = repr(make_batch(2, meta={"temperature": 1.0, "step": 3}))
    assert text.startswith("Batch(len=2, tensors={input_ids: (2, 3) int64, score: (2,) float32")
    assert "non_tensors=['uid', 'extra']" in text and "meta=['temperature', 'step']" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip_and_indexing():
    b = make_batch(4).to("cuda")
    assert b["input_ids"].is_cuda
    assert row_ids(b[torch.tensor([True, False, True, False], device="cuda")].to("cpu")) == [0, 2]
    assert row_ids(b.repeat(2).to("cpu")) == [0, 0, 1, 1, 2, 2, 3, 3]
    back = pickle.loads(pickle.dumps(b[1:3]))
    assert back["score"].is_cuda and row_ids(back.to("cpu")) == [1, 2]
