"""Lock files: the exact versions `make venv` and `make venv-vllm` install, as pip constraints (`pip install -c`).

pyproject.toml keeps ranges for library users; requirements/lock.txt (.venv) and requirements/lock-vllm.txt
(.venv-vllm) pin every installed distribution, so CI installs the same software every day. `make lock` rebuilds
both venvs fresh in a temporary directory without constraints, then:

    <venv>/bin/python tools/lock.py freeze OUT --root hyflow --root Makefile=pip,setuptools,wheel,torch
        writes OUT from the distributions installed in the running interpreter's environment (less hyflow itself):
        one `name==version` line each, sorted, annotated `# via` with what requires it (another locked package, or
        a root: `hyflow` = pyproject's dependencies, `hyflow[x]` = its extra x, `Makefile` = what the Makefile
        installs itself). It walks requirements with their markers and extras from the roots, so a package that
        nothing requires is an error (something installed by hand).
    python tools/lock.py diff OLD NEW
        prints what changed, one package a line: `name old -> new`, `+ name version`, `- name version`.

tests/test_packaging.py checks that the locks satisfy pyproject's ranges and that each locked top-level package
(a root's direct requirement) is one pyproject or the Makefile names.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from collections import defaultdict
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = """\
# Exact versions {target} installs (pip constraints: `pip install -c {path}`).
# Made by `make lock` from a fresh, unconstrained install (Python {python}); do not edit: run `make lock`.
# pyproject.toml keeps the ranges; tests/test_packaging.py checks that these pins satisfy them.
# `# via`: what requires each package: another line here, or hyflow (pyproject's dependencies), hyflow[x]
# (its extra x), Makefile (installed by the Makefile itself).
"""

LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)\s*(?:#\s*via\s+(?P<via>.*))?$")


def parse_lock(text: str) -> dict[str, tuple[str, str, list[str]]]:
    """{canonical name: (name, version, via labels)} of a lock file's `name==version  # via a, b` lines; any other
    non-comment line is a ValueError naming it."""
    pins: dict[str, tuple[str, str, list[str]]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = LINE.match(line.strip())
        if match is None:
            raise ValueError(f"line {number}: not `name==version  # via ...`: {line!r}")
        via = [v.strip() for v in (match["via"] or "").split(",") if v.strip()]
        pins[canonicalize_name(match["name"])] = (match["name"], match["version"], via)
    return pins


def _installed() -> dict[str, md.Distribution]:
    found: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist)
    return found


def walk(roots: dict[str, list[str]], installed: dict[str, md.Distribution]) -> dict[str, set[str]]:
    """{canonical name: the labels of what requires it} over the requirement graph from the roots: `hyflow[a,b]`
    (its dependencies labelled `hyflow`, those of extra a `hyflow[a]`) and `LABEL=name,...` (each labelled LABEL);
    markers are evaluated here, with the extras each package was asked for."""
    via: dict[str, set[str]] = defaultdict(set)
    queue: list[tuple[str, frozenset[str]]] = []
    seen: set[tuple[str, frozenset[str]]] = set()

    def need(requirement: Requirement, label: str) -> None:
        name = canonicalize_name(requirement.name)
        if name not in installed:
            raise SystemExit(f"lock: {requirement} (required by {label}) is not installed")
        via[name].add(label)
        queue.append((name, frozenset(canonicalize_name(e) for e in requirement.extras)))

    for label, names in roots.items():
        if names:
            for name in names:
                need(Requirement(name), label)
            continue
        root = Requirement(label)
        dist = installed[canonicalize_name(root.name)]
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                need(req, root.name)
            for extra in sorted(root.extras):
                if req.marker is not None and not req.marker.evaluate({"extra": ""}) \
                        and req.marker.evaluate({"extra": extra}):
                    need(req, f"{root.name}[{extra}]")
    while queue:
        name, extras = queue.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        dist = installed[name]
        label = dist.metadata["Name"]
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *sorted(extras))):
                need(req, label)
    return via


def freeze(out: Path, roots: dict[str, list[str]], target: str) -> None:
    installed = _installed()
    root_names = {canonicalize_name(Requirement(label).name) for label, names in roots.items() if not names}
    via = walk(roots, installed)
    lines, stray = [], []
    for name in sorted(installed):
        if name in root_names:
            continue  # hyflow itself: installed editable from the checkout
        dist = installed[name]
        if name not in via:
            stray.append(f"{dist.metadata['Name']}=={dist.version}")
            continue
        labels = sorted(via[name], key=lambda v: (not v.startswith(("hyflow", "Makefile")), v.lower()))
        lines.append(f"{dist.metadata['Name']}=={dist.version}  # via {', '.join(labels)}")
    if stray:
        raise SystemExit(f"lock: installed but required by nothing the roots reach: {', '.join(stray)}")
    python = ".".join(map(str, sys.version_info[:2]))
    out.write_text(HEADER.format(target=target, path=f"requirements/{out.name}", python=python) + "\n".join(lines) + "\n")
    print(f"lock: {len(lines)} pins -> {out}")


def diff(old: str, new: str) -> list[str]:
    """`name old -> new` per changed pin, `+ name version` added, `- name version` removed (sorted by name)."""
    before, after = parse_lock(old), parse_lock(new)
    changes = []
    for key in sorted(before.keys() | after.keys()):
        if key not in before:
            changes.append(f"+ {after[key][0]} {after[key][1]}")
        elif key not in after:
            changes.append(f"- {before[key][0]} {before[key][1]}")
        elif before[key][1] != after[key][1]:
            changes.append(f"  {after[key][0]} {before[key][1]} -> {after[key][1]}")
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("freeze", help="write the lock file of this interpreter's environment")
    p.add_argument("out", type=Path)
    p.add_argument("--root", action="append", required=True,
                   help="hyflow[extra,...] (a distribution and the extras installed) or LABEL=name,name,...")
    p.add_argument("--target", default="the venv", help="what installs it, for the header")
    d = sub.add_parser("diff", help="print what changed between two lock files")
    d.add_argument("old", type=Path)
    d.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "freeze":
        roots = {}
        for root in args.root:
            label, _, names = root.partition("=")
            roots[label] = [n for n in names.split(",") if n] if names else []
        freeze(args.out, roots, args.target)
        return 0
    old = args.old.read_text() if args.old.exists() else ""
    changes = diff(old, args.new.read_text())
    print(f"{args.new.name}: " + (f"{len(changes)} changes" if changes else "no change"))
    for change in changes:
        print(change)
    return 0


if __name__ == "__main__":
    sys.exit(main())
