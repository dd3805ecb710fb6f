"""hyflow.tools: schemas, the verl-format YAML loader and its errors, the calculator, the code interpreter."""

from __future__ import annotations

import asyncio
import re
import textwrap

import pytest

from hyflow.tools import (
    BaseTool,
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
    initialize_tools_from_config,
    load_tools,
    tool_schemas,
)
from hyflow.tools.calculator import CalculatorTool
from hyflow.tools.code_interpreter import CodeInterpreterTool

# ---- schemas -----------------------------------------------------------------------------------------------


def test_parsed_call_decodes_arguments_and_flags_bad_json():
    call, bad = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
        OpenAIFunctionParsedSchema(name="calculator", arguments='{"expression": "1+1"}')
    )
    assert (call.name, call.arguments, bad) == ("calculator", {"expression": "1+1"}, False)
    for arguments in ("{not json", "[1, 2]", '"text"'):
        call, bad = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
            OpenAIFunctionParsedSchema(name="f", arguments=arguments)
        )
        assert call.arguments == {} and bad
    tool_call = OpenAIFunctionToolCall(id="call_0", function=call)
    assert tool_call.type == "function"


def test_tool_response_checks_media_lists():
    assert ToolResponse().is_empty() and not ToolResponse().is_text_only()
    assert ToolResponse(text="hi").is_text_only() and not ToolResponse(text="hi").is_empty()
    assert not ToolResponse(text="hi", image=["img"]).is_text_only()
    with pytest.raises(ValueError, match=r"image must be a list.*\[item\]"):
        ToolResponse(image="img")
    with pytest.raises(ValueError, match="video must be a list"):
        ToolResponse(video=3)


def test_function_schema_defaults_to_no_parameters():
    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "f", "description": "d"}}
    )
    assert schema.function.parameters.type == "object" and schema.function.parameters.properties == {}
    assert schema.function.strict is False


# ---- BaseTool ----------------------------------------------------------------------------------------------


def test_base_tool_without_a_schema_says_where_to_give_it():
    class NoSchemaTool(BaseTool):
        pass

    with pytest.raises(ValueError, match=r"NoSchemaTool.*`tool_schema`.*YAML"):
        NoSchemaTool({}, None)


def test_base_tool_defaults():
    tool = CalculatorTool()
    assert tool.name == "calculator" and tool.config == {}

    async def lifecycle():
        instance_id, response = await BaseTool.create(tool)
        assert len(instance_id) == 32 and response.is_empty()
        assert (await BaseTool.create(tool, "mine"))[0] == "mine"
        assert await tool.calc_reward(instance_id) == 0.0
        assert await tool.release(instance_id) is None

    asyncio.run(lifecycle())


# ---- calculator --------------------------------------------------------------------------------------------


def calc(expression, tool=None):
    tool = tool or CalculatorTool()
    return asyncio.run(tool.execute("id", {"expression": expression}))


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("6**5 - 1", "7775"),
        ("-12", "-12"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("2 ** 3 ** 2", "512"),
        ("-2 ** 2", "-4"),
        ("-(3 - 5) * +2", "4"),
        ("6 / 3", "2"),
        ("1 / 3 * 3", "1"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),
        ("2 / 3", "0.6666666667"),
        ("0.1 + 0.2", "0.3"),
        ("2.5 * 2", "5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 0.5", "1.414213562"),
        ("2 ** -3", "0.125"),
        ("2 ** 64", "18446744073709551616"),
        ("1e20 / 3", "3.333333333e+19"),
        ("  1 + 1  ", "2"),
    ],
)
def test_calculator_values(expression, expected):
    response, reward, metrics = calc(expression)
    assert (response.text, reward, metrics) == (expected, 0.0, {"ok": True})


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("5 // (2 - 2)", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 65", r"exponent 65 is too large.*<= 64"),
        ("2 ** -100", r"exponent -100 is too large"),
        ("(10 ** 20) ** 6", r"exceeds 10\*\*100"),
        ("10 ** 50 * 10 ** 50", r"exceeds 10\*\*100"),
        ("(-8) ** (1 / 3)", "complex"),
        ("x + 1", "name 'x'"),
        ("abs(-1)", r"function call abs\(\.\.\.\)"),
        ("__import__('os').system('ls')", "function call"),
        ("(1).real", "attribute access"),
        ("'12'", "string literal"),
        ("True + 1", "boolean"),
        ("1 ^ 2", r"\^ \(write \*\* for powers\)"),
        ("1 < 2", "comparison"),
        ("[1, 2]", "list"),
        ("1 +", "invalid syntax"),
        ("", "empty expression"),
    ],
)
def test_calculator_errors_are_texts(expression, message):
    response, reward, metrics = calc(expression)
    assert response.text.startswith("error: ") and reward == 0.0
    assert metrics["error"] == response.text.removeprefix("error: ")
    assert re.search(message, response.text), response.text


