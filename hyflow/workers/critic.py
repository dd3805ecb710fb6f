"""The critic worker: a value model V(s_t) for every response token, trained with the clipped value loss.

`compute_values` reads values at the positions before each response token; `update_critic` makes
`critic.ppo_epochs` passes in mini-batches (same units as the actor: prompts x n samples), micro-batched, with
the loss normalised over the whole mini-batch on all ranks (micro-batch and DP invariant), like the actor.

Several ranks (`critic.strategy` fsdp/fsdp2 = FSDP2, ddp = DistributedDataParallel; `hyflow.workers.fsdp`):
`init_model` joins the process group and shards the value model; metrics are all-reduced so every rank reports
the global values; `state_dict` (collective) returns rank 0's full state dicts, `load_state_dict` loads them
into any world size, `save_sharded_checkpoint` / `load_sharded_checkpoint` use per-rank DCP shards.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hyflow.algos import compute_value_loss, loss_normalisers, masked_mean
from hyflow.batch import Batch
from hyflow.config import HyflowConfig
from hyflow.config.arithmetic import batch_arithmetic
from hyflow.controller import Dispatch, Worker, register
from hyflow.models.forward import values_from_model
from hyflow.models.loading import load_value_model
from hyflow.workers.actor import autocast, resolve_device
from hyflow.workers.engine import (
    all_reduce_sum,
    apply_full_determinism,
    build_optimizer,
    build_scheduler,
    finish_mini_batch,
    micro_batches_as_derived,
    mini_batches,
    pad_response,
    trim_padding,
)
from hyflow.workers.fsdp import (
    TrainingStateCheckpoints,
    maybe_init_distributed,
    parallel_strategy,
    wrap_model,
)


class CriticWorker(TrainingStateCheckpoints, Worker):
    """Value model training and inference on one device (one rank of a data-parallel group)."""

    checkpoint_prefix = "critic"

    def __init__(self, config: HyflowConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        self.config = config
        self.critic = config.critic
        self.model_device = resolve_device(config.trainer.device, self.local_rank)

    @register(Dispatch.REPLICATE)
    def init_model(self, total_training_steps: int) -> None:
        """Load the value model (fresh value head when the checkpoint has none), optimizer and schedule.

        With several ranks: join the process group and shard (FSDP2) or wrap (DDP) the model first.
        """
        model_cfg = self.critic.model
        path = model_cfg.path or self.config.actor_rollout_ref.model.path
        self.batches = batch_arithmetic(self.config)  # what `hyflow config` prints: micro-batch sizes of each pass
        self.strategy = parallel_strategy(self.critic.strategy, self.world_size)
        apply_full_determinism(model_cfg.fsdp_config.full_determinism)
        maybe_init_distributed(self)
        torch.manual_seed(self.config.trainer.seed + 1)  # the same fresh value head on every rank
        model = load_value_model(path, dtype="float32", trust_remote_code=model_cfg.trust_remote_code,
                                 override_config=dict(model_cfg.override_config or {}),
                                 enable_gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
                                 device=self.model_device, config_key="critic.model.path")
        self.model = wrap_model(model, self.strategy, model_cfg.fsdp_config)
        mini_batches_per_step = max(1, self.config.data.train_batch_size // self.critic.ppo_mini_batch_size)
        self.optimizer = build_optimizer(self.model.parameters(), self.critic.optim)
        self.scheduler = build_scheduler(self.optimizer, self.critic.optim,
                                         total_training_steps * self.critic.ppo_epochs * mini_batches_per_step)

    def _micro_batches(self, batch: Batch, *, training: bool):
        """Micro-batches of an update (`critic.ppo_*`) or of a values pass (`critic.forward_*`), as derived by
        `batch_arithmetic` (what `hyflow config` prints)."""
        return micro_batches_as_derived(batch, self.batches.critic if training else self.batches.critic_values)

    def _values(self, micro: Batch, R: int) -> tuple[torch.Tensor, int]:
        seq, r = trim_padding(micro, R)
        seq = {k: v.to(self.model_device) for k, v in seq.items()}
        with autocast(self.model_device, self.critic.model.fsdp_config.dtype):
            values = values_from_model(self.model, seq["input_ids"], seq["attention_mask"], seq["position_ids"], r)
        return values, r

    @register(Dispatch.DP_SPLIT)
    def compute_values(self, batch: Batch) -> Batch:
        """`values` [N, R] (0 on masked tokens)."""
        R = batch["responses"].shape[1]
        values = torch.zeros(len(batch), R)
        self.model.eval()
        with torch.no_grad():
            for micro, rows in self._micro_batches(batch, training=False):
                v, _ = self._values(micro, R)
                values[rows] = pad_response(v.float().cpu(), R)
        return Batch({"values": values * batch["response_mask"]})

    @register(Dispatch.DP_SPLIT, pad=False)
    def update_critic(self, batch: Batch) -> Batch:
        """Clipped value regression onto `returns`; a row-less Batch carrying `critic/*` metrics."""
        c = self.critic
        R = batch["responses"].shape[1]
        mini_size = max(1, c.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n // self.world_size)
        metrics: dict[str, list[float]] = {}
        self.model.train()
        seed = int(batch.meta.get("global_step", 0)) * 7919 + 17
        for _, mini in mini_batches(batch, mini_size, epochs=c.ppo_epochs, shuffle=c.shuffle, seed=seed):
            norms = all_reduce_sum(loss_normalisers(mini["response_mask"], c.loss_agg_mode))
            global_tokens = max(float(norms["global_token_count"]), 1.0)
            sums: defaultdict[str, float] = defaultdict(float)  # this rank's parts of the global values
            for micro, _ in self._micro_batches(mini, training=True):
                vpreds, r = self._values(micro, R)
                cols = {k: micro[k][:, :r].to(self.model_device) for k in ("returns", "values", "response_mask")}
                mask = cols["response_mask"].float()
                loss, loss_metrics = compute_value_loss(vpreds, cols["returns"], cols["values"], mask,
                                                        cliprange_value=c.cliprange_value,
                                                        loss_agg_mode=c.loss_agg_mode, **norms)
                (loss * self.world_size).backward()  # DDP/FSDP average gradients; the loss is a global sum
                weight = float(mask.sum()) / global_tokens
                sums["critic/vf_loss"] += float(loss.detach())
                sums["critic/vf_clipfrac"] += float(loss_metrics["vf_clipfrac"]) * weight
                sums["critic/vpred_mean"] += float(masked_mean(vpreds.detach(), mask)) * weight
            finish_mini_batch(metrics, sums, self.model, self.optimizer, self.scheduler, c.grad_clip, "critic")
        return Batch(meta={"metrics": metrics})
