"""The rollout-engine protocol and sampling parameters.

An engine turns prompt token ids into response token ids (never text): `generate(prompts, params) -> Batch`
with verl's keys, `load_weights(named_tensors)` to receive the trainer's weights, `sleep()` / `wake()` to give
memory back while the trainer runs. Engines register by name (`actor_rollout_ref.rollout.name`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from hyflow.batch import Batch


@dataclass
class SamplingParams:
    """How to sample one generation call (verl's rollout / val_kwargs knobs)."""

    n: int = 1  # samples per prompt; outputs are interleaved (p0s0, p0s1, ..., p1s0, ...)
    max_new_tokens: int = 512  # response length limit in tokens (rollout.response_length)
    temperature: float = 1.0  # logits are divided by it; 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass (1.0 = off)
    top_k: int = -1  # keep the k most likely tokens (-1 or 0 = off)
    do_sample: bool = True  # False = greedy (validation default)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # extra stop ids besides the tokenizer's EOS
    calculate_log_probs: bool = True  # return `rollout_log_probs`
    seed: int | None = None  # seeds the sampler; same seed + same weights + same prompts = same samples

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1 (got {self.n}); set actor_rollout_ref.rollout.n")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens}); set data.max_response_length")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generation engine."""

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


def register_engine(name: str) -> Callable:
    """Register an engine factory under `name` (a duplicate name is an error)."""

    def decorator(factory: Callable[..., RolloutEngine]) -> Callable[..., RolloutEngine]:
        if name in ENGINES:
            raise ValueError(f"rollout engine {name!r} is already registered")
        ENGINES[name] = factory
        return factory

    return decorator


def make_engine(name: str, **kwargs) -> RolloutEngine:
    """Build the engine registered as `name` (actor_rollout_ref.rollout.name)."""
    import hyflow.rollout.hf  # noqa: F401  (registers "hf")

    if name not in ENGINES:
        optional = {"vllm": "pip install 'hyflow[vllm]'", "sglang": "pip install sglang"}
        if name in optional:
            raise ValueError(
                f"rollout engine {name!r} is not available in this install ({optional[name]}); "
                "use actor_rollout_ref.rollout.name=hf"
            )
        close = difflib.get_close_matches(name, list(ENGINES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown rollout engine {name!r}.{hint} Known: {', '.join(sorted(ENGINES))}.")
    return ENGINES[name](**kwargs)
