"""The generative reward model's worker: a judge model on an engine of its own (hf or vllm) answers prompts.

`generate(prompts, params)` is the rollout engine's call (`hyflow.rollout.base`), split over the worker group
(data parallel), so the worker group itself is what `hyflow.rewards.judge.engine_generate` adapts: the trainer's
`JudgeRewardManager` renders each sample into the judge's prompt, this worker generates, the manager parses the
scores. Placement (`hyflow.trainer.roles`): in the actor's processes, or with `reward_model.enable_resource_pool`
on devices of its own; every worker holds the whole judge.
"""

from __future__ import annotations

from hyflow.batch import Batch
from hyflow.controller import Dispatch, Worker, register
from hyflow.rollout.base import SamplingParams
from hyflow.specs import JudgeSpec
from hyflow.workers.teacher import serve_model
from hyflow.workers.train_engine import resolve_device


class JudgeWorker(Worker):
    """A frozen judge model on one device, answering this rank's share of the judge prompts."""

    def __init__(self, spec: JudgeSpec, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.model_device = resolve_device(spec.device, self.local_rank)
        self.engine = None

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """Load the judge into its engine."""
        spec = self.spec
        self.engine = serve_model(spec.engine, spec.model, device=self.model_device, dtype=spec.dtype,
                                  max_num_seqs=spec.max_num_seqs, rollout=spec.rollout, overrides=spec.overrides)

    @register(Dispatch.DP_SPLIT)
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """The judge's answers to this rank's left-padded prompts (the engine's `generate`)."""
        return self.engine.generate(prompts, params)