@pytest.mark.parametrize(
    ("parameters", "message"),
    [({"expression": 12}, "must be a string, got int"), ({"expression": None}, "missing"), ({}, "missing")],
)
def test_calculator_non_string_input(parameters, message):
    response, reward, metrics = asyncio.run(CalculatorTool().execute("id", parameters))
    assert message in response.text and reward == 0.0 and "error" in metrics


def test_calculator_length_limit():
    expression = "+".join(["1"] * 101)  # 201 characters
    assert "limit is 200" in calc(expression)[0].text
    tool = CalculatorTool({"max_length": 500})
    assert calc(expression, tool)[0].text == "101"
    assert "limit is 10" in calc("1+1+1+1+1+1", CalculatorTool({"max_length": 10}))[0].text


def test_calculator_counts_calls_per_instance():
    tool = CalculatorTool()

    async def run():
        first, _ = await tool.create()
        second, _ = await tool.create("second")
        await tool.execute(first, {"expression": "1+1"})
        await tool.execute(first, {"expression": "oops"})
        await tool.execute(second, {"expression": "2"})
        assert tool._calls == {first: 2, "second": 1}
        await tool.release(first)
        assert tool._calls == {"second": 1}

    asyncio.run(run())


# ---- code interpreter --------------------------------------------------------------------------------------


def test_code_interpreter_prints_errors_and_times_out():
    tool = CodeInterpreterTool({"timeout": 1})
    assert tool.name == "code_interpreter"

    def run(code):
        return asyncio.run(tool.execute("id", {"code": code}))

    response, reward, metrics = run("print(6 * 7)")
    assert (response.text, reward, metrics["status"]) == ("42\n", 0.0, "ok") and metrics["wall_s"] > 0
    response, _, metrics = run("print('before')\nprint(1 / 0)")
    assert (
        response.text == "before\nerror: ZeroDivisionError: division by zero" and metrics["status"] == "error"
    )
    response, _, metrics = run("while True:\n    pass")
    assert response.text == "timeout after 1 s" and metrics["status"] == "timeout"
    assert run("x = 1")[0].text == "(no output)"


def test_code_interpreter_refuses_non_string_code_and_bad_config():
    response, reward, metrics = asyncio.run(CodeInterpreterTool().execute("id", {"code": ["print(1)"]}))
    assert (
        response.text == "error: `code` must be a string, got list" and reward == 0.0 and "error" in metrics
    )
    assert "missing" in asyncio.run(CodeInterpreterTool().execute("id", {}))[0].text
    with pytest.raises(ValueError, match="`timeout` must be a positive number"):
        CodeInterpreterTool({"timeout": 0})


# ---- the YAML loader ---------------------------------------------------------------------------------------

COUNTING_TOOL = '''
from hyflow.tools import BaseTool, ToolResponse


class CountingTool(BaseTool):
    """Counts calls per instance and remembers its create kwargs; the reward is the number of calls."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.calls = {}
        self.created_with = {}
        self.released = []

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        self.calls[instance_id] = 0
        self.created_with[instance_id] = (ground_truth, kwargs.get("create_kwargs"))
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        self.calls[instance_id] += 1
        return ToolResponse(text=f"{parameters['word']} #{self.calls[instance_id]}"), 0.5, {"n": 1}

    async def calc_reward(self, instance_id, **kwargs):
        return float(self.calls[instance_id])

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)
        del self.calls[instance_id]


class CountingHelper:
    pass


def counting_function():
    pass
'''

