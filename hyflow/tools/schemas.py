"""OpenAI function-calling schemas and the tool response type, with verl's class and field names.

A tool's schema is what the chat template shows the model
(``tokenizer.apply_chat_template(..., tools=[...])``); `OpenAIFunctionParsedSchema` is a call as the tool
parser cut it out of the generated text (arguments still a JSON string), `OpenAIFunctionCallSchema` the same
call with the arguments decoded, and `ToolResponse` what a tool's ``execute`` hands back to the agent loop
(text and, for multimodal tools, lists of images/videos).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function. ``type`` is a JSON-schema type name, or a list of them for a union
    (``["integer", "number"]``); ``enum`` lists the allowed values (any JSON values)."""

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """The parameters object of a function: ``{"type": "object", "properties": {...}, "required": [...]}``."""

    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


def _no_parameters() -> OpenAIFunctionParametersSchema:
    return OpenAIFunctionParametersSchema(type="object", properties={}, required=[])


class OpenAIFunctionSchema(BaseModel):
    """A function: its name (what the model calls), a description and its parameters."""

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=_no_parameters)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool in OpenAI format: ``{"type": "function", "function": {...}}``."""

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as parsed from the model's text: the function name and its arguments as a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A call with decoded arguments."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """Decode the arguments; returns ``(call, has_decode_error)``. Arguments that are not valid JSON, or
        JSON that is not an object, give an empty dict and ``has_decode_error=True``."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except (json.JSONDecodeError, TypeError):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    """A tool call in OpenAI format (``{"id": ..., "type": "function", "function": {...}}``)."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns: ``text`` and/or lists of ``image`` / ``video`` items (None when absent)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_must_be_lists(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for key in ("image", "video"):
                value = values.get(key)
                if value is not None and not isinstance(value, list):
                    raise ValueError(
                        f"ToolResponse.{key} must be a list, got {type(value).__name__}; wrap a single item "
                        f"in a list in your tool's execute(): ToolResponse({key}=[item])"
                    )
        return values

    def is_empty(self) -> bool:
        """True when there is neither text nor images nor videos."""
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        """True when there is text and no images or videos."""
        return bool(self.text) and not self.image and not self.video
