"""Tensor parallelism of a Hugging Face decoder with PyTorch's own engine (`torch.distributed.tensor.parallel`).

Each decoder layer's attention and MLP are split over a tensor-parallel group of T ranks, Megatron's layout as
torchtitan writes it for Llama: `q_proj`, `k_proj`, `v_proj`, `gate_proj` and `up_proj` column-wise (rank t
holds heads t*H/T .. (t+1)*H/T - 1 and the same slice of the MLP's columns), `o_proj` and `down_proj` row-wise
(their partial sums are all-reduced). The layer's input and output stay whole on every rank of the group
(Replicate), so everything outside the split modules (embeddings, norms, the LM or value head, hyflow's packed
attention, which reads the local head count from its tensors) runs as in one process, and their gradients come
out the same on every rank of the group (the backward of a replicated input all-reduces its partial gradients).

The group's ranks therefore compute on the same rows (the controller sends each rank of a group its data-parallel
share, `hyflow.controller.dispatch`'s `mesh=`, as for Ulysses groups) and FSDP2 shards over the data-parallel dimension of the one mesh (`hyflow.parallel.dims`, whose `tp`
dimension this module splits over; `hyflow.parallel.parallelize` applies both in order). Parameters of a split
module are DTensors on the tp mesh (FSDP2 adds the dp dimension); state dicts, weight sync and checkpoints see full
tensors through DTensor (`hyflow.workers.fsdp`).

`apply_tensor_parallel(model, mesh)` checks first that the model is of this shape (a `config` with attention and
key-value heads divisible by T, decoder layers with `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`
linears; a mixture-of-experts layer's MLP stays whole, `layer_plan`) and says which part is not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# module path inside a decoder layer -> "colwise" | "rowwise"
LAYER_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def tp_problem(model: nn.Module, layers: list[nn.Module], tp_size: int) -> str | None:
    """Why `model` cannot be split over `tp_size` ranks by LAYER_PLAN, or None."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        return "the model's config has no num_attention_heads"
    for name, count in (("attention heads", heads), ("key-value heads", kv_heads)):
        if count % tp_size:
            return f"tensor_parallel_size={tp_size} must divide the model's {count} {name}"
    if not layers:
        return "the model has no decoder layers (model.layers) to split"
    for path in layer_plan(layers[0]):
        try:
            module = layers[0].get_submodule(path)
        except AttributeError:
            module = None
        if type(module) is not nn.Linear:
            found = "no such module" if module is None else type(module).__name__
            return (f"each decoder layer needs a plain nn.Linear at {path} to split it ({found} in "
                    f"{type(layers[0]).__name__}); tensor parallelism supports Llama/Qwen-style decoders without "
                    "LoRA")
        if path.endswith(("gate_proj", "up_proj", "q_proj", "k_proj", "v_proj")) and module.out_features % tp_size:
            return f"tensor_parallel_size={tp_size} must divide {path}'s {module.out_features} output features"
        if path.endswith(("o_proj", "down_proj")) and module.in_features % tp_size:
            return f"tensor_parallel_size={tp_size} must divide {path}'s {module.in_features} input features"
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads)
    for name in HEAD_NORMS:
        norm = getattr(getattr(layers[0], "self_attn", None), name, None)
        weight = getattr(norm, "weight", None)
        if weight is not None and weight.numel() != head_dim:
            return (f"self_attn.{name} normalises the whole projection ({weight.numel()} features, not one head's "
                    f"{head_dim}): a tensor-parallel rank holds part of it, so it cannot be split; use "
                    "tensor_parallel_size=1 for this model")
    return None


def apply_tensor_parallel(model: nn.Module, layers: list[nn.Module], mesh) -> None:
    """Split every decoder layer of `model` (`layers`, from `hyflow.parallel.fsdp.decoder_layers`) over the 1-D
    tensor-parallel `mesh`, in place (before FSDP2 wraps the model). Raises ValueError when the model is not of
    the shape LAYER_PLAN needs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    size = mesh.size()
    problem = tp_problem(model, layers, size)
    if problem is not None:
        raise ValueError(problem)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in layers:
        parallelize_module(layer, mesh, {path: styles[kind]() for path, kind in layer_plan(layer).items()})
        for name in HEAD_NORMS:
            norm = getattr(getattr(layer, "self_attn", None), name, None)
            if isinstance(norm, nn.Module):
                norm.forward = _HeadNormForward(norm, mesh.get_group())


# Per-head query / key norms (Qwen3's RMSNorm over head_dim after q_proj / k_proj): each rank normalises its own heads
# with the whole (replicated) weight, so the weight's gradient on a rank covers its heads only; summed over the
# group it is the whole one, as every rank needs it (the weights of the group stay equal).
HEAD_NORMS = ("q_norm", "k_norm")


class _HeadNormForward:
    """A head norm's forward whose weight gradient is summed over the tensor-parallel group."""

    def __init__(self, module: nn.Module, group):
        self.module, self.group = module, group

    def __call__(self, hidden_states):
        from torch.nn.utils.stateless import _reparametrize_module

        module = self.module
        weight = sum_grad_over_group(module.weight, self.group)
        with _reparametrize_module(module, {"weight": weight}):
            return type(module).forward(module, hidden_states)


def layer_plan(layer: nn.Module) -> dict[str, str]:
    """LAYER_PLAN for one decoder layer; a mixture-of-experts layer's MLP (a router beside routed experts) stays whole
    on every rank of the group: its attention is split, its experts run replicated, or split over the ranks by
    expert parallelism (`hyflow.parallel.expert`, which spans the tensor-parallel ranks as Megatron's does)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
        return {path: kind for path, kind in LAYER_PLAN.items() if not path.startswith("mlp.")}
    return LAYER_PLAN


def sum_grad_over_group(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` unchanged, whose gradient is summed over `group` in the backward (`_SumGradOverGroup`)."""
    return _SumGradOverGroup.apply(tensor, group)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (Megatron's copy to the tensor-parallel region):
    each tp rank's experts see only its share of the tokens (a head norm only its heads), so the shares' gradients
    add up to the whole."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
