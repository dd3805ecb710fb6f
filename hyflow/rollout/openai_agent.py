"""Train an agent written against the OpenAI client, unchanged: an OpenAI-compatible endpoint on loopback that
serves the current policy during a rollout, and the `openai_agent` loop that runs the user's agent against it.

The user's agent is one function::

    async def run(client: openai.AsyncOpenAI, sample: dict) -> float | dict:
        reply = await client.chat.completions.create(model="policy", messages=sample["raw_prompt"], tools=[...])
        ...                                    # call tools, ask again: any number of requests
        return score                           # or {"score": s, **extras}

registered as an agent loop (`rollout.agent.agent_loop_config_path`)::

    - name: my_agent
      _target_: hyflow.rollout.openai_agent.OpenAIAgentLoop
      run: my_agent.py:run                     # or package.module.run
      sample: concat                           # concat (default) or last

Rows with `agent_name: my_agent` then run it, one trajectory per sample, each with its own client whose base URL
is `http://127.0.0.1:PORT/t/<trajectory>/v1`. The endpoint binds to 127.0.0.1 only, on a free port, for the
length of one rollout.

Token in, token out. The endpoint keeps each trajectory's conversation as token ids: the first request's messages
are rendered with the chat template (and the request's `tools`) and tokenised; a later request that repeats the
conversation so far (the earlier messages and the assistant message the endpoint returned) and appends messages
(tool results, a user turn) continues it: the appended messages are rendered as the tool agent renders its turns
and appended to the ids the engine produced, which are never re-tokenised. `sample: concat` trains on that whole
conversation (model tokens in the loss, appended turns masked out); a request that does not continue the
conversation (the agent rewrote its history) starts a new one, and the trajectory's sample is the last
conversation (`openai/restarts/mean` counts them). `sample: last` trains on the last request's prompt and answer
alone. The function's return is the sample's score (`AgentLoopOutput.reward_score`): no reward function scores
these rows.

Requests: `POST .../v1/chat/completions` (messages, tools, max_tokens / max_completion_tokens; the answer carries
`tool_calls` parsed with `multi_turn.format`'s parser, `finish_reason` tool_calls / stop / length, usage) and
`POST .../v1/completions` (a prompt string, continued as is), `GET .../v1/models`. The policy samples with the
rollout's parameters: a request that asks for another temperature or top_p, for n > 1, or for stop strings is
refused with HTTP 400 naming the rollout's value (sampling differently would train on tokens from another
distribution than the log-probs say). A request past the trajectory's response budget (`data.max_response_length`,
all turns together) is refused with HTTP 400 too. An agent that raises ends its trajectory: the sample keeps what it
generated, scores 0, and names the error in `extra_info["agent_error"]` (`openai/errors/mean`); an agent that made
no request at all is an error of the rollout.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from hyflow.rollout.agent_loop import AgentLoopBase, AgentLoopOutput, register
from hyflow.rollout.tool_agent import render_delta, render_messages
from hyflow.rollout.tool_parser import make_tool_parser

MODEL_NAME = "hyflow-policy"


@dataclass
class _Conversation:
    """One token-level conversation of a trajectory."""

    prompt_ids: list[int]
    messages: list[dict]  # the request's messages (+ the assistant message the endpoint returned)
    tools: list | None
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ended_with_eos: bool = False


@dataclass
class _Trajectory:
    handle: Any  # the ServerHandle of this trajectory
    budget: int
    conversations: list[_Conversation] = field(default_factory=list)
    last: tuple[list[int], list[int], list[float]] | None = None  # the last request's (prompt, answer, log-probs)
    requests: int = 0
    refused: int = 0


class _Refused(Exception):
    """An HTTP 400 answer."""


class OpenAIEndpoint:
    """The OpenAI-compatible HTTP server of one rollout (aiohttp, on 127.0.0.1, in the rollout's event loop)."""

    def __init__(self, tokenizer, *, temperature: float, top_p: float, tool_format: str,
                 chat_template_kwargs: dict | None = None, eos_token_id: int | None = None) -> None:
        self.tokenizer, self.temperature, self.top_p = tokenizer, float(temperature), float(top_p)
        self.parser = make_tool_parser(tool_format, tokenizer)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self.trajectories: dict[str, _Trajectory] = {}
        self.port: int | None = None
        self._runner = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/t/{trajectory}/v1/chat/completions", self._chat)
        app.router.add_post("/t/{trajectory}/v1/completions", self._completions)
        app.router.add_get("/t/{trajectory}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)  # loopback only, a free port
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, handle, budget: int) -> tuple[str, _Trajectory]:
        """A new trajectory over `handle`: (its base URL, its record)."""
        key = uuid.uuid4().hex
        record = self.trajectories[key] = _Trajectory(handle, int(budget))
        return f"http://127.0.0.1:{self.port}/t/{key}/v1", record

    # ------------------------------------------------------------------ handlers
    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                             "owned_by": "hyflow"}]})

    async def _chat(self, request):
        return await self._answer(request, chat=True)

    async def _completions(self, request):
        return await self._answer(request, chat=False)

    async def _answer(self, request, *, chat: bool):
        from aiohttp import web

        record = self.trajectories.get(request.match_info["trajectory"])
        if record is None:
            return _error(404, "unknown trajectory: this client belongs to a rollout that has ended")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        try:
            self._check_sampling(body)
            if chat:
                return web.json_response(await self._chat_answer(record, body))
            return web.json_response(await self._completion_answer(record, body))
        except _Refused as refusal:
            record.refused += 1
            return _error(400, str(refusal))

    def _check_sampling(self, body: dict) -> None:
        for key, ours in (("temperature", self.temperature), ("top_p", self.top_p)):
            value = body.get(key)
            if value is not None and abs(float(value) - ours) > 1e-6:
                raise _Refused(f"{key}={value}: the policy samples with the rollout's {key}={ours} "
                               f"(actor_rollout_ref.rollout.{key}); omit it or send {ours}")
        if int(body.get("n") or 1) != 1:
            raise _Refused("n > 1: one answer per request (the rollout's n samples are separate trajectories)")
        if body.get("stop"):
            raise _Refused("stop strings are not supported: the policy stops at its end-of-turn token")

    async def _generate(self, record: _Trajectory, prompt_ids: list[int], used: int, body: dict):
        left = record.budget - used
        if left <= 0:
            raise _Refused(f"the trajectory's response budget of {record.budget} tokens (data.max_response_length) "
                           "is spent")
        wanted = body.get("max_completion_tokens") or body.get("max_tokens")
        budget = min(left, int(wanted)) if wanted else left
        record.requests += 1
        return await record.handle.generate(prompt_ids=prompt_ids, sampling_params={"max_tokens": budget})

    async def _chat_answer(self, record: _Trajectory, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _Refused("messages must be a non-empty list")
        messages = [_plain_message(m) for m in messages]
        tools = body.get("tools") or None
        current = record.conversations[-1] if record.conversations else None
        if current is not None and current.tools == tools and _continues(messages, current.messages):
            delta = render_delta(self.tokenizer, current.messages, messages[len(current.messages):],
                                 ended_with_eos=current.ended_with_eos, tools=tools,
                                 chat_template_kwargs=self.chat_template_kwargs)
            current.response_ids += delta
            current.mask += [0] * len(delta)
            current.logprobs += [0.0] * len(delta)
            current.messages = messages
        else:
            text = render_messages(self.tokenizer, messages, generation_prompt=True, tools=tools,
                                   chat_template_kwargs=self.chat_template_kwargs)
            current = _Conversation(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), messages, tools)
            record.conversations.append(current)
        prompt_ids = current.prompt_ids + current.response_ids
        out = await self._generate(record, prompt_ids, len(current.response_ids), body)
        logprobs = out.log_probs if out.log_probs is not None else [0.0] * len(out.token_ids)
        current.response_ids += out.token_ids
        current.mask += [1] * len(out.token_ids)
        current.logprobs += logprobs
        current.ended_with_eos = bool(out.token_ids) and out.token_ids[-1] == self.eos_token_id
        record.last = (prompt_ids, list(out.token_ids), list(logprobs))
        turn = self.parser.parse_ids(out.token_ids)
        calls = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in turn.calls]
        message: dict[str, Any] = {"role": "assistant", "content": turn.content if turn.content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        current.messages = [*messages, _plain_message(message)]
        finish = "tool_calls" if calls else ("length" if out.stop_reason == "length" else "stop")
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": MODEL_NAME, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                  "logprobs": None}],
                "usage": _usage(len(prompt_ids), len(out.token_ids))}

    async def _completion_answer(self, record: _Trajectory, body: dict) -> dict:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _Refused("prompt must be one string")
        prompt_ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        conversation = _Conversation(prompt_ids, [], None)
        record.conversations.append(conversation)
        out = await self._generate(record, prompt_ids, 0, body)
        logprobs = out.log_probs if out.log_probs is not None else [0.0] * len(out.token_ids)
        conversation.response_ids, conversation.mask = list(out.token_ids), [1] * len(out.token_ids)
        conversation.logprobs = list(logprobs)
        record.last = (prompt_ids, list(out.token_ids), list(logprobs))
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": MODEL_NAME, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": "length" if out.stop_reason == "length" else "stop"}],
                "usage": _usage(len(prompt_ids), len(out.token_ids))}


