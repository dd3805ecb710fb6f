"""Environments as agent loops: a Gymnasium-style text environment seat and the `env_agent` loop that runs it.

An environment is a class with Gymnasium's two methods, over text (sync or `async def`):

    reset(sample) -> None            prepare an episode from the dataset row (its columns: extra_info, ground truth,
                                     ...); the first observation is the row's prompt, which the policy answers first
    step(action) -> (observation, reward, done, info)
                                     `action`: the model's turn as text; `observation`: the text of the next user
                                     turn (None or "" ends the episode); `reward`: a number; `done`: the episode is
                                     over; `info`: a dict (its numbers are logged as env/<key>/mean)
    close()                          optional; called once the episode ends, whatever happened

so environment libraries plug in without writing an agent loop. `@register_env("name")` registers a class; a row
picks it with an `env_class` column (SkyRL's name), else the loop's `env` argument does (an agent-loop YAML entry
`- name: my_env_agent` / `_target_: hyflow.rollout.env_loop.EnvAgentLoop` / `env: my_envs.py:Maze`); the row's
`env_kwargs` (or `extra_info.env_kwargs`) and the YAML's `env_kwargs` go to its constructor.

The `env_agent` loop: generate a turn, `step` it, append the observation as a user turn (token in, token out, mask
0, rendered by the chat template as the tool agent's turns are), and repeat until `done`, the response budget, or
`multi_turn.max_assistant_turns`. The episode's return (the sum of the step rewards) is the trajectory's score
(`AgentLoopOutput.reward_score`): the reward function is not called for it. Each environment call runs with the
tool calls' protection (`multi_turn.tool_timeout`, on a thread that a hung call cannot hold): an environment that
raises or times out ends the episode with the return so far, counted in `env/errors` / `env/timeouts` and named
in the sample's `extra_info["env_error"]`.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from hyflow.registry import Registry
from hyflow.rollout.agent_loop import AgentLoopOutput, register
from hyflow.rollout.tool_agent import ToolAgentLoop
from hyflow.tools.runner import ToolThreadsExhausted

ENVS = Registry("environment", hint="Register one with @hyflow.rollout.env_loop.register_env(name), or name a "
                                    "class as path/to/file.py:Class or package.module.Class.",
                lazy={"skyrl": "hyflow.rollout.skyrl_env:SkyRLEnv",  # SkyRL-Gym's environments (hyflow[envs])
                      "textarena": "hyflow.rollout.textarena_env:TextArenaEnv"})  # TextArena's games (same)


def register_env(name: str):
    """Register a text environment class under `name` (a row's `env_class` column picks it)."""
    return ENVS.register(name)


def resolve_env(spec: Any):
    """The environment class `spec` names: a registered name, `file.py:Class` or `package.module.Class`, or a
    class itself."""
    if isinstance(spec, type):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"env_agent: no environment: give the rows an env_class column or the loop an `env` "
                         f"argument (got {spec!r})")
    if spec in ENVS:
        return ENVS.get(spec)
    if ":" in spec or "." in spec:
        from hyflow.user_code import load_object

        return load_object(spec, what="environment class", config_key="env_class (or the env_agent loop's env)",
                           require="class")
    raise ENVS.unknown(spec, " (the row's env_class, or the env_agent loop's env argument)")


