"""The documentation site: the generated pages match the code, name every key of the support table, and the site
builds with `mkdocs build --strict` (every link and anchor resolves)."""

from __future__ import annotations

import difflib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCRIPT = ROOT / "tools" / "gen_docs.py"


def load_gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_docs():
    return load_gen_docs()


@pytest.fixture(scope="module")
def regenerated(gen_docs, tmp_path_factory):
    """The generated pages, written from the code now into a fresh folder."""
    out = tmp_path_factory.mktemp("docs")
    for name, text in gen_docs.render().items():
        (out / name).write_text(text)
    return out


def page(name: str) -> str:
    return (DOCS / name).read_text()


def section(text: str, heading: str) -> str:
    """The text under the `### heading` of a page, up to the next heading of level 2 or 3."""
    start = text.index(f"\n### {heading}\n")
    ends = [i for i in (text.find("\n### ", start + 1), text.find("\n## ", start + 1)) if i != -1]
    return text[start:min(ends) if ends else len(text)]


def test_generated_pages_are_up_to_date(gen_docs, regenerated):
    stale = []
    for name in gen_docs.PAGES:
        new, old = (regenerated / name).read_text(), (DOCS / name).read_text() if (DOCS / name).exists() else ""
        if new != old:
            diff = "".join(list(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"docs/{name}",
                                                     f"regenerated {name}", n=0))[:40])
            stale.append(f"{name}:\n{diff}")
    assert not stale, ("the generated docs are out of date with the code: run `python tools/gen_docs.py` (or "
                       "`make docs`) and commit docs/.\n" + "\n".join(stale))


def test_every_performance_only_and_not_supported_key_is_on_coming_from_verl():
    from hyflow.config.support import NOT_SUPPORTED, PERFORMANCE_ONLY, table

    text = page("coming-from-verl.md")
    titles = {"rl": "RL trainer (`hyflow train`)", "sft": "SFT trainer (`hyflow sft`)"}
    kinds = {PERFORMANCE_ONLY: "performance-only", NOT_SUPPORTED: "not supported"}
    missing = []
    for entry in table():
        if entry.kind not in kinds:
            continue
        where = section(text, f"{titles[entry.schema]}: {kinds[entry.kind]}")
        if f"`{entry.key}`" not in where:
            missing.append(f"{entry.kind} {entry.schema} {entry.key}")
    assert not missing, "keys of hyflow.config.support.table() missing from docs/coming-from-verl.md: " + str(missing)


def test_every_alias_is_on_coming_from_verl():
    from hyflow.config.verl_compat import RL_ALIASES, SFT_ALIASES

    text = page("coming-from-verl.md")
    for title, aliases in (("RL trainer (`hyflow train`): aliases", RL_ALIASES),
                           ("SFT trainer (`hyflow sft`): aliases", SFT_ALIASES)):
        where = section(text, title)
        for new, old in aliases.items():
            assert f"| `{new}` | `{old}` |" in where


def test_the_verl_keys_listed_as_missing_are_refused_as_verl_keys(gen_docs):
    """One key of every row of the 'verl keys hyflow lacks' tables goes through the loader: it must be refused
    with the verl-key message (the page's criterion is the loader's own)."""
    from hyflow.config import load_config
    from hyflow.config.keys import ConfigError
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.config.verl_compat import verl_keys

    for schema, load in (("rl", load_config), ("sft", load_sft_config)):
        lacking, count = gen_docs.verl_keys_hyflow_lacks(schema)
        assert lacking and count >= len(lacking)
        keys, _ = verl_keys(schema)
        first_per_section: dict[str, str] = {}
        for entry in lacking:
            first_per_section.setdefault(entry.removesuffix(".*").rpartition(".")[0], entry)
        for entry in first_per_section.values():
            key = entry.removesuffix(".*")
            if entry.endswith(".*"):  # a whole verl section: one of its leaves
                key = min(k for k in keys if k.startswith(key + "."))
            with pytest.raises(ConfigError, match="is a verl key that hyflow does not support yet"):
                load([f"{key}=1"])


def test_markdown_escaping(gen_docs):
    assert gen_docs.md("a_b *c* [d] <tool_call> |x| `k_1|2`") == (
        "a\\_b \\*c\\* \\[d\\] &lt;tool\\_call&gt; \\|x\\| `k_1|2`")
    assert gen_docs.md("two\n   lines") == "two lines"


def test_check_names_the_stale_pages_and_the_command(gen_docs, regenerated, tmp_path, monkeypatch, capsys):
    pages = {name: (regenerated / name).read_text() for name in gen_docs.PAGES}
    monkeypatch.setattr(gen_docs, "render", lambda: pages)
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(sys, "argv", ["gen_docs.py", "--check", "--out", str(tmp_path)])
    gen_docs.main()  # up to date: returns
    (tmp_path / "config-reference.md").write_text("stale\n")
    with pytest.raises(SystemExit) as exit_info:
        gen_docs.main()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "config-reference.md" in err and "python tools/gen_docs.py" in err


def test_every_recipe_is_a_valid_config(gen_docs):
    gen_docs.check_recipes()  # raises SystemExit naming the recipe otherwise
    text = page("algorithms.md")
    for name, _paper, lines in gen_docs.RECIPES:
        assert all(f"`{line}`" in text for line in lines), name


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` as the Makefile runs it (no -q: mkdocs 1.6 drops warnings before --strict counts
    them under -q, so a broken link would pass)."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=root,
                          capture_output=True, text=True, timeout=300)


needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                  reason="mkdocs is not installed (pip install -e .[test])")


@needs_mkdocs
def test_mkdocs_build_strict(tmp_path):
    proc = mkdocs_build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    built = {p.name for p in (tmp_path / "site").glob("*.html")}
    assert {p.stem + ".html" for p in DOCS.glob("*.md")} <= built


@needs_mkdocs
def test_mkdocs_build_strict_fails_on_a_broken_link(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a") as f:
        f.write("\nSee [the estimators](algorithms.md#no-such-section).\n")
    proc = mkdocs_build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0 and "no-such-section" in proc.stdout + proc.stderr
