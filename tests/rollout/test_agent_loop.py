"""The agent loop: token-in-token-out trajectories, tools, interactions, failures, batching, budgets.

Most tests drive the loop with a scripted engine (the reply to a conversation is a function of its text), so the
tool turns, masks and metrics are checked exactly; two tests use the real hf engine on the tiny model: a
single-turn rollout equals the engine's own call, and a multi-turn sample's rollout log-probs equal the trainer's
recompute on the model's tokens.
"""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time

import pytest
import torch

from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.data.rl_dataset import collate_prompts
from hyflow.rollout.agent_loop import AGENT_LOOPS
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.manager import AgentLoopManager
from hyflow.rollout.output import assemble_rollout, prompt_budgets
from hyflow.rollout.tool_parser import HermesToolParser, check_arguments
from hyflow.tools import BaseTool

R = 400  # response budget of the scripted tests
RT = "actor_rollout_ref.rollout"


class ScriptedEngine:
    """reply(conversation text) -> text; the reply's tokens + EOS are the generation (cut at the row's budget).
    Every generated token gets log-prob -0.5. Records the number of prompts x n of every call."""

    shares_weights = True

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply = tokenizer, reply
        self.calls: list[int] = []
        self.seeds: list[int | None] = []

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.calls.append(len(prompts) * params.n)
        self.seeds.append(params.seed)
        budgets = prompt_budgets(prompts, params)
        rows, lengths = [], []
        for ids, mask, budget in zip(prompts["input_ids"], prompts["attention_mask"], budgets.tolist()):
            text = self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            reply = self.tokenizer(self.reply(text), add_special_tokens=False)["input_ids"]
            reply = ([*reply, self.tokenizer.eos_token_id])[:budget]
            rows += [reply] * params.n
            lengths += [len(reply)] * params.n
        responses = torch.full((len(rows), params.max_new_tokens), self.tokenizer.pad_token_id)
        for i, row in enumerate(rows):
            responses[i, : len(row)] = torch.tensor(row)
        logprobs = torch.full(responses.shape, -0.5)
        return assemble_rollout(prompts, prompts["input_ids"], prompts["attention_mask"], responses, logprobs,
                                torch.tensor(lengths), params)


def call(expression: str, name: str = "calculator") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def calculator_script(text: str) -> str:
    """Call the calculator once, then answer with the tool's result."""
    last = text.rsplit("<|im_start|>", 2)[-2]
    if last.startswith("tool\n"):
        return "#### " + last[len("tool\n"):].split("<|im_end|>")[0]
    return call("2 + 3 * 4")


def rollout_config(tmp_path, *overrides, tools=True):
    args = ["actor_rollout_ref.model.path=x", f"data.max_response_length={R}",
            "actor_rollout_ref.rollout.multi_turn.enable=true", *overrides]
    if tools:
        path = tmp_path / "tools.yaml"
        path.write_text("tools:\n  - class_name: hyflow.tools.calculator.CalculatorTool\n    config: {type: native}\n")
        args.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}")
    return load_config(args).actor_rollout_ref.rollout


def make_prompts(tokenizer, questions, agent="tool_agent", tools=None, **columns):
    items = []
    for i, q in enumerate(questions):
        messages = [{"role": "user", "content": q}]
        kwargs = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        items.append({"raw_prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"], "raw_prompt": messages,
                      "uid": f"u{i}", "agent_name": agent, "extra_info": {"index": i},
                      **{k: v[i] for k, v in columns.items()}})
    return collate_prompts(items, tokenizer.pad_token_id)


def manager(engine, tokenizer, rollout, tools=None, interactions=None):
    from hyflow.tools import load_tools

    if tools is None and rollout.multi_turn.tool_config_path:
        tools = load_tools(rollout.multi_turn.tool_config_path)
    return AgentLoopManager(engine, tokenizer, rollout, eos_token_ids=[tokenizer.eos_token_id],
                            pad_token_id=tokenizer.pad_token_id, tools=tools, interactions=interactions)


def params(n=1, **kw):
    return SamplingParams(n=n, max_new_tokens=R, seed=3, calculate_log_probs=True, **kw)


def segments(tokenizer, out, row):
    """The response of `row` cut into (mask value, decoded text) runs."""
    ids, mask = out["responses"][row].tolist(), out["response_mask"][row].tolist()
    length = int(out["attention_mask"][row, -R:].sum())
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(ids[:length], mask[:length]):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return [(m, tokenizer.decode(t, skip_special_tokens=False)) for m, t in runs]


# ---------------------------------------------------------------------------------------------- trajectories
def test_tool_trajectory_masks_logprobs_and_metrics(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, calculator_script)
    rollout = rollout_config(tmp_path)
    out = manager(engine, tok, rollout).generate(make_prompts(tok, ["What is 2 + 3 * 4?", "Add"]), params(n=2))
    assert len(out) == 4 and out["responses"].shape == (4, R)
    for row in range(4):
        runs = segments(tok, out, row)
        assert runs == [
            (1, call("2 + 3 * 4") + "<|im_end|>"),
            (0, "\n<|im_start|>tool\n14<|im_end|>\n<|im_start|>assistant\n"),
            (1, "#### 14<|im_end|>"),
        ]
        mask = out["response_mask"][row].bool()
        assert (out["rollout_log_probs"][row][mask] == -0.5).all()
        assert (out["rollout_log_probs"][row][~mask] == 0).all()
        info = out["extra_info"][row]
        assert info["num_turns"] == 4 and info["tool_rewards"] == [0.0] and info["turn_scores"] == []
    assert out["__num_turns__"].tolist() == [4] * 4
    metrics = out.meta["metrics"]
    assert metrics["tool/calls_per_sample/mean"] == 1.0 and metrics["tool/samples_with_call"] == 1.0
    assert metrics["num_turns/mean"] == 4.0 and metrics["tool/errors/mean"] == 0.0
    # two engine calls, each with every trajectory: the first as 2 prompts x n=2 (shared prefill), then 4 rows
    assert engine.calls == [4, 4] and metrics["agent_loop/engine_batch/max"] == 4.0
    assert engine.seeds == [3, 3 + 1_000_033]
    # the prompt side is exactly the single-turn layout
    assert torch.equal(out["prompts"], out["input_ids"][:, : out["prompts"].shape[1]])


