"""openai_agent: an agent written against the real `openai` client trains unchanged through hyflow's endpoint.

The policy is the scripted engine of test_agent_loop.py (the reply is a function of the conversation), so every
token of a trajectory is checked: a conversation continued by the agent becomes the same response a tool agent
would produce (model tokens in the loss, the tool turn masked out). The agents run in processes of their own, so
what they saw comes back in their return (extras land in extra_info), not in a module-level list.
Hostile agents and requests: test_openai_agent_hostile.py."""

from __future__ import annotations

import pytest
import torch
from test_agent_loop import (
    AGENT_LOOPS,
    ScriptedEngine,
    calculator_script,
    call,
    make_prompts,
    manager,
    params,
    rollout_config,
    segments,
)

from hyflow.rollout.agent_loop import AGENT_LOOP_KWARGS

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]
AGENT = '''
import json

TOOLS = {tools}


async def calculator_agent(client, sample):
    messages = list(sample["raw_prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for tool_call in message.tool_calls or []:
        expression = json.loads(tool_call.function.arguments)["expression"]
        messages.append({{"role": "tool", "tool_call_id": tool_call.id, "content": str(eval(expression))}})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    answer = second.choices[0].message.content
    return {{"score": float(answer.strip() == "#### 14"), "answer": answer, "finish": first.choices[0].finish_reason}}


async def hot(client, sample):
    try:
        await client.chat.completions.create(model="policy", messages=sample["raw_prompt"], temperature=0.3)
        seen = "accepted"
    except Exception as err:
        seen = str(err)
    await client.chat.completions.create(model="policy", messages=sample["raw_prompt"])
    return {{"score": 0.5, "seen": seen}}


async def breaks(client, sample):
    await client.chat.completions.create(model="policy", messages=sample["raw_prompt"])
    raise KeyError("the agent broke")


async def silent(client, sample):
    return 1.0


async def plain(client, sample):
    models = await client.models.list()
    out = await client.completions.create(model="policy", prompt="2 + 3 * 4 =")
    return {{"score": 1.0, "models": [m.id for m in models.data], "text": out.choices[0].text}}
'''


@pytest.fixture
def agent_file(tmp_path, monkeypatch):
    (tmp_path / "my_agents.py").write_text(AGENT.format(tools=repr(TOOLS)))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    sys.modules.pop("my_agents", None)
    return importlib.import_module("my_agents")


def rollout(tmp_path, function, sample="concat"):
    (tmp_path / "loops.yaml").write_text(f"- name: my_agent\n  _target_: hyflow.rollout.openai_agent.OpenAIAgentLoop\n"
                                         f"  run: my_agents.{function}\n  sample: {sample}\n")
    return rollout_config(tmp_path, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/loops.yaml",
                          tools=False)


def run_agent(tmp_path, tok, function, sample="concat", engine_script=calculator_script, questions=("What is 2 + 3 * 4?",)):
    engine = ScriptedEngine(tok, engine_script)
    try:
        return manager(engine, tok, rollout(tmp_path, function, sample)).generate(
            make_prompts(tok, list(questions), agent="my_agent"), params(n=2))
    finally:
        AGENT_LOOPS.pop("my_agent", None)
        AGENT_LOOP_KWARGS.pop("my_agent", None)


def test_an_openai_client_agent_trains_token_in_token_out(tmp_path, tiny_tokenizer, agent_file):
    tok = tiny_tokenizer
    out = run_agent(tmp_path, tok, "calculator_agent")
    # the hermes call came back as OpenAI tool_calls
    assert [info["finish"] for info in out["extra_info"]] == ["tool_calls", "tool_calls"]
    for row in range(2):
        # the whole conversation, as the tool agent would have produced it: the engine's tokens, the tool turn
        # rendered by the template and masked out, the answer
        assert segments(tok, out, row) == [
            (1, call("2 + 3 * 4") + "<|im_end|>"),
            (0, "\n<|im_start|>tool\n14<|im_end|>\n<|im_start|>assistant\n"),
            (1, "#### 14<|im_end|>"),
        ]
        prompt = tok.decode(out["prompts"][row][out["attention_mask"][row, : out["prompts"].shape[1]].bool()])
        assert "calculator" in prompt and prompt.endswith("What is 2 + 3 * 4?<|im_end|>\n<|im_start|>assistant\n")
        info = out["extra_info"][row]
        assert info["answer"] == "#### 14" and "agent_error" not in info
    assert list(out["agent_reward"]) == [1.0, 1.0]  # the function's score, no reward function
    mask = out["response_mask"].bool()
    assert (out["rollout_log_probs"][mask] == -0.5).all() and (out["rollout_log_probs"][~mask] == 0).all()
    metrics = out.meta["metrics"]
    assert metrics["agent_loop/engine_batch/max"] == 2.0  # both trajectories' turns decoded together
    # the agent ran its tool itself: no hyflow tool metrics (they would say 0 calls), the endpoint's instead
    assert "tool/samples_with_call" not in metrics and metrics["openai/requests/mean"] == 2.0


