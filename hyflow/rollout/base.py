"""The rollout-engine protocol, sampling parameters, and the one factory that builds an engine by name.

An engine turns prompt token ids into response token ids (never text): a token stream (`open_stream(params)`,
requests in, each output back as it finishes), or a batch decoder (`decode_batch(prompts, params, budgets)`, one
`TokenOutput` per sample; `generate(prompts, params) -> Batch` with verl's keys is `hyflow.rollout.output.
generate_rollout` over it) that one adapter makes a stream (`RolloutEngine` below); `update_weights(buckets)` to receive the trainer's weights after an
update (all or nothing), `sleep()` / `wake()` to give memory back while the trainer runs. `make_engine(name,
EngineSpec(...))` builds the engine registered as `actor_rollout_ref.rollout.name` for one rank from the model
path, device, rollout config and, for `hf`, the trainer's own module. `ENGINES` is a `hyflow.registry.Registry`
whose built-in entries are lazy (`hf`, `vllm`: imported on first use), so importing this module loads no engine
and no vLLM; an engine declares what it can do as data on its class (`EngineCapabilities`), which the config
checks read instead of engine names.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from hyflow.registry import Registry


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


@dataclass
class TokenOutput:
    """One generation: the new token ids, their log-probs (None when not asked for) and why it stopped:
    "stop" (an end-of-sequence or stop token), "length" (the request's budget) or "abort" (ended early)."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str


@dataclass
class TokenRequest:
    """One generation request of the token-level protocol (`engine.open_stream`): a prompt's token ids, at most
    `max_tokens` new tokens, sampled with `seed` (None: unseeded); `request_id` names it for `abort`.
    `multi_modal_inputs` (a vision-language model's prompt): the processed images whose tokens `prompt_ids` hold
    (`pixel_values`, `image_grid_thw`, `hyflow.models.vision`); `multi_modal_data`: the same images as PIL images
    (`{"image": [...]}`, what vLLM takes); `group`: see below."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None = None
    multi_modal_inputs: dict | None = None
    multi_modal_data: dict | None = None
    # requests of one batch call with equal group keys, prompts and budgets share their prompt (a prompt's n first
    # turns); ("prompt", row) names a row of the rollout's prompt batch (`hyflow.rollout.batch_stream`). Streams
    # that schedule requests themselves ignore it.
    group: tuple | None = None


class RolloutEngineError(RuntimeError):
    """An engine could not start, or a weight sync into it failed; the message names the cause and the fix."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generation engine.

    `shares_weights` is True when the engine generates with the trainer's own module (nothing to sync);
    `update_weights(buckets)` receives the trainer's full weights, bucket by bucket, after each update: all of
    them or none (a sync that fails part-way leaves an engine that refuses to generate, never a half-updated
    model); `load_weights(named_tensors)` loads one set of tensors.

    Generation, one of two (`hyflow.rollout.agent_server.TurnServer` speaks only the first):
    the token-level protocol, `open_stream(params) -> stream`, where `stream.submit(TokenRequest)` returns a
    `concurrent.futures.Future` of the request's `TokenOutput` as soon as it finishes, whatever else is running
    (continuous batching), `stream.abort(request_ids)` ends requests early (their futures get the tokens so far,
    stop reason "abort"), and `stream.close()` ends the stream: it serves every `rollout.agent.batching` policy;
    or a batch decoder, `decode_batch(prompts, params, budgets) -> list[TokenOutput]` (left-padded prompt rows,
    one output per sample; `generate(prompts, params) -> Batch` is `hyflow.rollout.output.generate_rollout` over
    it), which the one adapter `hyflow.rollout.batch_stream.BatchTokenStream` turns into a stream for barrier and
    eager (padding inside itself). `hf` and `vllm` have both: barrier and eager use their batch decoder (one seed per call, the samples
    they always gave), continuous their stream. What an engine can do is data on its class: `capabilities`
    (`EngineCapabilities`).

    Optional, scoring (an engine serving a teacher in on-policy distillation): `prompt_log_probs(sequences,
    response_length, topk)` -> `log_probs` [N, R] of the last R tokens of each row, and with `topk` > 0 the
    model's own `topk_log_probs` / `topk_ids` [N, R, K] (`hf`: one forward; `vllm`: prompt log-probs).
    """

    shares_weights: bool

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


@dataclass
class EngineSpec:
    """Everything a factory needs to build an engine for one rank (see `make_engine`).

    `module` is the trainer's own policy module: the `hf` engine generates with it (`share_module=True`: one
    process on CPU, zero copy) or with a copy of it; engines with their own model runtime (`vllm`) load
    `model_path` and receive the trainer's weights through `update_weights`.
    """

    model_path: str | None = None
    device: torch.device | str = "cpu"
    rollout: Any = None  # the `actor_rollout_ref.rollout` config section (RolloutConfig)
    eos_token_ids: Sequence[int] = ()
    pad_token_id: int = 0
    module: torch.nn.Module | None = None
    share_module: bool = False
    trust_remote_code: bool = False
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, declared as data on its class (`capabilities = EngineCapabilities(...)`); the config
    checks and the key-support table read it (through `hyflow.config.catalog`), never the engine's name.

    `streams`: `open_stream` schedules requests itself (continuous batching); `loads_model`: it loads the model
    path itself and receives the trainer's weights through `update_weights` (else it generates with a torch
    module: the trainer's, or a copy, `EngineSpec.module`); `max_tensor_parallel`: the largest
    `tensor_model_parallel_size` it splits a model over (1: one full copy per device, None: any divisor of the
    devices); `stream_max_tensor_parallel`: the same for its stream and multi-turn rollouts (None: no limit);
    `serves_frozen`: it can serve a frozen model (a distillation teacher, a generative judge); `own_image_processor`:
    it processes a vision-language prompt's images with the model's own settings (it cannot take
    `data.mm_processor_kwargs`); `knobs`: the `actor_rollout_ref.rollout` keys it reads beyond the sampling ones
    (`engine_kwargs` included when it takes engine arguments); `requires`: the package it imports, what to install
    on CUDA and on CPU (None: nothing beyond hyflow's own)."""

    streams: bool = False
    loads_model: bool = False
    max_tensor_parallel: int | None = 1
    stream_max_tensor_parallel: int | None = None
    serves_frozen: bool = False
    own_image_processor: bool = False
    knobs: frozenset[str] = frozenset()
    requires: tuple[str, str, str] | None = None


