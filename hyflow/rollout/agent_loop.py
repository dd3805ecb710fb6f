"""The agent loop: every sample is a trajectory that an async loop drives turn by turn over one rollout engine.

`AgentLoopManager.generate(prompts, params)` replaces a bare `engine.generate` call (the actor worker calls it on
its share of the prompts). Each of the B x n samples runs the agent loop named by its `agent_name` column
(`rollout.agent.default_agent_loop` when empty): `single_turn_agent` (one generation: exactly today's single-turn
rollout) or `tool_agent` (generate, parse tool calls, run the tools, append their answers, generate again ...),
or a loop registered with `@register(name)` / `rollout.agent.agent_loop_config_path`.

Token in, token out. A trajectory's response is the concatenation of the token ids the engine generated and the
token ids of the appended tool / user turns; nothing the model generated is ever re-tokenised. An appended turn
is the chat template's text for the new messages (the difference between the rendered conversation with and
without them, plus the text the template puts after the model's end-of-turn token, ChatML's newline), tokenised
alone. `response_mask` is 1 on model tokens only; `rollout_log_probs` are the engine's on those tokens and 0 on
the rest; `attention_mask` covers every response token. The response budget (`rollout.response_length`) counts
all of them: a turn may generate at most what is left, and a tool answer that would not fit ends the trajectory
before it is appended (verl's rule), so a trajectory always ends on model tokens.

Batching. The trajectories' generation requests go to one `BatchingServer`, which decodes every request that is
waiting in one engine call as soon as no trajectory can make progress without it (all live trajectories are
waiting for the engine): requests in trajectory order, each with its own budget (the engines' per-prompt
`max_new_tokens` column). This makes the batches as large as they can be and the samples a function of the seed
alone: call k of a rollout uses seed + k * 1_000_033. The first call holds every trajectory's first turn; the n
samples of a prompt go to the engine as one prompt with n samples, so a single-turn rollout is exactly the engine
call it replaced (same samples for the same seed). A tool that takes long holds back the next batch (every tool
call has a timeout: `rollout.multi_turn.tool_timeout`). With `rollout.agent.batching=eager` the server instead
calls the engine as soon as it is free with every request waiting then, on a thread of its own, so the event loop
keeps running tools and interactions meanwhile: a slow tool or a long answer holds back only its own trajectory,
at the price of smaller calls and samples that depend on the timing (which requests share call k).

Never crash on the policy's output: a malformed call, an unknown tool, arguments that do not fit the tool's
schema, a tool that raises (SystemExit included), returns garbage or times out all become an `error: ...` text in
the tool turn and a counted metric (`tool/malformed_calls`, `tool/unknown_tools`, `tool/bad_arguments`,
`tool/errors`, `tool/timeouts`). Errors in the configuration (an unknown agent name, a missing interaction) stop
the run before anything is generated, with the fix.

Tools cannot stall or hang the rollout. Every tool method call (create + execute, calc_reward, release) runs on a
worker thread of the manager's `ToolRunner`, in an event loop of its own, so a tool that blocks (``time.sleep``
in ``async execute``, a synchronous client, a wait that never returns) holds only its own thread: the other
trajectories go on, the call is answered with the timeout error at `multi_turn.tool_timeout` (counted from the
call's start), and `generate()` returns without waiting for it. A thread still blocked after its call was
abandoned is counted in `tool/stuck_threads` (per rollout worker) and warned about; Python cannot kill it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.registry import Registry
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.output import assemble_rollout
from hyflow.rollout.tool_parser import (
    FunctionCall,
    MalformedCall,
    ToolParser,
    check_arguments,
    make_tool_parser,
)
from hyflow.tools.runner import DaemonExecutor, ToolRunner, ToolThreadsExhausted, ToolTimeout
from hyflow.user_code import load_object

SEED_STRIDE = 1_000_033  # engine call k of one rollout samples with seed + k * SEED_STRIDE


# ---------------------------------------------------------------------------------------------- data types
@dataclass
class TokenOutput:
    """One generation: the new token ids, their log-probs (None when not asked for) and why it stopped:
    "stop" (an end-of-sequence or stop token) or "length" (the request's budget)."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str


@dataclass
class AgentLoopOutput:
    """What an agent loop returns for one trajectory (verl's AgentLoopOutput fields)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 = generated by the model, 0 = tool / user / template tokens
    response_logprobs: list[float] | None = None
    num_turns: int = 2  # messages in the conversation: user prompt + assistant turns + tool/user turns
    # the trajectory's score when the loop computes it (an environment's return, an external agent's reward): it
    # replaces the reward function for this sample (the batch column `agent_reward`; hyflow.rewards.agent_rewards)
    reward_score: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- registry
AGENT_LOOPS = Registry("agent loop", hint="Register one with @hyflow.rollout.agent_loop.register(name) or "
                                          "rollout.agent.agent_loop_config_path.",
                       lazy={"env_agent": "hyflow.rollout.env_loop:EnvAgentLoop",
                             "openai_agent": "hyflow.rollout.openai_agent:OpenAIAgentLoop"})
AGENT_LOOP_KWARGS: dict[str, dict[str, Any]] = {}


def register(name: str):
    """Register an agent loop class under `name` (the `agent_name` column of a row picks it); verl's decorator."""
    return AGENT_LOOPS.register(name)


def load_agent_loop_config(path: str | None) -> None:
    """Register the loops of a verl `agent_loop_config_path` YAML: a list of `{name, _target_: module.Class,
    **kwargs}` (`_target_` may also be `path/to/file.py:Class`, looked up from the current directory, then the
    YAML's); the extra keys are passed to the loop's constructor. A name already registered is replaced."""
    if not path:
        return
    from omegaconf import OmegaConf

    where = f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}"
    try:
        entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except FileNotFoundError as err:
        raise ValueError(f"{where}: no such file") from err
    if not isinstance(entries, list):
        raise ValueError(f"{where}: the file must hold a list of {{name: ..., _target_: module.Class}} entries")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "name" not in entry or "_target_" not in entry:
            raise ValueError(f"{where}: entry {i} needs `name` and `_target_` (module.Class), got {entry!r}")
        entry = dict(entry)
        name, target = entry.pop("name"), entry.pop("_target_")
        AGENT_LOOPS[name] = load_object(target, what="agent loop class", config_key=f"{where} entry {i}: _target_",
                                        require="class", base=AgentLoopBase, methods=("run",),
                                        search=(Path.cwd(), Path(path).parent))
        AGENT_LOOP_KWARGS[name] = entry


