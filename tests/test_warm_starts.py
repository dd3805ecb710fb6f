"""tests/warm_starts.py's committed warm starts (tests/fixtures/NAME): fresh for their inputs, or the suite says how
to build them again; a stale one is never used."""

import json

import pytest
import warm_starts
from learning import SEED
from warm_starts import BUILT_JSON, FIXTURE_INPUTS, FIXTURES, committed_fixture, fixture_key


@pytest.mark.skipif(SEED != 0, reason="HYFLOW_TEST_SEED is not 0: the committed warm starts are of seed 0 (another "
                                      "seed builds its own)")
@pytest.mark.parametrize("name", sorted(FIXTURE_INPUTS))
def test_the_committed_warm_start_matches_its_inputs(name):
    built = json.loads((FIXTURES / name / BUILT_JSON).read_text())
    assert built["key"] == fixture_key(name), (
        f"tests/fixtures/{name} was built from other inputs than tests/warm_starts.py's FIXTURE_INPUTS[{name!r}] now "
        f"(its BUILT.json holds them): the suite would build it itself, ~25 minutes. Build and commit it afresh: "
        f"python tests/warm_starts.py --export {name} --root EMPTY_DIR")
    assert (FIXTURES / name / "model" / "model.safetensors").stat().st_size > 1_000_000
    assert len((FIXTURES / name / "metrics.jsonl").read_text().splitlines()) == warm_starts.METRICS_KEPT
    assert committed_fixture(name) == FIXTURES / name


def test_a_stale_or_refused_fixture_is_not_used(monkeypatch):
    monkeypatch.setitem(FIXTURE_INPUTS, "tool_warm", {**FIXTURE_INPUTS["tool_warm"], "steps": 1})
    assert committed_fixture("tool_warm") is None
    monkeypatch.undo()
    monkeypatch.setenv("HYFLOW_TEST_BUILD_WARM", "1")
    assert committed_fixture("tool_warm") is None
