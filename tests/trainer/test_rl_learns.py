"""The algorithms learn: from a short SFT warm start on the built-in arithmetic task, GRPO, PPO (critic + GAE),
RLOO and DAPO run a few steps each, and GRPO, PPO and PRIME raise the mean reward; on-policy distillation from the warm
start teaches a sparse-reward student that GRPO alone cannot move."""

import pytest
from learning import SEED, WARM_RISE_MARGIN, assert_beats_frozen, report_margin, rise

from hyflow.trainer.rl_trainer import RLTrainer

pytestmark = pytest.mark.slow


def rl(warm, run_dir, steps, *extra, seed=SEED):
    model, data = warm
    return RLTrainer([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
        f"trainer.default_local_dir={run_dir}", "data.train_batch_size=16", "data.max_prompt_length=64",
        "data.max_response_length=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.optim.lr=1e-4", "reward_model.num_workers=0",
        "trainer.logger=[file]", f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", f"trainer.seed={seed}", *extra,
    ]).fit()


def scores(history):
    return [row["critic/score/mean"] for row in history]


def score_rise(values, k=6):
    """The mean training score of the last `k` steps minus that of the first `k`."""
    return rise(values, k)


def frozen(warm, tmp_path_factory, steps=24):
    """The control of the rise tests: rl()'s run from `warm` with the actor's lr 0 (its weights never move; the
    estimator only shapes the update, so GRPO stands for every algorithm), as a function of the RL seed."""
    return lambda seed: scores(rl(warm, tmp_path_factory.mktemp("frozen"), steps, "algorithm.adv_estimator=grpo",
                                  "actor_rollout_ref.actor.optim.lr=0", seed=seed))


def mean_reward(history, steps):
    return sum(row["critic/score/mean"] for row in steps(history)) / len(steps(history))


RISE_ALGORITHMS = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "ppo": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "critic.ppo_epochs=2",
            "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
    "prime": ["algorithm.adv_estimator=prime", "reward_model.enable=true", "reward_model.model.optim.lr=1e-4",
              "reward_model.mini_batch_size=128", "algorithm.reward_dpo_coef=1"],
}


RISE_STEPS = 48


@pytest.mark.parametrize("name", list(RISE_ALGORITHMS))  # ids test_reward_rises[grpo], [ppo], [prime]
def test_reward_rises(warm, tmp_path, tmp_path_factory, name):
    """The rise of the mean training score (last 6 of RISE_STEPS = 48 steps - first 6) beats the frozen control's (the
    same run, same seeds, actor lr 0) by more than WARM_RISE_MARGIN = 0.11 (its noise: tests/learning.py; the control's
    per-step scores are stationary, so its rise's SD does not depend on how many steps lie between the windows).
    48 steps, not 24: on an Intel Xeon (native avx512) the 24-step runs gave D = rise - control = grpo +0.120,
    ppo +0.124, prime +0.102 (CI failed prime), where the AMD EPYC below gave +0.164 / +0.231 / +0.147. At 48 steps
    (Intel Xeon, seed 0): native control -0.042, grpo D +0.212, ppo +0.231, prime +0.180; ATEN_CPU_CAPABILITY=default
    (its own warm start) control -0.004, grpo +0.189, prime +0.154. At 24 steps, AMD EPYC native (issue 37): the
    control rose -0.052; grpo +0.112 (D +0.164), ppo +0.178 (+0.231), prime +0.095 (+0.147).
    Rises measured before, against a fixed 0.05: seed 0 under ATEN_CPU_CAPABILITY=default grpo 0.133, ppo 0.184
    (issue 22); seeds 1 / 2 under default grpo 0.208 / 0.128, ppo 0.238 / 0.133. prime (the implicit PRM trained
    every step, one PRM optimizer step of 128 samples, lr 1e-4; the outcome's RLOO weighs 5, the implicit rewards' 1):
    seed 0 default 0.108, avx2 0.098; seeds 1 / 2 native 0.232 / 0.151 (issue 28). With the recipe's equal weights
    5 / 5 the one native run rose 0.023 (PRM lr 1e-4) to 0.074 (lr 1e-5); outcome-only RLOO (reward_dpo_coef=0)
    rose 0.104 there, so on this tiny task the implicit rewards add no measurable speed."""
    assert_beats_frozen(f"test_reward_rises[{name}]", f"score rise (last 6 - first 6 of {RISE_STEPS} steps)",
                        lambda: score_rise(scores(rl(warm, tmp_path / name, RISE_STEPS, *RISE_ALGORITHMS[name]))),
                        frozen(warm, tmp_path_factory, RISE_STEPS), score_rise,
                        ("rl_learns", str(warm[0]), RISE_STEPS), WARM_RISE_MARGIN)


