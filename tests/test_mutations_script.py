"""tools/mutations.py, the mutation check: its list matches the code (every original occurs exactly once, every test
it names exists), and its machinery gives the right verdicts on a tiny fake project (a caught mutant, one caught only
in a process that inherits nothing, a mutant no test notices, an original that is not there, a selection that
collects nothing, a hang), never touching the checkout it copies, and leaves nothing running when stopped."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tomllib", reason="tools/mutations.py reads its list with tomllib (Python 3.11+)")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "mutations.py"


def load_script():
    spec = importlib.util.spec_from_file_location("mutations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mutations():
    return load_script()


def test_the_list_parses_and_every_original_occurs_once_in_the_code(mutations):
    """What keeps the list honest as the code moves: a line that changed or moved fails here, by its id."""
    entries = mutations.load()
    assert len(entries) >= 30 and len({m.id for m in entries}) == len(entries)
    assert sum(m.fast for m in entries) >= 20
    assert mutations.check(entries, ROOT) == []


def test_a_moved_line_or_a_missing_test_is_named(mutations, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\nx = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text("def test_x():\n    pass\n")
    base = dict(feature="f", file="pkg/m.py", replacement="y = 2", fast=True)
    problems = mutations.check([
        mutations.Mutation(id="twice", original="x = 1", tests=("tests/test_m.py",), **base),
        mutations.Mutation(id="gone", original="z = 3", tests=("tests/test_m.py::test_x",), **base),
        mutations.Mutation(id="no-test", original="x = 1\nx = 1", tests=("tests/test_m.py::test_y",), **base),
        mutations.Mutation(id="no-file", original="x = 1\nx = 1", tests=("tests/test_n.py",), **base),
    ], tmp_path)
    assert len(problems) == 4
    assert "twice: the original text occurs 2 times in pkg/m.py" in problems[0] and "until it is unique" in problems[0]
    assert "gone: the original text occurs 0 times" in problems[1] and "update tools/mutations.toml" in problems[1]
    assert "no-test: tests/test_m.py has no test 'test_y'" in problems[2]
    assert "no-file: test path tests/test_n.py does not exist" in problems[3]


def test_a_mutant_that_does_not_compile_is_refused(mutations):
    bad = mutations.Mutation(id="syntax", feature="f", file="m.py", original="return a", replacement="return (a",
                             tests=("t.py",), fast=True)
    with pytest.raises(mutations.MutationError, match=r"syntax: the mutant of m.py does not compile"):
        mutations.mutate(bad, "def f(a):\n    return a\n")


@pytest.mark.parametrize(("entry", "message"), [
    ('id = "a"\nfeature = "f"\nfile = "m.py"\noriginal = "x"\nreplacement = "y"\ntests = ["t.py"]\n',
     r"missing \['fast'\]"),
    ('id = "a"\nfeature = "f"\nfile = "m.py"\noriginal = "x"\nreplacement = "y"\ntests = ["t.py"]\nfast = true\n'
     'test = "t.py"\n', r"unknown keys \['test'\]"),
    ('id = "a"\nfeature = "f"\nfile = "m.py"\noriginal = "x"\nreplacement = "x"\ntests = ["t.py"]\nfast = true\n',
     "the replacement equals the original"),
    ('id = "a"\nfeature = "f"\nfile = "m.py"\noriginal = "x"\nreplacement = "y"\ntests = []\nfast = true\n',
     "tests must be a non-empty list"),
    ('id = "a"\nfeature = "f"\nfile = "m.py"\noriginal = "x"\nreplacement = "y"\ntests = ["t.py"]\nfast = "yes"\n',
     "fast must be a bool"),
])
def test_a_malformed_entry_is_named(mutations, tmp_path, entry, message):
    path = tmp_path / "list.toml"
    path.write_text("[[mutation]]\n" + entry)
    with pytest.raises(mutations.MutationError, match=message):
        mutations.load(path)


def test_ids_are_unique(mutations, tmp_path):
    entry = 'id = "a"\nfeature = "f"\nfile = "m.py"\noriginal = "x"\nreplacement = "y"\ntests = ["t.py"]\nfast = true\n'
    path = tmp_path / "list.toml"
    path.write_text(f"[[mutation]]\n{entry}\n[[mutation]]\n{entry}")
    with pytest.raises(mutations.MutationError, match="id 'a' is used twice"):
        mutations.load(path)


# ------------------------------------------------------------------------------------- the fake project

CALC = """\
def add(a, b):
    return a + b
"""

TESTS = """\
import subprocess
import sys

import pytest

from hyflow.calc import add


def test_add():
    assert add(2, 3) == 5


def test_add_gives_a_number():
    assert isinstance(add(2, 3), int)


@pytest.mark.skip(reason="never runs here")
def test_add_skipped():
    assert add(2, 3) == 5


def test_add_in_a_process_with_nothing_inherited():
    code = "from hyflow.calc import add; print(add(2, 3))"
    out = subprocess.run([sys.executable, "-I", "-c", code], env={}, cwd="/", capture_output=True, text=True)
    assert out.stdout.strip() == "5", out.stderr
