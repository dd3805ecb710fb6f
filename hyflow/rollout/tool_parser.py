"""Tool-call parsers: the text of one assistant turn -> its content and the tool calls it makes.

Parsers are registered by name (`rollout.multi_turn.format`, verl's key). Built in: `hermes` (Qwen2.5 / Qwen3 /
Hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `qwen3_coder` (Qwen3-Coder / Qwen3.5's XML,
`<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>`, verl's name) and
`llama3_json` (Llama 3.x, `{"name": ..., "parameters": {...}}`, vLLM's name) and `gpt-oss` (harmony's
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, verl's name). `@register_tool_parser("mine")` (verl's
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
        self.tool_parameters: dict[str, dict[str, Any]] = {}  # tool name -> its JSON-schema `parameters`

    def set_tools(self, schemas: Iterable[dict[str, Any]]) -> None:
        """The tools the model may call (OpenAI function schemas, as the chat template receives them): formats
        whose arguments are untyped text (qwen3_coder's `<parameter=...>` values) read their types from here."""
        for schema in schemas:
            function = schema.get("function", schema)
            if function.get("name"):
                self.tool_parameters[function["name"]] = dict(function.get("parameters") or {})

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


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's (and Qwen3.5's) XML calls, any number per turn::

        <tool_call>
        <function=calculator>
        <parameter=expression>
        6 * 7
        </parameter>
        </function>
        </tool_call>

    A value is the text between its tags without the one newline on each side that the chat template writes.
    Its type comes from the tool's schema (`set_tools`): strings stay text; integers, numbers and booleans
    (`true`/`True`) are converted; objects and arrays are read as JSON (the template writes them with `tojson`).
    A value that does not convert stays text, so the argument check names the type error to the model. For a
    tool without a schema a value is read as JSON when it is JSON, else kept as text. An unclosed
    `<tool_call>`, a call without `<function=NAME>` or without `</function>`, and an unclosed `<parameter=` are
    malformed."""

    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)$", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn(content=self._CALL.sub("", text))
        for match in self._CALL.finditer(text):
            call = self._read(match.group(1))
            (turn.calls if isinstance(call, FunctionCall) else turn.malformed).append(call)
        if self.START in turn.content:
            cut = turn.content.index(self.START)
            turn.malformed.append(MalformedCall(turn.content[cut:], f"{self.START} without {self.END}"))
            turn.content = turn.content[:cut]
        return turn

    def _read(self, body: str) -> FunctionCall | MalformedCall:
        function = self._FUNCTION.match(body)
        if function is None:
            return MalformedCall(body.strip(), "the call has no <function=NAME>")
        name, rest = function.group(1).strip(), function.group(2)
        if "</function>" not in rest:
            return MalformedCall(body.strip(), f"<function={name}> without </function>")
        inner = rest[: rest.rindex("</function>")]
        if rest[rest.rindex("</function>") + len("</function>"):].strip():
            return MalformedCall(body.strip(), f"text after </function> in the call of {name!r}")
        if self._PARAMETER.sub("", inner).count("<parameter=") > 0:
            return MalformedCall(body.strip(), f"a <parameter= of {name!r} without </parameter>")
        properties = (self.tool_parameters.get(name) or {}).get("properties") or {}
        arguments: dict[str, Any] = {}
        for parameter in self._PARAMETER.finditer(inner):
            key, raw = parameter.group(1).strip(), _strip_one_newline(parameter.group(2))
            arguments[key] = _typed_value(raw, (properties.get(key) or {}).get("type"), known=name in self.tool_parameters)
        return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls: a turn that is one or more JSON objects
    `{"name": "calculator", "parameters": {"expression": "6 * 7"}}` (`"arguments"` is read too), separated by `;`
    or whitespace, optionally after `<|python_tag|>` (which may follow some text: that text is the content). A
    turn that does not start with `{` (after the tag) is content without calls. Calls end the turn with EOS
    (`<|eot_id|>`) or `<|eom_id|>`, which is a stop id when the tokenizer has it."""

    TAG = "<|python_tag|>"

    @property
    def stop_token_ids(self) -> list[int]:
        if self.tokenizer is None:
            return []
        eom = self.tokenizer.convert_tokens_to_ids("<|eom_id|>")
        return [eom] if isinstance(eom, int) and eom != self.tokenizer.unk_token_id else []

    def parse(self, text: str) -> ParsedTurn:
        content, body = (text.split(self.TAG, 1) if self.TAG in text else ("", text))
        if not body.lstrip().startswith("{"):
            return ParsedTurn(content=text.replace(self.TAG, ""))
        turn = ParsedTurn(content=content)
        decoder, position, body = json.JSONDecoder(), 0, body.strip()
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError as err:
                turn.malformed.append(MalformedCall(body[position:], f"the call is not valid JSON ({err.msg} at "
                                                                     f"character {err.pos - position})"))
                break
            if isinstance(value, dict) and "parameters" in value:  # Llama's key for the arguments
                value = {**{k: v for k, v in value.items() if k != "parameters"}, "arguments": value["parameters"]}
            call = _read_call(json.dumps(value))
            (turn.calls if isinstance(call, FunctionCall) else turn.malformed).append(call)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return turn


