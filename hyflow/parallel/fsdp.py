"""The wrappers `parallelize` applies last: FSDP2 (`fully_shard`, ZeRO-3) and DDP, with the decoder-layer discovery
and the mixed-precision and offload policies they take.

FSDP2. Every parameter becomes a DTensor sharded on dim 0 over the mesh of the ranks that shard the parameters (the
`dp_shard_sp` dimension of `hyflow.parallel.dims`: the data-parallel ranks, and under sequence parallelism the ranks
of each sequence-parallel group too; under tensor parallelism the split parameters keep their tp dimension). Each
decoder layer is its own shard group (all-gathered just before its forward, freed after it when
`reshard_after_forward`), the root group holds everything else: embeddings, final norm, lm_head or value head. Tied
input/output embeddings (Qwen2: `lm_head.weight is model.embed_tokens.weight`) are therefore one parameter in one
group and stay tied. Gradients are reduce-scattered as the MEAN over the mesh, which is why the engine scales each
micro-batch loss by the data-parallel size (the losses are already normalised by the global token/sequence counts:
D x mean over ranks = sum over ranks = the single-process gradient). Mixed precision (`MixedPrecisionPolicy`):
parameters are cast to bf16/fp16 for compute, gradients are reduced in fp32, the master weights and the optimizer
stay fp32. FSDP2's own `CPUOffloadPolicy` (`offload_policy`) keeps the shards, their gradients and the optimizer
step on the host for good and copies each layer's parameters to the device for its forward and backward; its pinned
host memory needs an accelerator, so on a CPU model it runs unpinned.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from hyflow.models.forward import unwrap_model

MIXED_PRECISION = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                   "fp16": torch.float16, "float32": None, "fp32": None}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model, each to become its own FSDP shard group.

    `<base model>.layers` for Hugging Face decoders (`model.model.layers`, also for value and reward models; an
    `nn.ModuleDict` of the layers a pipeline rank holds), a pipeline stage's own `layers`;
    otherwise the `nn.ModuleList` of same-class blocks holding the most parameters (GPT-2's `transformer.h`);
    [] when there is none (then the whole model is one group).
    """
    inner = unwrap_model(model)
    base = getattr(inner, getattr(inner, "base_model_prefix", "") or "", None)
    for holder in (base, inner):  # a pipeline stage (hyflow.parallel.pipeline) holds its layers itself
        layers = getattr(holder, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return list(layers)
        if isinstance(layers, nn.ModuleDict) and len(layers) > 0:  # a pipeline-cut decoder's layers, by index
            return list(layers.values())
    best, best_params = [], 0
    for module in inner.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            n_params = sum(p.numel() for p in module.parameters())
            if n_params > best_params:
                best, best_params = list(module), n_params
    return best


def check_shard_groups(model: nn.Module, layers: list[nn.Module]) -> None:
    """Raise if a parameter is shared between a layer and anything outside it (FSDP would untie it).

    Tied input/output embeddings are fine: both live in the root group. A weight tied into a decoder layer is not.
    """
    prefixes = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    owner: dict[int, str] = {}
    for layer in layers:
        for param in layer.parameters():
            owner[id(param)] = prefixes[id(layer)] + "."
    for name, param in model.named_parameters(remove_duplicate=False):
        prefix = owner.get(id(param))
        if prefix is not None and not name.startswith(prefix):
            raise ValueError(f"parameter {name!r} is shared with decoder layer {prefix[:-1]!r}; FSDP2 shards each "
                             "layer separately and would untie it: untie the weights, or keep shared weights "
                             "outside the decoder layers")


def mixed_precision_policy(dtype: str | None):
    """FSDP2 `MixedPrecisionPolicy`: compute in `dtype` (bf16/fp16), reduce gradients in fp32; None/fp32 = off."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype is None:
        return MixedPrecisionPolicy()
    if dtype not in MIXED_PRECISION:
        raise ValueError(f"fsdp_config.dtype={dtype!r} is not a mixed-precision dtype; use one of "
                         f"{sorted(MIXED_PRECISION)}")
    param_dtype = MIXED_PRECISION[dtype]
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def wrap_fsdp2(model: nn.Module, *, mixed_precision: str | None, reshard_after_forward: bool = True,
               activation_checkpointing: bool = False, offload_policy: bool = False, mesh=None) -> nn.Module:
    """Shard `model` in place with FSDP2: each decoder layer, then the root; returns `model`. A standalone use of
    what `parallelize` composes (`apply_activation_checkpointing`, then `apply_fsdp`).

    mesh: the given one, or the `dp_shard_sp` mesh of all the ranks (`ParallelDims(world_size=W).build_mesh`, the
    parameters' device type). Needs an initialised process group (`hyflow.workers.fsdp.maybe_init_distributed`).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("wrap_fsdp2 needs an initialised torch.distributed process group; call "
                           "maybe_init_distributed(worker) (or torch.distributed.init_process_group) first")
    if mesh is None:
        from hyflow.parallel.dims import ParallelDims

        device_type = next(model.parameters()).device.type
        mesh = ParallelDims(world_size=dist.get_world_size()).build_mesh(device_type).get("dp_shard_sp")
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    return apply_fsdp(model, mesh, mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
                      offload_policy=offload_policy)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer's activations in backward (composable checkpoint: parameter names are
    unchanged); returns `model`."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(model):
        checkpoint(layer)
    return model


