"""torch.compile of a model's per-token modules for the training engine's passes (verl's `use_torch_compile`).

What is compiled: every module whose class name ends in `MLP` or `RMSNorm` (Qwen2MLP, LlamaMLP, Qwen2RMSNorm,
...): the elementwise work between the matmuls (SiLU, the gate product, the norm's square, mean, rsqrt and
scale, and their backward) that eager PyTorch runs as one kernel per op over the whole activation. Inductor fuses
it. The attention is not compiled (hyflow's packed attention has Python control flow over the sequences); the
linears are matmuls either way. Measured on CPU (BENCHMARKS.md): 1.09-1.13x the training tokens/s, for
a one-time compile of about 5 s per model and grad mode.

When: only inside `CompiledModules.active()`, which the training engine enters for its own forwards (update,
old log-probs, reference) and their backward. Outside it the modules are the plain eager modules, so the hf
rollout engine that shares the actor's module decodes eagerly (one token per row per call, where a compiled call
costs more than it saves), and nothing compiled is left on the module for `copy.deepcopy`, `state_dict` or
pickling to meet. The compiled callables live on this object, one per module, made once (`dynamic=True`: the
packed token count changes every micro-batch; dynamo shares the graph between modules of one class).

The compiled and the eager modules give the same values up to floating-point reassociation (the norm's mean is a
different reduction order). Never run on a GPU: the same code, inductor's Triton backend there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hyflow.models.forward import unwrap_model

COMPILED_CLASS_SUFFIXES = ("MLP", "RMSNorm")


class CompiledModules:
    """The per-token modules of `model` (under DDP / FSDP2 / PEFT wrappers) and a compiled call for each."""

    def __init__(self, model: nn.Module):
        inner = unwrap_model(model)
        self.modules = [m for m in inner.modules() if type(m).__name__.endswith(COMPILED_CLASS_SUFFIXES)]
        if not self.modules:
            raise ValueError(
                f"use_torch_compile: {type(inner).__name__} has no module whose class name ends in "
                f"{' or '.join(COMPILED_CLASS_SUFFIXES)}, which is what hyflow compiles; set use_torch_compile=false")
        self.compiled = [torch.compile(m._call_impl, dynamic=True) for m in self.modules]

    @property
    def names(self) -> list[str]:
        """Class names of the compiled modules, each once (for the start-up line)."""
        return sorted({type(m).__name__ for m in self.modules})

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside, calling one of the modules runs its compiled call (nests; restored on exit)."""
        previous = [m._compiled_call_impl for m in self.modules]
        try:
            for module, compiled in zip(self.modules, self.compiled, strict=True):
                module._compiled_call_impl = compiled
            yield
        finally:
            for module, call in zip(self.modules, previous, strict=True):
                module._compiled_call_impl = call