"""

LIST = """\
[[mutation]]
id = "caught"
feature = "add adds"
file = "hyflow/calc.py"
original = "return a + b"
replacement = "return a - b"
tests = ["tests/test_calc.py"]
fast = true

[[mutation]]
id = "missed"
feature = "add adds, but only its type is tested"
file = "hyflow/calc.py"
original = "return a + b"
replacement = "return a * b"
tests = ["tests/test_calc.py::test_add_gives_a_number"]
fast = true

[[mutation]]
id = "caught-in-a-clean-process"
feature = "add adds, tested in a process that inherits no PYTHONPATH"
file = "hyflow/calc.py"
original = "return a + b"
replacement = "return a - b"
tests = ["tests/test_calc.py::test_add_in_a_process_with_nothing_inherited"]
fast = true

[[mutation]]
id = "moved"
feature = "a line that is no longer there"
file = "hyflow/calc.py"
original = "return b + a"
replacement = "return b - a"
tests = ["tests/test_calc.py"]
fast = true

[[mutation]]
id = "nothing-collected"
feature = "a -k that selects no test"
file = "hyflow/calc.py"
original = "return a + b"
replacement = "return a - b"
tests = ["tests/test_calc.py"]
k = "no_such_test"
fast = true

[[mutation]]
id = "all-skipped"
feature = "a selection whose only test is skipped"
file = "hyflow/calc.py"
original = "return a + b"
replacement = "return a - b"
tests = ["tests/test_calc.py::test_add_skipped"]
fast = true

[[mutation]]
id = "hangs"
feature = "a mutant whose test never ends"
file = "hyflow/calc.py"
original = "return a + b"
replacement = "return __import__('time').sleep(600)"
tests = ["tests/test_calc.py::test_add"]
timeout = 5
fast = false
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A git checkout of a package named hyflow (so the copy must win over the editable install), one committed
    test file, and the mutation list. Its pytest runs load no plugins: it needs none, and they cost seconds each."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    root = tmp_path / "project"
    (root / "hyflow").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "hyflow" / "__init__.py").write_text("")
    (root / "hyflow" / "calc.py").write_text(CALC)
    (root / "tests" / "test_calc.py").write_text(TESTS)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "."], cwd=root, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "fake"], cwd=root, check=True)
    (tmp_path / "list.toml").write_text(LIST)
    return root


LINE = re.compile(r"^(caught|NOT CAUGHT|ERROR) +(\S+)  \((\S+)\)  \d+ s(?:  (.*))?$")


def verdicts(out: str) -> dict[str, tuple[str, str]]:
    """{id: (verdict, detail)} from the script's result lines."""
    return {m.group(2): (m.group(1), m.group(4) or "") for m in map(LINE.match, out.splitlines()) if m}


def test_verdicts_on_a_fake_project(mutations, project, capsys):
    rc = mutations.main(["--file", str(project.parent / "list.toml"), "--root", str(project)])
    out = capsys.readouterr().out
    got = verdicts(out)
    assert rc == 1, out
    assert got["caught"][0] == "caught" and got["caught"][-1] == "tests/test_calc.py::test_add", out
    assert got["missed"][0] == "NOT CAUGHT", out  # runs after `caught` in the same copy: the file was restored
    # the copy's interpreter imports the copy even where PYTHONPATH does not reach (the sandbox's tests)
    assert got["caught-in-a-clean-process"][0] == "caught", out
    assert got["moved"][0] == "ERROR" and "occurs 0 times in hyflow/calc.py" in got["moved"][-1], out
    assert got["nothing-collected"][0] == "ERROR" and "pytest exit 5" in got["nothing-collected"][-1], out
    assert got["hangs"][0] == "ERROR" and "timed out after 5 s" in got["hangs"][-1], out
    assert got["all-skipped"][0] == "ERROR" and "every selected test was skipped" in got["all-skipped"][-1], out
    assert "7 mutations: 2 caught, 1 not caught, 4 errors" in out
    assert (project / "hyflow" / "calc.py").read_text() == CALC  # the checkout itself is never mutated


def test_only_fast_and_a_commit_instead_of_the_working_tree(mutations, project, capsys):
    """--rev copies the commit: a test added to the working tree after it is not there; without --rev it is."""
    (project / "tests" / "test_more.py").write_text("from hyflow.calc import add\n\n\ndef test_more():\n"
                                                    "    assert add(1, 1) == 2\n")
    listing = project.parent / "list.toml"
    listing.write_text(LIST.replace('tests = ["tests/test_calc.py::test_add_gives_a_number"]',
                                    'tests = ["tests/test_calc.py::test_add_gives_a_number", "tests/test_more.py"]'))
    assert mutations.main(["--file", str(listing), "--root", str(project), "--only", "missed", "--fast",
                           "--rev", "HEAD"]) == 1
    assert "pytest exit 4" in verdicts(capsys.readouterr().out)["missed"][-1]  # test_more.py: no such file there
    assert mutations.main(["--file", str(listing), "--root", str(project), "--only", "missed", "caught", "hangs",
                           "--fast", "-j", "2"]) == 0
    out = capsys.readouterr().out
    assert verdicts(out)["missed"][-1] == "tests/test_more.py::test_more" and "hangs" not in out
    assert "2 mutations: 2 caught, 0 not caught, 0 errors" in out


