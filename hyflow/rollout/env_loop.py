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
(`AgentLoopOutput.reward_score`): the reward function is not called for it.

An environment is user code: whatever it does costs its own episode, never the rollout. Each episode's environment
lives in a forked process of its own (`hyflow.rollout.env_host`), built there and called there with a deadline of
`multi_turn.tool_timeout` per call (the constructor's included), and killed when it misses one. An environment whose
constructor, reset, step or close raises (SystemExit included), hangs, ends its process (``os._exit``,
``posix._exit``, a signal, a crash) or whose step returns a reward that is not a finite number, an info that is not
a dict, or another shape, ends its episode: the sample scores 0 (its return so far stays in
`extra_info["env_return"]`), the error is named in `extra_info["env_error"]`, and it is counted in `env/errors` or
`env/timeouts`. The model's first turn is generated even when the environment fails before it, so every row is a
trajectory. An observation longer than `multi_turn.max_env_observation_length` characters is cut (at
`multi_turn.tool_response_truncate_side`, with a note) in the environment's process, before it is sent or
tokenised. A name that resolves to no environment class stops the run (a configuration error).
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from typing import Any

from hyflow.registry import Registry
from hyflow.rollout.agent_loop import AgentLoopOutput, register
from hyflow.rollout.env_host import EnvCallFailed, EnvHost
from hyflow.rollout.tool_agent import ToolAgentLoop

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
        self.max_observation_length = int(self.rollout_config.multi_turn.max_env_observation_length)

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
        env_class = resolve_env(row.get("env_class") or self.env_spec)  # a name that resolves to nothing stops the run
        request_id = uuid.uuid4().hex
        host: EnvHost | None = None

        async def generate() -> Any:
            nonlocal turns, response_ids, mask, logprobs
            left = self.response_length - len(response_ids)
            out = await self.server_manager.generate(request_id, prompt_ids=prompt_ids + response_ids,
                                                     sampling_params={**sampling_params, "max_tokens": left})
            response_ids += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += out.log_probs if out.log_probs is not None else [0.0] * len(out.token_ids)
            turns += 1
            return out

        try:
            host = await self._start(env_class, kwargs, {k: v for k, v in row.items() if k != "raw_prompt_ids"},
                                     metrics)
            await self._call(host, metrics, "reset")
            while len(response_ids) < self.response_length:
                out = await generate()
                action = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": action})
                observation, reward, done, info = await self._call(host, metrics, "step", action)
                steps += 1
                if not math.isfinite(total + reward):
                    metrics["env_errors"] += 1
                    raise _EnvFailure(f"environment step returned the reward {reward}, which takes the episode's "
                                      f"return {total} past a float's range")
                total += reward
                for key, value in info.items():
                    info_numbers.setdefault(key, []).append(value)
                if done or not observation or len(response_ids) >= self.response_length:
                    break
                if self.max_assistant_turns and turns >= self.max_assistant_turns:
                    break
                ended_with_eos = bool(out.token_ids) and out.token_ids[-1] == self.tokenizer.eos_token_id
                new = [{"role": "user", "content": observation}]
                delta = self._render_delta(messages, new, ended_with_eos=ended_with_eos)
                if len(response_ids) + len(delta) >= self.response_length:
                    break
                messages += new
                response_ids += delta
                mask += [0] * len(delta)
                logprobs += [0.0] * len(delta)
                user_turns += 1
        except _EnvFailure as failure:
            extra["env_error"] = str(failure)
            if not response_ids:  # the environment failed before the first turn: the row still gets the model's
                await generate()
        finally:
            if host is not None:
                try:
                    if not host.dead:
                        with contextlib.suppress(_EnvFailure):  # counted in env/errors; the episode is over anyway
                            await self._call(host, metrics, "close")
                finally:  # the rollout may be cancelled meanwhile: the child is killed whatever happens
                    host.close()
                await host.wait_closed()
        metrics["env_steps"] = steps
        metrics["env_info"] = {k: sum(v) / len(v) for k, v in info_numbers.items()}
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids[: self.response_length],
                               response_mask=mask[: self.response_length],
                               response_logprobs=logprobs[: self.response_length],
                               num_turns=1 + turns + user_turns, metrics=metrics,
                               reward_score=0.0 if "env_error" in extra else total,
                               extra_fields={**extra, "env_return": total, "env_steps": steps})

    async def _start(self, env_class: type, kwargs: dict, sample: dict, metrics: dict) -> EnvHost:
        """The episode's `EnvHost` (its environment built in a child process); a failure is an _EnvFailure."""
        start = time.perf_counter()
        try:
            return await EnvHost.start(env_class, kwargs, sample, timeout=self.tool_timeout,
                                       max_observation_chars=self.max_observation_length,
                                       truncate_side=self.truncate_side)
        except EnvCallFailed as err:
            raise self._failure(err, metrics, "constructor") from None
        finally:
            metrics["env_seconds"] += time.perf_counter() - start

    async def _call(self, host: EnvHost, metrics: dict, what: str, *args):
        """`host.call(what, *args)` with the tool calls' timeout; a failure is an _EnvFailure."""
        start = time.perf_counter()
        try:
            return await host.call(what, *args, timeout=self.tool_timeout)
        except EnvCallFailed as err:
            raise self._failure(err, metrics, what) from None
        finally:
            metrics["env_seconds"] += time.perf_counter() - start

    def _failure(self, err: EnvCallFailed, metrics: dict, what: str) -> _EnvFailure:
        """The episode's error for a failed call, counted in env_timeouts or env_errors."""
        if err.kind == "timeout":
            metrics["env_timeouts"] += 1
            return _EnvFailure(f"environment {what} timed out after {self.tool_timeout} s (multi_turn.tool_timeout)")
        metrics["env_errors"] += 1
        return _EnvFailure(f"environment {what} {err}")


class _EnvFailure(Exception):
    pass
