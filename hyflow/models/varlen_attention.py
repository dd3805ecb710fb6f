"""The attention of packed sequences (`hyflow.models.packing`): one row of concatenated sequences, each attending
only to itself (and, with shared prompts, to its prompt's prefix), registered with transformers as the
`hyflow_packed` attention implementation; `packed_attention(model)` switches a model to it."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hyflow.models import ulysses
from hyflow.models.forward import (
    unwrap_model,
)
from hyflow.models.vision import find_vision_tower

Tensor = torch.Tensor

PACKED_ATTENTION = "hyflow_packed"
FIX = ("set use_remove_padding=false (actor_rollout_ref.model.use_remove_padding, critic.model.use_remove_padding, "
       "or model.use_remove_padding for SFT)")
SHARED_PREFIX_KWARG = "hyflow_shared_prefix"


# ---------------------------------------------------------------------------------------------- attention
def model_name(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    architectures = getattr(config, "architectures", None)
    if architectures:
        return str(architectures[0])
    model_type = getattr(config, "model_type", None)
    return f"{model_type} ({type(module).__name__})" if model_type else type(module).__name__


def _refuse(module: nn.Module, what: str) -> None:
    raise NotImplementedError(
        f"sequence packing does not support {what} ({model_name(module)}); {FIX}, which runs the padded path"
    )


def _repeat_kv(states: Tensor, groups: int) -> Tensor:
    """[b, h_kv, t, d] -> [b, h_kv * groups, t, d], each K/V head shared by `groups` query heads."""
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def _varlen_cuda(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_len: int,
                 scaling: float) -> Tensor | None:
    """PyTorch's varlen flash kernel on [1, h, T, d] states -> [1, T, h, d], or None where it cannot be called.

    NEVER RUN ON A GPU (see the module docstring). Adapts to the two known signatures of
    `torch.nn.attention.varlen.varlen_attn`: (`window_size`, `scale`, `enable_gqa` keywords) and the first one
    (`is_causal`, no scale, equal head counts)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    head_dim = query.shape[-1]
    groups = query.shape[1] // key.shape[1]
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if "scale" in params:
        kwargs["scale"] = scaling
    elif not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
        return None
    if groups > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif groups > 1:
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    q_THD = query[0].transpose(0, 1).contiguous()
    k_THD = key[0].transpose(0, 1).contiguous()
    v_THD = value[0].transpose(0, 1).contiguous()
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    out_THD = varlen_attn(q_THD, k_THD, v_THD, cu, cu, int(max_len), int(max_len), **kwargs)
    return out_THD.unsqueeze(0)


