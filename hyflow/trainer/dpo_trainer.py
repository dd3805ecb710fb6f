"""Offline preference optimisation: `hyflow dpo <overrides>` (DPO and its IPO/hinge/robust variants, CPO, SimPO,
ORPO, KTO; the losses and their sources are in `hyflow.algos.preference`, the keys in `hyflow.config.dpo_schema`).

The trainer is the SFT trainer's loop (`hyflow.trainer.sft_trainer.SFTTrainer`: seeded resumable loader, workers
on the local or Ray executor, FSDP2/DDP, LoRA, checkpoints, metrics.jsonl, run summary) with a preference worker
(`hyflow.workers.preference`) and preference data (`hyflow.data.preference_dataset`). One step, top to bottom:

    batch = loader.next_batch()                   P pairs = 2P rows (chosen, rejected, ...); KTO: B rows + KL rows
    train_step: each worker its whole pairs ->    reference log-probs (no grad; frozen copy or LoRA adapter off)
                                                  -> micro-batch forward/backward of the preference loss
                                                  -> clip grad norm -> AdamW -> LR schedule
    metrics  = the same loss function on the step's per-sequence log-probs (before the update): TRL's names
               rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected
               (+ nll_loss, log_odds_ratio, log_odds_chosen, kl where the loss has them), with train/loss, train/lr,
               train/grad_norm
    validate (every test_freq steps and at the end): val/loss and val/<metric> over the validation rows
    log to metrics.jsonl; save_checkpoint (every save_freq steps and at the end)

The reference model is not checkpointed: it is the initial model (`model.partial_pretrain`), rebuilt on resume;
with LoRA it is the base model itself. Checkpoints are SFT checkpoints (model, optimizer, scheduler, trainer state,
hf_config/, tokenizer/), so `hyflow export` reads them and a stopped run resumes exactly.

Differences from TRL: KTO's KL reference point is estimated over the whole step's KL rows (TRL: per forward
batch), so it does not depend on the micro-batch size; metrics are over the whole step (TRL: averaged over logging
steps). Simplifications: text models only (no images), no dynamic micro-batches or sequence parallelism (a pair must
stay in one micro-batch), dropout is left as the model config has it (TRL's disable_dropout: the tiny and Qwen2
configs have none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from hyflow.algos.preference import PREFERENCE_LOSSES, preference_loss
from hyflow.config.dpo_schema import DPOConfig, load_dpo_config, validate_dpo_config
from hyflow.config.keys import ConfigError
from hyflow.data.preference_dataset import PreferenceDataset
from hyflow.specs import PreferenceSpec, SFTBatches
from hyflow.trainer.sft_trainer import SFTTrainer, sft_spec
from hyflow.workers.preference import PreferenceWorker

KNOBS = ("label_smoothing", "simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight")


def preference_batch_arithmetic(cfg: DPOConfig) -> SFTBatches:
    """The step's sizes in sequences (the unit of the engine): P pairs = 2P sequences, m pairs per micro-batch =
    2m sequences; KTO: one sequence per completion (its KL row is a separate no-grad pass of the same size)."""
    d, t = cfg.data, cfg.trainer
    per_unit = 2 if PREFERENCE_LOSSES.get(cfg.algorithm.loss_type).paired else 1
    devices = t.nnodes * t.n_gpus_per_node
    per_device = d.train_batch_size * per_unit // devices
    micro = d.micro_batch_size_per_gpu * per_unit
    return SFTBatches(n_devices=devices, samples_per_step=d.train_batch_size * per_unit,
                      samples_per_device=per_device, use_dynamic_bsz=False, micro_batch_size_per_device=micro,
                      micro_batches=-(-per_device // micro), max_token_len_per_device=None,
                      max_sequence_tokens=d.max_length)


def preference_spec(cfg: DPOConfig, batches: SFTBatches, total_steps: int) -> PreferenceSpec:
    """The SFT worker's spec (model, engine, batches) with the loss: its name, beta and the knobs it reads."""
    base = sft_spec(cfg, batches, total_steps)
    a = cfg.algorithm
    loss = PREFERENCE_LOSSES.get(a.loss_type)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields["engine"] = dataclasses.replace(base.engine, name="policy")  # checkpoint names stay the SFT trainer's
    return PreferenceSpec(**fields,
                          loss_type=a.loss_type, beta=a.beta,
                          knobs={k: getattr(a, k) for k in loss.knobs if getattr(a, k) is not None},
                          reference=loss.reference, paired=loss.paired)


