"""Expensive test inputs (SFT warm starts) built once per test run, keyed by their inputs.

A warm start takes minutes of CPU; several test modules start from the same one. `built_once(name, inputs, build)`
returns the directory `build` filled the first time these exact inputs were asked for in this run, from any module
and from any pytest process of the run:

- the cache root is `HYFLOW_TEST_CACHE` (`make test` points both its pytest runs at one fresh directory and removes it
  afterwards) or, without it, a directory of this pytest session (shared by its modules only);
- the key is a hash of `inputs` (plain JSON: the config, the data, the seed) plus what else decides the result: the
  torch and transformers versions and the CPU capability torch dispatches to, so the vLLM venv (another
  transformers) or another `ATEN_CPU_CAPABILITY` builds its own;
- a file lock serialises two processes asking for the same key; a build that raised leaves nothing behind (the
  next caller builds again), so a half-written directory is never taken for a finished one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

DONE = "BUILT"


def cache_root(tmp_path_factory) -> Path:
    """`HYFLOW_TEST_CACHE` if set (created if missing), else one directory of this pytest session."""
    given = os.environ.get("HYFLOW_TEST_CACHE")
    if given:
        root = Path(given)
        root.mkdir(parents=True, exist_ok=True)
        return root
    return tmp_path_factory.getbasetemp() / "run_cache"


def examples_cache(tmp_path_factory) -> Path:
    """HYFLOW_EXAMPLES_CACHE for the examples' `--cpu` runs (tiny model, warm-started model, task data): one per
    test run and transformers version (the vLLM venv has another), so test_examples.py and test_multinode.py, in
    every xdist worker, make them once (examples/_cpu_setup.sh holds a lock on it while it makes them)."""
    import transformers

    return cache_root(tmp_path_factory) / f"examples-{transformers.__version__}"


def cache_key(name: str, inputs: dict) -> str:
    """`name` and a hash of `inputs` with the library versions and CPU capability that decide a built result."""
    import torch
    import transformers

    decided_by = {"inputs": inputs, "torch": torch.__version__, "transformers": transformers.__version__,
                  "capability": torch.backends.cpu.get_cpu_capability()}
    digest = hashlib.sha256(json.dumps(decided_by, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{name}-{digest}"


def built_once(root: Path, name: str, inputs: dict, build: Callable[[Path], None]) -> Path:
    """The directory holding what `build(directory)` wrote for these `inputs`, built on the first call of the run."""
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(name, inputs)
    out = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / DONE).exists():
            print(f"[run cache] {name}: reusing {out}")
            return out
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        try:
            build(out)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        (out / DONE).write_text(json.dumps(inputs, sort_keys=True, default=str))
        return out
