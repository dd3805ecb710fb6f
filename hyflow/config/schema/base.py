"""The building blocks of the schema's dataclasses: `option` (a leaf with its help text), `section` (a nested
dataclass), the value lists several sections share, and the resolution of `${...}` defaults when a config is
built directly (`HyflowConfig()`, not `load_config`): OmegaConf resolves them, by the same rules as the loader.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_NAMES = KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def option(default: Any, help: str, *, choices: tuple[Any, ...] | None = None) -> Any:
    """A leaf field: `field(default=..., metadata={"help": ...})`; lists and dicts are copied per instance."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def option_like(cls: type, name: str) -> Any:
    """The leaf `name` of the schema dataclass `cls` again (same default, help text and choices), for a section
    that has the same key: one definition serves both (the SFT schema's keys that are the RL schema's)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return option(default, f.metadata["help"], choices=f.metadata.get("choices"))


def section(factory: Callable[[], Any], help: str) -> Any:
    """A nested section: `field(default_factory=factory, metadata={"help": ...})`."""
    return field(default_factory=factory, metadata={"help": help})


def holds_interpolation(node: Any) -> bool:
    """Whether a string anywhere in `node` (dataclasses, dicts, lists) is a `${...}` interpolation."""
    if dataclasses.is_dataclass(node):
        return any(holds_interpolation(getattr(node, f.name)) for f in dataclasses.fields(node))
    if isinstance(node, dict):
        return any(holds_interpolation(v) for v in node.values())
    if isinstance(node, list):
        return any(holds_interpolation(v) for v in node)
    return isinstance(node, str) and "${" in node


def resolve_interpolations(root: Any) -> None:
    """Replace the `${...}` strings of the root config dataclass `root`, in place, by their targets' values:
    OmegaConf composes `root` as a structured config and resolves it (absolute `${a.b}`, relative `${.b}`,
    resolvers such as `${oc.env:X}`), exactly as `load_config` does."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_object(OmegaConf.structured(root))
    for f in dataclasses.fields(root):
        setattr(root, f.name, getattr(resolved, f.name))
