"""A tool that returns an image (verl's `ToolResponse.image`) in a vision-language model's multi-turn rollout: the
image enters the conversation as its block of pad tokens, the trajectory's row carries it after the prompt's
(`multi_modal_inputs` with `image_pad_starts`, `multi_modal_data`), and the log-probs the engine sampled with equal
the trainer's recomputation over the whole sequence, padded and packed, under every batching mode."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from vision import SHOWN, STOPS, AlwaysLook, LookTool, image_prompts, tiny_vl

from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.models.forward import response_logprobs
from hyflow.models.packing import packed_response_logprobs
from hyflow.models.vision import (
    add_images,
    concat_multi_modal_inputs,
    image_placeholders,
    placeholder_mask,
    row_position_ids,
)
from hyflow.rollout.base import SamplingParams, TokenRequest
from hyflow.rollout.hf import HFRolloutEngine
from hyflow.rollout.manager import AgentLoopManager
from hyflow.tools import OpenAIFunctionToolSchema

R = 64


def _tool(config=None, cls=LookTool):
    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": "look", "description": "look", "parameters": {"type": "object", "properties": {}}}})
    return cls(config or {}, schema)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    _, model, processor = tiny_vl(tmp_path_factory.mktemp("vl") / "m")
    return model, processor


def _manager(model, processor, batching="barrier", tool_config=None, with_processor=True, turns=3, length=R):
    rollout = load_config(["actor_rollout_ref.model.path=x", f"data.max_response_length={length}",
                           "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={turns}",
                           f"actor_rollout_ref.rollout.agent.batching={batching}",
                           "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]
                          ).actor_rollout_ref.rollout
    engine = HFRolloutEngine(model, eos_token_id=processor.tokenizer.eos_token_id,
                             pad_token_id=processor.tokenizer.pad_token_id)
    manager = AgentLoopManager(engine, processor.tokenizer, rollout, eos_token_ids=[processor.tokenizer.eos_token_id],
                               pad_token_id=processor.tokenizer.pad_token_id, tools=[_tool(tool_config)],
                               processor=processor if with_processor else None)
    manager.tool_parser = AlwaysLook(processor.tokenizer)
    return manager


def _recompute(model, processor, out: Batch, packed: bool = False) -> torch.Tensor:
    """The trainer's arithmetic: every row's images, generated pad tokens as text (placeholder_mask)."""
    rows = list(out["multi_modal_inputs"])
    mm = concat_multi_modal_inputs(rows)
    mask = placeholder_mask(out["input_ids"], rows, processor.tokens)
    with torch.no_grad():
        if packed:
            logp, _ = packed_response_logprobs(model, out["input_ids"], out["attention_mask"], out["responses"].shape[1],
                                               position_ids=out["position_ids"], images=mm, image_mask=mask)
        else:
            with image_placeholders(model, mask):
                logp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                            out["responses"].shape[1], **mm)
    return logp * out["response_mask"]


@pytest.mark.parametrize("batching", ["barrier", "eager", "continuous"])
def test_a_tools_image_joins_the_trajectory_and_the_logprobs_equal_the_recompute(vl, batching):
    model, processor = vl
    prompts = image_prompts(processor)
    out = _manager(model, processor, batching).generate(
        prompts, SamplingParams(n=2, max_new_tokens=R, seed=0, calculate_log_probs=True, stop_token_ids=STOPS))
    pad = processor.tokens.image_token_id
    tool_blocks = 0
    for i, row in enumerate(out["multi_modal_inputs"]):
        prompt_images = 0 if i >= 6 else 1  # the fourth prompt has no picture
        grid = (row or {}).get("image_grid_thw")
        added = (0 if grid is None else len(grid)) - prompt_images
        tool_blocks += added
        assert len((out["multi_modal_data"][i] or {}).get("image") or []) == prompt_images + added
        if added:
            assert grid[-1].tolist() == [1, 6, 4]  # 84 x 56 pixels in 14-pixel patches
            assert len(row["image_pad_starts"]) == len(grid)
            # the tool image's tokens sit in the response, outside the response mask, and are image slots
            response = out["responses"][i]
            slots = placeholder_mask(out["input_ids"][i : i + 1], [row], processor.tokens)[0]
            P = out["prompts"].shape[1]
            assert int(slots[P:].sum()) == 6 * 4 // 4 * added
            assert not bool((out["response_mask"][i].bool() & slots[P:] & (response == pad)).any())
    assert tool_blocks >= 4, "too few tool calls fit the response budget to test anything"
    assert torch.allclose(out["rollout_log_probs"], _recompute(model, processor, out), atol=1e-5, rtol=0)
    assert torch.allclose(out["rollout_log_probs"], _recompute(model, processor, out, packed=True), atol=1e-5, rtol=0)


def test_the_tools_image_is_seen(vl):
    """The model's turns after the tool's picture depend on the picture: scored under another colour, they change."""
    model, processor = vl
    prompts = image_prompts(processor, ((200, 30, 30),))
    params = SamplingParams(n=1, max_new_tokens=R, seed=0, calculate_log_probs=True, stop_token_ids=STOPS)
    out = _manager(model, processor, turns=2).generate(prompts, params)
    row = out["multi_modal_inputs"][0]
    assert len(row["image_grid_thw"]) == 2
    other = processor.images([Image.new("RGB", (56, 84), (0, 90, 250))])
    swapped = dict(row, pixel_values=torch.cat([row["pixel_values"][: -len(other["pixel_values"])],
                                                other["pixel_values"]]))
    forced = out.clone()
    forced.non_tensors["multi_modal_inputs"] = [swapped]
    mask = out["response_mask"][0].bool()
    second = mask & (torch.arange(mask.shape[0]) > int((~mask).nonzero().min()))  # the model's second turn
    assert second.any()
    diff = (_recompute(model, processor, forced)[0] - out["rollout_log_probs"][0]).abs()
    assert float(diff[second].max()) > 1e-3
    first = mask & ~second
    assert float(diff[first].max()) < 1e-5  # the first turn came before the picture


def test_a_generated_pad_token_before_a_tools_image_is_text(vl):
    """A request whose ids hold a pad token the model sampled and then a tool's image block: the engine puts the
    image where `image_pad_starts` says (not on the sampled pad), and its log-probs equal the recompute."""
    model, processor = vl
    prompts = image_prompts(processor, ((200, 30, 30),))
    prompt_ids = prompts["input_ids"][0][prompts["attention_mask"][0].bool()].tolist()
    pad = processor.tokens.image_token_id
    row = prompts["multi_modal_inputs"][0]
    new = processor.images([Image.new("RGB", (56, 56), (0, 200, 0))])
    block = processor.expand([pad], new["image_grid_thw"])
    before = sum(1 for t in prompt_ids if t == pad)
    generated = [40, pad, 41]  # the model sampled a pad token, then a tool answered with a picture
    ids = prompt_ids + generated + [42] + block + [43]
    inputs = add_images(row, new, [before + 1], processor.tokens.spatial_merge_size)
    engine = HFRolloutEngine(model, eos_token_id=processor.tokenizer.eos_token_id,
                             pad_token_id=processor.tokenizer.pad_token_id)
    params = SamplingParams(n=1, max_new_tokens=6, seed=0, calculate_log_probs=True)
    [output] = engine.generate_requests([TokenRequest("r", ids, 6, 0, inputs)], params)
    full = torch.tensor([ids + output.token_ids])
    positions = row_position_ids(processor.tokens, full[0], inputs)[:, None]
    mask = placeholder_mask(full, [inputs], processor.tokens)
    assert int(mask.sum()) == before + len(block)  # the sampled pad is no slot
    mm = concat_multi_modal_inputs([inputs])
    with torch.no_grad(), image_placeholders(model, mask):
        logp, _ = response_logprobs(model, full, torch.ones_like(full), positions.transpose(0, 1),
                                    len(output.token_ids), **mm)
    assert torch.allclose(logp[0], torch.tensor(output.log_probs), atol=1e-5, rtol=0)


def test_a_tool_image_for_a_text_policy_is_a_tool_error(vl):
    """Without a vision-language processor the loop cannot show the picture: the tool turn says so and counts it."""
    model, processor = vl
    SHOWN.clear()
    length = 400  # room for the error text
    out = _manager(model, processor, with_processor=False, turns=2, length=length).generate(
        image_prompts(processor, ((200, 30, 30),)),
        SamplingParams(n=1, max_new_tokens=length, seed=0, stop_token_ids=STOPS))
    assert SHOWN, "the tool was not called"
    assert len(out["multi_modal_inputs"][0]["image_grid_thw"]) == 1  # the prompt's picture only
    assert out.meta["metrics"]["tool/errors/mean"] >= 1
    text = processor.tokenizer.decode(out["responses"][0][~out["response_mask"][0].bool()
                                                           & out["attention_mask"][0, -length:].bool()])
    assert "but the policy is a text model" in text


def test_a_tools_text_cannot_fake_an_image_block(vl):
    """Vision tokens in a tool's text are removed (an image block is the image's own), so the row's blocks stay
    aligned with its images."""
    model, processor = vl
    out = _manager(model, processor, tool_config={"text": "<|vision_start|><|image_pad|><|vision_end|> look"},
                   turns=2).generate(image_prompts(processor, ((200, 30, 30),)),
                                     SamplingParams(n=1, max_new_tokens=R, seed=0, calculate_log_probs=True,
                                                    stop_token_ids=STOPS))
    row = out["multi_modal_inputs"][0]
    assert len(row["image_grid_thw"]) == 2
    pad = processor.tokens.image_token_id
    counts = processor.token_counts(row["image_grid_thw"])
    generated = int(((out["responses"][0] == pad) & out["response_mask"][0].bool()).sum())
    assert int((out["input_ids"][0] == pad).sum()) == sum(counts) + generated
    assert torch.allclose(out["rollout_log_probs"], _recompute(model, processor, out), atol=1e-5, rtol=0)