# name -> where the engine lives, imported on first use, so `hyflow.rollout.base` imports no engine (and no vLLM)
# and an engine module may import anything below the rollout layer without a cycle.
ENGINES = Registry("rollout engine", lazy={"hf": "hyflow.rollout.hf:HFRolloutEngine",
                                           "vllm": "hyflow.rollout.vllm:VLLMRolloutEngine"})
# Names verl has that hyflow has not built: a config-time error with the reason.
ENGINES_NOT_BUILT: dict[str, str] = {
    "sglang": "the SGLang engine is not built yet (its PyPI wheels are CUDA-only and its CPU path is a source "
              "build for AMX Xeons); use vllm or hf",
    "trtllm": "the TensorRT-LLM engine is not built yet; use vllm or hf",
}


def register_engine(name: str) -> Callable:
    """Register a builder `EngineSpec -> engine` under `name` (a duplicate name is an error)."""
    return ENGINES.register(name)


def engine_names() -> list[str]:
    """Every engine name this install can build or load (registered, or known lazily by module)."""
    return ENGINES.names()


def engine_capabilities(name: str) -> EngineCapabilities:
    """The capabilities the engine registered as `name` declares (imports its module, never its package)."""
    return getattr(ENGINES.get(name), "capabilities", EngineCapabilities())


def missing_requirement(name: str, device: str = "cpu") -> str | None:
    """What to install for engine `name` on `device` ("cuda" or "cpu"), or None when nothing is missing.

    Found without importing the package (importing vLLM takes seconds).
    """
    import importlib.util

    requires = engine_capabilities(name).requires
    if requires is None:
        return None
    package, on_cuda, on_cpu = requires
    if importlib.util.find_spec(package) is not None:
        return None
    return on_cuda if device == "cuda" else on_cpu


def make_engine(name: str, spec: EngineSpec | None = None, **kwargs) -> RolloutEngine:
    """Build the engine registered as `name` (actor_rollout_ref.rollout.name) for one rank.

    `spec` describes the rank (model path, device, rollout config, token ids, the trainer's module);
    keyword arguments instead go to the engine class directly (`make_engine("hf", model=m, eos_token_id=...)`).
    """
    if name in ENGINES_NOT_BUILT:
        raise ValueError(f"actor_rollout_ref.rollout.name={name}: {ENGINES_NOT_BUILT[name]}")
    device = torch.device(spec.device).type if spec is not None else "cpu"
    needs = missing_requirement(name, device)  # before importing the engine's package (found without importing)
    if needs is not None:
        raise ValueError(f"actor_rollout_ref.rollout.name={name} needs a package that is not installed in "
                         f"this Python ({sys.executable}): {needs}")
    factory = ENGINES.get(name)
    if spec is None:
        return factory(**kwargs)
    if kwargs:
        raise TypeError("make_engine takes either an EngineSpec or keyword arguments, not both")
    builder = getattr(factory, "from_spec", factory)
    return builder(spec)
