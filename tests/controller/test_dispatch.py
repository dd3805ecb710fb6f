"""Pure dispatch functions: register, split_args, collect_results (padding, chunk sizes, unpad order,
metrics merging, errors). Metrics are reduced by `hyflow.algos.reduce_metrics` (tests/algos/test_val_metrics.py)."""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.batch import Batch
from hyflow.controller import (
    Collect,
    Dispatch,
    DispatchMode,
    collect_results,
    register,
    registered_methods,
    split_args,
)
from hyflow.controller.dispatch import (
    MINI_BATCH_ROWS,
    DataLayout,
    check_layout,
    mini_batch_major_order,
    with_mini_batch_rows,
)

DP = DispatchMode(Dispatch.DP_SPLIT)
MB = DispatchMode(Dispatch.DP_MINI_BATCHES, pad=False)


def make_batch(n: int) -> Batch:
    """Row i: x = i, uid 'u{i}'."""
    return Batch({"x": torch.arange(n)}, {"uid": [f"u{i}" for i in range(n)]}, {"temperature": 1.0})


def row_wise(batch: Batch, rank: int) -> Batch:
    """A row-wise worker body: y = 10 x, with per-rank metrics."""
    return Batch({"y": batch["x"] * 10}, {"uid": batch["uid"]},
                 {"metrics": {"rows": len(batch), "rank": rank}})


# ---- register ----------------------------------------------------------------------------------


def test_register_stores_mode_and_returns_function():
    def forward(self, batch):
        return batch

    decorated = register(Dispatch.DP_SPLIT, pad=False)(forward)
    assert decorated is forward
    assert forward.__hyflow_dispatch__ == DispatchMode(Dispatch.DP_SPLIT, Collect.CONCAT, pad=False)


@pytest.mark.parametrize(("dispatch", "collect"), [(Dispatch.DP_SPLIT, Collect.CONCAT),
                                                   (Dispatch.REPLICATE, Collect.ALL),
                                                   (Dispatch.RANK_ZERO, Collect.FIRST),
                                                   (Dispatch.DIRECT, Collect.ALL)])
def test_default_collect_per_dispatch(dispatch, collect):
    assert DispatchMode(dispatch).collect is collect


def test_modes_accept_strings():
    assert DispatchMode("dp_split", "all") == DispatchMode(Dispatch.DP_SPLIT, Collect.ALL)


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown Dispatch 'scatter'; valid: Dispatch.REPLICATE"):
        DispatchMode("scatter")
    with pytest.raises(ValueError, match=r"unknown Collect 'sum'; valid: Collect.CONCAT"):
        DispatchMode(Dispatch.REPLICATE, "sum")


def test_rank_zero_only_collects_first():
    with pytest.raises(ValueError, match=r"RANK_ZERO runs one rank.*Collect.FIRST"):
        register(Dispatch.RANK_ZERO, Collect.ALL)


def test_bare_register_is_an_error():
    with pytest.raises(TypeError, match=r"@register needs parentheses"):
        @register
        def forward(self, batch):
            return batch


def test_registered_methods_include_inherited_only_registered():
    class Base:
        @register(Dispatch.DP_SPLIT)
        def forward(self, batch):
            return batch

        def helper(self):
            return 1

    class Child(Base):
        @register(Dispatch.RANK_ZERO)
        def save(self, path):
            return path

    assert registered_methods(Child) == {"forward": DispatchMode(Dispatch.DP_SPLIT),
                                         "save": DispatchMode(Dispatch.RANK_ZERO)}


# ---- split_args --------------------------------------------------------------------------------


