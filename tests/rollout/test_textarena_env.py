"""TextArena's single-player games in the environment seat: `hyflow data textarena` writes rows whose prompt is the
game's opening message for a seed, and the `env_agent` loop plays them with the real TextArena (hyflow[envs]); a
binary-search player wins Guess The Number, a stubborn one loses; bad requests are named errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_agent_loop import RT, ScriptedEngine, make_prompts, manager, params, rollout_config


@pytest.fixture(autouse=True)
def _textarena():
    """Per test, not at import: collecting this module in .venv-vllm (which deselects it) must not skip it."""
    pytest.importorskip("textarena", reason="TextArena is installed by make venv (hyflow[envs])")

HYFLOW = [str(Path(sys.executable).parent / "hyflow")]


def binary_search(text: str) -> str:
    """Guess The Number (1..20) by halving, from the hints in the conversation so far."""
    low, high, guess = 1, 20, None
    for turn in text.split("<|im_start|>")[1:]:
        if turn.startswith("assistant\n"):
            found = re.search(r"\[(\d+)\]", turn)
            guess = int(found.group(1)) if found else guess
        elif turn.startswith("user\n") and guess is not None:
            if "higher" in turn:
                low = guess + 1
            elif "lower" in turn:
                high = guess - 1
    return f"I guess [{(low + high) // 2}]"


def written_rows(tmp_path, n_train=4, *options):
    proc = subprocess.run([*HYFLOW, "data", "textarena", "--env", "GuessTheNumber-v0", "--out", str(tmp_path),
                           "--n-train", str(n_train), "--n-test", "2", *options], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [pq.read_table(tmp_path / f"{split}.parquet").to_pylist() for split in ("train", "test")]


def play(tmp_path, tok, rows, reply):
    prompts = make_prompts(tok, [row["prompt"][0]["content"] for row in rows], agent="env_agent",
                           env_class=[row["env_class"] for row in rows], env_kwargs=[row["env_kwargs"] for row in rows])
    rollout = rollout_config(tmp_path, f"{RT}.multi_turn.max_assistant_turns=8", tools=False)
    return manager(ScriptedEngine(tok, reply), tok, rollout).generate(prompts, params())


def test_the_cli_writes_games_that_the_env_agent_plays_to_the_end(tmp_path, tiny_tokenizer):
    train, test = written_rows(tmp_path)
    assert len(train) == 4 and len(test) == 2
    assert {row["data_source"] for row in train} == {"textarena/GuessTheNumber-v0"}
    assert all(row["agent_name"] == "env_agent" and row["env_class"] == "textarena" for row in train)
    assert [row["env_kwargs"]["seed"] for row in train] == [0, 1, 2, 3]
    assert not {r["env_kwargs"]["seed"] for r in train} & {r["env_kwargs"]["seed"] for r in test}  # disjoint
    assert train[0]["prompt"][0]["content"].startswith("You are Player 0. You are playing Guess The Number.")

    out = play(tmp_path, tiny_tokenizer, train, binary_search)
    assert list(out["agent_reward"]) == [1.0] * 4  # halving 1..20 wins within 5 guesses
    steps = [info["env_steps"] for info in out["extra_info"]]
    assert all(1 <= s <= 5 for s in steps)
    assert out.meta["metrics"]["env/turn_count/mean"] == pytest.approx(sum(steps) / 4)
    assert out.meta["metrics"]["env/invalid_move/mean"] == 0.0

    # a player that always says 1 wins no game whose number is not 1 (TextArena gives a loss a partial reward by
    # its distance, and ends it at the repeated guesses); the game's hints are its user turns
    out = play(tmp_path, tiny_tokenizer, train, lambda text: "[1]")
    assert all(reward < 1.0 for reward in out["agent_reward"])
    text = tiny_tokenizer.decode(out["input_ids"][0])
    assert "The target number is higher." in text and "[Player]" not in text  # no echo of the player's action


def test_options_reach_the_game(tmp_path, tiny_tokenizer):
    train, _ = written_rows(tmp_path, 2, "--option", "max_turns=2")
    assert json.loads(train[0]["env_kwargs"]["options"]) == {"max_turns": 2}
    assert "within 2 turns" in train[0]["prompt"][0]["content"]
    # distinct wrong guesses (20, 19, ...: the seeds' numbers are 13 and 5): max_turns=2 ends each game at its
    # third guess (TextArena's turn count starts at 0), long before the loop's limit of 8 turns
    out = play(tmp_path, tiny_tokenizer, train, lambda text: f"[{20 - text.count('<|im_start|>assistant')}]")
    assert [info["env_steps"] for info in out["extra_info"]] == [3, 3]
    assert all(reward < 1.0 for reward in out["agent_reward"])


def test_bad_requests_are_named(tmp_path, tiny_tokenizer):
    from hyflow.data.textarena import write_textarena
    from hyflow.rollout.textarena_env import TextArenaEnv, opening

    proc = subprocess.run([*HYFLOW, "data", "textarena", "--env", "GuessTheNumbr-v0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "'GuessTheNumbr-v0' is not a TextArena game; did you mean GuessTheNumber-v0" in proc.stderr
    with pytest.raises(ValueError, match=r"'TicTacToe-v0' is not a single-player game"):
        write_textarena("TicTacToe-v0", tmp_path, opening=opening, n_train=1, n_test=0)
    with pytest.raises(ValueError, match=r"does not take the options \['colour'\]"):
        write_textarena("GuessTheNumber-v0", tmp_path, opening=opening, n_train=1, n_test=0,
                        options={"colour": "red"})
    with pytest.raises(ValueError, match=r"needs the game's id in env_kwargs.env"):
        TextArenaEnv()
    # a row whose prompt is not the game's opening for its seed
    train, _ = written_rows(tmp_path / "d", 1)
    env = TextArenaEnv(env="GuessTheNumber-v0", seed=train[0]["env_kwargs"]["seed"] + 1, options="{}")
    with pytest.raises(ValueError, match=r"not the opening message of TextArena's 'GuessTheNumber-v0' for seed 1"):
        env.reset({"raw_prompt": [{"role": "user", "content": "Guess."}]})
