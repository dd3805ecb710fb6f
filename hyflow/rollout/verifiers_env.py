"""Environments of the `verifiers` library, trained unchanged: the `verifiers_agent` loop (`hyflow[envs]`).

A verifiers environment runs its rollout against an OpenAI-compatible client and scores it with its rubric. The
`verifiers_agent` loop is an `openai_agent` (`hyflow.rollout.openai_agent`) whose agent function is the
environment's own rollout: each trajectory gets a client pointed at hyflow's loopback endpoint, wrapped as
verifiers' `OpenAIChatCompletionsClient`, and calls `env.run_rollout(input, client, "policy", {})`, which asks the
policy as many times as the environment's protocol says (one turn, tool calls, user turns, ...) and scores the
result with the rubric. The rubric's reward is the sample's score; its metrics go to the sample's `extra_info`
(`verifiers_metrics`); a rollout that verifiers reports as failed (`error`) scores 0 with the error in
`extra_info["agent_error"]`. Token in, token out as for any openai_agent: the ids the engine produced are what is
trained, never a re-tokenisation of the text verifiers saw.

Rows come from `hyflow data verifiers --env ID --out DIR` (`hyflow.data.verifiers`): the environment's prompt
messages, and in `extra_info.verifiers` the env id, its options and the example's answer, info and task. The
environment is loaded once per process per (id, options). Sampling: the rollout's parameters (verifiers' own
sampling arguments are not sent, so the endpoint's refusal of another temperature never fires); the per-turn
token budget is the trajectory's remaining response budget.

Register it in `rollout.agent.agent_loop_config_path` (or use the name: it is built in)::

    - name: verifiers_agent
      _target_: hyflow.rollout.verifiers_env.VerifiersAgentLoop
      sample: concat        # or last
"""

from __future__ import annotations

import json
import math
from typing import Any

from hyflow.rollout.agent_loop import AgentLoopOutput, register
from hyflow.rollout.openai_agent import OpenAIAgentLoop
from hyflow.user_code import optional_package

_ENVS: dict[tuple[str, str], Any] = {}  # (env id, options JSON) -> the loaded environment (one per process)


def _verifiers():
    return optional_package("verifiers", used_by="hyflow data verifiers / the verifiers_agent loop", pip="verifiers")


def load_env(env_id: str, options: dict | str | None = None):
    """The verifiers environment `env_id` built with `options` (a dict or its JSON), cached per process; an id that
    names no environment is a ValueError that says how to install one."""
    vf = _verifiers()
    if isinstance(options, str):
        options = json.loads(options) if options else {}
    key = (env_id, json.dumps(options or {}, sort_keys=True))
    if key not in _ENVS:
        import importlib.util

        module = env_id.replace("-", "_")
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"verifiers environment {env_id!r} is not installed here (no module {module!r}): install "
                             "its package (`vf-install ID`, or pip install it), or put a module of that name "
                             "exposing load_environment(**options) on PYTHONPATH")
        try:
            _ENVS[key] = vf.load_environment(env_id, **(options or {}))
        except Exception as err:  # verifiers wraps what load_environment raised in a RuntimeError
            cause = err.__cause__ or err
            if isinstance(cause, TypeError) and "keyword argument" in str(cause):
                raise ValueError(f"verifiers environment {env_id!r} does not take the options "
                                 f"{sorted(options or {})}: {cause}") from None
            raise ValueError(f"verifiers could not build the environment {env_id!r}: {type(cause).__name__}: "
                             f"{cause}") from err
    return _ENVS[key]


def _spec(sample: dict) -> dict:
    extra = sample.get("extra_info") or {}
    spec = extra.get("verifiers") if isinstance(extra, dict) else None
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, dict) or not spec.get("env_id"):
        raise ValueError("a verifiers_agent row needs extra_info.verifiers (the env id, its options, the example): "
                         "write the rows with `hyflow data verifiers --env ID --out DIR`")
    return spec


async def run_verifiers_rollout(client, sample: dict) -> dict[str, Any]:
    """The agent function of `verifiers_agent`: the row's environment runs its rollout against `client` (an
    `openai.AsyncOpenAI` on hyflow's endpoint) and its rubric scores it."""
    from verifiers.clients import OpenAIChatCompletionsClient

    spec = _spec(sample)
    env = load_env(spec["env_id"], spec.get("options"))
    rollout_input: dict[str, Any] = {"prompt": [dict(m) for m in sample["raw_prompt"]],
                                     "example_id": spec.get("example_id", 0)}
    for key in ("answer", "info", "task"):
        if spec.get(key) is not None:
            rollout_input[key] = spec[key]
    out = await env.run_rollout(rollout_input, OpenAIChatCompletionsClient(client), "policy", {})
    if out.get("error"):
        raise RuntimeError(f"the verifiers environment {spec['env_id']!r} reported its rollout failed: "
                           f"{out['error']}")
    reward = out.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"the verifiers environment {spec['env_id']!r} scored the rollout {reward!r:.80}, not a "
                         "finite number (its rubric's reward functions must return finite floats)")
    metrics = {k: float(v) for k, v in (out.get("metrics") or {}).items()
               if isinstance(v, (int, float)) and math.isfinite(v)}
    return {"score": float(reward), "verifiers_metrics": metrics,
            "verifiers_truncated": bool(out.get("is_truncated", False))}


@register("verifiers_agent")
class VerifiersAgentLoop(OpenAIAgentLoop):
    """An openai_agent whose agent function is the row's verifiers environment (see the module docstring)."""

    def __init__(self, *, sample: str = "concat", **kwargs: Any) -> None:
        if kwargs.get("run") is not None:  # a key that would be ignored: the environment is the agent
            raise ValueError("verifiers_agent runs the row's verifiers environment; drop `run:` from its "
                             "agent_loop_config_path entry (use openai_agent for an agent function of your own)")
        kwargs.pop("run", None)
        super().__init__(run=run_verifiers_rollout, sample=sample, **kwargs)

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        """A row that does not name its environment is a data error: it stops the rollout here, in the trainer's
        process, instead of costing each sample in the agent's (every row of such a dataset would fail alike)."""
        try:
            _spec(row)
        except (ValueError, TypeError) as err:
            raise RuntimeError(f"verifiers_agent: {err}") from err
        return await super().run(sampling_params, **row)