def test_dp_split_pads_chunks_and_unpads_in_order():
    batch = make_batch(7)
    args, kwargs, pad_count = split_args(DP, 3, (batch, "replicated"), {"scale": 2.0}, method="W.f")
    assert pad_count == 2
    assert [len(a[0]) for a in args] == [3, 3, 3]
    # rank order; the padding rows are copies of rows 0, 1 appended at the end
    assert [a[0]["x"].tolist() for a in args] == [[0, 1, 2], [3, 4, 5], [6, 0, 1]]
    assert [list(a[0]["uid"]) for a in args][2] == ["u6", "u0", "u1"]
    assert all(a[1] == "replicated" for a in args) and all(k == {"scale": 2.0} for k in kwargs)
    results = [row_wise(a[0], rank) for rank, a in enumerate(args)]
    out = collect_results(DP, results, pad_count, padded_size=9)
    assert out["y"].tolist() == [0, 10, 20, 30, 40, 50, 60]
    assert list(out["uid"]) == [f"u{i}" for i in range(7)]
    assert out.meta["metrics"] == {"rows": [3, 3, 3], "rank": [0, 1, 2]}


def test_dp_split_keyword_batches_split_alike():
    a, b = make_batch(4), make_batch(4)
    args, kwargs, pad_count = split_args(DP, 2, (a,), {"other": b, "k": 1})
    assert pad_count == 0
    assert [kw["other"]["x"].tolist() for kw in kwargs] == [[0, 1], [2, 3]]
    assert [arg[0]["x"].tolist() for arg in args] == [[0, 1], [2, 3]]
    assert [kw["k"] for kw in kwargs] == [1, 1]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 23), world_size=st.integers(1, 5))
def test_dp_split_round_trip_equals_direct_call(rows, world_size):
    batch = make_batch(rows)
    args, _, pad_count = split_args(DP, world_size, (batch,), {})
    sizes = [len(a[0]) for a in args]
    assert pad_count == -rows % world_size
    assert len(sizes) == world_size and len(set(sizes)) == 1 and sum(sizes) == rows + pad_count
    results = [row_wise(a[0], r) for r, a in enumerate(args)]
    out = collect_results(DP, results, pad_count, padded_size=sum(sizes))
    direct = row_wise(batch, 0)
    assert torch.equal(out["y"], direct["y"]) and list(out["uid"]) == list(direct["uid"])
    assert out.meta["metrics"]["rows"] == sizes


def test_dp_split_without_pad_rejects_indivisible_batch():
    mode = DispatchMode(Dispatch.DP_SPLIT, pad=False)
    with pytest.raises(ValueError, match=r"Actor.update: a Batch of 7 rows cannot be split evenly across DP "
                                         r"size 3 \(registered with pad=False\)"):
        split_args(mode, 3, (make_batch(7),), {}, method="Actor.update")
    args, _, pad_count = split_args(mode, 3, (make_batch(6),), {})
    assert pad_count == 0 and [len(a[0]) for a in args] == [2, 2, 2]


def test_dp_split_needs_a_batch_of_one_length():
    with pytest.raises(TypeError, match=r"W.f is registered with Dispatch.DP_SPLIT but got no Batch"):
        split_args(DP, 2, ([1, 2],), {}, method="W.f")
    with pytest.raises(ValueError, match=r"different lengths \[3, 4\]"):
        split_args(DP, 2, (make_batch(3), make_batch(4)), {})


def test_replicate_and_rank_zero():
    args, kwargs, pad = split_args(Dispatch.REPLICATE, 3, (1, "a"), {"k": 2})
    assert args == [(1, "a")] * 3 and kwargs == [{"k": 2}] * 3 and pad == 0
    kwargs[0]["k"] = 5
    assert kwargs[1]["k"] == 2  # kwargs dicts are independent per rank
    args, kwargs, pad = split_args(Dispatch.RANK_ZERO, 3, (1,), {"k": 2})
    assert args == [(1,)] and kwargs == [{"k": 2}] and pad == 0


def test_direct_hands_element_i_to_rank_i():
    args, kwargs, pad = split_args(Dispatch.DIRECT, 3, ([1, 2, 3],), {"seed": (7, 8, 9)})
    assert args == [(1,), (2,), (3,)] and kwargs == [{"seed": 7}, {"seed": 8}, {"seed": 9}] and pad == 0