def apply_fsdp(model: nn.Module, mesh, *, mixed_precision: str | None, reshard_after_forward: bool = True,
               offload_policy: bool = False, ignored_params: set | None = None) -> nn.Module:
    """FSDP2 over the 1-D `mesh`: each decoder layer, then the root (module docstring); returns `model`.

    `reshard_after_forward` applies to the layers; the root group (embeddings, norm, heads) always stays gathered
    between its forward and the backward, since the lm_head chunks of `hyflow.models.forward` run after the
    forward. `mixed_precision`: None or fp32 = full precision, bf16/fp16 = `MixedPrecisionPolicy(param_dtype,
    reduce_dtype=fp32)`. `offload_policy`: FSDP2's `CPUOffloadPolicy`, pinned host memory when the model is on an
    accelerator. `mesh` 2-D (dp_replicate, dp_shard): hybrid sharding, FSDP2's HSDP. `ignored_params`: parameters
    FSDP2 leaves as they are (expert parallelism's split experts, `hyflow.parallel.expert`).
    """
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    policy = mixed_precision_policy(mixed_precision)
    offload = {"offload_policy": cpu_offload_policy(device_type)} if offload_policy else {}
    layers = decoder_layers(model)
    check_shard_groups(model, layers)
    if ignored_params:
        offload["ignored_params"] = set(ignored_params)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, **offload)
    # The root stays gathered after its forward: hyflow runs the lm_head in chunks after the model's forward
    # (hyflow.models.forward), and backward needs the root's parameters at once anyway.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy, **offload)
    # FSDP2 warns on every forward whose output is a view (a token classifier's logits are a reshaped matmul):
    # an in-place op on it would skip the backward all-gather. hyflow's forward functions never modify model
    # outputs in place (the 2-rank vs 1-process gradient tests would fail), so on each rank it is only noise.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return model


def cpu_offload_policy(device_type: str):
    """FSDP2's `CPUOffloadPolicy` for a model on `device_type`: pinned host memory (asynchronous copies) for an
    accelerator; unpinned on a CPU model, where pinning raises ("Cannot access accelerator device when none is
    available", torch 2.13) and the host is the device anyway."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


def wrap_ddp(model: nn.Module) -> nn.Module:
    """DistributedDataParallel around `model` (replicated weights, gradients all-reduced as the mean)."""
    device = next(model.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