def test_rloo_with_adaptive_kl_in_reward(warm, tmp_path):
    history = rl(warm, tmp_path / "rloo", 3, "algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=true",
                 "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05")
    last = history[-1]
    assert last["step"] == 3 and "actor/reward_kl_penalty" in last
    assert last["actor/reward_kl_penalty_coeff"] != 0.05  # the adaptive controller moved the coefficient


def test_remax_greedy_baseline(warm, tmp_path):
    history = rl(warm, tmp_path / "remax", 2, "algorithm.adv_estimator=remax")
    assert history[-1]["step"] == 2 and history[-1]["critic/advantages/max"] > 0


def test_rollout_correction_and_ppo_extras(warm, tmp_path):
    history = rl(warm, tmp_path / "tis", 2, "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=token",
                 "algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=2.0",
                 "actor_rollout_ref.actor.policy_loss.loss_mode=cispo", "actor_rollout_ref.actor.entropy_coeff=0.01",
                 "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512")
    last = history[-1]
    assert "rollout_corr/is_mean" in last and "actor/entropy_loss" in last
    assert abs(last["rollout_corr/kl"]) < 1e-4  # rollout and trainer agree on CPU in fp32


def test_dapo_clip_higher_dynamic_sampling_overlong(warm, tmp_path):
    history = rl(warm, tmp_path / "dapo", 3, "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                 "actor_rollout_ref.actor.loss_agg_mode=token-mean", "algorithm.filter_groups.enable=true",
                 "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
                 "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true",
                 "reward_model.overlong_buffer.len=8", "reward_model.overlong_buffer.penalty_factor=1.0",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.gen_batch_size=8")
    last = history[-1]
    assert "train/num_gen_batches" in last and "reward/overlong_penalty/mean" in last
    # rounds of data.gen_batch_size=8 prompts fill a train batch of 16 prompts in two rounds at least
    assert min(h["train/num_gen_batches"] for h in history) >= 2
    # every kept group has samples that disagree, so no advantage row is all zero
    assert last["critic/advantages/max"] > 0 > last["critic/advantages/min"]


def test_on_policy_distillation_learns_where_grpo_cannot(warm, unformatted, tmp_path):
    """On-policy distillation (issue 27) against GRPO alone, both from the same sparse-reward student (the
    `unformatted` fixture: it adds but almost never writes the `#### value` line the scorer reads) for 15 steps of
    16 prompts x 8 samples. GRPO's groups all score 0, so its advantages are 0 and it cannot move; the teacher (the
    warm start, which writes the line about half the time) scores every token of the student's own samples, and the
    forward KL over its top-16 tokens teaches the line. The mean training score (a sampled average over 8 x 128
    samples, no argmax) of distillation's last 8 steps exceeds GRPO's by more than 0.05 (GRPO's stays below 0.01).
    Premise: GRPO's first 4 steps score below 0.05 (the reward is sparse). The ceiling is the teacher's own score,
    which varies with the seed (the warm start samples right about 0.4 of the time at seed 0, 0.2 at seed 2).
    Margins measured (distillation - GRPO - 0.05; `[margin]` lines; AMD EPYC; issue 27, part 3): seeds 0 / 1 / 2
    under ATEN_CPU_CAPABILITY=default: +0.102 / +0.126 / +0.069; under avx2: +0.121 / +0.108 / +0.130 (GRPO's
    last-8 score 0.000-0.004 in all six). Adds about 45 s on a quiet 2-core machine (fixture + two runs).
    The control (issue 37) is the GRPO run itself: its advantages are all 0, so it does not move, and a frozen
    distillation run would sample what it samples. A frozen policy passes only if its last-8 mean score (1,024
    samples at p ~ 0.003) exceeds GRPO's by 0.05: that mean's SD is about sqrt(0.003 / 1024) = 0.0017, so 0.05 is
    ~20 SD away (false-pass rate ~0); the six measured GRPO runs above span 0.004."""
    teacher, _ = warm
    grpo = rl(unformatted, tmp_path / "grpo", 15, "algorithm.adv_estimator=grpo",
              "actor_rollout_ref.actor.optim.lr=3e-4")
    distill = rl(unformatted, tmp_path / "distill", 15, "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.actor.optim.lr=1e-3", "distillation.enabled=true",
                 f"distillation.teacher_models.teacher_model.model_path={teacher}",
                 "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=16",
                 "distillation.distillation_loss.use_task_rewards=false")
    first_grpo = mean_reward(grpo, lambda h: h[:4])
    last_grpo, last_distill = mean_reward(grpo, lambda h: h[-8:]), mean_reward(distill, lambda h: h[-8:])
    print(f"GRPO: first 4 steps {first_grpo:.3f}, last 8 {last_grpo:.3f}; distillation: last 8 {last_distill:.3f}")
    print("scores by step: GRPO", [round(row["critic/score/mean"], 3) for row in grpo],
          "distillation", [round(row["critic/score/mean"], 3) for row in distill])
    assert first_grpo < 0.05, f"premise: the student's reward is sparse (GRPO's first 4 steps score {first_grpo})"
    report_margin("test_on_policy_distillation_learns_where_grpo_cannot",
                  "score of distillation - GRPO (last 8 of 15 steps)", last_distill - last_grpo, 0.05)
    assert last_distill > last_grpo + 0.05


PREFERENCE_ALGORITHMS = {
    "online_dpo": ["algorithm.adv_estimator=online_dpo", "actor_rollout_ref.actor.dpo_beta=0.1",
                   "actor_rollout_ref.actor.optim.lr=3e-4"],
    "sppo": ["algorithm.adv_estimator=sppo", "actor_rollout_ref.actor.policy_loss.loss_mode=sppo",
             "actor_rollout_ref.actor.optim.lr=3e-4"],
}


@pytest.mark.parametrize("name", list(PREFERENCE_ALGORITHMS))
def test_preference_reward_rises(warm, tmp_path, tmp_path_factory, name):
    """Online preference optimisation inside the RL step (online DPO: pairs of each prompt's best- and worst-scored
    samples; SPPO: square loss toward the centred score), 16 prompts x 8 samples, lr 3e-4: the rise of the mean
    training score (last 6 of 24 steps - first 6) beats the frozen control's (as test_reward_rises) by more than
    WARM_RISE_MARGIN = 0.11, over RISE_STEPS = 48 steps (the frozen control test_reward_rises runs too). 48, not 24:
    from the warm start an Intel Xeon builds (tests/fixtures/warm) the 24-step online_dpo run gave D = +0.113 (seed
    0, avx512 and avx2 alike): on the margin's edge, where the AMD EPYC's warm start gave +0.203. Measured at 24 steps,
    seed 0, native avx512 (issue 37; the control rose -0.052): online_dpo +0.151 (D = +0.203), sppo +0.138 (+0.190).
    At lr 1e-4 (until issue 37) they rose 0.076 / 0.061 (D 0.128 / 0.113, the rises 0.113 / 0.132 under default
    kernels, 0.120 / 0.119 under avx2): too close to a margin that a policy moving at random beats in under 1 % of
    seeds."""
    assert_beats_frozen(f"test_preference_reward_rises[{name}]",
                        f"score rise (last 6 - first 6 of {RISE_STEPS} steps)",
                        lambda: score_rise(scores(rl(warm, tmp_path / name, RISE_STEPS, *PREFERENCE_ALGORITHMS[name]))),
                        frozen(warm, tmp_path_factory, RISE_STEPS), score_rise, ("rl_learns", str(warm[0]), RISE_STEPS),
                        WARM_RISE_MARGIN)