def test_direct_rejects_wrong_lengths():
    with pytest.raises(ValueError, match=r"W.set_seed is registered with Dispatch.DIRECT: argument 'seed' "
                                         r"must be a list with one value per rank \(3\), got a list of "
                                         r"length 2"):
        split_args(Dispatch.DIRECT, 3, (), {"seed": [1, 2]}, method="W.set_seed")
    with pytest.raises(ValueError, match=r"argument 0 must be a list.*got a int"):
        split_args(Dispatch.DIRECT, 3, (5,), {})


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        split_args(DP, 0, (make_batch(2),), {})


# ---- DP_MINI_BATCHES ---------------------------------------------------------------------------


def local_mini_batches(args: list[tuple], per_rank: int) -> list[list[list[int]]]:
    """[rank][k] -> the x values of rank's k-th local mini-batch of `per_rank` rows."""
    return [[part["x"].tolist() for part in a[0].split(per_rank)] for a in args]


def test_mini_batch_major_gives_each_rank_its_share_of_every_mini_batch():
    # 12 rows, mini-batches of 4 rows, 2 ranks: rank r gets rows 2r, 2r+1 of each mini-batch
    batch = with_mini_batch_rows(make_batch(12), 4)
    args, kwargs, pad_count = split_args(MB, 2, (batch,), {"k": 1}, method="W.update")
    assert pad_count == 0 and kwargs == [{"k": 1}, {"k": 1}]
    assert local_mini_batches(args, 2) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]
    assert [list(a[0]["uid"]) for a in args][1] == ["u2", "u3", "u6", "u7", "u10", "u11"]


@settings(max_examples=60, deadline=None)
@given(mini_batches=st.integers(1, 4), per_rank=st.integers(1, 3), world_size=st.integers(1, 4))
def test_mini_batch_major_ranks_together_walk_the_global_mini_batches(mini_batches, per_rank, world_size):
    mini = per_rank * world_size
    batch = with_mini_batch_rows(make_batch(mini_batches * mini), mini)
    args, _, _ = split_args(MB, world_size, (batch,), {})
    local = local_mini_batches(args, per_rank)
    for k in range(mini_batches):  # the k-th global mini-batch = the ranks' k-th local ones, in rank order
        assert [x for r in range(world_size) for x in local[r][k]] == list(range(k * mini, (k + 1) * mini))


def test_mini_batch_major_order_matches_the_formula_and_declines_ragged_layouts():
    order = mini_batch_major_order(8, 4, 2)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert mini_batch_major_order(8, 4, 1) is None  # one rank: nothing to lay out
    assert mini_batch_major_order(10, 4, 2) is None  # not a whole number of mini-batches
    assert mini_batch_major_order(12, 6, 4) is None  # the ranks do not divide a mini-batch
    args, _, _ = split_args(MB, 2, (with_mini_batch_rows(make_batch(10), 4),), {})
    assert [a[0]["x"].tolist() for a in args] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # the plain DP_SPLIT cut


def test_mini_batch_major_needs_the_mini_batch_size_on_several_ranks():
    with pytest.raises(ValueError, match=r"W.update is registered with Dispatch.DP_MINI_BATCHES, so its Batch must "
                                         r"say its mini-batch size to be split across 2 ranks: set "
                                         r"meta\['mini_batch_rows'\]"):
        split_args(MB, 2, (make_batch(4),), {}, method="W.update")
    args, _, _ = split_args(MB, 1, (make_batch(4),), {})  # one rank walks the rows as given
    assert args[0][0]["x"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"different meta\['mini_batch_rows'\] \[2, 4\]"):
        split_args(MB, 2, (with_mini_batch_rows(make_batch(4), 2), with_mini_batch_rows(make_batch(4), 4)), {})
    with pytest.raises(ValueError, match=r"W.update: a Batch of 5 rows cannot be split evenly across DP size 2"):
        split_args(MB, 2, (with_mini_batch_rows(make_batch(5), 5),), {}, method="W.update")


