"""Tools written to defeat the tool agent's protections: each costs its own call (an `error: ...` tool turn the
model reads, counted in tool/errors or tool/timeouts), never the rollout or the process.

Tools run in the trainer's process (hyflow/tools/runner.py says why and which attacks that leaves open:
``os.kill(os.getpid(), SIGKILL)``, ``os.abort()``, ctypes); ``os._exit`` and ``posix._exit`` are stopped while a
call runs. One rollout runs every hostile tool beside a well-behaved calculator trajectory (module fixture)."""

from __future__ import annotations

import asyncio
import os
import posix
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from test_agent_loop import (
    ScriptedEngine,
    _tool,
    call,
    make_prompts,
    manager,
    params,
    rollout_config,
    segments,
)

from hyflow.rewards import pool
from hyflow.tools import BaseTool, ToolResponse
from hyflow.tools import runner as tool_runner
from hyflow.tools.calculator import CalculatorTool

CAP = 200  # multi_turn.max_tool_response_length of the rollout
RELEASE = threading.Event()  # set when the tests end, to free the threads the hanging tool left behind


class OsExit(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        os._exit(5)


class PosixExit(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        posix._exit(6)


class ExitOnItsThread(BaseTool):
    """os._exit on a thread of the call's own (asyncio.to_thread)."""

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.to_thread(os._exit, 4)


class SysExit(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):  # a plain method: duck-typed tools may define them
        sys.exit(3)


class ExitsInCreate(BaseTool):
    async def create(self, instance_id=None, **kwargs):
        os._exit(8)


class HugeResponse(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="A" * 2_000_000 + "B" * 2_000_000), 0.0, {}


class HugeError(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise ValueError("x" * 20_000_000)


class StrHangs(BaseTool):
    """An answer whose text blocks when it is read: it must be read on the tool's thread, under the deadline."""

    class Text:
        def __str__(self):
            RELEASE.wait()
            return "late"

    async def execute(self, instance_id, parameters, **kwargs):
        return {"text": self.Text()}, 0.0, {}


class NanRewards(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return "fine", float("nan"), {}

    async def calc_reward(self, instance_id, **kwargs):
        return float("inf")


class ExitsInCalcReward(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return "fine", 0.5, {}

    async def calc_reward(self, instance_id, **kwargs):
        os._exit(9)


# tool name -> (class, the tool turn's expected start, counter)
HOSTILE = {
    "os_exit": (OsExit, "error: tool 'os_exit' called os._exit(5), which would have ended the trainer; hyflow "
                        "stopped it", "tool/errors/mean"),
    "posix_exit": (PosixExit, "error: tool 'posix_exit' called os._exit(6)", "tool/errors/mean"),
    "thread_exit": (ExitOnItsThread, "error: tool 'thread_exit' called os._exit(4)", "tool/errors/mean"),
    "sys_exit": (SysExit, "error: tool 'sys_exit' raised SystemExit: 3", "tool/errors/mean"),
    "create_exit": (ExitsInCreate, "error: tool 'create_exit' called os._exit(8)", "tool/errors/mean"),
    "huge_error": (HugeError, "error: tool 'huge_error' raised ValueError: xxxx", "tool/errors/mean"),
    "str_hangs": (StrHangs, "error: tool 'str_hangs' timed out after 2 s", "tool/timeouts/mean"),
}


def script(text: str) -> str:
    """Call the tool the question names (the calculator for "calc"), then answer with the tool's turn."""
    if "<|im_start|>tool\n" in text:
        return "#### done"
    name = text.split("<|im_start|>user\nuse ")[1].split("<|im_end|>")[0]
    return call("2 + 3 * 4", "calculator" if name == "calc" else name)


@pytest.fixture(scope="module")
def hostile_rollout(tmp_path_factory, tiny_tokenizer):
    tmp = tmp_path_factory.mktemp("hostile_tools")
    tok = tiny_tokenizer
    names = ["calc", *HOSTILE, "huge_response", "nan_rewards", "calc_reward_exit"]
    classes = {name: cls for name, (cls, _, _) in HOSTILE.items()} | {
        "huge_response": HugeResponse, "nan_rewards": NanRewards, "calc_reward_exit": ExitsInCalcReward}
    tools = [CalculatorTool()] + [_tool(cls, name, {"timeout": 2} if name == "str_hangs" else None)
                                  for name, cls in classes.items()]
    config = rollout_config(tmp, f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={CAP}",
                            tools=False)
    try:
        with pytest.warns(RuntimeWarning, match=r"tool thread\(s\) are still blocked .*tool 'str_hangs'"):
            out = manager(ScriptedEngine(tok, script), tok, config, tools=tools).generate(
                make_prompts(tok, [f"use {name}" for name in names]), params())
    finally:
        RELEASE.set()
    return {"out": out, "names": names, "tok": tok}


def tool_turn(rollout, name: str) -> str:
    runs = segments(rollout["tok"], rollout["out"], rollout["names"].index(name))
    assert [m for m, _ in runs] == [1, 0, 1], runs  # the trajectory went on after the tool's turn
    return runs[1][1].removeprefix("\n<|im_start|>tool\n").split("<|im_end|>")[0]


def test_the_well_behaved_trajectory_runs_beside_the_hostile_tools(hostile_rollout):
    assert tool_turn(hostile_rollout, "calc") == "14"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_tool_costs_its_own_call(name, hostile_rollout):
    text = tool_turn(hostile_rollout, name)
    assert text.startswith(HOSTILE[name][1]), text
    assert len(text) <= CAP + len("...(truncated)...")  # a 20 MB exception message is cut like any answer


def test_failures_are_counted_by_kind(hostile_rollout):
    metrics, rows = hostile_rollout["out"].meta["metrics"], len(hostile_rollout["names"])
    errors = sum(1 for _, _, counter in HOSTILE.values() if counter == "tool/errors/mean")
    # + the step reward and calc_reward of nan_rewards, the calc_reward of calc_reward_exit
    assert metrics["tool/errors/mean"] == pytest.approx((errors + 3) / rows)
    assert metrics["tool/timeouts/mean"] == pytest.approx(1 / rows)


def test_a_huge_answer_is_cut_before_it_is_tokenised(hostile_rollout):
    text = tool_turn(hostile_rollout, "huge_response")
    assert text == "A" * (CAP // 2) + "...(truncated)..." + "B" * (CAP // 2)


def test_non_finite_tool_rewards_are_errors_not_scores(hostile_rollout):
    out, names = hostile_rollout["out"], hostile_rollout["names"]
    info = out["extra_info"][names.index("nan_rewards")]
    assert tool_turn(hostile_rollout, "nan_rewards") == "fine"  # the answer is kept, its reward is not
    assert info["tool_rewards"] == [] and "rollout_reward_scores" not in info
    assert info["tool_reward_errors"]["nan_rewards"] == "raised ValueError: calc_reward returned inf, not a finite number"
    info = out["extra_info"][names.index("calc_reward_exit")]
    assert info["tool_rewards"] == [0.5]
    assert info["tool_reward_errors"]["calc_reward_exit"].startswith("called os._exit(9)")


def test_the_exit_guard_is_lifted_when_the_calls_end(hostile_rollout):
    """os._exit / posix._exit are the real ones again once no tool call runs (the released thread included)."""
    deadline = time.monotonic() + 10
    while os._exit is not pool._REAL_OS_EXIT or posix._exit is not tool_runner._REAL_POSIX_EXIT:
        assert time.monotonic() < deadline, (os._exit, posix._exit)
        time.sleep(0.05)