def test_single_turn_rows_equal_the_engine_call(tiny_model_dir, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from hyflow.rollout.hf import HFRolloutEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = tiny_tokenizer
    engine = HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = make_prompts(tok, ["What is 1 + 2?", "hello there, how are you today?", "7"], agent=None)
    p = SamplingParams(n=3, max_new_tokens=24, seed=5, calculate_log_probs=True)
    direct = engine.generate(prompts, p)
    rollout = load_config(["actor_rollout_ref.model.path=x", "data.max_response_length=24"]).actor_rollout_ref.rollout
    via_loop = manager(engine, tok, rollout).generate(prompts, p)
    for key in direct.keys():  # noqa: SIM118 (Batch iterates rows)
        a, b = direct[key], via_loop[key]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else list(a) == list(b), key
    assert "__num_turns__" not in via_loop  # single-turn runs add nothing to the batch


# ---------------------------------------------------------------------------------------------- verl-style tools
COUNTING_TOOL = textwrap.dedent('''
    from hyflow.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse

    CALLS = []
    CREATED = []
    RELEASED = []

    class CountingTool(BaseTool):
        """Counts its calls per trajectory; its reward is the number of calls."""

        def __init__(self, config, tool_schema):
            super().__init__(config, tool_schema)
            self.counts = {}

        async def create(self, instance_id=None, ground_truth=None, **kwargs):
            instance_id, _ = await super().create(instance_id)
            self.counts[instance_id] = 0
            CREATED.append((ground_truth, kwargs.get("create_kwargs")))
            return instance_id, ToolResponse()

        async def execute(self, instance_id, parameters, **kwargs):
            self.counts[instance_id] += 1
            CALLS.append(parameters["expression"])
            return ToolResponse(text=f"call {self.counts[instance_id]}"), 0.25, {}

        async def calc_reward(self, instance_id, **kwargs):
            return float(self.counts[instance_id])

        async def release(self, instance_id, **kwargs):
            RELEASED.append(instance_id)
            del self.counts[instance_id]
''')

COUNTING_YAML = textwrap.dedent('''
    tools:
      - class_name: counting_tool_mod.CountingTool
        config:
          type: native
        tool_schema:
          type: function
          function:
            name: counter
            description: counts calls
            parameters:
              type: object
              properties:
                expression: {type: string, description: anything}
              required: [expression]
''')


def test_verl_style_tool_from_yaml_counts_calls(tmp_path, tiny_tokenizer, monkeypatch):
    (tmp_path / "counting_tool_mod.py").write_text(COUNTING_TOOL)
    (tmp_path / "tools.yaml").write_text(COUNTING_YAML)
    monkeypatch.syspath_prepend(str(tmp_path))
    import counting_tool_mod

    tok = tiny_tokenizer

    def twice(text: str) -> str:
        done = text.count("<|im_start|>tool\n")
        return call(f"x{done}", "counter") if done < 2 else "#### done"

    rollout = load_config(["actor_rollout_ref.model.path=x", f"data.max_response_length={R}",
                           "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}"]
                          ).actor_rollout_ref.rollout
    tools_kwargs = [{"counter": {"create_kwargs": {"ground_truth": "42"}}}]
    out = manager(ScriptedEngine(tok, twice), tok, rollout).generate(
        make_prompts(tok, ["count"], tools_kwargs=tools_kwargs), params())
    assert counting_tool_mod.CALLS == ["x0", "x1"]  # one instance per trajectory, two calls on it
    assert counting_tool_mod.CREATED == [("42", {"ground_truth": "42"})]  # both create_kwargs spellings
    assert len(counting_tool_mod.RELEASED) == 1
    info = out["extra_info"][0]
    assert info["tool_rewards"] == [0.25, 0.25] and info["rollout_reward_scores"] == {"counter": 2.0}
    assert [text for m, text in segments(tok, out, 0) if m == 0] == [
        "\n<|im_start|>tool\ncall 1<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>tool\ncall 2<|im_end|>\n<|im_start|>assistant\n"]


# ---------------------------------------------------------------------------------------------- never crash
class RaisingTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("disk on fire")


class HangingTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(60)


class GarbageTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return 12345


def _tool(cls, name, config=None):
    from hyflow.tools import OpenAIFunctionToolSchema

    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": name, "description": name, "parameters": {"type": "object", "properties": {
            "expression": {"type": "string"}}, "required": ["expression"]}}})
    return cls(config or {}, schema)


