"""Shared fixtures: a tiny random model with a locally trained tokenizer, built once per session (no downloads)."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A directory holding a random-weight tiny Qwen2 model and its byte-level BPE tokenizer."""
    from hyflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` need the real engine: skipped where vLLM is not installed (the main venv), an error
    where it must be (HYFLOW_REQUIRE_VLLM=1, as `make test` runs them in .venv-vllm) so they never pass by skipping."""
    if importlib.util.find_spec("vllm") is not None:
        return
    marked = [item for item in items if item.get_closest_marker("vllm")]
    if marked and os.environ.get("HYFLOW_REQUIRE_VLLM"):
        raise pytest.UsageError(f"HYFLOW_REQUIRE_VLLM is set but vllm is not importable in {os.sys.executable}; "
                                "run `make venv-vllm` and use .venv-vllm/bin/python")
    skip = pytest.mark.skip(reason="vLLM is not installed here; `make test` runs these in .venv-vllm")
    for item in marked:
        item.add_marker(skip)
