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
