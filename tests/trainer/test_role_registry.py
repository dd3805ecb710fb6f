"""Roles as data (`hyflow.trainer.role_registry`): the registry's entries, `Roles` as a mapping, the specs derived
once for every role (`hyflow.config.roles.role_specs`), and the checkpointed roles read from the registry."""

from __future__ import annotations

import dataclasses

import pytest

from hyflow.config import load_config
from hyflow.config.roles import actor_loss_terms, role_specs
from hyflow.controller import Dispatch, Worker, register
from hyflow.specs import (
    DistillationLossSpec,
    JudgeSpec,
    PairPreferenceSpec,
    PRMSpec,
    RewardModelSpec,
    RoleSpecs,
)
from hyflow.trainer.role_checkpoints import role_states
from hyflow.trainer.role_registry import ROLES, RoleDefinition
from hyflow.trainer.roles import Roles, build_roles
from hyflow.workers.train_engine import EngineCheckpoints

BASE = ["actor_rollout_ref.model.path=m", "trainer.device=cpu", "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2"]


def test_every_entry_names_a_worker_a_spec_field_and_a_checkpoint_section_that_exist():
    spec_fields = {f.name for f in dataclasses.fields(RoleSpecs)}
    cfg = load_config(BASE)
    for name, definition in ROLES.items():
        assert definition.name == name and issubclass(definition.worker, Worker)
        assert definition.spec in spec_fields, name
        assert definition.placement in ("colocated", "rollout_pool")
        if definition.checkpoint is not None:  # a trained role: its engine's state is what checkpoints hold
            assert issubclass(definition.worker, EngineCheckpoints)
            section = cfg
            for part in definition.checkpoint.split("."):
                section = getattr(section, part)
            assert section.checkpoint.save_contents
    assert [n for n, d in ROLES.items() if d.checkpoint] == ["actor", "critic", "prm"]


@pytest.mark.parametrize("extra, present", [
    (("algorithm.adv_estimator=grpo",), {"actor"}),
    (("algorithm.adv_estimator=gae",), {"actor", "critic"}),
    (("algorithm.adv_estimator=grpo", "reward_model.enable=true", "reward_model.model.path=rm"),
     {"actor", "reward_model"}),
    (("algorithm.adv_estimator=prime", "reward_model.enable=true"), {"actor", "prm"}),
])
def test_role_specs_derive_every_role_of_the_run_once(extra, present):
    specs = role_specs(load_config([*BASE, *extra]), n_devices=1, total_steps=3)
    got = {f.name for f in dataclasses.fields(specs) if f.name not in ("batches", "rollout")
           and getattr(specs, f.name) is not None}
    assert got == present
    if "prm" in present:
        assert isinstance(specs.prm, PRMSpec) and specs.prm.engine.total_optimizer_steps >= 3
    if "reward_model" in present:
        assert isinstance(specs.reward_model, RewardModelSpec)


def test_a_judge_or_a_classifier_behind_an_engine_is_the_models_call():
    """reward_model.rollout.name serves a judge or a classifier (the model's architecture decides): the slot stays
    empty until the caller says which."""
    cfg = load_config([*BASE, "reward_model.enable=true", "reward_model.model.path=rm", "reward_model.rollout.name=hf"])
    unknown = role_specs(cfg, n_devices=1)
    assert unknown.judge is None and unknown.reward_model is None
    assert isinstance(role_specs(cfg, n_devices=1, judge=True).judge, JudgeSpec)
    assert isinstance(role_specs(cfg, n_devices=1, judge=False).reward_model, RewardModelSpec)


@pytest.mark.parametrize("knobs, terms", [
    ({}, ("policy",)),
    ({"entropy_coeff": 0.01, "use_kl_loss": True}, ("policy", "entropy", "kl")),
    ({"pair_preference": PairPreferenceSpec(), "use_kl_loss": True}, ("pair_preference", "kl")),
    ({"distillation": DistillationLossSpec()}, ("policy", "distillation")),
    ({"distillation": DistillationLossSpec(use_task_rewards=False)}, ("distillation",)),
    ({"distillation": DistillationLossSpec(use_task_rewards=False, use_policy_gradient=True), "entropy_coeff": 0.1},
     ("policy", "entropy", "distillation")),
])
def test_the_actor_loss_terms_the_spec_names(knobs, terms):
    args = {"entropy_coeff": 0.0, "use_kl_loss": False, "distillation": None, "pair_preference": None, **knobs}
    assert actor_loss_terms(**args) == terms


def test_the_spec_names_the_actor_loss_terms_from_the_config():
    loss = role_specs(load_config([*BASE, "actor_rollout_ref.actor.use_kl_loss=true",
                                   "actor_rollout_ref.actor.entropy_coeff=0.01"]), n_devices=1).actor.loss
    assert loss.terms == ("policy", "entropy", "kl")
    assert loss.term_knobs()["kl"] == {"kl_loss_coef": loss.kl_loss_coef, "kl_loss_type": loss.kl_loss_type}


def test_roles_is_a_mapping_with_attribute_access():
    roles = Roles()
    roles.views["actor"] = "actor view"
    assert roles["actor"] == roles.actor == "actor view" and list(roles) == ["actor"] and len(roles) == 1
    assert roles.critic is None and roles.rollout is None and "critic" not in roles  # registered, not in this run
    with pytest.raises(AttributeError, match="no role or attribute 'critc'"):
        roles.critc  # noqa: B018


def test_the_checkpointed_roles_are_the_registrys_with_state_in_its_order():
    cfg = load_config([*BASE, "critic.checkpoint.save_contents=[model]"])
    roles = Roles()
    for name in ("prm", "teacher", "critic", "actor"):
        roles.views[name] = f"{name} view"
    roles.definitions = {name: ROLES[name] for name in ROLES if name in roles.views}
    states = role_states(roles, cfg)
    assert list(states) == ["actor", "critic", "prm"]  # the teacher holds no training state
    assert states["critic"].group == "critic view" and states["critic"].save_contents == ("model",)
    assert states["prm"].save_contents == tuple(cfg.actor_rollout_ref.actor.checkpoint.save_contents)


class ProbeWorker(Worker):
    """A role added by one registry entry: it receives its spec and loads with the others."""

    def __init__(self, spec, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec, self.loaded = spec, False

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        self.loaded = True


def test_a_new_role_is_one_registry_entry(tiny_model_dir, tiny_tokenizer, monkeypatch):
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", *BASE[1:], "algorithm.adv_estimator=gae"])
    specs = role_specs(cfg, n_devices=1)
    monkeypatch.setitem(ROLES, "probe", RoleDefinition("probe", ProbeWorker, spec="critic"))
    roles = build_roles(cfg, specs, executor="local", tokenizer=tiny_tokenizer)
    try:
        assert list(roles) == ["actor", "critic", "probe"]
        probe = roles.workers.workers[0].roles["probe"]  # colocated with the actor, its spec handed over
        assert probe.spec is specs.critic and probe.loaded
    finally:
        roles.shutdown()
