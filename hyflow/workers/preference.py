"""The preference worker: one rank of offline preference optimisation (`hyflow dpo`), through a `TrainEngine`.

It is the SFT worker (`hyflow.workers.sft`: same model loading, engine, FSDP2/DDP, LoRA, checkpoints) with a
preference loss (`hyflow.algos.preference`) in place of cross entropy. A batch is SFT-layout rows (the response span
is every column but the first; `response_mask` = the completion's tokens), chosen and rejected alternating for
paired losses, so each sequence's summed log-prob is

    log pi(y | x) = sum_t response_mask[t] * log pi(x_t | x_<t).

One step on this rank's share (whole pairs; `hyflow.data.preference_dataset`):

    ref_log_prob = reference pass (no grad)     the frozen copy, or the same engine with its LoRA adapter off;
                                                skipped for reference-free losses (cpo, simpo, orpo)
    kl           = KTO only: mean over the step's KL rows (prompt i, completion i-1) of log pi - log pi_ref, all
                   ranks, clamped at 0 (no grad)
    update       = one optimizer step: each micro-batch (whole pairs) scores its rows, computes the loss of its pairs
                   and backpropagates sum(losses) / (pairs of the step on all ranks), so the accumulated gradient is
                   the gradient of the step's mean loss whatever the micro-batch size or number of ranks

The NLL term of cpo/orpo is a token mean over the step's chosen completions: each micro-batch gets the step's mean
chosen length (all ranks). `train_step` returns the engine's train/loss, train/lr, train/grad_norm and this rank's
per-row statistics (policy and reference log-probs, lengths, labels), from which the trainer computes TRL's metrics
for the whole step with the same loss function.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from hyflow.algos.preference import preference_loss
from hyflow.batch import Batch
from hyflow.controller import Collect, Dispatch, register
from hyflow.models.loading import load_causal_lm
from hyflow.specs import PreferenceSpec
from hyflow.workers.engine import all_reduce_sum
from hyflow.workers.sft import SFTWorker, as_engine_batch
from hyflow.workers.train_engine import MicroContext, TrainEngine, UpdatePlan

COLUMNS = ("response_mask", "ref_log_prob", "labels")


def sequence_logps(log_probs_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """log pi(y | x) per row: the masked sum of per-token log-probs."""
    return (log_probs_BR * mask_BR).sum(-1)


# KTO's KL rows (the mismatched completions its reference point is taken on) travel in the same batch as its pairs,
# each sequence column under this prefix (`hyflow.data.preference_dataset`'s collator writes them so): the batch's
# column names are the contract between data and workers, as `input_ids` is
KL_PREFIX = "kl_"


def kl_rows(batch: Batch) -> Batch:
    """The KL rows of a KTO batch as a batch of their own: every `kl_<name>` column as `<name>`."""
    return Batch({key[len(KL_PREFIX):]: batch[key] for key in batch.keys() if key.startswith(KL_PREFIX)})  # noqa: SIM118 (iterating a Batch gives rows)


class PreferenceWorker(SFTWorker):
    """A rank of preference training: the SFT worker's engine, plus the reference (module docstring)."""

    spec: PreferenceSpec

    def __init__(self, spec: PreferenceSpec, model: torch.nn.Module | None = None, **kwargs) -> None:
        # a given model object is copied before training starts: the copy is the frozen reference
        self.reference_model = (copy.deepcopy(model) if model is not None and spec.reference
                                and spec.engine.lora is None else None)
        super().__init__(spec, model, **kwargs)
        self.ref: TrainEngine | None = None

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """The SFT worker's engine; then, for a loss with a reference and no LoRA, a frozen copy of the initial model
        in its own optimizer-less engine (with LoRA the reference is the same engine with its adapter off)."""
        super().init_model()
        spec = self.spec
        if not spec.reference or spec.engine.lora is not None:
            return
        model, self.reference_model = self.reference_model, None
        if model is None:
            m = spec.model
            model = load_causal_lm(m.path, dtype="float32", trust_remote_code=m.trust_remote_code,
                                   override_config=dict(m.override_config), config_key=m.config_key,
                                   device=self.model_device)
        frozen = dataclasses.replace(spec.engine, name="ref", optim=None, lora=None, checkpoint_prefix="ref_")
        self.ref = TrainEngine.from_spec(model.to(self.model_device), frozen, device=self.model_device,
                                         world_size=self.world_size)

    # ------------------------------------------------------------------------------------------ passes

    def _reference_logps(self, data: Batch) -> torch.Tensor:
        """Per-token reference log-probs [N, R] (no grad)."""
        if self.ref is not None:
            with self.ref.on_device():
                return self.ref.infer(data, self.spec.batches)["log_probs"]
        return self.engine.infer(data, self.spec.batches, adapter=False)["log_probs"]

    def _kl(self, batch: Batch) -> float:
        """KTO's reference point: mean over all ranks' KL rows of log pi - log pi_ref, clamped at 0 (no grad)."""
        data = as_engine_batch(kl_rows(batch))  # the columns the collator wrote as kl_<name>
        mask = data["response_mask"].float()
        policy = sequence_logps(self.engine.infer(data, self.spec.batches)["log_probs"], mask)
        reference = sequence_logps(self._reference_logps(data), mask)
        sums = all_reduce_sum({"gap": (policy - reference).double().sum(), "rows": torch.tensor(float(len(data)))})
        return max(float(sums["gap"] / sums["rows"].clamp(min=1)), 0.0)

    def _prepare(self, batch: Batch) -> tuple[Batch, dict]:
        """The engine batch with `ref_log_prob` and `labels` columns, and this rank's per-row statistics."""
        spec = self.spec
        data = as_engine_batch(batch)
        mask = data["response_mask"].float()
        stats = {"lengths": mask.sum(-1)}
        if spec.reference:
            data["ref_log_prob"] = self._reference_logps(data)
            stats["ref_logps"] = sequence_logps(data["ref_log_prob"], mask)
        if not spec.paired:
            stats["labels"] = batch["labels"].bool()
            data["labels"] = batch["labels"][:, None].repeat(1, mask.shape[1]).float()
            stats["kl"] = torch.tensor(self._kl(batch))
        return data, stats

    def _loss_fn(self, stats: dict, collected: list):
        """The engine's per-micro-batch loss: the preference loss of its rows / the step's pairs on all ranks."""
        spec = self.spec
        totals = all_reduce_sum({"rows": torch.tensor(float(len(stats["lengths"]))),
                                 "chosen_tokens": stats["lengths"][0::2].sum().double()})
        units = totals["rows"] / 2 if spec.paired else totals["rows"]
        mean_chosen_length = float(totals["chosen_tokens"] / units.clamp(min=1)) if spec.paired else None

        def loss_fn(out: dict, cols: dict, ctx: MicroContext) -> tuple[torch.Tensor, dict]:
            mask = cols["response_mask"].float()
            logps = sequence_logps(out["log_probs"], mask)
            micro = {"logps": logps, "lengths": mask.sum(-1)}
            if "ref_log_prob" in cols:
                micro["ref_logps"] = sequence_logps(cols["ref_log_prob"], mask)
            if "labels" in cols:
                micro["labels"], micro["kl"] = cols["labels"][:, 0].bool(), stats["kl"]
            losses, _ = preference_loss(spec.loss_type, micro, beta=spec.beta,
                                        mean_chosen_length=mean_chosen_length, **spec.knobs)
            loss = losses.sum() / units.clamp(min=1).to(losses.dtype)
            collected.append(logps.detach().float().cpu())
            return loss, {"train/loss": float(loss.detach())}

        return loss_fn

    # ------------------------------------------------------------------------------------------ calls

    @register(Dispatch.DP_SPLIT, collect=Collect.ALL, pad=False, mesh="sft")
    def train_step(self, batch: Batch) -> dict:
        """One optimizer step on this rank's share: {"metrics": train/loss, train/lr, train/grad_norm (global),
        "stats": this rank's per-row statistics, policy log-probs before the step}."""
        plan = UpdatePlan(mini_batch_size=len(batch), epochs=1, shuffle=False, seed=0, sizes=self.spec.batches,
                          loss_agg_mode="token-mean", metric_prefix="train")
        collected: list[torch.Tensor] = []
        with self.engine.on_device(optimizer=True):
            data, stats = self._prepare(batch)
            metrics = self.engine.update(data, plan, self._loss_fn(stats, collected), columns=COLUMNS)
        stats["logps"] = torch.cat(collected)  # fixed-size micro-batches run the rows in order
        if len(stats["logps"]) != len(batch):
            raise RuntimeError(f"the update scored {len(stats['logps'])} rows of {len(batch)}")
        return {"metrics": {key: metrics[key][0] for key in ("train/loss", "train/lr", "train/grad_norm")},
                "stats": stats}

    @register(Dispatch.DP_SPLIT, collect=Collect.ALL, pad=False, mesh="sft")
    def evaluate(self, batch: Batch) -> dict:
        """This rank's per-row statistics of `batch` under the current policy (no grad, no step)."""
        with self.engine.on_device():
            data, stats = self._prepare(batch)
            stats["logps"] = sequence_logps(self.engine.infer(data, self.spec.batches)["log_probs"],
                                            data["response_mask"].float())
        return stats
