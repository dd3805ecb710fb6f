"""Procedurally generated RL tasks from Reasoning Gym (`pip install 'hyflow[envs]'`): `hyflow data reasoning-gym`.

Reasoning Gym (Stojanovski et al., 2025) generates verifiable problems of ~100 kinds offline (`leg_counting`,
`basic_arithmetic`, `chain_sum`, `word_sorting`, `sudoku`, `knights_knaves`, ...), each with its own checker.
`write_reasoning_gym(tasks, out_dir, ...)` writes `train` and `test` files in verl's row schema:

    prompt       = the generated question + " " + INSTRUCTION (the answer after "####")
    data_source  = "reasoning_gym" (one scorer for every task: hyflow.rewards.scorers.reasoning_gym)
    ground_truth = the entry's answer
    extra_info   = {"index", "split", "task", "entry": the whole generated entry as JSON}

Several tasks are mixed in turn (`tasks="leg_counting,chain_sum"`); `config` holds the generators' options (e.g.
`{"min_animals": 2}`; Reasoning Gym names them per task). Train and test come from disjoint seeds. The scorer
reads the answer after the response's last "####" and asks the task's own checker (`score_answer`), which gives
partial credit where the task defines it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hyflow.data.tasks.common import make_row, write_splits
from hyflow.user_code import optional_package

INSTRUCTION = "Think it through, then put the final answer after '####' on the last line."
DATA_SOURCE = "reasoning_gym"


def _reasoning_gym():
    return optional_package("reasoning_gym", used_by="hyflow data reasoning-gym", pip="reasoning-gym")


def task_names() -> list[str]:
    """Every task Reasoning Gym can generate."""
    return sorted(_reasoning_gym().factory.DATASETS)


def write_reasoning_gym(tasks: str | list[str], out_dir: str | Path, *, n_train: int = 2000, n_test: int = 200,
                        seed: int = 0, config: dict[str, Any] | None = None, fmt: str = "parquet") -> dict[str, Path]:
    """Generate `n_train` + `n_test` problems of `tasks` (comma-separated or a list) and write them; returns
    {split: path}. An unknown task is a ValueError naming the closest ones."""
    rg = _reasoning_gym()
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    known = set(rg.factory.DATASETS)
    for name in names:
        if name not in known:
            import difflib

            close = difflib.get_close_matches(name, sorted(known), n=3)
            raise ValueError(f"unknown Reasoning Gym task {name!r}" + (f"; did you mean {', '.join(close)}?" if close
                             else f"; {len(known)} tasks: hyflow data reasoning-gym --list"))
    if not names or n_train < 0 or n_test < 0 or n_train + n_test == 0:
        raise ValueError("name at least one task and ask for at least one problem (--n-train / --n-test)")
    splits: dict[str, list[dict]] = {}
    for split, size, split_seed in (("train", n_train, seed), ("test", n_test, seed + 1_000_003)):
        rows: list[dict] = []
        per_task = {name: -(-size // len(names)) for name in names}
        datasets = {}
        for k, name in enumerate(names):
            try:
                datasets[name] = rg.create_dataset(name, size=max(per_task[name], 1), seed=split_seed + k,
                                                   **(config or {}))
            except TypeError as err:
                raise ValueError(f"Reasoning Gym task {name!r} does not take the options {sorted(config or {})}: "
                                 f"{err}") from None
        for i in range(size):
            name = names[i % len(names)]
            entry = datasets[name][i // len(names)]
            rows.append(make_row(DATA_SOURCE, f"{entry['question'].strip()} {INSTRUCTION}", ability="reasoning",
                                 ground_truth=str(entry["answer"]), split=split, index=i,
                                 extra={"task": name, "entry": json.dumps(entry, default=str)}))
        splits[split] = rows
    return write_splits({k: v for k, v in splits.items() if v}, out_dir, fmt)
