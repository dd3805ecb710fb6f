"""The seats `parallelize` fills in torchtitan's order: pipeline stages first (`apply_pp`, which cuts the model),
then tensor parallelism, sequence parallelism, expert parallelism (`apply_ep`), activation checkpointing, compile,
and FSDP2 `fully_shard` last (it shards what the others left).

Pipeline and expert parallelism are issue 39: their seats refuse a size above 1 by name, so a configuration that
asks for them fails before any model is cut.
"""

from __future__ import annotations

from torch import nn

from hyflow.parallel.dims import ParallelDims


def apply_pp(model: nn.Module, dims: ParallelDims, mesh=None) -> nn.Module:
    """Pipeline parallelism over `dims.pp` stages: the model unchanged at pp=1; not built for pp > 1."""
    if dims.pp > 1:
        raise NotImplementedError(f"pipeline parallelism (pp={dims.pp}) is not built yet (issue 39); use pp=1")
    return model


def apply_ep(model: nn.Module, dims: ParallelDims, mesh=None) -> nn.Module:
    """Expert parallelism over `dims.ep` ranks: the model unchanged at ep=1; not built for ep > 1."""
    if dims.ep > 1:
        raise NotImplementedError(f"expert parallelism (ep={dims.ep}) is not built yet (issue 39); use ep=1")
    return model
