"""The env_agent loop: a Gymnasium-style text environment drives the trajectory; its return is the sample's score.

Most tests use the scripted engine of test_agent_loop.py (the reply is a function of the conversation), so turns,
masks and rewards are exact; one runs the trainer end to end on rows that only an environment scores."""

from __future__ import annotations

import time

import pytest
from test_agent_loop import RT, ScriptedEngine, make_prompts, manager, params, rollout_config, segments

from hyflow.rollout.env_loop import ENVS, register_env

GUESS_ENV = '''
class Guess:
    """Guess a number in 1..9: each wrong guess is answered 'higher' or 'lower' (reward -0.1), the right one ends
    the episode with reward 1."""

    def __init__(self, target=7, **kwargs):
        self.target, self.closed = int(target), False

    def reset(self, sample):
        self.target = int((sample.get("extra_info") or {}).get("target", self.target))

    def step(self, action):
        digits = [c for c in action if c.isdigit()]
        if not digits:
            return "say a digit", -0.1, False, {"valid": 0}
        guess = int(digits[-1])
        if guess == self.target:
            return None, 1.0, True, {"valid": 1}
        return ("higher" if guess < self.target else "lower"), -0.1, False, {"valid": 1}

    def close(self):
        self.closed = True
'''


def guesser(text: str) -> str:
    """Binary-search the number from the observations in the conversation."""
    low, high = 1, 9
    guess = 5
    for turn in text.split("<|im_start|>")[1:]:
        if turn.startswith("assistant\n") and "####" in turn:
            guess = int(turn.split("####")[1].strip()[0])
        elif turn.startswith("user\nhigher"):
            low = guess + 1
        elif turn.startswith("user\nlower"):
            high = guess - 1
    return f"#### {(low + high) // 2}"


@pytest.fixture
def guess_env(tmp_path):
    (tmp_path / "guess_env.py").write_text(GUESS_ENV)
    return f"{tmp_path}/guess_env.py:Guess"


def env_prompts(tok, targets, env_class):
    return make_prompts(tok, ["Guess my number."] * len(targets), agent="env_agent",
                        env_class=[env_class] * len(targets), extra_info=[{"target": t} for t in targets])


def test_an_episode_is_the_trajectory_and_its_return_the_score(tmp_path, tiny_tokenizer, guess_env):
    tok = tiny_tokenizer
    out = manager(ScriptedEngine(tok, guesser), tok, rollout_config(tmp_path, tools=False)).generate(
        env_prompts(tok, [7, 5], guess_env), params())
    # target 7: 5 (higher) -> 7; target 5: 5 at once
    assert segments(tok, out, 0) == [(1, "#### 5<|im_end|>"),
                                     (0, "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"),
                                     (1, "#### 7<|im_end|>")]
    assert segments(tok, out, 1) == [(1, "#### 5<|im_end|>")]
    assert list(out["agent_reward"]) == [pytest.approx(0.9), 1.0]
    info = out["extra_info"][0]
    assert info["env_return"] == pytest.approx(0.9) and info["env_steps"] == 2 and "env_error" not in info
    metrics = out.meta["metrics"]
    assert metrics["env/return/mean"] == pytest.approx(0.95) and metrics["env/steps/mean"] == 1.5
    assert metrics["env/valid/mean"] == 1.0 and metrics["env/errors/mean"] == 0.0


class Raising:
    def step(self, action):
        raise RuntimeError("the simulator crashed")


class Blocking:
    def step(self, action):
        time.sleep(30)


class Garbage:
    def step(self, action):
        return "not a tuple"


