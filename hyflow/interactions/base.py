"""`BaseInteraction`: a simulated user (verl's ``verl.interactions.base.BaseInteraction``, same methods).

An interaction answers the model between assistant turns: a user giving feedback ("try again"), an
environment reporting an outcome, a judge scoring each turn. How hyflow's agent loop drives it:

1. When a trajectory begins, the sample's ``extra_info["interaction_kwargs"]`` is looked at: its ``name``
   picks the interaction (one of those loaded from the interaction YAML), and
   ``start_interaction(instance_id, **interaction_kwargs)`` starts per-trajectory state (ground truth, turn
   counters) under that instance id.
2. Whenever an assistant turn contains no tool call, ``generate_response(instance_id, messages,
   **interaction_kwargs)`` gets the whole conversation so far (OpenAI-style ``{"role", "content"}`` dicts)
   and returns ``(should_terminate_sequence, response_content, current_turn_score, additional_data)``.
   ``should_terminate_sequence=True`` ends the trajectory; otherwise ``response_content`` is appended as a
   ``user`` message and generation continues. Every ``current_turn_score`` is appended to the trajectory's
   ``turn_scores``.
3. ``finalize_interaction(instance_id)`` when the trajectory ends, however it ends.

One interaction object serves all trajectories concurrently on one asyncio event loop: keep per-trajectory
state keyed by instance id, and run blocking work through ``await asyncio.to_thread(...)``.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4


class BaseInteraction:
    """Base class for interactions (see the module docstring for how the agent loop calls it).

    `config` is the entry's ``config`` mapping from the interaction YAML, with ``name`` set to the
    interaction's name.
    """

    def __init__(self, config: dict):
        self.config = config if config is not None else {}
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start per-trajectory state; returns the instance id (a new uuid4 hex when `instance_id` is None).
        `kwargs` are the sample's ``interaction_kwargs``."""
        return instance_id if instance_id is not None else uuid4().hex

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's answer to the conversation `messages`: ``(should_terminate_sequence, response_content,
        current_turn_score, additional_data)``. This default ends the conversation with score 0.0."""
        return True, "", 0.0, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        """A score for the interaction as a whole (0.0 by default)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        """Drop the per-trajectory state of `instance_id`."""
        return None
