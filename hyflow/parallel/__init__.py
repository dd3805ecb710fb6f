"""Parallelism applied to a plain model on one mesh (torchtitan's shape): `ParallelDims` (`hyflow.parallel.dims`)
sizes the dimensions and builds the one DeviceMesh; `hyflow.parallel.parallelize` holds the order the dimensions are
applied in and the seats of pipeline and expert parallelism (`apply_pp`, `apply_ep`, issue 39)."""

from hyflow.parallel.dims import ParallelDims, ParallelMesh
from hyflow.parallel.parallelize import apply_ep, apply_pp

__all__ = ["ParallelDims", "ParallelMesh", "apply_ep", "apply_pp"]
