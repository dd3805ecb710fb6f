"""What the config needs to know about the registered algorithms, without importing them.

The config layer is core: it imports nothing of hyflow above it (docs/architecture.md's layers). Two of its checks still
depend on the algorithm registry: whether `algorithm.adv_estimator` / `policy_loss.loss_mode` name registered
functions, and whether the estimator needs a critic (it declares `requires=("values",)`). They read an
`AlgorithmCatalog`, which the layer that owns both (the `hyflow` package root) provides through
`set_catalog_provider`; `hyflow/__init__.py` installs the provider that reads `hyflow.algos`' registries on
first use. Without a provider (a config-only install), names are not checked and the critic follows
`critic.enable` (null = no critic).

The same way, a `ComponentCatalog` (`set_component_provider`) lists the names of the registries above the config
layer: `trainer.logger` backends with the package each needs, reward managers and rollout engines, so that
`validate_config` checks them before anything loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AlgorithmCatalog:
    """Registered advantage estimators (name -> the inputs each requires) and policy-loss names."""

    advantage_estimators: Mapping[str, frozenset[str]]
    policy_losses: frozenset[str]

    def estimator_requires(self, name: str) -> frozenset[str]:
        """What estimator `name` requires (empty for an unknown name: validation reports that separately)."""
        return self.advantage_estimators.get(name, frozenset())


_provider: Callable[[], AlgorithmCatalog] | None = None


def set_catalog_provider(provider: Callable[[], AlgorithmCatalog] | None) -> None:
    """Install the function that builds the catalog; None removes it."""
    global _provider
    _provider = provider


def algorithm_catalog() -> AlgorithmCatalog | None:
    """The catalog from the installed provider (built on each call: the registries may grow at any time, and
    reading them is cheap), or None without a provider."""
    return None if _provider is None else _provider()


# ------------------------------------------------------------------------ loggers, reward managers, engines


@dataclass(frozen=True)
class ComponentCatalog:
    """Names the config checks against the registries above it: `trainer.logger` entries (name -> the package it
    imports and how to install it, None = built in), `reward_model.reward_manager` names and
    `actor_rollout_ref.rollout.name` engine names (those this install can build) with the capabilities each
    declares, what to install for an engine whose package is missing, and the verl engine names hyflow has not
    built."""

    loggers: Mapping[str, tuple[str, str] | None]
    reward_managers: frozenset[str]
    rollout_engines: frozenset[str]
    # engine name -> (what to install on CUDA, on CPU), for engines whose package this Python lacks
    missing_engine_packages: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # verl engine names hyflow has not built -> why
    engines_not_built: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # engine name -> what it declares it can do (hyflow.rollout.base.EngineCapabilities: streams, loads_model,
    # max_tensor_parallel, stream_max_tensor_parallel, serves_frozen, own_image_processor, knobs, requires)
    engine_capabilities: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # registered tool-call formats (actor_rollout_ref.rollout.multi_turn.format); empty = not checked
    tool_formats: frozenset[str] = frozenset()


_component_provider: Callable[[], ComponentCatalog] | None = None


def set_component_provider(provider: Callable[[], ComponentCatalog] | None) -> None:
    """Install the function that builds the component catalog; None removes it."""
    global _component_provider
    _component_provider = provider


def component_catalog() -> ComponentCatalog | None:
    """The component catalog from the installed provider, or None without one (names are then not checked)."""
    return None if _component_provider is None else _component_provider()


def engine_capabilities(name: str | None) -> Any | None:
    """What the rollout engine registered as `name` declares it can do (`EngineCapabilities`), or None without a
    catalog or for a name no registered engine has (the engine-name check reports those)."""
    catalog = component_catalog()
    return None if catalog is None or name is None else catalog.engine_capabilities.get(name)


def splits_model(caps: Any) -> bool:
    """Whether an engine with capabilities `caps` splits a model over several devices (reads
    tensor_model_parallel_size); False: one full copy per device."""
    return caps.max_tensor_parallel != 1


def stream_serves(caps: Any, tensor_parallel_size: int) -> bool:
    """Whether the engine's token stream (continuous batching, multi-turn turns) runs at this tensor-parallel size."""
    limit = caps.stream_max_tensor_parallel if splits_model(caps) else None
    return caps.streams and (limit is None or tensor_parallel_size <= limit)


def frozen_engines() -> list[str]:
    """The registered engines that serve a frozen model (a distillation teacher, a generative judge)."""
    catalog = component_catalog()
    return [] if catalog is None else sorted(n for n, c in catalog.engine_capabilities.items() if c.serves_frozen)