FAILURES = {
    "bad json": ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
                 "error: malformed tool call: the call is not valid JSON", "tool/malformed_calls/mean"),
    "not closed": ('<tool_call>{"name": "calculator"', "error: malformed tool call: <tool_call> without </tool_call>",
                   "tool/malformed_calls/mean"),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>', 'error: malformed tool call: the call has no "name"',
                "tool/malformed_calls/mean"),
    "unknown tool": (call("1", "weather"), "error: unknown tool 'weather'; available tools:",
                     "tool/unknown_tools/mean"),
    "wrong type": ('<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>',
                   "error: calculator: argument 'expression' must be string, got int 7", "tool/bad_arguments/mean"),
    "missing arg": ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
                    "error: calculator: missing required argument(s) 'expression'", "tool/bad_arguments/mean"),
    "raises": (call("1", "raiser"), "error: tool 'raiser' raised RuntimeError: disk on fire", "tool/errors/mean"),
    "hangs": (call("1", "hanger"), "error: tool 'hanger' timed out after 0.2 s", "tool/timeouts/mean"),
    "garbage": (call("1", "garbage"), "error: tool 'garbage' returned int", "tool/errors/mean"),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_failures_become_tool_turn_errors(case, tmp_path, tiny_tokenizer):
    first, message, metric = FAILURES[case]
    tok = tiny_tokenizer

    def script(text: str) -> str:
        return "#### 1" if "<|im_start|>tool\n" in text else first

    from hyflow.tools.calculator import CalculatorTool

    tools = [CalculatorTool(), _tool(RaisingTool, "raiser"), _tool(HangingTool, "hanger", {"timeout": 0.2}),
             _tool(GarbageTool, "garbage")]
    rollout = rollout_config(tmp_path, tools=False)
    out = manager(ScriptedEngine(tok, script), tok, rollout, tools=tools).generate(make_prompts(tok, ["q"]), params())
    runs = segments(tok, out, 0)
    assert [m for m, _ in runs] == [1, 0, 1], runs  # the trajectory went on after the error
    assert runs[1][1].startswith("\n<|im_start|>tool\n" + message), runs[1][1]
    assert out.meta["metrics"][metric] == 1.0


# ---------------------------------------------------------------------------------------------- blocking tools
NEVER = threading.Event()  # set only at the end of the tests below, to let their abandoned threads go


class SleepingTool(BaseTool):
    """Blocks its thread with time.sleep inside `async execute` (no await): the event loop cannot interrupt it."""

    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(5)
        return "late answer", 0.0, {}


class ThreadForeverTool(BaseTool):
    """Awaits a thread (asyncio.to_thread) that never ends."""

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.to_thread(NEVER.wait)
        return "late answer", 0.0, {}


class BlocksForeverTool(BaseTool):
    """Blocks its thread forever on an event nobody sets."""

    async def execute(self, instance_id, parameters, **kwargs):
        NEVER.wait()
        return "late answer", 0.0, {}


def _blocking_rollout(tmp_path, tok, tool, questions):
    script = lambda text: "#### 1" if "<|im_start|>tool\n" in text else call("1", "blocker")  # noqa: E731
    loops = manager(ScriptedEngine(tok, script), tok, rollout_config(tmp_path, tools=False),
                    tools=[_tool(tool, "blocker", {"timeout": 0.5})])
    started = time.monotonic()
    out = loops.generate(make_prompts(tok, questions), params())
    return out, time.monotonic() - started


@pytest.mark.parametrize("tool", [SleepingTool, ThreadForeverTool, BlocksForeverTool], ids=lambda c: c.__name__)
def test_blocking_tools_time_out_and_do_not_hold_the_rollout(tool, tmp_path, tiny_tokenizer):
    """A tool that blocks (time.sleep in async execute, a to_thread or a wait that never ends) is answered with the
    timeout error at its deadline; generate() returns without waiting for the tool's thread, two trajectories'
    calls run at once (about one timeout, not two), and the abandoned threads are counted."""
    tok = tiny_tokenizer
    try:
        with pytest.warns(RuntimeWarning, match=r"2 tool thread\(s\) are still blocked .*tool 'blocker' \(execute\)"):
            out, elapsed = _blocking_rollout(tmp_path, tok, tool, ["q1", "q2"])
        assert elapsed < 3.0, elapsed  # the tool sleeps 5 s or forever; serialised calls would take >= 1 s
        for row in range(2):
            runs = segments(tok, out, row)
            assert [m for m, _ in runs] == [1, 0, 1], runs
            assert runs[1][1].startswith("\n<|im_start|>tool\nerror: tool 'blocker' timed out after 0.5 s"), runs
            assert "late answer" not in runs[1][1]
        metrics = out.meta["metrics"]
        assert metrics["tool/timeouts/mean"] == 1.0
        assert metrics["tool/stuck_threads"] >= 2  # both calls' threads are still blocked, abandoned
    finally:
        NEVER.set()  # free the abandoned threads (a real stuck tool would keep them: they are daemon threads)
        time.sleep(0.1)
        NEVER.clear()


class ExitingTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise SystemExit(3)