def agent_loop_names() -> list[str]:
    """Every registered agent loop name, sorted."""
    return AGENT_LOOPS.names()


# ---------------------------------------------------------------------------------------------- the server
@dataclass
class _Request:
    index: int  # trajectory index (order of the output rows)
    group: tuple  # requests with equal group keys in one call share their prompt (the n samples of turn 1)
    prompt_ids: list[int]
    budget: int
    future: asyncio.Future


class BatchingServer:
    """Decodes the waiting requests of many trajectories together (see the module docstring).

    `live` trajectories are running; when every one of them waits for the engine, the waiting requests are
    decoded in one engine call (seeded with seed + k * SEED_STRIDE for the k-th call).
    """

    _request_type: type = _Request  # what `generate` queues (a subclass may queue its own kind)

    def __init__(self, engine, params: SamplingParams, pad_token_id: int, eos_token_ids: Sequence[int],
                 prompts: Batch | None = None, *, eager: bool = False) -> None:
        self.engine, self.params, self.pad_token_id = engine, params, pad_token_id
        self.eager = eager  # call the engine whenever it is free (rollout.agent.batching=eager)
        self.stop_ids = set(eos_token_ids) | set(params.stop_token_ids)
        self.prompts = prompts  # the original prompt batch: turn-1 calls reuse its padded rows unchanged
        self.live = 0
        self.waiting: list[_Request] = []
        self.calls = 0
        self.batch_sizes: list[int] = []
        self.seconds = 0.0
        self.tokens = 0  # generated so far (the progress callback reports it)
        self._ready: asyncio.Event | None = None

    def _due(self) -> bool:
        """Whether the waiting requests go to the engine now: all live trajectories wait (barrier), or any (eager)."""
        return bool(self.waiting) and (self.eager or len(self.waiting) >= self.live)

    def _check(self) -> None:
        """Wake `serve` when the waiting requests are due, or when no trajectory is left."""
        if self._ready is not None and (self.live <= 0 or self._due()):
            self._ready.set()

    def finished_one(self) -> None:
        self.live -= 1
        self._check()

    async def generate(self, index: int, prompt_ids: list[int], budget: int, group: tuple | None = None
                       ) -> TokenOutput:
        budget = max(1, min(int(budget), self.params.max_new_tokens))
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(self._request_type(index, group if group is not None else ("own", index),
                                               list(prompt_ids), budget, future))
        self._check()
        return await future

    async def serve(self) -> None:
        """Run until every trajectory has finished."""
        self._ready = asyncio.Event()
        self._check()
        engine_thread = None
        if self.eager:  # the engine runs on this thread while the event loop runs tools and interactions
            from concurrent.futures import ThreadPoolExecutor

            engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyflow-engine")
        try:
            while self.live > 0:
                await self._ready.wait()
                self._ready.clear()
                if self._due():
                    requests, self.waiting = sorted(self.waiting, key=lambda r: r.index), []
                    if engine_thread is None:
                        outputs = self._decode_or_fail(requests)
                    else:
                        try:
                            outputs = await asyncio.get_running_loop().run_in_executor(engine_thread, self._decode,
                                                                                      requests)
                        except BaseException as err:
                            self._fail(requests, err)  # futures are set on the event loop's thread
                            raise
                    for request, output in zip(requests, outputs):
                        if not request.future.done():
                            request.future.set_result(output)
                    self._check()  # requests that arrived during the call are due now
        finally:
            if engine_thread is not None:
                engine_thread.shutdown(wait=True)

    def _decode_or_fail(self, requests: list[_Request]) -> list[TokenOutput]:
        """`_decode`; when it raises, every request not yet done gets the error (its trajectory stops with it)."""
        try:
            return self._decode(requests)
        except BaseException as err:
            self._fail(requests, err)
            raise

    @staticmethod
    def _fail(requests: list[_Request], err: BaseException) -> None:
        for request in requests:
            if not request.future.done():
                request.future.set_exception(err)

    def _decode(self, requests: list[_Request]) -> list[TokenOutput]:
        # runs of requests sharing a group key (a prompt's n first turns) go in as one prompt with n samples
        runs: list[list[_Request]] = []
        for request in requests:
            if runs and runs[-1][0].group == request.group and runs[-1][0].budget == request.budget:
                runs[-1].append(request)
            else:
                runs.append([request])
        n = len(runs[0])
        if any(len(run) != n for run in runs):
            runs, n = [[r] for r in requests], 1
        heads = [run[0] for run in runs]
        batch = self._prompt_batch(heads)
        seed = None if self.params.seed is None else self.params.seed + self.calls * SEED_STRIDE
        params = dataclasses.replace(self.params, n=n, seed=seed)
        start = time.perf_counter()
        out = self.engine.generate(batch, params)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.batch_sizes.append(len(requests))
        lengths = out["response_mask"].sum(-1).tolist()
        self.tokens += int(sum(lengths))
        logprobs = out["rollout_log_probs"] if "rollout_log_probs" in out else None  # noqa: SIM401 (Batch)
        outputs = []
        for row, length in enumerate(lengths):
            ids = out["responses"][row, :length].tolist()
            budget = heads[row // n].budget
            stopped = bool(ids) and ids[-1] in self.stop_ids
            outputs.append(TokenOutput(ids, None if logprobs is None else logprobs[row, :length].tolist(),
                                       "stop" if stopped or length < budget else "length"))
        return outputs

    def _prompt_batch(self, heads: list[_Request]) -> Batch:
        original = self.prompts
        if original is not None and all(r.group[0] == "prompt" for r in heads):
            rows = [r.group[1] for r in heads]  # first turns: the original padded rows, as the engine saw them
            batch = Batch({"input_ids": original["input_ids"][rows], "attention_mask": original["attention_mask"][rows]})
        else:
            width = max(len(r.prompt_ids) for r in heads)
            input_ids = torch.full((len(heads), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(heads), width), dtype=torch.long)
            for i, r in enumerate(heads):
                input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
                mask[i, width - len(r.prompt_ids):] = 1
            batch = Batch({"input_ids": input_ids, "attention_mask": mask})
        budgets = torch.tensor([r.budget for r in heads], dtype=torch.long)
        if bool((budgets != self.params.max_new_tokens).any()):
            batch["max_new_tokens"] = budgets
        return batch


class ServerHandle:
    """What an agent loop sees (verl's `server_manager`): `await generate(request_id, prompt_ids=...,
    sampling_params=...)` -> TokenOutput. `sampling_params["max_tokens"]` caps the new tokens of this call
    (default: what is left of the trajectory's response budget, as verl's server computes it)."""

    def __init__(self, server: BatchingServer, index: int, prompt_row: int | None, response_length: int) -> None:
        self._server, self.index, self._prompt_row = server, index, prompt_row
        self.response_length = response_length
        self._calls = 0

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids at which the engine ends a turn (EOS ids and the sampling params' stop ids)."""
        return frozenset(self._server.stop_ids)

    async def generate(self, request_id: str | None = None, *, prompt_ids: list[int],
                       sampling_params: dict | None = None, **_: Any) -> TokenOutput:
        budget = (sampling_params or {}).get("max_tokens") or self.response_length
        first = self._calls == 0 and self._prompt_row is not None
        self._calls += 1
        group = ("prompt", self._prompt_row) if first else None
        return await self._server.generate(self.index, prompt_ids, budget, group)


# ---------------------------------------------------------------------------------------------- loops
class AgentLoopBase:
    """Base class of agent loops (verl's AgentLoopBase): one instance per trajectory.

    Attributes: `server_manager` (ServerHandle), `tokenizer`, `rollout_config` (the rollout config section),
    `tools` (name -> BaseTool), `tool_parser`, `interactions` (name -> BaseInteraction), `response_length`,
    `chat_template_kwargs`, `tool_runner` (runs tool calls with a real timeout: `await
    tool_runner.run(lambda: tool.execute(...), timeout, label)`). Implement `async run(sampling_params, **row) -> AgentLoopOutput`; `row` holds the
    sample's columns (`raw_prompt` messages, `raw_prompt_ids`, `tools_kwargs`, `interaction_kwargs`,
    `extra_info`, ...)."""

    def __init__(self, *, server_manager: ServerHandle, tokenizer, rollout_config, tools: dict | None = None,
                 tool_parser: ToolParser | None = None, interactions: dict | None = None,
                 chat_template_kwargs: dict | None = None, tool_runner: ToolRunner | None = None,
                 **kwargs: Any) -> None:
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.rollout_config = rollout_config
        self.tools = tools or {}
        self.tool_parser = tool_parser
        self.interactions = interactions or {}
        self.response_length = int(rollout_config.response_length)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.tool_runner = tool_runner if tool_runner is not None else _shared_tool_runner()
        self.loop_kwargs = kwargs

    # True for a loop whose outputs always carry reward_score (env_agent): the trainer then needs no reward function
    # for its rows (no scorer check at start)
    scores_trajectories: bool = False
    # True for a loop whose trajectories may start from another prompt than the row's (openai_agent: the external
    # agent writes its own messages); each of its rows then keeps the prompt it returned
    may_change_prompt: bool = False

    # A loop class may define `async start_rollout(cls, manager, params) -> dict` (run once per rollout that has its
    # rows, before the trajectories start; the dict goes to each instance's constructor) and `async
    # end_rollout(cls, kwargs)` (after they end, whatever happened): openai_agent starts and stops its endpoint so.

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raise NotImplementedError


_SHARED_RUNNER: list[ToolRunner] = []


def _shared_tool_runner() -> ToolRunner:
    """The process's ToolRunner for agent loops built without one (outside `AgentLoopManager`)."""
    if not _SHARED_RUNNER:
        _SHARED_RUNNER.append(ToolRunner())
    return _SHARED_RUNNER[0]


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One generation from the prompt's token ids: the single-turn rollout."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prompt_ids = list(kwargs["raw_prompt_ids"])
        out = await self.server_manager.generate(prompt_ids=prompt_ids, sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                               response_logprobs=out.log_probs, num_turns=2,
                               extra_fields={"turn_scores": [], "tool_rewards": []})


@dataclass
class AgentData:
    """A trajectory's state; tools receive it as `agent_data` (verl passes its AgentData the same way)."""

    messages: list[dict[str, Any]]
    request_id: str
    tools_kwargs: dict[str, Any]
    interaction_kwargs: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    tool_instances: dict[str, str] = field(default_factory=dict)  # tool name -> instance id
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)


_COUNTERS = ("tool_calls", "malformed_calls", "unknown_tools", "bad_arguments", "tool_errors", "tool_timeouts",
             "dropped_calls")


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Generate -> parse tool calls -> run them (at most `max_parallel_calls` at once) -> append the answers as
    `tool` messages -> generate again; an assistant turn without a call goes to the sample's interaction (when it
    has one: its answer becomes a `user` turn, `should_terminate` ends the trajectory) or ends the trajectory.
    Also ends at `max_assistant_turns`, `max_user_turns` or when the response budget is spent."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        mt = self.rollout_config.multi_turn
        self.max_assistant_turns = mt.max_assistant_turns
        self.max_user_turns = mt.max_user_turns
        self.max_parallel_calls = max(1, int(mt.max_parallel_calls))
        self.max_tool_response_length = int(mt.max_tool_response_length)
        self.truncate_side = mt.tool_response_truncate_side
        self.tool_timeout = float(mt.tool_timeout)  # validated > 0 with the config
        self.tool_schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                             for t in self.tools.values()]
        if self.tool_parser is None:
            self.tool_parser = make_tool_parser(mt.format, self.tokenizer)
            self.tool_parser.set_tools(self.tool_schemas)
        # a turn's closing ids, dropped before it is parsed (a server manager of verl's shape may not say them)
        self.end_ids = getattr(self.server_manager, "stop_ids", frozenset())

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        data = AgentData(messages=[dict(m) for m in kwargs["raw_prompt"]], request_id=uuid.uuid4().hex,
                         tools_kwargs=dict(kwargs.get("tools_kwargs") or {}),
                         interaction_kwargs=dict(kwargs.get("interaction_kwargs") or {}),
                         prompt_ids=list(kwargs["raw_prompt_ids"]))
        data.metrics.update({key: 0 for key in _COUNTERS}, tool_seconds=0.0, tool_latencies=[])
        interaction = self._interaction(data)
        instance = None
        if interaction is not None:
            instance = await interaction.start_interaction(data.request_id, **data.interaction_kwargs)
        try:
            await self._turns(data, sampling_params, interaction, instance)
        finally:
            await self._release_tools(data)
            if interaction is not None:
                await interaction.finalize_interaction(instance)
        return AgentLoopOutput(
            prompt_ids=data.prompt_ids, response_ids=data.response_ids[: self.response_length],
            response_mask=data.response_mask[: self.response_length],
            response_logprobs=data.response_logprobs[: self.response_length] if data.response_logprobs else None,
            num_turns=data.assistant_turns + data.user_turns + 1, metrics=data.metrics,
            extra_fields={**data.extra_fields, "turn_scores": data.turn_scores, "tool_rewards": data.tool_rewards})

    def _interaction(self, data: AgentData):
        name = data.interaction_kwargs.get("name")
        if not self.interactions or (name is None and not data.interaction_kwargs):
            return None
        if name is None and len(self.interactions) == 1:
            return next(iter(self.interactions.values()))
        if name not in self.interactions:
            raise ValueError(f"interaction_kwargs.name={name!r} names no interaction of "
                             f"multi_turn.interaction_config_path (known: {', '.join(sorted(self.interactions))})")
        return self.interactions[name]

    async def _turns(self, data: AgentData, sampling_params: dict, interaction, instance) -> None:
        while True:
            left = self.response_length - len(data.response_ids)
            if left <= 0:
                return
            start = time.perf_counter()
            out = await self.server_manager.generate(data.request_id, prompt_ids=data.prompt_ids + data.response_ids,
                                                     sampling_params={**sampling_params, "max_tokens": left})
            data.metrics["generate_seconds"] = data.metrics.get("generate_seconds", 0.0) + time.perf_counter() - start
            data.response_ids += out.token_ids
            data.response_mask += [1] * len(out.token_ids)
            data.response_logprobs += out.log_probs if out.log_probs is not None else [0.0] * len(out.token_ids)
            data.assistant_turns += 1
            if len(data.response_ids) >= self.response_length:
                return
            if self.max_assistant_turns and data.assistant_turns >= self.max_assistant_turns:
                return
            if self.max_user_turns and data.user_turns >= self.max_user_turns:
                return
            parsed = self.tool_parser.parse_ids(out.token_ids, end_ids=self.end_ids)
            calls: list[FunctionCall | MalformedCall] = [*parsed.calls, *parsed.malformed]
            data.messages.append(self._assistant_message(parsed.content, parsed.calls))
            if calls:
                if len(calls) > self.max_parallel_calls:
                    data.metrics["dropped_calls"] += len(calls) - self.max_parallel_calls
                    calls = calls[: self.max_parallel_calls]
                start = time.perf_counter()
                answers = await asyncio.gather(*(self._call_tool(call, data) for call in calls))
                data.metrics["tool_seconds"] += time.perf_counter() - start
                new = []
                for call, text_answer in zip(calls, answers):
                    message = {"role": "tool", "content": text_answer}
                    if isinstance(call, FunctionCall) and call.tool_call_id is not None:
                        message["tool_call_id"] = call.tool_call_id
                    new.append(message)
            elif interaction is not None:
                terminate, reply, score, _ = await interaction.generate_response(
                    instance, data.messages, **data.interaction_kwargs)
                data.turn_scores.append(float(score))
                data.user_turns += 1
                if terminate:
                    return
                new = [{"role": "user", "content": reply}]
            else:
                return
            ended_with_eos = bool(out.token_ids) and out.token_ids[-1] == self.tokenizer.eos_token_id
            delta = self._render_delta(data.messages, new, ended_with_eos=ended_with_eos)
            if len(data.response_ids) + len(delta) >= self.response_length:
                return  # verl: a turn that does not fit ends the trajectory before it is appended
            data.messages += new
            data.response_ids += delta
            data.response_mask += [0] * len(delta)
            data.response_logprobs += [0.0] * len(delta)
            if calls:
                data.user_turns += 1

    @staticmethod
    def _assistant_message(content: str, calls: list[FunctionCall]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                                      **({"id": c.tool_call_id} if c.tool_call_id else {})} for c in calls]
        return message

    # ------------------------------------------------------------------ tools
    async def _call_tool(self, call: FunctionCall | MalformedCall, data: AgentData) -> str:
        if isinstance(call, MalformedCall):
            data.metrics["malformed_calls"] += 1
            return f"error: malformed tool call: {call.reason}"
        data.metrics["tool_calls"] += 1
        tool = self.tools.get(call.name)
        if tool is None:
            data.metrics["unknown_tools"] += 1
            known = ", ".join(sorted(self.tools)) or "none"
            return f"error: unknown tool {call.name!r}; available tools: {known}"
        arguments = call.parsed_arguments()
        problem = check_arguments(arguments, tool.tool_schema.function.parameters.model_dump(exclude_none=True))
        if problem is not None:
            data.metrics["bad_arguments"] += 1
            return f"error: {call.name}: {problem}"
        timeout = float((getattr(tool, "config", None) or {}).get("timeout") or self.tool_timeout)
        start = time.perf_counter()

        async def create_and_execute():  # runs on a tool thread (see the module docstring)
            instance_id = await self._instance(tool, data)
            return await tool.execute(instance_id, arguments, agent_data=data)

        try:
            result = await self.tool_runner.run(create_and_execute, timeout, f"tool {call.name!r} (execute)")
        except ToolTimeout:
            data.metrics["tool_timeouts"] += 1
            return f"error: tool {call.name!r} timed out after {timeout:g} s"
        except ToolThreadsExhausted:
            raise
        except (Exception, SystemExit) as err:  # the tool's own failure: the model reads it, the step goes on
            data.metrics["tool_errors"] += 1
            return f"error: tool {call.name!r} raised {type(err).__name__}: {err}"
        finally:
            data.metrics["tool_latencies"].append(time.perf_counter() - start)
        text, reward = _tool_result(result)
        if text is None:
            data.metrics["tool_errors"] += 1
            return (f"error: tool {call.name!r} returned {type(result).__name__}, not (ToolResponse, reward, "
                    "metrics)")
        if reward is not None:
            data.tool_rewards.append(reward)
        return self._truncate(text)

    async def _instance(self, tool, data: AgentData) -> str:
        if tool.name not in data.tool_instances:
            create_kwargs = dict((data.tools_kwargs.get(tool.name) or {}).get("create_kwargs") or {})
            created = await tool.create(create_kwargs=create_kwargs,
                                        **{k: v for k, v in create_kwargs.items() if k not in ("instance_id",)})
            data.tool_instances[tool.name] = created[0] if isinstance(created, tuple) else created
        return data.tool_instances[tool.name]

    async def _release_tools(self, data: AgentData) -> None:
        scores = {}
        for name, instance_id in data.tool_instances.items():
            tool = self.tools[name]
            release_kwargs = dict((data.tools_kwargs.get(name) or {}).get("release_kwargs") or {})
            run = self.tool_runner.run
            try:
                if hasattr(tool, "calc_reward"):
                    scores[name] = float(await run(lambda tool=tool, i=instance_id: tool.calc_reward(i),
                                                   self.tool_timeout, f"tool {name!r} (calc_reward)"))
            except ToolThreadsExhausted:
                raise
            except (Exception, SystemExit) as err:
                data.metrics["tool_errors"] += 1
                data.extra_fields.setdefault("tool_reward_errors", {})[name] = f"{type(err).__name__}: {err}"
            try:
                await run(lambda tool=tool, i=instance_id, kw=release_kwargs: tool.release(i, **kw),
                          self.tool_timeout, f"tool {name!r} (release)")
            except ToolThreadsExhausted:
                raise
            except (Exception, SystemExit):
                data.metrics["tool_errors"] += 1
        if scores:
            data.extra_fields["rollout_reward_scores"] = scores

    def _truncate(self, text: str) -> str:
        limit = self.max_tool_response_length
        if len(text) <= limit:
            return text
        if self.truncate_side == "left":
            return "(truncated)..." + text[-limit:]
        if self.truncate_side == "right":
            return text[:limit] + "...(truncated)"
        half = limit // 2
        return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]

    # ------------------------------------------------------------------ templates
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return render_messages(self.tokenizer, messages, generation_prompt=generation_prompt,
                               tools=self.tool_schemas, chat_template_kwargs=self.chat_template_kwargs)

    def _render_delta(self, with_assistant: list[dict], new: list[dict], *,
                      ended_with_eos: bool) -> list[int]:
        return render_delta(self.tokenizer, with_assistant, new, ended_with_eos=ended_with_eos,
                            tools=self.tool_schemas, chat_template_kwargs=self.chat_template_kwargs)


