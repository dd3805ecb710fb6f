"""The critic worker: a value model V(s_t) for every response token, trained with the clipped value loss.

`compute_values` reads values at the positions before each response token; `update_critic` makes
`critic.ppo_epochs` passes in mini-batches (same units as the actor: prompts x n samples), micro-batched, with
the loss normalised over the whole mini-batch on all ranks (micro-batch and DP invariant), like the actor.

Several ranks (`critic.strategy` fsdp/fsdp2 = FSDP2, ddp = DistributedDataParallel; `hyflow.workers.fsdp`):
`init_model` joins the process group and shards the value model; metrics are all-reduced so every rank reports
the global values; `state_dict` (collective) returns rank 0's full state dicts, `load_state_dict` loads them
into any world size, `save_sharded_checkpoint` / `load_sharded_checkpoint` use per-rank DCP shards.

Offload (verl's `critic.model.fsdp_config.param_offload` / `optimizer_offload`): the value model's parameters (and
its optimizer state) live in host memory between uses; `compute_values` brings the parameters to the device,
`update_critic` both, and each sends them back after (`TrainEngine.on_device`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from hyflow.algos import compute_value_loss, masked_mean
from hyflow.batch import Batch
from hyflow.controller import Dispatch, Worker, register
from hyflow.models.loading import load_value_model
from hyflow.specs import CriticSpec
from hyflow.workers.engine import apply_full_determinism
from hyflow.workers.fsdp import maybe_init_distributed
from hyflow.workers.train_engine import (
    EngineCheckpoints,
    TrainEngine,
    UpdatePlan,
    resolve_device,
)

VALUE_COLUMNS = ("returns", "values", "response_mask")


class CriticWorker(EngineCheckpoints, Worker):
    """Value model training and inference on one device (one rank of a data-parallel group), built from the
    role's `CriticSpec` (the config layer's `role_specs` derives it)."""

    MESHES: ClassVar[dict[str, str]] = {"critic": "engine"}

    def __init__(self, spec: CriticSpec, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.model_device = resolve_device(spec.engine.device, self.local_rank)

    def set_progress(self, progress) -> None:
        """In-step progress of the critic's update (a plain callable `progress(stage, done, total, unit, detail)`,
        the trainer's bar; None to stop): its micro-batches. In-process only."""
        if getattr(self, "engine", None) is not None:
            self.engine.progress = progress

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """Load the value model (fresh value head when the checkpoint has none) into a TrainEngine; the LR
        schedule's length and the micro-batch sizes are the spec's (the batch arithmetic printed at start).
        With several ranks: join the process group, then shard (FSDP2) or wrap (DDP) the model."""
        spec = self.spec
        apply_full_determinism(spec.full_determinism)
        maybe_init_distributed(self)
        torch.manual_seed(spec.seed + 1)  # the same fresh value head on every rank
        model = load_value_model(spec.model.path, dtype="float32", trust_remote_code=spec.model.trust_remote_code,
                                 override_config=dict(spec.model.override_config),
                                 enable_gradient_checkpointing=spec.model.enable_gradient_checkpointing,
                                 device=self.model_device, config_key=spec.model.config_key)
        self.engine = TrainEngine.from_spec(model, spec.engine, device=self.model_device, world_size=self.world_size)
        self.model = self.engine.model
        if self.rank == 0:
            print(self.engine.describe_parameters(), flush=True)

    @register(Dispatch.DP_SPLIT, mesh="critic")
    def compute_values(self, batch: Batch) -> Batch:
        """`values` [N, R] (0 on masked tokens), micro-batched as `critic.forward_*` derive."""
        with self.engine.on_device():
            return Batch({"values": self.engine.infer(batch, self.spec.values)["values"]})

    @register(Dispatch.DP_MINI_BATCHES, pad=False, mesh="critic")
    def update_critic(self, batch: Batch) -> Batch:
        """Clipped value regression onto `returns`; a row-less Batch carrying `critic/*` metrics."""
        c = self.spec

        def loss_fn(out: dict, cols: dict, ctx) -> tuple[torch.Tensor, dict]:
            mask = cols["response_mask"].float()
            loss, parts = compute_value_loss(out["values"], cols["returns"], cols["values"], mask,
                                             cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                                             **ctx.norms)
            weight = ctx.token_weight(mask)
            return loss, {"critic/vf_loss": float(loss.detach()),
                          "critic/vf_clipfrac": float(parts["vf_clipfrac"]) * weight,
                          "critic/vpred_mean": float(masked_mean(out["values"].detach(), mask)) * weight}

        sizes = c.batches  # the derived arithmetic: samples of a mini-batch on this device, epochs
        plan = UpdatePlan(mini_batch_size=max(1, int(sizes.samples_per_device)), epochs=sizes.ppo_epochs,
                          shuffle=c.shuffle, sizes=sizes,
                          seed=int(batch.meta.get("global_step", 0)) * 7919 + 17, loss_agg_mode=c.loss_agg_mode,
                          metric_prefix="critic")
        with self.engine.on_device(optimizer=True):
            metrics = self.engine.update(batch, plan, loss_fn, columns=VALUE_COLUMNS)
        return Batch(meta={"metrics": metrics})
