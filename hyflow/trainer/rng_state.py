"""Snapshots of every global random generator, saved in a checkpoint so that a resumed run draws the same random
numbers as an uninterrupted one (`hyflow.trainer.checkpoint`'s bit-exact resume)."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """The state of every global random generator: Python `random`, NumPy's global generator, torch CPU, and
    torch CUDA on every device (only when CUDA is initialised in this process: an uninitialised CUDA
    generator has drawn nothing, and initialising it here would allocate a context in a CPU-only driver)."""
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {  # plain data only: checkpoints are loaded with weights_only=True
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)), int(pos),
                  int(has_gauss), float(cached_gaussian)],
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": cuda,
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set every global generator back to a `capture_rng_state()` snapshot, so the next draws repeat exactly.

    CUDA states are restored per device; a different device count (or no CUDA now) is a warning, since the
    resumed run then cannot be bit-exact on the GPU.
    """
    missing = [k for k in ("python", "numpy", "torch_cpu", "torch_cuda") if k not in state]
    if missing:
        raise ValueError(f"RNG state is missing {missing}; pass the dict that capture_rng_state() returned")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    keys = keys.cpu().numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)  # loaded to cuda: .cpu()
    np.random.set_state((kind, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached_gaussian)))
    torch.set_rng_state(state["torch_cpu"].cpu())
    cuda_states = state["torch_cuda"]
    if cuda_states is None:
        return
    if not torch.cuda.is_available():
        warnings.warn(
            f"the checkpoint holds CUDA RNG states for {len(cuda_states)} device(s) but CUDA is not available; "
            "CUDA random numbers will differ from the original run",
            stacklevel=2,
        )
        return
    if len(cuda_states) != torch.cuda.device_count():
        warnings.warn(
            f"the checkpoint holds CUDA RNG states for {len(cuda_states)} device(s), this process sees "
            f"{torch.cuda.device_count()}; restoring the common ones, the run is not bit-exact",
            stacklevel=2,
        )
    for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(cuda_state.cpu(), device)