def _error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                             status=status)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _plain_message(message: dict) -> dict:
    """A message as the chat template takes it: tool-call arguments as objects (the API sends JSON strings)."""
    out = {k: v for k, v in message.items() if v is not None or k == "content"}
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                with contextlib.suppress(json.JSONDecodeError):  # not JSON: the template shows the string
                    function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


def _continues(messages: list[dict], before: list[dict]) -> bool:
    """Whether `messages` repeat the conversation `before` (roles, contents and tool calls) and add to it."""
    return len(messages) > len(before) and all(_same_message(new, old) for new, old in zip(messages, before))


def _same_message(a: dict, b: dict) -> bool:
    def calls(m: dict) -> list:
        return [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                for c in m.get("tool_calls") or []]

    return (a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")
            and calls(a) == calls(b))


@register("openai_agent")
class OpenAIAgentLoop(AgentLoopBase):
    """Runs the user's OpenAI-client agent for one trajectory (see the module docstring)."""

    scores_trajectories = True
    may_change_prompt = True

    @classmethod
    async def start_rollout(cls, manager, params) -> dict[str, Any]:
        """The rollout's endpoint (one for every openai_agent row of it), started; given to each instance."""
        endpoint = OpenAIEndpoint(manager.tokenizer, temperature=params.temperature, top_p=params.top_p,
                                  tool_format=manager.config.multi_turn.format,
                                  chat_template_kwargs=manager.chat_template_kwargs)
        await endpoint.start()
        return {"openai_endpoint": endpoint}

    @classmethod
    async def end_rollout(cls, kwargs: dict[str, Any]) -> None:
        await kwargs["openai_endpoint"].stop()

    def __init__(self, *, run: Any = None, sample: str = "concat", openai_endpoint: OpenAIEndpoint | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if sample not in ("concat", "last"):
            raise ValueError(f"openai_agent: sample={sample!r}; use concat (the whole conversation) or last")
        if run is None:
            raise ValueError("openai_agent needs `run: file.py:function` (an async def run(client, sample)) in its "
                             "rollout.agent.agent_loop_config_path entry")
        if isinstance(run, str):
            from hyflow.user_code import load_object

            run = load_object(run, what="agent function", config_key="rollout.agent.agent_loop_config_path: run")
        self.agent_fn, self.sample_mode, self.endpoint = run, sample, openai_endpoint

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        import openai

        if self.endpoint is None:
            raise RuntimeError("openai_agent runs inside AgentLoopManager.generate, which starts its endpoint")
        base_url, record = self.endpoint.open(self.server_manager, self.response_length)
        client = openai.AsyncOpenAI(base_url=base_url, api_key="hyflow", max_retries=0, timeout=600.0)
        extra: dict[str, Any] = {}
        score = 0.0
        try:
            result = await self.agent_fn(client, dict(row))
            score, returned = _score(result)
            extra.update(returned)
        except Exception as err:  # the agent's own failure: this trajectory ends, the rollout goes on
            extra["agent_error"] = f"{type(err).__name__}: {err}"
        finally:
            await client.close()
        if not record.conversations:
            why = extra.get("agent_error") or "it returned without asking the policy"
            raise RuntimeError(f"openai_agent: the agent made no request for a sample ({why}); every trajectory "
                               "must ask the policy at least once")
        if self.sample_mode == "last":
            prompt_ids, answer, logprobs = record.last
            response, mask = list(answer), [1] * len(answer)
        else:
            conversation = record.conversations[-1]
            prompt_ids, response = conversation.prompt_ids, conversation.response_ids
            mask, logprobs = conversation.mask, conversation.logprobs
        R = self.response_length
        metrics = {"openai_requests": record.requests, "openai_restarts": len(record.conversations) - 1,
                   "openai_refused": record.refused, "openai_errors": int("agent_error" in extra)}
        return AgentLoopOutput(prompt_ids=list(prompt_ids), response_ids=list(response)[:R], response_mask=mask[:R],
                               response_logprobs=list(logprobs)[:R], num_turns=1 + 2 * record.requests,
                               reward_score=score, metrics=metrics, extra_fields=extra)


def _score(result: Any) -> tuple[float, dict]:
    """(score, extras) of what the agent function returned: a number, or a dict with "score" (verl's shape)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"the agent function returned a dict without 'score' (keys: {sorted(result)})")
        return float(result["score"]), {k: v for k, v in result.items() if k != "score"}
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return float(result), {}
    raise ValueError(f"the agent function must return a number or a dict with 'score', got {type(result).__name__}")