@register_tool_parser("gpt-oss")
class GptOssToolParser(ToolParser):
    """gpt-oss's harmony format (verl's name `gpt-oss`). A turn is a run of messages, each a header then
    `<|message|>` then its text up to `<|end|>`, `<|call|>` or `<|return|>`::

        <|channel|>analysis<|message|>I should compute it.<|end|>
        <|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "6 * 7"}<|call|>

    A message whose header names a recipient `to=functions.NAME` (before or after the channel, as harmony allows)
    is a call with that JSON body as its arguments; the `final` channel's text is the content (the `analysis`
    channel is reasoning, left out of it); a turn without harmony markers is content as it is. A call whose body
    is not a JSON object is malformed. `<|call|>` and `<|return|>` end a turn (stop ids when the tokenizer has
    them)."""

    # a message: its header (everything since the previous message ended: `<|start|>assistant`, the recipient, the
    # channel, `<|constrain|>json`), then its text
    _MESSAGE = re.compile(r"(?P<header>(?:(?!<\|message\|>).)*?)<\|message\|>(?P<body>.*?)"
                          r"(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL)
    _RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")
    _CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")

    @property
    def stop_token_ids(self) -> list[int]:
        if self.tokenizer is None:
            return []
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<|call|>", "<|return|>")]
        return [i for i in ids if isinstance(i, int) and i != self.tokenizer.unk_token_id]

    def parse(self, text: str) -> ParsedTurn:
        if "<|message|>" not in text:
            return ParsedTurn(content=text)
        turn = ParsedTurn(content="")
        finals: list[str] = []
        for match in self._MESSAGE.finditer(text):
            header, body = match.group("header"), match.group("body")
            recipient = self._RECIPIENT.search(header)
            if recipient is not None:
                call = _read_call(json.dumps({"name": recipient.group(1), "arguments": _json_or_text(body)}))
                if isinstance(call, FunctionCall):
                    turn.calls.append(call)
                else:
                    turn.malformed.append(MalformedCall(body.strip(), call.reason))
                continue
            channel = self._CHANNEL.search(header)
            if channel is None or channel.group(1) == "final":
                finals.append(body)
        turn.content = "".join(finals).strip()
        return turn


def _json_or_text(body: str) -> Any:
    """The JSON value of a call's body, or the body itself (then the call is malformed: not an object)."""
    try:
        return json.loads(body.strip())
    except json.JSONDecodeError:
        return body.strip()


def _strip_one_newline(value: str) -> str:
    """The text of a qwen3_coder value: the chat template writes one newline after the opening tag and one
    before the closing tag."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _typed_value(raw: str, kind: str | list | None, *, known: bool) -> Any:
    """`raw` as the schema's type says (see Qwen3CoderToolParser); unconvertible text stays text."""
    text = raw.strip()
    if not known:  # no schema for this tool: JSON when it is JSON
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return raw
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    for k in kinds:
        if k == "string":
            return raw
        if k == "null" and text.lower() in ("null", "none"):
            return None
        if k == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if k == "integer" and re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        if k == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            return int(number) if re.fullmatch(r"[+-]?\d+", text) else number
        if k in ("object", "array"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict if k == "object" else list):
                return value
    return raw


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
