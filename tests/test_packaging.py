"""Packaging: the version, pyproject.toml's metadata, and file paths the Markdown files point users to."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

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
