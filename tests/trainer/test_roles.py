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


# ------------------------------------------------------------------ what a local Ray cluster can hold, said first


def plan_config(*extra: str):
    return load_config(["actor_rollout_ref.model.path=some/model", "data.train_batch_size=8",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=2",
                        "trainer.executor=ray", *extra])


def test_the_planned_pools_are_the_groups_a_run_starts():
    from hyflow.trainer.roles import planned_pools

    cfg = plan_config("trainer.device=cpu", "trainer.n_gpus_per_node=2", "algorithm.adv_estimator=gae",
                      "critic.enable_resource_pool=true", "critic.n_gpus_per_node=1")
    plans = planned_pools(cfg, role_specs(cfg))
    assert [(p.name, [d.name for d in p.definitions], p.nnodes, p.devices_per_node) for p in plans] == [
        ("HybridWorker", ["actor"], 1, 2), ("CriticWorkerHost", ["critic"], 1, 1)]


@pytest.mark.parametrize(("extra", "ray_init", "message"), [
    (["trainer.device=cpu", "trainer.n_gpus_per_node=4"], {"num_cpus": 2},
     r"the worker groups \(actor \+ critic: 1 x 4\) are 4 worker processes of 1 CPU each, and a local Ray cluster here has 2 "
     r"CPUs \(ray_kwargs.ray_init.num_cpus\); set ray_kwargs.ray_init.num_cpus=4 to run them anyway"),
    (["trainer.device=cpu", "trainer.n_gpus_per_node=2", "algorithm.adv_estimator=gae",
      "critic.enable_resource_pool=true", "critic.n_gpus_per_node=1"], {"num_cpus": 2},
     r"\(actor: 1 x 2; critic: 1 x 1\) are 3 worker processes"),
    (["trainer.device=cuda", "trainer.n_gpus_per_node=8"], {"num_gpus": 2, "num_cpus": 16},
     r"need 8 GPUs \(trainer.device=cuda: one per worker\), and this machine has 2 \(ray_kwargs.ray_init.num_gpus\)"),
    (["trainer.device=cpu", "trainer.nnodes=2"], {},
     r"span 2 nodes, but a local Ray cluster \(ray_kwargs.address unset\) is this one machine"),
])
def test_a_local_cluster_that_cannot_hold_the_workers_is_refused_before_it_starts(extra, ray_init, message):
    from hyflow.trainer.roles import check_local_ray_cluster

    cfg = plan_config(*extra)
    with pytest.raises(ValueError, match=message):
        check_local_ray_cluster(cfg, role_specs(cfg), ray_init)


def test_a_local_cluster_that_holds_the_workers_passes_and_counts_the_machine_without_num_cpus(monkeypatch):
    import ray._private.utils

    from hyflow.trainer.roles import check_local_ray_cluster

    cfg = plan_config("trainer.device=cpu", "trainer.n_gpus_per_node=4")
    check_local_ray_cluster(cfg, role_specs(cfg), {"num_cpus": 4})
    monkeypatch.setattr(ray._private.utils, "get_num_cpus", lambda *a, **k: 3)
    with pytest.raises(ValueError, match=r"has 3 CPUs \(this machine's cores, as Ray counts them\)"):
        check_local_ray_cluster(cfg, role_specs(cfg), {})
    monkeypatch.setattr(ray._private.utils, "get_num_cpus", lambda *a, **k: 4)
    check_local_ray_cluster(cfg, role_specs(cfg), {})