def test_mini_batch_major_is_registered_without_padding():
    with pytest.raises(ValueError, match=r"DP_MINI_BATCHES splits whole mini-batches.*register it with pad=False"):
        register(Dispatch.DP_MINI_BATCHES)
    assert DispatchMode("dp_mini_batches", pad=False).collect is Collect.CONCAT


def test_with_mini_batch_rows_is_a_view_with_its_own_meta():
    batch = make_batch(4)
    view = with_mini_batch_rows(batch, 2)
    assert view.meta == {"temperature": 1.0, MINI_BATCH_ROWS: 2} and batch.meta == {"temperature": 1.0}
    assert torch.equal(view["x"], batch["x"])
    with pytest.raises(ValueError, match=r"mini-batch rows must be an int >= 1, got 0"):
        with_mini_batch_rows(batch, 0)


# ---- collect_results ---------------------------------------------------------------------------


def test_collect_first_and_all():
    assert collect_results(DispatchMode(Dispatch.REPLICATE, Collect.FIRST), ["a", "b"]) == "a"
    assert collect_results(Dispatch.REPLICATE, ["a", "b"]) == ["a", "b"]
    assert collect_results(Dispatch.RANK_ZERO, ["only"]) == "only"


def test_concat_tensors_lists_and_none_with_padding():
    assert collect_results(DP, [torch.tensor([1, 2]), torch.tensor([3, 9])], 1).tolist() == [1, 2, 3]
    assert collect_results(DP, [[1, 2], (3, 9)], 1, padded_size=4) == [1, 2, 3]
    assert collect_results(DP, [None, None], 1) is None


def test_concat_metrics_only_results_keep_their_metrics():
    parts = [Batch(meta={"metrics": {"loss": r}}) for r in (0.5, 1.5)]
    out = collect_results(DP, parts, pad_count=1, padded_size=4)
    assert len(out) == 0 and out.meta["metrics"] == {"loss": [0.5, 1.5]}


def test_metrics_list_values_contribute_all_items():
    parts = [Batch({"y": torch.zeros(2)}, meta={"metrics": {"loss": [1.0, 2.0]}}),
             Batch({"y": torch.zeros(2)}, meta={"metrics": {"loss": [3.0, 4.0]}})]
    assert collect_results(DP, parts).meta["metrics"] == {"loss": [1.0, 2.0, 3.0, 4.0]}


def test_concat_rejects_mixed_types():
    with pytest.raises(TypeError, match=r"W.f: Collect.CONCAT cannot concatenate results of types "
                                        r"\['dict', 'list'\].*collect=Collect.ALL"):
        collect_results(DP, [[1], {"a": 1}], method="W.f")


def test_unpad_needs_row_wise_results():
    results = [make_batch(4), make_batch(4)]  # 8 rows back for 6 padded input rows
    with pytest.raises(ValueError, match=r"W.f returned 8 rows for 6 input rows \(1 of them padding\); "
                                         r"padding can only be removed from row-wise results"):
        collect_results(DP, results, pad_count=1, padded_size=6, method="W.f")


def sampler(batch: Batch, n: int) -> Batch:
    """A worker body that returns `n` rows per input row, in input order (a rollout of n samples per prompt)."""
    return Batch({"y": batch["x"].repeat_interleave(n)}, {"uid": list(np.repeat(batch["uid"], n))})


@pytest.mark.parametrize(("rows", "world_size", "n"), [(5, 2, 3), (7, 3, 2), (4, 4, 1), (1, 3, 4)])
def test_padding_outputs_dropped_for_several_rows_per_input_row(rows, world_size, n):
    batch = make_batch(rows)
    args, _, pad_count = split_args(DP, world_size, (batch,), {})
    results = [sampler(a[0], n) for a in args]
    out = collect_results(DP, results, pad_count, padded_size=rows + pad_count)
    direct = sampler(batch, n)
    assert torch.equal(out["y"], direct["y"]) and list(out["uid"]) == list(direct["uid"])


def test_collect_needs_results():
    with pytest.raises(ValueError, match=r"W.f: no results to collect"):
        collect_results(DP, [], method="W.f")


