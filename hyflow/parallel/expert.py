"""Expert parallelism for the mixture-of-experts models of transformers 5: each rank of an `ep` group holds E / ep of
every MoE layer's experts and the tokens travel to their experts and back by all-to-all (gloo on CPU, NCCL on GPU).

What it changes. transformers keeps a MoE layer's routed experts in one module (`Qwen3MoeExperts`,
`MixtralExperts`, `DeepseekV3Experts`, ...: the classes its `use_experts_implementation` decorates) whose
parameters are 3-D, expert first: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]; its forward takes the layer's
tokens [T, H] with the router's choice `top_k_index` [T, k] and weights `top_k_weights` [T, k]. The router (`gate`),
the shared experts (DeepSeek) and everything else of the model are untouched; FSDP2 shards them as before.
`apply_expert_parallel` turns each experts module's parameters into DTensors on the expert mesh (`edp` x `ep`,
placements Replicate x Shard(0): rank j of an ep group holds experts [j E/ep, (j+1) E/ep)) and gives the module this
forward, per MoE layer:

1. the (token, choice) pairs are sorted by expert; each rank sends every other rank of its ep group the tokens for
   that rank's experts (one all-to-all of counts, one of hidden states, one of local expert ids);
2. each rank runs its own experts on what it received (gate_up, the family's gate `_apply_gate`, down);
3. a second all-to-all returns each output to the rank its token came from, where it is weighted by the router's
   weight and summed per token (index_add), as the unsplit module does.

The all-to-alls of hidden states are differentiable (`all_to_all_single_autograd`: the backward sends each gradient
back the way its token came), so an expert's gradient on its rank is the sum over the ep group's tokens.

Gradients. FSDP2 averages a gradient over the ranks it shards over (R = dp_replicate x dp_shard x sp ranks); the
engine scales each loss by the data-parallel size so that average is the one-process gradient. The experts are kept
out of FSDP2 (`ignored_params`), so `sync_expert_grads` (the engine runs it before clipping) gives them the same
average: the sum over the `edp` ranks that hold the same experts (the ep groups' other copies), divided by R. A rank
whose experts got no token has no gradient: it contributes zeros (every rank enters the same collectives).

Weights out. A DTensor's `full_tensor()` gathers the experts of an ep group, so exports, weight sync and the full
state dict see the plain [E, ...] tensors under the same names; DCP checkpoints store each rank's experts once.

Layout. ep must divide the experts of every MoE layer and the ranks of one replica (dp_shard x sp x tp: ep borrows
them, as Megatron's expert-data layout with expert_tensor_parallel_size=1 does); the ep groups are runs of ep
consecutive ranks, inside one HSDP replica. Under tensor parallelism the MoE block stays whole on each tp rank
(`hyflow.models.tensor_parallel.layer_plan`) and the tp ranks hold the same tokens: each sends only its share of the
sorted (token, choice) pairs (its gradient into the tokens is summed over the tp group in the backward), and the
outputs are all-gathered over the tp group before the weighted sum, which every tp rank then computes alike (so the
router's gradient is the same on each). Not built: pipeline parallelism, experts split over tensor-parallel ranks
(`expert_tensor_parallel_size` > 1), experts whose weights are transposed, interleaved or carry biases (gpt-oss):
refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hyflow.models.moe import expert_modules
from hyflow.models.tensor_parallel import sum_grad_over_group

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def check_expert_layout(name: str, module: nn.Module, ep: int) -> None:
    """Raise ValueError naming what of `module` expert parallelism over `ep` ranks cannot split."""
    kind = type(module).__name__
    if getattr(module, "has_bias", False) or getattr(module, "is_transposed", False) or not getattr(
            module, "is_concatenated", True) or not getattr(module, "has_gate", True) or getattr(
            module, "has_post_expert_norm", False):
        raise ValueError(f"expert parallelism: {name} ({kind}) stores its experts transposed, interleaved, without a "
                         "gate or with biases; only the gate_up_proj [E, 2I, H] / down_proj [E, H, I] layout (Qwen3-MoE, "
                         "Mixtral, DeepSeek-V3, ...) is split; use expert_parallel_size=1 for this model")
    for weight in EXPERT_WEIGHTS:
        param = getattr(module, weight, None)
        if not isinstance(param, nn.Parameter) or param.dim() != 3 or param.shape[0] != module.num_experts:
            raise ValueError(f"expert parallelism: {name} ({kind}) has no 3-D expert-first {weight}; use "
                             "expert_parallel_size=1 for this model")
    if module.num_experts % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide the {module.num_experts} experts of {name}")


@dataclass(frozen=True)
class ExpertLayout:
    """How one rank takes part: the expert `mesh` (edp x ep), the ep group's process group and size, the edp group
    (None when every ep group is the only copy), `grad_divisor` R (the ranks FSDP2 averages over), and the
    tensor-parallel group whose ranks hold the same tokens."""

    mesh: object
    ep_group: object
    ep_size: int
    edp_group: object
    grad_divisor: int
    tp_group: object = None  # the tensor-parallel ranks, which hold the same tokens (None at tp=1)
    tp_size: int = 1


def apply_expert_parallel(model: nn.Module, layout: ExpertLayout) -> list[nn.Parameter]:
    """Split every experts module of `model` over `layout` (module docstring), in place; returns the expert
    parameters (DTensors on the expert mesh), which FSDP2 must leave alone. Raises ValueError naming a module it
    cannot split; for a model without experts, naming that."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    modules = expert_modules(model)
    if not modules:
        raise ValueError("expert_parallel_size > 1 needs a mixture-of-experts model (routed experts in a "
                         "transformers experts module); this model has none: use expert_parallel_size=1")
    params = []
    for name, module in modules:
        check_expert_layout(name, module, layout.ep_size)
        for weight in EXPERT_WEIGHTS:
            full = getattr(module, weight)
            split = distribute_tensor(full.detach(), layout.mesh, (Replicate(), Shard(0)))
            param = nn.Parameter(split, requires_grad=full.requires_grad)
            setattr(module, weight, param)
            params.append(param)
        module.forward = _ExpertParallelForward(module, layout)
    return params


