"""Interactions (simulated users) for multi-turn rollouts, compatible with verl's ``verl.interactions``.

Porting a verl interaction means changing its import::

    from verl.interactions.base import BaseInteraction   ->  from hyflow.interactions import BaseInteraction

See `hyflow.interactions.base` for how the agent loop calls it and `hyflow.interactions.registry` for the
YAML format.
"""

from hyflow.interactions.base import BaseInteraction
from hyflow.interactions.registry import initialize_interactions_from_config, load_interactions

__all__ = ["BaseInteraction", "initialize_interactions_from_config", "load_interactions"]
