"""TextArena's single-player games as RL data (`pip install 'hyflow[envs]'`): `hyflow data textarena`.

`write_textarena(envs, out_dir, ...)` writes `train` and `test` files of rows that the `env_agent` loop plays with
`env_class: textarena` (`hyflow.rollout.textarena_env`): one game per row, its seed in `env_kwargs`, its opening
message for that seed as the prompt (so the policy answers it first), the episode's return as the score (no
reward function, no ground truth). Several games are mixed in turn (`envs="GuessTheNumber-v0,Mastermind-v0"`);
`options` go to every game's constructor (e.g. `{"max_turns": 10}`). Train and test come from disjoint seeds.
The game helpers here (`make_game`, `start`, `text_of`) are shared with the environment
(`hyflow.rollout.textarena_env`), which plays the rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hyflow.data.tasks.common import make_row, optional_package, write_splits


def _textarena():
    return optional_package("textarena", used_by="env_class textarena / hyflow data textarena", pip="textarena")


def game_ids() -> list[str]:
    """TextArena's game ids (without its wrapper variants -raw / -train)."""
    from textarena.envs.registration import ENV_REGISTRY

    _textarena()
    return sorted(i for i in ENV_REGISTRY if not i.endswith(("-raw", "-train")))


def make_game(env: str, options: dict | str | None = None):
    """The game `env` without TextArena's LLM wrappers, built with `options`; unknown ids and games that cannot
    be built here are ValueErrors that say why."""
    ta = _textarena()
    from textarena.envs.registration import ENV_REGISTRY

    if isinstance(options, str):
        options = json.loads(options) if options else {}
    raw = env if env.endswith("-raw") else f"{env}-raw"
    if raw not in ENV_REGISTRY:
        import difflib

        close = difflib.get_close_matches(env, game_ids(), n=3)
        raise ValueError(f"{env!r} is not a TextArena game" + (f"; did you mean {', '.join(close)}?" if close else
                                                                 "; hyflow data textarena --list names them"))
    try:
        return ta.make(raw, **(options or {}))
    except TypeError as err:
        raise ValueError(f"TextArena game {env!r} does not take the options {sorted(options or {})}: {err}") from None
    except Exception as err:  # a game whose module does not import here (Python version, missing asset)
        raise ValueError(f"TextArena could not build the game {env!r}: {type(err).__name__}: {err}") from err


def start(env: str, seed: int | None, options: dict | str | None = None) -> tuple[Any, str]:
    """(the game reset for one player with `seed`, its opening message)."""
    game = make_game(env, options)
    try:
        game.reset(num_players=1, seed=seed)
    except AssertionError as err:  # TextArena asserts the number of players
        raise ValueError(f"TextArena game {env!r} is not a single-player game ({err}); hyflow's textarena "
                         "environment plays single-player games only") from None
    except LookupError as err:  # nltk data the game would download
        raise ValueError(f"TextArena game {env!r} needs data it downloads at start, which is not here: "
                         f"{' '.join(str(err).split())[:300]}") from None
    player, messages = game.get_observation()
    return game, text_of(messages, player)


def text_of(messages, player: int) -> str:
    """The text of the game's messages, the player's own echoed actions left out."""
    return "\n".join(str(message) for sender, message, *_ in messages if sender != player).strip()


def write_textarena(envs: str | list[str], out_dir: str | Path, *, n_train: int = 2000, n_test: int = 200,
                    seed: int = 0, options: dict[str, Any] | None = None, fmt: str = "parquet") -> dict[str, Path]:
    """Write `n_train` + `n_test` games of `envs` (comma-separated or a list); returns {split: path}. An unknown
    game, a game for several players or one that cannot start here is a ValueError that says which."""
    names = [e.strip() for e in envs.split(",")] if isinstance(envs, str) else list(envs)
    if not names or not all(names) or n_train < 0 or n_test < 0 or n_train + n_test == 0:
        raise ValueError("name at least one TextArena game and ask for at least one row (--n-train / --n-test)")
    options_json = json.dumps(options or {}, sort_keys=True)
    splits: dict[str, list[dict]] = {}
    for split, size, split_seed in (("train", n_train, seed), ("test", n_test, seed + 1_000_003)):
        rows = []
        for i in range(size):
            name, game_seed = names[i % len(names)], split_seed + i
            game, opening = start(name, game_seed, options)
            game.close()
            row = make_row(f"textarena/{name}", opening, ability="game", ground_truth="", split=split, index=i,
                           extra={"game": name, "seed": game_seed})
            row.update(agent_name="env_agent", env_class="textarena",
                       env_kwargs={"env": name, "seed": game_seed, "options": options_json})
            rows.append(row)
        splits[split] = rows
    return write_splits({k: v for k, v in splits.items() if v}, out_dir, fmt)
