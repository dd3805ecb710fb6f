"""A generative reward model in the RL trainer: the judge (a causal LM on the hf engine, in the actor's process or
in a pool of its own on Ray) answers a prompt per sample, its answers are parsed into the reward, mixed with a rule
scorer by weight; a judge whose answers never parse stops the run with the answer quoted; the config refuses what
cannot work, by name."""

import pytest

from hyflow.config import load_config, validate_config
from hyflow.config.keys import ConfigError
from hyflow.rewards.managers import RewardFunctionError
from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # one Ray cluster for consecutive tests (tests/conftest.py)


@pytest.fixture(scope="module")
def digit_judge(tmp_path_factory):
    """A tiny causal LM whose greedy answers are digits only: its final norm keeps one hidden dimension and an
    untied head maps that dimension's sign to "7" or "3", so the judge's plumbing (prompts, engine, parsing,
    mixing) is tested with answers that parse."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyflow.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("judge"), preset="tiny", seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    seven, three = (tokenizer.convert_tokens_to_ids(t) for t in ("7", "3"))
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        head = torch.zeros(model.config.vocab_size, model.config.hidden_size)
        head[seven, 0], head[three, 0] = 50.0, -50.0
        model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return path


def overrides(model_dir, task_dir, run_dir, *extra):
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={task_dir}/train.parquet",
        f"trainer.default_local_dir={run_dir}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48",
        "data.max_response_length=8", "reward_model.num_workers=0", "trainer.logger=[file]",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.device=cpu",
        "reward_model.enable=true", f"reward_model.model.path={model_dir}", "reward_model.rollout.name=hf",
        "reward_model.rollout.response_length=6", "reward_model.rollout.do_sample=false", *extra,
    ]


@pytest.mark.parametrize("where", ["local", "own_pool"])
def test_judge_scores_mix_with_the_rule_scorer(tiny_model_dir, task_dir, digit_judge, tmp_path, where):
    run = tmp_path / "run"
    pool = (["trainer.executor=ray", "reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=1",
             "ray_kwargs.ray_init.num_cpus=2"] if where == "own_pool" else [])
    RLTrainer(overrides(tiny_model_dir, task_dir, run, f"reward_model.model.path={digit_judge}",
                        r"reward_model.judge.score_pattern='(\d)'", "reward_model.judge.rule_weight=1.0",
                        "reward_model.judge.weight=0.5", *pool)).fit()
    row = next(r for r in read_metrics(run) if r["step"] == 1)
    assert row["reward/errors"] == 0
    assert row["reward/judge/mean"] in (3.0, 7.0) or 3.0 < row["reward/judge/mean"] < 7.0  # answers 3 or 7
    # score = 0.5 x judge + 1.0 x rule, per sample, so the means add the same way
    expected = 0.5 * row["reward/judge/mean"] + row["reward/rule/mean"]
    assert row["critic/score/mean"] == pytest.approx(expected, abs=1e-5)


def test_a_judge_that_never_parses_stops_the_run(tiny_model_dir, task_dir, tmp_path):
    with pytest.raises(RewardFunctionError, match="judge"):
        RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "run",
                            r"reward_model.judge.score_pattern='NEVER-SEEN-(\d+)'")).fit()


@pytest.mark.parametrize(("extra", "message"), [
    (["reward_model.enable=false"], "reward_model.enable is false"),
    (["reward_model.judge.normalize=true"], "set reward_model.judge.score_range"),
    (["reward_model.rollout.name=null", "reward_model.judge.rule_weight=1"], "the reward model is not generative"),
    (["reward_model.rollout.n=2"], "reward_model.rollout.n"),
])
def test_judge_config_errors(tiny_model_dir, task_dir, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(overrides(tiny_model_dir, task_dir, tmp_path, *extra)))


def test_a_judge_needs_a_manager_that_mixes_like_naive(tiny_model_dir, task_dir, tmp_path):
    with pytest.raises(ValueError, match="use naive or dapo"):
        RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "run", "reward_model.reward_manager=batch"))


def test_a_sequence_classifier_behind_the_engine_keys_is_scored_by_hyflows_forward(tiny_model_dir, task_dir,
                                                                                     tmp_path, capsys):
    """verl serves a discriminative reward model through reward_model.rollout too (its Skywork-RM example): a
    classifier there is scored by hyflow's forward, and the engine keys are said to change speed only."""
    from hyflow.models.loading import load_reward_model

    rm_dir = tmp_path / "rm"
    load_reward_model(tiny_model_dir, allow_fresh_head=True).save_pretrained(rm_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).exists():
            (rm_dir / name).write_bytes((tiny_model_dir / name).read_bytes())
    run = tmp_path / "run"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, f"reward_model.model.path={rm_dir}")).fit()
    assert "is a sequence classifier: hyflow scores it with its own forward" in capsys.readouterr().out
    row = next(r for r in read_metrics(run) if r["step"] == 1)
    assert "reward/rm_score/mean" in row and "reward/judge/mean" not in row


def test_verl_spelling_of_the_judge_keys(tiny_model_dir, task_dir, tmp_path):
    cfg = load_config(overrides(tiny_model_dir, task_dir, tmp_path, "reward.reward_model.rollout.temperature=0.7",
                                "reward.reward_model.rollout.tensor_model_parallel_size=2",
                                f"reward.reward_model.model_path={tiny_model_dir}"))
    validate_config(cfg)
    assert cfg.reward_model.rollout.temperature == 0.7
