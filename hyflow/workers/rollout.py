"""The rollout side of asynchronous training (`async_training.mode`): a `RolloutStream` on a worker.

- `RolloutStreamHost`: the worker methods the trainer's scheduler calls — `stream_start`, `stream_submit`,
  `stream_advance`, `stream_close` — over this rank's stream engine. With several rollout ranks each keeps the
  prompts whose tag is its rank modulo the world size, and advances until its share of the wanted prompts is
  finished (so the split never depends on timing).
- `RolloutWorker`: a rollout-only worker (tokenizer, one engine, the agent loop; no optimizer, no reference),
  built from a `RolloutSpec`, for the rollout pool of its own (`rollout.n_gpus_per_node` > 0). It receives the
  trainer's weights through `stream_load_weights(buckets, version)`: all of them or none (`update_weights`).
Both build their engine and agent loop with `hyflow.rollout.build.build_rollout` (shared with the colocated actor
worker).
"""

from __future__ import annotations

import dataclasses
import math
import time

from hyflow.batch import Batch
from hyflow.controller import Dispatch, Worker, register
from hyflow.models.loading import load_causal_lm, load_tokenizer
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.build import build_rollout, engine_loads_model
from hyflow.rollout.stream import RolloutStream
from hyflow.specs import RolloutSpec
from hyflow.workers.train_engine import resolve_device


class RolloutStreamHost:
    """Stream methods for a worker that has `self.stream_manager` (an AgentLoopManager over the stream's engine),
    `self.rank` and `self.world_size`."""

    stream: RolloutStream | None = None

    @register(Dispatch.REPLICATE)
    def stream_start(self, params: SamplingParams, chunk_tokens: int, prompt_width: int) -> None:
        """Start an empty stream (rank r samples with seed + 1_000_003 * r, as `generate_sequences` does)."""
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + 1_000_003 * self.rank)
        if self.stream is not None:
            self.stream.close()
        self.stream = RolloutStream(self.stream_manager, params, chunk_tokens=chunk_tokens, prompt_width=prompt_width)

    @register(Dispatch.REPLICATE)
    def stream_submit(self, prompts: Batch, tags: list[int]) -> None:
        """Admit this rank's prompts of `prompts` (those whose tag is the rank modulo the world size)."""
        mine = [i for i, tag in enumerate(tags) if int(tag) % self.world_size == self.rank]
        if mine:
            self.stream.submit(prompts[mine], [int(tags[i]) for i in mine])

    @register(Dispatch.REPLICATE)
    def stream_advance(self, need: int) -> tuple[Batch | None, float]:
        """Decode until this rank's share of `need` prompts (ceil(need / world size)) is finished or nothing is in
        flight here; returns (the finished samples or None, seconds spent)."""
        start = time.perf_counter()
        batch = self.stream.advance(math.ceil(need / self.world_size))
        return batch, time.perf_counter() - start

    @register(Dispatch.REPLICATE)
    def stream_close(self) -> None:
        """Cancel what is in flight and stop the stream's event loop and tool threads."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None


class RolloutWorker(RolloutStreamHost, Worker):
    """A rollout-only worker on a device of the rollout pool (see the module docstring)."""

    def __init__(self, spec: RolloutSpec, tokenizer=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.tokenizer = tokenizer
        self.model_device = resolve_device(spec.device, self.local_rank)

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """Load the tokenizer and the engine (hf: the model on this device; vllm: loads the path itself)."""
        model_spec, rollout = self.spec.model, self.spec.section
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(model_spec.tokenizer_path or model_spec.path,
                                            trust_remote_code=model_spec.trust_remote_code,
                                            chat_template=model_spec.custom_chat_template)
        model = None
        if not engine_loads_model(rollout.name):  # the engine generates with a module: this worker's own copy
            model = load_causal_lm(model_spec.path, dtype="float32", trust_remote_code=model_spec.trust_remote_code,
                                   override_config=dict(model_spec.override_config), device=self.model_device)
            model.requires_grad_(False)
        built = build_rollout(self.spec, self.tokenizer, device=self.model_device, module=model, share_module=True,
                              rank=self.rank, world_size=self.world_size)
        self.engine, self.stream_manager = built.engine, built.agent_loops
        self.engine.shares_weights = False  # its own module: the trainer's weights arrive via update_weights

    @register(Dispatch.REPLICATE)
    def stream_load_weights(self, buckets: list, version: int) -> float:
        """Load the trainer's weights (all buckets or none) and tag what is decoded from now on with `version`;
        returns seconds spent."""
        start = time.perf_counter()
        self.engine.wake()
        self.engine.update_weights(buckets)
        if self.stream is not None:
            self.stream.set_version(version)
        return time.perf_counter() - start
