"""Tool-call parsers: the text of one assistant turn -> its content and the tool calls it makes.

Parsers are registered by name (`rollout.multi_turn.format`, verl's key): `hermes` (Qwen2.5 / Hermes,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) is built in; `@register_tool_parser("mine")` (verl's
spelling `@ToolParser.register("mine")` also works) adds one to `TOOL_PARSERS`. A parser never raises on the
policy's output: every call it cannot read (bad JSON, no name, arguments that are not an object, a
`<tool_call>` never closed) comes back as a `MalformedCall` with the reason, which the
agent loop turns into an error message in the tool turn and counts (`tool/malformed_calls`).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hyflow.registry import Registry


@dataclass
class FunctionCall:
    """One call as the model wrote it: `arguments` is a JSON object string (verl's FunctionCall)."""

    name: str
    arguments: str
    tool_call_id: str | None = None

    def parsed_arguments(self) -> dict[str, Any]:
        return json.loads(self.arguments)


@dataclass
class MalformedCall:
    """A call the parser could not read: the text it saw and why."""

    text: str
    reason: str


@dataclass
class ParsedTurn:
    content: str  # the turn's text without the tool-call markup
    calls: list[FunctionCall] = field(default_factory=list)
    malformed: list[MalformedCall] = field(default_factory=list)


class ToolParser(ABC):
    """Base class: `parse(text) -> ParsedTurn`; `stop_token_ids` are extra ids at which a turn must stop so the
    parser can run (empty for formats whose models end the turn with EOS after a call, as hermes does)."""

    registry: ClassVar[Registry]  # = TOOL_PARSERS, set below

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    @property
    def stop_token_ids(self) -> list[int]:
        return []

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn: ...

    def parse_ids(self, token_ids: Sequence[int], *, end_ids: Iterable[int] = ()) -> ParsedTurn:
        """Parse one turn from the token ids the model produced: the one decode path of the agent loop and of
        `extract_tool_calls`.

        The ids are decoded with their special tokens kept: a format's markers may be special tokens (Qwen's
        `<tool_call>` in tokenizers that mark it special, Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`), and
        decoding with `skip_special_tokens=True` made them vanish, so a well-formed call was neither run nor
        counted as malformed. The turn's closing ids (the tokenizer's EOS and `end_ids`: the engine's EOS and stop
        ids) are dropped before decoding, and the special tokens left in the content (outside the calls) are
        removed from it, so the content reads as a decode without special tokens would.
        """
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__} was made without a tokenizer; parse(text) needs none")
        ids = list(token_ids)
        closing = set(end_ids)
        if self.tokenizer.eos_token_id is not None:
            closing.add(self.tokenizer.eos_token_id)
        while ids and ids[-1] in closing:
            ids.pop()
        turn = self.parse(self.tokenizer.decode(ids, skip_special_tokens=False))
        for token in _special_token_texts(self.tokenizer):
            turn.content = turn.content.replace(token, "")
        return turn

    async def extract_tool_calls(self, responses_ids: list[int], tools=None) -> tuple[str, list[FunctionCall]]:
        """verl's parser method: decode the ids and return (content, calls); malformed calls are left out."""
        parsed = self.parse_ids(responses_ids)
        return parsed.content, parsed.calls

    @classmethod
    def register(cls, name: str):
        """verl's spelling of `register_tool_parser(name)`: a decorator registering a parser class."""
        return TOOL_PARSERS.register(name)

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer=None) -> ToolParser:
        """verl's spelling of `make_tool_parser(name, tokenizer)`."""
        return make_tool_parser(name, tokenizer)


TOOL_PARSERS = Registry("tool-call format", hint="Register your own with "
                                                 "@hyflow.rollout.tool_parser.register_tool_parser(name).")
ToolParser.registry = TOOL_PARSERS  # verl's attribute


def register_tool_parser(name: str):
    """Register a `ToolParser` subclass as the format `name` (`rollout.multi_turn.format`)."""
    return TOOL_PARSERS.register(name)


def make_tool_parser(name: str, tokenizer=None) -> ToolParser:
    """The parser registered as `name`, over `tokenizer`; an unknown name is a ValueError naming the closest."""
    if name not in TOOL_PARSERS:
        raise TOOL_PARSERS.unknown(name, " (actor_rollout_ref.rollout.multi_turn.format)")
    return TOOL_PARSERS.get(name)(tokenizer)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>`, any number per turn.

    `arguments` may also be a JSON string holding an object (some models double-encode). A `<tool_call>` with
    no closing tag is malformed (the turn was cut or the model forgot it)."""

    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn(content=self._CALL.sub("", text))
        for match in self._CALL.finditer(text):
            call = _read_call(match.group(1))
            (turn.calls if isinstance(call, FunctionCall) else turn.malformed).append(call)
        rest = self._CALL.sub("", text)
        if self.START in rest:
            tail = rest[rest.index(self.START):]
            turn.malformed.append(MalformedCall(tail, f"{self.START} without {self.END}"))
            turn.content = rest[: rest.index(self.START)]
        return turn


def _special_token_texts(tokenizer) -> list[str]:
    """Every special token's text (`all_special_tokens` and added tokens marked special), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts |= {token.content for token in decoder.values() if getattr(token, "special", False)}
    return sorted((t for t in texts if t), key=len, reverse=True)


def _read_call(body: str) -> FunctionCall | MalformedCall:
    text = body.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return MalformedCall(text, f"the call is not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(value, dict):
        return MalformedCall(text, f"the call must be a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(text, 'the call has no "name" string')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return MalformedCall(text, f'the "arguments" of {name!r} are a string that is not JSON')
    if not isinstance(arguments, dict):
        return MalformedCall(text, f'the "arguments" of {name!r} must be a JSON object, got '
                                   f"{type(arguments).__name__}")
    call_id = value.get("id")
    return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False),
                        tool_call_id=call_id if isinstance(call_id, str) else None)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
    "object": (dict,), "null": (type(None),),
}


def check_arguments(arguments: dict[str, Any], parameters: dict[str, Any] | None) -> str | None:
    """Why `arguments` do not fit the tool's JSON-schema `parameters` (required keys, known keys, the types of
    `properties`), or None when they fit. Types are checked one level deep, as OpenAI's `strict: false` does."""
    if not parameters:
        return None
    properties = parameters.get("properties") or {}
    missing = [key for key in parameters.get("required") or [] if key not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(map(repr, missing))}"
    if properties:
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            return (f"unknown argument(s) {', '.join(map(repr, unknown))}; the tool takes "
                    f"{', '.join(map(repr, properties))}")
    for key, value in arguments.items():
        spec = properties.get(key) or {}
        kinds = spec.get("type")
        if kinds is None:
            continue
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        allowed = tuple(t for kind in kinds for t in _JSON_TYPES.get(kind, (object,)))
        is_bool = isinstance(value, bool)
        if not isinstance(value, allowed) or (is_bool and "boolean" not in kinds):
            return f"argument {key!r} must be {' or '.join(kinds)}, got {type(value).__name__} {value!r}"
        if spec.get("enum") is not None and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return None
