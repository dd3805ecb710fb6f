"""The rollout stream of asynchronous training: trajectories that outlive one call, decoded in segments, with
the policy version and log-prob of every token across a weight update (a partial rollout)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_agent_loop import ScriptedEngine, calculator_script, make_prompts, manager, rollout_config

from hyflow.config import load_config
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.stream import RolloutStream, left_pad_prompts

R = 16


def hf_stream(model, tok, chunk, n=2, seed=5, temperature=1.0):
    from hyflow.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rollout = load_config(["actor_rollout_ref.model.path=x", f"data.max_response_length={R}"]).actor_rollout_ref.rollout
    params = SamplingParams(n=n, max_new_tokens=R, seed=seed, temperature=temperature, calculate_log_probs=True)
    return RolloutStream(manager(engine, tok, rollout), params, chunk_tokens=chunk, prompt_width=64), engine


def test_partial_rollout_tokens_carry_their_version_and_its_log_probs(tiny_model_dir, tiny_tokenizer):
    """Two engine calls of 5 tokens under version 0, new weights, the rest under version 1: each token's version
    says which weights sampled it, and its rollout log-prob equals the trainer's recompute under those weights."""
    from transformers import AutoModelForCausalLM

    from hyflow.models.forward import response_logprobs

    tok = tiny_tokenizer
    torch.manual_seed(0)
    v0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    v1 = copy.deepcopy(v0)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stream, engine = hf_stream(copy.deepcopy(v0), tok, chunk=5, temperature=0.9)
    prompts = make_prompts(tok, ["What is 1 + 2?", "Name a colour."], agent="single_turn_agent")
    stream.submit(prompts, [10, 11])
    assert stream.advance(need=2, max_calls=2) is None  # 10 tokens each, nothing finished
    assert stream.in_flight() == [10, 11]
    engine.load_weights(v1.named_parameters())  # the trainer's update reaches the rollout between two segments
    stream.set_version(1)
    out = stream.advance(need=2)
    assert out is not None and len(out) == 4 and out["async_tag"].tolist() == [10, 10, 11, 11]
    assert out["async_admitted_version"].tolist() == [0] * 4
    mask = out["response_mask"].bool()
    versions = out["rollout_versions"]
    assert (versions[~mask] == -1).all()
    lengths = mask.sum(-1).tolist()
    for row, length in enumerate(lengths):
        expected = [0] * min(length, 10) + [1] * max(0, length - 10)
        assert versions[row, :length].tolist() == expected
    assert any(length > 10 for length in lengths), "some sample must span the update"
    with torch.no_grad():
        logp = {v: response_logprobs(m, out["input_ids"], out["attention_mask"], out["position_ids"], R,
                                     temperature=0.9)[0] for v, m in ((0, v0), (1, v1))}
    for v in (0, 1):
        where = mask & (versions == v)
        diff = (logp[v] - out["rollout_log_probs"])[where].abs().max().item()
        assert diff < 1e-5, (v, diff)
    other = mask & (versions == 1)  # the new weights really differ on those tokens
    assert (logp[0] - out["rollout_log_probs"])[other].abs().max().item() > 1e-3
    stream.close()


class ContinuingEngine(ScriptedEngine):
    """The scripted engine, continued: a prompt that ends inside an assistant turn (a resumed segment) gets the
    rest of the reply to the conversation before that turn, as a language model continues its own text."""

    def generate(self, prompts, params):
        from hyflow.batch import Batch
        from hyflow.rollout.output import assemble_rollout, prompt_budgets

        self.calls.append(len(prompts) * params.n)
        header = self.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        rows, lengths = [], []
        for ids, mask, budget in zip(prompts["input_ids"], prompts["attention_mask"],
                                     prompt_budgets(prompts, params).tolist()):
            ids = ids[mask.bool()].tolist()
            start = max(i for i in range(len(ids) - len(header) + 1) if ids[i : i + len(header)] == header)
            head, partial = ids[: start + len(header)], ids[start + len(header):]
            text = self.tokenizer.decode(head, skip_special_tokens=False)
            reply = [*self.tokenizer(self.reply(text), add_special_tokens=False)["input_ids"],
                     self.tokenizer.eos_token_id]
            assert reply[: len(partial)] == partial, "a segment must continue its own reply"
            rest = reply[len(partial):][:budget]
            rows += [rest] * params.n
            lengths += [len(rest)] * params.n
        responses = torch.full((len(rows), params.max_new_tokens), self.tokenizer.pad_token_id)
        for i, row in enumerate(rows):
            responses[i, : len(row)] = torch.tensor(row)
        return assemble_rollout(Batch(dict(prompts.tensors.items())), prompts["input_ids"], prompts["attention_mask"],
                                responses, torch.full(responses.shape, -0.5), torch.tensor(lengths), params)


def test_segments_are_invisible_to_the_agent_loop(tmp_path, tiny_tokenizer):
    """A tool trajectory decoded 3 tokens per engine call gives the same tokens, masks and tool turns as the
    one-call agent loop (the engine continues its own reply, as a language model does)."""
    tok = tiny_tokenizer
    rollout = rollout_config(tmp_path)
    prompts = make_prompts(tok, ["What is 2 + 3 * 4?", "Add"])
    params = SamplingParams(n=2, max_new_tokens=400, seed=3, calculate_log_probs=True)
    whole = manager(ContinuingEngine(tok, calculator_script), tok, rollout).generate(prompts, params)
    engine = ContinuingEngine(tok, calculator_script)
    stream = RolloutStream(manager(engine, tok, rollout), params, chunk_tokens=3, prompt_width=whole["prompts"].shape[1])
    stream.submit(prompts, [0, 1])
    out = stream.advance(need=2)
    for key in ("responses", "response_mask", "attention_mask", "prompts"):
        assert torch.equal(out[key], whole[key]), key
    assert max(engine.calls) <= 4 and len(engine.calls) > 10  # many short calls
    assert out.meta["metrics"]["async/continued_segments"] > 0
    assert (out["rollout_versions"][out["response_mask"].bool()] == 0).all()
    stream.close()


