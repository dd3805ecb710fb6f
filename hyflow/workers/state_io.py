"""A `TrainEngine`'s checkpoint state: full (unsharded) state dicts and sharded DCP directories, and the
checkpoint methods a worker role mixes in (`EngineCheckpoints`).

Components are named `<prefix>model` (the adapter only under LoRA), `<prefix>lora` (the LoRA settings),
`<prefix>optimizer`, `<prefix>scheduler`; `contents` (`CHECKPOINT_CONTENTS`) says which of model / optimizer /
extra (the LR schedule) a call saves or loads. The collectives (full gathers, DCP) are `hyflow.workers.fsdp`'s.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hyflow.controller import Collect, Dispatch, register
from hyflow.workers.fsdp import (
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
    load_sharded,
    reshard,
)
from hyflow.workers.fsdp import save_sharded as save_sharded_state

CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")


class EngineState:
    """The checkpoint I/O of one engine: its wrapped `model` (`module` before wrapping), optimizer and LR
    schedule (None for a frozen model), LoRA settings (None without), component `prefix`, `rank`."""

    def __init__(self, *, name: str, model: nn.Module, module: nn.Module, optimizer, scheduler, lora, prefix: str,
                 rank: int, pipeline=None):
        self.name, self.model, self.module, self.optimizer, self.scheduler = name, model, module, optimizer, scheduler
        self.lora, self.prefix, self.rank = lora, prefix, rank
        # pipeline parallelism (hyflow.parallel.pipeline.PipelineParts): rank 0 holds one stage, so full state
        # dicts are refused; a tied lm_head copy reads a one-process checkpoint's embedding
        self.pipeline = pipeline
        self.aliases = {}
        if pipeline is not None and pipeline.export_skip:
            embed = [name for name, p in module.named_parameters() if name.endswith("embed_tokens.weight")]
            self.aliases = dict.fromkeys(pipeline.export_skip, embed[0] if embed else "model.embed_tokens.weight")

    def _refuse_full(self) -> None:
        if self.pipeline is not None:
            raise ValueError(f"{self.name}: full (gathered) checkpoints are not built under pipeline parallelism "
                             "(rank 0 holds one stage); use trainer.checkpoint_format=sharded (or auto)")

    def _state_options(self, **kwargs):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # With LoRA only the trainable tensors (the adapter, and a value head) are checkpoint state: the frozen
        # base weights come from the model path again.
        return StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None, **kwargs)

    def _model_state(self, **kwargs) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        reshard(self.model)
        state = get_model_state_dict(self.model, options=self._state_options(**kwargs))
        if self.lora is not None:  # a tied alias of a frozen weight (lm_head.weight) is not a parameter name
            trainable = {name for name, p in self.module.named_parameters() if p.requires_grad}
            state = {name: value for name, value in state.items() if name in trainable}
        return state

    def _check_adapter_keys(self, state: dict) -> None:
        if self.lora is None:
            return
        expected = set(self._model_state())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"the {self.name} checkpoint does not match this LoRA model: missing "
                             f"{missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected "
                             f"{unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}; resume with the lora_rank, "
                             "lora_alpha, target_modules and exclude_modules the run was saved with")

    def state_dict(self, contents=CHECKPOINT_CONTENTS) -> dict:
        """Full (unsharded) checkpoint components `<name>_model` (the adapter only under LoRA),
        `<name>_optimizer`, `<name>_scheduler` (as `contents` asks); collective; rank 0 returns them, others {}."""
        self._refuse_full()
        weights = self._model_state(full_state_dict=True, cpu_offload=True)
        optimizer_state = (full_optimizer_state_dict(self.model, self.optimizer)
                           if "optimizer" in contents and self.optimizer is not None else None)
        if self.rank != 0:
            return {}
        out = {f"{self.prefix}model": weights}
        if self.lora is not None:
            out[f"{self.prefix}lora"] = dataclasses.asdict(self.lora)
        if optimizer_state is not None:
            out[f"{self.prefix}optimizer"] = optimizer_state
        if "extra" in contents and self.scheduler is not None:
            out[f"{self.prefix}scheduler"] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, components: dict, contents=CHECKPOINT_CONTENTS) -> None:
        """Restore what `state_dict` returned, saved at any world size (optimizer / schedule when `contents` has
        them and `components` holds them; else they stay as they are)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        self._refuse_full()
        state = components[f"{self.prefix}model"]
        self._check_adapter_keys(state)
        set_model_state_dict(self.model, state, options=self._state_options(full_state_dict=True))
        if "optimizer" in contents and f"{self.prefix}optimizer" in components and self.optimizer is not None:
            load_full_optimizer_state_dict(self.model, self.optimizer, components[f"{self.prefix}optimizer"])
        if "extra" in contents and f"{self.prefix}scheduler" in components and self.scheduler is not None:
            self.scheduler.load_state_dict(components[f"{self.prefix}scheduler"])

    def save_sharded(self, path, contents=CHECKPOINT_CONTENTS) -> None:
        """Every rank's shards (DCP) of the model (the adapter only under LoRA), with the optimizer's and the LR
        schedule when `contents` has "optimizer" / "extra"; collective."""
        extra = {f"{self.prefix}scheduler": self.scheduler.state_dict()} if "extra" in contents else None
        if extra is not None and self.lora is not None:
            extra[f"{self.prefix}lora"] = dataclasses.asdict(self.lora)
        save_sharded_state(self.model, self.optimizer if "optimizer" in contents else None, path, extra=extra,
                           options=self._state_options(), optimizer_skip=set(self.aliases),
                           names_group=None if self.pipeline is None else self.pipeline.group)

    def load_sharded(self, path, contents=CHECKPOINT_CONTENTS) -> None:
        """Read a `save_sharded` directory written at any world size."""
        extra = load_sharded(self.model, self.optimizer if "optimizer" in contents else None, path,
                             options=self._state_options(), aliases=self.aliases)
        if "extra" in contents and f"{self.prefix}scheduler" in extra:
            self.scheduler.load_state_dict(extra[f"{self.prefix}scheduler"])


