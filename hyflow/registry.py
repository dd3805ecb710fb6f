"""One `Registry` for every extension point: name -> object, filled by decorators or by lazy entries.

hyflow's extension points (advantage estimators, policy losses, reward scorers, reward managers, rollout
engines, agent loops, tool parsers, trackers) are each one `Registry`:

    ESTIMATORS = Registry("advantage estimator")

    @ESTIMATORS.register("grpo")              # a decorator ...
    def grpo(...): ...

    ESTIMATORS.register("alias", grpo)         # ... or a plain call
    SCORERS.register_lazy("gsm8k", "hyflow.rewards.scorers.gsm8k:compute_score")   # imported on first get

`get(name)` returns the object (importing a lazy entry's module the first time); an unknown name raises
`UnknownNameError` (both a KeyError and a ValueError, so callers that caught either keep working) whose message
is ``unknown <kind> 'x'. Did you mean 'y'? Known: a, b, c.`` plus the registry's hint on how to add one.
`names()` lists every name, lazy ones included, without importing anything (help texts, config checks).

A registry is also a mutable mapping (`in`, iteration in registration order, `items()`, item assignment and
deletion): item assignment replaces silently (tests and YAML loaders use it), `register` refuses to give a
taken name to a different object. This module imports nothing of hyflow, so any layer may use it.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

_MISSING: Any = object()


class UnknownNameError(KeyError, ValueError):
    """A name no registry entry has; the message names the closest known names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def closest_names(name: str, choices: Any, n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The `n` entries of `choices` closest to `name` (difflib's ratio >= `cutoff`), best first."""
    return difflib.get_close_matches(str(name), [str(choice) for choice in choices], n=n, cutoff=cutoff)


def _describe(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{qualname}" if module else qualname


class Registry(MutableMapping[str, Any]):
    """Name -> object for one kind of extension (see the module docstring).

    `kind` labels the messages ("advantage estimator"); `hint` is appended to the unknown-name error (how to add
    one); `lazy` maps names to ``"package.module:Attr"``, imported on first `get`. When importing the module
    registers the name itself (a decorator in that module), that registration wins; otherwise `Attr` is taken.
    """

    def __init__(self, kind: str, *, hint: str = "", lazy: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.hint = hint
        self._entries: dict[str, Any] = {}
        self._lazy: dict[str, str] = {}
        for name, target in (lazy or {}).items():
            self.register_lazy(name, target)

    # ------------------------------------------------------------------ registering
    def register(self, name: str, obj: Any = _MISSING) -> Any:
        """Register `obj` under `name`, or, without `obj`, return a decorator that does.

        Registering the same object twice under one name is a no-op; a different object under a taken name is
        a ValueError naming the one that holds it."""
        if obj is _MISSING:
            def decorator(target: T) -> T:
                self._add(name, target)
                return target

            return decorator
        self._add(name, obj)
        return obj

    def register_lazy(self, name: str, target: str) -> None:
        """Register ``"package.module:Attr"`` under `name`, imported on the first `get(name)`."""
        module, colon, attr = target.partition(":")
        if not colon or not module or not attr:
            raise ValueError(f"lazy {self.kind} {name!r}: {target!r} must read 'package.module:Attr'")
        if name in self._entries or (name in self._lazy and self._lazy[name] != target):
            raise ValueError(f"{self.kind} {name!r} is already registered; pick another name.")
        self._lazy[name] = target

    def _add(self, name: str, obj: Any) -> None:
        held = self._entries.get(name, _MISSING)
        if held is not _MISSING and held is not obj:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {_describe(held)}); pick another name.")
        lazy = self._lazy.get(name)
        own = f"{getattr(obj, '__module__', None)}:{getattr(obj, '__qualname__', None)}"
        if held is _MISSING and lazy is not None and lazy != own:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {lazy.replace(':', '.')}); pick "
                             "another name.")
        self._entries[name] = obj

    # ------------------------------------------------------------------ looking up
    def names(self) -> list[str]:
        """Every registered name, lazy ones included, sorted; imports nothing."""
        return sorted(self)

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The object registered as `name` (a lazy entry is imported now).

        Unknown name: `default` when given, else `UnknownNameError` naming the closest known names."""
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            return self._resolve(name)
        if default is not _MISSING:
            return default
        raise self.unknown(name)

    def unknown(self, name: str, context: str = "") -> UnknownNameError:
        """The error for an unknown `name`: ``unknown <kind> 'x'<context>. Did you mean 'y'? Known: ....``"""
        close = closest_names(name, self)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        known = ", ".join(self.names()) or "none"
        extra = f" {self.hint}" if self.hint else ""
        return UnknownNameError(f"unknown {self.kind} {name!r}{context}.{hint} Known: {known}.{extra}")

    def _resolve(self, name: str) -> Any:
        module_name, _, attr = self._lazy[name].partition(":")
        module = importlib.import_module(module_name)
        if name not in self._entries:  # the module did not register the name itself
            self._entries[name] = getattr(module, attr)
        return self._entries[name]

    # ------------------------------------------------------------------ mapping protocol
    def __getitem__(self, name: str) -> Any:
        return self.get(name)

    def __setitem__(self, name: str, obj: Any) -> None:
        self._entries[name] = obj

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise self.unknown(name)
        self._entries.pop(name, None)
        self._lazy.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        yield from self._entries
        yield from (name for name in self._lazy if name not in self._entries)

    def __len__(self) -> int:
        return len(self._entries.keys() | self._lazy.keys())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"

