"""Supervised fine-tuning (SFT) of a causal LM on chat conversations: `hyflow sft <overrides>`.

The objective is next-token cross entropy on the trained tokens (loss_mask = 1: every assistant turn and its
end-of-turn token, see `hyflow.data.sft_dataset`), as a token mean over the whole optimizer-step batch:

    L = -(1 / N) * sum_{b,t: m[b,t] = 1} log p(x[b,t] | x[b,<t]),      N = sum_{b,t} m[b,t]

The token at position t is predicted from the hidden state at t - 1 (the shift). A step's
`data.train_batch_size` samples are split evenly over the W = trainer.nnodes x trainer.n_gpus_per_node devices
and each device's share is cut into micro-batches of `data.micro_batch_size_per_gpu` (or of at most
`data.max_token_len_per_gpu` tokens with `data.use_dynamic_bsz`); each micro-batch backpropagates its own sum of
-log p divided by the step's N over all devices, so the accumulated gradient is exactly the full-batch gradient
however unevenly the trained tokens fall into micro-batches and devices. (verl's legacy trainer divides each
micro-batch by its own token count and then by the micro-batch count: a mean of means.)

One step, top to bottom in `fit`:

    batch = loader.next_batch()                  seeded order = f(seed, epoch); resumable position
    train_step: each worker its share -> micro-batch forward/backward -> clip grad norm -> AdamW -> LR schedule
    validate (every test_freq steps, and at the end): val/loss = token mean of -log p over the validation set
    log train/loss, train/lr, train/grad_norm, val/loss to metrics.jsonl (verl's names)
    save_checkpoint (every save_freq steps, and at the end)

The workers (`hyflow.workers.sft.SFTWorker`, one per device) train through the same `TrainEngine` as the RL
actor. `trainer.executor`: local = one worker in this process (one device; `breakpoint()` works anywhere), ray =
one Ray actor per device with torch.distributed (gloo on CPU, NCCL on GPU) and FSDP2 (`engine.strategy`); auto =
local for one device, ray for more. The metrics are global (all-reduced), so 2 CPU workers log what one process
logs, up to floating-point summation order.

LoRA (`model.lora_rank`, ...): the engine trains an adapter; checkpoints hold the adapter only and `hyflow export`
merges it. Packing (`model.use_remove_padding`, default true): each micro-batch runs as one row without pads.
Simplifications: no sequence parallelism, no CPU offload; bf16 autocast (FSDP2 mixed precision) on cuda over fp32
master weights, fp32 on cpu. The lm_head runs only on the response positions, at once when their logits are small
and else in checkpointed row chunks (`hyflow.models.forward.lm_head_logprobs`).

Resume: a checkpoint holds the full (unsharded) model, AdamW state keyed by parameter name and the scheduler (the
workers' collective `state_dict`, written by rank 0), the loader's (epoch, position) and the driver's RNG; a run
stopped after step k and resumed writes the same metrics.jsonl rows for steps k+1.. as one that never stopped, at
any number of devices (a checkpoint written by 2 workers resumes in 1 process and vice versa). The checkpoint
also holds hf_config/ and tokenizer/, so `hyflow export --component model` works.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.config.keys import ConfigError
from hyflow.config.loader import config_to_dict, config_to_yaml
from hyflow.config.lora import lora_settings
from hyflow.config.roles import fsdp_settings, optimizer_spec
from hyflow.config.sft_schema import SFTConfig, load_sft_config, validate_sft_config
from hyflow.config.support import not_supported_problems, performance_only_warning
from hyflow.config.validate import check_loggers
from hyflow.controller import make_worker_group
from hyflow.data.rl_dataset import PromptLoader, is_row_collection
from hyflow.data.sft_dataset import SFTDataset
from hyflow.models.forward import backbone_hidden_states, lm_head_logprobs, unwrap_model
from hyflow.models.loading import load_tokenizer
from hyflow.specs import ModelSpec, SFTBatches, SFTSpec, TrainEngineSpec
from hyflow.threads import configure_threads
from hyflow.trainer.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from hyflow.trainer.rl_datasets import prompt_processor
from hyflow.trainer.run_dir import claim_run_directory
from hyflow.trainer.tracking import (
    ProgressBar,
    Tracker,
    format_already_complete,
    format_run_summary,
    truncate_metrics,
)
from hyflow.workers.sft import SFTWorker

MODEL_COMPONENTS = ("model", "optimizer", "scheduler")  # the workers' checkpoint components
RAY_READY_TIMEOUT_S = 300.0


def sft_batch_arithmetic(cfg: SFTConfig) -> SFTBatches:
    """The derived sizes of one step on W = trainer.nnodes x trainer.n_gpus_per_node devices: B / W samples per
    device (B = data.train_batch_size), in micro-batches of data.micro_batch_size_per_gpu samples, or of at most
    data.max_token_len_per_gpu tokens with data.use_dynamic_bsz (a validated config divides evenly)."""
    d, t = cfg.data, cfg.trainer
    devices = t.nnodes * t.n_gpus_per_node
    # a sequence-parallel group of devices trains on one data-parallel share (hyflow.controller.dispatch's mesh=)
    dp = devices // max(cfg.engine.ulysses_sequence_parallel_size, 1)
    per_device, micro = d.train_batch_size // dp, d.micro_batch_size_per_gpu
    return SFTBatches(
        n_devices=devices, samples_per_step=d.train_batch_size, samples_per_device=per_device,
        use_dynamic_bsz=bool(d.use_dynamic_bsz), micro_batch_size_per_device=micro,
        micro_batches=None if d.use_dynamic_bsz else -(-per_device // micro),
        max_token_len_per_device=d.max_token_len_per_gpu if d.use_dynamic_bsz else None,
        max_sequence_tokens=d.max_length)


def sft_spec(cfg: SFTConfig, batches: SFTBatches, total_steps: int) -> SFTSpec:
    """The SFT worker's spec: `model.*`, the engine (`engine.*`: strategy, FSDP2 settings, compute dtype; `optim.*`
    with an LR schedule over `total_steps` optimizer steps; LoRA; packing) and the step's `batches`."""
    m, e, o = cfg.model, cfg.engine, cfg.optim
    engine = TrainEngineSpec(
        name="sft", head="lm", strategy=e.strategy, fsdp=fsdp_settings(e), compute_dtype=e.dtype,
        device=cfg.trainer.device, optim=optimizer_spec(o, lr_scheduler_type=o.lr_scheduler), grad_clip=o.clip_grad,
        total_optimizer_steps=total_steps, use_remove_padding=m.use_remove_padding,
        lora=lora_settings(m, config_key="model"), checkpoint_prefix="",
        ulysses_sequence_parallel_size=e.ulysses_sequence_parallel_size)
    model = ModelSpec(path=m.partial_pretrain, tokenizer_path=m.tokenizer_path, trust_remote_code=m.trust_remote_code,
                      override_config=dict(m.override_config or {}),
                      enable_gradient_checkpointing=m.enable_gradient_checkpointing,
                      custom_chat_template=m.custom_chat_template, config_key="model.partial_pretrain")
    return SFTSpec(model=model, engine=engine, batches=batches, seed=cfg.trainer.seed)


