"""The hf rollout engine on the tiny model: shapes, masks, EOS handling, seeding, weights, sleep/wake."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hyflow.batch import Batch
from hyflow.rollout.base import SamplingParams, make_engine
from hyflow.rollout.hf import HFRolloutEngine


@pytest.fixture
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def prompt_batch(tokenizer, texts):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return Batch({"input_ids": input_ids, "attention_mask": mask}, {"uid": [f"p{i}" for i in range(len(ids))]})


TEXTS = ["What is 1 + 2?", "12 * 3 =", "hello there, how are you today?", "7"]


def test_shapes_masks_and_interleaving(model, tiny_tokenizer):
    # many stop ids so rows stop at different lengths
    stop = list(range(0, len(tiny_tokenizer), 7))
    engine = HFRolloutEngine(model, eos_token_id=stop, pad_token_id=tiny_tokenizer.pad_token_id)
    out = engine.generate(prompt_batch(tiny_tokenizer, TEXTS), SamplingParams(n=3, max_new_tokens=12, seed=0))
    n, R = 12, 12
    assert len(out) == n and out["responses"].shape == (n, R)
    assert list(out["uid"]) == [f"p{i}" for i in range(4) for _ in range(3)]
    P = out["prompts"].shape[1]
    assert out["input_ids"].shape == out["attention_mask"].shape == out["position_ids"].shape == (n, P + R)
    mask = out["response_mask"]
    lengths = mask.sum(-1)
    assert (lengths < R).any(), "some rows should have stopped early"
    for row in range(n):
        L = int(lengths[row])
        assert mask[row, :L].all() and not mask[row, L:].any()  # contiguous, ends at the first stop token
        tokens = out["responses"][row].tolist()
        stops = [t in stop for t in tokens[:L]]
        if L < R:
            assert stops[-1] and not any(stops[:-1])  # the first stop token is the last valid one
            assert all(t == tiny_tokenizer.pad_token_id for t in tokens[L:])
        assert (out["rollout_log_probs"][row, L:] == 0).all()
        assert (out["rollout_log_probs"][row, :L] < 0).all()
    assert torch.equal(out["attention_mask"][:, P:], mask)


def test_logprobs_agree_with_recomputation(model, tiny_tokenizer):
    engine = HFRolloutEngine(model, eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    out = engine.generate(prompt_batch(tiny_tokenizer, TEXTS), SamplingParams(n=2, max_new_tokens=10, temperature=0.7,
                                                                              seed=3))
    R = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits[:, -R - 1 : -1]
    recomputed = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, out["responses"][..., None]).squeeze(-1)
    diff = ((recomputed - out["rollout_log_probs"]) * out["response_mask"]).abs().max().item()
    assert diff < 1e-5, diff


def test_seeded_sampling_is_reproducible(model, tiny_tokenizer):
    engine = HFRolloutEngine(model, eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    prompts = prompt_batch(tiny_tokenizer, TEXTS)
    a = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=11))
    b = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=11))
    c = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=12))
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])


def test_greedy_matches_transformers_generate(model, tiny_tokenizer):
    engine = HFRolloutEngine(model, eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    prompts = prompt_batch(tiny_tokenizer, TEXTS)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=8, do_sample=False))
    ref = model.generate(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"], do_sample=False,
                         max_new_tokens=8, min_new_tokens=8, eos_token_id=None, pad_token_id=tiny_tokenizer.pad_token_id)
    got = out["responses"]
    for row in range(len(TEXTS)):
        L = int(out["response_mask"][row].sum())
        assert got[row, :L].tolist() == ref[row, prompts["input_ids"].shape[1]:][:L].tolist()


def test_load_weights_changes_outputs_and_sleep_wake(model, tiny_tokenizer):
    engine = make_engine("hf", model=model, eos_token_id=tiny_tokenizer.eos_token_id,
                         pad_token_id=tiny_tokenizer.pad_token_id)
    prompts = prompt_batch(tiny_tokenizer, TEXTS)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    before = engine.generate(prompts, params)["responses"]
    new = {name: torch.randn_like(p) * 0.5 for name, p in model.named_parameters()}
    assert engine.load_weights(new.items()) == len(new)
    after = engine.generate(prompts, params)["responses"]
    assert not torch.equal(before, after)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, params)
    engine.wake()
    assert torch.equal(engine.generate(prompts, params)["responses"], after)


def test_load_weights_rejects_unknown_names_and_shapes(model, tiny_tokenizer):
    engine = HFRolloutEngine(model, eos_token_id=2, pad_token_id=0)
    with pytest.raises(KeyError, match="no parameter 'nope.weight'"):
        engine.load_weights([("nope.weight", torch.zeros(1))])
    name, p = next(iter(model.named_parameters()))
    with pytest.raises(ValueError, match="expects"):
        engine.load_weights([(f"module.{name}", torch.zeros(p.shape[0] + 1))])


def test_input_errors(model, tiny_tokenizer):
    engine = HFRolloutEngine(model, eos_token_id=2, pad_token_id=0)
    right_padded = Batch({"input_ids": torch.tensor([[5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])})
    with pytest.raises(ValueError, match="LEFT-padded"):
        engine.generate(right_padded, SamplingParams(max_new_tokens=2))
    with pytest.raises(KeyError, match="attention_mask"):
        engine.generate(Batch({"input_ids": torch.tensor([[5]])}), SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="unknown rollout engine 'hff'. Did you mean 'hf'"):
        make_engine("hff", model=model, eos_token_id=2, pad_token_id=0)
    with pytest.raises(ValueError, match="rollout.n"):
        SamplingParams(n=0)
