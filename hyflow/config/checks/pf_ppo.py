"""PF-PPO (algorithm.use_pf_ppo): resampling after GAE, so only with an estimator that reads values."""

from __future__ import annotations

from hyflow.config.catalog import algorithm_catalog
from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig


@check(540, applies=lambda cfg: cfg.algorithm.use_pf_ppo)
def pf_ppo_estimator(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    catalog = algorithm_catalog()
    if catalog is not None and "values" not in catalog.estimator_requires(algo.adv_estimator):
        return [f"algorithm.use_pf_ppo=true with algorithm.adv_estimator={algo.adv_estimator}: PF-PPO "
                "resamples the batch after GAE (verl applies it only there and ignores it otherwise); "
                "use adv_estimator=gae or drop use_pf_ppo"]
    return []