# ---- data-parallel layout (mesh=): one part per data-parallel rank, one result per group ----------------------------

def groups_of_two(world_size: int) -> list[DataLayout]:
    """Ranks 2d, 2d+1 form data-parallel rank d (a sequence-parallel pair); the group's second rank collects (as a
    mesh could choose), so collecting is not rank order."""
    return [DataLayout(dp_rank=r // 2, dp_size=world_size // 2, collects=r % 2 == 1) for r in range(world_size)]


@pytest.mark.parametrize("rows", [4, 5, 8, 1])
def test_layout_sends_a_group_one_part_and_collects_it_once(rows):
    layout = groups_of_two(4)
    mode = DispatchMode(Dispatch.DP_SPLIT, mesh="actor")
    args, _, pad_count = split_args(mode, 4, (make_batch(rows),), {}, layout=layout)
    assert pad_count == -rows % 2  # padded to the data-parallel size (2), not the world size (4)
    parts = [a[0]["x"].tolist() for a in args]
    assert parts[0] == parts[1] and parts[2] == parts[3]
    assert parts[0] + parts[2] == list(range(rows)) + list(range(pad_count))
    results = [row_wise(a[0], rank) for rank, a in enumerate(args)]
    out = collect_results(mode, results, pad_count, padded_size=rows + pad_count, layout=layout)
    assert out["y"].tolist() == [10 * i for i in range(rows)]
    assert out.meta["metrics"]["rank"] == [1, 3]  # the collecting rank of each group, in data-parallel order
    assert collect_results(DispatchMode(Dispatch.DP_SPLIT, Collect.ALL, mesh="actor"), ["a", "b", "c", "d"],
                           layout=layout) == ["b", "d"]
    assert collect_results(DispatchMode(Dispatch.DP_SPLIT, Collect.FIRST), ["a", "b", "c", "d"], layout=layout) == "a"


def test_layout_lays_mini_batches_out_by_the_data_parallel_size():
    mode = DispatchMode(Dispatch.DP_MINI_BATCHES, pad=False, mesh="actor")
    batch = with_mini_batch_rows(make_batch(8), 4)  # mini-batches of 4 rows, 2 data-parallel ranks of 2 ranks each
    args, _, _ = split_args(mode, 4, (batch,), {}, layout=groups_of_two(4))
    assert [a[0]["x"].tolist() for a in args] == [[0, 1, 4, 5], [0, 1, 4, 5], [2, 3, 6, 7], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match=r"a Batch of 7 rows cannot be split evenly across DP size 2"):
        split_args(mode, 4, (with_mini_batch_rows(make_batch(7), 4),), {}, layout=groups_of_two(4))


def test_layouts_are_checked_and_mesh_needs_a_batch_dispatch():
    assert check_layout(groups_of_two(4), "actor") == groups_of_two(4)
    with pytest.raises(ValueError, match=r"mesh 'actor': the ranks report different data-parallel sizes \[1, 2\]"):
        check_layout([DataLayout(0, 2, True), DataLayout(0, 1, True)], "actor")
    with pytest.raises(ValueError, match=r"mesh 'actor': .*collecting ranks \[0, 0, 1\].*exactly one collecting rank"):
        check_layout([DataLayout(0, 2, True), DataLayout(0, 2, True), DataLayout(1, 2, True)], "actor")
    with pytest.raises(ValueError, match=r"mesh 'actor': data-parallel ranks \[0, 0\] of size 2"):
        check_layout([DataLayout(0, 2, True), DataLayout(0, 2, False)], "actor")
    with pytest.raises(ValueError, match=r"mesh='actor' sets how a batch is split, so it needs Dispatch.DP_SPLIT"):
        register(Dispatch.REPLICATE, mesh="actor")
    with pytest.raises(ValueError, match=r"W.f: a layout of 2 ranks for a group of 4"):
        split_args(DispatchMode(Dispatch.DP_SPLIT, mesh="a"), 4, (make_batch(4),), {}, method="W.f",
                   layout=groups_of_two(2))
