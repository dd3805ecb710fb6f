"""TextArena's single-player games in hyflow's environment seat (`env_class: textarena`).

TextArena (`pip install textarena`, `hyflow[envs]`) ships ~100 text games (GuessTheNumber, Mastermind,
FrozenLake, Minesweeper, Sudoku, FifteenPuzzle, Countdown, LightsOut, Blackjack, ...). A row runs one with::

    {"agent_name": "env_agent", "env_class": "textarena",
     "env_kwargs": {"env": "GuessTheNumber-v0", "seed": 7, "options": "{\"max_turns\": 10}"},
     "prompt": [{"role": "user", "content": <the game's first observation for that seed>}]}

`hyflow data textarena --env ID[,ID] --out DIR` writes such rows (`hyflow.data.textarena`, with `opening` from
here): the game's opening
message for each seed is the prompt, so the policy's first turn answers it. `env_kwargs`: `env` (a TextArena id),
`seed` (the game's seed), `options` (the game's constructor options, a dict or its JSON).

Mapping: `reset(sample)` builds the game without TextArena's LLM wrappers (`<id>-raw`: observations are the new
messages only, actions are the model's text as it wrote it) for one player and checks that its opening message
is the row's prompt (hyflow has already tokenised it). `step(action)` plays the model's turn: while the game goes
on, the observation is the game's new messages (the echo of the player's own action left out), reward 0; when
it ends, TextArena's reward for the player (1 for a win in most games, 0 or -1 otherwise) and the numbers of its
game info (`turn_count`, `invalid_move` as 0/1) as `info`. Games for two or more players are refused by name
(hyflow would need opponents), as are games whose assets TextArena downloads at start (nltk's word lists: there is
no network here to fetch them).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from hyflow.rollout.env_loop import register_env
from hyflow.user_code import optional_package

with contextlib.suppress(ModuleNotFoundError):  # imported once, here: each episode's process inherits it (seconds)
    import textarena  # noqa: F401


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


def opening(env: str, seed: int, options: dict | str | None = None) -> str:
    """The first message of the game `env` for `seed` (a row's prompt: `hyflow data textarena`)."""
    game, text = start(env, seed, options)
    game.close()
    return text


@register_env("textarena")
class TextArenaEnv:
    """One single-player TextArena game (see the module docstring)."""

    def __init__(self, env: str | None = None, seed: int | None = None, options: dict | str | None = None) -> None:
        if not env:
            raise ValueError("env_class textarena needs the game's id in env_kwargs.env (e.g. GuessTheNumber-v0)")
        make_game(env, options)  # the id and options are checked before the episode starts
        self.name, self.seed, self.options = env, None if seed is None else int(seed), options
        self.game = None
        self.player = 0

    def reset(self, sample: dict) -> None:
        self.game, opening = start(self.name, self.seed, self.options)
        prompt = [dict(m) for m in sample["raw_prompt"]]
        last = str(prompt[-1].get("content", "")).strip() if prompt else ""
        if last != opening:
            raise ValueError(f"the row's prompt is not the opening message of TextArena's {self.name!r} for seed "
                             f"{self.seed}: write the rows with `hyflow data textarena` (the game decides its opening "
                             "message; hyflow has already tokenised the row's)")

    def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        done, _ = self.game.step(action=action)
        if not done:
            player, messages = self.game.get_observation()
            self.player = player
            return text_of(messages, player) or None, 0.0, False, {}
        rewards, game_info = self.game.close()
        self.game = None
        info = dict((game_info or {}).get(self.player) or {})
        numbers = {k: float(v) for k, v in info.items() if isinstance(v, (int, float))}
        return None, float((rewards or {}).get(self.player, 0.0)), True, numbers

    def close(self) -> None:
        if self.game is not None:
            self.game.close()
            self.game = None
