"""Interactions from a YAML file in verl's format (``rollout.multi_turn.interaction_config_path``).

.. code-block:: yaml

    interaction:
      - name: gsm8k                         # optional; default: class name minus "Interaction", lower-cased
        class_name: my_package.interactions.Gsm8kInteraction   # or path/to/file.py:Gsm8kInteraction
        config: {max_turns: 3}              # handed to the constructor, with `name` added

`initialize_interactions_from_config(path)` (alias `load_interactions`) returns ``{name: interaction}``; a
sample picks one with ``extra_info["interaction_kwargs"]["name"]``. Every mistake raises a `ValueError`
naming the file, the entry (``interaction[i]``) and the fix, as the tools loader does
(`hyflow.tools.registry`), and two entries with the same name are an error.
"""

from __future__ import annotations

import os

from hyflow.interactions.base import BaseInteraction
from hyflow.tools.registry import check_entry, entry_config, load_entry_class, read_section

_EXAMPLE = """interaction:
  - name: my_interaction            # optional
    class_name: my_package.my_module.MyInteraction
    config: {}"""

_ENTRY_KEYS = ("name", "class_name", "config")
_METHODS = ("start_interaction", "generate_response")


def default_interaction_name(class_name: str) -> str:
    """``pkg.mod.Gsm8kInteraction`` -> ``gsm8k``: the class name without ``Interaction``, lower-cased."""
    simple = class_name.strip().rpartition(":")[2].rpartition(".")[2]
    if simple.endswith("Interaction") and len(simple) > len("Interaction"):
        simple = simple[: -len("Interaction")]
    return simple.lower()


def initialize_interactions_from_config(
    interaction_config_file: str | os.PathLike,
) -> dict[str, BaseInteraction]:
    """Instantiate the interactions declared in a verl-format YAML file; returns ``{name: interaction}``."""
    file, entries = read_section(interaction_config_file, "interaction", "interaction", _EXAMPLE)
    interactions: dict[str, BaseInteraction] = {}
    seen: dict[str, int] = {}
    for index, raw in enumerate(entries):
        where = f"{file}: interaction[{index}]"
        entry = check_entry(raw, where, _ENTRY_KEYS)
        config = entry_config(entry, where)
        name = entry.get("name")
        if name is None:
            name = default_interaction_name(entry["class_name"])
        elif not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"{where}: `name` must be a non-empty string, got {name!r}; fix it or leave it out"
            )
        if name in seen:
            raise ValueError(
                f"{where}: interaction[{seen[name]}] and interaction[{index}] are both named '{name}'; "
                "fix: give each entry a unique `name:`"
            )
        cls = load_entry_class(entry, where, file, BaseInteraction, _METHODS)
        config["name"] = name
        try:
            interaction = cls(config=config)
        except Exception as error:
            raise ValueError(
                f"{where}: constructing {entry['class_name']} failed: {type(error).__name__}: {error}"
            ) from error
        seen[name] = index
        interactions[name] = interaction
    return interactions


load_interactions = initialize_interactions_from_config
"""Alias of `initialize_interactions_from_config`."""