def test_the_engine_samples_from_the_prompt_the_agent_sent(tmp_path, tiny_tokenizer, agent_file):
    """The agent renders its own first prompt (here with the calculator's schema, which the row's prompt lacks):
    the engine must decode that prompt, not the row's padded one (found by make demo-openai: the SFT model, shown
    the row's prompt without its tools, never called the calculator)."""
    def script(text):  # calls the tool only when it sees the schema before the question
        return calculator_script(text) if "calculator" in text.split("<|im_start|>user")[0] else "#### 0"

    out = run_agent(tmp_path, tiny_tokenizer, "calculator_agent", engine_script=script)
    assert [info["finish"] for info in out["extra_info"]] == ["tool_calls", "tool_calls"]
    assert list(out["agent_reward"]) == [1.0, 1.0]


def test_the_last_turn_alone_as_the_sample(tmp_path, tiny_tokenizer, agent_file):
    tok = tiny_tokenizer
    out = run_agent(tmp_path, tok, "calculator_agent", sample="last")
    assert segments(tok, out, 0) == [(1, "#### 14<|im_end|>")]
    prompt = tok.decode(out["prompts"][0][out["attention_mask"][0, : out["prompts"].shape[1]].bool()])
    assert prompt.endswith("<|im_start|>tool\n14<|im_end|>\n<|im_start|>assistant\n")


def test_requests_that_would_sample_differently_are_refused_by_name(tmp_path, tiny_tokenizer, agent_file):
    tok = tiny_tokenizer
    out = run_agent(tmp_path, tok, "hot", engine_script=lambda text: "#### 1")
    for info in out["extra_info"]:
        assert "temperature=0.3: the policy samples with the rollout's temperature=1.0" in info["seen"]
    assert list(out["agent_reward"]) == [0.5, 0.5]


def test_an_agent_that_raises_keeps_its_tokens_and_scores_zero(tmp_path, tiny_tokenizer, agent_file):
    tok = tiny_tokenizer
    out = run_agent(tmp_path, tok, "breaks", engine_script=lambda text: "#### 1")
    assert [info["agent_error"] for info in out["extra_info"]] == ["KeyError: 'the agent broke'"] * 2
    assert list(out["agent_reward"]) == [0.0, 0.0] and int(out["response_mask"].sum()) > 0
    assert out.meta["metrics"]["openai/errors/mean"] == 1.0


def test_an_agent_that_never_asks_the_policy_costs_its_sample(tmp_path, tiny_tokenizer, agent_file):
    """Nothing of the policy's to train on: an empty response (mask 0) on the row's prompt, scored 0 whatever the
    function returned, named and counted as the sample's agent error."""
    out = run_agent(tmp_path, tiny_tokenizer, "silent")
    assert list(out["agent_reward"]) == [0.0, 0.0] and int(out["response_mask"].sum()) == 0
    assert all("without an answer of the policy" in info["agent_error"] for info in out["extra_info"])
    assert out.meta["metrics"]["openai/errors/mean"] == 1.0


def test_completions_and_models_and_the_loopback_binding(tmp_path, tiny_tokenizer, agent_file):
    tok = tiny_tokenizer
    out = run_agent(tmp_path, tok, "plain", engine_script=lambda text: " 14")
    assert [(info["models"], info["text"]) for info in out["extra_info"]] == [(["hyflow-policy"], " 14")] * 2
    assert segments(tok, out, 0) == [(1, " 14<|im_end|>")]
    prompt = tok.decode(out["prompts"][0][out["attention_mask"][0, : out["prompts"].shape[1]].bool()])
    assert prompt == "2 + 3 * 4 ="  # a completion's prompt is the text as sent