COUNTING_SCHEMA = """
    tool_schema:
      type: function
      function:
        name: echo
        description: Echo a word
        parameters:
          type: object
          properties:
            word: {type: string, description: the word}
          required: [word]
"""


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    """A module `my_counting_tools` (a file in tmp_path, on sys.path) defining `CountingTool`."""
    (tmp_path / "my_counting_tools.py").write_text(COUNTING_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_counting_tools"
    import sys

    sys.modules.pop("my_counting_tools", None)


def write_yaml(tmp_path, text, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_verl_yaml_loads_a_user_tool_and_runs_its_lifecycle(tmp_path, tool_module):
    path = write_yaml(
        tmp_path,
        f'tools:\n  - class_name: "{tool_module}.CountingTool"\n'
        "    config:\n      type: native\n      greeting: ${oc.env:HYFLOW_TEST_UNSET,hello}\n"
        + COUNTING_SCHEMA[1:]
        + "  - class_name: hyflow.tools.calculator.CalculatorTool\n    config: {max_length: 50}\n",
    )
    tools = initialize_tools_from_config(str(path))
    assert load_tools is initialize_tools_from_config
    echo, calculator = tools
    assert type(echo).__name__ == "CountingTool" and isinstance(echo, BaseTool)
    assert (echo.name, echo.config) == ("echo", {"type": "native", "greeting": "hello"})
    assert (calculator.name, calculator.max_length, calculator.config["type"]) == ("calculator", 50, "native")

    async def trajectory():
        create_kwargs = {"ground_truth": "42"}
        instance_id, _ = await echo.create(create_kwargs=create_kwargs, **create_kwargs)
        assert echo.created_with[instance_id] == ("42", {"ground_truth": "42"})
        first = await echo.execute(instance_id, {"word": "hi"})
        second = await echo.execute(instance_id, {"word": "ho"})
        assert (first[0].text, first[1], first[2]) == ("hi #1", 0.5, {"n": 1})
        assert second[0].text == "ho #2"
        assert await echo.calc_reward(instance_id) == 2.0
        await echo.release(instance_id)
        assert echo.released == [instance_id] and echo.calls == {}

    asyncio.run(trajectory())


def test_tool_schemas_for_the_chat_template(tmp_path, tool_module):
    path = write_yaml(tmp_path, f"tools:\n  - class_name: {tool_module}.CountingTool\n" + COUNTING_SCHEMA[1:])
    tools = load_tools(path)
    schemas = tool_schemas([*tools, CalculatorTool()])
    assert schemas[0] == {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Echo a word",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "description": "the word"}},
                "required": ["word"],
            },
        },
    }
    assert schemas[1]["function"]["name"] == "calculator"
    assert schemas[1]["function"]["parameters"]["required"] == ["expression"]


def test_file_path_class_name(tmp_path, monkeypatch):
    tools_dir = tmp_path / "my_tools"
    tools_dir.mkdir()
    (tools_dir / "counting.py").write_text(COUNTING_TOOL)
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    absolute = write_yaml(
        config_dir,
        f"tools:\n  - class_name: {tools_dir / 'counting.py'}:CountingTool\n" + COUNTING_SCHEMA[1:],
    )
    assert type(load_tools(absolute)[0]).__name__ == "CountingTool"
    # A relative path: from the current directory, else from the YAML file's directory.
    monkeypatch.chdir(tmp_path)
    from_cwd = write_yaml(
        config_dir,
        "tools:\n  - class_name: my_tools/counting.py:CountingTool\n" + COUNTING_SCHEMA[1:],
        name="cwd.yaml",
    )
    assert load_tools(from_cwd)[0].name == "echo"
    from_yaml_dir = write_yaml(
        config_dir,
        "tools:\n  - class_name: ../my_tools/counting.py:CountingTool\n" + COUNTING_SCHEMA[1:],
        name="rel.yaml",
    )
    monkeypatch.chdir(tools_dir)
    assert load_tools(from_yaml_dir)[0].name == "echo"


