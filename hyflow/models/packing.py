"""Sequence packing (verl's `use_remove_padding=true`): the real tokens of a micro-batch run as one row, no pads.

A padded micro-batch `input_ids [B, L]`, `attention_mask [B, L]` (prompts left-padded, responses right-padded,
so the real tokens of a row are contiguous) spends compute on B·L positions. Packed, the forward pass runs on
the T = sum_b n_b real tokens only:

    packed ids   x_1 ++ x_2 ++ ... ++ x_B                  one row [1, T]   (x_b = the n_b real tokens of row b)
    position ids 0..n_1-1, 0..n_2-1, ..., 0..n_B-1         restart at every sequence (RoPE sees the padded
                                                            positions clamp(cumsum(mask) - 1, 0) of each token)
    cu_seqlens   [0, n_1, n_1+n_2, ..., T]                 int32 [B+1]; sequence b is packed[cu[b]:cu[b+1]]

Attention must never cross a sequence boundary: token i of sequence b attends to tokens cu[b]..i only. That
is a block-diagonal causal mask over the row, which is never built. Instead the model runs with the attention
implementation `hyflow_packed` (registered in transformers' `AttentionInterface`, with an
`AttentionMaskInterface` entry that builds no mask), which reads the boundaries from the flash-attention
keyword arguments transformers forwards to every attention call (`cu_seq_lens_q/k`, `max_length_q/k`) and
computes causal attention per sequence:

    CPU (and any dtype/device the CUDA kernel does not take): `F.scaled_dot_product_attention(is_causal=True)`
        on each sequence's slice, so the cost is sum_b n_b^2, not T^2 (a dense block-diagonal mask over the one
        row would make packing slower than padding). Grouped-query attention: SDPA shares the K/V heads itself
        (`enable_gqa`, no copies).
    CUDA, fp16/bf16, no attention dropout: PyTorch's own varlen flash kernel,
        `torch.nn.attention.varlen.varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0))`
        (older signatures with `is_causal=` are adapted to). THIS BRANCH HAS NEVER RUN ON A GPU: it was written
        against the torch 2.13 CPU build's source and is untested; the per-sequence SDPA path is what runs here.

Shared prompts (verl's `actor.use_prefix_grouper`; PrefixGrouper, arXiv 2506.05433): with
`share_prefix_width = P` (or `share_prompts=True` in the forwards below), rows of a micro-batch whose prompt
columns are identical (the n samples of a GRPO prompt) pack the prompt once. The packed row is then

    prompt_g ++ response_g1 ++ response_g2 (prompt dropped) ++ ... ++ prompt_h ++ response_h1 ++ ...

and the attention layout (`SharedPrefixes`, passed to the attention function under the keyword
`hyflow_shared_prefix`) says that each response attends to all of its prompt's one copy and causally to itself.
The response positions continue after the prompt as in the padded row, so the outputs (and the gradients: the
prompt's keys and values get the sum over the responses that read them) equal the padded ones up to floating-point
reassociation, for (n-1)/n fewer prompt tokens through every layer. The attention is computed by gathering each
segment's queries and keys into a masked SDPA call (prompts in one call, responses in another) on any device;
the CUDA varlen kernel above is not used for shared layouts (and this path has not run on a GPU either).

Refused loudly (an error naming the model and `use_remove_padding=false` as the fix): sliding-window layers,
logit soft-capping, attention sinks, bidirectional attention, and a `hyflow_packed` call without boundaries.

The attention implementation is switched only inside `packed_attention(model)` (the config of the model under
its DDP / FSDP2 / PEFT wrappers, restored on exit), so the padded path of the same module (and the rollout
engine sharing it) is untouched. Gradient checkpointing (transformers' `gradient_checkpointing_enable`, or
FSDP2's composable `checkpoint`) recomputes each layer during backward, after the forward returned, and the
recompute looks the attention function up again: the backward must then run inside `packed_attention(model)`
too, or it would recompute packed activations with the original (sequence-crossing) attention. The packed
functions below refuse to run in that situation unless an enclosing `packed_attention(model)` is active:

    with packed_attention(model):
        log_probs, _ = packed_response_logprobs(model, input_ids, attention_mask, response_length)
        loss_fn(log_probs).backward()

Outputs match `hyflow.models.forward` on the padded batch (float32; up to floating-point reassociation), with
zeros where the padded path reads padding: the lm_head runs on the real response tokens only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hyflow.models import ulysses
from hyflow.models.forward import (
    backbone_hidden_states,
    check_response_length,
    decoder_of,
    lm_head_logprobs,
    lm_head_logprobs_topk,
    token_values,
    unwrap_model,
)
from hyflow.models.varlen_attention import (  # noqa: F401 (re-exported)
    FIX,
    PACKED_ATTENTION,
    SHARED_PREFIX_KWARG,
    model_name,
    packed_attention,
    packed_attention_forward,
    packed_forward_context,
)
from hyflow.models.vision import MultiModalError, image_placeholders

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------- packing
@dataclass
class PackedSequences:
    """The real tokens of a [B, L] batch as one row of T tokens, and what is needed to go back.

    `flat_index[t] = b * L + l` is where packed token t sits in the padded batch; `cu_seqlens[b]` is the packed
    offset of row b (int32, [B + 1], repeated where a row has no real token); `seq_lengths` are the n_b as
    Python ints; `max_seqlen = max_b n_b`.
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    seq_lengths: tuple[int, ...]
    flat_index: Tensor
    batch_size: int
    seq_len: int
    token_index: Tensor | None = None
    shared: SharedPrefixes | None = None
    leaders: Tensor | None = None  # shared prompts: [B], the row whose packed prompt row b reads (b for its own)

    @property
    def num_tokens(self) -> int:
        """T, the number of real tokens."""
        return int(self.flat_index.numel())

    def attention_kwargs(self) -> dict:
        """The keyword arguments transformers forwards to every attention call: the boundaries of the non-empty
        sequences (`cu_seq_lens_q/k` int32, `max_length_q/k` int), as its flash-attention path names them."""
        cu = [0]
        for n in self.seq_lengths:
            if n:
                cu.append(cu[-1] + n)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=self.input_ids.device)
        kwargs = {"cu_seq_lens_q": cu_t, "cu_seq_lens_k": cu_t,
                  "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen}
        if self.shared is not None:
            kwargs[SHARED_PREFIX_KWARG] = self.shared
        return kwargs




@dataclass(frozen=True)
class SharedPrefixes:
    """The attention layout of a packed row in which samples of one prompt share its tokens (verl's
    `actor.use_prefix_grouper`).

    `segments[i] = (q_start, q_end, p_start, p_end)`: packed tokens q_start..q_end-1 are queries that attend to
    the packed prefix p_start..p_end-1 (all of it) and causally to themselves (key q_start + j is visible to query
    q_start + i when j <= i). A prompt is one segment without prefix (p_start = p_end); the response of every sample
    with that prompt is a segment whose prefix is the prompt's tokens, which are packed once, in the row of the
    group's first sample. The segments partition 0..T-1 in order.
    """

    segments: tuple[tuple[int, int, int, int], ...]
    shared_tokens: int  # prompt tokens not packed because an earlier row of the micro-batch has the same prompt


def pack_sequences(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None, *,
                   share_prefix_width: int | None = None, prompt_keys: Tensor | None = None) -> PackedSequences:
    """Concatenate the real tokens (attention_mask = 1) of every row, in row order, into one row [1, T].

    Position ids restart at 0 for every sequence (n-th real token of a row -> n - 1, which is
    `compute_position_ids` of the padded row), unless `position_ids [B, L]` is given: then its values at the real
    tokens are kept. Rows without real tokens contribute nothing (a zero-length sequence in `cu_seqlens`).

    `share_prefix_width = P` (the prompt columns of an RL batch: left-padded prompts in columns 0..P-1, then the
    responses): rows whose prompt columns are identical (ids and mask; the n samples of a prompt) pack the prompt
    once, in the first such row; the others pack their response tokens only, which attend to that copy
    (`SharedPrefixes`). Their position ids continue after the prompt as in the padded row. Each row's real tokens
    must then be contiguous (they are in an RL batch). `prompt_keys` [B] (optional): rows share a prompt only when
    their keys are equal too (a vision-language prompt's images, which the ids do not show: `prompt_image_keys`).
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"pack_sequences needs input_ids and attention_mask of one shape [B, L]; got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    if share_prefix_width:
        shared = _pack_shared_prefixes(input_ids, attention_mask, position_ids, int(share_prefix_width), prompt_keys)
        if shared is not None:
            return shared
    batch, width = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    flat_index = mask.reshape(-1).nonzero().squeeze(-1)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    seq_lengths = tuple(int(n) for n in lengths.tolist())
    if position_ids is None:
        row_of_token = flat_index // width
        positions = torch.arange(flat_index.numel(), device=input_ids.device) - cu_seqlens[row_of_token].long()
    elif position_ids.dim() == 3:  # a vision-language model's [B, 4, L]: [4, T] (row 0 restarts per sequence)
        positions = position_ids.transpose(0, 1).reshape(position_ids.shape[1], -1)[:, flat_index]
    else:
        positions = position_ids.reshape(-1)[flat_index]
    return _packed(input_ids, flat_index, positions, cu_seqlens, seq_lengths)


def _packed(input_ids: Tensor, flat_index: Tensor, positions: Tensor, cu_seqlens: Tensor,
            seq_lengths: tuple[int, ...], **shared) -> PackedSequences:
    """The `PackedSequences` of the [B, L] batch `input_ids` whose tokens at `flat_index` are packed."""
    return PackedSequences(
        input_ids=input_ids.reshape(-1)[flat_index].unsqueeze(0), position_ids=positions.unsqueeze(0),
        cu_seqlens=cu_seqlens, max_seqlen=max(seq_lengths, default=0), seq_lengths=seq_lengths,
        flat_index=flat_index, batch_size=input_ids.shape[0], seq_len=input_ids.shape[1], **shared,
    )


def prompt_group_ids(input_ids: Tensor, attention_mask: Tensor, width: int, keys: Tensor | None = None) -> Tensor:
    """[B] ids, equal for the rows whose first `width` columns (the left-padded prompt: ids and mask) are equal
    (and their `keys`, when given): the rows that `pack_sequences(share_prefix_width=width)` packs one prompt for."""
    prompt_mask = attention_mask[:, :width].bool()
    key = input_ids[:, :width].masked_fill(~prompt_mask, -1)
    if keys is not None:
        key = torch.cat([key, keys.to(key.device, key.dtype).reshape(-1, 1)], dim=1)
    return torch.unique(key, dim=0, return_inverse=True)[1]


def _pack_shared_prefixes(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None,
                          width: int, keys: Tensor | None = None) -> PackedSequences | None:
    """`pack_sequences` with prompts shared (see there); None when no two rows share a prompt."""
    batch, seq_len = input_ids.shape
    if not 0 < width <= seq_len or batch < 2:
        return None
    device = input_ids.device
    mask = attention_mask.bool()
    prompt_mask = mask[:, :width]
    prompt_len = prompt_mask.sum(-1)
    group = prompt_group_ids(input_ids, attention_mask, width, keys)
    rows = torch.arange(batch, device=device)
    first = torch.full((int(group.max()) + 1,), batch, device=device).scatter_reduce(0, group, rows, "amin")
    leader = first[group]
    follower = (leader != rows) & (prompt_len > 0)
    if not bool(follower.any()):
        return None
    lengths = mask.sum(-1)
    real_cols = torch.arange(seq_len, device=device)
    first_col = torch.where(mask, real_cols, seq_len).amin(-1)
    last_col = torch.where(mask, real_cols, -1).amax(-1)
    if bool(((lengths > 0) & (last_col - first_col + 1 != lengths)).any()):
        raise ValueError("sharing prompts (use_prefix_grouper) needs each row's real tokens contiguous (left-padded "
                         "prompt, then the right-padded response); this batch has a row with a gap")
    pack_mask = mask.clone()
    pack_mask[:, :width] &= ~follower[:, None]
    flat_index = pack_mask.reshape(-1).nonzero().squeeze(-1)
    total = flat_index.numel()
    token_index = torch.full((batch, seq_len), -1, dtype=torch.long, device=device)
    token_index.view(-1)[flat_index] = torch.arange(total, device=device)
    token_index[follower, :width] = token_index[leader[follower], :width]
    own = pack_mask.sum(-1)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = own.cumsum(0)
    if position_ids is None:
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    if position_ids.dim() == 3:  # a vision-language model's [B, 4, L] -> [4, T], the padded rows' values
        positions = position_ids.transpose(0, 1).reshape(position_ids.shape[1], -1)[:, flat_index]
    else:
        positions = position_ids.reshape(-1)[flat_index]

    cu, plen, own_l, lead, is_f = (t.tolist() for t in (cu_seqlens, prompt_len, own, leader, follower))
    segments = []
    for b in range(batch):
        start, end = cu[b], cu[b + 1]
        if start == end:
            continue
        if is_f[b]:  # the response only; the prompt is the leader's first plen packed tokens
            segments.append((start, end, cu[lead[b]], cu[lead[b]] + plen[b]))
        elif 0 < plen[b] < own_l[b]:  # the prompt, then the response attending to it
            segments.append((start, start + plen[b], start, start))
            segments.append((start + plen[b], end, start, start + plen[b]))
        else:
            segments.append((start, end, start, start))
    return _packed(input_ids, flat_index, positions, cu_seqlens, tuple(own_l), token_index=token_index,
                   shared=SharedPrefixes(tuple(segments), int(prompt_len[follower].sum())),
                   leaders=torch.where(follower, leader, rows))


def unpack(values: Tensor, packed: PackedSequences) -> Tensor:
    """Scatter per-token packed values ([T, ...] or [1, T, ...]) back to [B, L, ...], zeros at the pads.

    Differentiable (out-of-place `index_put`)."""
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == packed.num_tokens:
        values = values[0]
    if values.shape[0] != packed.num_tokens:
        raise ValueError(f"unpack got {values.shape[0]} packed values for {packed.num_tokens} packed tokens")
    rest = tuple(values.shape[1:])
    where = packed.flat_index
    if packed.token_index is not None:  # a shared prompt's values appear in every row that has that prompt
        index = packed.token_index.reshape(-1)
        where = (index >= 0).nonzero().squeeze(-1)
        values = values[index[where]]
    out = values.new_zeros((packed.batch_size * packed.seq_len, *rest)).index_put((where,), values)
    return out.view(packed.batch_size, packed.seq_len, *rest)


def _predictor_index(packed: PackedSequences, attention_mask: Tensor, targets: Tensor,
                     columns: slice) -> tuple[Tensor, Tensor]:
    """For the target tokens (targets = 1, real, not the first real token of their row) in `columns`: the bool
    mask of those targets and the packed index of the hidden state that predicts each (the previous real token).

    The packed index of real token (b, c) is cu_seqlens[b] + #real tokens of row b before column c.
    """
    mask = attention_mask.long()
    real_before = (mask.cumsum(-1) - mask)[:, columns]
    valid = targets.bool() & attention_mask[:, columns].bool() & (real_before > 0)
    if packed.token_index is not None:  # shared prompts: the predictor is the packed token of the column before
        start = columns.start or 0
        previous = packed.token_index[:, start - 1 : packed.seq_len - 1] if start > 0 else None
        if previous is None or previous.shape != valid.shape:
            raise ValueError("shared-prefix packing scores columns start >= 1 through the last column only")
        return valid, previous[valid]
    packed_pos = packed.cu_seqlens[:-1, None].long() + real_before
    return valid, packed_pos[valid] - 1


# ---------------------------------------------------------------------------------------------- forwards
def _dummy_if_empty(packed: PackedSequences) -> PackedSequences:
    """A batch without any real token still runs the model (on one token) so that data-parallel collectives of
    FSDP/DDP stay in step across ranks and the outputs stay attached to the graph."""
    if packed.num_tokens > 0:
        return packed
    device = packed.input_ids.device
    return PackedSequences(
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=device), max_seqlen=1, seq_lengths=(1,),
        flat_index=torch.zeros(1, dtype=torch.long, device=device), batch_size=1, seq_len=1,
    )


def packed_hidden_states(model: nn.Module, packed: PackedSequences, **model_kwargs) -> Tensor:
    """Final decoder hidden states [1, T, H] of the packed row (`forward.backbone_hidden_states` with the
    sequence boundaries, under the packed attention); `model_kwargs` go to the model call too (a vision-language
    model's images, in the packed row's order)."""
    packed = _dummy_if_empty(packed)
    return _packed_call(model, packed, backbone_hidden_states, **model_kwargs)


def _packed_call(model: nn.Module, packed: PackedSequences, forward, **model_kwargs) -> Tensor:
    """`forward(model, input_ids, None, position_ids, **boundaries, **model_kwargs)` -> [1, T, ...] on the packed
    row under the packed attention; under Ulysses sequence parallelism (`hyflow.models.ulysses`) the row is
    padded to a multiple of the group's size (the padding a sequence of its own), this rank's slice goes through
    the model (attention over the whole row by all-to-all), and the slices' outputs are gathered."""
    sp = ulysses.active()
    if sp is None:
        with packed_forward_context(model):
            return forward(model, packed.input_ids, None, packed.position_ids, **packed.attention_kwargs(),
                           **model_kwargs)
    group, grad_scale = sp
    total = packed.num_tokens
    padded, start, end = ulysses.local_slice(total, group)
    extra = padded - total
    ids, positions = packed.input_ids, _padded_positions(packed.position_ids, extra)
    if extra:
        ids = torch.cat([ids, ids.new_zeros((*ids.shape[:-1], extra))], dim=-1)
    kwargs = packed.attention_kwargs()
    if extra:  # the padding attends to itself only
        cu = kwargs["cu_seq_lens_q"]
        cu = torch.cat([cu, cu.new_tensor([padded])])
        longest = max(kwargs["max_length_q"], extra)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        if packed.shared is not None:
            kwargs[SHARED_PREFIX_KWARG] = SharedPrefixes((*packed.shared.segments, (total, padded, total, total)),
                                                         packed.shared.shared_tokens)
    kwargs[ulysses.ULYSSES_KWARG] = group
    if model_kwargs.get("pixel_values") is not None:  # a vision-language model: see _decoder_gets_the_slice
        with packed_forward_context(model), _decoder_gets_the_slice(model, start, end, extra, kwargs):
            local = forward(model, packed.input_ids, None, packed.position_ids, **packed.attention_kwargs(),
                            **model_kwargs)
    else:
        with packed_forward_context(model):
            local = forward(model, ids[..., start:end], None, positions[..., start:end], **kwargs, **model_kwargs)
    return ulysses.gather_sequence(local, group, dim=1, grad_scale=grad_scale)[:, :total]


def _padded_positions(positions: Tensor, extra: int) -> Tensor:
    """Position ids [..., T] followed by `extra` padding positions 0 .. extra - 1 (the padding's own sequence)."""
    if not extra:
        return positions
    tail = torch.arange(extra, device=positions.device).expand(*positions.shape[:-1], extra)
    return torch.cat([positions, tail.to(positions.dtype)], dim=-1)


@contextlib.contextmanager
def _decoder_gets_the_slice(model: nn.Module, start: int, end: int, extra: int, kwargs: dict) -> Iterator[None]:
    """Ulysses sequence parallelism of a vision-language model: every rank of the group runs the vision tower on
    all the row's images and builds the whole row's input embeddings (the image features land on their pad
    tokens, which a slice of token ids could not say), then its language model runs on this rank's slice only:
    a pre-hook pads `inputs_embeds` and the [4, 1, T] positions by `extra` tokens, cuts [start, end) and hands the
    decoder the padded row's boundaries with the group (`kwargs`). The gradient reaches the tower and the
    embeddings through the slice alone; the gather's grad scale makes the group's average the whole gradient, as
    for the decoder (hyflow.models.ulysses)."""
    inner = unwrap_model(model)
    decoder = decoder_of(inner)

    def slice_inputs(_module, args, call_kwargs):
        embeds = call_kwargs.get("inputs_embeds")
        if embeds is None or args:
            raise MultiModalError(f"{model_name(inner)}'s language model was not called with inputs_embeds as a "
                                  "keyword: Ulysses sequence parallelism of this vision-language model is not "
                                  "supported; use ulysses_sequence_parallel_size=1")
        if extra:
            embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], extra, embeds.shape[-1])], dim=1)
        call_kwargs = {**call_kwargs, **kwargs, "inputs_embeds": embeds[:, start:end],
                       "position_ids": _padded_positions(call_kwargs["position_ids"], extra)[..., start:end]}
        return args, call_kwargs

    handle = decoder.register_forward_pre_hook(slice_inputs, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _attach(out: Tensor, hidden: Tensor) -> Tensor:
    """`out` + 0 * sum(hidden) when nothing was scored, so a loss built on `out` still reaches the parameters."""
    return out + 0.0 * hidden.sum().float() if hidden.requires_grad else out


def packed_response_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_size: int = 1024,
    share_prompts: bool = False,
    position_ids: Tensor | None = None,
    images: dict | None = None,
    image_mask: Tensor | None = None,
    image_parts: list | None = None,
    topk_ids: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """`forward.response_logprobs` of the padded batch, computed packed: log-probs [B, R] (float32), entropy
    (and with `topk_ids` [B, R, K] the log-probs at those ids and the model's own top-k ids, [B, R, K] each, 0 at
    padding).

    A vision-language model: `position_ids` [B, 4, L] (its M-RoPE positions, packed as they are), `images` (the
    rows' `pixel_values` / `image_grid_thw` in row order, which is the packed row's order) and `image_mask` [B, L]
    (the tokens that take image features, `hyflow.models.vision.placeholder_mask`). With `share_prompts` pass
    `image_parts` (per row its prompt's and its later images, `hyflow.models.vision.split_prompt_images`) instead
    of `images`: rows share a prompt only when its images are equal too, whose images then run once; a row's later
    images (a tool's) run with its response.

    log_probs[b, i] = log_softmax(lm_head(h_prev) / T)[y] for the real response token y = input_ids[b, L-R+i],
    h_prev the packed hidden state of the real token before it; 0 where attention_mask[b, L-R+i] = 0. The backbone
    runs once on the packed row; the lm_head (chunked as in `forward.lm_head_logprobs`) only on the real response
    tokens. Position ids restart per sequence (`compute_position_ids` of the padded rows). Differentiable.
    `share_prompts`: rows with the same prompt (the first L - R columns) run it once (`pack_sequences`'
    `share_prefix_width`; verl's `use_prefix_grouper`): the same values, less compute.
    """
    check_response_length(input_ids, response_length)
    packed, images = _pack_with_images(input_ids, attention_mask, response_length, share_prompts, position_ids,
                                       images, image_parts)
    if images:
        packed_mask = image_mask.reshape(-1)[packed.flat_index].unsqueeze(0)
        with image_placeholders(model, packed_mask):
            hidden_1TH = packed_hidden_states(model, packed, **images)
    else:
        hidden_1TH = packed_hidden_states(model, packed)
    columns = slice(input_ids.shape[1] - response_length, None)
    valid_BR, predictor_N = _predictor_index(packed, attention_mask, attention_mask[:, columns], columns)
    head = unwrap_model(model).get_output_embeddings()
    if topk_ids is None:
        logp_N, entropy_N = lm_head_logprobs(hidden_1TH[0, predictor_N], input_ids[:, columns][valid_BR], head,
                                             temperature=temperature, calculate_entropy=calculate_entropy,
                                             chunk_size=chunk_size)
    else:
        logp_N, entropy_N, gathered_NK, own_NK = lm_head_logprobs_topk(
            hidden_1TH[0, predictor_N], input_ids[:, columns][valid_BR], topk_ids.to(valid_BR.device)[valid_BR],
            head, temperature=temperature, calculate_entropy=calculate_entropy, chunk_size=chunk_size)
    if calculate_entropy and entropy_N is None:  # lm_head_logprobs gives None for zero rows
        entropy_N = logp_N.new_zeros(0)
    shape = valid_BR.shape
    where = valid_BR.nonzero(as_tuple=True)
    logp_BR = logp_N.new_zeros(shape).index_put(where, logp_N)
    entropy_BR = entropy_N.new_zeros(shape).index_put(where, entropy_N) if entropy_N is not None else None
    if predictor_N.numel() == 0:
        logp_BR = _attach(logp_BR, hidden_1TH)
        entropy_BR = _attach(entropy_BR, hidden_1TH) if entropy_BR is not None else None
    if topk_ids is None:
        return logp_BR, entropy_BR
    gathered_BRK = gathered_NK.new_zeros(topk_ids.shape).index_put(where, gathered_NK)
    if predictor_N.numel() == 0:
        gathered_BRK = _attach(gathered_BRK, hidden_1TH)
    return logp_BR, entropy_BR, gathered_BRK, own_NK.new_zeros(topk_ids.shape).index_put(where, own_NK)


def packed_values(value_model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_length: int, *,
                  share_prompts: bool = False, position_ids: Tensor | None = None, images: dict | None = None,
                  image_mask: Tensor | None = None, image_parts: list | None = None) -> Tensor:
    """`forward.values_from_model` of the padded batch, computed packed: V [B, R] (float32), 0 at padding.

    values[b, i] = V(s) at the real token before response token (b, L-R+i): the critic's value of the state
    before that token is emitted. The value model is a token classifier with one label (`load_value_model`).
    A vision-language critic: `position_ids`, `images` / `image_parts` and `image_mask` as in
    `packed_response_logprobs`.
    """
    check_response_length(input_ids, response_length)
    packed, images = _pack_with_images(input_ids, attention_mask, response_length, share_prompts, position_ids,
                                       images, image_parts)
    run = _dummy_if_empty(packed)
    placeholders = (image_placeholders(value_model, image_mask.reshape(-1)[packed.flat_index].unsqueeze(0))
                    if images else contextlib.nullcontext())
    with placeholders:
        values_T = _packed_call(value_model, run, token_values, **(images or {}))[0]
    columns = slice(input_ids.shape[1] - response_length, None)
    valid_BR, predictor_N = _predictor_index(packed, attention_mask, attention_mask[:, columns], columns)
    values_BR = values_T.new_zeros(valid_BR.shape).index_put(valid_BR.nonzero(as_tuple=True), values_T[predictor_N])
    return _attach(values_BR, values_T) if predictor_N.numel() == 0 else values_BR


def packed_token_nll_sum(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                         loss_mask: Tensor) -> Tensor:
    """`sft_trainer.token_nll_sum` computed packed: sum over targets (b, t), t >= 1, loss_mask[b, t] = 1 (and real),
    of -log p(x[b, t] | x[b, <t]), a scalar. The batch's own position ids are kept at the real tokens; the lm_head
    runs on the target tokens only."""
    packed = pack_sequences(input_ids, attention_mask, position_ids)
    hidden_1TH = packed_hidden_states(model, packed)
    columns = slice(1, None)
    valid_BT, predictor_N = _predictor_index(packed, attention_mask, loss_mask[:, columns], columns)
    logp_N, _ = lm_head_logprobs(hidden_1TH[0, predictor_N], input_ids[:, columns][valid_BT],
                                 unwrap_model(model).get_output_embeddings())
    nll = -logp_N.sum()
    return _attach(nll, hidden_1TH) if predictor_N.numel() == 0 else nll


def _pack_with_images(input_ids: Tensor, attention_mask: Tensor, response_length: int, share_prompts: bool,
                      position_ids: Tensor | None, images: dict | None, image_parts: list | None
                      ) -> tuple[PackedSequences, dict | None]:
    """The packed batch (prompts shared when asked; with `image_parts`, only rows whose prompt images are equal)
    and its images in the packed row's order (`images` as given without `image_parts`)."""
    keys = None
    if image_parts is not None and share_prompts:
        from hyflow.models.vision import prompt_image_keys

        keys = prompt_image_keys(image_parts)
    width = input_ids.shape[1] - response_length
    packed = pack_sequences(input_ids, attention_mask, position_ids,
                            share_prefix_width=width if share_prompts else None, prompt_keys=keys)
    if image_parts is not None:  # in packed order: a row that reads another row's prompt brings its later images
        from hyflow.models.vision import concat_multi_modal_inputs

        leaders = packed.leaders.tolist() if packed.leaders is not None else list(range(len(image_parts)))
        images = concat_multi_modal_inputs(
            [_merged(prompt, later) if leaders[b] == b else later
             for b, (prompt, later) in enumerate(image_parts)])
        images = {key: value.to(input_ids.device) for key, value in images.items()}
    return packed, images


def _merged(first: dict, second: dict) -> dict:
    """Two {pixel_values, image_grid_thw} parts of a row (either may be {}) as one, in order."""
    if not first or not second:
        return first or second
    return {key: torch.cat([first[key], second[key]]) for key in ("pixel_values", "image_grid_thw")}