def render_messages(tokenizer, messages: list[dict], *, generation_prompt: bool, tools: list | None = None,
                    chat_template_kwargs: dict | None = None) -> str:
    """The chat template's text of `messages` (with the tools' schemas when there are tools)."""
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        kwargs.setdefault("tools", tools)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def render_delta(tokenizer, with_assistant: list[dict], new: list[dict], *, ended_with_eos: bool,
                 tools: list | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `new` messages as the template renders them after the conversation `with_assistant` (ending
    with the model's turn), including the template's text after the assistant's end-of-turn token when the model
    ended on it: appended to the model's own token ids, they continue the conversation token in, token out."""
    base = render_messages(tokenizer, with_assistant, generation_prompt=False, tools=tools,
                           chat_template_kwargs=chat_template_kwargs)
    full = render_messages(tokenizer, with_assistant + new, generation_prompt=True, tools=tools,
                           chat_template_kwargs=chat_template_kwargs)
    if not full.startswith(base):
        raise ValueError("the chat template does not render a conversation as a prefix of the conversation with "
                         "one more message, so the tool turn's tokens cannot be appended token-in-token-out; use "
                         "a template that renders earlier turns unchanged (Qwen2.5 / ChatML templates do)")
    tail = full[len(base):]
    eos = tokenizer.eos_token or ""
    suffix = ""
    if ended_with_eos and eos and eos in base:
        suffix = base[base.rfind(eos) + len(eos):]
    return list(tokenizer(suffix + tail, add_special_tokens=False)["input_ids"])


def _tool_result(result) -> tuple[str | None, float | None]:
    """(text, reward) of what `execute` returned: (ToolResponse | str | dict, reward, metrics)."""
    response, reward = result, None
    if isinstance(result, tuple):
        if not result:
            return None, None
        response = result[0]
        if len(result) > 1 and isinstance(result[1], (int, float)) and not isinstance(result[1], bool):
            reward = float(result[1])
    if isinstance(response, str):
        return response, reward
    if isinstance(response, dict):
        return str(response.get("text") or ""), reward
    text = getattr(response, "text", None)
    if text is None and hasattr(response, "is_empty"):
        return "", reward
    return (str(text), reward) if text is not None else (None, None)


# ---------------------------------------------------------------------------------------------- manager
class AgentLoopManager:
    """Runs one rollout's trajectories on this worker's engine and returns verl's rollout Batch."""

    def __init__(self, engine, tokenizer, rollout_config, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 tools: Sequence | None = None, interactions: dict | None = None,
                 chat_template_kwargs: dict | None = None) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, rollout_config
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), int(pad_token_id)
        self.tools = {tool.name: tool for tool in (tools or [])}
        self.interactions = dict(interactions or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        agent = rollout_config.agent
        load_agent_loop_config(agent.agent_loop_config_path)
        self.default_agent = agent.default_agent_loop
        self.num_workers = max(1, int(agent.num_workers))
        self.multi_turn = bool(rollout_config.multi_turn.enable)
        self.tool_parser = make_tool_parser(rollout_config.multi_turn.format, tokenizer)
        self.tool_parser.set_tools(tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                                   for tool in self.tools.values())
        # tool calls run on these threads (at most max(64, num_workers) at once), so a timeout can end them
        self.tool_runner = ToolRunner(max_threads=max(64, self.num_workers))
        self._stuck_reported = 0
        self._rollout_kwargs: dict = {}  # loop class -> constructor kwargs its start_rollout gave this rollout
        self.last_server: BatchingServer | None = None
        # progress(stage, done, total, unit, detail): called as trajectories finish (the trainer's progress bar)
        self.progress: Callable[..., None] | None = None

    def agent_names(self, prompts: Batch) -> list[str]:
        names = list(prompts["agent_name"]) if "agent_name" in prompts else [None] * len(prompts)
        names = [self.default_agent if _is_empty(name) else str(name) for name in names]
        unknown = sorted({name for name in names if name not in AGENT_LOOPS})
        if unknown:
            raise AGENT_LOOPS.unknown(unknown[0], " (the rows' agent_name, or rollout.agent.default_agent_loop)")
        if not self.multi_turn and any(name != "single_turn_agent" for name in names):
            other = next(name for name in names if name != "single_turn_agent")
            raise ValueError(f"rows ask for the agent loop {other!r} but actor_rollout_ref.rollout.multi_turn.enable "
                             "is false: set it to true (and multi_turn.tool_config_path for tools), or drop the rows' "
                             "agent_name to roll them out single-turn")
        return names

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        names = self.agent_names(prompts)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no event loop in this thread
            return asyncio.run(self._generate(prompts, params, names))
        # called from inside a running event loop (a Jupyter cell, an async driver): run ours in a thread of its own
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyflow-agent-loop") as pool:
            return pool.submit(asyncio.run, self._generate(prompts, params, names)).result()

    async def _generate(self, prompts: Batch, params: SamplingParams, names: list[str]) -> Batch:
        # asyncio.to_thread in an agent loop: daemon threads that asyncio.run does not wait for at its end
        asyncio.get_running_loop().set_default_executor(DaemonExecutor("hyflow-agent-thread"))
        n = params.n
        turn_params = dataclasses.replace(params, n=1)
        extra_stops = [i for i in self.tool_parser.stop_token_ids if i not in params.stop_token_ids]
        if self.multi_turn and extra_stops:  # the format ends a call turn with its own id (llama3's <|eom_id|>)
            turn_params = dataclasses.replace(turn_params, stop_token_ids=(*params.stop_token_ids, *extra_stops))
        server = BatchingServer(self.engine, turn_params, self.pad_token_id, self.eos_token_ids, prompts,
                                eager=self.config.agent.batching == "eager")
        self.last_server = server
        rows = prompt_rows(prompts)
        sampling = sampling_dict(params)
        server.live = total = len(rows) * n
        finished = 0

        async def trajectory(index: int) -> AgentLoopOutput:
            nonlocal finished
            try:
                agent = self.make_agent(names[index // n], ServerHandle(server, index, index // n,
                                                                        int(self.config.response_length)))
                return await agent.run(sampling, **rows[index // n])
            finally:
                server.finished_one()
                finished += 1
                if self.progress is not None:
                    self.progress("rollout", finished, total, "trajectories", f"{server.tokens} tokens")

        # loops that need something for the whole rollout (openai_agent: its endpoint) start it now
        self._rollout_kwargs = {}
        started = []
        try:
            for loop in {AGENT_LOOPS.get(name) for name in set(names)}:
                if hasattr(loop, "start_rollout"):
                    self._rollout_kwargs[loop] = await loop.start_rollout(self, params)
                    started.append(loop)
        except BaseException:
            for loop in started:
                await loop.end_rollout(self._rollout_kwargs[loop])
            raise
        tasks = [asyncio.ensure_future(trajectory(i)) for i in range(len(rows) * n)]
        serving = asyncio.ensure_future(server.serve())
        try:
            outputs = await asyncio.gather(*tasks)
            await serving
        except BaseException:
            for task in [*tasks, serving]:
                task.cancel()
            await asyncio.gather(*tasks, serving, return_exceptions=True)
            raise
        finally:
            for loop in started:
                await loop.end_rollout(self._rollout_kwargs[loop])
            self._rollout_kwargs = {}
        self._warn_stuck_threads()
        return self.assemble(prompts, params, outputs, names, server)

    def _warn_stuck_threads(self) -> None:
        """One warning when more tool threads are stuck than at the last report (see the module docstring)."""
        stuck = self.tool_runner.stuck_threads()
        if len(stuck) > self._stuck_reported:
            import collections
            import warnings

            where = ", ".join(f"{label} x{count}" for label, count in collections.Counter(stuck).most_common())
            warnings.warn(f"hyflow: {len(stuck)} tool thread(s) are still blocked in calls abandoned at their timeout "
                          f"({where}); they keep running (Python cannot kill a thread) but no longer hold the "
                          "rollout. Give the blocking work in the tool a timeout of its own, or make it await "
                          "(tool/stuck_threads counts them)", RuntimeWarning, stacklevel=2)
        self._stuck_reported = len(stuck)

    def make_agent(self, name: str, handle: ServerHandle) -> AgentLoopBase:
        """A new instance of the agent loop registered as `name`, over `handle`."""
        loop = AGENT_LOOPS[name]
        extra = self._rollout_kwargs.get(loop, {})  # what the loop's start_rollout gave for this rollout
        return loop(server_manager=handle, tokenizer=self.tokenizer, rollout_config=self.config,
                    tools=self.tools, tool_parser=self.tool_parser, interactions=self.interactions,
                    chat_template_kwargs=self.chat_template_kwargs, tool_runner=self.tool_runner,
                    **AGENT_LOOP_KWARGS.get(name, {}), **extra)

    def assemble(self, prompts: Batch, params: SamplingParams, outputs: list[AgentLoopOutput], names: list[str],
                 server: BatchingServer) -> Batch:
        """verl's rollout Batch from the trajectories' outputs (row i is sample i % n of prompt i // n); the
        metrics read `server`'s counters (calls, batch_sizes, seconds)."""
        n, R = params.n, params.max_new_tokens
        N = len(outputs)
        responses = torch.full((N, R), self.pad_token_id, dtype=torch.long)
        model_mask = torch.zeros((N, R), dtype=torch.long)
        lengths = torch.zeros(N, dtype=torch.long)
        logprobs = torch.zeros((N, R), dtype=torch.float32)
        own_prompts = False  # a loop that may change the prompt did (openai_agent): each row keeps its own
        for i, out in enumerate(outputs):
            expected = prompts["input_ids"][i // n][prompts["attention_mask"][i // n].bool()].tolist()
            if list(out.prompt_ids) != expected and getattr(AGENT_LOOPS.get(names[i // n]), "may_change_prompt", False):
                own_prompts = True
            elif list(out.prompt_ids) != expected:
                raise ValueError(f"agent loop {names[i // n]!r} returned prompt_ids that are not the prompt's token "
                                 "ids; an agent loop keeps the prompt as it came (token in, token out) and puts "
                                 "everything it adds into response_ids (with response_mask 0 where the model did "
                                 "not generate it)")
            if len(out.response_ids) != len(out.response_mask):
                raise ValueError(f"agent loop {names[i // n]!r} returned {len(out.response_ids)} response ids but "
                                 f"{len(out.response_mask)} mask entries")
            ids = out.response_ids[:R]
            k = lengths[i] = len(ids)
            responses[i, :k] = torch.tensor(ids, dtype=torch.long)
            model_mask[i, :k] = torch.tensor(out.response_mask[:k], dtype=torch.long)
            if out.response_logprobs:
                logprobs[i, :k] = torch.tensor(out.response_logprobs[:k], dtype=torch.float32)
        if own_prompts:  # one left-padded prompt per trajectory (the prompt repeated n times otherwise)
            width = max(len(o.prompt_ids) for o in outputs)
            input_ids = torch.full((N, width), self.pad_token_id, dtype=torch.long)
            prompt_mask = torch.zeros((N, width), dtype=torch.long)
            for i, out in enumerate(outputs):
                input_ids[i, width - len(out.prompt_ids):] = torch.tensor(list(out.prompt_ids), dtype=torch.long)
                prompt_mask[i, width - len(out.prompt_ids):] = 1
            out_batch = assemble_rollout(prompts.repeat(n, interleave=True), input_ids, prompt_mask, responses,
                                         logprobs, lengths, dataclasses.replace(params, n=1), model_mask=model_mask)
        else:
            out_batch = assemble_rollout(prompts, prompts["input_ids"].cpu(), prompts["attention_mask"].cpu(),
                                         responses, logprobs, lengths, params, model_mask=model_mask)
        if self.multi_turn:
            out_batch["__num_turns__"] = np.array([o.num_turns for o in outputs], dtype=np.int64)
            infos = list(out_batch["extra_info"]) if "extra_info" in out_batch else [{} for _ in outputs]
            out_batch["extra_info"] = [
                {**(info or {}), **o.extra_fields, "num_turns": o.num_turns} for info, o in zip(infos, outputs)]
        if any(o.reward_score is not None for o in outputs):  # the loop scored its trajectory (verl's reward_score)
            out_batch["agent_reward"] = [None if o.reward_score is None else float(o.reward_score) for o in outputs]
        out_batch.meta.setdefault("metrics", {}).update(self._metrics(outputs, server))
        return out_batch

    def _metrics(self, outputs: list[AgentLoopOutput], server: BatchingServer) -> dict[str, float]:
        metrics = {"agent_loop/engine_calls": float(server.calls),
                   "agent_loop/engine_batch/mean": float(np.mean(server.batch_sizes)) if server.batch_sizes else 0.0,
                   "agent_loop/engine_batch/max": float(max(server.batch_sizes, default=0)),
                   "timing_s/agent_loop_engine": server.seconds}
        if not self.multi_turn:
            return metrics
        turns = np.array([o.num_turns for o in outputs], dtype=float)
        metrics.update({"num_turns/min": float(turns.min()), "num_turns/max": float(turns.max()),
                        "num_turns/mean": float(turns.mean()),
                        "tool/stuck_threads": float(len(self.tool_runner.stuck_threads()))})
        counts = {key: np.array([o.metrics.get(key, 0) for o in outputs], dtype=float) for key in _COUNTERS}
        calls = counts["tool_calls"] + counts["malformed_calls"]
        # per-sample means (workers' values are averaged, so every count is a rate per sample)
        metrics["tool/calls_per_sample/mean"] = float(calls.mean())
        metrics["tool/calls_per_sample/max"] = float(calls.max())
        metrics["tool/samples_with_call"] = float((calls > 0).mean())
        if calls.sum() > 0:  # calls that parsed, named a tool and fit its schema, of all calls
            bad = counts["malformed_calls"] + counts["unknown_tools"] + counts["bad_arguments"]
            metrics["tool/well_formed_share"] = float(1.0 - bad.sum() / calls.sum())
        for key, name in (("malformed_calls", "tool/malformed_calls"), ("unknown_tools", "tool/unknown_tools"),
                          ("bad_arguments", "tool/bad_arguments"), ("tool_errors", "tool/errors"),
                          ("tool_timeouts", "tool/timeouts"), ("dropped_calls", "tool/dropped_calls")):
            metrics[f"{name}/mean"] = float(counts[key].mean())
        seconds = np.array([o.metrics.get("tool_seconds", 0.0) for o in outputs], dtype=float)
        metrics.update({"agent_loop/tool_calls/min": float(seconds.min()),
                        "agent_loop/tool_calls/max": float(seconds.max()),
                        "agent_loop/tool_calls/mean": float(seconds.mean())})
        latencies = [x for o in outputs for x in o.metrics.get("tool_latencies", [])]
        if latencies:
            metrics["tool/latency_s/mean"] = float(np.mean(latencies))
            metrics["tool/latency_s/max"] = float(np.max(latencies))
        agents = [o for o in outputs if "openai_requests" in o.metrics]  # openai_agent (hyflow.rollout.openai_agent)
        for key in ("requests", "restarts", "refused", "errors") if agents else ():
            metrics[f"openai/{key}/mean"] = float(np.mean([o.metrics[f"openai_{key}"] for o in agents]))
        episodes = [o for o in outputs if "env_steps" in o.metrics]  # env_agent trajectories (hyflow.rollout.env_loop)
        if episodes:
            metrics["env/return/mean"] = float(np.mean([o.reward_score or 0.0 for o in episodes]))
            for key in ("env_steps", "env_errors", "env_timeouts", "env_seconds"):
                metrics[f"env/{key[len('env_'):]}/mean"] = float(np.mean([o.metrics[key] for o in episodes]))
            for key in sorted({k for o in episodes for k in o.metrics["env_info"]}):
                values = [o.metrics["env_info"][key] for o in episodes if key in o.metrics["env_info"]]
                metrics[f"env/{key}/mean"] = float(np.mean(values))
        return metrics


def sampling_dict(params: SamplingParams) -> dict[str, Any]:
    """The `sampling_params` dict an agent loop receives (verl's names)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "logprobs": params.calculate_log_probs}


def _is_empty(value) -> bool:
    """None, "", or a float NaN (a missing value read from parquet)."""
    return value is None or value == "" or (isinstance(value, float) and value != value)


def prompt_rows(prompts: Batch) -> list[dict[str, Any]]:
    """Per-prompt dicts of the batch's non-tensor columns (plus `raw_prompt_ids` from the tensors when absent)."""
    keys = [k for k in prompts.keys() if k not in ("input_ids", "attention_mask", "position_ids")]  # noqa: SIM118
    rows = []
    for i in range(len(prompts)):
        row = {key: prompts[key][i] for key in keys}
        if "raw_prompt_ids" not in row:
            row["raw_prompt_ids"] = prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()
        elif not isinstance(row["raw_prompt_ids"], list):
            row["raw_prompt_ids"] = list(row["raw_prompt_ids"])
        for key in ("tools_kwargs", "interaction_kwargs"):
            if row.get(key) is None:
                row[key] = {}
        rows.append(row)
    return rows
