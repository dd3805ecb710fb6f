"""The output every engine returns: verl's rollout keys, assembled from prompts and sampled token ids.

Rows are interleaved (p0s0, p0s1, ..., p1s0, ...). Keys: `prompts` [N, P] (left-padded), `responses` [N, R]
(right-padded with the pad id), `response_mask` (1 up to and including the stop token), `input_ids`,
`attention_mask`, `position_ids` [N, P + R], `rollout_log_probs` [N, R] (0 where masked; only when asked), every
other column of the prompt batch repeated per sample, and `meta["temperature"]`: the temperature the log-probs
were taken at (1.0 for greedy), which the trainer recomputes at.

One function builds it, `rollout_batch`, from each row's response token ids as lists: an engine's `generate(prompts,
params)` is `generate_rollout(engine, prompts, params)` over the engine's batch decoder (`decode_batch`, which
returns one `TokenOutput` per sample, what a token stream returns), and the agent loop's manager builds its rollout
from its trajectories' lists with the same function.
"""

from __future__ import annotations

import torch

from hyflow.batch import Batch
from hyflow.models.vision import continue_positions
from hyflow.rollout.base import SamplingParams, TokenOutput


def left_pad(id_lists, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as left-padded `input_ids` and `attention_mask` [len, longest] (long tensors)."""
    id_lists = [list(ids) for ids in id_lists]
    width = max(len(ids) for ids in id_lists)
    input_ids = torch.full((len(id_lists), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(id_lists), width), dtype=torch.long)
    for row, ids in enumerate(id_lists):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids):] = 1
    return input_ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """clamp(cumsum(mask) - 1, min=0): positions count only real tokens, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def prompt_budgets(prompts: Batch, params: SamplingParams) -> torch.Tensor:
    """New tokens allowed per prompt [B]: the prompt batch's `max_new_tokens` column when it has one (each at
    most `params.max_new_tokens`, at least 1), else `params.max_new_tokens` for every prompt."""
    if "max_new_tokens" not in prompts:
        return torch.full((len(prompts),), params.max_new_tokens, dtype=torch.long)
    budgets = torch.as_tensor(prompts["max_new_tokens"], dtype=torch.long).cpu()
    if bool((budgets < 1).any()) or bool((budgets > params.max_new_tokens).any()):
        raise ValueError(f"every prompt's max_new_tokens must be in [1, {params.max_new_tokens}] "
                         f"(SamplingParams.max_new_tokens), got {budgets.tolist()}")
    return budgets


def turn_end(ids: list[int], budget: int, stop_ids) -> str:
    """Why a response ended: "stop" when its last token is a stop id or it is shorter than its budget, else
    "length"."""
    return "stop" if (ids and ids[-1] in stop_ids) or len(ids) < budget else "length"


def padded_outputs(responses: torch.Tensor, logprobs: torch.Tensor | None, lengths, budgets, stop_ids) -> list[TokenOutput]:
    """One TokenOutput per row of right-padded `responses` [N, R] (their `logprobs`, None when not asked for) cut
    at `lengths` [N]; `budgets` [N]: each row's new-token budget (for the stop reason, `turn_end`)."""
    responses = responses.cpu()
    logprobs = None if logprobs is None else logprobs.cpu()
    outputs = []
    for row, (length, budget) in enumerate(zip(torch.as_tensor(lengths).tolist(), torch.as_tensor(budgets).tolist())):
        ids = responses[row, :length].tolist()
        outputs.append(TokenOutput(ids, None if logprobs is None else logprobs[row, :length].tolist(),
                                   turn_end(ids, budget, stop_ids)))
    return outputs


def generate_rollout(engine, prompts: Batch, params: SamplingParams) -> Batch:
    """`engine.generate(prompts, params)` of an engine with a batch decoder: `params.n` samples per left-padded
    prompt row, verl's rollout keys out (the module docstring). The engine's `decode_batch(prompts, params,
    budgets)` returns one TokenOutput per sample, interleaved (`budgets` [B]: `prompt_budgets`), and
    `engine.pad_token_id` pads the responses."""
    for key in ("input_ids", "attention_mask"):
        if key not in prompts:
            raise KeyError(f"generate() needs a {key!r} column of left-padded prompt token ids")
    input_ids, prompt_mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu()
    if (prompt_mask[:, -1] == 0).any():
        raise ValueError("prompts must be LEFT-padded (the last position of every row must be a real token)")
    outputs = engine.decode_batch(prompts, params, prompt_budgets(prompts, params))
    return rollout_batch(prompts, input_ids, prompt_mask, params, [o.token_ids for o in outputs],
                         [o.log_probs for o in outputs], engine.pad_token_id)


def rollout_batch(prompts: Batch, input_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                  token_ids, log_probs, pad_token_id: int, model_masks=None) -> Batch:
    """The rollout Batch (`assemble_rollout`) from each of the B*n rows' response token ids (lists, cut to
    `params.max_new_tokens`), their log-probs (a list per row; None or empty: 0) and optionally each row's model
    mask (1 where the model generated the token: the agent loop's trajectories)."""
    R, N = params.max_new_tokens, len(token_ids)
    responses = torch.full((N, R), int(pad_token_id), dtype=torch.long)
    logprobs = torch.zeros((N, R), dtype=torch.float32)
    lengths = torch.zeros(N, dtype=torch.long)
    model_mask = None if model_masks is None else torch.zeros((N, R), dtype=torch.long)
    for i, ids in enumerate(token_ids):
        ids = list(ids)[:R]
        k = lengths[i] = len(ids)
        responses[i, :k] = torch.tensor(ids, dtype=torch.long)
        if log_probs[i]:
            logprobs[i, :k] = torch.tensor(list(log_probs[i])[:k], dtype=torch.float32)
        if model_mask is not None:
            model_mask[i, :k] = torch.tensor(list(model_masks[i])[:k], dtype=torch.long)
    return assemble_rollout(prompts, input_ids, prompt_mask, responses, logprobs, lengths, params,
                            model_mask=model_mask)


def assemble_rollout(prompts: Batch, input_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     logprobs: torch.Tensor, lengths: torch.Tensor, params: SamplingParams,
                     model_mask: torch.Tensor | None = None) -> Batch:
    """The rollout Batch from left-padded prompts [B, P], responses [B*n, R], their log-probs and lengths [B*n].

    `model_mask` [B*n, R] marks the tokens the model generated when a response also holds others (the agent
    loop's tool and user turns): `response_mask` is then that mask within the lengths, while `attention_mask`
    covers every response token. Without it every token within the length is the model's."""
    n = params.n
    prompt_positions = prompts["position_ids"] if "position_ids" in prompts else None  # noqa: SIM401 (Batch)
    if prompt_positions is not None and prompt_positions.dim() == 3:  # a vision-language model's [B, 4, P]
        if prompt_positions.shape[-1] != input_ids.shape[-1]:
            raise ValueError(f"the prompts' M-RoPE position_ids cover {prompt_positions.shape[-1]} columns but their "
                             f"input_ids {input_ids.shape[-1]}: a vision-language rollout keeps the prompt batch's "
                             "padding (an agent loop that re-renders its prompt cannot carry images)")
        prompt_positions = prompt_positions.cpu().repeat_interleave(n, dim=0)
    else:
        prompt_positions = None
    within = (torch.arange(responses.shape[1], device=responses.device)[None] < lengths[:, None]).long()
    response_mask = within if model_mask is None else within * model_mask.long()
    prompt_ids = input_ids.repeat_interleave(n, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask.long(), within], dim=-1)
    out = prompts.repeat(n, interleave=True)
    for key in ("input_ids", "attention_mask", "position_ids", "raw_prompt_ids", "max_new_tokens"):
        if key in out:
            out.pop(key)
    out = out.to("cpu")
    columns = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=-1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask) if prompt_positions is None else torch.cat(
            [prompt_positions, continue_positions(prompt_positions, responses.shape[1])], dim=-1),
    }
    if params.calculate_log_probs:
        columns["rollout_log_probs"] = logprobs * response_mask
    for key, value in columns.items():
        out[key] = value.cpu()
    out.meta["temperature"] = 1.0 if params.greedy else params.temperature
    return out


