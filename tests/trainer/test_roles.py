"""build_roles (`hyflow.trainer.roles`): the worker groups of a run's roles, each worker built from its spec."""

from __future__ import annotations

import pytest

from hyflow.config import load_config
from hyflow.config.roles import role_specs
from hyflow.trainer.roles import build_roles, has_rollout_pool


def config(model_dir, *extra: str):
    return load_config([f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "data.train_batch_size=2",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2", *extra])


def test_local_roles_hold_one_colocated_group_whose_workers_got_their_specs(tiny_model_dir, tiny_tokenizer):
    cfg = config(tiny_model_dir, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true")
    specs = role_specs(cfg, n_devices=1, total_steps=3)
    roles = build_roles(cfg, specs, executor="local", tokenizer=tiny_tokenizer)
    try:
        assert len(roles.groups) == 1 and roles.groups[0] is roles.workers and roles.pools == []
        assert roles.reward_model is None and roles.rollout is None
        hosted = roles.workers.workers[0].roles
        assert set(hosted) == {"actor", "critic"}  # colocated: one process per device hosts both
        assert hosted["actor"].spec is specs.actor and hosted["critic"].spec is specs.critic
        assert hosted["actor"].tokenizer is tiny_tokenizer
        # the models were loaded, with the spec's LR-schedule length (3 steps x 1 optimizer step)
        assert hosted["actor"].engine.scheduler is not None and hosted["actor"].ref is not None
        assert hosted["critic"].engine.head == "value"
    finally:
        roles.shutdown()
    assert roles.groups == [] and roles.workers is None


def test_a_failure_while_loading_stops_what_was_started(tiny_model_dir, tiny_tokenizer, monkeypatch):
    from hyflow.controller import Dispatch, register
    from hyflow.controller.group import LocalWorkerGroup
    from hyflow.workers.critic import CriticWorker

    stopped = []
    cfg = config(tiny_model_dir, "algorithm.adv_estimator=gae")

    @register(Dispatch.REPLICATE)  # a worker method is called through its registration
    def fail(self):
        raise RuntimeError("no value model")

    monkeypatch.setattr(CriticWorker, "init_model", fail)
    original = LocalWorkerGroup.shutdown
    monkeypatch.setattr(LocalWorkerGroup, "shutdown", lambda self: (stopped.append(self), original(self)))
    with pytest.raises(Exception, match="no value model"):
        build_roles(cfg, role_specs(cfg, n_devices=1), executor="local", tokenizer=tiny_tokenizer)
    assert len(stopped) == 1


def test_the_rollout_pool_is_for_asynchronous_runs_with_rollout_devices(tiny_model_dir):
    assert not has_rollout_pool(config(tiny_model_dir))
    assert not has_rollout_pool(config(tiny_model_dir, "async_training.mode=one_step_off"))
    assert not has_rollout_pool(config(tiny_model_dir, "rollout.n_gpus_per_node=1"))  # sync: no stream to feed
    assert has_rollout_pool(config(tiny_model_dir, "async_training.mode=one_step_off", "rollout.n_gpus_per_node=1",
                                   "trainer.executor=ray"))
