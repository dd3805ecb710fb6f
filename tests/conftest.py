"""Shared fixtures: a tiny random model with a locally trained tokenizer, built once per session (no downloads)."""

from __future__ import annotations

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
