"""`parallelize(model, dims, spec, mesh)`: every parallel dimension applied to a plain Hugging Face model, in
torchtitan's order, on the one mesh of `hyflow.parallel.dims`.

1. pipeline stages (`apply_pp`: the decoder cut into this rank's stages, `hyflow.parallel.pipeline`; the later
   steps see only the layers this rank holds);
2. tensor parallelism (`apply_tp`: each decoder layer's attention and MLP split over the `tp` mesh,
   `hyflow.models.tensor_parallel`);
3. sequence parallelism (`apply_sp`: Ulysses changes no module, its all-to-alls run inside the packed attention
   under `hyflow.models.ulysses.sequence_parallel(mesh.group("sp"))`; the seat checks that the model's heads split);
4. expert parallelism (`apply_ep`: each MoE layer's routed experts split over the `ep` ranks, tokens sent to them by
   all-to-all, `hyflow.parallel.expert`);
5. activation checkpointing (`hyflow.parallel.fsdp.apply_activation_checkpointing`, per decoder layer);
6. compile (`hyflow.models.compile.CompiledModules`: the MLPs and norms, switched on for the engine's own passes);
7. the data-parallel wrapper last, which shards or replicates what the others left: FSDP2 `fully_shard` over the
   `dp_shard_sp` mesh, or under HSDP (dp_replicate > 1) the 2-D (dp_replicate, dp_shard_sp) mesh (replicated x
   sharded; `hyflow.parallel.fsdp.apply_fsdp`), the expert weights left out; under pipeline parallelism each stage
   module is its own FSDP2 root; or DDP (trainable models only), or none on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from hyflow.parallel.dims import ParallelDims, ParallelMesh
from hyflow.parallel.fsdp import apply_activation_checkpointing, apply_fsdp, decoder_layers, wrap_ddp

STRATEGIES = ("single", "ddp", "fsdp2")


@dataclass(frozen=True)
class ParallelizeSpec:
    """How `parallelize` wraps one model. strategy: "single" (one rank, unwrapped), "ddp" or "fsdp2";
    mixed_precision: FSDP2's compute dtype (None/fp32 = full precision); reshard_after_forward and offload_policy:
    FSDP2's (`hyflow.parallel.fsdp.apply_fsdp`); activation_checkpointing: recompute each decoder layer in
    backward; compile: the per-token modules compiled (`hyflow.models.compile`); trainable: False for a frozen model
    (DDP then leaves it unwrapped)."""

    strategy: str = "single"
    mixed_precision: str | None = None
    reshard_after_forward: bool = True
    offload_policy: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    trainable: bool = True
    virtual_stages: int = 1  # pipeline stages per pp rank (virtual_pipeline_parallel_size)
    head: str = "lm"  # the head the last pipeline stage ends with ("lm" or "value")


@dataclass
class Parallelized:
    """What `parallelize` returns: the wrapped `model`, the compiled modules (None without compile), and under
    expert parallelism the split expert weights and their layout, whose gradients `sync_grads` must average before
    every optimizer step (`hyflow.parallel.expert.sync_expert_grads`)."""

    model: nn.Module
    compiled: object = None
    experts: list = field(default_factory=list)
    expert_layout: object = None
    pipeline: object = None  # hyflow.parallel.pipeline.PipelineParts when pp > 1

    def sync_grads(self) -> None:
        """Average what FSDP2 does not (the expert weights' gradients) and sum a tied embedding's two pipeline
        copies' gradients; collective under expert and pipeline parallelism."""
        if self.pipeline is not None:
            self.pipeline.tied.sync()
        if self.experts:
            from hyflow.parallel.expert import sync_expert_grads

            sync_expert_grads(self.experts, self.expert_layout)


def parallelize(model: nn.Module, dims: ParallelDims, spec: ParallelizeSpec, mesh: ParallelMesh) -> Parallelized:
    """Apply every dimension of `dims` to `model` on `mesh` (`dims.build_mesh`), in place and in the module
    docstring's order. Raises ValueError for a model a dimension cannot split."""
    if spec.strategy not in STRATEGIES:
        raise ValueError(f"parallelize: strategy={spec.strategy!r}; use one of {STRATEGIES}")
    if (dims.dp_replicate > 1 or dims.ep > 1 or dims.pp > 1) and spec.strategy != "fsdp2":
        raise ValueError(f"hybrid sharding (dp_replicate={dims.dp_replicate}), expert parallelism (ep={dims.ep}) and "
                         f"pipeline parallelism (pp={dims.pp}) are built on FSDP2: use strategy fsdp or fsdp2, not "
                         f"{spec.strategy}")
    pipeline = apply_pp(model, dims, mesh, virtual=spec.virtual_stages, head=spec.head)
    apply_tp(model, dims, mesh)
    apply_sp(model, dims, mesh)
    experts = apply_ep(model, dims, mesh)
    if spec.activation_checkpointing:
        apply_activation_checkpointing(model)
    compiled = None
    if spec.compile:
        from hyflow.models.compile import CompiledModules

        compiled = CompiledModules(model)
    if spec.strategy == "fsdp2":
        fsdp = {"mixed_precision": spec.mixed_precision, "reshard_after_forward": spec.reshard_after_forward,
                "offload_policy": spec.offload_policy, "ignored_params": set(experts)}
        # under pipeline parallelism each stage is the FSDP2 root torch's PipelineStage drives; the model keeps
        # the stages' (sharded) parameters under their names
        for root in pipeline.stages if pipeline is not None else [model]:
            apply_fsdp(root, mesh.fsdp_mesh(), **fsdp)
    elif spec.strategy == "ddp" and spec.trainable:
        model = wrap_ddp(model)
    return Parallelized(model, compiled, experts, mesh.expert, pipeline)


def apply_pp(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh, *, virtual: int = 1, head: str = "lm"):
    """Pipeline parallelism over `dims.pp` x `virtual` stages (`hyflow.parallel.pipeline.cut_model`, in place):
    this rank's `PipelineParts`; None at pp=1 (the model unchanged, `virtual` must be 1)."""
    if dims.pp == 1:
        if virtual > 1:
            raise ValueError(f"virtual_pipeline_parallel_size={virtual} needs pipeline_parallel_size > 1")
        return None
    from hyflow.parallel.pipeline import cut_model

    return cut_model(model, mesh, virtual, head)


def apply_tp(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh) -> None:
    """Tensor parallelism over the `tp` mesh (`hyflow.models.tensor_parallel.apply_tensor_parallel`), in place; a
    no-op at tp=1. Raises ValueError naming what of the model cannot be split."""
    if dims.tp == 1:
        return
    from hyflow.models.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(model, decoder_layers(model), mesh.get("tp"))


def apply_sp(model: nn.Module, dims: ParallelDims, mesh=None) -> None:
    """Ulysses sequence parallelism over the `sp` mesh changes no module (module docstring); it needs each rank of
    a sequence x tensor-parallel group to attend with a whole number of heads: sp x tp must divide the heads."""
    if dims.sp == 1:
        return
    config = getattr(model, "config", None)
    heads = getattr(getattr(config, "text_config", None) or config, "num_attention_heads", None)
    if heads is not None and heads % (dims.sp * dims.tp):
        split = f"ulysses_sequence_parallel_size={dims.sp}" + (f" x tensor_parallel_size={dims.tp}" if dims.tp > 1
                                                               else "")
        raise ValueError(f"{split} must divide the model's {heads} attention heads (each rank attends with "
                         f"heads / {dims.sp * dims.tp} of them)")


def apply_ep(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh) -> list[nn.Parameter]:
    """Expert parallelism over the `ep` ranks (`hyflow.parallel.expert.apply_expert_parallel`), in place: returns
    the split expert weights (DTensors on the expert mesh, which FSDP2 leaves alone); [] at ep=1."""
    if dims.ep == 1:
        return []
    from hyflow.parallel.expert import apply_expert_parallel

    return apply_expert_parallel(model, mesh.expert)
