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
      timeout_s: 600                           # the agent's deadline (default), its waits for the policy not counted

Rows with `agent_name: my_agent` then run it, one trajectory per sample, each in a forked process of its own
(`hyflow.rollout.agent_process`) with its own client, whose base URL is `http://127.0.0.1:PORT/t/<trajectory>/v1`
and whose API key is the trajectory's secret (the endpoint keeps its hash; a request with another trajectory's URL
is a 401 and changes nothing). The endpoint binds to 127.0.0.1 only, on a free port, for the length of one
rollout.

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
all turns together) is refused with HTTP 400 too, and so is a new prompt over `data.max_prompt_length`. Bodies are
bounded (16 bytes per token of prompt + response length, at least 1 MiB: 413; 60 s to arrive: 408); malformed
JSON or fields of the wrong type are a 400 with a one-line reason; stopping the endpoint waits for no request.

Containment: an agent that raises (`SystemExit` included), ends its process (`os._exit`, a crash, a kill), runs
past `timeout_s` seconds (not counting its waits for the policy) or returns no finite score (NaN, inf, not a
number; extras that are not plain data or over 16 MiB) ends its trajectory: the sample keeps what it generated,
scores 0, and names the error in `extra_info["agent_error"]` (`openai/errors/mean`). A trajectory with no answer of
the policy has an empty response (mask 0) on its row's prompt, scored 0 and counted the same way. An error of the
endpoint's own (the engine's) is an error of the rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from hyflow.rollout.agent_loop import AgentLoopBase, AgentLoopOutput, register
from hyflow.rollout.agent_process import run_agent_process
from hyflow.rollout.tool_agent import render_delta, render_messages
from hyflow.rollout.tool_parser import make_tool_parser

MODEL_NAME = "hyflow-policy"
DEFAULT_TIMEOUT_S = 600.0  # an agent's deadline when its agent_loop_config_path entry gives no timeout_s
MIN_REQUEST_BYTES = 1024 * 1024  # the request body limit is this, or 16 bytes per token of the longest sample
READ_TIMEOUT_S = 60.0  # the longest a request's body may take to arrive
MAX_CHARS_PER_TOKEN = 32  # text longer than this many characters per token of its limit is refused unread


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
    key_digest: bytes | None = None  # sha256 of the trajectory's API key (the key itself lives in its agent only)
    conversations: list[_Conversation] = field(default_factory=list)
    last: tuple[list[int], list[int], list[float]] | None = None  # the last request's (prompt, answer, log-probs)
    requests: int = 0
    refused: int = 0
    tasks: set = field(default_factory=set)  # the requests being answered (cancelled when the trajectory closes)
    internal_error: str | None = None  # an error of hyflow's own while answering (the engine's): the rollout's
    generating: int = 0  # requests waiting for the engine now
    generating_since: float = 0.0
    generated_s: float = 0.0  # seconds with at least one request waiting for the engine, before generating_since

    def policy_seconds(self) -> float:
        """Seconds this trajectory has waited for the policy so far (not counted against its agent's timeout)."""
        ongoing = time.monotonic() - self.generating_since if self.generating else 0.0
        return self.generated_s + ongoing


