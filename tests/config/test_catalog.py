"""The config layer learns the registered algorithms through a catalog the package root provides."""

import pytest

from hyflow.config import ConfigError, load_config, uses_critic, validate_config
from hyflow.config import catalog as catalog_mod


def test_the_package_root_installs_a_catalog_of_the_registries():
    catalog = catalog_mod.algorithm_catalog()
    assert catalog is not None
    assert "values" in catalog.estimator_requires("gae") and "index" in catalog.estimator_requires("grpo")
    assert {"vanilla", "gspo", "cispo"} <= catalog.policy_losses


def test_an_estimator_registered_later_is_known_with_what_it_requires():
    from hyflow.algos.registry import ADVANTAGE_ESTIMATORS, register_advantage_estimator

    @register_advantage_estimator("test_catalog_needs_values", requires=("values",))
    def _estimator(**kwargs):
        raise NotImplementedError

    try:
        cfg = load_config(["algorithm.adv_estimator=test_catalog_needs_values"])
        assert uses_critic(cfg)
        validate_config(cfg)
    finally:
        del ADVANTAGE_ESTIMATORS["test_catalog_needs_values"]
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='test_catalog_needs_values' is not one of"):
        validate_config(cfg)


def test_without_a_provider_names_are_not_checked_and_null_means_no_critic(monkeypatch):
    monkeypatch.setattr(catalog_mod, "_provider", None)
    cfg = load_config(["algorithm.adv_estimator=gae"])
    assert not uses_critic(cfg)
    validate_config(load_config(["algorithm.adv_estimator=not_registered_anywhere", "actor_rollout_ref.rollout.n=4"]))