@pytest.mark.parametrize("env, counter, message", [
    (Raising, "env/errors/mean", "environment step raised RuntimeError: the simulator crashed"),
    (Blocking, "env/timeouts/mean", "environment step timed out after 1.0 s (multi_turn.tool_timeout)"),
    (Garbage, "env/errors/mean", "environment step returned str; return (observation, reward, done, info)"),
])
def test_an_environment_that_fails_ends_its_episode_not_the_rollout(env, counter, message, tmp_path,
                                                                    tiny_tokenizer, guess_env):
    tok = tiny_tokenizer
    register_env("broken")(env)
    try:
        prompts = env_prompts(tok, [7, 7], guess_env)
        prompts["env_class"] = ["broken", guess_env]
        start = time.perf_counter()
        out = manager(ScriptedEngine(tok, guesser), tok,
                      rollout_config(tmp_path, f"{RT}.multi_turn.tool_timeout=1", tools=False)).generate(
            prompts, params())
        assert time.perf_counter() - start < 20  # a blocked step holds nothing past its timeout
    finally:
        ENVS._entries.pop("broken", None)
    assert out["extra_info"][0]["env_error"].startswith(message)
    assert list(out["agent_reward"]) == [0.0, pytest.approx(0.9)]  # the other episode was played out
    assert out.meta["metrics"][counter] == 0.5


def test_an_unknown_environment_is_named(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    with pytest.raises(ValueError, match=r"unknown environment 'gues'"):
        manager(ScriptedEngine(tok, guesser), tok, rollout_config(tmp_path, tools=False)).generate(
            env_prompts(tok, [7], "gues"), params())


@pytest.mark.slow
def test_the_trainer_learns_from_environment_returns_alone(tiny_model_dir, tmp_path, guess_env):
    """Rows whose data_source no scorer knows: the env_agent loop scores them, so the run starts and its rewards
    are the episodes' returns."""
    import pandas as pd

    from hyflow.trainer.rl_trainer import RLTrainer

    rows = [{"data_source": "guess_game", "prompt": [{"role": "user", "content": "Guess my number."}],
             "agent_name": "env_agent", "env_class": guess_env, "extra_info": {"target": 1 + i % 9}}
            for i in range(16)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    history = RLTrainer([
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/train.parquet", f"trainer.default_local_dir={tmp_path}/run",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=48", "data.max_response_length=40",
        f"{RT}.multi_turn.enable=true", f"{RT}.multi_turn.max_assistant_turns=3", "trainer.logger=[file]",
        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "reward_model.num_workers=0",
    ]).fit()
    last = history[-1]
    assert last["reward/agent_reward/share"] == 1.0
    assert last["critic/score/mean"] == pytest.approx(last["env/return/mean"], abs=1e-5)
    assert "env/steps/mean" in last and last["env/errors/mean"] == 0.0


# ---------------------------------------------------------------------------------------------- SkyRL-Gym
def test_skyrl_gym_environments_run_in_the_seat(tmp_path, tiny_tokenizer):
    """The real SkyRL-Gym gsm8k environment (hyflow[envs]) scores each row's answer against its ground truth."""
    pytest.importorskip("skyrl_gym", reason="SkyRL-Gym is installed by make venv (hyflow[envs])")
    tok = tiny_tokenizer
    prompts = make_prompts(tok, ["What is 8 * 9?", "What is 6 * 7?"], agent="env_agent",
                           env_class=["skyrl", "skyrl"], env_kwargs=[{"env": "gsm8k"}] * 2, ground_truth=["72", "42"])
    out = manager(ScriptedEngine(tok, lambda text: "8 * 9 = 72\n#### 72"), tok,
                  rollout_config(tmp_path, tools=False)).generate(prompts, params())
    assert list(out["agent_reward"]) == [1.0, 0.0]  # right for the first row, wrong for the second
    assert [info["env_steps"] for info in out["extra_info"]] == [1, 1]  # gsm8k is one step


def test_skyrl_errors_name_the_fix():
    pytest.importorskip("skyrl_gym")
    from hyflow.rollout.skyrl_env import SkyRLEnv

    with pytest.raises(ValueError, match=r"needs the SkyRL-Gym environment id in env_kwargs.env"):
        SkyRLEnv()
    with pytest.raises(ValueError, match=r"env_kwargs.env='gsm9k' is not a SkyRL-Gym environment \(registered: .*gsm8k"):
        SkyRLEnv(env="gsm9k")