def test_tool_schema_from_the_class_when_the_yaml_has_none(tmp_path):
    path = write_yaml(
        tmp_path,
        "tools:\n  - class_name: hyflow.tools.code_interpreter.CodeInterpreterTool\n"
        "    config: {timeout: 3}\n",
    )
    (tool,) = load_tools(path)
    assert (tool.name, tool.timeout_s, tool.memory_mb) == ("code_interpreter", 3, 512)


def test_empty_tools_list(tmp_path):
    assert load_tools(write_yaml(tmp_path, "tools: []\n")) == []


def loader_error(tmp_path, text, name="tools.yaml"):
    path = write_yaml(tmp_path, text, name)
    with pytest.raises(ValueError) as info:
        load_tools(path)
    message = str(info.value)
    assert str(path) in message, message
    return message


def test_error_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.yaml does not exist; fix the path"):
        load_tools(tmp_path / "nope.yaml")


def test_error_no_tools_list(tmp_path):
    message = loader_error(tmp_path, "tool:\n  - class_name: a.B\n")
    assert "no top-level `tools:` list" in message and "class_name:" in message
    assert "must be a list" in loader_error(tmp_path, "tools: {class_name: a.B}\n")
    assert "no top-level `tools:` list" in loader_error(tmp_path, "- class_name: a.B\n")


def test_error_entry_without_class_name(tmp_path):
    message = loader_error(tmp_path, "tools:\n  - config: {type: native}\n")
    assert (
        "tools[0]: missing `class_name`" in message
        and "add `class_name: package.module.ClassName`" in message
    )
    assert "tools[0]: each entry must be a mapping" in loader_error(tmp_path, "tools:\n  - just_a_string\n")


def test_error_unknown_entry_key(tmp_path):
    message = loader_error(
        tmp_path, "tools:\n  - class_name: hyflow.tools.calculator.CalculatorTool\n    tool_shema: {}\n"
    )
    assert "tools[0]: unknown key(s) `tool_shema` (did you mean `tool_schema`?)" in message


def test_error_module_not_importable(tmp_path):
    message = loader_error(tmp_path, "tools:\n  - class_name: hyflow.tools.calcuator.CalculatorTool\n")
    assert "tools[0]: class_name='hyflow.tools.calcuator.CalculatorTool': cannot import module 'hyflow.tools.calcuator'" in (
        message)
    assert "ModuleNotFoundError" in message and "PYTHONPATH" in message
    assert "must be a dotted import path" in loader_error(
        tmp_path, "tools:\n  - class_name: CalculatorTool\n"
    )
    message = loader_error(tmp_path, "tools:\n  - class_name: missing_dir/tool.py:MyTool\n")
    assert "names the file missing_dir/tool.py, which does not exist" in message and "fix the path" in message