class _ExpertParallelForward:
    """The experts module's forward under expert parallelism (module docstring, steps 1-3)."""

    def __init__(self, module: nn.Module, layout: ExpertLayout):
        self.module, self.layout = module, layout
        self.local = module.num_experts // layout.ep_size

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        group, ep, local, layout = self.layout.ep_group, self.layout.ep_size, self.local, self.layout
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, choice) pairs by expert, so by destination rank
        experts_all, source_all = flat[order], order // k
        experts, source_token, states = experts_all, source_all, hidden_states
        if layout.tp_group is not None:  # the tp ranks hold the same tokens: each sends its share of the pairs
            states = sum_grad_over_group(hidden_states, layout.tp_group)
            pairs, rank = len(flat), dist.get_rank(layout.tp_group)
            shares = [pairs // layout.tp_size + (t < pairs % layout.tp_size) for t in range(layout.tp_size)]
            start = sum(shares[:rank])
            experts, source_token = experts_all[start:start + shares[rank]], source_all[start:start + shares[rank]]
        send = torch.bincount(experts // local, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        arrived = all_to_all_single_autograd(states[source_token], recv_sizes, send_sizes, group)
        arrived_experts = torch.empty(sum(recv_sizes), dtype=experts.dtype, device=experts.device)
        dist.all_to_all_single(arrived_experts, (experts % local).contiguous(), recv_sizes, send_sizes, group=group)
        done = self._run_local(arrived, arrived_experts)
        returned = all_to_all_single_autograd(done, send_sizes, recv_sizes, group)
        if layout.tp_group is not None:  # every tp rank gets every pair's output back, in the sorted order
            returned = _GatherShares.apply(returned, layout.tp_group, shares)
        source_token = source_all
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, source_token, (returned * weights).to(out.dtype))

    def _run_local(self, states: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the tokens sent to them: rows in arrival order."""
        module = self.module
        gate_up = module.gate_up_proj.to_local().to(states.dtype)
        down = module.down_proj.to_local().to(states.dtype)
        # zeros that depend on `states`: a rank none of whose experts got a token still returns a tensor on the
        # autograd graph, so every rank enters the backward all-to-alls
        out = states * 0
        for e in torch.unique(experts).tolist():
            rows = torch.nonzero(experts == e, as_tuple=True)[0]
            gated = module._apply_gate(nn.functional.linear(states[rows], gate_up[e]))
            out = out.index_copy(0, rows, nn.functional.linear(gated, down[e]))
        return out


def sync_expert_grads(params: list[nn.Parameter], layout: ExpertLayout) -> None:
    """Give the expert weights FSDP2's gradient average (module docstring): sum over the edp ranks, divide by R.
    Every rank calls it with the same parameters in the same order; a missing gradient counts as zeros."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad.to_local()
        if layout.edp_group is not None:
            dist.all_reduce(grad, group=layout.edp_group)
        grad.div_(layout.grad_divisor)


class _GatherShares(torch.autograd.Function):
    """All-gather the tp ranks' shares (rows, `shares` long each, in rank order); backward keeps this rank's rows of
    the gradient (every tp rank computes the same downstream, so its gradient is already the whole one)."""

    @staticmethod
    def forward(ctx, own: torch.Tensor, group, shares: list[int]) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.rows = (sum(shares[:rank]), shares[rank])
        width = max(shares)
        padded = own.new_zeros((width, *own.shape[1:]))
        padded[:own.shape[0]] = own
        parts = [torch.empty_like(padded) for _ in shares]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:size] for part, size in zip(parts, shares, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, size = ctx.rows
        return grad[start:start + size].contiguous(), None, None
