"""The hf engine behind the token-level protocol (`open_stream`, `generate_requests`): per-request seeds, padding
inside the engine, abort with the tokens so far, close, errors; `rollout.agent.batching=continuous` and the
abort/resume partial rollouts of the asynchronous stream on the hf engine (vLLM's counterparts:
tests/rollout/test_vllm_continuous.py, in .venv-vllm)."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from test_agent_loop import make_prompts, manager

from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.models.forward import response_logprobs
from hyflow.models.loading import load_causal_lm
from hyflow.rollout.base import SamplingParams, TokenRequest
from hyflow.rollout.hf import HFRolloutEngine

R = 24


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir), dtype="float32")


def make_engine(model, tok) -> HFRolloutEngine:
    return HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def sampling(**kw) -> SamplingParams:
    return SamplingParams(**{"n": 1, "max_new_tokens": R, "temperature": 0.9, "calculate_log_probs": True, **kw})


def prompt_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_request_alone_is_the_engine_generate_of_its_prompt(model, tiny_tokenizer):
    """Same prompt, same seed: the stream's output is exactly `generate`'s (the same arithmetic: one row, one
    generator drawing the same uniforms), and its stop reason says why it ended."""
    tok = tiny_tokenizer
    engine = make_engine(model, tok)
    ids = prompt_ids(tok, "What is 1 + 2?")
    whole = engine.generate(Batch({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                                                                                                    dtype=torch.long)}),
                            sampling(seed=11))
    length = int(whole["response_mask"].sum())
    stream = engine.open_stream(sampling())
    try:
        out = stream.submit(TokenRequest("a", ids, R, seed=11)).result(timeout=60)
    finally:
        stream.close()
    assert out.token_ids == whole["responses"][0, :length].tolist()
    assert out.log_probs == whole["rollout_log_probs"][0, :length].tolist()
    assert out.stop_reason == ("stop" if out.token_ids[-1] == tok.eos_token_id else "length")
    assert stream.step_count == 1 and stream.step_sizes == [1]


def test_each_request_samples_with_its_own_seed_wherever_it_sits_in_the_batch(model, tiny_tokenizer):
    tok = tiny_tokenizer
    engine = make_engine(model, tok)
    a, b = prompt_ids(tok, "Name a colour."), prompt_ids(tok, "Name a fruit.")
    assert len(a) == len(b)  # no padding: the two orders are the same arithmetic, row by row
    first = engine.generate_requests([TokenRequest("a", a, R, 1), TokenRequest("b", b, R, 2)], sampling())
    swapped = engine.generate_requests([TokenRequest("b", b, R, 2), TokenRequest("a", a, R, 1)], sampling())
    for x, y in ((first[0], swapped[1]), (first[1], swapped[0])):  # a row's position rounds only the last bits
        assert x.token_ids == y.token_ids and x.stop_reason == y.stop_reason
        assert max(abs(p - q) for p, q in zip(x.log_probs, y.log_probs)) < 1e-5
    again = engine.generate_requests([TokenRequest("a", a, R, 2), TokenRequest("b", b, R, 1)], sampling())
    assert again[0].token_ids != first[0].token_ids  # the seed, not the position, decides
    # prompts of different lengths are left-padded inside the engine; each output's log-probs are the model's
    c = prompt_ids(tok, "Tell me about the weather on a long day.")
    outs = engine.generate_requests([TokenRequest("a", a, 7, 1), TokenRequest("c", c, R, 3)], sampling())
    assert len(outs[0].token_ids) <= 7 and outs[0].stop_reason in ("stop", "length")
    for ids, out in ((a, outs[0]), (c, outs[1])):
        full = torch.tensor([ids + out.token_ids])
        logp, _ = response_logprobs(model, full, torch.ones_like(full), torch.arange(full.shape[1])[None],
                                    len(out.token_ids), temperature=0.9)
        assert (logp[0] - torch.tensor(out.log_probs)).abs().max().item() < 1e-5


def test_an_aborted_request_keeps_the_tokens_it_had(model, tiny_tokenizer):
    """The stream's `abort` reaches the engine at its next decoding step (here held at step 3 until the test
    aborted): the request returns its first 3 tokens, exactly those of its full run, stop reason "abort"."""
    tok = tiny_tokenizer
    engine = make_engine(model, tok)
    ids = prompt_ids(tok, "Count to ten.")
    full = engine.generate_requests([TokenRequest("x", ids, R, 7)], sampling(), aborted=None)[0]
    assert len(full.token_ids) > 3, "the premise: the full run is longer than the cut"
    real, asked, held = engine.generate_requests, [], threading.Event()

    def gated(requests, params, aborted=None, **kw):
        def ask():
            asked.append(1)
            if len(asked) == 4:  # before step 3: wait until the test has aborted
                held.set()
                time.sleep(0.2)
            return aborted()

        return real(requests, params, aborted=ask, **kw)

    engine.generate_requests = gated
    for end in ("abort", "close"):  # `close` ends the batch decoding now the same way
        asked.clear()
        held.clear()
        stream = engine.open_stream(sampling())
        try:
            future = stream.submit(TokenRequest("x", ids, R, 7))
            assert held.wait(60)
            stream.abort(["x"]) if end == "abort" else stream.close()
            out = future.result(timeout=60)
        finally:
            stream.close()
        assert out.stop_reason == "abort" and out.token_ids == full.token_ids[:3], end
        assert out.log_probs == full.log_probs[:3]


def test_close_ends_queued_requests_and_refuses_new_ones_and_an_engine_error_reaches_each(model, tiny_tokenizer):
    tok = tiny_tokenizer
    engine = make_engine(model, tok)
    stream = engine.open_stream(sampling())
    stream.close()
    with pytest.raises(RuntimeError, match="the hf token stream is closed"):
        stream.submit(TokenRequest("late", [1, 2, 3], R)).result(timeout=10)

    broken = make_engine(model, tok)

    def fail(requests, params, **kw):
        raise RuntimeError("the engine broke")

    broken.generate_requests = fail
    stream = broken.open_stream(sampling())
    try:
        futures = [stream.submit(TokenRequest(f"r{i}", [1, 2, 3], R)) for i in range(3)]
        for future in futures:
            with pytest.raises(RuntimeError, match="the engine broke"):
                future.result(timeout=60)
        with pytest.raises(RuntimeError, match="the engine broke"):  # and anything after it
            stream.submit(TokenRequest("next", [1, 2, 3], R)).result(timeout=10)
    finally:
        stream.close()
    with pytest.raises(ValueError, match="one sample per request"):
        engine.open_stream(sampling(n=2))
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep; call wake"):
        engine.open_stream(sampling())
    engine.wake()


def rollout(*overrides):
    return load_config(["actor_rollout_ref.model.path=x", f"data.max_response_length={R}",
                        "actor_rollout_ref.rollout.agent.batching=continuous", *overrides]).actor_rollout_ref.rollout


def test_continuous_batching_on_the_hf_engine(model, tiny_tokenizer):
    """A synchronous rollout with batching=continuous on the hf engine: every request through the stream, each
    sample's log-probs the trainer's recompute, first turns seeded seed + trajectory (as with vllm)."""
    tok = tiny_tokenizer
    engine = make_engine(model, tok)
    real, seen = engine.generate_requests, []

    def recorded(requests, params, **kw):
        seen.extend(requests)
        return real(requests, params, **kw)

    engine.generate_requests = recorded
    prompts = make_prompts(tok, ["What is 1 + 2?", "Name a colour."], agent="single_turn_agent")
    out = manager(engine, tok, rollout()).generate(prompts, sampling(n=2, seed=5))
    assert len(out) == 4 and "rollout_versions" not in out and "async/rollout_tokens" not in out.meta["metrics"]
    assert out.meta["metrics"]["agent_loop/engine_calls"] >= 1
    mask = out["response_mask"].bool()
    logp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], R,
                                temperature=0.9)
    assert (logp - out["rollout_log_probs"])[mask].abs().max().item() < 1e-5
    # sample j of prompt p is trajectory i = 2p + j: its first turn is request t<i>.0.0, seeded 5 + i (as with vllm)
    assert sorted((r.request_id, r.seed) for r in seen) == [(f"t{i}.0.0", 5 + i) for i in range(4)]


@pytest.mark.slow
def test_fully_async_stream_aborts_and_resumes_on_the_hf_engine(model, tiny_tokenizer):
    """fully_async + batching=continuous on the hf engine: `advance` returns once the short prompt is done and
    aborts the long one's samples mid-answer; after new weights the next `advance` resumes them. Every token's
    version says which weights sampled it, and its log-prob equals the trainer's recompute under those weights."""
    from hyflow.rollout.stream import RolloutStream

    budgeted = _budgeted_loop()
    tok = tiny_tokenizer
    v0, v1 = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy = copy.deepcopy(v0)
    # 20 ms more per forward: the long samples still decode when the event loop aborts them
    policy.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    engine = make_engine(policy, tok)
    long_budget = 200
    prompts = make_prompts(tok, ["Count to ten.", "Tell me a long story."], agent=budgeted,
                           budget=[4, long_budget])
    params = SamplingParams(n=2, max_new_tokens=long_budget, seed=5, temperature=0.9, calculate_log_probs=True)
    loops = manager(engine, tok, rollout(f"data.max_response_length={long_budget}",
                                         "actor_rollout_ref.rollout.multi_turn.enable=true"))
    stream = RolloutStream(loops, params, prompt_width=64)
    try:
        stream.submit(prompts, [10, 11])
        first = stream.advance(need=1)
        assert first["async_tag"].tolist() == [10, 10] and stream.in_flight() == [11]
        policy.load_state_dict(v1.state_dict())  # the stream is closed: the engine is idle
        stream.set_version(1)
        out = stream.advance(need=1)
    finally:
        stream.close()
    assert out["async_tag"].tolist() == [11, 11]
    assert out.meta["metrics"]["async/continued_segments"] >= 1  # a long sample was aborted and resumed
    mask = out["response_mask"].bool()
    versions = out["rollout_versions"]
    for row in range(2):
        got = versions[row][mask[row]].tolist()
        cut = got.index(1) if 1 in got else len(got)
        assert got == [0] * cut + [1] * (len(got) - cut), got
    assert bool((versions[mask] == 1).any())
    logp = {v: response_logprobs(m, out["input_ids"], out["attention_mask"], out["position_ids"], long_budget,
                                 temperature=0.9)[0] for v, m in ((0, v0), (1, v1))}
    for v in (0, 1):
        where = mask & (versions == v)
        if bool(where.any()):
            diff = (logp[v] - out["rollout_log_probs"])[where].abs().max().item()
            assert diff < 1e-5, (v, diff)
    newer = mask & (versions == 1)  # the new weights really differ on the resumed tokens
    assert (logp[0] - out["rollout_log_probs"])[newer].abs().max().item() > 1e-3


def _budgeted_loop() -> str:
    """A single-turn loop whose row says its budget (`budget`): requests of one batch that finish far apart."""
    from hyflow.rollout.agent_loop import AGENT_LOOPS, SingleTurnAgentLoop, register

    name = "test_hf_budgeted_agent"
    if name not in AGENT_LOOPS:
        @register(name)
        class Budgeted(SingleTurnAgentLoop):
            async def run(self, sampling_params, **row):
                return await super().run({**sampling_params, "max_tokens": int(row["budget"])}, **row)
    return name
