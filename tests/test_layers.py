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

# DESIGN.md's layer table ("Layers"), top to bottom. A package sits in one row; `hyflow.parallel` and `hyflow.serve`
# have their seats before they exist. The leaf utilities import nothing of hyflow and DESIGN's table does not name
# them: every layer may use them (algos only the registry, see MAY_IMPORT).
LAYERS: dict[str, int] = {
    "hyflow": 10, "hyflow.__main__": 10, "hyflow.cli": 10, "hyflow.trainer": 10, "hyflow.serve": 10,  # entry
    "hyflow.workers": 9,
    "hyflow.controller": 8,  # control
    "hyflow.rollout": 7,
    "hyflow.tools": 6, "hyflow.interactions": 6,
    "hyflow.parallel": 5,
    "hyflow.models": 4,
    "hyflow.data": 3, "hyflow.rewards": 3,
    "hyflow.algos": 2,
    "hyflow.batch": 1, "hyflow.config": 1, "hyflow.specs": 1,  # core (the batch, the config schema, role specs)
    "hyflow.registry": 0, "hyflow.user_code": 0, "hyflow.serialization": 0, "hyflow.threads": 0, "hyflow.version": 0,
    "hyflow.boxed": 0,  # the \boxed{} answer parser the data preprocessors and the math scorer share
    "hyflow.images": 0,  # image rows decoded with PIL: data's datasets and rollout's tools that return images
}
LEAVES = tuple(name for name, layer in LAYERS.items() if layer == 0)
ENTRY = LAYERS["hyflow"]
# DESIGN's "may import" column, exactly: what each package below the entry layer may import of hyflow, besides itself
# and the leaf utilities. Packages of one row (tools + interactions) may import each other; data and rewards share a
# row but each may import only the batch.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    # "controller, models, algos, rollout, batch": the core a worker sees is the batch and its role's spec; and
    # parallel, which DESIGN's table leaves out but its "Training engine" contract needs (TrainEngine(model, spec,
    # mesh) calls parallelize(): issue 38 section 4)
    "hyflow.workers": ("hyflow.controller", "hyflow.models", "hyflow.algos", "hyflow.rollout", "hyflow.parallel",
                       "hyflow.batch", "hyflow.specs"),
    "hyflow.controller": ("hyflow.batch",),  # generic: knows no RL, no config
    "hyflow.rollout": ("hyflow.models", "hyflow.tools", "hyflow.interactions", "hyflow.batch"),
    "hyflow.tools": ("hyflow.rewards", "hyflow.interactions", "hyflow.batch"),  # rewards: the sandbox
    "hyflow.interactions": ("hyflow.tools", "hyflow.rewards", "hyflow.batch"),
    "hyflow.parallel": ("hyflow.models",),
    "hyflow.models": (),
    "hyflow.data": ("hyflow.batch",),
    "hyflow.rewards": ("hyflow.batch",),
    "hyflow.algos": (),  # pure tensor math: torch only (+ the one registry style, below)
    "hyflow.batch": (),
    "hyflow.config": ("hyflow.specs",),  # one row: the schema derives the role specs
    "hyflow.specs": (),
}
LEAVES_FOR: dict[str, tuple[str, ...]] = {"hyflow.algos": ("hyflow.registry",)}
NOT_FROM: dict[str, tuple[str, ...]] = {
    "hyflow.workers": ("hyflow.config",),  # a worker gets its role's spec, never the config
}
# The breaks of the table that exist today, each with why and what removes it. The test fails on a break not listed
# here, and on an entry here that no longer breaks (delete it then).
KNOWN_BREAKS: dict[tuple[str, str], str] = {}  # none left (issue 38 removed the last 8 pairs)


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


def _breaks() -> list[tuple[str, str, str]]:
    """(importer, imported, rule broken) for every import DESIGN's table forbids."""
    found = []
    for module, targets in sorted(GRAPH.items()):
        layer = _layer(module)
        package = layer if LAYERS[layer] < ENTRY else None
        for target in sorted(targets):
            seat = _layer(target)
            if LAYERS[seat] > LAYERS[layer]:
                found.append((module, target, f"points up: {layer} -> {seat}"))
            elif package is None or seat == package:
                continue
            elif seat in LEAVES:
                if package in LEAVES_FOR and seat not in LEAVES_FOR[package]:
                    found.append((module, target, f"{package} may use only {LEAVES_FOR[package]} of the utilities"))
            elif seat not in MAY_IMPORT[package]:
                found.append((module, target, f"{package} may import {MAY_IMPORT[package] or 'nothing of hyflow'}"))
    return found


def test_every_package_has_its_rule():
    for layer, rank in LAYERS.items():
        assert rank == ENTRY or rank == 0 or layer in MAY_IMPORT, f"{layer} has no row in MAY_IMPORT"
        for allowed in MAY_IMPORT.get(layer, ()):
            assert LAYERS[allowed] <= rank, f"{layer} may import {allowed}, which is above it"


def test_imports_follow_the_layer_table():
    new = [f"{m} imports {t} ({why})" for m, t, why in _breaks() if (m, t) not in KNOWN_BREAKS]
    assert not new, "imports DESIGN.md's layer table forbids (Layers):\n" + "\n".join(new)


def test_known_breaks_are_still_breaks():
    found = {(m, t) for m, t, _ in _breaks()}
    gone = sorted(pair for pair in KNOWN_BREAKS if pair not in found)
    assert not gone, f"these breaks are fixed: remove them from KNOWN_BREAKS: {gone}"


def test_the_rules_catch_a_break():
    GRAPH["hyflow.models.forward"].add("hyflow.data")
    GRAPH["hyflow.controller.dispatch"].add("hyflow.registry")
    try:
        found = {(m, t) for m, t, _ in _breaks()}
    finally:
        GRAPH["hyflow.models.forward"].discard("hyflow.data")
        GRAPH["hyflow.controller.dispatch"].discard("hyflow.registry")
    assert ("hyflow.models.forward", "hyflow.data") in found
    assert ("hyflow.controller.dispatch", "hyflow.registry") not in found  # a leaf utility


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


def _private_uses(module: str) -> list[str]:
    """`from hyflow.x import _name` and `x._name` (x a hyflow module imported here) where x is another module."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hyflow"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__") and node.module != module:
                    found.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hyflow") and alias.asname and alias.name in MODULES:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and aliases[node.value.id] != module and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


# Private names another module still imports, each in a file whose owner renames it (issue 38, section 6).
KNOWN_PRIVATE: dict[tuple[str, str], str] = {}


def test_no_module_uses_another_modules_private_names():
    uses = [(m, use) for m in sorted(MODULES) for use in _private_uses(m)]
    new = [f"{m}: {use}" for m, use in uses if (m, use) not in KNOWN_PRIVATE]
    assert not new, "private names used from another module (make the name public, or move it):\n" + "\n".join(new)
    gone = sorted(pair for pair in KNOWN_PRIVATE if pair not in uses)
    assert not gone, f"no longer used: remove from KNOWN_PRIVATE: {gone}"