class EngineCheckpoints:
    """The checkpoint methods of a worker role that trains through a `TrainEngine` (hyflow.workers.train_engine)
    held as `self.engine`, mixed into its Worker class: collective calls the driver makes on every rank.
    `after_weights_loaded` runs after a load (the actor refreshes its rollout engine's weights there). An offloaded
    engine comes to the device for the call (the gathers and DCP's collectives run there) and goes back after;
    `offload_status` reports where each engine of the role lives."""

    engine: object  # the role's TrainEngine

    def after_weights_loaded(self) -> None:
        """Hook: called on every rank after a checkpoint's weights were loaded."""

    @register(Dispatch.REPLICATE, collect=Collect.FIRST)
    def state_dict(self, contents=CHECKPOINT_CONTENTS) -> dict:
        """Checkpoint components: full model weights (the adapter under LoRA), full optimizer state (by parameter
        name), LR schedule. Collective (every rank gathers); rank 0 returns the components, the other ranks {}."""
        with self.engine.on_device(optimizer="optimizer" in contents):  # offloaded: gathered on the device
            return self.engine.state_dict(contents)

    @register(Dispatch.REPLICATE)
    def load_state_dict(self, components: dict, contents=CHECKPOINT_CONTENTS) -> None:
        """Restore what `state_dict` returned (saved at any world size); `contents` as in `state_dict`."""
        with self.engine.on_device(optimizer="optimizer" in contents):
            self.engine.load_state_dict(components, contents)
        self.after_weights_loaded()

    @register(Dispatch.REPLICATE)
    def save_sharded_checkpoint(self, path: str, contents=CHECKPOINT_CONTENTS) -> None:
        """Write every rank's model shards (DCP) into directory `path`, with the optimizer's and the LR schedule
        when `contents` has "optimizer" / "extra"."""
        with self.engine.on_device(optimizer="optimizer" in contents):
            self.engine.save_sharded(path, contents)

    @register(Dispatch.REPLICATE)
    def load_sharded_checkpoint(self, path: str, contents=CHECKPOINT_CONTENTS) -> None:
        """Read a `save_sharded_checkpoint` directory written at any world size."""
        with self.engine.on_device(optimizer="optimizer" in contents):
            self.engine.load_sharded(path, contents)
        self.after_weights_loaded()

    @register(Dispatch.REPLICATE)
    def parallel_layout(self) -> dict:
        """This rank's layout of every engine the role holds: {engine name: {"dp": data-parallel size, "sp": ...,
        "tp": ..., "group_rank": rank in the group that shares rows, "local_params": elements of the model this
        rank holds (FSDP2 shards and tensor-parallel splits), "params": elements of the whole model}}."""
        from hyflow.workers.fsdp import local_tensor

        return {e.name: {"dp": e.dp_size, "sp": e.sp_size, "tp": e.tp_size, "group_rank": e.group_rank,
                         "local_params": sum(local_tensor(p).numel() for p in e.model.parameters()),
                         "params": sum(p.numel() for p in e.model.parameters())}
                for e in self._engines()}

    @register(Dispatch.REPLICATE)
    def offload_status(self) -> dict:
        """This rank's offload state of every engine the role holds: {engine name: {"params": "host" | "device",
        "optimizer": ..., "counts": {"params_to_host": n, ...}}}."""
        return {e.name: {**e.location(), "counts": dict(e.offload_counts)} for e in self._engines()}

    def _engines(self) -> list:
        """The engines this role holds: its own and, for the actor, a separate reference (LoRA's is the same)."""
        return list(dict.fromkeys(e for e in (self.engine, getattr(self, "ref", None)) if e is not None))
