"""The qwen3_coder and llama3_json tool-call formats: calls rendered as the model families' chat templates render
them are parsed back to the same names and arguments; malformed calls are reported, never raised.

The templates below are the tool-call part of each family's chat template, written from the format those
templates produce (Qwen3-Coder / Qwen3.5: XML with one newline around each value, mappings and sequences as
JSON, other values with Jinja's `string` filter, so booleans read `True`; Llama 3.1: one JSON object with
"parameters" and `<|eot_id|>`). They render real assistant messages with jinja2, as transformers does.
"""

from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.rollout.tool_parser import Llama3JsonToolParser, Qwen3CoderToolParser, make_tool_parser

QWEN3_CODER_CALLS = (
    "{%- for tool_call in message.tool_calls %}"
    "{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '<tool_call>\\n<function=' ~ tool_call.name ~ '>\\n' -}}"
    "{%- for args_name, args_value in tool_call.arguments|items %}"
    "{{- '<parameter=' ~ args_name ~ '>\\n' -}}"
    "{%- set args_value = args_value | tojson if args_value is mapping or (args_value is sequence and args_value "
    "is not string) else args_value | string %}"
    "{{- args_value ~ '\\n</parameter>\\n' -}}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>\\n' -}}"
    "{%- endfor %}"
)
LLAMA3_CALLS = (
    "{%- for tool_call in message.tool_calls %}"
    "{%- set tool_call = tool_call.function %}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' + '\"parameters\": ' + tool_call.arguments | tojson + '}' }}"
    "{%- if not loop.last %}{{- '; ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
)

SCHEMAS = [
    {"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "top_k": {"type": "integer"}, "threshold": {"type": "number"},
        "exact": {"type": "boolean"}, "filters": {"type": "object"}, "fields": {"type": "array"},
        "note": {"type": ["string", "null"]}}}}},
]
CALLS = [
    {"name": "calculator", "arguments": {"expression": "6 * 7"}},
    {"name": "search", "arguments": {"query": "42\nlines < and > signs", "top_k": 3, "threshold": 0.25,
                                     "exact": True, "filters": {"year": 2024, "tags": ["a", "b"]},
                                     "fields": ["title", 1], "note": "123"}},
]


def render(template: str, calls: list[dict]) -> str:
    env = jinja2.Environment()
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    message = {"role": "assistant", "tool_calls": [{"type": "function", "function": c} for c in calls]}
    return env.from_string(template).render(message=message)


def test_qwen3_coder_calls_rendered_by_the_template_parse_back_to_the_same_arguments():
    parser = make_tool_parser("qwen3_coder")
    parser.set_tools(SCHEMAS)
    text = "I will compute it.\n" + render(QWEN3_CODER_CALLS, CALLS)
    assert "<parameter=exact>\nTrue\n</parameter>" in text  # the template writes Python's True
    turn = parser.parse(text)
    assert not turn.malformed and turn.content.strip() == "I will compute it."
    assert [{"name": c.name, "arguments": c.parsed_arguments()} for c in turn.calls] == CALLS


def test_qwen3_coder_without_a_schema_reads_json_values_and_keeps_text():
    parser = Qwen3CoderToolParser()  # no set_tools: the values' types are guessed
    call = {"name": "other", "arguments": {"n": 7, "flag": False, "items": [1, 2], "word": "seven", "num": "8"}}
    turn = parser.parse(render(QWEN3_CODER_CALLS, [call]))
    # 'False' (Python's spelling) is not JSON: it stays text; '8' is JSON: a number (only a schema can say string)
    assert turn.calls[0].parsed_arguments() == {"n": 7, "flag": "False", "items": [1, 2], "word": "seven", "num": 8}


@pytest.mark.parametrize("text, reason", [
    ("<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</function>", "without </tool_call>"),
    ("<tool_call>\n<parameter=expression>\n1\n</parameter>\n</tool_call>", "no <function=NAME>"),
    ("<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</tool_call>",
     "without </function>"),
    ("<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</function>\n</tool_call>",
     "without </parameter>"),
])
def test_qwen3_coder_malformed_calls_are_reported(text, reason):
    turn = Qwen3CoderToolParser().parse("ok " + text)
    assert not turn.calls and len(turn.malformed) == 1 and reason in turn.malformed[0].reason


