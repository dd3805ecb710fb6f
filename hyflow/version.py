"""hyflow's version: the installed distribution's (what pip reports), else the source tree's.

A module of its own (core layer) so that the trainer's checkpoint metadata can name the version without importing
the `hyflow` package facade, which imports the trainer (an import cycle).
"""

from __future__ import annotations

import functools

# The version in pyproject.toml, used only when hyflow runs from a source tree that is not installed (a test in
# tests/test_packaging.py keeps the two equal).
SOURCE_VERSION = "0.1.0"


@functools.cache
def distribution_version() -> str:
    """The installed distribution's version (importlib.metadata, 20-40 ms once), else `SOURCE_VERSION`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hyflow")
    except PackageNotFoundError:
        return SOURCE_VERSION
