"""Online preference optimisation learns inside the RL step: from the quickstart's SFT warm start on the built-in
arithmetic task (the `warm` fixture, tests/trainer/conftest.py), online DPO (pairs of each prompt's best- and
worst-scored samples) and SPPO (square loss toward the centred score) raise the mean training reward."""

import pytest
from learning import report_margin
from test_rl_learns import rl

pytestmark = pytest.mark.slow

ALGORITHMS = {
    "online_dpo": ["algorithm.adv_estimator=online_dpo", "actor_rollout_ref.actor.dpo_beta=0.1"],
    "sppo": ["algorithm.adv_estimator=sppo", "actor_rollout_ref.actor.policy_loss.loss_mode=sppo"],
}


def mean_reward(rows):
    return sum(row["critic/score/mean"] for row in rows) / len(rows)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_preference_reward_rises(warm, tmp_path, name):
    """The mean training reward of the last 6 of 24 steps exceeds that of the first 6 by more than 0.05.
    Margins measured (last - first - 0.05; seed 0, AMD EPYC): ATEN_CPU_CAPABILITY=default online_dpo +0.063, sppo
    +0.082; avx2 online_dpo +0.070, sppo +0.069; avx512 (measured with the first 6 steps counted from step 2)
    online_dpo +0.033, sppo +0.024. About 6 minutes each with the warm start on 2 busy cores."""
    history = rl(warm, tmp_path / name, 24, *ALGORITHMS[name])  # 16 prompts x 8 samples, lr 1e-4
    first, last = mean_reward(history[:6]), mean_reward(history[-6:])
    print(f"{name}: mean reward first 6 steps {first:.3f}, last 6 steps {last:.3f}")
    report_margin(f"test_preference_reward_rises[{name}]", "reward rise (last 6 - first 6 steps)", last - first, 0.05)
    assert last > first + 0.05
