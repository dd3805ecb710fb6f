"""The hf engine on a vision-language model: image prompts in, rollout log-probs equal to the trainer's recompute
(with the rollout batch's [N, 4, P + R] positions and the rows' images), through the engine's own call and through
the agent loop's barrier, eager and continuous servers."""

from __future__ import annotations

import pytest
import torch
from vision import image_prompts, tiny_vl

from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.models.forward import response_logprobs
from hyflow.models.vision import concat_multi_modal_inputs
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.hf import HFRolloutEngine
from hyflow.rollout.manager import AgentLoopManager

R = 6


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    _, model, processor = tiny_vl(tmp_path_factory.mktemp("vl") / "m")
    return model, processor


def _engine(model, processor):
    return HFRolloutEngine(model, eos_token_id=processor.tokenizer.eos_token_id,
                           pad_token_id=processor.tokenizer.pad_token_id)


def _recompute(model, out: Batch) -> torch.Tensor:
    mm = concat_multi_modal_inputs(list(out["multi_modal_inputs"]))
    with torch.no_grad():
        logp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                    out["responses"].shape[1], **mm)
    return logp * out["response_mask"]


def test_engine_rollout_logprobs_equal_the_recompute_on_image_prompts(vl):
    model, processor = vl
    prompts = image_prompts(processor)
    out = _engine(model, processor).generate(prompts, SamplingParams(n=2, max_new_tokens=R, seed=0,
                                                                      calculate_log_probs=True))
    assert out["position_ids"].shape == (8, 4, prompts["input_ids"].shape[1] + R)
    assert out["response_mask"].sum() > 8
    assert torch.allclose(out["rollout_log_probs"], _recompute(model, out), atol=1e-5, rtol=0)
    # the response positions continue each row's maximum (past the image's grid for the M-RoPE rows)
    P = prompts["input_ids"].shape[1]
    first = out["position_ids"][0, :, P]
    assert torch.equal(first, out["position_ids"][0, :, :P].max(-1).values + 1)


def test_the_image_changes_the_rollout(vl):
    model, processor = vl
    params = SamplingParams(n=1, max_new_tokens=R, seed=0, calculate_log_probs=True)
    red = _engine(model, processor).generate(image_prompts(processor, ((200, 30, 30),)), params)
    blue = _engine(model, processor).generate(image_prompts(processor, ((20, 20, 220),)), params)
    forced = red.clone()  # the red rollout's tokens scored under the blue image
    forced.non_tensors["multi_modal_inputs"] = blue.non_tensors["multi_modal_inputs"]
    assert (_recompute(model, forced)[0] - red["rollout_log_probs"][0]).abs().max() > 1e-3


@pytest.mark.parametrize("batching", ["barrier", "eager", "continuous"])
def test_agent_loop_rollouts_of_image_prompts_equal_the_recompute(vl, batching):
    model, processor = vl
    prompts = image_prompts(processor)
    rollout = load_config(["actor_rollout_ref.model.path=x", f"data.max_response_length={R}",
                           f"actor_rollout_ref.rollout.agent.batching={batching}"]).actor_rollout_ref.rollout
    manager = AgentLoopManager(_engine(model, processor), processor.tokenizer, rollout,
                               eos_token_ids=[processor.tokenizer.eos_token_id],
                               pad_token_id=processor.tokenizer.pad_token_id)
    params = SamplingParams(n=2, max_new_tokens=R, seed=0, calculate_log_probs=True)
    out = manager.generate(prompts, params)
    assert torch.allclose(out["rollout_log_probs"], _recompute(model, out), atol=1e-5, rtol=0)
    if batching == "barrier":  # the barrier's first turns are the engine's own call on the prompt rows
        direct = _engine(model, processor).generate(prompts, params)
        assert torch.equal(out["responses"], direct["responses"])
        assert torch.equal(out["position_ids"], direct["position_ids"])


def test_images_for_a_text_model_are_an_error(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = Batch({"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)},
                    {"multi_modal_inputs": [{"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.ones(1, 3)}]})
    engine = HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="the prompts carry images but the rollout model is not a vision-language"):
        engine.generate(prompts, SamplingParams(n=1, max_new_tokens=2, seed=0))


def test_a_generated_image_pad_token_is_text_to_the_engine_and_to_the_trainer(vl):
    """A sampled <|image_pad|> (a random or a real VLM may emit it) is embedded as a token by the engine's decoding
    step; the trainer's forward embeds it the same way (placeholder_mask), instead of failing as transformers'
    count check does ("Image features and image tokens do not match", verl issue 3469) or misplacing the image."""
    from hyflow.models.vision import image_placeholders, placeholder_mask, position_ids_4d

    model, processor = vl
    prompts = image_prompts(processor, ((200, 30, 30),))
    pad = processor.tokens.image_token_id
    prompt_ids = prompts["input_ids"][0].tolist()
    mm = prompts["multi_modal_inputs"][0]
    response = [40, pad, 41, pad, pad, 42]
    # the engine's arithmetic: prefill with the image, then one decoding step per response token
    engine_logp = []
    cache_arg = "cache" if "cache" in __import__("inspect").signature(type(model).forward).parameters else \
        "past_key_values"
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = position_ids_4d(processor.tokens, prompt_ids, mm["image_grid_thw"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids]), position_ids=positions[:, None], use_cache=True,
                       **{cache_arg: cache}, **mm).logits[0, -1]
        nxt = positions.max(-1).values + 1
        for token in response:
            engine_logp.append(torch.log_softmax(logits.float(), -1)[token])
            logits = model(input_ids=torch.tensor([[token]]), position_ids=nxt[:, None, None], use_cache=True,
                           **{cache_arg: cache}).logits[0, -1]
            nxt = nxt + 1
    ids = torch.tensor([prompt_ids + response])
    full_pos = torch.cat([positions, positions.max(-1, keepdim=True).values + 1 + torch.arange(len(response))], -1)
    mask = placeholder_mask(ids, [mm], processor.tokens)
    assert int(mask.sum()) == int((torch.tensor(prompt_ids) == pad).sum())  # the three generated pads are not slots
    with torch.no_grad(), image_placeholders(model, mask):
        ours, _ = response_logprobs(model, ids, torch.ones_like(ids), full_pos[None], len(response), **mm)
    assert torch.allclose(ours[0], torch.stack(engine_logp), atol=1e-5, rtol=0)
    # the positions the engine gives a later turn over these ids equal the rollout's continuation
    assert torch.equal(position_ids_4d(processor.tokens, ids[0], mm["image_grid_thw"]), full_pos)