def test_error_module_with_a_missing_dependency(tmp_path, monkeypatch):
    (tmp_path / "needs_dependency.py").write_text("import hyflow_no_such_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = loader_error(tmp_path, "tools:\n  - class_name: needs_dependency.MyTool\n")
    assert (
        "importing module 'needs_dependency' failed" in message
        and "install 'hyflow_no_such_package'" in message
    )
    (tmp_path / "raises.py").write_text("raise RuntimeError('broken module')\n")
    message = loader_error(tmp_path, "tools:\n  - class_name: raises.MyTool\n")
    assert "raised RuntimeError: broken module" in message


def test_error_class_not_in_module(tmp_path, tool_module):
    message = loader_error(tmp_path, f"tools:\n  - class_name: {tool_module}.CountingTol\n")
    assert f"tools[0]: class_name='{tool_module}.CountingTol': module '{tool_module}' has no class 'CountingTol'" in (
        message)
    assert (
        "Did you mean 'CountingTool'?" in message
        and "BaseTool classes defined there: CountingTool" in message
    )
    assert "fix the name" in message


def test_error_not_a_tool_class(tmp_path, tool_module):
    message = loader_error(tmp_path, f"tools:\n  - class_name: {tool_module}.CountingHelper\n")
    assert (
        "is not a BaseTool (it lacks create, execute)" in message
        and "subclass hyflow.tools.BaseTool" in message
    )
    assert "is a function, not a class" in loader_error(
        tmp_path, f"tools:\n  - class_name: {tool_module}.counting_function\n"
    )


def test_duck_typed_tool_class_is_accepted(tmp_path, monkeypatch):
    (tmp_path / "duck_tools.py").write_text(
        textwrap.dedent("""
        class DuckTool:
            def __init__(self, config, tool_schema):
                self.config, self.tool_schema, self.name = config, tool_schema, tool_schema.function.name
            async def create(self, instance_id=None, **kwargs):
                return instance_id or "x", None
            async def execute(self, instance_id, parameters, **kwargs):
                return None, 0.0, {}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_yaml(tmp_path, "tools:\n  - class_name: duck_tools.DuckTool\n" + COUNTING_SCHEMA[1:])
    assert load_tools(path)[0].name == "echo"


def test_error_tool_type_other_than_native(tmp_path):
    message = loader_error(
        tmp_path, "tools:\n  - class_name: hyflow.tools.calculator.CalculatorTool\n    config: {type: mcp}\n"
    )
    assert "tools[0]: config.type 'mcp' is not supported" in message and "set `type: native`" in message


def test_error_invalid_tool_schema(tmp_path):
    message = loader_error(
        tmp_path,
        "tools:\n  - class_name: hyflow.tools.calculator.CalculatorTool\n"
        "    tool_schema: {type: function, function: {description: no name}}\n",
    )
    assert "tools[0]: tool_schema is not a valid OpenAI function schema" in message
    assert "function.name" in message and "Field required" in message  # pydantic's own message


def test_error_no_schema_anywhere(tmp_path):
    message = loader_error(tmp_path, "tools:\n  - class_name: hyflow.tools.base.BaseTool\n")
    assert "tools[0]: constructing hyflow.tools.base.BaseTool failed" in message
    assert "give `tool_schema` for it in the tools YAML" in message


def test_error_duplicate_tool_names(tmp_path):
    message = loader_error(
        tmp_path,
        "tools:\n  - class_name: hyflow.tools.calculator.CalculatorTool\n"
        "  - class_name: hyflow.tools.calculator.CalculatorTool\n",
    )
    assert "tools[1]: tools[0] and tools[1] are both named 'calculator'" in message
    assert "unique tool_schema.function.name" in message


def test_error_bad_yaml(tmp_path):
    message = loader_error(tmp_path, "tools:\n  - class_name: [unclosed\n")
    assert "cannot be read as YAML" in message


# ---------------------------------------------------------------------------------------------- ToolRunner
def test_tool_runner_abandons_blocked_calls_and_stops_before_leaking_without_end():
    """The runner returns results and exceptions (SystemExit too), abandons a blocked call at its deadline
    (counted as stuck while its thread is blocked), and refuses new calls once `max_stuck` threads are stuck."""
    import threading
    import time

    from hyflow.tools.runner import ToolRunner, ToolThreadsExhausted, ToolTimeout

    never = threading.Event()
    runner = ToolRunner(max_threads=2, max_stuck=2)

    async def value():
        return 7

    async def exits():
        raise SystemExit(3)

    def blocks():  # a duck-typed tool may define plain methods: their return value is used as is
        never.wait()

    async def main():
        assert await runner.run(value, 1.0, "value") == 7
        with pytest.raises(SystemExit):
            await runner.run(exits, 1.0, "exits")
        started = time.monotonic()
        results = await asyncio.gather(*(runner.run(blocks, 0.3, f"blocker {i}") for i in range(2)),
                                       return_exceptions=True)
        assert time.monotonic() - started < 2.0  # two threads: both time out together
        assert all(isinstance(r, ToolTimeout) for r in results), results
        assert sorted(runner.stuck_threads()) == ["blocker 0", "blocker 1"]
        await runner.run(value, 1.0, "value")  # raises: 2 stuck threads are the limit

    try:
        with pytest.raises(ToolThreadsExhausted, match="2 tool threads are stuck .*blocker"):
            asyncio.run(main())
    finally:
        never.set()
    time.sleep(0.2)
    assert runner.stuck_threads() == []  # released threads are no longer counted
    assert asyncio.run(runner.run(value, 1.0, "value")) == 7
