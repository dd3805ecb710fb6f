"""`BaseTool`: the class a tool subclasses (verl's ``verl.tools.base_tool.BaseTool``, same methods).

Lifecycle, as hyflow's agent loop drives it. One tool object serves every trajectory; per-trajectory state
lives under an *instance id*:

1. ``create(create_kwargs=ck, **ck)`` at the tool's first call in a trajectory, where ``ck`` is the sample's
   ``extra_info["tools_kwargs"][tool.name]["create_kwargs"]`` (``{}`` when absent). Both spellings are
   passed so that tools written for old verl (named keyword arguments such as ``ground_truth``) and for new
   verl (``kwargs["create_kwargs"]``) both work. It returns ``(instance_id, ToolResponse)``.
2. ``execute(instance_id, parameters)`` for every call the model makes to this tool in that trajectory, with
   the decoded JSON arguments. It returns ``(ToolResponse, step_reward, metrics)``.
3. ``calc_reward(instance_id)`` and then ``release(instance_id)`` when the trajectory ends.

Each call runs on a worker thread of the agent loop's `hyflow.tools.runner.ToolRunner`, in an event loop of its
own, and is abandoned at its timeout (``multi_turn.tool_timeout`` or the tool's ``config.timeout``): blocking
code inside ``execute`` (``time.sleep``, a synchronous HTTP client, heavy computation) holds only its own
thread and gets the timeout error, it does not stall the other trajectories. Python cannot kill a thread, so a
call that blocks for ever leaves a stuck thread behind (counted as ``tool/stuck_threads``): give blocking work
a timeout of its own. Because calls run on different threads and event loops, state a tool shares between
calls must be thread-safe (``threading.Lock``, not ``asyncio.Lock``).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from hyflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """Base class for tools (see the module docstring for the lifecycle).

    Subclasses override `execute` (and usually `create`, `calc_reward`, `release` when they keep state per
    trajectory). A subclass that always has the same schema overrides `get_openai_tool_schema` so the YAML
    may leave ``tool_schema`` out.
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config if config is not None else {}
        self.tool_schema = tool_schema
        if self.tool_schema is None:
            self.tool_schema = self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(
                f"{type(self).__name__} has no tool schema: give `tool_schema` for it in the tools YAML "
                "(type: function, function: {name, description, parameters}), or override "
                "get_openai_tool_schema() in the class"
            )
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        """The tool's schema in OpenAI format (the one given to the constructor; None before it is set)."""
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start per-trajectory state. Returns the instance id (a new uuid4 hex when `instance_id` is None)
        and a response (empty by default; the agent loop does not show it to the model).

        `kwargs` holds the sample's create kwargs twice: as ``create_kwargs=<dict>`` and spread out as
        keyword arguments (see the module docstring).
        """
        return (instance_id if instance_id is not None else uuid4().hex), ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        """Run one call with the model's decoded arguments `parameters`.

        Returns ``(response, step_reward, metrics)``: the response shown to the model, a per-step reward and a
        dict of metrics. Report bad model input as a response text rather than by raising. Blocking work is
        allowed (the call runs on a thread of its own) but should carry its own timeout (see the module
        docstring).
        """
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The tool's reward for the whole trajectory, asked once when it ends (0.0 by default)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the per-trajectory state of `instance_id` (called last, after `calc_reward`)."""
        return None
