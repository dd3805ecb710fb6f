"""tests/run_cache.py: a warm start is built once per run for the same inputs, again for other inputs, never
taken half-built."""

import pytest
from run_cache import built_once, cache_root


def test_built_once_per_inputs(tmp_path):
    calls = []

    def build(out):
        calls.append(out)
        (out / "model").write_text(str(len(calls)))

    first = built_once(tmp_path, "warm", {"seed": 0}, build)
    again = built_once(tmp_path, "warm", {"seed": 0}, build)
    other = built_once(tmp_path, "warm", {"seed": 1}, build)
    assert first == again != other
    assert len(calls) == 2 and (first / "model").read_text() == "1" and (other / "model").read_text() == "2"


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path):
    def broken(out):
        (out / "half").write_text("x")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="mid-build"):
        built_once(tmp_path, "warm", {"seed": 0}, broken)
    out = built_once(tmp_path, "warm", {"seed": 0}, lambda out: (out / "model").write_text("ok"))
    assert not (out / "half").exists() and (out / "model").read_text() == "ok"


def test_the_run_wide_root_comes_from_the_environment(tmp_path, monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HYFLOW_TEST_CACHE", str(tmp_path / "shared"))
    assert cache_root(tmp_path_factory) == tmp_path / "shared" and (tmp_path / "shared").is_dir()
    monkeypatch.delenv("HYFLOW_TEST_CACHE")
    assert cache_root(tmp_path_factory).parent == tmp_path_factory.getbasetemp()
