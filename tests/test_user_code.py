"""hyflow.user_code.load_object: the one loader of user code (file.py:Name, pkg.mod.Name, (path, name)) and its
errors, each naming the config key and the fix and each also the built-in exception callers expect."""

from __future__ import annotations

import textwrap

import pytest

from hyflow.user_code import (
    UserCodeError,
    UserFileNotFoundError,
    UserImportError,
    UserNameError,
    UserTypeError,
    accepted_keywords,
    load_object,
)


class Base:
    def run(self): ...


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_code.py"
    path.write_text(textwrap.dedent("""
        from dataclasses import dataclass

        LIMIT = 3

        def score(x):
            return x + 1

        class Runner:
            def run(self):
                return "ran"
    """))
    return path


def test_three_spec_forms_give_the_same_object(user_file, monkeypatch):
    by_file = load_object(f"{user_file}:score", what="function", config_key="k")
    assert load_object((user_file, "score"), what="function", config_key="k") is by_file  # imported once
    assert by_file(1) == 2 and by_file.__module__.startswith("hyflow_user_my_code_")
    monkeypatch.syspath_prepend(str(user_file.parent))
    assert load_object("my_code.score", what="function", config_key="k")(1) == 2
    assert load_object("json.dumps", what="function", config_key="k")([1]) == "[1]"


def test_relative_paths_are_searched_in_order(user_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    loaded = load_object("my_code.py:Runner", what="class", config_key="k", require="class",
                         search=(tmp_path.parent, tmp_path))
    assert loaded().run() == "ran"


def test_missing_file(tmp_path):
    with pytest.raises(UserFileNotFoundError) as info:
        load_object("nope.py:f", what="function", config_key="my.key", search=(tmp_path,))
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    assert str(info.value) == (f"my.key='nope.py:f' names the file nope.py, which does not exist (looked at "
                               f"{tmp_path / 'nope.py'}); fix the path (a relative path is looked up from {tmp_path})")


def test_syntax_error_gives_the_line(tmp_path):
    path = tmp_path / "typo.py"
    path.write_text("x = 1\ndef f(:\n    return 1\n")
    with pytest.raises(ImportError, match=r"k.path='.*typo.py': importing the file .*typo.py raised SyntaxError "
                                          r"at line 2: .*'def f\(:'; fix that file") as info:
        load_object((path, "f"), what="function", config_key="k")
    assert isinstance(info.value, UserImportError) and isinstance(info.value.__cause__, SyntaxError)


def test_module_errors_say_what_is_missing(tmp_path, monkeypatch):
    with pytest.raises(ImportError, match=r"cannot import module 'no_such_module_xyz' \(ModuleNotFoundError"):
        load_object("no_such_module_xyz.f", what="function", config_key="k")
    (tmp_path / "needs_dep.py").write_text("import hyflow_no_such_dependency\n")
    (tmp_path / "raises_here.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"importing module 'needs_dep' failed.*install 'hyflow_no_such_dependency'"):
        load_object("needs_dep.f", what="function", config_key="k")
    with pytest.raises(ImportError, match=r"importing module 'raises_here' raised RuntimeError: boom"):
        load_object("raises_here.f", what="function", config_key="k")
    with pytest.raises(UserCodeError, match=r"k='justaname': 'justaname' must be a dotted import path"):
        load_object("justaname", what="function", config_key="k")


def test_missing_name_lists_the_closest_and_what_is_defined(user_file):
    with pytest.raises(AttributeError) as info:
        load_object((user_file, "scor"), what="function", config_key="k")
    message = str(info.value)
    assert isinstance(info.value, UserNameError)
    assert message.startswith("k.name='scor': the file ") and "has no function 'scor'." in message
    assert "Did you mean 'score'? Callables defined there: Runner, score; fix the name" in message
    assert "dataclass" not in message  # imported names are not listed


def test_type_checks(user_file):
    with pytest.raises(TypeError, match=r"'LIMIT' in the file .* is a int, not a function; k.name must name a "
                                        "callable") as info:
        load_object((user_file, "LIMIT"), what="function", config_key="k")
    assert isinstance(info.value, UserTypeError)
    with pytest.raises(TypeError, match="'score' in the file .* is a function, not a class; name a Base subclass"):
        load_object(f"{user_file}:score", what="class", config_key="k", require="class", base=Base)
    with pytest.raises(TypeError, match=r"'Runner' in the file .* is not a Base \(it lacks start\); fix: subclass "):
        load_object(f"{user_file}:Runner", what="class", config_key="k", require="class", base=Base,
                    methods=("start",))
    duck = load_object(f"{user_file}:Runner", what="class", config_key="k", require="class", base=Base,
                       methods=("run",))
    assert duck.__name__ == "Runner"  # duck-typed: has every method
    assert load_object((user_file, "LIMIT"), what="value", config_key="k", require=None) == 3
    with pytest.raises(ValueError, match=r"k.path='.*' is set but k.name is not"):
        load_object((user_file, None), what="function", config_key="k")


def test_accepted_keywords():
    def fixed(a, *, b, c=1): ...

    def flexible(a, **kwargs): ...

    assert accepted_keywords(fixed) == {"a", "b", "c"}
    assert accepted_keywords(flexible) is None
