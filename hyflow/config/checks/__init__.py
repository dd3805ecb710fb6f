"""The config's semantic checks, one module per feature, each registering its checks with `check`.

A check is a function of the config that returns its problems as sentences naming the keys, their values and what
to change (an empty list: nothing wrong). It registers with the condition under which it applies and its place in
the order in which `validate_config` (hyflow.config.validate) runs the checks and lists their problems:

    @check(555, applies=lambda cfg: cfg.algorithm.adv_estimator == "spin")
    def spin_settings(cfg: HyflowConfig) -> list[str]:
        ...

`devices=True`: the check also takes the device count given to `validate_config` (`n_devices`, None = the
trainer's nnodes x n_gpus_per_node). `advisory=True`: its findings are warnings, not errors (advisories have an
order of their own). Orders are unique; the gaps leave room:

    100-199 registered names (estimator, policy loss, loggers, reward manager, rollout engine)
    200-299 devices, parallelism and batch sizes       300 clip ratios       400-499 sampling
    500-599 the algorithm's knobs and their combinations (GAE, KL, dynamic sampling, SPIN, online DPO, ...)
    600-799 features: keys not built, LoRA, prefix grouper, multi-turn, checkpoints, run length, pools, async,
            distillation, judge, PRIME, the reward model's batches

A new feature adds its module here; nothing else lists it (`registered_checks` imports every module of this
package). A feature's algorithm names appear in its own module only.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyflow.config.schema import HyflowConfig

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class Check:
    """One registered check: `run(cfg)` (or `run(cfg, n_devices)` with `devices`) -> problems, run where
    `applies(cfg)` holds (always when None)."""

    order: int
    run: Callable[..., list[str]]
    applies: Callable[[HyflowConfig], bool] | None = None
    devices: bool = False
    advisory: bool = False

    @property
    def name(self) -> str:
        return f"{self.run.__module__}.{self.run.__qualname__}"


_CHECKS: dict[str, Check] = {}  # name -> check: importing a module again replaces its checks


def check(order: int, *, applies: Callable[[HyflowConfig], bool] | None = None, devices: bool = False,
          advisory: bool = False) -> Callable[[Callable[..., list[str]]], Callable[..., list[str]]]:
    """Register the decorated function as a check at `order` (see the module docstring); returns it unchanged."""

    def register(fn: Callable[..., list[str]]) -> Callable[..., list[str]]:
        entry = Check(order, fn, applies, devices, advisory)
        taken = [c.name for c in _CHECKS.values()
                 if (c.order, c.advisory) == (order, advisory) and c.name != entry.name]
        if taken:
            raise ValueError(f"check order {order} of {entry.name} is taken by {taken[0]}; choose a free number")
        _CHECKS[entry.name] = entry
        return fn

    return register


@functools.cache
def _import_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def registered_checks(*, advisory: bool = False) -> list[Check]:
    """The problem checks (or, with `advisory`, the advisories) of every feature module, in order."""
    _import_all()
    return sorted((c for c in _CHECKS.values() if c.advisory == advisory), key=lambda c: c.order)


def run_checks(cfg: HyflowConfig, n_devices: int | None = None, *, advisory: bool = False) -> list[str]:
    """The problems (or advisory findings) of every check that applies to `cfg`, in order."""
    found: list[str] = []
    for entry in registered_checks(advisory=advisory):
        if entry.applies is None or entry.applies(cfg):
            args: tuple[Any, ...] = (cfg, n_devices) if entry.devices else (cfg,)
            found += entry.run(*args)
    return found