def replace_responses(batch: Batch, rows: list[int], responses: list[list[int]], pad_token_id: int) -> Batch:
    """`batch` (a text rollout) with the responses of `rows` replaced by the given token ids (each cut to the
    batch's response width): `responses`, `response_mask`, `input_ids`, `attention_mask` and `position_ids` of
    those rows rebuilt as `assemble_rollout` builds them, `rollout_log_probs` 0 there (no engine sampled them).
    The other rows and columns are unchanged; a new Batch is returned."""
    if batch["position_ids"].dim() != 2:
        raise ValueError("replacing responses needs a text rollout (2-D position_ids), not a vision-language one")
    out = batch.clone()
    R = out["responses"].shape[1]
    new = torch.full((len(rows), R), pad_token_id, dtype=out["responses"].dtype)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    for i, tokens in enumerate(responses):
        tokens = list(tokens)[:R]
        new[i, : len(tokens)] = torch.tensor(tokens, dtype=new.dtype)
        lengths[i] = len(tokens)
    index = torch.tensor(rows, dtype=torch.long)
    within = (torch.arange(R)[None] < lengths[:, None]).long()
    prompt_mask = out["attention_mask"][index, : out["prompts"].shape[1]].long()
    attention_mask = torch.cat([prompt_mask, within], dim=-1)
    columns = {"responses": new, "response_mask": within, "attention_mask": attention_mask,
               "input_ids": torch.cat([out["prompts"][index], new], dim=-1),
               "position_ids": position_ids_from_mask(attention_mask)}
    if "rollout_log_probs" in out:
        columns["rollout_log_probs"] = torch.zeros(len(rows), R)
    for key, value in columns.items():
        column = out[key].clone()
        column[index] = value.to(column.dtype)
        out[key] = column
    return out

