"""hyflow.parallel: ParallelDims sizes and validation, the one DeviceMesh (its layout on 4 gloo ranks: tensor-parallel
groups of consecutive ranks, then sequence-parallel ones, as hyflow's groups were before the mesh was their one
source), one process without a process group, the pipeline seat and what expert parallelism refuses."""

from __future__ import annotations

import re

import pytest
import torch
from ranks import init_gloo, spawn_ranks

from hyflow.parallel import ParallelDims, ParallelMesh, apply_ep, apply_pp


def test_dp_shard_takes_the_ranks_the_others_leave():
    dims = ParallelDims(world_size=8, tp=2, sp=2)
    assert (dims.dp_shard, dims.dp_size, dims.row_group_size) == (2, 2, 4)
    assert dims.sizes() == {"dp_shard": 2, "sp": 2, "tp": 2}
    assert dims.flattened() == {"dp": ("dp_shard",), "dp_shard_sp": ("dp_shard", "sp"),
                                "dp_sp": ("dp_shard", "sp"), "sp_tp": ("sp", "tp")}
    hsdp = ParallelDims(world_size=8, dp_replicate=2, dp_shard=4)
    assert (hsdp.dp_size, hsdp.sizes()) == (8, {"dp_replicate": 2, "dp_shard": 4})
    assert ParallelDims().sizes() == {} and ParallelDims().flattened() == {}
    # on several ranks the mesh keeps FSDP2's dimension at size 1 too (tp=2 on 2 ranks: a (1, 2) mesh, as before)
    tp_only = ParallelDims(world_size=2, tp=2)
    assert (tp_only.sizes(), tp_only.mesh_sizes()) == ({"tp": 2}, {"dp_shard": 1, "tp": 2})
    assert tp_only.flattened() == {"dp": ("dp_shard",), "dp_shard_sp": ("dp_shard",), "dp_sp": ("dp_shard",),
                                   "sp_tp": ("tp",)}
    assert ParallelDims().mesh_sizes() == {}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world_size": 4, "tp": 3}, "pp x dp_replicate x sp x tp = 1 x 1 x 1 x 3 must divide the world size 4"),
    ({"world_size": 4, "dp_shard": 3}, "pp x dp_replicate x dp_shard x sp x tp = 1 x 1 x 3 x 1 x 1 must equal the "
                                       "world size 4"),
    ({"world_size": 4, "sp": 0}, "sp=0 must be a positive integer"),
    ({"world_size": 4, "dp_shard": 0}, "dp_shard=0 must be a positive integer (or -1: the rest)"),
    ({"world_size": 4, "tp": 2, "ep": 8}, "ep=8 must divide dp_shard x sp x tp = 4"),
    ({"world_size": 4, "pp": 2, "ep": 4}, "ep=4 must divide dp_shard x sp x tp = 2"),  # ep within a pipeline stage
])
def test_sizes_that_do_not_fit_the_world_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims(**kwargs)


def test_one_process_builds_no_mesh_and_needs_no_process_group():
    assert not torch.distributed.is_initialized()
    mesh = ParallelDims().build_mesh("cpu")
    assert mesh.root is None
    assert all(mesh.get(name) is None for name in ("dp", "dp_shard", "sp", "tp", "dp_shard_sp", "pp"))
    assert (mesh.local_rank("tp"), mesh.group("sp")) == (0, None)
    with pytest.raises(KeyError, match="no mesh dimension 'cp'"):
        mesh.get("cp")
    assert not torch.distributed.is_initialized()


def test_pipeline_needs_a_decoder_and_expert_parallelism_needs_experts():
    model = torch.nn.Linear(2, 2)
    one = ParallelDims().build_mesh("cpu")
    assert apply_pp(model, ParallelDims(), one) is None and apply_ep(model, ParallelDims(), one) == []
    staged = ParallelMesh(ParallelDims(world_size=2, pp=2), None, {})  # a mesh without groups: refused before any
    with pytest.raises(ValueError, match="pipeline parallelism cuts a decoder with embed_tokens.*Linear is not one"):
        apply_pp(model, staged.dims, staged)
    two = ParallelMesh(ParallelDims(world_size=2, ep=2), None, {})  # a mesh without groups: refused before any
    with pytest.raises(ValueError, match="needs a mixture-of-experts model .* this model has none"):
        apply_ep(model, two.dims, two)


def _ranks(mesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def _layout_rank(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    init_gloo(rank, 4, init_file)
    pair, strided = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
    # tensor parallel: groups of 2 consecutive ranks; FSDP2 shards over the data-parallel ranks across them
    mesh = ParallelDims(world_size=4, tp=2).build_mesh("cpu")
    assert (_ranks(mesh.get("tp")), _ranks(mesh.get("sp_tp"))) == (pair, pair)
    assert _ranks(mesh.get("dp")) == _ranks(mesh.get("dp_shard_sp")) == strided
    assert (mesh.local_rank("tp"), mesh.local_rank("dp")) == (rank % 2, rank // 2)
    # sequence parallel: groups of 2 consecutive ranks; FSDP2 shards over all 4 ranks
    mesh = ParallelDims(world_size=4, sp=2).build_mesh("cpu")
    assert _ranks(mesh.get("sp")) == dist.get_process_group_ranks(mesh.group("sp")) == pair
    assert mesh.local_rank("sp") == rank % 2 == dist.get_rank(mesh.group("sp"))
    assert (_ranks(mesh.get("dp_shard_sp")), _ranks(mesh.get("dp"))) == ([0, 1, 2, 3], strided)
    # sequence x tensor: a 2-D (sp, tp) mesh, tp innermost; the four ranks share rows
    mesh = ParallelDims(world_size=4, sp=2, tp=2).build_mesh("cpu")
    assert (_ranks(mesh.get("tp")), _ranks(mesh.get("sp"))) == (pair, strided)
    assert (_ranks(mesh.get("sp_tp")), mesh.local_rank("sp_tp")) == ([0, 1, 2, 3], rank)
    assert mesh.root.mesh_dim_names == ("dp_shard", "sp", "tp")  # FSDP2's dimension, here of size 1
    assert (_ranks(mesh.get("dp")), mesh.group("dp"), _ranks(mesh.get("dp_shard_sp"))) == ([rank], None, strided)
    # HSDP: replicas outermost, shards inside
    mesh = ParallelDims(world_size=4, dp_replicate=2).build_mesh("cpu")
    assert (_ranks(mesh.get("dp_shard")), _ranks(mesh.get("dp"))) == ([rank // 2 * 2, rank // 2 * 2 + 1], [0, 1, 2, 3])
    assert mesh.local_rank("dp") == rank
    dist.destroy_process_group()


@pytest.mark.slow  # 4 spawned ranks: about 100 s on 2 shared cores
def test_the_mesh_lays_ranks_out_as_hyflows_groups_did(tmp_path):
    spawn_ranks(_layout_rank, args=(str(tmp_path / "init"),), nprocs=4, timeout_s=300)