def trained_tokens(batch: Batch) -> int:
    """N = number of target tokens with loss_mask = 1 (the mask shifted to the predicted positions)."""
    return int(batch["loss_mask"][:, 1:].sum())


def token_nll_sum(model: torch.nn.Module, micro: Batch) -> torch.Tensor:
    """sum over t with m[b,t] = 1 of -log p(x[b,t] | x[b,<t]) for a right-padded micro-batch (a scalar).

    The reference form of the SFT loss (the workers compute it through the engine, `hyflow.workers.sft`).
    Columns past the longest sample are cut first; the lm_head runs on the trained positions only.
    """
    width = int(micro["attention_mask"].sum(-1).max())
    ids_BT = micro["input_ids"][:, :width]
    hidden_BTH = backbone_hidden_states(model, ids_BT, micro["attention_mask"][:, :width],
                                        micro["position_ids"][:, :width])
    mask_BT = micro["loss_mask"][:, 1:width].bool()
    logp_N, _ = lm_head_logprobs(hidden_BTH[:, :-1][mask_BT], ids_BT[:, 1:][mask_BT],
                                 unwrap_model(model).get_output_embeddings())
    return -logp_N.sum()


def accumulate_sft_gradients(model: torch.nn.Module, micro_batches: Sequence[Batch], device: torch.device) -> float:
    """Backpropagate L = sum over micro-batches of token_nll_sum / N, N = trained tokens of ALL micro-batches
    (the global token mean); gradients add into `.grad`. Returns L (the step's mean token loss). The reference
    the workers' engine path is tested against, in one process."""
    n_tokens = max(sum(trained_tokens(m) for m in micro_batches), 1)
    total = 0.0
    for micro in micro_batches:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = token_nll_sum(model, micro.to(device)) / n_tokens
        if loss.requires_grad:  # a micro-batch without trained tokens has no graph
            loss.backward()
        total += float(loss.detach())
    return total