def test_a_tool_raising_system_exit_is_a_tool_error_not_the_end_of_the_run(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    out, _ = _blocking_rollout(tmp_path, tok, ExitingTool, ["q"])
    runs = segments(tok, out, 0)
    assert [m for m, _ in runs] == [1, 0, 1], runs
    assert runs[1][1].startswith("\n<|im_start|>tool\nerror: tool 'blocker' raised SystemExit: 3"), runs
    assert out.meta["metrics"]["tool/errors/mean"] == 1.0


def test_parallel_calls_are_capped_and_counted(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    three = call("1 + 1") + call("2 + 2") + call("3 + 3")
    rollout = rollout_config(tmp_path, "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2")
    script = lambda text: "#### 0" if "<|im_start|>tool\n" in text else three  # noqa: E731
    out = manager(ScriptedEngine(tok, script), tok, rollout).generate(make_prompts(tok, ["q"]), params())
    tool_turn = segments(tok, out, 0)[1][1]
    assert tool_turn == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    assert out.meta["metrics"]["tool/dropped_calls/mean"] == 1.0


# ---------------------------------------------------------------------------------------------- limits
def test_budget_and_turn_limits(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    forever = lambda text: call("1 + 1")  # noqa: E731  (calls the tool at every turn)
    rollout = rollout_config(tmp_path)
    out = manager(ScriptedEngine(tok, forever), tok, rollout).generate(make_prompts(tok, ["q"]), params())
    length = int(out["attention_mask"][0, -R:].sum())
    assert length <= R and out["response_mask"][0, length - 1] == 1  # ends on model tokens, within the budget
    turns = out["extra_info"][0]["num_turns"]
    rollout = rollout_config(tmp_path, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2")
    out = manager(ScriptedEngine(tok, forever), tok, rollout).generate(make_prompts(tok, ["q"]), params())
    assert out["extra_info"][0]["num_turns"] == 4 < turns  # user, assistant, tool, assistant
    rollout = rollout_config(tmp_path, "actor_rollout_ref.rollout.multi_turn.max_user_turns=1")
    out = manager(ScriptedEngine(tok, forever), tok, rollout).generate(make_prompts(tok, ["q"]), params())
    assert out["extra_info"][0]["num_turns"] == 4


def test_long_tool_output_is_truncated(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    rollout = rollout_config(tmp_path, "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=6",
                             "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=right")
    script = lambda text: "#### 0" if "<|im_start|>tool\n" in text else call("12345678 * 11111111")  # noqa: E731
    out = manager(ScriptedEngine(tok, script), tok, rollout).generate(make_prompts(tok, ["q"]), params())
    assert segments(tok, out, 0)[1][1].startswith("\n<|im_start|>tool\n137174...(truncated)<|im_end|>")


# ---------------------------------------------------------------------------------------------- interactions
class Teacher:
    """An interaction (verl's methods): wrong answers get a retry, the right one ends the trajectory."""

    name = "teacher"

    def __init__(self):
        self.started, self.finalized = [], []

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        self.started.append(ground_truth)
        return instance_id

    async def generate_response(self, instance_id, messages, ground_truth=None, **kwargs):
        answer = messages[-1]["content"]
        if answer == f"#### {ground_truth}":
            return True, "correct", 1.0, {}
        return False, "wrong, try again", 0.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        self.finalized.append(instance_id)


def test_interaction_retries_then_ends_the_trajectory(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    script = lambda text: "#### 7" if "wrong" in text else "#### 6"  # noqa: E731
    teacher = Teacher()
    rollout = rollout_config(tmp_path, tools=False)
    prompts = make_prompts(tok, ["3 + 4?"], interaction_kwargs=[{"name": "teacher", "ground_truth": "7"}])
    out = manager(ScriptedEngine(tok, script), tok, rollout, interactions={"teacher": teacher}).generate(
        prompts, params())
    assert segments(tok, out, 0) == [(1, "#### 6<|im_end|>"),
                                     (0, "\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"),
                                     (1, "#### 7<|im_end|>")]
    info = out["extra_info"][0]
    assert info["turn_scores"] == [0.0, 1.0] and info["num_turns"] == 5
    assert teacher.started == ["7"] and len(teacher.finalized) == 1


def test_unknown_interaction_name_is_a_config_error(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    rollout = rollout_config(tmp_path, tools=False)
    prompts = make_prompts(tok, ["q"], interaction_kwargs=[{"name": "nobody"}])
    loops = manager(ScriptedEngine(tok, lambda t: "#### 1"), tok, rollout, interactions={"teacher": Teacher()})
    with pytest.raises(ValueError, match="interaction_kwargs.name='nobody' names no interaction"):
        loops.generate(prompts, params())


# ---------------------------------------------------------------------------------------------- configuration
def test_agent_names_are_checked(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, lambda t: "#### 1")
    with pytest.raises(ValueError, match="agent loop 'tool_agnt'.*Did you mean 'tool_agent'"):
        manager(engine, tok, rollout_config(tmp_path)).generate(make_prompts(tok, ["q"], agent="tool_agnt"), params())
    single = load_config(["actor_rollout_ref.model.path=x", f"data.max_response_length={R}"]).actor_rollout_ref.rollout
    with pytest.raises(ValueError, match="multi_turn.enable is false: set it to true"):
        manager(engine, tok, single).generate(make_prompts(tok, ["q"]), params())


CUSTOM_LOOP = textwrap.dedent('''
    from hyflow.rollout.agent_loop import AgentLoopBase, AgentLoopOutput

    class EchoTwice(AgentLoopBase):
        """Generates twice from the prompt (no tools); response = both generations."""

        def __init__(self, *, times=2, **kwargs):
            super().__init__(**kwargs)
            self.times = times

        async def run(self, sampling_params, **kwargs):
            prompt = list(kwargs["raw_prompt_ids"])
            ids = []
            for _ in range(self.times):
                out = await self.server_manager.generate(prompt_ids=prompt + ids,
                                                         sampling_params={"max_tokens": 8})
                ids += out.token_ids
            return AgentLoopOutput(prompt_ids=prompt, response_ids=ids, response_mask=[1] * len(ids))
''')


def test_custom_agent_loop_from_config(tmp_path, tiny_tokenizer, monkeypatch):
    (tmp_path / "echo_loop_mod.py").write_text(CUSTOM_LOOP)
    (tmp_path / "loops.yaml").write_text("- name: echo\n  _target_: echo_loop_mod.EchoTwice\n  times: 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = tiny_tokenizer
    rollout = rollout_config(tmp_path, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/loops.yaml",
                             tools=False)
    engine = ScriptedEngine(tok, lambda t: "ab")
    try:
        out = manager(engine, tok, rollout).generate(make_prompts(tok, ["q", "r"], agent="echo"), params())
    finally:
        AGENT_LOOPS.pop("echo", None)
    assert engine.calls == [2, 2, 2]  # both trajectories decoded together at each of the 3 generations
    assert tok.decode(out["responses"][0][out["response_mask"][0].bool()]) == "ab<|im_end|>" * 3


# ---------------------------------------------------------------------------------------------- parser
def test_hermes_parser_reads_several_calls_and_reports_the_rest():
    parser = HermesToolParser()
    turn = parser.parse('I will compute. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
                        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call><tool_call>[1]</tool_call>')
    assert [c.name for c in turn.calls] == ["a", "b"] and turn.calls[1].parsed_arguments() == {"y": 2}
    assert [m.reason for m in turn.malformed] == ["the call must be a JSON object, got list"]
    assert turn.content.startswith("I will compute.")


def test_argument_checks():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "mode": {"type": "string", "enum": ["a"]}},
              "required": ["n"]}
    assert check_arguments({"n": 3}, schema) is None
    assert "must be integer, got bool" in check_arguments({"n": True}, schema)
    assert "unknown argument(s) 'm'" in check_arguments({"n": 1, "m": 2}, schema)
    assert "must be one of ['a']" in check_arguments({"n": 1, "mode": "b"}, schema)



class AskTwice:
    """Answers the first assistant turn with a user message, ends the trajectory at the second."""

    name = "again"

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        asked = sum(m["role"] == "user" for m in messages)
        return asked >= 2, "Say it again, shorter.", 0.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        return None


@pytest.mark.parametrize("batching", ["barrier", "eager"])
def test_multi_turn_logprobs_equal_the_trainers_recompute(tiny_model_dir, tiny_tokenizer, tmp_path, batching):
    """The rollout's log-probs of a multi-turn sample equal the trainer's recompute (the function the actor trains
    with) on the model's tokens, in float32; the user turn between them is context, not trained on. Also with the
    engine on a thread of its own (batching=eager)."""
    from transformers import AutoModelForCausalLM

    from hyflow.models.forward import response_logprobs
    from hyflow.rollout.hf import HFRolloutEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = tiny_tokenizer
    engine = HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rollout = load_config(["actor_rollout_ref.model.path=x", "data.max_response_length=48",
                           "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"{RT}.agent.batching={batching}"]).actor_rollout_ref.rollout
    prompts = make_prompts(tok, ["What is 1 + 2?", "Name a colour."], interaction_kwargs=[{"name": "again"}] * 2)
    # many stop ids, so that the random model's turns end early and the interaction gets its turn
    p = SamplingParams(n=2, max_new_tokens=48, seed=11, temperature=0.8, calculate_log_probs=True,
                       stop_token_ids=tuple(range(3, 300, 5)))
    out = manager(engine, tok, rollout, interactions={"again": AskTwice()}).generate(prompts, p)
    mask = out["response_mask"].bool()
    assert (out["attention_mask"][:, -48:].bool() & ~mask).any(), "some sample must hold a user turn"
    with torch.no_grad():
        logp, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"], 48,
                                    temperature=0.8)
    diff = (logp - out["rollout_log_probs"])[mask].abs().max().item()
    assert diff < 1e-5, diff
    assert (out["rollout_log_probs"][~mask] == 0).all()


def test_multi_turn_config_errors_name_the_key_and_the_fix(tmp_path):
    from hyflow.config.keys import ConfigError
    from hyflow.config.validate import validate_config

    def problems(*overrides):
        with pytest.raises(ConfigError) as err:
            validate_config(load_config(["actor_rollout_ref.model.path=x", *overrides]))
        return str(err.value)

    text = problems(f"{RT}.multi_turn.tool_config_path={tmp_path}/none.yaml", f"{RT}.multi_turn.max_parallel_calls=0",
                    f"{RT}.multi_turn.tool_timeout=0", f"{RT}.agent.num_workers=0")
    assert text.startswith("4 problems") and "none.yaml: no such file" in text and "tool_timeout=0.0 must be > 0" in text
    assert "Did you mean 'hermes'?" in problems(f"{RT}.multi_turn.format=hermez")
    assert "token in, token out" in problems(f"{RT}.multi_turn.use_inference_chat_template=true")
    assert "@function_tool files are not built" in problems(f"{RT}.multi_turn.function_tool_path=tools.py")
    assert "tensor-parallel vllm engine" in problems(
        f"{RT}.multi_turn.enable=true", f"{RT}.name=vllm", f"{RT}.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=2")


def test_generate_works_inside_a_running_event_loop(tmp_path, tiny_tokenizer):
    """A trainer driven from a Jupyter cell or an async program: the agent loop runs in a thread of its own."""
    tok = tiny_tokenizer
    loops = manager(ScriptedEngine(tok, calculator_script), tok, rollout_config(tmp_path))

    async def driver():
        return loops.generate(make_prompts(tok, ["q"]), params())

    out = asyncio.run(driver())
    assert [m for m, _ in segments(tok, out, 0)] == [1, 0, 1]


def test_a_loop_that_changes_the_prompt_is_refused(tmp_path, tiny_tokenizer, monkeypatch):
    from hyflow.rollout.agent_loop import AgentLoopBase, AgentLoopOutput

    class Rewrites(AgentLoopBase):
        async def run(self, sampling_params, **kwargs):
            out = await self.server_manager.generate(prompt_ids=[1, 2, 3], sampling_params={})
            return AgentLoopOutput(prompt_ids=[1, 2, 3], response_ids=out.token_ids,
                                   response_mask=[1] * len(out.token_ids))

    monkeypatch.setitem(AGENT_LOOPS, "rewrites", Rewrites)
    tok = tiny_tokenizer
    loops = manager(ScriptedEngine(tok, lambda t: "x"), tok, rollout_config(tmp_path, tools=False))
    with pytest.raises(ValueError, match="returned prompt_ids that are not the prompt's token ids"):
        loops.generate(make_prompts(tok, ["q"], agent="rewrites"), params())


# ---------------------------------------------------------------------------------------------- special markers
def _marking_tags_special(tokenizer, special: bool):
    """A copy of the tokenizer in which <tool_call> and </tool_call> are single added tokens, special or not."""
    import copy

    from tokenizers import AddedToken

    tok = copy.deepcopy(tokenizer)
    tags = [AddedToken(t, special=special, normalized=False) for t in ("<tool_call>", "</tool_call>")]
    if special:
        tok.add_special_tokens({"additional_special_tokens": tags})
    else:
        tok.add_tokens(tags)
    ids = tok("<tool_call>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 1 and (ids[0] in tok.all_special_ids) == special  # the premise of the test
    return tok


@pytest.mark.parametrize("special", [True, False], ids=["tags-special", "tags-plain"])
def test_calls_are_parsed_whether_the_tags_are_special_tokens_or_not(special, tiny_tokenizer):
    """One decode path keeps special tokens: a tokenizer that marks <tool_call> special made the agent loop's
    decode (skip_special_tokens=True) drop the markers, so the call was neither run nor counted as malformed."""
    tok = _marking_tags_special(tiny_tokenizer, special)
    parser = HermesToolParser(tok)
    text = "Let me compute. " + call("6 * 7") + " and " + call("1 +", name="calculator")
    ids = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    turn = parser.parse_ids(ids)
    assert [(c.name, c.parsed_arguments()) for c in turn.calls] == [("calculator", {"expression": "6 * 7"}),
                                                                    ("calculator", {"expression": "1 +"})]
    assert turn.content == "Let me compute.  and " and not turn.malformed  # no EOS or tag text left
    unclosed = parser.parse_ids([*tok("Sure <tool_call>{\"name\": \"calculator\"", add_special_tokens=False)[
        "input_ids"], tok.eos_token_id])
    assert not unclosed.calls and "without </tool_call>" in unclosed.malformed[0].reason
    assert unclosed.content == "Sure "
    content, calls = asyncio.run(parser.extract_tool_calls(ids))  # verl's method: the same path
    assert content == turn.content and [c.name for c in calls] == ["calculator", "calculator"]


@pytest.mark.parametrize("special", [True, False], ids=["tags-special", "tags-plain"])
def test_the_tool_agent_runs_calls_whose_tags_are_special_tokens(special, tmp_path, tiny_tokenizer):
    tok = _marking_tags_special(tiny_tokenizer, special)
    engine = ScriptedEngine(tok, calculator_script)
    out = manager(engine, tok, rollout_config(tmp_path)).generate(make_prompts(tok, ["What is 2 + 3 * 4?"]),
                                                                   params())
    metrics = out.meta["metrics"]
    assert metrics["tool/calls_per_sample/mean"] == 1.0 and metrics["tool/malformed_calls/mean"] == 0.0
    assert [text for _, text in segments(tok, out, 0)][-1] == "#### 14<|im_end|>"  # the tool's answer came back


def test_the_tool_agent_with_the_qwen3_coder_format(tmp_path, tiny_tokenizer):
    """multi_turn.format=qwen3_coder: the XML call is parsed with the tool's schema and run."""
    tok = tiny_tokenizer

    def script(text: str) -> str:
        last = text.rsplit("<|im_start|>", 2)[-2]
        if last.startswith("tool\n"):
            return "#### " + last[len("tool\n"):].split("<|im_end|>")[0]
        return ("<tool_call>\n<function=calculator>\n<parameter=expression>\n2 + 3 * 4\n</parameter>\n</function>\n"
                "</tool_call>")

    engine = ScriptedEngine(tok, script)
    out = manager(engine, tok, rollout_config(tmp_path, f"{RT}.multi_turn.format=qwen3_coder")).generate(
        make_prompts(tok, ["What is 2 + 3 * 4?"]), params())
    metrics = out.meta["metrics"]
    assert metrics["tool/calls_per_sample/mean"] == 1.0 and metrics["tool/bad_arguments/mean"] == 0.0
    assert [text for _, text in segments(tok, out, 0)][-1] == "#### 14<|im_end|>"


def test_a_format_with_its_own_end_of_call_id_stops_turns_there(tmp_path, tiny_tokenizer):
    """llama3_json: <|eom_id|> (when the tokenizer has it) ends a call turn, as EOS does."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|eom_id|>"]})
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    loops = manager(ScriptedEngine(tok, lambda text: "6"), tok,
                    rollout_config(tmp_path, f"{RT}.multi_turn.format=llama3_json"))
    loops.generate(make_prompts(tok, ["Hi"]), params())
    assert eom in loops.last_server.stop_ids and tok.eos_token_id in loops.last_server.stop_ids


# ---------------------------------------------------------------------------------------------- eager batching
class WaitsForTheOthers:
    """The first trajectory's interaction answers only once the second trajectory has finished (or after `patience`
    seconds): under barrier batching the second cannot finish while the first waits, under eager it can."""

    name = "waits"

    def __init__(self, patience: float):
        self.patience, self.timed_out = patience, None
        self.second_done = asyncio.Event()

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, who=None, **kwargs):
        turns = sum(m["role"] == "assistant" for m in messages)
        if who == "second":
            if turns >= 3:
                self.second_done.set()
            return turns >= 3, "again", 0.0, {}
        if turns == 1:
            try:
                await asyncio.wait_for(self.second_done.wait(), self.patience)
                self.timed_out = False
            except asyncio.TimeoutError:
                self.timed_out = True
        return turns >= 2, "again", 0.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        return None


@pytest.mark.parametrize("batching, waited_out", [("barrier", True), ("eager", False)])
def test_eager_batching_lets_a_trajectory_go_on_while_another_waits(batching, waited_out, tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    waits = WaitsForTheOthers(patience=2.0)
    rollout = rollout_config(tmp_path, f"{RT}.agent.batching={batching}", tools=False)
    prompts = make_prompts(tok, ["a", "b"], interaction_kwargs=[{"name": "waits", "who": "first"},
                                                                {"name": "waits", "who": "second"}])
    engine = ScriptedEngine(tok, lambda text: "#### 1")
    out = manager(engine, tok, rollout, interactions={"waits": waits}).generate(prompts, params())
    assert waits.timed_out is waited_out
    assert [info["num_turns"] for info in out["extra_info"]] == [5, 7]  # 2 and 3 model turns, whatever the timing
    if batching == "eager":  # the second trajectory's later turns were decoded alone, while the first waited
        assert engine.calls[0] == 2 and engine.calls.count(1) >= 2


def test_eager_and_barrier_batching_give_the_same_trajectories_for_a_deterministic_model(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    outs = {}
    for batching in ("barrier", "eager"):
        engine = ScriptedEngine(tok, calculator_script)
        rollout = rollout_config(tmp_path, f"{RT}.agent.batching={batching}")
        outs[batching] = manager(engine, tok, rollout).generate(make_prompts(tok, ["What is 2 + 3 * 4?", "Add"]),
                                                               params(n=2))
    for key in ("responses", "response_mask", "attention_mask", "rollout_log_probs", "input_ids", "position_ids"):
        assert torch.equal(outs["barrier"][key], outs["eager"][key]), key


def test_an_engine_error_under_eager_batching_reaches_the_caller(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer

    class Broken(ScriptedEngine):
        def generate(self, prompts, params):
            raise RuntimeError("the engine broke")

    rollout = rollout_config(tmp_path, f"{RT}.agent.batching=eager")
    with pytest.raises(RuntimeError, match="the engine broke"):
        manager(Broken(tok, calculator_script), tok, rollout).generate(make_prompts(tok, ["q"]), params())


# ---------------------------------------------------------------------------------------------- continuous batching
class StreamingScriptedEngine(ScriptedEngine):
    """ScriptedEngine with the token-level protocol (`open_stream`): each request is answered on a thread of its
    own after `delay(prompt text)` seconds, whatever else is running; records every request and each close."""

    def __init__(self, tokenizer, reply, delay=lambda text: 0.0):
        super().__init__(tokenizer, reply)
        self.delay, self.requests, self.closed = delay, [], 0

    def open_stream(self, params):
        import concurrent.futures

        from hyflow.rollout.base import TokenOutput

        engine = self

        class Stream:
            step_count, seconds, step_sizes = 0, 0.0, []

            def submit(self, request):
                engine.requests.append(request)
                future = concurrent.futures.Future()

                def answer():
                    text = engine.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
                    time.sleep(engine.delay(text))
                    ids = engine.tokenizer(engine.reply(text), add_special_tokens=False)["input_ids"]
                    ids = [*ids, engine.tokenizer.eos_token_id][: request.max_tokens]
                    self.step_count += 1
                    self.step_sizes.append(1)
                    future.set_result(TokenOutput(ids, [-0.5] * len(ids), "stop"))

                threading.Thread(target=answer, daemon=True).start()
                return future

            def close(self):
                engine.closed += 1

        return Stream()


def vllm_rollout_config(tmp_path, *overrides):
    return rollout_config(tmp_path, f"{RT}.name=vllm", f"{RT}.agent.batching=continuous", *overrides)


def test_continuous_batching_gives_the_barrier_trajectories_for_a_deterministic_model(tmp_path, tiny_tokenizer):
    """Every turn is its own request (seed + trajectory + turn * SEED_STRIDE); the rows are those of the barrier
    rollout; the stream is closed once at the end."""
    from hyflow.rollout.agent_server import SEED_STRIDE

    tok = tiny_tokenizer
    prompts = make_prompts(tok, ["What is 2 + 3 * 4?", "Add"])
    barrier = manager(ScriptedEngine(tok, calculator_script), tok, rollout_config(tmp_path)).generate(
        prompts, params(n=2))
    engine = StreamingScriptedEngine(tok, calculator_script)
    loops = manager(engine, tok, vllm_rollout_config(tmp_path))
    out = loops.generate(prompts, params(n=2))
    for key in ("responses", "response_mask", "attention_mask", "rollout_log_probs", "input_ids", "position_ids"):
        assert torch.equal(out[key], barrier[key]), key
    assert engine.calls == [] and engine.closed == 1  # no padded-batch call: all through the stream
    seeds = sorted((r.request_id, r.seed) for r in engine.requests)
    # request ids: t<trajectory>.<turn>.<segment> (a synchronous rollout is never cut into segments)
    assert seeds == sorted([(f"t{i}.0.0", 3 + i) for i in range(4)] + [(f"t{i}.1.0", 3 + i + SEED_STRIDE)
                                                                       for i in range(4)])
    assert out.meta["metrics"]["agent_loop/engine_calls"] == 8


def test_continuous_batching_lets_a_trajectory_go_on_while_another_waits(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    waits = WaitsForTheOthers(patience=2.0)
    rollout = vllm_rollout_config(tmp_path)
    prompts = make_prompts(tok, ["a", "b"], interaction_kwargs=[{"name": "waits", "who": "first"},
                                                                {"name": "waits", "who": "second"}])
    out = manager(StreamingScriptedEngine(tok, lambda text: "#### 1"), tok, rollout,
                  interactions={"waits": waits}).generate(prompts, params())
    assert waits.timed_out is False  # the second trajectory finished while the first waited
    assert [info["num_turns"] for info in out["extra_info"]] == [5, 7]


def test_a_slow_answer_holds_back_only_its_own_trajectory(tmp_path, tiny_tokenizer):
    """One trajectory's first answer takes 1.5 s; the other's three turns are all decoded meanwhile."""
    tok = tiny_tokenizer
    finished = []

    class Record(WaitsForTheOthers):
        async def generate_response(self, instance_id, messages, who=None, **kwargs):
            turns = sum(m["role"] == "assistant" for m in messages)
            if turns >= 3 or (who == "slow" and turns >= 1):
                finished.append(who)
            return turns >= 3 or who == "slow", "again", 0.0, {}

    engine = StreamingScriptedEngine(tok, lambda text: "#### 1",
                                     delay=lambda text: 1.5 if text.count("<|im_start|>user") == 1 and "slow" in text
                                     else 0.0)
    prompts = make_prompts(tok, ["slow", "fast"], interaction_kwargs=[{"name": "rec", "who": "slow"},
                                                                      {"name": "rec", "who": "fast"}])
    manager(engine, tok, vllm_rollout_config(tmp_path, "actor_rollout_ref.rollout.multi_turn.enable=true"),
            interactions={"rec": Record(0)}).generate(prompts, params())
    assert finished == ["fast", "slow"]


def test_continuous_batching_needs_an_engine_with_a_stream(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    with pytest.raises(ValueError, match=r"batching=continuous needs an engine with a token stream.*"
                                         r"ScriptedEngine decodes fixed batches only: use batching=eager"):
        manager(ScriptedEngine(tok, calculator_script), tok, vllm_rollout_config(tmp_path)).generate(
            make_prompts(tok, ["q"]), params())
    from hyflow.config.validate import validate_config

    with pytest.raises(ValueError, match=r"batching=continuous needs an engine with a token stream: "
                                         r"actor_rollout_ref.rollout.name=hf, or vllm with tensor_model_parallel_size"
                                         r"=1 \(got name=vllm, tensor_model_parallel_size=2"):
        validate_config(load_config(["actor_rollout_ref.model.path=x", f"{RT}.agent.batching=continuous",
                                     f"{RT}.name=vllm", f"{RT}.tensor_model_parallel_size=2"]))
    validate_config(load_config(["actor_rollout_ref.model.path=x", f"{RT}.agent.batching=continuous"]))  # hf
    for mode in ("fully_async", "one_step_off"):  # the stream has barrier segments or continuous, no eager
        with pytest.raises(ValueError, match=rf"agent.batching=eager with async_training.mode={mode}"):
            validate_config(load_config(["actor_rollout_ref.model.path=x", f"{RT}.agent.batching=eager",
                                         f"async_training.mode={mode}", f"{RT}.calculate_log_probs=true"]))
    vllm_async = ["actor_rollout_ref.model.path=x", f"{RT}.name=vllm", f"{RT}.agent.batching=continuous",
                  "async_training.mode=fully_async", f"{RT}.calculate_log_probs=true", "trainer.executor=ray",
                  "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"]
    try:  # continuous batching, aborted and resumed at weight pushes (this venv may lack vllm: nothing else)
        validate_config(load_config(vllm_async))
    except ValueError as err:
        assert str(err).startswith(f"{RT}.name=vllm needs the vllm package"), err  # the only problem
    with pytest.raises(ValueError, match=r"partial_rollout_chunk=4 with actor_rollout_ref.rollout.agent.batching="
                                         r"continuous: .* drop partial_rollout_chunk"):
        validate_config(load_config([*vllm_async, "async_training.partial_rollout_chunk=4"]))


# ---------------------------------------------------------------------------------------------- loop rewards
def test_a_loop_that_scores_its_trajectory_replaces_the_reward_function(tmp_path, tiny_tokenizer):
    """AgentLoopOutput.reward_score (verl's field) becomes the batch column agent_reward; those rows take it as
    their score on the last model token, and only the other rows go to the reward function."""
    from hyflow.rewards.managers import RewardResult, score_with_agent_rewards
    from hyflow.rollout.agent_loop import SingleTurnAgentLoop, register

    @register("scored_agent")
    class Scored(SingleTurnAgentLoop):
        async def run(self, sampling_params, **kwargs):
            out = await super().run(sampling_params, **kwargs)
            out.reward_score = 0.25 * len(out.response_ids)
            return out

    tok = tiny_tokenizer
    try:
        prompts = make_prompts(tok, ["a", "b", "c"], agent="scored_agent")
        prompts["agent_name"] = ["scored_agent", "single_turn_agent", "scored_agent"]
        out = manager(ScriptedEngine(tok, lambda text: "#### 1"), tok, rollout_config(tmp_path, tools=False)).generate(
            prompts, params())
    finally:
        AGENT_LOOPS.pop("scored_agent", None)
    lengths = out["response_mask"].sum(-1).tolist()
    assert list(out["agent_reward"]) == [0.25 * lengths[0], None, 0.25 * lengths[2]]

    seen = []

    def reward_function(batch):  # the reward manager's role: sees only the unscored row
        seen.append(len(batch))
        scores = torch.zeros(batch["responses"].shape)
        scores[:, 0] = 0.5
        return RewardResult(scores, [0.5] * len(batch), {"checked": [True] * len(batch)}, {"reward/x/mean": 0.5})

    result = score_with_agent_rewards(reward_function, out)
    assert seen == [1]
    assert result.scores == [0.25 * lengths[0], 0.5, 0.25 * lengths[2]]
    assert result.extra == {"checked": [None, True, None]}
    last = [length - 1 for length in lengths]
    assert result.token_level_scores[0, last[0]] == 0.25 * lengths[0] and result.token_level_scores[0].sum() == \
        0.25 * lengths[0]
    assert result.token_level_scores[1, 0] == 0.5
    assert result.metrics["reward/agent_reward/share"] == pytest.approx(2 / 3)
    out.pop("agent_reward")  # no loop scored: the reward function scores every row
    assert score_with_agent_rewards(reward_function, out).scores == [0.5] * 3 and seen == [1, 3]