def packed_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal attention within each packed sequence: out_i = sum_{j in seq(i), j <= i} softmax_j(q_i.k_j s) v_j.

    Query [1, h, T, d], key/value [1, h_kv, T, d] (h_kv divides h); returns ([1, T, h, d], None) as transformers'
    attention functions do. The boundaries are `kwargs["cu_seq_lens_q"]` (int32 [N+1], N non-empty sequences).
    """
    group = kwargs.pop(ulysses.ULYSSES_KWARG, None)
    if group is not None:  # sequence parallel: the whole row for this rank's heads, then back (hyflow.models.ulysses)
        size = dist.get_world_size(group)
        if query.shape[1] % size:
            raise RuntimeError(f"Ulysses sequence parallelism over {size} ranks needs the attention heads "
                               f"({query.shape[1]}, {model_name(module)}) divisible by {size}; lower "
                               "ulysses_sequence_parallel_size")
        repeats = ulysses.kv_repeats(key.shape[1], size)
        if repeats > 1:  # K/V heads fewer than (or not divisible by) the group: each rank gets whole ones
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        out, _ = packed_attention_forward(module, ulysses.seq_to_heads(query, group),
                                          ulysses.seq_to_heads(key, group), ulysses.seq_to_heads(value, group),
                                          attention_mask, dropout, scaling, sliding_window, softcap, **kwargs)
        return ulysses.heads_to_seq(out, group), None
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None or attention_mask is not None:
        raise RuntimeError(
            f"attention implementation {PACKED_ATTENTION!r} runs only on packed input (one row, attention_mask=None, "
            f"boundaries in cu_seq_lens_q) as hyflow.models.packing passes it ({model_name(module)}); a padded "
            f"forward ran inside packed_attention(model): run padded forwards outside it"
        )
    if sliding_window is not None:
        _refuse(module, f"sliding-window attention layers (sliding_window={sliding_window})")
    if softcap is not None:
        _refuse(module, f"attention logit soft-capping (softcap={softcap})")
    if kwargs.get("s_aux") is not None:
        _refuse(module, "attention sinks")
    is_causal = kwargs.get("is_causal")
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        _refuse(module, "bidirectional (non-causal) attention")
    if query.shape[0] != 1 or query.shape[2] != key.shape[2] or query.shape[1] % key.shape[1]:
        raise RuntimeError(f"{PACKED_ATTENTION!r} expects one packed row with as many keys as queries and "
                           f"h_kv dividing h; got query {tuple(query.shape)}, key {tuple(key.shape)}")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    shared = kwargs.get(SHARED_PREFIX_KWARG)
    if shared is not None:
        if shared.segments and shared.segments[-1][1] != query.shape[2]:
            raise RuntimeError(f"the shared-prefix layout ends at token {shared.segments[-1][1]} but the packed "
                               f"row has {query.shape[2]}")
        out_Thd = _shared_prefix_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                           value[0].transpose(0, 1), shared.segments, dropout, scale)
        return out_Thd.unsqueeze(0), None
    if (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0
            and (out := _varlen_cuda(query, key, value, cu_seqlens, kwargs.get("max_length_q", 0), scale))
            is not None):
        return out, None
    bounds = cu_seqlens.tolist()
    if bounds[-1] != query.shape[2]:
        raise RuntimeError(f"cu_seq_lens_q ends at {bounds[-1]} but the packed row has {query.shape[2]} tokens")
    gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}  # K/V heads shared in the kernel
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    if _batched_is_cheaper(lengths):
        return _batched_attention(query, key, value, lengths, dropout, scale), None
    outs = [
        F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout,
                                       is_causal=True, scale=scale, **gqa)
        for s, e in itertools.pairwise(bounds)
        if e > s
    ]
    out_1hTd = torch.cat(outs, dim=2) if outs else query.new_zeros(query.shape)
    return out_1hTd.transpose(1, 2).contiguous(), None


# The CPU path computes attention either per sequence (one SDPA call each: cost sum of len_i^2, plus a fixed cost
# per call that dominates for many short sequences) or batched (the sequences scattered into [N, L_max] with a
# causal + key-length mask, one SDPA call: cost N * L_max^2). Batched is chosen when it wastes at most this factor
# of attention work: similar lengths (a GRPO group's samples) take one call, very different ones go one by one.
BATCHED_ATTENTION_MAX_WASTE = 2.0


def _batched_is_cheaper(lengths: list[int]) -> bool:
    return _batching_pays([(n, n) for n in lengths if n > 0])


def _batching_pays(shapes: list[tuple[int, int]]) -> bool:
    """Whether one padded call over these (queries, keys) shapes wastes at most `BATCHED_ATTENTION_MAX_WASTE` of
    their attention work: N x max queries x max keys against the sum of queries x keys."""
    if len(shapes) < 2:
        return False
    widest = max(q for q, _ in shapes) * max(k for _, k in shapes)
    return len(shapes) * widest <= BATCHED_ATTENTION_MAX_WASTE * sum(q * k for q, k in shapes)


def _batched_attention(query: Tensor, key: Tensor, value: Tensor, lengths: list[int], dropout: float,
                       scale: float) -> Tensor:
    """Causal attention of the packed sequences as one [N, h, L_max, d] SDPA call; returns [1, T, h, d].

    Token t of sequence b sits at (b, t - start_b); key j is visible to query i of the same row when j <= i and
    j < len_b (padded query rows see key 0 only and are dropped when gathering back)."""
    device = query.device
    sizes = torch.tensor(lengths, device=device)
    keep = sizes > 0
    n_rows, width = int(keep.sum()), int(sizes.max())
    sizes = sizes[keep]
    row = torch.repeat_interleave(torch.arange(n_rows, device=device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    col = torch.arange(row.numel(), device=device) - starts[row]

    def scatter(x_1hTd: Tensor) -> Tensor:
        x_Thd = x_1hTd[0].transpose(0, 1)
        out = x_Thd.new_zeros(n_rows, width, *x_Thd.shape[1:])
        out[row, col] = x_Thd
        return out.transpose(1, 2)  # [N, h, L_max, d]

    positions = torch.arange(width, device=device)
    mask = (positions[None, :, None] >= positions[None, None, :]) & (positions[None, None, :] < sizes[:, None, None])
    out = F.scaled_dot_product_attention(scatter(query), scatter(key), scatter(value), attn_mask=mask[:, None],
                                         dropout_p=dropout, scale=scale,
                                         **({"enable_gqa": True} if query.shape[1] != key.shape[1] else {}))
    return out.transpose(1, 2)[row, col].unsqueeze(0).contiguous()


def _segment_attention(q_Thd: Tensor, k_Thd: Tensor, v_Thd: Tensor, segments, dropout: float,
                       scale: float) -> tuple[Tensor, Tensor]:
    """Attention of `segments` (`SharedPrefixes.segments`) in one SDPA call: each segment is a row of queries
    [N, h, Lq, d] against its prefix keys ++ its own keys [N, h_kv, Lk, d] (gathered from the packed row with
    their h_kv heads, grouped-query attention in the kernel; the gradient of a prefix read by several segments is
    summed by the gather's backward). Returns (the packed indices of the queries, their outputs [n, h, d])."""
    device = q_Thd.device
    seg = torch.tensor(segments, device=device, dtype=torch.long)
    q_start, q_len = seg[:, 0], seg[:, 1] - seg[:, 0]
    p_start, p_len = seg[:, 2], seg[:, 3] - seg[:, 2]
    width_q, width_k = int(q_len.max()), int((q_len + p_len).max())
    i = torch.arange(width_q, device=device)
    j = torch.arange(width_k, device=device)
    last = q_Thd.shape[0] - 1
    q_index = (q_start[:, None] + i).clamp(max=last)
    q_valid = i < q_len[:, None]
    own_j = j - p_len[:, None]  # key j of a segment: prefix token j, or its own token j - p_len
    k_index = torch.where(own_j < 0, p_start[:, None] + j, q_start[:, None] + own_j).clamp(0, last)
    visible = (own_j[:, None, :] < 0) | ((own_j[:, None, :] <= i[None, :, None])
                                         & (own_j[:, None, :] < q_len[:, None, None]))
    out = F.scaled_dot_product_attention(q_Thd[q_index].transpose(1, 2), k_Thd[k_index].transpose(1, 2),
                                         v_Thd[k_index].transpose(1, 2), attn_mask=visible[:, None],
                                         dropout_p=dropout, scale=scale, **_gqa(q_Thd, k_Thd))
    return q_index[q_valid], out.transpose(1, 2)[q_valid]


def _gqa(q_Thd: Tensor, k_Thd: Tensor) -> dict:
    """SDPA's keyword for query heads sharing K/V heads ([T, h, d] queries, [T, h_kv, d] keys)."""
    return {"enable_gqa": True} if q_Thd.shape[1] != k_Thd.shape[1] else {}


def _shared_prefix_attention(q_Thd: Tensor, k_Thd: Tensor, v_Thd: Tensor, segments, dropout: float,
                             scale: float) -> Tensor:
    """Causal attention of a packed row laid out by `SharedPrefixes`: queries [T, h, d], keys and values
    [T, h_kv, d] (h_kv divides h) -> [T, h, d].

    Prompts and responses form two classes of similar shapes. Each class takes one masked call when that wastes
    at most `BATCHED_ATTENTION_MAX_WASTE` of its attention work, else one call per segment."""
    out = q_Thd.new_zeros(q_Thd.shape)
    classes = ([s for s in segments if s[3] == s[2]], [s for s in segments if s[3] > s[2]])
    for cls in classes:
        if not cls:
            continue
        if _batching_pays([(q1 - q0, q1 - q0 + p1 - p0) for q0, q1, p0, p1 in cls]):
            index, values = _segment_attention(q_Thd, k_Thd, v_Thd, cls, dropout, scale)
            out = out.index_put((index,), values)
            continue
        for q0, q1, p0, p1 in cls:
            q = q_Thd[q0:q1].transpose(0, 1).unsqueeze(0)
            if p1 == p0:
                o = F.scaled_dot_product_attention(q, k_Thd[q0:q1].transpose(0, 1).unsqueeze(0),
                                                   v_Thd[q0:q1].transpose(0, 1).unsqueeze(0), dropout_p=dropout,
                                                   is_causal=True, scale=scale, **_gqa(q_Thd, k_Thd))
            else:
                k = torch.cat([k_Thd[p0:p1], k_Thd[q0:q1]]).transpose(0, 1).unsqueeze(0)
                v = torch.cat([v_Thd[p0:p1], v_Thd[q0:q1]]).transpose(0, 1).unsqueeze(0)
                n_q, n_p = q1 - q0, p1 - p0
                visible = torch.ones(n_q, n_p + n_q, dtype=torch.bool, device=q.device).tril(diagonal=n_p)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, scale=scale,
                                                   **_gqa(q_Thd, k_Thd))
            out = out.index_put((torch.arange(q0, q1, device=q.device),), o[0].transpose(0, 1))
    return out


