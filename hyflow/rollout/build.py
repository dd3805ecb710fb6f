"""Building a rank's rollout: the engine and the agent loop over it, from the rollout's spec, in one place.

`build_rollout(spec, tokenizer, device=..., module=...)` resolves what every engine needs (the EOS ids of the
tokenizer and the model's generation config, the pad id), builds the engine registered as the rollout's name
(`make_engine`) and the agent loop over it with the tools and interactions of `rollout.multi_turn`, and returns
both as a `Rollout`. Workers call it and nothing else: they never branch on engine names. What differs between
engines is data on the engine class (`capabilities`, `hyflow.rollout.base.EngineCapabilities`): `loads_model` (the engine loads `model.path` itself and receives the
trainer's weights through `update_weights`, as `vllm` does) or not (`hf` generates with a torch module: the
trainer's own, or a copy of it), which `engine_loads_model(name)` reads for a worker that has no trainer module.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyflow.rollout.base import EngineSpec, RolloutEngine, engine_capabilities, make_engine
from hyflow.rollout.manager import AgentLoopManager


@dataclass
class Rollout:
    """A rank's rollout: the engine and the agent loop that drives it."""

    engine: RolloutEngine
    agent_loops: AgentLoopManager


def eos_token_ids(tokenizer, model=None) -> list[int]:
    """The tokenizer's EOS id plus the model's generation-config EOS id(s)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
    return sorted(ids)


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def engine_loads_model(name: str) -> bool:
    """Whether the engine registered as `name` loads the model path itself (else it needs a torch module)."""
    return engine_capabilities(name).loads_model


def build_agent_loops(spec, tokenizer, engine, eos_ids: list[int]) -> AgentLoopManager:
    """The agent loop over `engine`, with the tools and interactions of the rollout section's multi_turn (each
    worker loads its own instances, as each of verl's agent-loop workers does). `spec`: a `RolloutSpec`."""
    rollout = spec.section
    mt = rollout.multi_turn
    tools = interactions = None
    if mt.tool_config_path:
        from hyflow.tools import load_tools

        tools = load_tools(mt.tool_config_path)
    if mt.interaction_config_path:
        from hyflow.interactions import load_interactions

        interactions = load_interactions(mt.interaction_config_path)
    processor = None
    if tools:  # a vision-language policy's tools may return images: the loop processes them as the data's
        from hyflow.models.loading import load_vision_processor

        processor = load_vision_processor(spec.model.path, tokenizer, image_kwargs=dict(spec.image_kwargs),
                                          trust_remote_code=spec.model.trust_remote_code)
    return AgentLoopManager(engine, tokenizer, rollout, eos_token_ids=eos_ids, pad_token_id=pad_token_id(tokenizer),
                            tools=tools, interactions=interactions,
                            chat_template_kwargs=dict(spec.chat_template_kwargs), processor=processor)


def build_rollout(spec, tokenizer, *, device, module=None, share_module: bool = False, rank: int = 0,
                  world_size: int = 1, engine: str | None = None) -> Rollout:
    """The engine (`engine`, default the rollout's name) and its agent loop for one rank, from a `RolloutSpec`.

    `module`: the trainer's policy module, for engines that generate with it (`share_module`: generate with that
    very module, zero copy; else a copy) and for the EOS ids of its generation config."""
    eos = eos_token_ids(tokenizer, module)
    engine_spec = EngineSpec(model_path=spec.model.path, device=device, rollout=spec.section, eos_token_ids=eos,
                             pad_token_id=pad_token_id(tokenizer), module=module, share_module=share_module,
                             trust_remote_code=spec.model.trust_remote_code, rank=rank, world_size=world_size)
    built = make_engine(engine or spec.section.name, engine_spec)
    return Rollout(built, build_agent_loops(spec, tokenizer, built, eos))
