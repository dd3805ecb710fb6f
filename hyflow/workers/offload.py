"""The offload state machine of a `TrainEngine` (verl's `fsdp_config.param_offload` / `optimizer_offload`).

The parameters (and the optimizer state) live in host memory from the engine's construction on and come to the
device only inside `on_device()`, which a role wraps around each pass (verl's load_fsdp_model_to_gpu /
offload_fsdp_model_to_cpu around compute_log_prob, update_actor, ...):

    with engine.on_device(optimizer=True):   # params (+ optimizer state) -> device; nested uses share one load
        engine.update(...)
    engine.location()                        # {"params": "host", "optimizer": "host"} again

Every move is recorded (`moves`, `counts`; the engine's `offload_log`, `offload_counts`). With
`fsdp_config.offload_policy` FSDP2's `CPUOffloadPolicy` keeps them on the host instead and streams each layer to
the device (no moves here). The tensor moves themselves are `hyflow.workers.fsdp`'s (`move_model`,
`optimizer_state_to_host`, `optimizer_state_back`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hyflow.workers.fsdp import (
    HOST,
    move_model,
    optimizer_state_back,
    optimizer_state_to_host,
    uses_offload_policy,
)

_MOVES = itertools.count()  # numbers every offload move of this process, across engines (OffloadMove.seq)


@dataclass(frozen=True)
class OffloadMove:
    """One move of an engine's `part` ("params" or "optimizer") `to` "host" or "device": the `seq`-th of this
    process (orders the moves of several engines), `nbytes` of this rank's tensors moved (0 when nothing was
    elsewhere: an optimizer that has not stepped, or the host is the device and nothing is copied)."""

    seq: int
    engine: str
    part: str
    to: str
    nbytes: int


class Offload:
    """Where one engine's parameters and optimizer state live, and the moves between host and device.

    `copies()` says whether a move to the device a tensor is already on copies it anyway (the engine's
    `offload_copies`, read at each move: tests set it on a CPU-only machine)."""

    def __init__(self, name: str, model: nn.Module, optimizer, device: torch.device, strategy: str, fsdp_config,
                 copies: Callable[[], bool]):
        """What is offloaded, then the initial move to the host."""
        self.name, self.model, self.optimizer, self.device, self.copies = name, model, optimizer, device, copies
        self.fsdp_cpu_offload = uses_offload_policy(strategy, fsdp_config)  # FSDP2 keeps them on the host
        self.offload_params = bool(getattr(fsdp_config, "param_offload", False)) and not self.fsdp_cpu_offload
        self.offload_optimizer = (bool(getattr(fsdp_config, "optimizer_offload", False)) and not self.fsdp_cpu_offload
                                  and self.optimizer is not None)
        self._where = {"params": "device", "optimizer": "device"}
        self._users = {"params": 0, "optimizer": 0}  # open on_device() scopes that need each part on the device
        self._optimizer_devices: dict = {}
        self.moves: list[OffloadMove] = []
        self.counts: Counter[str] = Counter()  # "params_to_host", "optimizer_to_device", ...
        self._offload("params", self.offload_params)
        self._offload("optimizer", self.offload_optimizer)

    def location(self) -> dict[str, str | None]:
        """Where the parameters and the optimizer state live now: "device" or "host" ("host" for good under
        offload_policy; optimizer None without one)."""
        params = "host" if self.fsdp_cpu_offload else self._where["params"]
        optimizer = None if self.optimizer is None else "host" if self.fsdp_cpu_offload else self._where["optimizer"]
        return {"params": params, "optimizer": optimizer}

    def describe(self) -> str:
        """`, parameters and optimizer state in host memory between uses` (the start-up line), "" without offload."""
        if self.fsdp_cpu_offload:
            return ", parameters, gradients and optimizer step in host memory (FSDP2 CPUOffloadPolicy)"
        parts = [name for name, on in (("parameters", self.offload_params),
                                       ("optimizer state", self.offload_optimizer)) if on]
        return f", {' and '.join(parts)} in host memory between uses (offload)" if parts else ""

    def _move(self, part: str, to: str) -> None:
        """Move `part` ("params" / "optimizer") `to` "host" or "device" and record it."""
        copy = self.copies()
        if part == "params":
            nbytes = move_model(self.model, HOST if to == "host" else self.device, copy=copy)
        elif to == "host":
            self._optimizer_devices, nbytes = optimizer_state_to_host(self.optimizer, copy=copy)
        else:
            nbytes = optimizer_state_back(self.optimizer, self._optimizer_devices, copy=copy)
        self._where[part] = to
        self.counts[f"{part}_to_{to}"] += 1
        self.moves.append(OffloadMove(next(_MOVES), self.name, part, to, nbytes))

    def _offload(self, part: str, enabled: bool) -> None:
        if enabled and self._where[part] == "device" and self._users[part] == 0:
            self._move(part, "host")

    def _load(self, part: str, enabled: bool) -> None:
        if enabled and self._where[part] == "host":
            self._move(part, "device")

    @contextlib.contextmanager
    def on_device(self, optimizer: bool = False) -> Iterator[None]:
        """The parameters (and with `optimizer` the optimizer state) on the device inside, back in host memory after
        when they are offloaded; nested scopes share the outermost one's load. Without offload: nothing moves."""
        parts = [part for part, enabled in (("params", self.offload_params),
                                            ("optimizer", optimizer and self.offload_optimizer)) if enabled]
        entered = []
        try:
            for part in parts:
                self._load(part, True)
                self._users[part] += 1
                entered.append(part)
            yield
        finally:
            for part in entered:  # verl's order: the model, then the optimizer
                self._users[part] -= 1
                self._offload(part, True)