def step_metrics(spec: PreferenceSpec, stats: dict, prefix: str = "") -> dict[str, float]:
    """TRL's metrics (and `<prefix>loss` when a prefix is given) of per-row statistics, by the run's loss."""
    losses, metrics = preference_loss(spec.loss_type, stats, beta=spec.beta, **spec.knobs)
    out = {f"{prefix}{name}": float(value) for name, value in metrics.items()}
    if prefix:
        out[f"{prefix}loss"] = float(losses.mean())
    return out


def concat_stats(parts: Sequence[dict]) -> dict:
    """The ranks' per-row statistics joined in rank order (= the batch's row order); scalars (kl) from rank 0."""
    return {key: torch.cat([p[key] for p in parts]) if parts[0][key].dim() else parts[0][key] for key in parts[0]}


class DPOTrainer(SFTTrainer):
    """Preference optimisation of `model.partial_pretrain` on `data.train_files` (or the objects passed in, as the
    SFT trainer takes them); `fit()` runs it."""

    config_class = DPOConfig
    load_config = staticmethod(load_dpo_config)
    validate_config = staticmethod(validate_dpo_config)
    batch_arithmetic = staticmethod(preference_batch_arithmetic)
    worker_spec = staticmethod(preference_spec)
    worker_class = PreferenceWorker
    pool_name = "hyflow-dpo"

    def _dataset(self, files, max_samples: int, key: str) -> PreferenceDataset:
        if not files:
            raise ConfigError(f"{key} is not set; set {key}=<parquet/jsonl file> (or a list [a.parquet, b.parquet])")
        d, a = self.config.data, self.config.algorithm
        return PreferenceDataset(files, self.tokenizer, paired=PREFERENCE_LOSSES.get(a.loss_type).paired,
                                 max_length=d.max_length, truncation=d.truncation, prompt_key=d.prompt_key,
                                 chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                                 completion_key=d.completion_key, label_key=d.label_key, max_samples=max_samples,
                                 seed=self.config.trainer.seed)

    def describe(self) -> str:
        a, o = self.config.algorithm, self.config.optim
        unit = "pairs" if self.spec.paired else "completions"
        reference = ("no reference model" if not self.spec.reference else "reference = the base model (LoRA "
                     "adapter off)" if self.spec.engine.lora is not None else "reference = a frozen copy of the "
                     "initial model")
        workers = (f"{self.n_devices} {self.device.type} workers ({self.executor})" if self.n_devices > 1
                   else f"{self.device.type}")
        return (f"Preference optimisation ({a.loss_type}, beta {a.beta:g}, {reference}) on {workers}: "
                f"{len(self.train_dataset)} training {unit}, {len(self.loader)} steps per epoch, {self.total_steps} "
                f"optimizer steps. Each step: {self.config.data.train_batch_size} {unit} = {self.batches.describe()}."
                f" lr {o.lr:g} ({o.lr_scheduler}), grad clip {o.clip_grad:g}. Run directory: {self.run_dir}")

    def train_step(self, batch) -> dict[str, float]:
        """One optimizer step: train/loss, train/lr, train/grad_norm and TRL's metrics of the step's pairs."""
        results = self.workers.train_step(batch)
        return {**results[0]["metrics"], **step_metrics(self.spec, concat_stats([r["stats"] for r in results]))}

    def validate(self) -> dict[str, float]:
        """val/loss and val/<TRL metric> over the whole validation set, scored by the current policy. The set goes
        to the workers in chunks of train_batch_size rows; a last chunk that the workers cannot share evenly is
        filled up with copies of its last row, whose statistics are dropped."""
        ds, chunk, workers = self.val_dataset, self.config.data.train_batch_size, self.n_devices
        parts = []
        for start in range(0, len(ds), chunk):
            items = [ds[i] for i in range(start, min(start + chunk, len(ds)))]
            real = len(items)
            items += [items[-1]] * (-real % workers)
            stats = concat_stats(self.workers.evaluate(ds.collate(items)))
            rows = real * (2 if self.spec.paired else 1)
            parts.append({k: v[:rows] if v.dim() else v for k, v in stats.items()})
        stats = concat_stats(parts)
        if not self.spec.paired:  # KTO: the chunks' KL estimates, weighted by their rows
            stats["kl"] = sum(p["kl"] * len(p["lengths"]) for p in parts) / len(stats["lengths"])
        return step_metrics(self.spec, stats, prefix="val/")


def run_dpo(overrides: Sequence[str], config_file: str | Path | None = None) -> list[dict]:
    """`hyflow dpo <overrides>`: compose the DPOConfig (defaults <- config_file <- overrides) and train."""
    return DPOTrainer(load_dpo_config(overrides, config_file)).fit()