def test_the_endpoint_listens_on_loopback_only(tiny_tokenizer):
    import asyncio

    from hyflow.rollout.openai_agent import OpenAIEndpoint

    async def addresses():
        endpoint = OpenAIEndpoint(tiny_tokenizer, temperature=1.0, top_p=1.0, tool_format="hermes")
        await endpoint.start()
        try:
            found = [sock.getsockname() for server in endpoint._runner.sites for sock in server._server.sockets]
        finally:
            await endpoint.stop()
        return found

    found = asyncio.run(addresses())
    assert found and all(host == "127.0.0.1" for host, *_ in found)


ASK_TWICE = '''
async def ask_twice(client, sample):
    messages = list(sample["raw_prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": "Say it again, shorter."})
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
    return 1.0
'''


def test_with_the_real_hf_engine_the_log_probs_equal_the_trainers_recompute(tiny_model_dir, tiny_tokenizer,
                                                                            tmp_path, monkeypatch):
    """The tiny model through the real engine: an agent asks, appends a user turn, asks again; the rollout's
    log-probs on the model's tokens equal the trainer's recompute of the whole conversation, in float32."""
    from transformers import AutoModelForCausalLM

    from hyflow.models.forward import response_logprobs
    from hyflow.rollout.base import SamplingParams
    from hyflow.rollout.hf import HFRolloutEngine

    (tmp_path / "twice.py").write_text(ASK_TWICE)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "loops.yaml").write_text("- name: twice\n  _target_: hyflow.rollout.openai_agent.OpenAIAgentLoop\n"
                                         "  run: twice.ask_twice\n")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = tiny_tokenizer
    engine = HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rollout = rollout_config(tmp_path, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/loops.yaml",
                             "data.max_response_length=48", tools=False)
    p = SamplingParams(n=2, max_new_tokens=48, seed=5, temperature=1.0, calculate_log_probs=True,
                       stop_token_ids=tuple(range(3, 300, 5)))
    try:
        out = manager(engine, tok, rollout).generate(make_prompts(tok, ["What is 1 + 2?", "Name a colour."],
                                                                  agent="twice"), p)
    finally:
        AGENT_LOOPS.pop("twice", None)
        AGENT_LOOP_KWARGS.pop("twice", None)
    mask = out["response_mask"].bool()
    assert (out["attention_mask"][:, -48:].bool() & ~mask).any(), "the user turn sits between the two answers"
    with torch.no_grad():
        logp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], 48,
                                    temperature=1.0)
    diff = (logp - out["rollout_log_probs"])[mask].abs().max().item()
    assert diff < 1e-5, diff


def test_an_openai_client_agent_in_the_asynchronous_rollout_stream(tmp_path, tiny_tokenizer, agent_file):
    """async_training's rollout stream (fully_async / one_step_off) starts the loop's endpoint on its first
    trajectory, keeps it across advances, and stops it on close; before, every openai_agent trajectory failed
    there ("runs inside AgentLoopManager.generate, which starts its endpoint")."""
    from hyflow.rollout.stream import RolloutStream

    tok = tiny_tokenizer
    try:
        loops = manager(ScriptedEngine(tok, calculator_script), tok, rollout(tmp_path, "calculator_agent"))
        stream = RolloutStream(loops, params(n=2), chunk_tokens=10_000, prompt_width=256)  # no segments
        stream.submit(make_prompts(tok, ["What is 2 + 3 * 4?"], agent="my_agent"), [0])
        first = stream.advance(need=1)
        stream.submit(make_prompts(tok, ["What is 2 + 3 * 4?"], agent="my_agent"), [1])
        second = stream.advance(need=1)
        endpoint = next(iter(stream._loop_kwargs.values()))["openai_endpoint"]
        stream.close()
    finally:
        AGENT_LOOPS.pop("my_agent", None)
        AGENT_LOOP_KWARGS.pop("my_agent", None)
    for out in (first, second):
        assert list(out["agent_reward"]) == [1.0, 1.0] and all("agent_error" not in i for i in out["extra_info"])
        assert segments(tok, out, 0)[-1] == (1, "#### 14<|im_end|>")
        assert [info["finish"] for info in out["extra_info"]] == ["tool_calls"] * 2
    assert not stream._loop_kwargs
    assert endpoint._runner is None  # stopped by close
