"""The config of online DPO, SPIN and SPPO: what hangs together is accepted (and loads the reference where the
pairs need it), what does not is refused with a message naming the keys."""

import pytest

from hyflow.config import load_config, validate_config
from hyflow.config.arithmetic import uses_reference
from hyflow.config.roles import pair_preference_spec

BASE = ["actor_rollout_ref.model.path=m", "data.train_files=x.parquet", "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]


def config(*extra):
    return load_config([*BASE, *extra])


@pytest.mark.parametrize("estimator", ["online_dpo", "spin"])
def test_the_pair_estimators_load_the_reference_and_give_the_actor_its_dpo_term(estimator):
    cfg = config(f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.actor.dpo_beta=0.3",
                 "algorithm.dpo_loss_type=ipo", "trainer.ref_update_freq=2", "trainer.save_freq=4")
    validate_config(cfg)
    assert uses_reference(cfg)
    spec = pair_preference_spec(cfg)
    assert (spec.loss_type, spec.beta, spec.label_smoothing) == ("ipo", 0.3, 0.0)
    assert pair_preference_spec(config("algorithm.adv_estimator=grpo")) is None
    assert not uses_reference(config("algorithm.adv_estimator=sppo", "actor_rollout_ref.actor.policy_loss.loss_mode=sppo"))


@pytest.mark.filterwarnings("ignore::UserWarning")  # the other checks' warnings about the same configs
@pytest.mark.parametrize("extra, message", [
    (["algorithm.adv_estimator=sppo"], "adv_estimator=sppo .* with actor_rollout_ref.actor.policy_loss.loss_mode=sppo"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sppo", "algorithm.adv_estimator=grpo"], "set both"),
    (["algorithm.adv_estimator=online_dpo", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     "DPO loss in the policy loss's place"),
    (["algorithm.adv_estimator=online_dpo", "critic.enable=true"], "set critic.enable=false"),
    (["algorithm.adv_estimator=spin", "actor_rollout_ref.rollout.n=1"], "set actor_rollout_ref.rollout.n=2"),
    (["algorithm.adv_estimator=spin", "algorithm.rollout_correction.rollout_is=token",
      "actor_rollout_ref.rollout.calculate_log_probs=true"], "no rollout log-probs for them"),
    (["algorithm.adv_estimator=spin", "async_training.mode=one_step_off"], "use async_training.mode=sync"),
    (["algorithm.adv_estimator=grpo", "algorithm.dpo_label_smoothing=0.1"], "dpo_label_smoothing is read by"),
    (["algorithm.adv_estimator=online_dpo", "algorithm.dpo_loss_type=hinge", "algorithm.dpo_label_smoothing=0.1"],
     "sigmoid and robust losses only"),
    (["algorithm.adv_estimator=grpo", "data.reference_answer_key=extra_info.solution"], "spin only"),
    (["algorithm.adv_estimator=grpo", "trainer.ref_update_freq=2"], "this run has none"),
    (["algorithm.adv_estimator=spin", "trainer.ref_update_freq=2", "trainer.save_freq=3"], "not a multiple"),
    (["algorithm.adv_estimator=spin", "trainer.ref_update_freq=0"], "ref_update_freq=0"),
    (["algorithm.adv_estimator=spin", "trainer.ref_update_freq=1", "actor_rollout_ref.model.lora_rank=8"],
     "with LoRA"),
])
def test_what_does_not_hang_together_is_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        validate_config(config(*extra))
