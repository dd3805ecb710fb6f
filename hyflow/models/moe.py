"""Router diagnostics of a mixture-of-experts model: the load-balancing loss, the router z-loss and the largest expert's
load of each forward pass, as Megatron-Core reports them (verl's Megatron engine logs Megatron's own).

transformers 5's MoE blocks (Qwen3-MoE, Mixtral, DeepSeek-V3, ...) call their router as `self.gate(hidden)`, which
returns (router_logits [T, E], weights [T, k], chosen experts [T, k]); `RouterStats` hooks every router beside a
routed-experts module (`hyflow.parallel.expert.expert_modules`) and, per MoE layer of each pass, with f_e the
fraction of the T x k (token, choice) assignments that went to expert e and P_e the mean over tokens of the softmax
of the router's logits:

- load_balancing_loss = E x sum_e f_e P_e (Switch Transformer's auxiliary loss as Megatron normalises it,
  `switch_load_balancing_loss_func`: 1 for a perfectly balanced router; Hugging Face's `load_balancing_loss_func`
  is k times this);
- z_loss = mean over tokens of logsumexp(logits)^2 (ST-MoE's router z-loss, Megatron's `z_loss_func` without its
  coefficient);
- max_expert_load = E x max_e f_e (1 when balanced; E when every choice goes to one expert).

Each is the mean over the model's MoE layers. They are metrics only: hyflow adds no auxiliary loss to the actor's
(verl turns Megatron's off for RL, `moe_router_load_balancing_type="none"`; asking for a coefficient is refused by
name, `hyflow.config.engine_compat`). For a sigmoid-scored router (DeepSeek-V3) P_e is still the softmax of its
logits: a diagnostic of the same shape, not DeepSeek's own sequence-wise auxiliary loss.
"""

from __future__ import annotations

import torch
from torch import nn

STATS = ("load_balancing_loss", "z_loss", "max_expert_load")


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed-experts module of `model`: the modules transformers' `use_experts_implementation`
    decorates (they carry `_is_expert_parallel`), with 3-D expert-first weights."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int):
            found.append((name, module))
    return found


def routers(model: nn.Module) -> list[nn.Module]:
    """The router (`gate`) of every MoE block of `model`: the sibling of each routed-experts module."""
    found = []
    modules = dict(model.named_modules())
    for name, _ in expert_modules(model):
        parent = modules.get(name.rpartition(".")[0]) if "." in name else model
        gate = getattr(parent, "gate", None)
        if isinstance(gate, nn.Module):
            found.append(gate)
    return found


def router_stats(logits: torch.Tensor, chosen: torch.Tensor) -> dict[str, float]:
    """The module docstring's three statistics of one router call: `logits` [T, E], `chosen` [T, k]."""
    logits = logits.detach().float().reshape(-1, logits.shape[-1])
    experts = logits.shape[-1]
    chosen = chosen.detach().reshape(logits.shape[0], -1)
    if logits.shape[0] == 0:
        return {}
    load = torch.bincount(chosen.reshape(-1), minlength=experts).float() / chosen.numel()  # f_e
    probs = torch.softmax(logits, dim=-1).mean(0)  # P_e
    return {"load_balancing_loss": float(experts * (load * probs).sum()),
            "z_loss": float(torch.logsumexp(logits, dim=-1).square().mean()),
            "max_expert_load": float(experts * load.max())}


class RouterStats:
    """Hooks on a MoE model's routers while entered (nothing for a dense model); `take()` returns the mean over the
    MoE layers of the calls since the last `take()` ({} when none ran)."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self._handles: list = []
        self._calls: list[dict[str, float]] = []
        # the tokens to count ([tokens] bool, the router's rows), None = all: a pipeline stage's padded
        # micro-batch sets it (`hyflow.parallel.pipeline`)
        self.token_mask: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.routers)

    def _hook(self, module, args, output) -> None:
        if torch._C._current_graph_task_id() != -1:  # a checkpointed layer's recompute in backward: counted already
            return
        if isinstance(output, tuple) and len(output) >= 3 and torch.is_tensor(output[0]):
            logits, chosen = output[0], output[2]
            mask = self.token_mask
            if mask is not None and mask.numel() == logits.shape[0]:
                logits, chosen = logits[mask], chosen[mask]
            stats = router_stats(logits, chosen)
            if stats:
                self._calls.append(stats)

    def __enter__(self) -> RouterStats:
        self._handles = [router.register_forward_hook(self._hook) for router in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> dict[str, float]:
        sums, count = self.take_sums()
        return {name: value / count for name, value in sums.items()} if count else {}

    def take_sums(self) -> tuple[dict[str, float], int]:
        """The sums over the MoE-layer calls since the last take and their count (to average over several ranks'
        layers: a pipeline's stages)."""
        calls, self._calls = self._calls, []
        return {name: sum(call[name] for call in calls) for name in STATS} if calls else {}, len(calls)
