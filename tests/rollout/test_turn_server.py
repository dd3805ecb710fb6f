"""The agent loop's one engine seat: `TurnServer` over a token stream, and the adapter that makes a batch decoder one.

An engine that has only `open_stream` serves every policy (barrier, eager, continuous); a batch decoder
(`decode_batch`, or only `generate(Batch)`) is wrapped by `BatchTokenStream`, which pads inside itself and decodes a
call at each `flush`.
"""

from __future__ import annotations

import pytest
import torch

from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.data.rl_dataset import collate_prompts
from hyflow.rollout.agent_server import TurnServer
from hyflow.rollout.base import SamplingParams, TokenRequest
from hyflow.rollout.batch_stream import BatchTokenStream
from hyflow.rollout.manager import AgentLoopManager


class StreamOnly:
    """An engine with the token-level protocol only (no `generate`): the hf engine's stream."""

    shares_weights = True

    def __init__(self, engine):
        self._engine = engine

    def open_stream(self, params):
        return self._engine.open_stream(params)


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from hyflow.rollout.hf import HFRolloutEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return HFRolloutEngine(model, eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)


def prompts_of(tokenizer, questions):
    items = []
    for i, q in enumerate(questions):
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
        items.append({"raw_prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"], "uid": f"u{i}"})
    return collate_prompts(items, tokenizer.pad_token_id)


def rollout_of(engine, tokenizer, batching, prompts, params):
    rollout = load_config(["actor_rollout_ref.model.path=x", "data.max_response_length=16",
                           f"actor_rollout_ref.rollout.agent.batching={batching}"]).actor_rollout_ref.rollout
    manager = AgentLoopManager(engine, tokenizer, rollout, eos_token_ids=[tokenizer.eos_token_id],
                               pad_token_id=tokenizer.pad_token_id)
    return manager.generate(prompts, params)


@pytest.mark.parametrize("batching", ["barrier", "eager", "continuous"])
def test_an_engine_with_only_a_stream_serves_every_policy(batching, hf_engine, tiny_tokenizer):
    prompts = prompts_of(tiny_tokenizer, ["What is 1 + 2?", "Name a colour."])
    params = SamplingParams(n=3, max_new_tokens=16, seed=4, calculate_log_probs=True)
    out = rollout_of(StreamOnly(hf_engine), tiny_tokenizer, batching, prompts, params)
    assert out["responses"].shape == (6, 16) and int(out["response_mask"].sum()) > 0
    assert len({tuple(row.tolist()) for row in out["responses"][:3]}) > 1, "a prompt's samples have their own seeds"
    if batching == "barrier":  # deterministic: the same samples again
        again = rollout_of(StreamOnly(hf_engine), tiny_tokenizer, batching, prompts, params)
        assert torch.equal(out["responses"], again["responses"])


def test_the_batch_adapter_pads_inside_itself_and_keeps_the_prompt_rows(hf_engine, tiny_tokenizer):
    prompts = prompts_of(tiny_tokenizer, ["What is 1 + 2?", "hello there, how are you today?"])
    params = SamplingParams(n=1, max_new_tokens=8, seed=7, calculate_log_probs=True)
    seen = []

    class Recording:
        def generate(self, batch: Batch, p: SamplingParams) -> Batch:
            seen.append((batch["input_ids"].clone(), p.n, p.seed))
            return hf_engine.generate(batch, p)

    stream = BatchTokenStream(Recording(), params, tiny_tokenizer.pad_token_id, [tiny_tokenizer.eos_token_id], prompts)
    ids = [prompts["input_ids"][r][prompts["attention_mask"][r].bool()].tolist() for r in range(2)]
    futures = [stream.submit(TokenRequest(f"r{r}.{j}", ids[r], 8, seed=7, group=("prompt", r)))
               for r in range(2) for j in range(2)]
    stream.flush()
    input_ids, n, seed = seen[0]
    assert torch.equal(input_ids, prompts["input_ids"]) and n == 2 and seed == 7  # the rows as they came, n = 2
    direct = hf_engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=7, calculate_log_probs=True))
    for row, future in enumerate(futures):
        length = int(direct["response_mask"][row].sum())
        assert future.result().token_ids == direct["responses"][row, :length].tolist()
    assert stream.step_count == 1 and stream.step_sizes == [4]
    queued = stream.submit(TokenRequest("late", ids[0], 8, seed=1))
    stream.abort(["late"])
    assert queued.result().stop_reason == "abort" and queued.result().token_ids == []


def test_the_batch_adapter_takes_the_decoders_outputs_and_builds_no_rollout_batch(hf_engine, tiny_tokenizer):
    """An engine with `decode_batch` is called there, never through `generate(Batch)` (whose rollout Batch the adapter
    would read back into lists), and its outputs are the rows `generate` gives for the same call."""
    prompts = prompts_of(tiny_tokenizer, ["What is 1 + 2?", "hello there, how are you today?"])
    params = SamplingParams(n=1, max_new_tokens=8, seed=3, calculate_log_probs=True)
    calls = []

    class Decoder:
        pad_token_id = tiny_tokenizer.pad_token_id

        def decode_batch(self, batch, p, budgets):
            calls.append(budgets.tolist())
            return hf_engine.decode_batch(batch, p, budgets)

        def generate(self, batch, p):
            raise AssertionError("the adapter asked for a rollout Batch")

    stream = BatchTokenStream(Decoder(), params, tiny_tokenizer.pad_token_id, [tiny_tokenizer.eos_token_id], prompts)
    ids = [prompts["input_ids"][r][prompts["attention_mask"][r].bool()].tolist() for r in range(2)]
    futures = [stream.submit(TokenRequest(f"r{r}", ids[r], budget, seed=3, group=("turn", r)))
               for r, budget in enumerate((8, 5))]
    stream.flush()
    assert calls == [[8, 5]]
    batch = Batch({"input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"],
                   "max_new_tokens": torch.tensor([8, 5])})
    direct = hf_engine.generate(batch, params)
    for row, future in enumerate(futures):
        length = int(direct["response_mask"][row].sum())
        assert future.result().token_ids == direct["responses"][row, :length].tolist()
        assert future.result().log_probs == direct["rollout_log_probs"][row, :length].tolist()
        ended = future.result().token_ids[-1] == tiny_tokenizer.eos_token_id or length < (8, 5)[row]
        assert future.result().stop_reason == ("stop" if ended else "length")


def test_an_unknown_policy_and_a_batch_only_engine_under_continuous_are_errors(hf_engine):
    params = SamplingParams(n=1, max_new_tokens=8)
    with pytest.raises(ValueError, match="batching=fast: use one of barrier, eager, continuous"):
        TurnServer(lambda: None, params, [0], policy="fast")

    class BatchOnly:
        def generate(self, batch, p):
            return hf_engine.generate(batch, p)

    with pytest.raises(ValueError, match="needs an engine with a token stream"):
        TurnServer.over(BatchOnly(), params, [0], policy="continuous", pad_token_id=0)
