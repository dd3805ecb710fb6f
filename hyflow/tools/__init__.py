"""Tools for multi-turn rollouts, compatible with verl's ``verl.tools``.

A tool is a `BaseTool` subclass with verl's methods (``create``, ``execute``, ``calc_reward``, ``release``),
declared in a YAML file in verl's format and loaded with `initialize_tools_from_config` (alias `load_tools`);
`tool_schemas(tools)` gives what the chat template needs as ``tools=``. Built in:
`hyflow.tools.calculator.CalculatorTool` and `hyflow.tools.code_interpreter.CodeInterpreterTool`.

Porting a verl tool means changing its imports, nothing else::

    from verl.tools.base_tool import BaseTool         ->  from hyflow.tools import BaseTool
    from verl.tools.schemas import ToolResponse       ->  from hyflow.tools import ToolResponse
    from verl.tools.schemas import OpenAIFunctionToolSchema
                                                      ->  from hyflow.tools import OpenAIFunctionToolSchema

and, in the tools YAML, ``class_name`` pointing at the ported class. verl-only decorators such as
``@rollout_trace_op`` (``verl.utils.rollout_trace``) have no counterpart here: drop them. See
`hyflow.tools.base` for the lifecycle the agent loop follows.
"""

from hyflow.tools.base import BaseTool
from hyflow.tools.registry import initialize_tools_from_config, load_tools, tool_schemas
from hyflow.tools.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
)

__all__ = [
    "BaseTool",
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
    "initialize_tools_from_config",
    "load_tools",
    "tool_schemas",
]