def test_a_baseline_that_fails_unmutated_is_an_error(mutations, project, capsys):
    (project / "tests" / "test_calc.py").write_text(TESTS.replace("== 5", "== 6"))
    assert mutations.main(["--file", str(project.parent / "list.toml"), "--root", str(project), "--only", "caught",
                           "--baseline"]) == 1
    line = verdicts(capsys.readouterr().out)["caught"]
    assert line[0] == "ERROR" and "the tests fail without the mutant (exit 1)" in line[-1]


def test_a_copy_that_imports_the_installed_hyflow_is_refused(mutations, tmp_path):
    """Without the copy's own package, the editable install's hyflow would be imported: the mutants would not be
    what the tests run."""
    (tmp_path / "copy").mkdir()
    with pytest.raises(mutations.MutationError, match="not from the copy"):
        mutations.verify_import(tmp_path / "copy", sys.executable)


def test_rotation_cycles_through_the_entries_and_adds_the_recently_changed(mutations, project, capsys):
    """--rotate 3: the checkout's slot (its commit count mod 3) picks every third entry; --recent adds the entries
    whose file or tests the last commits changed; 3 consecutive commits run every entry."""
    listing = ["--file", str(project.parent / "list.toml"), "--root", str(project), "--list"]
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    ids = [m.id for m in mutations.load(project.parent / "list.toml")]
    seen = set()
    for commit in range(2, 5):  # the fixture's commit is 1: slots 2, 0, 1
        (project / "notes.txt").write_text(str(commit))
        subprocess.run([*git, "add", "notes.txt"], cwd=project, check=True)
        subprocess.run([*git, "commit", "-q", "-m", f"notes {commit}"], cwd=project, check=True)
        assert mutations.main([*listing, "--rotate", "3"]) == 0
        out = capsys.readouterr().out
        chosen = [line.split()[0] for line in out.splitlines()[1:] if line and not line.startswith(" ")]
        assert chosen == [i for n, i in enumerate(ids) if n % 3 == commit % 3], out
        assert out.startswith(f"mutations: {len(chosen)} of 7 entries: slot {commit % 3} of 3"), out
        seen.update(chosen)
    assert seen == set(ids)
    assert mutations.main([*listing, "--rotate", "3", "--recent", "3"]) == 0  # notes.txt only: nothing added
    assert "and 0 more whose file or tests changed in the last 3 commits" in capsys.readouterr().out
    (project / "tests" / "test_calc.py").write_text(TESTS + "\n")
    subprocess.run([*git, "commit", "-q", "-am", "tests"], cwd=project, check=True)
    assert mutations.main([*listing, "--rotate", "3", "--recent", "1"]) == 0  # every entry tests test_calc.py
    assert "mutations: 7 of 7 entries: slot 2 of 3 (2 entries) and 5 more" in capsys.readouterr().out
    assert mutations.main([*listing, "--rotate", "0"]) == 2


def test_unknown_ids_and_the_listing(mutations, capsys):
    assert mutations.main(["--only", "no-such-id"]) == 2
    assert "no entries ['no-such-id']" in capsys.readouterr().err
    assert mutations.main(["--list", "--fast"]) == 0
    out = capsys.readouterr().out
    assert "ulysses-grad-scale" in out and "dp-global-loss-normalisation" not in out


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_sigterm_ends_the_runs_under_way_and_removes_the_copies(project, tmp_path):
    """The pytest runs are in sessions of their own (a timeout kills each whole), so no signal sent to the script
    reaches them: SIGTERM (and Ctrl-C) must end them itself, and the temporary copies must go."""
    pid_file, scratch = tmp_path / "pid", tmp_path / "scratch"
    scratch.mkdir()
    listing = project.parent / "list.toml"
    listing.write_text(LIST.replace("replacement = \"return __import__('time').sleep(600)\"",
                                    "replacement = \"return __import__('pathlib').Path(__import__('os').environ["
                                    "'HANG_PID_FILE']).write_text(str(__import__('os').getpid())) and "
                                    "__import__('time').sleep(600)\"").replace("timeout = 5", "timeout = 600"))
    env = {**os.environ, "HANG_PID_FILE": str(pid_file), "TMPDIR": str(scratch)}
    script = subprocess.Popen([sys.executable, str(SCRIPT), "--file", str(listing), "--root", str(project),
                               "--only", "hangs"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hung = None
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert script.poll() is None and time.monotonic() < deadline, script.communicate()
            time.sleep(0.1)
        hung = int(pid_file.read_text())
        assert _alive(hung)
        script.send_signal(signal.SIGTERM)
        out, err = script.communicate(timeout=120)
    finally:
        script.kill()
        if hung is not None and _alive(hung):  # the test failed: leave nothing sleeping behind
            os.kill(hung, signal.SIGKILL)
            time.sleep(0.5)
            raise AssertionError("the hung test still ran after the script was told to stop")
    assert script.returncode == 130 and "interrupted" in err, (out, err)
    assert list(scratch.iterdir()) == []