@register("env_agent")
class EnvAgentLoop(ToolAgentLoop):
    """Runs one episode of a text environment per trajectory (see the module docstring)."""

    scores_trajectories = True  # its output carries reward_score: rows it runs need no reward function

    def __init__(self, *, env: Any = None, env_kwargs: dict | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.env_spec, self.env_kwargs = env, dict(env_kwargs or {})

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        prompt_ids = list(row["raw_prompt_ids"])
        messages = [dict(m) for m in row["raw_prompt"]]
        response_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        total, steps, turns, user_turns = 0.0, 0, 0, 0
        info_numbers: dict[str, list[float]] = {}
        extra: dict[str, Any] = {}
        metrics: dict[str, Any] = {"env_errors": 0, "env_timeouts": 0, "env_seconds": 0.0}
        extra_info = row.get("extra_info") or {}
        kwargs = {**self.env_kwargs, **(extra_info.get("env_kwargs") or {}), **(row.get("env_kwargs") or {})}
        env = resolve_env(row.get("env_class") or self.env_spec)(**kwargs)
        request_id = uuid.uuid4().hex
        try:
            reset = getattr(env, "reset", None)  # optional: an environment may need no preparation
            if reset is not None:
                await self._call(reset, metrics, "reset", {k: v for k, v in row.items() if k != "raw_prompt_ids"})
            while True:
                left = self.response_length - len(response_ids)
                if left <= 0:
                    break
                out = await self.server_manager.generate(request_id, prompt_ids=prompt_ids + response_ids,
                                                         sampling_params={**sampling_params, "max_tokens": left})
                response_ids += out.token_ids
                mask += [1] * len(out.token_ids)
                logprobs += out.log_probs if out.log_probs is not None else [0.0] * len(out.token_ids)
                turns += 1
                action = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": action})
                result = await self._call(env.step, metrics, "step", action)
                try:
                    observation, reward, done, info = _step_result(result)
                except _EnvFailure:
                    metrics["env_errors"] += 1
                    raise
                steps += 1
                total += reward
                for key, value in info.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        info_numbers.setdefault(key, []).append(float(value))
                if done or not observation or len(response_ids) >= self.response_length:
                    break
                if self.max_assistant_turns and turns >= self.max_assistant_turns:
                    break
                ended_with_eos = bool(out.token_ids) and out.token_ids[-1] == self.tokenizer.eos_token_id
                new = [{"role": "user", "content": str(observation)}]
                delta = self._render_delta(messages, new, ended_with_eos=ended_with_eos)
                if len(response_ids) + len(delta) >= self.response_length:
                    break
                messages += new
                response_ids += delta
                mask += [0] * len(delta)
                logprobs += [0.0] * len(delta)
                user_turns += 1
        except ToolThreadsExhausted:
            raise
        except _EnvFailure as failure:
            extra["env_error"] = str(failure)
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                with contextlib.suppress(_EnvFailure):  # counted in env/errors; the episode is over anyway
                    await self._call(close, metrics, "close")
        metrics["env_steps"] = steps
        metrics["env_info"] = {k: sum(v) / len(v) for k, v in info_numbers.items()}
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids[: self.response_length],
                               response_mask=mask[: self.response_length],
                               response_logprobs=logprobs[: self.response_length],
                               num_turns=1 + turns + user_turns, reward_score=total, metrics=metrics,
                               extra_fields={**extra, "env_return": total, "env_steps": steps})

    async def _call(self, method, metrics: dict, what: str, *args):
        """`method(*args)` (sync or async) with the tool calls' timeout; a raise or a timeout is an _EnvFailure."""
        start = time.perf_counter()
        label = f"environment {what}"

        def make():
            return method(*args)

        try:
            return await self.tool_runner.run(make, self.tool_timeout, label)  # awaits what an async method returns
        except ToolThreadsExhausted:
            raise
        except TimeoutError as err:
            metrics["env_timeouts"] += 1
            raise _EnvFailure(f"{label} timed out after {self.tool_timeout} s (multi_turn.tool_timeout)") from err
        except (Exception, SystemExit) as err:
            metrics["env_errors"] += 1
            raise _EnvFailure(f"{label} raised {type(err).__name__}: {err}") from err
        finally:
            metrics["env_seconds"] += time.perf_counter() - start


class _EnvFailure(Exception):
    pass


def _step_result(result: Any) -> tuple[str | None, float, bool, dict]:
    """(observation, reward, done, info) from what `step` returned: Gymnasium's 4-tuple, its 5-tuple (observation,
    reward, terminated, truncated, info), or a mapping with those keys."""
    if isinstance(result, dict):
        done = bool(result.get("done") or result.get("terminated") or result.get("truncated"))
        return result.get("observation"), float(result.get("reward") or 0.0), done, dict(result.get("info") or {})
    if isinstance(result, tuple) and len(result) == 5:
        observation, reward, terminated, truncated, info = result
        return observation, float(reward or 0.0), bool(terminated or truncated), dict(info or {})
    if isinstance(result, tuple) and len(result) == 4:
        observation, reward, done, info = result
        return observation, float(reward or 0.0), bool(done), dict(info or {})
    raise _EnvFailure(f"environment step returned {type(result).__name__}; return (observation, reward, done, "
                      "info) or Gymnasium's (observation, reward, terminated, truncated, info)")