def _no_mask(*args, **kwargs) -> None:
    """The AttentionMaskInterface entry of `hyflow_packed`: boundaries come as cu_seq_lens, no mask is built."""
    return None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


def _tower_configs(model: nn.Module) -> list:
    """The configs of a vision tower (a vision-language model's `visual` module, `hyflow.models.vision`): it attends
    within each image, bidirectionally, with boundaries of its own, and is not packed."""
    tower = find_vision_tower(model)
    return _configs(tower) if tower is not None else []


def _configs(model: nn.Module) -> list:
    """Every distinct transformers config held by the modules of `model` (parents before their sub-configs)."""
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen[id(config)] = config
    return list(seen.values())


_DEPTH_ATTR = "_hyflow_packed_attention_depth"


@contextlib.contextmanager
def packed_attention(model: nn.Module) -> Iterator[None]:
    """Inside, the model (under DDP / FSDP2 / PEFT wrappers) attends with `hyflow_packed`; on exit every config
    gets its previous `_attn_implementation` back. Nests. Wrap forward and backward in it when the model
    recomputes activations in backward (gradient checkpointing)."""
    inner = unwrap_model(model)
    previous = [(config, config._attn_implementation) for config in _configs(inner)]
    # a composite config passes its attention implementation on to its sub-configs: the vision tower's get theirs
    # back (it is not packed)
    towers = [(config, config._attn_implementation) for config in _tower_configs(inner)]
    setattr(inner, _DEPTH_ATTR, getattr(inner, _DEPTH_ATTR, 0) + 1)
    try:
        for config, _ in previous:
            if all(config is not tower for tower, _ in towers):
                config._attn_implementation = PACKED_ATTENTION
        for config, implementation in towers:
            config._attn_implementation = implementation
        yield
    finally:
        for config, implementation in reversed(previous):
            config._attn_implementation = implementation
        for config, implementation in towers:  # after the parents: they pass theirs on (a nested exit too)
            config._attn_implementation = implementation
        setattr(inner, _DEPTH_ATTR, getattr(inner, _DEPTH_ATTR) - 1)


def _recomputes_in_backward(inner: nn.Module) -> bool:
    """True when a backward of this forward would re-run layers (transformers' gradient checkpointing or
    FSDP2's composable `checkpoint`, or a `CheckpointWrapper`), with gradients enabled and in training mode."""
    if not (torch.is_grad_enabled() and inner.training):
        return False
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # pragma: no cover - torch without the composable API
        def _get_registry(_module):
            return None
    for module in inner.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            return True
        if "checkpoint" in (_get_registry(module) or {}) or type(module).__name__ == "CheckpointWrapper":
            return True
    return False


@contextlib.contextmanager
def packed_forward_context(model: nn.Module) -> Iterator[None]:
    inner = unwrap_model(model)
    if getattr(inner, _DEPTH_ATTR, 0) == 0 and _recomputes_in_backward(inner):
        raise RuntimeError(
            f"{model_name(inner)} recomputes activations in backward (gradient checkpointing), and the recompute "
            f"looks the attention implementation up again: run the forward AND the backward inside "
            f"`with hyflow.models.packing.packed_attention(model):`, or disable gradient checkpointing, or {FIX}"
        )
    with packed_attention(model):
        yield
