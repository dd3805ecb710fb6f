"""Per-token log-probs, entropy, values and reward scores of responses from one model forward pass.

A sample is `input_ids = prompt ++ response` ([B, L], prompts left-padded, responses right-padded, response
length R). The token at position t is predicted by the hidden state at t - 1, so the response tokens
`input_ids[:, -R:]` are scored from the hidden states `h[:, -R-1:-1]`:

    log pi(y_t) = log_softmax(W h_{t-1} / T)[y_t]          (T = sampling temperature)
    H_t         = logsumexp(z) - sum_v softmax(z)_v z_v,    z = W h_{t-1} / T
    V(s_t)      = w_v . h_{t-1} + b_v                       (critic: value of the state before y_t)

Memory and speed: the backbone runs once (no lm_head); the lm_head and the log-softmax then run on the
N = B·R response rows of hidden states in one of two ways, chosen by the size of the logits, N·V elements:

- N·V <= `full_logits_max_elements` (default 2**24, i.e. 64 MiB of float32 logits: every tiny/small model on
  CPU, e.g. 8192 rows x 512 tokens = 2**22): the [N, V] logits are built at once and autograd keeps them for
  backward. Nothing is recomputed; the extra memory is a few [N, V] float32 buffers (at most ~256 MiB).
- larger (any real vocabulary: 2**24 elements are 110 rows of Qwen2's 151,936 tokens): `chunk_size` rows at a
  time, and when gradients are needed each chunk runs inside `torch.utils.checkpoint` (non-reentrant), so
  autograd keeps only the hidden-state chunk and backward recomputes that chunk's logits: peak extra memory
  is about one [chunk_size, V] block instead of [B·R, V] logits in the model dtype plus their float32
  log-softmax.

The log-prob kernel works row by row, so both ways give the same values (to float rounding, should the
matmul round differently for a different number of rows; bit for bit on CPU); they differ in memory and
in the recompute, which on CPU cost 25-45 % of the lm_head + log-prob time at a 512-token vocabulary
(BENCHMARKS.md). The log-softmax/entropy math is
`hyflow.models.logprobs.logprobs_and_entropy_from_logits` (float32 outputs).

Position ids for left padding: `position_ids = clamp(cumsum(attention_mask) - 1, min=0)`. A vision-language model's
are [B, 4, L] (text positions over M-RoPE's three rows, `hyflow.models.vision`), passed to the model as [4, B, L],
with its image inputs in `model_kwargs`.

Wrapped models: the forward call goes through the outermost module (DDP, FSDP2, PEFT), so their hooks run;
the decoder's output is captured with a forward hook and the causal LM is asked for logits at no position.
The lm_head chunks then run after that forward, on the parameters the wrapper left materialised (FSDP2
keeps the root module unsharded after its forward).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyflow.models.logprobs import logprobs_and_entropy_from_logits

Tensor = torch.Tensor


def compute_position_ids(attention_mask: Tensor) -> Tensor:
    """position_ids = clamp(cumsum(mask, -1) - 1, min=0): 0 on left padding, then 0, 1, 2, ... per token."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def check_response_length(input_ids: Tensor, response_length: int) -> None:
    seq_len = input_ids.shape[-1]
    if not 1 <= response_length < seq_len:
        raise ValueError(
            f"response_length={response_length} must be in [1, {seq_len - 1}] for input_ids of length {seq_len} "
            f"(at least one prompt token precedes the response); pass responses.shape[-1]"
        )


def unwrap_model(model: nn.Module) -> nn.Module:
    """The HF model inside DDP/FSDP1 wrappers (`.module`) and PEFT wrappers (`.get_base_model()`).

    FSDP2 changes the model's class in place, so the model itself is returned.
    """
    while True:
        if isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif hasattr(model, "get_base_model") and model.get_base_model() is not model:
            model = model.get_base_model()
        else:
            return model


def decoder_of(inner: nn.Module) -> nn.Module:
    """The decoder (the model's stack of layers with its final norm) of an unwrapped Hugging Face model."""
    return inner.get_decoder() if hasattr(inner, "get_decoder") else getattr(inner, inner.base_model_prefix)


