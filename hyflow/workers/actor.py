"""The actor + rollout + reference worker: one process per device hosts the policy, its generation engine and
the frozen reference policy (HybridFlow's colocated roles).

- `generate_sequences`: the rollout engine samples responses (token ids in, token ids + log-probs out).
- `compute_log_prob`: old log-probs (+ entropy, + sum of squared probabilities when an estimator needs it)
  under the current weights, the same temperature as the rollout.
- `compute_ref_log_prob`: log-probs under the reference policy (for a KL loss or KL-in-reward).
- `update_actor`: `ppo_epochs` passes over the step's samples (when the batch carries no `old_log_probs`, the
  update is on-policy — one epoch, one mini-batch — and pi_old is the update's own forward, detached) in mini-batches of `ppo_mini_batch_size`
  prompts (x n samples), each cut into micro-batches; every micro-batch loss is normalised by the token /
  sequence counts of the whole mini-batch over all data-parallel ranks, so the gradient is the same however the
  mini-batch is cut. Loss = policy loss (by name) - entropy_coeff * entropy + kl_loss_coef * KL(pi || ref).
- `sync_rollout_weights`: the rollout engine reads the actor's weights. In one process on CPU they share one
  module (nothing to copy); otherwise the engine holds its own full (unsharded) copy and the weights are pushed
  in buckets of at most `weight_bucket_bytes`, gathered from the FSDP2 shards parameter by parameter.

Several ranks (`world_size` > 1; `actor.strategy` fsdp or fsdp2 = FSDP2, ddp = DistributedDataParallel; see
`hyflow.workers.fsdp`): `init_model` joins the process group, shards the actor and the reference (the reference
has no optimizer), and gives the rollout engine a separate full copy. The driver splits each batch by rank
(DP_SPLIT); every rank trains on its share with globally normalised losses, and all-reduces the metrics, so
every rank reports the same global values. Checkpoint methods are collective (every rank calls them):
`state_dict` returns rank 0's full (unsharded) state dicts, `load_state_dict` loads full state dicts into any
world size, `save_sharded_checkpoint` / `load_sharded_checkpoint` write and read per-rank DCP shards.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections import defaultdict

import torch

from hyflow.algos import (
    agg_loss,
    compute_offpolicy_metrics,
    get_policy_loss,
    kl_penalty,
    loss_normalisers,
    sum_pi_squared_from_logits,
)
from hyflow.batch import Batch
from hyflow.config import HyflowConfig
from hyflow.config.arithmetic import batch_arithmetic, uses_reference
from hyflow.controller import Collect, Dispatch, Worker, register
from hyflow.models.forward import backbone_hidden_states, response_logprobs, unwrap_model
from hyflow.models.loading import load_causal_lm, load_tokenizer
from hyflow.rollout.base import EngineSpec, RolloutEngineError, SamplingParams, make_engine
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
    DIST_TIMEOUT_S,
    TrainingStateCheckpoints,
    full_state_dict,
    full_tensor_buckets,
    is_distributed,
    maybe_init_distributed,
    parallel_strategy,
    wrap_model,
)

RESPONSE_KEYS = ("response_mask", "old_log_probs", "advantages", "ref_log_prob", "rollout_is_weights",
                 "rollout_log_probs")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`trainer.device`: auto = cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device(name)


def autocast(device: torch.device, dtype_name: str):
    """bf16/fp16 autocast on accelerators (fsdp_config.dtype); full precision on CPU."""
    if device.type == "cpu" or dtype_name in ("fp32", "float32"):
        return contextlib.nullcontext()
    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16}[dtype_name]
    return torch.autocast(device_type=device.type, dtype=dtype)


class ActorRolloutRefWorker(TrainingStateCheckpoints, Worker):
    """Policy training, generation and reference log-probs on one device (one rank of a data-parallel group)."""

    checkpoint_prefix = "actor"

    def __init__(self, config: HyflowConfig, tokenizer=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.config = config
        self.arr = config.actor_rollout_ref
        self.tokenizer = tokenizer
        self.model_device = resolve_device(config.trainer.device, self.local_rank)

    # ------------------------------------------------------------------ set-up
    @register(Dispatch.REPLICATE)
    def init_model(self, total_training_steps: int) -> None:
        """Load the policy (and the reference copy), build optimizer, LR schedule and the rollout engine.

        With several ranks: join the process group, give the rollout engine its own full copy, then shard the
        actor and the reference (FSDP2) or wrap the actor in DDP; the optimizer is built on the wrapped model.
        """
        model_cfg = self.arr.model
        actor = self.arr.actor
        self.batches = batch_arithmetic(self.config)  # what `hyflow config` prints: micro-batch sizes of each pass
        self.strategy = parallel_strategy(actor.strategy, self.world_size)
        apply_full_determinism(actor.fsdp_config.full_determinism or self.arr.ref.fsdp_config.full_determinism)
        maybe_init_distributed(self)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(model_cfg.tokenizer_path or model_cfg.path,
                                            trust_remote_code=model_cfg.trust_remote_code,
                                            chat_template=model_cfg.custom_chat_template)
        torch.manual_seed(self.config.trainer.seed)
        model = load_causal_lm(model_cfg.path, dtype="float32", trust_remote_code=model_cfg.trust_remote_code,
                               override_config=dict(model_cfg.override_config or {}),
                               enable_gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
                               device=self.model_device)
        ref_model = None
        if uses_reference(self.config):
            ref_path = self.arr.ref.model.path
            if ref_path:
                ref_model = load_causal_lm(ref_path, dtype="float32", device=self.model_device,
                                           trust_remote_code=model_cfg.trust_remote_code)
            else:
                ref_model = copy.deepcopy(model)
            ref_model.requires_grad_(False).eval()
        self.weight_bucket_bytes = self.arr.rollout.checkpoint_engine.update_weights_bucket_megabytes << 20
        self.rollout = self._build_rollout(model)
        self.model = wrap_model(model, self.strategy, actor.fsdp_config)
        if not self.rollout.shares_weights:
            self.sync_rollout_weights()  # collective under FSDP2: every rank is here
        self.ref_model = None
        if ref_model is not None:
            ref_strategy = parallel_strategy(self.arr.ref.strategy, self.world_size)
            self.ref_model = wrap_model(ref_model, ref_strategy, self.arr.ref.fsdp_config, trainable=False)
        mini_batches_per_step = max(1, self.config.data.train_batch_size // actor.ppo_mini_batch_size)
        self.optimizer = build_optimizer(self.model.parameters(), actor.optim)
        self.scheduler = build_scheduler(self.optimizer, actor.optim,
                                         total_training_steps * actor.ppo_epochs * mini_batches_per_step)

    def _eos_ids(self, model) -> list[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        return sorted(ids)

    def _build_rollout(self, model):
        """The rollout engine of this rank, built by name (`hyflow.rollout.base.make_engine`).

        The hf engine generates with the actor's own module in one CPU process, or DDP on CPU (zero copy), else
        with a copy of it; the vllm engine loads the model path itself. Either way the engine then holds the
        actor's weights (a separate engine receives them at once: vllm may start from `load_format=dummy`).
        """
        rollout_cfg = self.arr.rollout
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self._model_class, self._model_config = type(model), model.config
        spec = EngineSpec(model_path=self.arr.model.path, device=self.model_device, rollout=rollout_cfg,
                          eos_token_ids=self._eos_ids(model), pad_token_id=pad, module=model,
                          share_module=self.model_device.type == "cpu" and self.strategy != "fsdp2",
                          trust_remote_code=self.arr.model.trust_remote_code, rank=self.rank,
                          world_size=self.world_size)
        return make_engine(rollout_cfg.name, spec)

    # ------------------------------------------------------------------ rollout
    @register(Dispatch.DP_SPLIT, pad=False)
    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses for each of this rank's prompts (the driver pads prompts to the DP size)."""
        if params.seed is not None:  # each rank draws its own samples
            params = dataclasses.replace(params, seed=params.seed + 1_000_003 * self.rank)
        start = time.perf_counter()
        self.rollout.wake()
        try:
            out = self.rollout.generate(prompts, params)
        finally:
            if self.arr.rollout.free_cache_engine:
                self.rollout.sleep()  # free the engine's memory while the actor trains
        out.meta.setdefault("metrics", {})["timing_s/generate_sequences"] = time.perf_counter() - start
        return out

    @register(Dispatch.REPLICATE)
    def sync_rollout_weights(self) -> float:
        """Make the rollout engine generate with the actor's current weights; returns seconds spent.

        A separate rollout copy receives the full weights in buckets of at most `weight_bucket_bytes`; under
        FSDP2 every parameter is all-gathered (a collective: every rank calls this together). A rank that never
        joins makes the others raise after the process-group timeout (DIST_TIMEOUT_S) instead of hanging.
        """
        start = time.perf_counter()
        if not self.rollout.shares_weights:
            try:
                self.rollout.update_weights(full_tensor_buckets(self.model, self.weight_bucket_bytes))
            except RuntimeError as err:
                if not is_distributed() or isinstance(err, RolloutEngineError):
                    raise
                raise RuntimeError(f"sync_rollout_weights on rank {self.rank}: gathering the actor's weights failed "
                                   f"after {time.perf_counter() - start:.1f} s (a collective times out after the "
                                   f"process group's timeout, {DIST_TIMEOUT_S:.0f} s by default): every rank must "
                                   f"call sync_rollout_weights together (Dispatch.REPLICATE); {err}") from err
        return time.perf_counter() - start

    # ------------------------------------------------------------------ forward passes

    def _log_probs(self, model, batch: Batch, *, with_entropy: bool, with_sum_pi_squared: bool = False,
                   sizes=None) -> Batch:
        R = batch["responses"].shape[1]
        temperature = batch.meta.get("temperature", self.arr.rollout.temperature)
        logp = torch.zeros(len(batch), R)
        entropy = torch.zeros(len(batch), R) if with_entropy else None
        sum_pi_sq = torch.zeros(len(batch), R) if with_sum_pi_squared else None
        model.eval()
        with torch.no_grad(), autocast(self.model_device, self.arr.actor.fsdp_config.dtype):
            for micro, rows in micro_batches_as_derived(batch, sizes or self.batches.old_log_prob):
                seq, r = trim_padding(micro, R)
                seq = {k: v.to(self.model_device) for k, v in seq.items()}
                lp, ent = response_logprobs(model, seq["input_ids"], seq["attention_mask"], seq["position_ids"], r,
                                            temperature=temperature, calculate_entropy=with_entropy)
                logp[rows] = pad_response(lp.cpu(), R)
                if with_entropy:
                    entropy[rows] = pad_response(ent.cpu(), R)
                if with_sum_pi_squared:
                    hidden = backbone_hidden_states(model, seq["input_ids"], seq["attention_mask"], seq["position_ids"])
                    logits = unwrap_model(model).get_output_embeddings()(hidden[:, -r - 1 : -1])
                    sum_pi_sq[rows] = pad_response(sum_pi_squared_from_logits(logits, temperature).cpu(), R)
        mask = batch["response_mask"].float()
        out = {"log_probs": logp * mask}
        if with_entropy:
            out["entropys"] = entropy * mask
        if with_sum_pi_squared:
            out["sum_pi_squared"] = sum_pi_sq * mask
        return Batch(out, meta={"temperature": temperature})

    @register(Dispatch.DP_SPLIT)
    def compute_log_prob(self, batch: Batch, with_sum_pi_squared: bool = False) -> Batch:
        """`old_log_probs` and `entropys` [N, R] under the current weights (+ `sum_pi_squared` when asked)."""
        out = self._log_probs(self.model, batch, with_entropy=True, with_sum_pi_squared=with_sum_pi_squared)
        result = Batch({"old_log_probs": out["log_probs"], "entropys": out["entropys"]})
        if with_sum_pi_squared:
            result["sum_pi_squared"] = out["sum_pi_squared"]
        return result

    @register(Dispatch.DP_SPLIT)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """`ref_log_prob` [N, R] under the frozen reference policy."""
        if self.ref_model is None:
            raise RuntimeError("no reference policy was loaded: set actor_rollout_ref.actor.use_kl_loss=True or "
                               "algorithm.use_kl_in_reward=True")
        sizes = self.batches.ref_log_prob or self.batches.old_log_prob
        return Batch({"ref_log_prob": self._log_probs(self.ref_model, batch, with_entropy=False,
                                                      sizes=sizes)["log_probs"]})

    # ------------------------------------------------------------------ training
    @register(Dispatch.DP_SPLIT, pad=False)
    def update_actor(self, batch: Batch) -> Batch:
        """PPO-style policy update over the step's samples; returns a row-less Batch carrying the metrics."""
        actor = self.arr.actor
        loss_fn = get_policy_loss(actor.policy_loss.loss_mode)
        loss_kwargs = {
            "clip_ratio": actor.clip_ratio, "clip_ratio_low": actor.clip_ratio_low,
            "clip_ratio_high": actor.clip_ratio_high, "clip_ratio_c": actor.clip_ratio_c,
            "tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg, "loss_scale_factor": actor.loss_scale_factor,
            **{k: v for k, v in vars(actor.policy_loss).items() if k != "loss_mode"},
        }
        temperature = batch.meta.get("temperature", self.arr.rollout.temperature)
        R = batch["responses"].shape[1]
        mini_size = max(1, actor.ppo_mini_batch_size * self.arr.rollout.n // self.world_size)
        metrics: dict[str, list[float]] = {}
        self.model.train()
        step_seed = actor.data_loader_seed + int(batch.meta.get("global_step", 0)) * 7919
        for _, mini in mini_batches(batch, mini_size, epochs=actor.ppo_epochs, shuffle=actor.shuffle, seed=step_seed):
            norms = all_reduce_sum(loss_normalisers(mini["response_mask"], actor.loss_agg_mode))
            global_tokens = max(float(norms["global_token_count"]), 1.0)
            # Every entry of `sums` is this rank's part of a global value: losses are already normalised by the
            # global counts, per-token means are weighted by (tokens of the micro-batch / global tokens).
            sums: defaultdict[str, float] = defaultdict(float)
            micros = micro_batches_as_derived(mini, self.batches.actor)
            for micro, _ in micros:
                seq, r = trim_padding(micro, R)
                seq = {k: v.to(self.model_device) for k, v in seq.items()}
                cols = {key: micro[key][:, :r].to(self.model_device) for key in RESPONSE_KEYS if key in micro}
                mask = cols["response_mask"].float()
                weight = float(mask.sum()) / global_tokens
                on_policy = "old_log_probs" not in cols  # the driver skipped the recompute: pi_old = pi_theta
                with autocast(self.model_device, actor.fsdp_config.dtype):
                    logp, entropy = response_logprobs(self.model, seq["input_ids"], seq["attention_mask"],
                                                      seq["position_ids"], r, temperature=temperature,
                                                      calculate_entropy=actor.entropy_coeff != 0 or on_policy)
                if on_policy:
                    cols["old_log_probs"] = logp.detach()
                    sums["actor/entropy"] += float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1)) * weight
                pg_loss, pg_metrics = loss_fn(old_log_prob=cols["old_log_probs"], log_prob=logp,
                                              advantages=cols["advantages"], response_mask=mask,
                                              rollout_is_weights=cols.get("rollout_is_weights"),
                                              loss_agg_mode=actor.loss_agg_mode,
                                              **norms, **loss_kwargs)
                loss = pg_loss
                agg = dict(loss_agg_mode=actor.loss_agg_mode, loss_scale_factor=actor.loss_scale_factor, **norms)
                if actor.entropy_coeff != 0:
                    entropy_loss = agg_loss(entropy, mask, **agg)
                    loss = loss - actor.entropy_coeff * entropy_loss
                    sums["actor/entropy_loss"] += float(entropy_loss.detach())
                if actor.use_kl_loss:
                    kl = agg_loss(kl_penalty(logp, cols["ref_log_prob"], actor.kl_loss_type), mask, **agg)
                    loss = loss + actor.kl_loss_coef * kl
                    sums["actor/kl_loss"] += float(kl.detach())
                (loss * self.world_size).backward()  # DDP/FSDP average gradients; the losses are global sums
                sums["actor/pg_loss"] += float(pg_loss.detach())
                for name, value in pg_metrics.items():
                    sums[f"actor/{name}"] += float(value) * weight
                if "rollout_log_probs" in cols:
                    for name, value in compute_offpolicy_metrics(logp.detach(), cols["rollout_log_probs"],
                                                                 mask).items():
                        sums[name] += float(value) / (len(micros) * self.world_size)
            finish_mini_batch(metrics, sums, self.model, self.optimizer, self.scheduler, actor.grad_clip, "actor")
        if actor.use_kl_loss:
            metrics["actor/kl_coef"] = [actor.kl_loss_coef]
        return Batch(meta={"metrics": metrics})

    # ------------------------------------------------------------------ checkpoints
    # state_dict / load_state_dict / save_sharded_checkpoint / load_sharded_checkpoint: TrainingStateCheckpoints
    def after_weights_loaded(self) -> None:
        """A loaded checkpoint's weights reach the rollout engine too."""
        self.sync_rollout_weights()

    @register(Dispatch.REPLICATE, collect=Collect.FIRST)
    def hf_model(self):
        """(policy as a plain Hugging Face module with full weights, tokenizer) on rank 0, None on the others.

        Under FSDP2 this gathers a full state dict (collective) into a CPU fp32 copy of the rollout's module.
        """
        if self.strategy != "fsdp2":
            return (unwrap_model(self.model), self.tokenizer) if self.rank == 0 else None
        state = full_state_dict(self.model)
        if self.rank != 0:
            return None
        model = self._model_class(self._model_config).to(device="cpu", dtype=torch.float32)
        model.load_state_dict(state)
        return model, self.tokenizer
