"""TextArena's single-player games as RL data (`pip install 'hyflow[envs]'`): `hyflow data textarena`.

`write_textarena(envs, out_dir, ...)` writes `train` and `test` files of rows that the `env_agent` loop plays with
`env_class: textarena` (`hyflow.rollout.textarena_env`): one game per row, its seed in `env_kwargs`, its opening
message for that seed as the prompt (so the policy answers it first), the episode's return as the score (no
reward function, no ground truth). Several games are mixed in turn (`envs="GuessTheNumber-v0,Mastermind-v0"`);
`options` go to every game's constructor (e.g. `{"max_turns": 10}`). Train and test come from disjoint seeds.
The game itself is the environment's (`hyflow.rollout.textarena_env`, which plays the rows): the CLI passes its
`opening(game, seed, options)` in, so the rows' prompts are the openings the environment checks against.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyflow.data.tasks.common import make_row, write_splits


def write_textarena(envs: str | list[str], out_dir: str | Path, *, opening: Callable[[str, int, str], str],
                    n_train: int = 2000, n_test: int = 200, seed: int = 0, options: dict[str, Any] | None = None,
                    fmt: str = "parquet") -> dict[str, Path]:
    """Write `n_train` + `n_test` games of `envs` (comma-separated or a list); returns {split: path}. `opening(game,
    seed, options JSON)`: the game's first message for that seed (`hyflow.rollout.textarena_env.opening`, which
    raises a ValueError that says why for an unknown game, one for several players or one that cannot start)."""
    names = [e.strip() for e in envs.split(",")] if isinstance(envs, str) else list(envs)
    if not names or not all(names) or n_train < 0 or n_test < 0 or n_train + n_test == 0:
        raise ValueError("name at least one TextArena game and ask for at least one row (--n-train / --n-test)")
    options_json = json.dumps(options or {}, sort_keys=True)
    splits: dict[str, list[dict]] = {}
    for split, size, split_seed in (("train", n_train, seed), ("test", n_test, seed + 1_000_003)):
        rows = []
        for i in range(size):
            name, game_seed = names[i % len(names)], split_seed + i
            row = make_row(f"textarena/{name}", opening(name, game_seed, options_json), ability="game", ground_truth="", split=split, index=i,
                           extra={"game": name, "seed": game_seed})
            row.update(agent_name="env_agent", env_class="textarena",
                       env_kwargs={"env": name, "seed": game_seed, "options": options_json})
            rows.append(row)
        splits[split] = rows
    return write_splits({k: v for k, v in splits.items() if v}, out_dir, fmt)
