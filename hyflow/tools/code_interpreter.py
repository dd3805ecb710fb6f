"""`CodeInterpreterTool`: run the model's Python in hyflow's local sandbox and return what it prints.

Each call runs `hyflow.rewards.sandbox.run_code` (a fresh, confined, resource-limited process: see that
module for the protections and their limits on a given machine) in a worker thread, so the event loop keeps
serving other trajectories while the code runs. Config: ``timeout`` (wall-clock seconds, default 10) and
``memory_mb`` (address-space limit, default 512).

The response is the program's stdout. When the program did not finish cleanly a status line follows: the
last line of stderr for an error (``error: ZeroDivisionError: division by zero``), ``timeout after 10 s``, or
``error: out of memory (limit 512 MiB)``. A successful run that prints nothing answers ``(no output)``, so
the model learns to ``print`` what it wants to see. Step reward 0.0; metrics ``{"status", "wall_s"}``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hyflow.rewards.sandbox import SandboxResult, run_code
from hyflow.tools.base import BaseTool
from hyflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

NO_OUTPUT = "(no output)"


def _positive(config: dict, key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"CodeInterpreterTool config `{key}` must be a positive number, got {value!r}")
    return value


def _last_error_line(stderr: str) -> str:
    """The last non-empty stderr line that is not a sandbox note (usually ``ExceptionType: message``)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    own = [line for line in lines if not line.startswith("[hyflow sandbox]")]
    if own:
        return own[-1]
    return lines[-1].removeprefix("[hyflow sandbox]").strip() if lines else "the program failed"


def format_result(result: SandboxResult, timeout_s: float, memory_mb: int) -> str:
    """The text the model sees for one run (see the module docstring)."""
    if result.status == "ok":
        return result.stdout if result.stdout else NO_OUTPUT
    if result.status == "timeout":
        status = f"timeout after {timeout_s:g} s"
    elif result.status == "memory":
        status = f"error: out of memory (limit {memory_mb} MiB)"
    else:
        status = f"error: {_last_error_line(result.stderr)}"
    if result.stdout:
        return result.stdout + ("" if result.stdout.endswith("\n") else "\n") + status
    return status


class CodeInterpreterTool(BaseTool):
    """Python in the local sandbox (see the module docstring). Config: ``timeout`` (s), ``memory_mb``."""

    def __init__(self, config: dict | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config if config is not None else {}, tool_schema)
        self.timeout_s = _positive(self.config, "timeout", 10)
        self.memory_mb = int(_positive(self.config, "memory_mb", 512))

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "code_interpreter",
                    "description": "Run Python code in a sandbox and return what it prints",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "code": {
                                "type": "string",
                                "description": "a Python program; print() the results",
                            },
                        },
                        "required": ["code"],
                    },
                },
            }
        )

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if code is None:
            message = "missing the `code` argument (a Python program as a string)"
            return ToolResponse(text=f"error: {message}"), 0.0, {"error": message}
        if not isinstance(code, str):
            message = f"`code` must be a string, got {type(code).__name__}"
            return ToolResponse(text=f"error: {message}"), 0.0, {"error": message}
        result = await asyncio.to_thread(run_code, code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        text = format_result(result, self.timeout_s, self.memory_mb)
        return ToolResponse(text=text), 0.0, {"status": result.status, "wall_s": result.wall_s}
