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
        # pipeline parallelism (hyflow.parallel.pipeline.PipelineParts): full state dicts are gathered from every
        # stage; a tied lm_head copy reads a one-process checkpoint's embedding
        self.pipeline = pipeline
        self.aliases = {}
        if pipeline is not None and pipeline.export_skip:
            embed = [name for name, p in module.named_parameters() if name.endswith("embed_tokens.weight")]
            self.aliases = dict.fromkeys(pipeline.export_skip, embed[0] if embed else "model.embed_tokens.weight")

    def _pipeline_state_dict(self, contents) -> dict:
        """`state_dict` under pipeline parallelism: every stage's full model and optimizer state, gathered on the
        pipeline's first rank (`hyflow.parallel.pipeline`); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from hyflow.parallel.pipeline import gather_stage_objects, merge_optimizer_states
        from hyflow.workers.fsdp import optimizer_has_stepped

        reshard(self.model)
        for stage in self.pipeline.stages:
            stage.reshard()
        weights = {name: tensor.cpu() for name, tensor in self._model_state(full_state_dict=True).items()}
        optimizer_state = None
        if "optimizer" in contents and self.optimizer is not None:
            optimizer_state = (get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
                full_state_dict=True)) if optimizer_has_stepped(self.optimizer) else {})
            optimizer_state = _to_cpu(optimizer_state)
            for name in self.aliases if optimizer_state else ():  # a tied lm_head copy: the embedding's entry is it
                optimizer_state["state"].pop(name, None)
                for group in optimizer_state["param_groups"]:
                    group["params"] = [fqn for fqn in group["params"] if fqn != name]
        gathered = gather_stage_objects(self.pipeline, (weights, optimizer_state), wanted=self.rank == 0)
        if gathered is None:
            return {}
        weights = {name: tensor for stage_weights, _ in gathered for name, tensor in stage_weights.items()}
        optimizer_state = None if optimizer_state is None else merge_optimizer_states([o for _, o in gathered])
        return self._components(weights, optimizer_state, contents)

    def _load_pipeline_state(self, components: dict, contents) -> None:
        """`load_state_dict` under pipeline parallelism: each stage takes its own tensors (and optimizer entries)
        of a whole model's state, saved at any layout."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        from hyflow.parallel.pipeline import local_optimizer_state

        state = components[f"{self.prefix}model"]
        own = set(get_model_state_dict(self.model, options=self._state_options()))
        local = {name: state[name if name in state else self.aliases.get(name, name)] for name in own}
        set_model_state_dict(self.model, local, options=self._state_options(full_state_dict=True))
        if "optimizer" in contents and f"{self.prefix}optimizer" in components and self.optimizer is not None:
            names = {name for name, _ in self.module.named_parameters()}
            load_full_optimizer_state_dict(self.model, self.optimizer, local_optimizer_state(
                components[f"{self.prefix}optimizer"], names, self.aliases))
        if "extra" in contents and f"{self.prefix}scheduler" in components and self.scheduler is not None:
            self.scheduler.load_state_dict(components[f"{self.prefix}scheduler"])

    def _components(self, weights: dict, optimizer_state: dict | None, contents) -> dict:
        """The checkpoint components of rank 0's gathered state."""
        out = {f"{self.prefix}model": weights}
        if self.lora is not None:
            out[f"{self.prefix}lora"] = dataclasses.asdict(self.lora)
        if optimizer_state is not None:
            out[f"{self.prefix}optimizer"] = optimizer_state
        if "extra" in contents and self.scheduler is not None:
            out[f"{self.prefix}scheduler"] = self.scheduler.state_dict()
        return out

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
        if self.pipeline is not None:
            return self._pipeline_state_dict(contents)
        weights = self._model_state(full_state_dict=True, cpu_offload=True)
        optimizer_state = (full_optimizer_state_dict(self.model, self.optimizer)
                           if "optimizer" in contents and self.optimizer is not None else None)
        if self.rank != 0:
            return {}
        return self._components(weights, optimizer_state, contents)

    def load_state_dict(self, components: dict, contents=CHECKPOINT_CONTENTS) -> None:
        """Restore what `state_dict` returned, saved at any world size (optimizer / schedule when `contents` has
        them and `components` holds them; else they stay as they are)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        if self.pipeline is not None:
            return self._load_pipeline_state(components, contents)
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


def _to_cpu(value):
    """`value` with every tensor in it (nested dicts and lists) on the CPU (to pickle between ranks)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value


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
        "tp": ..., "pp": pipeline stages' ranks, "group_rank": rank in the group that shares rows, "local_params":
        elements of the model this rank holds (FSDP2 shards and tensor-parallel splits), "params": elements of the
        whole model (under pipeline parallelism: of this rank's stages)}}."""
        from hyflow.workers.fsdp import local_tensor

        return {e.name: {"dp": e.dp_size, "sp": e.sp_size, "tp": e.tp_size, "pp": e.pp_size, "group_rank": e.group_rank,
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
