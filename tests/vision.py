"""Shared pieces of the vision-language tests: PNG bytes, the tiny Qwen2-VL model with its processor, and a
batch of image prompts (three pictures of different sizes and one text-only prompt) as RLDataset collates them."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image

from hyflow.rollout.tool_parser import FunctionCall, ParsedTurn, ToolParser, register_tool_parser
from hyflow.tools import BaseTool, ToolResponse

COLOURS = ((200, 30, 30), (20, 20, 220), (20, 180, 20))


def png(colour, size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def tiny_vl(directory: Path, seed: int = 1):
    """(model directory, model, VisionProcessor) of a fresh tiny-vl model."""
    from transformers import AutoModelForImageTextToText

    from hyflow.models.tiny import make_tiny_model
    from hyflow.models.vision import VisionProcessor

    path = make_tiny_model(directory, preset="tiny-vl", seed=seed)
    return path, AutoModelForImageTextToText.from_pretrained(path).eval(), VisionProcessor.from_pretrained(path)


def image_prompts(processor, colours=COLOURS):
    """A collated prompt batch: one picture per colour (56, 84, 112 pixels wide) and a text-only prompt."""
    from hyflow.data.rl_dataset import RLDataset

    rows = [{"prompt": [{"role": "user", "content": f"<image>Which colour{'?' * (i + 1)}"}], "data_source": "shapes",
             "reward_model": {"ground_truth": "x"}, "images": [{"bytes": png(c, (56 + 28 * i, 56))}]}
            for i, c in enumerate(colours)]
    rows.append({"prompt": "No image: what is 2 + 2?", "data_source": "shapes", "reward_model": {"ground_truth": "4"}})
    dataset = RLDataset(rows, processor.tokenizer, processor=processor, max_prompt_length=64)
    return dataset.collate([dataset[i] for i in range(len(dataset))])


# a random tiny model seldom ends a turn: stopping at any of these ids gives short turns, so tool calls (and their
# pictures) fit a small response budget
STOPS = tuple(range(100, 400))
SHOWN = []  # the colours LookTool showed, in call order


@register_tool_parser("always_look")
class AlwaysLook(ToolParser):
    """Every assistant turn is one call of `look` (a random tiny model writes no tool-call markup); its turns stop
    at any of `STOPS` (a format's stop ids join the turn's)."""

    @property
    def stop_token_ids(self) -> list[int]:
        return list(STOPS)

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(content=text, calls=[FunctionCall("look", "{}")])


class LookTool(BaseTool):
    """Returns a picture (its colour from the tool's config) and a line of text, as verl's image tools do."""

    async def execute(self, instance_id, parameters, **kwargs):
        colour = tuple(self.config.get("colour", (250, 200, 0)))
        SHOWN.append(colour)
        text = self.config.get("text", "a picture:")
        return ToolResponse(image=[Image.new("RGB", (56, 84), colour)], text=text), 0.0, {}