def _check_keys_and_names(cfg: SFTConfig) -> None:
    """Before anything loads: keys this version does not support and trainer.logger (names, missing packages)
    are one ConfigError; keys that only change speed or memory are named once on stdout."""
    problems = not_supported_problems(cfg) + check_loggers(cfg.trainer.logger)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in the SFT config:\n" + "\n".join(f"  - {p}" for p in problems))
    if (accepted := performance_only_warning(cfg)) is not None:
        print(accepted)


class SFTTrainer:
    """Fine-tune `model.partial_pretrain` on `data.train_files` (or the objects passed in); `fit()` runs it.

    `model=`: a model object trained in place instead of loading `model.partial_pretrain`; one device only (the
    local executor). `tokenizer=`, `train_dataset=`, `val_dataset=`: objects used instead of the config's.

    A trainer with another loss over the same loop (`hyflow.trainer.dpo_trainer`) sets the class attributes below
    and overrides `_dataset`, `train_step`, `validate` and `describe`."""

    config_class = SFTConfig
    load_config = staticmethod(load_sft_config)
    validate_config = staticmethod(validate_sft_config)
    batch_arithmetic = staticmethod(sft_batch_arithmetic)
    worker_spec = staticmethod(sft_spec)
    worker_class = SFTWorker
    pool_name = "hyflow-sft"

    def __init__(self, config: SFTConfig | Sequence[str] | None = None, *, train_dataset=None,
                 val_dataset=None, tokenizer=None, model: torch.nn.Module | None = None):
        if isinstance(config, self.config_class):
            self.validate_config(config)
            self.config = config
        else:
            self.config = self.load_config(list(config or ()))
        cfg = self.config
        _check_keys_and_names(cfg)
        _seed_everything(cfg.trainer.seed)
        self.device = _resolve_device(cfg.trainer.device)
        self.n_devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        # trainer.executor: auto = local (this process) for one device, ray for more
        self.executor = cfg.trainer.executor if cfg.trainer.executor != "auto" else (
            "local" if self.n_devices == 1 else "ray")
        if model is not None and self.executor != "local":
            raise ConfigError(
                f"SFTTrainer(model=...) trains that object in this process, on one device (trainer.executor=local), "
                f"but this run has {self.n_devices} device(s) on trainer.executor={self.executor}: each worker "
                "loads its own copy. Save the model (model.save_pretrained(DIR)) and set model.partial_pretrain=DIR, "
                "or train on one device (trainer.nnodes=1 trainer.n_gpus_per_node=1).")
        if model is None and cfg.model.partial_pretrain is None:
            raise ConfigError("model.partial_pretrain is not set; set model.partial_pretrain=<HF model directory "
                              "or hub id> (the model to fine-tune), or pass model=")
        self.given_model = model
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        # a vision-language model's image processor: image rows are expanded into the image's tokens
        model_path = cfg.model.partial_pretrain
        self.processor = (prompt_processor(model_path, self.tokenizer, trust_remote_code=cfg.model.trust_remote_code,
                                           data_cfg=cfg.data) if model_path else None)
        # a dataset object is used as given; in-memory rows (a list of dicts, a datasets.Dataset) become an SFTDataset
        if train_dataset is None:
            self.train_dataset = self._dataset(cfg.data.train_files, cfg.data.train_max_samples, "data.train_files")
        else:
            self.train_dataset = (self._dataset(train_dataset, cfg.data.train_max_samples, "train_dataset")
                                  if is_row_collection(train_dataset) else train_dataset)
        if val_dataset is not None:
            self.val_dataset = (self._dataset(val_dataset, cfg.data.val_max_samples, "val_dataset")
                                if is_row_collection(val_dataset) else val_dataset)
        else:
            self.val_dataset = self._dataset(cfg.data.val_files, cfg.data.val_max_samples,
                                             "data.val_files") if cfg.data.val_files else None
        seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
        self.loader = PromptLoader(self.train_dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                                   seed=seed)
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * len(self.loader)
        # One source of batch arithmetic: this object is what `describe` prints and what every worker runs.
        self.batches = self.batch_arithmetic(cfg)
        self.spec = self.worker_spec(cfg, self.batches, self.total_steps)  # what every worker is built from
        self.run_dir = Path(cfg.trainer.default_local_dir).expanduser()
        self.checkpoints = CheckpointManager(self.run_dir, cfg.trainer.max_ckpt_to_keep)
        self.step = 0
        self.workers = None
        self._pool = None
        self.started_ray = False

    # ------------------------------------------------------------------------------------------ setup

    def _load_tokenizer(self):
        m = self.config.model
        if m.tokenizer_path is None and m.partial_pretrain is None:
            raise ConfigError("model.partial_pretrain is not set; set model.partial_pretrain=<HF model directory "
                              "or hub id> (the model to fine-tune), or pass tokenizer= and model=")
        key = "model.tokenizer_path" if m.tokenizer_path else "model.partial_pretrain"
        return load_tokenizer(m.tokenizer_path or m.partial_pretrain, trust_remote_code=m.trust_remote_code,
                              chat_template=m.custom_chat_template, config_key=key)

    def _dataset(self, files, max_samples: int, key: str) -> SFTDataset:
        if not files:
            raise ConfigError(f"{key} is not set; set {key}=<parquet/jsonl file> (or a list [a.parquet, b.parquet])")
        d = self.config.data
        return SFTDataset(files, self.tokenizer, max_length=d.max_length, truncation=d.truncation,
                          prompt_key=d.prompt_key, response_key=d.response_key, messages_key=d.messages_key,
                          tools_key=d.tools_key, max_samples=max_samples, seed=self.config.trainer.seed,
                          image_key=d.image_key, processor=self.processor)

    def setup(self) -> None:
        """Start the workers (in this process, or one Ray actor per device) and load the model into them."""
        cfg = self.config
        # torch threads of this process: all usable cores in-process, a share of them beside Ray workers
        configure_threads(1 if self.executor == "local" else max(1, self.n_devices // max(1, cfg.trainer.nnodes)))
        if self.executor == "local":
            self.workers = make_worker_group("local", self.worker_class, world_size=1, spec=self.spec,
                                             model=self.given_model)
        else:
            from hyflow.controller.resources import RayResourcePool, ensure_ray

            ray_init = {k: v for k, v in dict(cfg.ray_kwargs.ray_init or {}).items() if v is not None}
            self.started_ray = ensure_ray(cfg.ray_kwargs.address, ray_init=ray_init)
            t = cfg.trainer
            self._pool = RayResourcePool(t.nnodes, t.n_gpus_per_node, use_gpu=self.device.type == "cuda",
                                         cpus_per_worker=1.0, ready_timeout_s=RAY_READY_TIMEOUT_S,
                                         name=self.pool_name)
            self.workers = make_worker_group("ray", self.worker_class, world_size=self.n_devices, pool=self._pool,
                                             spec=self.spec)
        self.workers.init_model()
        self.hf_config, self.generation_config = self.workers.model_configs()

    def shutdown(self) -> None:
        """Stop the workers (and the local Ray cluster this trainer started)."""
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self._pool is not None:
            self._pool.remove()
            self._pool = None
        if self.started_ray:
            from hyflow.controller.resources import shutdown_ray

            shutdown_ray()
            self.started_ray = False

    def describe(self) -> str:
        """The run's batch arithmetic in words, with units."""
        o = self.config.optim
        workers = (f"{self.n_devices} {self.device.type} workers ({self.executor})" if self.n_devices > 1
                   else f"{self.device.type}")
        return (f"SFT on {workers}: {len(self.train_dataset)} training samples, {len(self.loader)} steps per "
                f"epoch, {self.total_steps} optimizer steps. Each step: {self.batches.describe()}; loss = token "
                f"mean over the step's trained tokens. lr {o.lr:g} ({o.lr_scheduler}), grad clip {o.clip_grad:g}. "
                f"Run directory: {self.run_dir}")

    # ------------------------------------------------------------------------------------------ steps

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch` (train_batch_size samples, split over the workers); returns train/loss,
        train/lr, train/grad_norm."""
        return self.workers.train_step(batch)

    def validate(self) -> dict[str, float]:
        """val/loss: sum of -log p over every trained token of the validation set / their number.

        The set goes to the workers in chunks of train_batch_size samples; the last chunk is filled up to a
        multiple of the worker count with rows whose loss_mask is 0, which add nothing."""
        ds, chunk, workers = self.val_dataset, self.batches.samples_per_step, self.n_devices
        nll = tokens = 0.0
        for start in range(0, len(ds), chunk):
            batch = ds.collate([ds[i] for i in range(start, min(start + chunk, len(ds)))])
            padded, pad = batch.pad_to_multiple(workers)
            if pad:
                mask = padded["loss_mask"].clone()
                mask[len(batch):] = 0
                padded["loss_mask"] = mask
            sums = self.workers.validate(padded)
            nll, tokens = nll + sums["nll"], tokens + sums["tokens"]
        return {"val/loss": nll / max(tokens, 1.0)}

    def fit(self) -> list[dict]:
        """Train to `total_steps` (resuming per trainer.resume_mode); returns this call's metric rows.

        At the end it prints a summary (elapsed time, steps, final and best val/loss, run directory, last
        checkpoint and its export command); a resumed run with no step left says so and trains nothing."""
        t = self.config.trainer
        started = time.perf_counter()
        self._finished, self._start_step, self._last_checkpoint = False, self.step, None
        claim = claim_run_directory(self.run_dir, t.resume_mode, t.resume_from_path, self.checkpoints)
        try:
            self.setup()
            history = self._fit(claim.resume_path)
        finally:
            self.shutdown()
            claim.release()
        if self._finished:
            print(format_run_summary(self.run_dir, elapsed_s=time.perf_counter() - started, step=self.step,
                                     total_steps=self.total_steps, start_step=self._start_step,
                                     checkpoint=self._last_checkpoint, history=history, val_pattern="val/loss",
                                     higher_is_better=False), flush=True)
        return history

    def _fit(self, resume_path: Path | None) -> list[dict]:
        t = self.config.trainer
        (self.run_dir / "config.yaml").write_text(config_to_yaml(self.config))
        if resume_path is not None:
            self.resume(resume_path)
        self._start_step = self.step
        if 0 < self.total_steps <= self.step:
            latest = self.checkpoints.latest_step()
            print(format_already_complete(self.run_dir, self.step, self.total_steps,
                                          None if latest is None else self.checkpoints.step_dir(latest)), flush=True)
            return []
        truncate_metrics(self.run_dir, self.step)
        print(self.describe(), flush=True)
        history: list[dict] = []
        with Tracker(self.run_dir, t.logger, project_name=t.project_name, experiment_name=t.experiment_name,
                     config=config_to_dict(self.config)) as tracker, \
                ProgressBar(self.total_steps, initial=self.step) as progress:
            while self.step < self.total_steps:
                batch = self.loader.next_batch()
                self.step += 1
                last = self.step == self.total_steps
                progress.stage("train")
                metrics = self.train_step(batch)
                if self.val_dataset is not None and (last or (t.test_freq > 0 and self.step % t.test_freq == 0)):
                    progress.stage("testing")
                    metrics.update(self.validate())
                tracker.log(metrics, self.step)
                history.append({"step": self.step, **metrics})
                if last or (t.save_freq > 0 and self.step % t.save_freq == 0):
                    progress.stage("save_checkpoint")
                    self._last_checkpoint = self.save_checkpoint()
                progress.update(metrics)  # after the save: the plain progress line of the last step is the last
        self._finished = True
        return history

    # ------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """`run_dir/global_step_N/`: model, optimizer, scheduler (full state dicts gathered from the workers),
        trainer_state (step, loader, RNG) + HF config and tokenizer."""
        components = dict(self.workers.state_dict())  # collective; rank 0's full components
        components["trainer_state"] = {"step": self.step, "loader": self.loader.state_dict(),
                                       "rng": capture_rng_state()}
        return self.checkpoints.save(self.step, components, tokenizer=self.processor or self.tokenizer,
                                     hf_config=self.hf_config,
                                     generation_config=self.generation_config,
                                     config_yaml=config_to_yaml(self.config))

    def resume(self, path: Path | None = None) -> int:
        """Load `path`, or the checkpoint chosen by trainer.resume_mode (if any), into the workers (any number of
        them, whatever number wrote it); returns the step it holds (0 = fresh)."""
        t = self.config.trainer
        path = path or self.checkpoints.resolve_resume(t.resume_mode, t.resume_from_path)
        if path is None:
            return self.step
        saved = self.checkpoints.load(path, verify=False)
        self.workers.load_state_dict({name: saved[name] for name in MODEL_COMPONENTS if name in saved})
        state = saved["trainer_state"]
        self.loader.load_state_dict(state["loader"])
        restore_rng_state(state["rng"])
        self.step = int(state["step"])
        print(f"resumed from {path} (step {self.step})", flush=True)
        return self.step


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; set trainer.device=cpu (or auto)")
    return torch.device(name)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_sft(overrides: Sequence[str], config_file: str | Path | None = None) -> list[dict]:
    """`hyflow sft <overrides>`: compose the SFTConfig (defaults <- config_file <- overrides) and train."""
    return SFTTrainer(load_sft_config(overrides, config_file)).fit()
