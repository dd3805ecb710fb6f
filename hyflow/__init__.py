"""hyflow: reinforcement-learning post-training for large language models.

One driver process owns the dataflow (generate -> reward -> log-probs -> advantages -> update); workers own
the models. The same code runs in one plain Python process or on a Ray cluster. See docs/architecture.md (and
the README's Layout section) for the map.
"""

from hyflow.threads import quiet_openmp_waits as _quiet_openmp_waits

_quiet_openmp_waits()  # OMP_WAIT_POLICY=PASSIVE unless set, before anything imports torch (see hyflow/threads.py)

from hyflow.version import SOURCE_VERSION as _SOURCE_VERSION  # noqa: E402, F401 (tests/test_packaging.py)
from hyflow.version import distribution_version as _distribution_version  # noqa: E402


def _algorithm_catalog():
    """The config layer's view of `hyflow.algos`' registries (see hyflow/config/catalog.py)."""
    import hyflow.algos  # noqa: F401  (importing the package registers the built-in functions)
    from hyflow.algos.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from hyflow.config.catalog import AlgorithmCatalog

    return AlgorithmCatalog(
        advantage_estimators={name: frozenset(getattr(fn, "requires", ())) for name, fn in ADVANTAGE_ESTIMATORS.items()},
        policy_losses=frozenset(POLICY_LOSSES),
    )


def _component_catalog():
    """The config layer's view of the logger, reward-manager and rollout-engine registries."""
    from hyflow.config.catalog import ComponentCatalog
    from hyflow.rewards.managers import REWARD_MANAGERS
    from hyflow.rollout import base as engines
    from hyflow.rollout.tool_parser import ToolParser
    from hyflow.trainer.tracking import logger_packages

    missing, capabilities = {}, {}
    for name in engines.engine_names():
        capabilities[name] = engines.engine_capabilities(name)
        if capabilities[name].requires is not None and engines.missing_requirement(name) is not None:
            missing[name] = capabilities[name].requires[1:]
    return ComponentCatalog(loggers=logger_packages(), reward_managers=frozenset(REWARD_MANAGERS),
                            rollout_engines=frozenset(capabilities), missing_engine_packages=missing,
                            engines_not_built=dict(engines.ENGINES_NOT_BUILT), engine_capabilities=capabilities,
                            tool_formats=frozenset(ToolParser.registry))


def _install_catalog() -> None:
    # The package root sits above both layers, so it is the one place allowed to connect config and algos.
    from hyflow.config.catalog import set_catalog_provider, set_component_provider

    set_catalog_provider(_algorithm_catalog)
    set_component_provider(_component_catalog)


_install_catalog()

__all__ = ["RLTrainer", "SFTTrainer", "load_config"]


def __getattr__(name: str):
    # Lazy: `import hyflow` stays cheap (the config layer only, no torch); the trainers pull in torch and
    # transformers on first use, `__version__` importlib.metadata (20-40 ms) on first use.
    if name == "__version__":
        globals()["__version__"] = version = _distribution_version()
        return version
    if name == "RLTrainer":
        from hyflow.trainer.rl_trainer import RLTrainer

        return RLTrainer
    if name == "SFTTrainer":
        from hyflow.trainer.sft_trainer import SFTTrainer

        return SFTTrainer
    if name == "load_config":
        from hyflow.config import load_config

        return load_config
    raise AttributeError(f"module 'hyflow' has no attribute {name!r}")
