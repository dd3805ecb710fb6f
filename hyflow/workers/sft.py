"""The SFT worker: one rank of supervised fine-tuning, training a causal LM through a `TrainEngine`.

An SFT batch is right-padded conversations (`input_ids`, `attention_mask`, `position_ids`, `loss_mask` [B, L];
`hyflow.data.sft_dataset`). The engine scores a response span, the last R columns; for SFT that span is every
column but the first (R = L - 1):

    responses     = input_ids[:, 1:]        target x[b, t] of column t, predicted from the hidden state at t - 1
    response_mask = loss_mask[:, 1:]        m[b, t] = 1 on trained tokens (assistant turns and their end token)

which is exactly the shift of next-token cross entropy. The loss of a micro-batch is its sum of -log p over the
trained tokens divided by N, the trained tokens of the whole step on all ranks (`agg_loss(..., token-mean)` with
the engine's global normalisers), so the gradients summed over micro-batches and ranks are the gradient of

    L = -(1 / N) * sum_{b,t: m[b,t] = 1} log p(x[b,t] | x[b,<t])

whatever the micro-batch size, token budget or number of ranks. `train_step` (this rank's share of the step's
samples: one epoch, one mini-batch, no shuffle) returns train/loss = L, train/lr and train/grad_norm, all global
(the engine all-reduces them), so every rank returns the same numbers.

Several ranks (`engine.strategy` fsdp/fsdp2 = FSDP2, ddp; `hyflow.workers.fsdp`): `init_model` joins the process
group and shards the model; `state_dict` (collective) returns rank 0's full components `model`, `optimizer`,
`scheduler` (the names of a one-process SFT checkpoint, so `hyflow export --component model` reads them), and
`load_state_dict` loads them into any world size.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from hyflow.algos import agg_loss
from hyflow.batch import Batch
from hyflow.controller import Collect, Dispatch, Worker, register
from hyflow.models.loading import load_causal_lm
from hyflow.specs import SFTSpec
from hyflow.workers.engine import all_reduce_metrics
from hyflow.workers.fsdp import maybe_init_distributed
from hyflow.workers.train_engine import (
    EngineCheckpoints,
    MicroContext,
    TrainEngine,
    UpdatePlan,
    resolve_device,
)

SFT_COLUMNS = ("response_mask",)


def as_engine_batch(batch: Batch) -> Batch:
    """The engine's layout of an SFT batch: the response span is the last L - 1 columns (module docstring)."""
    images = ({"multi_modal_inputs": batch["multi_modal_inputs"]}  # a vision-language model's images
              if "multi_modal_inputs" in batch.non_tensors else None)
    return Batch({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "position_ids": batch["position_ids"], "responses": batch["input_ids"][:, 1:],
                  "response_mask": batch["loss_mask"][:, 1:]}, images)


def sft_loss(out: dict, cols: dict, ctx: MicroContext) -> tuple[torch.Tensor, dict]:
    """This micro-batch's sum of -log p over its trained tokens / the step's trained tokens on all ranks."""
    loss = agg_loss(-out["log_probs"], cols["response_mask"].float(), loss_agg_mode="token-mean", **ctx.norms)
    return loss, {"train/loss": float(loss.detach())}


class SFTWorker(EngineCheckpoints, Worker):
    """Causal-LM fine-tuning on one device (one rank of a data-parallel group).

    `spec`: the run's `SFTSpec` (the SFT trainer derives it); `model`: a model object to train instead of loading
    `model.partial_pretrain` (one in-process worker only: the `local` executor)."""

    MESHES: ClassVar[dict[str, str]] = {"sft": "engine"}

    def __init__(self, spec: SFTSpec, model: torch.nn.Module | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.given_model = model
        self.model_device = resolve_device(spec.engine.device, self.local_rank)

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """Load the model into a TrainEngine with the spec's optimizer and the LR schedule over its optimizer
        steps; the micro-batch sizes are the spec's (the batch arithmetic the trainer prints). With several ranks:
        join the process group, then shard (FSDP2) or wrap (DDP) the model."""
        spec = self.spec
        maybe_init_distributed(self)
        torch.manual_seed(spec.seed)
        model, self.given_model = self.given_model, None
        if model is None:
            m = spec.model
            model = load_causal_lm(m.path, dtype="float32", trust_remote_code=m.trust_remote_code,
                                   override_config=dict(m.override_config), config_key=m.config_key,
                                   enable_gradient_checkpointing=m.enable_gradient_checkpointing,
                                   device=self.model_device)
        model = model.to(self.model_device)
        # What a checkpoint needs to rebuild the model (hf_config/), read before the engine wraps it.
        self.hf_config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.engine = TrainEngine.from_spec(model, spec.engine, device=self.model_device, world_size=self.world_size)
        if self.rank == 0:
            print(self.engine.describe_parameters(), flush=True)

    @register(Dispatch.RANK_ZERO)
    def model_configs(self) -> tuple:
        """(the model's Hugging Face config, its generation config or None), for the checkpoint's hf_config/."""
        return self.hf_config, self.generation_config

    @register(Dispatch.DP_SPLIT, collect=Collect.FIRST, pad=False, mesh="sft")
    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on the step's samples (this rank gets its share): train/loss, train/lr,
        train/grad_norm, the same on every rank."""
        # one mini-batch: this rank's data-parallel share (a sequence-parallel group's ranks all receive the group's)
        plan = UpdatePlan(mini_batch_size=len(batch), epochs=1, shuffle=False, seed=0,
                          sizes=self.spec.batches,
                          loss_agg_mode="token-mean", metric_prefix="train")
        with self.engine.on_device(optimizer=True):  # engine.param_offload / optimizer_offload: in for the step
            metrics = self.engine.update(as_engine_batch(batch), plan, sft_loss, columns=SFT_COLUMNS)
        return {key: metrics[key][0] for key in ("train/loss", "train/lr", "train/grad_norm")}

    @register(Dispatch.DP_SPLIT, collect=Collect.FIRST, pad=False, mesh="sft")
    def validate(self, batch: Batch) -> dict[str, float]:
        """{"nll": sum of -log p over the trained tokens of `batch`, "tokens": their number}, summed over the
        ranks (the same on every rank). Rows without trained tokens (padding) add nothing."""
        data = as_engine_batch(batch)
        with self.engine.on_device():
            log_probs = self.engine.infer(data, self.spec.batches)["log_probs"]
        counted = self.engine.group_rank == 0  # a sequence-parallel group's rows count once
        return all_reduce_metrics({"nll": -float(log_probs.double().sum()) if counted else 0.0,
                                   "tokens": float(data["response_mask"].sum()) if counted else 0.0})
