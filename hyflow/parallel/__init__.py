"""Parallelism applied to a plain model on one mesh (torchtitan's shape): `ParallelDims` (`hyflow.parallel.dims`)
sizes the dimensions and builds the one DeviceMesh; `parallelize` (`hyflow.parallel.parallelize`) applies them in one
order (pipeline and expert seats, tensor, sequence, activation checkpointing, compile, FSDP2 / DDP); the wrappers are
`hyflow.parallel.fsdp`'s."""

from hyflow.parallel.dims import ParallelDims, ParallelMesh
from hyflow.parallel.parallelize import Parallelized, ParallelizeSpec, apply_ep, apply_pp, parallelize

__all__ = ["ParallelDims", "ParallelMesh", "ParallelizeSpec", "Parallelized", "apply_ep", "apply_pp", "parallelize"]
