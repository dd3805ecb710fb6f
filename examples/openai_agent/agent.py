"""An agent written against the OpenAI client, with nothing of hyflow in it: it asks the model, runs the calculator
the model calls (a function-calling loop), asks again with the result, and scores the final `#### value`.

hyflow trains it unchanged (examples/openai_agent/run.py): during each rollout the client's base URL points at
hyflow's OpenAI-compatible endpoint on 127.0.0.1, which serves the current policy and records every request
token-in/token-out, so the whole conversation becomes one training sample and this function's return its score.
Pointed at any OpenAI-compatible server (`python agent.py --base-url URL --model NAME`), it runs as is.
"""

from __future__ import annotations

import ast
import json
import operator
import re

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                       "required": ["expression"]},
    },
}
MAX_CALLS = 2
MODEL = "policy"  # hyflow's endpoint serves the policy under any name; another server needs its own
ANSWER = re.compile(r"####\s*(-?\d+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """+, -, * and parentheses over integers; anything else is an error message for the model to read."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only integers, +, -, * and parentheses")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


async def run(client, sample: dict) -> dict:
    """One episode: the question, up to MAX_CALLS calculator calls, the answer; 1.0 when it is right."""
    messages = list(sample["raw_prompt"])
    calls = 0
    while True:
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls or calls >= MAX_CALLS:
            break
        messages.append({"role": "assistant", "content": message.content or "",
                         "tool_calls": [call.model_dump() for call in message.tool_calls]})
        for call in message.tool_calls:
            calls += 1
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    found = ANSWER.search(message.content or "")
    truth = str(sample["reward_model"]["ground_truth"]).strip()
    return {"score": float(found is not None and found.group(1) == truth), "tool_calls": calls}


if __name__ == "__main__":  # the same agent against any OpenAI-compatible server
    import argparse
    import asyncio

    import openai

    parser = argparse.ArgumentParser(description="run the calculator agent once against an OpenAI-compatible server")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="policy")
    parser.add_argument("--question", default="What is 7634 - 5969? Use the calculator. Put the final answer "
                                              "after '####'.")
    parser.add_argument("--answer", default="1665")
    args = parser.parse_args()
    MODEL = args.model
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused")
    sample = {"raw_prompt": [{"role": "user", "content": args.question}],
              "reward_model": {"ground_truth": args.answer}}
    print(asyncio.run(run(client, sample)))
