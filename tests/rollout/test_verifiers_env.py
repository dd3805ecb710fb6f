"""Environments of the verifiers library (hyflow[envs]), trained unchanged: `hyflow data verifiers` writes an
environment's dataset as rows, and the `verifiers_agent` loop runs each through the environment's own rollout and
rubric against hyflow's OpenAI endpoint, token in, token out. The environments here are written in the test (a
single-turn one and one with a tool), loaded by verifiers' `load_environment` from a module on the path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_agent_loop import AGENT_LOOPS, ScriptedEngine, manager, params, rollout_config

HYFLOW = [str(Path(sys.executable).parent / "hyflow")]
ENV_MODULE = '''
import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 4, tool: bool = False):
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(n)]

    def exact(completion, answer, **kwargs):
        return float(str(completion[-1]["content"]).strip() == answer)

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    rubric = vf.Rubric(funcs=[exact])
    if tool:
        return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], rubric=rubric, max_turns=4)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:2]),
                            system_prompt="Answer with the number.", rubric=rubric)
'''


@pytest.fixture(autouse=True)
def env_module(tmp_path, monkeypatch):
    """Per test, not at import: collecting this module in .venv-vllm (which deselects it) must not skip it."""
    pytest.importorskip("verifiers", reason="verifiers is installed by make venv (hyflow[envs])")
    (tmp_path / "hyflow_test_vf_env.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hyflow_test_vf_env", None)
    from hyflow.rollout import verifiers_env

    verifiers_env._ENVS.clear()
    return tmp_path


def written_rows(tmp_path, *options):
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([*HYFLOW, "data", "verifiers", "--env", "hyflow_test_vf_env", "--out", str(tmp_path / "d"),
                           "--n-train", "3", "--n-test", "2", *options], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    return [pq.read_table(tmp_path / "d" / f"{split}.parquet").to_pylist() for split in ("train", "test")]


def adder(text: str) -> str:
    """The policy: the sum of the last question's two numbers."""
    a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1])
    return str(a + b)


def play(tmp_path, tok, rows, reply):
    from hyflow.data.rl_dataset import collate_prompts

    items = []
    for i, row in enumerate(rows):
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        items.append({"raw_prompt_ids": tok(text, add_special_tokens=False)["input_ids"], "raw_prompt": row["prompt"],
                      "uid": f"u{i}", "agent_name": row["agent_name"], "extra_info": row["extra_info"]})
    return manager(ScriptedEngine(tok, reply), tok, rollout_config(tmp_path, tools=False)).generate(
        collate_prompts(items, tok.pad_token_id), params(n=2))


def test_the_cli_writes_the_environments_rows_and_its_rubric_scores_their_rollouts(tmp_path, tiny_tokenizer):
    train, test = written_rows(tmp_path, "--option", "n=5")
    assert len(train) == 3 and len(test) == 2
    row = train[0]
    assert row["agent_name"] == "verifiers_agent" and row["data_source"] == "verifiers/hyflow_test_vf_env"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]  # the environment's own prompt
    spec = json.loads(row["extra_info"]["verifiers"])
    assert spec["env_id"] == "hyflow_test_vf_env" and json.loads(spec["options"]) == {"n": 5}
    assert spec["answer"] == adder(row["prompt"][-1]["content"]) == row["reward_model"]["ground_truth"]
    out = play(tmp_path, tiny_tokenizer, train, adder)
    assert list(out["agent_reward"]) == [1.0] * 6  # the environment's rubric scored the policy's answers
    info = out["extra_info"][0]
    assert info["verifiers_metrics"]["exact"] == 1.0 and "agent_error" not in info
    assert out.meta["metrics"]["openai/requests/mean"] == 1.0
    wrong = play(tmp_path, tiny_tokenizer, train, lambda text: "-1")
    assert list(wrong["agent_reward"]) == [0.0] * 6
    # token in, token out: the sample is the engine's tokens for the answer, after the environment's prompt
    mask = out["response_mask"][0].bool()
    assert tiny_tokenizer.decode(out["responses"][0][mask]) == f"{adder(train[0]['prompt'][-1]['content'])}<|im_end|>"


def test_a_tool_environment_calls_its_tool_through_the_endpoint(tmp_path, tiny_tokenizer):
    """verifiers' ToolEnv sends its tool's schema; the policy's hermes call comes back as an OpenAI tool call, the
    environment runs it and asks again; the sample is the whole conversation, the tool turn masked out."""
    train, _ = written_rows(tmp_path, "--option", "tool=true")

    def policy(text):
        if "<tool_response>" in text or "<|im_start|>tool" in text:
            return str(re.findall(r"(\d+)\s*(?:</tool_response>|<\|im_end\|>\n<\|im_start\|>assistant)", text)[-1])
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1])
        return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'

    out = play(tmp_path, tiny_tokenizer, train, policy)
    assert list(out["agent_reward"]) == [1.0] * 6, [i.get("agent_error") for i in out["extra_info"]]
    assert out.meta["metrics"]["openai/requests/mean"] == 2.0
    mask = out["response_mask"][0]
    assert (mask == 0).any() and mask[0] == 1  # the tool's answer is in the sample, masked out


def test_bad_requests_are_named(tmp_path, tiny_tokenizer):
    from hyflow.rollout.verifiers_env import load_env

    with pytest.raises(ValueError, match=r"'no_such_env' is not installed here .*vf-install"):
        load_env("no_such_env")
    with pytest.raises(ValueError, match=r"does not take the options \['colour'\]"):
        load_env("hyflow_test_vf_env", {"colour": "red"})
    train, _ = written_rows(tmp_path)
    for row in train:
        row["extra_info"] = {"index": 0}
    with pytest.raises(RuntimeError, match=r"needs extra_info.verifiers .* `hyflow data verifiers"):
        play(tmp_path, tiny_tokenizer, train, adder)
    assert "verifiers_agent" in AGENT_LOOPS