def test_advance_returns_prompts_in_admission_order_and_reset_drops_the_rest(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    stream, _ = hf_stream(model, tok, chunk=R, n=1)
    stream.submit(make_prompts(tok, ["a", "b"], agent="single_turn_agent"), [3, 4])
    stream.submit(make_prompts(tok, ["c"], agent="single_turn_agent"), [5])
    out = stream.advance(need=3)
    assert out["async_tag"].tolist() == [3, 4, 5]
    stream.submit(make_prompts(tok, ["d"], agent="single_turn_agent"), [6])
    with pytest.raises(ValueError, match="already in flight"):
        stream.submit(make_prompts(tok, ["d"], agent="single_turn_agent"), [6])
    assert stream.reset() == [6] and stream.in_flight() == []
    stream.close()


def test_left_pad_prompts_widens_and_refuses_wider(tiny_tokenizer):
    prompts = make_prompts(tiny_tokenizer, ["What is 1 + 2?"], agent="single_turn_agent")
    width = prompts["input_ids"].shape[1]
    wide = left_pad_prompts(prompts, width + 3, tiny_tokenizer.pad_token_id)
    assert wide["input_ids"].shape[1] == width + 3 and wide["attention_mask"][0, :3].sum() == 0
    assert wide["position_ids"][0, -1] == width - 1
    with pytest.raises(ValueError, match="prompt width"):
        left_pad_prompts(prompts, width - 1, tiny_tokenizer.pad_token_id)


class _FakeTokenStream:
    """A token stream (the `open_stream` protocol) whose requests of trajectories 2 and 3 run until aborted (they
    then return 3 tokens, "abort"); every other request finishes at once with 4 tokens."""

    def __init__(self, log):
        self.log, self.pending = log, {}
        self.step_count, self.seconds, self.step_sizes = 0, 0.0, []

    def submit(self, request):
        import concurrent.futures

        from hyflow.rollout.base import TokenOutput

        self.log.append(request)
        future = concurrent.futures.Future()
        if request.request_id.split(".")[0] in ("t2", "t3") and request.request_id.endswith(".0"):
            self.pending[request.request_id] = future
        else:
            count = min(4, request.max_tokens)
            future.set_result(TokenOutput([7] * count, [-0.25] * count, "length"))
        self.step_count += 1
        return future

    def abort(self, ids):
        from hyflow.rollout.base import TokenOutput

        for request_id in ids:
            self.pending.pop(request_id).set_result(TokenOutput([5, 5, 5], [-0.5] * 3, "abort"))

    def close(self):
        self.log.append("close")


class _FakeStreamEngine:
    def __init__(self):
        self.log = []

    def open_stream(self, params):
        return _FakeTokenStream(self.log)


def test_continuous_stream_pauses_with_the_tokens_so_far_and_resumes_them_as_the_next_segment(tmp_path,
                                                                                                tiny_tokenizer):
    """The abort/resume stream (`batching=continuous`), engine-free: `advance` returns the finished prompt and
    aborts the running requests (their 3 tokens kept, the stream closed); the next `advance` resubmits each with its
    tokens appended to its prompt, what is left of its budget and the next segment's seed, and its tokens carry the
    version that sampled them. An engine without a token stream is refused by name."""
    from hyflow.rollout.agent_server import SEED_STRIDE
    from hyflow.rollout.stream import SEGMENT_STRIDE

    tok = tiny_tokenizer
    engine = _FakeStreamEngine()
    rollout = rollout_config(tmp_path, "actor_rollout_ref.rollout.agent.batching=continuous", tools=False)
    stream = RolloutStream(manager(engine, tok, rollout), SamplingParams(n=2, max_new_tokens=R, seed=5,
                                                                        calculate_log_probs=True),
                           chunk_tokens=R, prompt_width=64)
    stream.submit(make_prompts(tok, ["q one", "q two"], agent="single_turn_agent"), [10, 11])
    first = stream.advance(need=1)
    assert first["async_tag"].tolist() == [10, 10] and stream.in_flight() == [11]
    assert engine.log[-1] == "close"  # paused: the engine's stream is closed, the engine idle for a push
    stream.set_version(1)
    out = stream.advance(need=1)
    stream.close()
    assert out["async_tag"].tolist() == [11, 11] and out.meta["metrics"]["async/continued_segments"] == 2
    requests = {r.request_id: r for r in engine.log if r != "close"}
    for index in (2, 3):
        head, resumed = requests[f"t{index}.0.0"], requests[f"t{index}.0.1"]
        assert resumed.prompt_ids == [*head.prompt_ids, 5, 5, 5] and resumed.max_tokens == head.max_tokens - 3
        assert head.seed == 5 + index and resumed.seed == 5 + index + SEGMENT_STRIDE != 5 + index + SEED_STRIDE
    mask = out["response_mask"].bool()
    for row in range(2):
        assert out["responses"][row][mask[row]].tolist() == [5, 5, 5, 7, 7, 7, 7]
        assert out["rollout_versions"][row][mask[row]].tolist() == [0, 0, 0, 1, 1, 1, 1]
        assert out["rollout_log_probs"][row][mask[row]].tolist() == [-0.5] * 3 + [-0.25] * 4
    with pytest.raises(ValueError, match=r"batching=continuous needs an engine with a token stream"):
        RolloutStream(manager(object(), tok, rollout), SamplingParams(n=1, max_new_tokens=R), chunk_tokens=R,
                      prompt_width=64)