def test_qwen3_coder_values_that_do_not_convert_stay_text_for_the_argument_check():
    parser = Qwen3CoderToolParser()
    parser.set_tools(SCHEMAS)
    text = "<tool_call>\n<function=search>\n<parameter=top_k>\nthree\n</parameter>\n</function>\n</tool_call>"
    assert parser.parse(text).calls[0].parsed_arguments() == {"top_k": "three"}


def test_llama3_calls_rendered_by_the_template_parse_back():
    parser = Llama3JsonToolParser()
    text = render(LLAMA3_CALLS, CALLS).removesuffix("<|eot_id|>")  # the turn's closing id is not parsed
    turn = parser.parse(text)
    assert not turn.malformed and turn.content == ""
    assert [{"name": c.name, "arguments": c.parsed_arguments()} for c in turn.calls] == CALLS
    tagged = parser.parse("Let me look.<|python_tag|>" + render(LLAMA3_CALLS, CALLS[:1]).removesuffix("<|eot_id|>"))
    assert tagged.content == "Let me look." and [c.name for c in tagged.calls] == ["calculator"]


def test_llama3_text_turns_and_broken_calls():
    parser = Llama3JsonToolParser()
    plain = parser.parse("The answer is 42. {not a call}")
    assert plain.content == "The answer is 42. {not a call}" and not plain.calls and not plain.malformed
    broken = parser.parse('{"name": "calculator", "parameters": {"expression": "1"}}; {"name": "calc')
    assert [c.name for c in broken.calls] == ["calculator"] and "not valid JSON" in broken.malformed[0].reason
    nameless = parser.parse('{"parameters": {"x": 1}}')
    assert not nameless.calls and 'no "name"' in nameless.malformed[0].reason


PIECES = [*list("<>/=\n{}[]\";: ab1"), "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
          "</parameter>", "<|python_tag|>", '{"name": "a", "parameters": ', "<|channel|>", "<|message|>",
          "<|call|>", "<|end|>", " to=functions.a", "<|start|>assistant", "final"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40).map("".join))
def test_parsers_never_raise_on_what_a_policy_writes(text):
    for parser in (Qwen3CoderToolParser(), Llama3JsonToolParser(), make_tool_parser("gpt-oss")):
        parser.set_tools(SCHEMAS)
        turn = parser.parse(text)
        for call in turn.calls:
            assert isinstance(call.parsed_arguments(), dict)


# ---------------------------------------------------------------------------------------------- gpt-oss (harmony)
def harmony_turn(calls: list[dict], analysis: str = "I should use the tool.", recipient_first: bool = False) -> str:
    """An assistant turn in the harmony format gpt-oss's template and model produce: reasoning, then each call."""
    parts = [f"<|channel|>analysis<|message|>{analysis}<|end|>"]
    for c in calls:
        name, args = c["name"], json.dumps(c["arguments"])
        if recipient_first:
            parts.append(f"<|start|>assistant to=functions.{name}<|channel|>commentary <|constrain|>json"
                         f"<|message|>{args}<|call|>")
        else:
            parts.append(f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
                         f"<|message|>{args}<|call|>")
    return "".join(parts)


@pytest.mark.parametrize("recipient_first", [False, True])
def test_gpt_oss_calls_parse_back(recipient_first):
    parser = make_tool_parser("gpt-oss")
    turn = parser.parse(harmony_turn(CALLS, recipient_first=recipient_first))
    assert not turn.malformed and turn.content == ""  # the analysis channel is reasoning, not content
    assert [{"name": c.name, "arguments": c.parsed_arguments()} for c in turn.calls] == CALLS


def test_gpt_oss_final_answers_and_broken_calls():
    parser = make_tool_parser("gpt-oss")
    final = parser.parse("<|channel|>analysis<|message|>14 it is.<|end|><|start|>assistant<|channel|>final"
                         "<|message|>The answer is 14.<|return|>")
    assert final.content == "The answer is 14." and not final.calls
    assert parser.parse("plain text, no harmony").content == "plain text, no harmony"
    broken = parser.parse("<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
                          "<|message|>{\"expression\": <|call|>")
    assert not broken.calls and "not JSON" in broken.malformed[0].reason
    listed = parser.parse("<|channel|>commentary to=functions.calculator<|message|>[1, 2]<|call|>")
    assert "must be a JSON object" in listed.malformed[0].reason