def backbone_hidden_states(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor, **model_kwargs
) -> Tensor:
    """Final hidden states [B, L, H] of the model's decoder (after the final norm), no KV cache.

    The call goes through the outermost module, so DDP and FSDP2 hooks run as in a normal forward; a
    forward hook on the decoder captures its output, and a causal LM is asked for logits at no position
    (`logits_to_keep` = an empty index), so no [B, L, V] logits are computed. `model_kwargs` go to the model
    call as well (e.g. the packed-sequence boundaries of `hyflow.models.packing`).
    """
    inner = unwrap_model(model)
    decoder = decoder_of(inner)
    captured: list[Tensor] = []

    def capture(_module, _args, output):
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    if position_ids is not None and position_ids.dim() == 3:  # [B, 4, L] (vision-language, hyflow.models.vision)
        position_ids = position_ids.transpose(0, 1)  # transformers' Qwen2-VL takes [4, B, L]
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              **model_kwargs}
    if "logits_to_keep" in inspect.signature(inner.forward).parameters:
        kwargs["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=input_ids.device)
    handle = decoder.register_forward_hook(capture)
    try:
        model(**kwargs, use_cache=False)
    finally:
        handle.remove()
    return captured[-1]


FULL_LOGITS_MAX_ELEMENTS = 1 << 24
"""Largest N·V for which `lm_head_logprobs` builds the [N, V] logits at once, without chunks or checkpointing."""


def _head_logprobs_chunk(
    hidden_cH: Tensor, labels_c: Tensor, lm_head: nn.Module, temperature: float, with_entropy: bool,
    gather_cK: Tensor | None = None,
) -> tuple[Tensor, ...]:
    logits_cV = lm_head(hidden_cH)
    logp_c, entropy_c = logprobs_and_entropy_from_logits(
        logits_cV, labels_c, temperature=temperature, chunk_size=max(1, logits_cV.shape[0]),
        with_entropy=with_entropy,
    )
    if gather_cK is None:
        return logp_c, entropy_c
    z_cV = logits_cV.float() / temperature  # the same softmax as logp: log_softmax(z)[ids] = z[ids] - lse(z)
    gathered_cK = z_cV.gather(-1, gather_cK.long()) - torch.logsumexp(z_cV, -1, keepdim=True)
    own_cK = z_cV.detach().topk(gather_cK.shape[-1], dim=-1).indices
    return logp_c, entropy_c, gathered_cK, own_cK


def _vocab_size(lm_head: nn.Module) -> int | None:
    """V of an lm_head without running it: `out_features` (nn.Linear, PEFT layers) or the weight's rows
    (a DTensor reports its global shape); None when neither is known."""
    out_features = getattr(lm_head, "out_features", None)
    if isinstance(out_features, int):
        return out_features
    weight = getattr(lm_head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else None


def lm_head_logprobs(
    hidden_NH: Tensor,
    labels_N: Tensor,
    lm_head: nn.Module,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_size: int = 1024,
    full_logits_max_elements: int = FULL_LOGITS_MAX_ELEMENTS,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(lm_head(h) / T)[label] (and entropy) for [N, H] rows.

    Returns float32 ([N], [N] or None). When N·V <= `full_logits_max_elements` the [N, V] logits are built
    at once (no recompute in backward); otherwise `chunk_size` rows at a time, each chunk checkpointed when
    gradients are enabled, so backward recomputes its [chunk_size, V] logits instead of keeping [N, V] of
    them (module docstring). Pass `full_logits_max_elements=0` to always chunk. Same values either way (to
    float rounding).
    """
    logp_N, entropy_N, _, _ = lm_head_rows(hidden_NH, labels_N, lm_head, None, temperature, calculate_entropy,
                                            chunk_size, full_logits_max_elements)
    return logp_N, entropy_N


def lm_head_logprobs_topk(
    hidden_NH: Tensor,
    labels_N: Tensor,
    gather_NK: Tensor,
    lm_head: nn.Module,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_size: int = 1024,
    full_logits_max_elements: int = FULL_LOGITS_MAX_ELEMENTS,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """`lm_head_logprobs` plus, from the same logits, the log-probs at K given token ids per row ([N, K] float32,
    differentiable: a teacher's top-k ids in on-policy distillation) and this model's own top-k ids ([N, K])."""
    return lm_head_rows(hidden_NH, labels_N, lm_head, gather_NK, temperature, calculate_entropy, chunk_size,
                         full_logits_max_elements)


def lm_head_rows(hidden_NH: Tensor, labels_N: Tensor, lm_head: nn.Module, gather_NK: Tensor | None,
                  temperature: float, calculate_entropy: bool, chunk_size: int, full_logits_max_elements: int):
    """The head over [N, H] rows at once or in checkpointed chunks (`lm_head_logprobs`); the gathered top-k
    outputs are None without `gather_NK`."""
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive number of rows; got {chunk_size}")
    n_rows = hidden_NH.shape[0]
    vocab = _vocab_size(lm_head)
    topk = 0 if gather_NK is None else gather_NK.shape[-1]
    if n_rows > 0 and vocab is not None and n_rows * vocab <= full_logits_max_elements:
        parts = [_head_logprobs_chunk(hidden_NH, labels_N, lm_head, temperature, calculate_entropy, gather_NK)]
    else:
        needs_grad = torch.is_grad_enabled() and (
            hidden_NH.requires_grad or any(p.requires_grad for p in lm_head.parameters())
        )
        parts = []
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            args = (hidden_NH[rows], labels_N[rows], lm_head, temperature, calculate_entropy,
                    None if gather_NK is None else gather_NK[rows])
            parts.append(checkpoint(_head_logprobs_chunk, *args, use_reentrant=False) if needs_grad
                         else _head_logprobs_chunk(*args))
    empty = hidden_NH.new_zeros(0, dtype=torch.float32)
    logp_N = torch.cat([p[0] for p in parts]).float() if parts else empty
    entropy_N = torch.cat([p[1] for p in parts]).float() if calculate_entropy and parts else None
    if gather_NK is None:
        return logp_N, entropy_N, None, None
    if not parts:
        return logp_N, entropy_N, empty.new_zeros(0, topk), gather_NK.new_zeros(0, topk)
    return logp_N, entropy_N, torch.cat([p[2] for p in parts]).float(), torch.cat([p[3] for p in parts])


def response_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_size: int = 1024,
    full_logits_max_elements: int = FULL_LOGITS_MAX_ELEMENTS,
    topk_ids: Tensor | None = None,
    **model_kwargs,
) -> tuple[Tensor, ...]:
    """Log-probs [B, R] (float32) of the last R tokens of `input_ids`, and their entropy [B, R] if asked.
    With `topk_ids` [B, R, K] (a teacher's top-k ids at each response token) two more outputs: the log-probs
    at those ids [B, R, K] and this model's own top-k ids [B, R, K] (`lm_head_logprobs_topk`).

    log_probs[b, i] = log_softmax(lm_head(h[b, L-R-1+i]) / T)[input_ids[b, L-R+i]]; the backbone runs once,
    the lm_head runs on all B·R rows at once when B·R·V <= `full_logits_max_elements`, else in checkpointed
    chunks of `chunk_size` rows (see the module docstring). Differentiable. `model_kwargs` go to the model call
    (a vision-language model's `pixel_values` and `image_grid_thw`, with `position_ids` [B, 4, L]).
    """
    check_response_length(input_ids, response_length)
    hidden_BLH = backbone_hidden_states(model, input_ids, attention_mask, position_ids, **model_kwargs)
    hidden_BRH = hidden_BLH[:, -response_length - 1 : -1]
    labels_BR = input_ids[:, -response_length:]
    batch, hidden_size = hidden_BRH.shape[0], hidden_BRH.shape[-1]
    gather_NK = None if topk_ids is None else topk_ids.reshape(batch * response_length, -1)
    logp_N, entropy_N, gathered_NK, own_NK = lm_head_rows(
        hidden_BRH.reshape(-1, hidden_size), labels_BR.reshape(-1), unwrap_model(model).get_output_embeddings(),
        gather_NK, temperature, calculate_entropy, chunk_size, full_logits_max_elements,
    )
    entropy_BR = entropy_N.view(batch, response_length) if entropy_N is not None else None
    if topk_ids is None:
        return logp_N.view(batch, response_length), entropy_BR
    return (logp_N.view(batch, response_length), entropy_BR, gathered_NK.view(topk_ids.shape),
            own_NK.view(topk_ids.shape))


def token_values(
    value_model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor, **model_kwargs
) -> Tensor:
    """Per-token values [B, L] (float32) of a critic from `load_value_model` (token classifier, 1 label);
    `model_kwargs` go to the model call as well (e.g. packed-sequence boundaries, a vision-language critic's
    images with `position_ids` [B, 4, L])."""
    if position_ids is not None and position_ids.dim() == 3:  # [B, 4, L] -> transformers' Qwen2-VL [4, B, L]
        position_ids = position_ids.transpose(0, 1)
    out = value_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
        **model_kwargs,
    )
    logits_BL1 = out.logits if hasattr(out, "logits") else out[0]
    if logits_BL1.shape[-1] != 1:
        raise ValueError(
            f"value model outputs {logits_BL1.shape[-1]} scores per token; a critic needs exactly one "
            f"(AutoModelForTokenClassification with num_labels=1, as built by load_value_model)"
        )
    return logits_BL1[..., 0].float()


def values_from_model(
    value_model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    response_length: int,
    **model_kwargs,
) -> Tensor:
    """Values [B, R] (float32) at positions [-R-1:-1]: V(s_t) is read before response token t is emitted.
    `model_kwargs` go to the model call (a vision-language critic's images)."""
    check_response_length(input_ids, response_length)
    values_BL = token_values(value_model, input_ids, attention_mask, position_ids, **model_kwargs)
    return values_BL[:, -response_length - 1 : -1]


def reward_scores(
    reward_model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor
) -> Tensor:
    """Sequence scores [B] (float32) of a reward model from `load_reward_model`, read at the last attended token.

    score[b] = score_head(h[b, last t with attention_mask[b, t] = 1]); this uses the attention mask rather
    than the pad token id, so pad == eos tokenizers and left or right padding both work. Columns that are padding
    in every row are cut first (the forward runs over the real lengths; the scores do not change).
    """
    used_L = attention_mask.any(dim=0).nonzero().squeeze(-1)
    if used_L.numel():
        first, last = int(used_L[0]), int(used_L[-1]) + 1
        input_ids, attention_mask = input_ids[:, first:last], attention_mask[:, first:last]
        position_ids = position_ids[..., first:last]
    hidden_BLH = backbone_hidden_states(reward_model, input_ids, attention_mask, position_ids)
    positions_L = torch.arange(input_ids.shape[-1], device=input_ids.device)
    last_B = (positions_L * attention_mask.long()).argmax(dim=-1)
    hidden_BH = hidden_BLH[torch.arange(input_ids.shape[0], device=input_ids.device), last_B]
    scores_B1 = unwrap_model(reward_model).score(hidden_BH)
    if scores_B1.shape[-1] != 1:
        raise ValueError(
            f"reward model outputs {scores_B1.shape[-1]} scores per sequence; a reward model needs exactly one "
            f"(AutoModelForSequenceClassification with num_labels=1)"
        )
    return scores_B1[:, 0].float()


@torch.no_grad()
def response_token_scores(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    response_length: int,
    *,
    topk: int = 0,
    chunk_size: int = 1024,
) -> dict[str, Tensor]:
    """A frozen model's scores of the last R tokens of `input_ids` (a teacher's, in on-policy distillation):
    `log_probs` [B, R] = log_softmax(lm_head(h[b, L-R-1+i]))[input_ids[b, L-R+i]] and, with `topk` > 0, the model's
    own `topk_log_probs` and `topk_ids` [B, R, K] at each position (its K most likely next tokens). float32, no
    gradients; the head runs `chunk_size` rows at a time, so no [B, R, V] tensor is built at once."""
    check_response_length(input_ids, response_length)
    hidden_BLH = backbone_hidden_states(model, input_ids, attention_mask, position_ids)
    hidden_NH = hidden_BLH[:, -response_length - 1 : -1].reshape(-1, hidden_BLH.shape[-1])
    labels_N = input_ids[:, -response_length:].reshape(-1)
    head = unwrap_model(model).get_output_embeddings()
    logp, values, ids = [], [], []
    for start in range(0, hidden_NH.shape[0], chunk_size):
        logp_cV = torch.log_softmax(head(hidden_NH[start : start + chunk_size]).float(), dim=-1)
        logp.append(logp_cV.gather(-1, labels_N[start : start + chunk_size, None]).squeeze(-1))
        if topk:
            top = logp_cV.topk(topk, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    shape = (input_ids.shape[0], response_length)
    out = {"log_probs": torch.cat(logp).view(shape)}
    if topk:
        out["topk_log_probs"] = torch.cat(values).view(*shape, topk)
        out["topk_ids"] = torch.cat(ids).view(*shape, topk)
    return out
