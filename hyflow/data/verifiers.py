"""Environments of Prime Intellect's `verifiers` library as RL data (`pip install 'hyflow[envs]'`):
`hyflow data verifiers`.

A verifiers environment bundles a dataset, a rollout protocol (single-turn, multi-turn, tools, sandboxes) written
against an OpenAI-compatible client, and a rubric that scores the rollout. hyflow trains one unchanged through its
OpenAI endpoint: `write_verifiers(env_id, out_dir, load_env=...)` takes the environment from the loader it is given
(the CLI passes `hyflow.rollout.verifiers_env.load_env`: `verifiers.load_environment(env_id, **options)`, an
installed environment package, `vf-install`'s, or any module on `sys.path` whose `load_environment(**options)`
returns one) and writes its dataset (train) and eval dataset (test; the dataset's
first rows when it has none) as rows that the `verifiers_agent` loop (`hyflow.rollout.verifiers_env`) plays: the
environment's own prompt messages (its system prompt included) as the prompt, `agent_name: verifiers_agent`, and
under `extra_info.verifiers` what its rollout needs besides (env id, options, example id, answer, info, task).
The environment's rubric scores each rollout: no reward function, no ground truth.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyflow.data.tasks.common import write_splits


def _rows(env_id: str, options_json: str, dataset, split: str, n: int, seed: int) -> list[dict]:
    if dataset is None or n == 0:
        return []
    if seed is not None and len(dataset) > 1:
        dataset = dataset.shuffle(seed=seed)
    rows = []
    for index, item in enumerate(dataset.select(range(min(n, len(dataset))))):
        prompt = item.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"verifiers environment {env_id!r}: row {index} of its {split} dataset has no chat "
                             "prompt (a list of messages); hyflow trains chat environments (verifiers' "
                             "message_type='chat')")
        answer = item.get("answer")
        info = item.get("info")
        rows.append({
            "data_source": f"verifiers/{env_id}",
            "prompt": [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in prompt],
            "ability": "verifiers",
            "reward_model": {"style": "rule", "ground_truth": "" if answer is None else str(answer)},
            "extra_info": {"split": split, "index": index, "verifiers": json.dumps({
                "env_id": env_id, "options": options_json, "example_id": item.get("example_id", index),
                "answer": answer, "info": info, "task": item.get("task")}, default=str)},
            "agent_name": "verifiers_agent",
        })
    return rows


def write_verifiers(env_id: str, out_dir: str | Path, *, load_env: Callable[[str, dict | None], Any],
                    n_train: int = 2000, n_test: int = 200, seed: int = 0, options: dict[str, Any] | None = None,
                    fmt: str = "parquet") -> dict[str, Path]:
    """Write up to `n_train` rows of the environment's dataset and `n_test` of its eval dataset (shuffled with
    `seed`); returns {split: path}. `load_env(env_id, options)`: the environment (`hyflow.rollout.verifiers_env.
    load_env`, which plays the rows)."""
    if not env_id or n_train < 0 or n_test < 0 or n_train + n_test == 0:
        raise ValueError("name a verifiers environment and ask for at least one row (--n-train / --n-test)")
    env = load_env(env_id, options)
    options_json = json.dumps(options or {}, sort_keys=True)
    train = env.get_dataset() if n_train else None
    try:
        test = env.get_eval_dataset() if n_test else None
    except ValueError:  # no eval dataset: verifiers falls back to the dataset, or refuses
        test = env.get_dataset() if n_test else None
    splits = {"train": _rows(env_id, options_json, train, "train", n_train, seed),
              "test": _rows(env_id, options_json, test, "test", n_test, seed + 1)}
    if not any(splits.values()):
        raise ValueError(f"verifiers environment {env_id!r} has no dataset rows to write")
    return write_splits({k: v for k, v in splits.items() if v}, out_dir, fmt)
