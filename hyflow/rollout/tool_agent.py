"""The `tool_agent` loop: generate, parse tool calls, run the tools, append their answers, generate again.

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

Tools cannot end the process with ``os._exit`` / ``posix._exit`` while a call runs (`ToolRunner` stops them: the call
fails with an error text; the runner's docstring lists what a tool in the trainer's process can still do). What a
call returns is read on its thread, under its deadline: the text cut to `multi_turn.max_tool_response_length`, an
exception's text too; a step or `calc_reward` reward that is not a finite number is dropped, counted in
`tool/errors` and named in `extra_info["tool_reward_errors"]`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hyflow.images import ImageError, load_image
from hyflow.models.vision import IMAGE_PAD, VISION_SPECIAL_TOKENS, MultiModalError, add_images
from hyflow.rollout.agent_loop import TOOL_COUNTERS, AgentLoopBase, AgentLoopOutput, register
from hyflow.rollout.tool_parser import (
    FunctionCall,
    MalformedCall,
    check_arguments,
    make_tool_parser,
)
from hyflow.tools.runner import ToolThreadsExhausted, ToolTimeout, describe, truncate_text


class _Answer(NamedTuple):
    """A tool call's turn: its text and images, the step reward kept, and what went wrong."""

    text: str
    images: list | tuple = ()
    reward: float | None = None
    failed: bool = False  # the text is an error the tool caused (counted in tool/errors)
    reward_error: str | None = None  # why the step reward was dropped


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
    # the prompt row's images and those tools added since (None until a tool returns one; AgentLoopOutput's fields)
    multi_modal_inputs: dict | None = None
    multi_modal_data: dict | None = None


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
        data.metrics.update({key: 0 for key in TOOL_COUNTERS}, tool_seconds=0.0, tool_latencies=[])
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
            extra_fields={**data.extra_fields, "turn_scores": data.turn_scores, "tool_rewards": data.tool_rewards},
            multi_modal_inputs=data.multi_modal_inputs, multi_modal_data=data.multi_modal_data)

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
            media = ({"multi_modal_inputs": data.multi_modal_inputs, "multi_modal_data": data.multi_modal_data}
                     if data.multi_modal_inputs is not None else None)  # the images a tool added, with the prompt's
            out = await self.server_manager.generate(data.request_id, prompt_ids=data.prompt_ids + data.response_ids,
                                                     sampling_params={**sampling_params, "max_tokens": left},
                                                     **({"media": media} if media is not None else {}))
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
            images: list = []  # what the tools returned besides text (a vision-language policy's tools)
            if calls:
                if len(calls) > self.max_parallel_calls:
                    data.metrics["dropped_calls"] += len(calls) - self.max_parallel_calls
                    calls = calls[: self.max_parallel_calls]
                start = time.perf_counter()
                answers = await asyncio.gather(*(self._call_tool(call, data) for call in calls))
                data.metrics["tool_seconds"] += time.perf_counter() - start
                new = []
                for call, (text_answer, answer_images) in zip(calls, answers):
                    content: str | list = text_answer
                    if answer_images:  # verl's multimodal tool message: the images, then the text
                        content = [*({"type": "image"} for _ in answer_images), {"type": "text", "text": text_answer}]
                        images += answer_images
                    message = {"role": "tool", "content": content}
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
            media = None
            if images:  # each image's single pad token becomes its block; the trajectory's images gain them
                delta, media = self._with_images(data, delta, images)
            if len(data.response_ids) + len(delta) >= self.response_length:
                return  # verl: a turn that does not fit ends the trajectory before it is appended
            if media is not None:
                data.multi_modal_inputs, data.multi_modal_data = media
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
    async def _call_tool(self, call: FunctionCall | MalformedCall, data: AgentData) -> tuple[str, list]:
        """(the tool turn's text, the images the tool returned); every failure is an `error: ...` text."""
        text, images = await self._tool_answer(call, data)
        if images and self.processor is None:
            data.metrics["tool_errors"] += 1
            return (f"error: tool {call.name!r} returned {len(images)} image(s), but the policy is a text model; "
                    "only a vision-language model's tools can return images"), []
        if images:
            try:
                images = [load_image(image, f"tool {call.name!r}'s image {k}") for k, image in enumerate(images)]
            except ImageError as err:
                data.metrics["tool_errors"] += 1
                return f"error: tool {call.name!r} returned an image that cannot be read: {err}", []
        if self.processor is not None:  # the vision tokens are the images' own: a tool's text cannot fake an image
            for token in VISION_SPECIAL_TOKENS:
                text = text.replace(token, "")
        return text, images

    async def _tool_answer(self, call: FunctionCall | MalformedCall, data: AgentData) -> tuple[str, list]:
        if isinstance(call, MalformedCall):
            data.metrics["malformed_calls"] += 1
            return f"error: malformed tool call: {call.reason}", []
        data.metrics["tool_calls"] += 1
        tool = self.tools.get(call.name)
        if tool is None:
            data.metrics["unknown_tools"] += 1
            known = ", ".join(sorted(self.tools)) or "none"
            return f"error: unknown tool {call.name!r}; available tools: {known}", []
        arguments = call.parsed_arguments()
        problem = check_arguments(arguments, tool.tool_schema.function.parameters.model_dump(exclude_none=True))
        if problem is not None:
            data.metrics["bad_arguments"] += 1
            return f"error: {call.name}: {problem}", []
        timeout = float((getattr(tool, "config", None) or {}).get("timeout") or self.tool_timeout)
        start = time.perf_counter()

        async def create_and_execute():  # runs on a tool thread (see the module docstring), reading included
            try:
                instance_id = await self._instance(tool, data)
                return self._answer(call.name, await tool.execute(instance_id, arguments, agent_data=data))
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # SystemExit and a stopped os._exit included
                return _Answer(self._truncate(f"error: tool {call.name!r} {describe(err)}"), failed=True)

        try:
            answer = await self.tool_runner.run(create_and_execute, timeout, f"tool {call.name!r} (execute)")
        except ToolTimeout:
            data.metrics["tool_timeouts"] += 1
            return f"error: tool {call.name!r} timed out after {timeout:g} s", []
        except ToolThreadsExhausted:
            raise
        except (Exception, SystemExit) as err:  # the runner's own failure to run the call
            data.metrics["tool_errors"] += 1
            return self._truncate(f"error: tool {call.name!r} {describe(err)}"), []
        finally:
            data.metrics["tool_latencies"].append(time.perf_counter() - start)
        if answer.failed or answer.reward_error is not None:
            data.metrics["tool_errors"] += 1
        if answer.reward_error is not None:
            data.extra_fields.setdefault("tool_reward_errors", {})[call.name] = answer.reward_error
        if answer.reward is not None:
            data.tool_rewards.append(answer.reward)
        return answer.text, answer.images

    def _answer(self, name: str, result: Any) -> _Answer:
        """What `execute` returned as the tool turn, made on the tool's thread (a hostile ``__str__`` or a huge text
        costs the call, not the loop): the text cut to max_tool_response_length, the images, the step reward when
        it is a finite number (else dropped, with the reason)."""
        response = result[0] if isinstance(result, tuple) and result else result
        if (response.get("video") if isinstance(response, dict) else getattr(response, "video", None)):
            return _Answer(f"error: tool {name!r} returned a video; videos are not supported yet, return images "
                           "(ToolResponse.image)", failed=True)
        text, reward, images = _tool_result(result)
        if text is None:
            return _Answer(f"error: tool {name!r} returned {type(result).__name__}, not (ToolResponse, reward, "
                           "metrics)", failed=True)
        if reward is not None and not math.isfinite(reward):
            return _Answer(self._truncate(text), images,
                           reward_error=f"execute returned the step reward {reward}, not a finite number")
        return _Answer(self._truncate(text), images, reward)

    def _with_images(self, data: AgentData, delta: list[int], images: list) -> tuple[list[int], tuple[dict, dict]]:
        """The tool turn's ids with each image's pad token expanded to its block, and the trajectory's images with
        these after the ones it had (`image_pad_starts`: where each new block starts among the sequence's pad
        tokens, counting those the model generated; `hyflow.models.vision`)."""
        processor = self.processor
        pad = processor.tokens.image_token_id
        placeholders = sum(1 for token in delta if token == pad)
        if placeholders != len(images):
            raise MultiModalError(
                f"the chat template rendered {placeholders} {IMAGE_PAD} token(s) for the {len(images)} image(s) the "
                "tools returned; a vision-language model's tool turns need a template that renders a message's "
                "{'type': 'image'} parts (the model's own chat template does)")
        media = getattr(self.server_manager, "media", {}) if data.multi_modal_inputs is None else {
            "multi_modal_inputs": data.multi_modal_inputs, "multi_modal_data": data.multi_modal_data}
        new = processor.images(images)
        counts = processor.token_counts(new["image_grid_thw"])
        before = sum(1 for token in data.prompt_ids + data.response_ids if token == pad)
        starts = [before + sum(counts[:k]) for k in range(len(images))]
        inputs = add_images(media.get("multi_modal_inputs"), new, starts, processor.tokens.spatial_merge_size)
        old_images = list((media.get("multi_modal_data") or {}).get("image") or [])
        return processor.expand(delta, new["image_grid_thw"]), (inputs, {"image": old_images + images})

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

            async def reward(tool=tool, instance_id=instance_id) -> float:  # on the tool's thread, float() included
                value = tool.calc_reward(instance_id)
                value = float(await value) if inspect.isawaitable(value) else float(value)
                if not math.isfinite(value):
                    raise ValueError(f"calc_reward returned {value}, not a finite number")
                return value

            try:
                if hasattr(tool, "calc_reward"):
                    scores[name] = await run(reward, self.tool_timeout, f"tool {name!r} (calc_reward)")
            except ToolThreadsExhausted:
                raise
            except (Exception, SystemExit) as err:
                data.metrics["tool_errors"] += 1
                data.extra_fields.setdefault("tool_reward_errors", {})[name] = describe(err)
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
        return truncate_text(text, self.max_tool_response_length, self.truncate_side)

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


def _tool_result(result) -> tuple[str | None, float | None, list]:
    """(text, reward, images) of what `execute` returned: (ToolResponse | str | dict, reward, metrics); text None
    when it is none of these."""
    response, reward = result, None
    if isinstance(result, tuple):
        if not result:
            return None, None, []
        response = result[0]
        if len(result) > 1 and isinstance(result[1], (int, float)) and not isinstance(result[1], bool):
            reward = float(result[1])
    if isinstance(response, str):
        return response, reward, []
    if isinstance(response, dict):
        return str(response.get("text") or ""), reward, list(response.get("image") or [])
    text = getattr(response, "text", None)
    images = list(getattr(response, "image", None) or [])
    if text is None and hasattr(response, "is_empty"):
        return "", reward, images
    return (str(text), reward, images) if text is not None else (None, None, [])