class _Refused(Exception):
    """An HTTP error answer (400 unless `status` says otherwise) with a one-line reason."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class OpenAIEndpoint:
    """The OpenAI-compatible HTTP server of one rollout (aiohttp, on 127.0.0.1, in the rollout's event loop).

    Each trajectory has its own URL and API key (`open`): a request must carry the key of the trajectory its URL
    names (401 otherwise, 404 for a trajectory that is not open), so an agent can neither read nor change another
    trajectory. A body is at most `max_request_bytes` (413) and must arrive within `READ_TIMEOUT_S` (408); a body
    that is not a JSON object, or fields of the wrong type, are a 400 naming the field. A new conversation's prompt
    is at most `max_prompt_tokens` (400). `close` ends a trajectory's requests in flight, and `stop` does not wait
    for any, so a slow or half-sent request cannot hold the rollout."""

    def __init__(self, tokenizer, *, temperature: float, top_p: float, tool_format: str,
                 chat_template_kwargs: dict | None = None, eos_token_id: int | None = None,
                 max_prompt_tokens: int | None = None, max_request_bytes: int | None = None) -> None:
        self.tokenizer, self.temperature, self.top_p = tokenizer, float(temperature), float(top_p)
        self.parser = make_tool_parser(tool_format, tokenizer)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self.max_prompt_tokens = max_prompt_tokens
        self.max_request_bytes = int(max_request_bytes or MIN_REQUEST_BYTES)
        self.trajectories: dict[str, _Trajectory] = {}
        self.port: int | None = None
        self._runner = None

    async def start(self) -> None:
        from aiohttp import web

        # the body limit is checked against Content-Length before anything is read (and while reading a chunked one)
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_post("/t/{trajectory}/v1/chat/completions", self._chat)
        app.router.add_post("/t/{trajectory}/v1/completions", self._completions)
        app.router.add_get("/t/{trajectory}/v1/models", self._models)
        # stopping waits at most shutdown_timeout for requests (a refused body's lingering read included)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5, lingering_time=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)  # loopback only, a free port
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        for key in list(self.trajectories):
            self.close(key)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, handle, budget: int) -> tuple[str, _Trajectory]:
        """A new trajectory over `handle`: (its base URL, its record). It answers no request until `authorize`."""
        key = uuid.uuid4().hex
        record = self.trajectories[key] = _Trajectory(handle, int(budget))
        return f"http://127.0.0.1:{self.port}/t/{key}/v1", record

    @staticmethod
    def authorize(record: _Trajectory) -> str:
        """A new API key for the trajectory `record`, of which the endpoint keeps only the digest: give it to the
        trajectory's agent alone, and hold no reference to it after (see `run_agent_process`)."""
        api_key = secrets.token_urlsafe(32)
        record.key_digest = _digest(api_key)
        return api_key

    def close(self, key_or_record: str | _Trajectory) -> None:
        """End a trajectory: later requests to its URL get 404, and the ones being answered are cancelled."""
        if isinstance(key_or_record, _Trajectory):
            found = [k for k, r in self.trajectories.items() if r is key_or_record]
            key_or_record = found[0] if found else ""
        record = self.trajectories.pop(key_or_record, None)
        if record is not None:
            for task in list(record.tasks):
                task.cancel()

    # ------------------------------------------------------------------ handlers
    def _record(self, request) -> tuple[_Trajectory | None, Any]:
        """The trajectory the request's URL names, when the request carries its key; else (None, the error)."""
        record = self.trajectories.get(request.match_info["trajectory"])
        if record is None:
            return None, _error(404, "unknown trajectory: this client belongs to a trajectory or rollout that has "
                                     "ended")
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if (scheme.lower() != "bearer" or record.key_digest is None
                or not hmac.compare_digest(_digest(key.strip()), record.key_digest)):
            return None, _error(401, "wrong or missing API key: each trajectory's client carries its own key "
                                     "(Authorization: Bearer <key>); use the client the agent function was given")
        return record, None

    async def _models(self, request):
        from aiohttp import web

        record, refusal = self._record(request)
        if record is None:
            return refusal
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                             "owned_by": "hyflow"}]})

    async def _chat(self, request):
        return await self._answer(request, chat=True)

    async def _completions(self, request):
        return await self._answer(request, chat=False)

    async def _answer(self, request, *, chat: bool):
        from aiohttp import web

        record, refusal = self._record(request)
        if record is None:
            return refusal
        task = asyncio.current_task()
        record.tasks.add(task)
        try:
            body = await self._body(request)
            self._check_sampling(body)
            answer = await (self._chat_answer(record, body) if chat else self._completion_answer(record, body))
            return web.json_response(answer)
        except _Refused as refusal:
            record.refused += 1
            return _error(refusal.status, str(refusal))
        except Exception as err:  # hyflow's own failure (the engine's): the rollout fails with it, not this agent
            record.internal_error = record.internal_error or f"{type(err).__name__}: {err}"
            return _error(500, f"the endpoint failed: {type(err).__name__}: {err}")
        finally:
            record.tasks.discard(task)

    async def _body(self, request) -> dict:
        """The request's JSON object; a _Refused when it is too large (413), too slow (408) or not one (400)."""
        from aiohttp import web

        too_large = _Refused(f"the request body is over {self.max_request_bytes:,} bytes, the endpoint's limit (16 "
                             "bytes per token of data.max_prompt_length + data.max_response_length, at least 1 MiB)",
                             413)
        if (request.content_length or 0) > self.max_request_bytes:  # refused before reading it
            raise too_large
        try:
            raw = await asyncio.wait_for(request.read(), READ_TIMEOUT_S)
        except web.HTTPRequestEntityTooLarge:  # a chunked body, found too large while reading it
            raise too_large from None
        except asyncio.TimeoutError:
            raise _Refused(f"the request body did not arrive within {READ_TIMEOUT_S:g} s", 408) from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise _Refused(f"the request body is not JSON ({err})") from None
        if not isinstance(body, dict):
            raise _Refused(f"the request body must be a JSON object, got a JSON {_json_type(body)}")
        return body

    def _check_sampling(self, body: dict) -> None:
        for key, ours in (("temperature", self.temperature), ("top_p", self.top_p)):
            value = _number(body, key)
            if value is not None and abs(value - ours) > 1e-6:
                raise _Refused(f"{key}={value}: the policy samples with the rollout's {key}={ours} "
                               f"(actor_rollout_ref.rollout.{key}); omit it or send {ours}")
        if (_integer(body, "n") or 1) != 1:
            raise _Refused("n > 1: one answer per request (the rollout's n samples are separate trajectories)")
        if body.get("stop"):
            raise _Refused("stop strings are not supported: the policy stops at its end-of-turn token")
        for key in ("max_completion_tokens", "max_tokens"):
            value = _integer(body, key)
            if value is not None and value < 1:
                raise _Refused(f"{key}={value}: ask for at least 1 token, or omit it for the trajectory's budget")

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
            raise _Refused(f"the prompt is {len(prompt_ids)} tokens, over the rollout's limit of "
                           f"{self.max_prompt_tokens} (data.max_prompt_length); send a shorter conversation or "
                           "raise data.max_prompt_length")

    async def _generate(self, record: _Trajectory, prompt_ids: list[int], used: int, body: dict):
        left = record.budget - used
        if left <= 0:
            raise _Refused(f"the trajectory's response budget of {record.budget} tokens (data.max_response_length) "
                           "is spent")
        wanted = _integer(body, "max_completion_tokens") or _integer(body, "max_tokens")
        budget = min(left, wanted) if wanted else left
        record.requests += 1
        if not record.generating:
            record.generating_since = time.monotonic()
        record.generating += 1
        try:
            return await record.handle.generate(prompt_ids=prompt_ids, sampling_params={"max_tokens": budget})
        finally:
            record.generating -= 1
            if not record.generating:
                record.generated_s += time.monotonic() - record.generating_since

    def _render(self, messages: list[dict], tools: list | None) -> list[int]:
        try:
            text = render_messages(self.tokenizer, messages, generation_prompt=True, tools=tools,
                                   chat_template_kwargs=self.chat_template_kwargs)
        except Exception as err:  # the template refused these messages (roles out of order, a field it needs)
            raise _Refused(f"the messages cannot be rendered with the policy's chat template: "
                           f"{type(err).__name__}: {err}") from None
        return self._tokenize(text)

    def _tokenize(self, text: str) -> list[int]:
        """`text`'s ids, refused unread when it is far over the prompt limit (tokenising runs on the event loop)."""
        if self.max_prompt_tokens is not None and len(text) > MAX_CHARS_PER_TOKEN * self.max_prompt_tokens:
            raise _Refused(f"the prompt is {len(text):,} characters, far over the rollout's limit of "
                           f"{self.max_prompt_tokens} (data.max_prompt_length) tokens; send a shorter conversation "
                           "or raise data.max_prompt_length")
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self._check_prompt(ids)
        return ids

    async def _chat_answer(self, record: _Trajectory, body: dict) -> dict:
        messages = _messages(body.get("messages"))
        tools = _tools(body.get("tools"))
        current = record.conversations[-1] if record.conversations else None
        if current is not None and current.tools == tools and _continues(messages, current.messages):
            left = record.budget - len(current.response_ids)
            added = sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or []))
                        for m in messages[len(current.messages):])
            if added > MAX_CHARS_PER_TOKEN * max(left, 0):  # refused unread, as a too long prompt is
                raise _Refused(f"the appended messages are {added:,} characters, far over the {max(left, 0)} tokens "
                               f"left of the trajectory's response budget of {record.budget} "
                               "(data.max_response_length)")
            try:
                delta = render_delta(self.tokenizer, current.messages, messages[len(current.messages):],
                                     ended_with_eos=current.ended_with_eos, tools=tools,
                                     chat_template_kwargs=self.chat_template_kwargs)
            except Exception as err:  # the template refused the appended messages
                raise _Refused(f"the appended messages cannot be rendered with the policy's chat template: "
                               f"{type(err).__name__}: {err}") from None
            current.response_ids += delta
            current.mask += [0] * len(delta)
            current.logprobs += [0.0] * len(delta)
            current.messages = messages
        else:
            current = _Conversation(self._render(messages, tools), messages, tools)
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
            raise _Refused(f"prompt must be one string, got a JSON {_json_type(prompt)}")
        prompt_ids = self._tokenize(prompt)
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


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    for kind, name in ((bool, "boolean"), (str, "string"), (int, "number"), (float, "number"), (list, "array"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Refused(f"{key} must be a finite number, got {json.dumps(value)[:80]}")
    return float(value)


def _integer(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused(f"{key} must be an integer, got {json.dumps(value)[:80]}")
    return value


def _messages(messages: Any) -> list[dict]:
    """The request's messages as the chat template takes them; a _Refused naming the first malformed one."""
    if not isinstance(messages, list) or not messages:
        raise _Refused(f"messages must be a non-empty array of message objects, got a JSON {_json_type(messages)}"
                       + (" (empty)" if messages == [] else ""))
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _Refused(f"messages[{i}] must be an object with a role and content, got a JSON "
                           f"{_json_type(message)}")
        if not isinstance(message.get("role"), str):
            raise _Refused(f"messages[{i}].role must be a string (system, user, assistant or tool)")
        content = message.get("content")
        if isinstance(content, list):  # the API's content parts: text parts are the text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _Refused(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                               "supported")
            message = {**message, "content": "".join(p["text"] for p in content)}
        elif content is not None and not isinstance(content, str):
            raise _Refused(f"messages[{i}].content must be a string, text parts or null, got a JSON "
                           f"{_json_type(content)}")
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)):
            raise _Refused(f"messages[{i}].tool_calls must be an array of objects with a function: {{'name': string, "
                           "'arguments': string}")
        out.append(_plain_message(message))
    return out


def _tools(tools: Any) -> list | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _Refused(f"tools must be an array of tool objects, got a JSON {_json_type(tools)}")
    return tools


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
    """Runs the user's OpenAI-client agent for one trajectory, in a process of its own (see the module docstring)."""

    scores_trajectories = True
    may_change_prompt = True

    @classmethod
    async def start_rollout(cls, manager, params) -> dict[str, Any]:
        """The rollout's endpoint (one for every openai_agent row of it), started; given to each instance."""
        config = manager.config
        prompt_length = getattr(config, "prompt_length", None)
        longest = int(prompt_length or 0) + int(config.response_length)
        endpoint = OpenAIEndpoint(manager.tokenizer, temperature=params.temperature, top_p=params.top_p,
                                  tool_format=config.multi_turn.format,
                                  chat_template_kwargs=manager.chat_template_kwargs,
                                  max_prompt_tokens=int(prompt_length) if prompt_length else None,
                                  max_request_bytes=max(MIN_REQUEST_BYTES, 16 * longest))
        await endpoint.start()
        return {"openai_endpoint": endpoint}

    @classmethod
    async def end_rollout(cls, kwargs: dict[str, Any]) -> None:
        await kwargs["openai_endpoint"].stop()

    def __init__(self, *, run: Any = None, sample: str = "concat", timeout_s: float = DEFAULT_TIMEOUT_S,
                 openai_endpoint: OpenAIEndpoint | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if sample not in ("concat", "last"):
            raise ValueError(f"openai_agent: sample={sample!r}; use concat (the whole conversation) or last")
        if run is None:
            raise ValueError("openai_agent needs `run: file.py:function` (an async def run(client, sample)) in its "
                             "rollout.agent.agent_loop_config_path entry")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"openai_agent: timeout_s={timeout_s!r}; give the seconds one trajectory's agent may "
                             f"run, a positive number (default {DEFAULT_TIMEOUT_S:g}), in its "
                             "rollout.agent.agent_loop_config_path entry")
        if isinstance(run, str):
            from hyflow.user_code import load_object

            run = load_object(run, what="agent function", config_key="rollout.agent.agent_loop_config_path: run")
        self.agent_fn, self.sample_mode, self.endpoint = run, sample, openai_endpoint
        self.timeout_s = float(timeout_s)

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        if self.endpoint is None:
            raise RuntimeError("openai_agent runs inside AgentLoopManager.generate, which starts its endpoint")
        base_url, record = self.endpoint.open(self.server_manager, self.response_length)
        try:
            outcome = await run_agent_process(self.agent_fn, dict(row), base_url=base_url,
                                              make_key=lambda: self.endpoint.authorize(record),
                                              timeout_s=self.timeout_s, excluded=record.policy_seconds)
        finally:
            self.endpoint.close(record)
        if record.internal_error is not None:
            raise RuntimeError(f"openai_agent: the endpoint failed while answering the agent: "
                               f"{record.internal_error}")
        extra: dict[str, Any] = {}
        score = 0.0
        if outcome.error is not None:  # the agent's own failure: this trajectory ends, the rollout goes on
            extra["agent_error"] = outcome.error
        else:
            try:
                score, returned = _score(outcome.value)
                extra.update(returned)
            except ValueError as err:
                extra["agent_error"] = str(err)
        answered = [c for c in record.conversations if any(c.mask)]
        if record.last is None or not answered:  # nothing of the policy's to train on: an empty response, scored 0
            if "agent_error" not in extra:
                extra["agent_error"] = ("the agent function returned without an answer of the policy: every "
                                        "trajectory must ask the policy at least once (scored 0)")
            score = 0.0
            prompt_ids, response, mask, logprobs = list(row.get("raw_prompt_ids") or []), [], [], []
        elif self.sample_mode == "last":
            prompt_ids, answer, logprobs = record.last
            response, mask = list(answer), [1] * len(answer)
        else:
            conversation = answered[-1]
            prompt_ids, response = conversation.prompt_ids, conversation.response_ids
            mask, logprobs = conversation.mask, conversation.logprobs
        R = self.response_length
        metrics = {"openai_requests": record.requests, "openai_restarts": max(0, len(record.conversations) - 1),
                   "openai_refused": record.refused, "openai_errors": int("agent_error" in extra)}
        return AgentLoopOutput(prompt_ids=list(prompt_ids), response_ids=list(response)[:R], response_mask=mask[:R],
                               response_logprobs=list(logprobs)[:R], num_turns=1 + 2 * record.requests,
                               reward_score=score, metrics=metrics, extra_fields=extra)


def _score(result: Any) -> tuple[float, dict]:
    """(score, extras) of what the agent function returned: a finite number, or a dict with "score" (verl's shape);
    anything else is a ValueError naming what came back."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"the agent function returned a dict without 'score' (keys: {sorted(map(str, result))})")
        score, extras = result["score"], {k: v for k, v in result.items() if k != "score"}
    else:
        score, extras = result, {}
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise ValueError(f"the agent function must return a number or a dict with 'score', got "
                         f"{'a score of type ' if isinstance(result, dict) else ''}{type(score).__name__}")
    if not math.isfinite(score):
        raise ValueError(f"the agent function returned the score {score!r}: a score must be a finite number "
                         "(scored 0 instead)")
    return float(score), extras
