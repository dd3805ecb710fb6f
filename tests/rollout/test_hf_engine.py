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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sleep_frees_the_device_and_an_update_while_asleep_lands_on_the_device(model, tiny_tokenizer):
    """On CUDA, sleep moves the weights to pinned host buffers (device memory freed); an update while asleep writes
    straight into fresh device storage (what it does not cover comes from the host copy); wake then moves nothing.
    Generation after each path equals an engine that was never put to sleep."""
    model = model.to("cuda")
    engine = HFRolloutEngine(model, eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    prompts = prompt_batch(tiny_tokenizer, TEXTS)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    before = engine.generate(prompts, params)["responses"]
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    awake_bytes = torch.cuda.memory_allocated()
    engine.sleep()
    assert torch.cuda.memory_allocated() < awake_bytes
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    engine.wake()
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert torch.equal(engine.generate(prompts, params)["responses"], before)

    # an update while asleep: half of the tensors new (sent in fp32 from the "trainer"), the rest from the host copy
    names = [name for name, _ in model.named_parameters()]
    new = {name: torch.randn_like(reference[name]) * 0.5 for name in names[::2]}
    engine.sleep()
    assert engine.update_weights([list(new.items())]) == len(new)
    assert all(p.device.type == "cuda" for p in model.parameters())  # on the device already: wake moves nothing
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, params)
    engine.wake()
    for name, p in model.named_parameters():
        assert torch.equal(p, new[name] if name in new else reference[name]), name
    after = engine.generate(prompts, params)["responses"]
    fresh = HFRolloutEngine(model, eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    assert torch.equal(fresh.generate(prompts, params)["responses"], after)


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


def _generate_without_fast_paths(monkeypatch, engine, prompts, params):
    """The same call with transformers' own DynamicCache (concatenating) and 2-D masks rebuilt every step."""
    import hyflow.rollout.hf as hf

    with monkeypatch.context() as patch:
        patch.setattr(hf, "_preallocated_cache", lambda config, capacity: hf.DynamicCache(config=config))
        patch.setattr(hf, "decodes_with_4d_mask", lambda model: False)
        return engine.generate(prompts, params)


def _tiny_llama_family_model(kind: str, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(1)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return MistralForCausalLM(MistralConfig(**common, sliding_window=6)).eval()  # window shorter than the rows


@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral-sliding-window"])
def test_fast_decode_paths_give_identical_samples(monkeypatch, model, tiny_tokenizer, kind):
    """The preallocated KV cache, the ready-made 4-D mask and the masked writes change no number: same tokens, same
    log-probs, same lengths as transformers' DynamicCache and 2-D masks, with rows stopping early and the cache
    compacted (many stop ids), for Qwen2 (layer_types), Llama (no layer_types) and a sliding-window Mistral (which
    keeps transformers' masks)."""
    import hyflow.rollout.hf as hf

    if kind != "qwen2":
        model = _tiny_llama_family_model(kind.split("-")[0], len(tiny_tokenizer))
    assert hf.decodes_with_4d_mask(model) == (kind != "mistral-sliding-window")
    stop = list(range(0, len(tiny_tokenizer), 9))
    engine = HFRolloutEngine(model, eos_token_id=stop, pad_token_id=tiny_tokenizer.pad_token_id)
    prompts = prompt_batch(tiny_tokenizer, TEXTS)
    params = SamplingParams(n=3, max_new_tokens=16, temperature=0.9, seed=5)
    fast = engine.generate(prompts, params)
    slow = _generate_without_fast_paths(monkeypatch, engine, prompts, params)
    lengths = fast["response_mask"].sum(-1)
    assert (lengths < 16).sum() >= 3, "enough rows should stop early for the cache to be compacted"
    for key in ("responses", "response_mask", "rollout_log_probs", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(fast[key], slow[key]), key


def test_equal_length_prompts_decode_identically(monkeypatch, model, tiny_tokenizer):
    """No padding at all (transformers would drop an all-ones mask): still the same samples."""
    ids = torch.randint(3, len(tiny_tokenizer), (3, 7), generator=torch.Generator().manual_seed(0))
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    engine = HFRolloutEngine(model, eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    params = SamplingParams(n=2, max_new_tokens=9, seed=2)
    fast = engine.generate(prompts, params)
    slow = _generate_without_fast_paths(monkeypatch, engine, prompts, params)
    assert torch.equal(fast["responses"], slow["responses"])
    assert torch.equal(fast["rollout_log_probs"], slow["rollout_log_probs"])


def test_preallocated_cache_layer_grows_past_its_capacity():
    from hyflow.rollout.hf import _PreallocatedLayer

    layer = _PreallocatedLayer(capacity=3)
    keys = torch.randn(2, 2, 5, 4)
    values = torch.randn(2, 2, 5, 4)
    k, v = layer.update(keys[:, :, :2], values[:, :, :2])
    assert k.shape == (2, 2, 2, 4) and layer.get_seq_length() == 2
    for t in range(2, 5):  # the third token fills it, the next ones grow it
        k, v = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    assert torch.equal(k, keys) and torch.equal(v, values) and layer.get_seq_length() == 5
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, keys[1:]) and torch.equal(layer.values, values[1:])
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.keys, keys[[1, 1]])
