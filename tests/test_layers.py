"""The package's structure, as DESIGN.md draws it: imports point downward only, no import cycles, and the rules
that keep the layers honest (workers never see the config, algos is pure math, the controller knows no RL).

Every import statement counts, a lazy one inside a function included: a lazy import hides a cycle from the
interpreter, not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hyflow"

# DESIGN.md's layers, top to bottom (a module may import its own layer and the layers below it).
LAYERS: dict[str, int] = {
    "hyflow": 9, "hyflow.cli": 9, "hyflow.trainer": 9, "hyflow.__main__": 9,
    "hyflow.workers": 8,
    "hyflow.controller": 7,
    "hyflow.rollout": 6,
    "hyflow.interactions": 5, "hyflow.tools": 5,
    "hyflow.parallel": 5,
    "hyflow.models": 4,
    "hyflow.data": 3, "hyflow.rewards": 3,
    "hyflow.algos": 2,
    "hyflow.batch": 1, "hyflow.config": 1, "hyflow.specs": 1, "hyflow.registry": 1, "hyflow.user_code": 1,
    "hyflow.serialization": 1, "hyflow.threads": 1, "hyflow.version": 1,
}
# Narrower rules than "downward": what each of these may import of hyflow, besides itself.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "hyflow.algos": ("hyflow.registry",),  # pure tensor math (+ the one registry style)
    "hyflow.controller": ("hyflow.batch", "hyflow.threads"),  # generic: knows no RL, no config
    "hyflow.specs": (),
    "hyflow.registry": (),
    "hyflow.batch": (),
}
NOT_FROM: dict[str, tuple[str, ...]] = {
    "hyflow.workers": ("hyflow.config",),  # a worker gets its role's spec, never the config
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The hyflow modules `module` imports anywhere in its text (`from a.b import c` counts a.b.c when c is one)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith("hyflow") else None
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> str:
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it to LAYERS (and DESIGN.md)")
    return best


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_point_downward():
    upward = [f"{m} ({_layer(m)}) imports {t} ({_layer(t)})" for m, targets in sorted(GRAPH.items())
              for t in sorted(targets) if LAYERS[_layer(t)] > LAYERS[_layer(m)]]
    assert not upward, "imports that point up a layer (DESIGN.md, Layers):\n" + "\n".join(upward)


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_narrow_layers_import_only_what_they_may(layer):
    allowed = MAY_IMPORT[layer]
    bad = [f"{m} imports {t}" for m, targets in sorted(GRAPH.items()) if _within(m, layer)
           for t in sorted(targets) if not _within(t, layer) and not any(_within(t, a) for a in allowed)]
    assert not bad, f"{layer} may import only {allowed or 'nothing of hyflow'}:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", sorted(NOT_FROM))
def test_forbidden_imports(layer):
    bad = [f"{m} imports {t}" for m, targets in sorted(GRAPH.items()) if _within(m, layer)
           for t in sorted(targets) if any(_within(t, f) for f in NOT_FROM[layer])]
    assert not bad, f"{layer} must not import {NOT_FROM[layer]}:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (every import counts, lazy ones too):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)
