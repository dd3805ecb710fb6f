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

Offload (the hybrid engine's state machine, as verl's fsdp_workers): with `actor.fsdp_config.param_offload` the
actor's parameters (with `optimizer_offload` its optimizer state) live in host memory between uses and come to the
device only for `compute_log_prob`, the weight sync and checkpoints (parameters), and `update_actor` (both), so the
rollout generates while the actor holds no device memory; `ref.fsdp_config.param_offload` does the same for the
reference around `compute_ref_log_prob` (`TrainEngine.on_device`). A step then moves: old log-probs (actor params
in, out), ref (ref params in, out), update (actor params and optimizer in, out), weight sync to a rollout copy of
its own (actor params in, out; verl gathers them when the next rollout starts: the same moves, one call earlier).

Several ranks (`world_size` > 1; `actor.strategy` fsdp or fsdp2 = FSDP2, ddp = DistributedDataParallel; see
`hyflow.workers.fsdp`): `init_model` joins the process group, shards the actor and the reference (the reference
has no optimizer), and gives the rollout engine a separate full copy. The driver splits each batch by rank
(DP_SPLIT); every rank trains on its share with globally normalised losses, and all-reduces the metrics, so
every rank reports the same global values. Checkpoint methods are collective (every rank calls them):
`state_dict` returns rank 0's full (unsharded) state dicts, `load_state_dict` loads full state dicts into any
world size, `save_sharded_checkpoint` / `load_sharded_checkpoint` write and read per-rank DCP shards.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import ClassVar

import torch

from hyflow.algos.distillation import uses_topk
from hyflow.algos.loss_terms import MicroBatchShare, TermInputs, compose_actor_loss
from hyflow.algos.online_preference import PAIR_COLUMNS
from hyflow.batch import Batch
from hyflow.controller import Collect, Dispatch, Worker, register
from hyflow.models.forward import unwrap_model
from hyflow.models.loading import load_causal_lm, load_tokenizer
from hyflow.rollout.base import RolloutEngineError, SamplingParams
from hyflow.rollout.build import build_rollout
from hyflow.specs import ActorLossSpec, ActorSpec
from hyflow.workers.engine import apply_full_determinism
from hyflow.workers.fsdp import (
    DIST_TIMEOUT_S,
    is_distributed,
    iter_full_tensors,
    maybe_init_distributed,
    parallel_strategy,
)
from hyflow.workers.rollout import RolloutStreamHost
from hyflow.workers.train_engine import (
    EngineCheckpoints,
    LossFn,
    MicroContext,
    TrainEngine,
    UpdatePlan,
    resolve_device,
)

RESPONSE_KEYS = ("response_mask", "old_log_probs", "advantages", "ref_log_prob", "rollout_is_weights",
                 "rollout_log_probs", "teacher_log_probs", "teacher_topk_log_probs", "teacher_topk_ids", *PAIR_COLUMNS)


class ActorRolloutRefWorker(RolloutStreamHost, EngineCheckpoints, Worker):
    """Policy training, generation and reference log-probs on one device (one rank of a data-parallel group).

    `spec`: the role's `ActorSpec` (the config layer's `role_specs` derives it); `tokenizer`: the policy's, when
    the driver already loaded it (else `init_model` loads it)."""

    # the log-prob passes and the update split their batches by their engine's mesh (its data-parallel ranks)
    MESHES: ClassVar[dict[str, str]] = {"actor": "engine", "ref": "ref"}

    def __init__(self, spec: ActorSpec, tokenizer=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.tokenizer = tokenizer
        self.model_device = resolve_device(spec.engine.device, self.local_rank)

    def set_progress(self, progress) -> None:
        """In-step progress (a plain callable `progress(stage, done, total, unit, detail)`, the trainer's bar; None
        to stop): the rollout's finished trajectories and tokens, the update's micro-batches. In-process only."""
        for target in (getattr(self, "agent_loops", None), getattr(self, "stream_manager", None),
                       getattr(self, "engine", None)):
            if target is not None:
                target.progress = progress

    # ------------------------------------------------------------------ set-up
    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        """Load the policy into a TrainEngine (LoRA, wrapper, optimizer, LR schedule over the spec's optimizer
        steps), the reference policy and the rollout engine; the micro-batch sizes of every pass are the spec's
        (the batch arithmetic printed at start).

        With several ranks: join the process group, give the rollout engine its own full copy, then shard the
        actor and the reference (FSDP2) or wrap the actor in DDP. With LoRA and no `ref.model.path` the
        reference is the actor with its adapter disabled (no second copy of the weights).
        """
        spec = self.spec
        self.strategy = parallel_strategy(spec.engine.strategy, self.world_size)
        apply_full_determinism(spec.full_determinism)
        maybe_init_distributed(self)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(spec.model.tokenizer_path or spec.model.path,
                                            trust_remote_code=spec.model.trust_remote_code,
                                            chat_template=spec.model.custom_chat_template)
        torch.manual_seed(spec.seed)
        model = load_causal_lm(spec.model.path, dtype="float32", trust_remote_code=spec.model.trust_remote_code,
                               override_config=dict(spec.model.override_config),
                               enable_gradient_checkpointing=spec.model.enable_gradient_checkpointing,
                               device=self.model_device)
        ref_model = self._load_reference(model)
        self.weight_bucket_bytes = spec.rollout.weight_bucket_bytes
        self.rollout, self.agent_loops = self._build_rollout(model)
        if spec.rollout.stream:
            self._build_stream(model)
        self.engine = TrainEngine.from_spec(model, spec.engine, device=self.model_device,
                                            world_size=self.world_size)
        self.model = self.engine.model
        if self.rank == 0:
            self._describe_engine()
        if not self.rollout.shares_weights:
            self.sync_rollout_weights()  # collective under FSDP2: every rank is here
        self.ref = None
        if ref_model is not None:
            self.ref = TrainEngine.from_spec(ref_model, spec.ref, device=self.model_device,
                                             world_size=self.world_size)
        elif spec.ref is not None:
            self.ref = self.engine  # LoRA: the reference is the actor with its adapter disabled

    def _load_reference(self, model):
        """The reference policy's own model (before the actor is wrapped): loaded from `ref_model_path`, else a
        copy of the policy; None when no KL term needs one, or with LoRA (the actor with its adapter off)."""
        spec = self.spec
        if spec.ref is None:
            return None
        if spec.ref_model_path:
            return load_causal_lm(spec.ref_model_path, dtype="float32", device=self.model_device,
                                  trust_remote_code=spec.model.trust_remote_code)
        return copy.deepcopy(model) if spec.engine.lora is None else None

    def _describe_engine(self) -> None:
        """Print the trainable parameters and, with use_torch_compile, what compiles (rank 0, at start)."""
        print(self.engine.describe_parameters(), flush=True)
        if self.engine.compiled is not None:
            print(f"actor: use_torch_compile: {len(self.engine.compiled.modules)} modules "
                  f"({', '.join(self.engine.compiled.names)}) compile at their first update / log-prob pass "
                  f"(seconds, once)", flush=True)

    def _build_rollout(self, model, *, engine: str | None = None, share_module: bool | None = None):
        """(engine, agent loop) of this rank (`hyflow.rollout.build.build_rollout`; engine: the rollout's name).

        The hf engine generates with the actor's own module in one CPU process, or DDP on CPU (zero copy), else
        with a copy of it; the vllm engine loads the model path itself. Either way the engine then holds the
        actor's weights (a separate engine receives them at once: vllm may start from `load_format=dummy`).
        """
        self._model_class, self._model_config = type(model), model.config
        if share_module is None:
            share_module = self.model_device.type == "cpu" and self.strategy != "fsdp2"
        built = build_rollout(self.spec.rollout, self.tokenizer, device=self.model_device, module=model,
                              share_module=share_module, rank=self.rank, world_size=self.world_size, engine=engine)
        return built.engine, built.agent_loops

    def _build_stream(self, model) -> None:
        """Asynchronous training with the rollout in this process: a second hf engine with its own copy of the
        weights, which change only when the scheduler pushes them (`stream_sync_weights`). hf because a second
        engine in the process must not hold a second model runtime (async_training with vllm gives the rollout a
        pool of its own: rollout.n_gpus_per_node)."""
        self.stream_engine, self.stream_manager = self._build_rollout(model, engine="hf", share_module=False)

    # ------------------------------------------------------------------ rollout
    @register(Dispatch.DP_SPLIT)
    def generate_sequences(self, prompts: Batch, params: SamplingParams, reward_channel=None) -> Batch:
        """Sample `params.n` responses for each of this rank's prompts (the driver pads prompts to the DP size).

        `reward_channel` (the reward loop's, `hyflow.rewards.reward_loop.RewardChannel`): each trajectory is put
        into it the moment it finishes, so the driver scores it while the rest of the rollout runs."""
        if params.seed is not None:  # each rank draws its own samples
            params = dataclasses.replace(params, seed=params.seed + 1_000_003 * self.rank)
        on_finished = (None if reward_channel is None else
                       reward_channel.on_finished(prompts, params, self.agent_loops.trajectory_extra_info))
        start = time.perf_counter()
        self.rollout.wake()
        try:
            out = self.agent_loops.generate(prompts, params, on_finished)  # single-turn: one engine call, as before
        finally:
            if self.spec.rollout.section.free_cache_engine:
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
                with self.engine.on_device():  # gathered on the device, then back to the host when offloaded
                    self.rollout.update_weights(self.engine.weight_buckets(self.weight_bucket_bytes))
            except RuntimeError as err:
                if not is_distributed() or isinstance(err, RolloutEngineError):
                    raise
                raise RuntimeError(f"sync_rollout_weights on rank {self.rank}: gathering the actor's weights failed "
                                   f"after {time.perf_counter() - start:.1f} s (a collective times out after the "
                                   f"process group's timeout, {DIST_TIMEOUT_S:.0f} s by default): every rank must "
                                   f"call sync_rollout_weights together (Dispatch.REPLICATE); {err}") from err
        return time.perf_counter() - start

    @register(Dispatch.REPLICATE)
    def stream_sync_weights(self, version: int) -> float:
        """Asynchronous training in this process: copy the actor's weights into the stream's engine and tag what
        it decodes from now on with `version`; returns seconds spent."""
        start = time.perf_counter()
        with self.engine.on_device():
            self.stream_engine.update_weights(self.engine.weight_buckets(self.weight_bucket_bytes))
        if self.stream is not None:
            self.stream.set_version(version)
        return time.perf_counter() - start

    @register(Dispatch.REPLICATE, collect=Collect.FIRST)
    def export_weights(self) -> list | None:
        """The actor's full weights (LoRA merged) as buckets of at most `weight_bucket_bytes` of CPU tensors on rank
        0, None on the others; collective under FSDP2 (every rank gathers). For a rollout pool of its own."""
        with self.engine.on_device():
            buckets = [[(name, tensor.detach().to("cpu", copy=True)) for name, tensor in bucket]
                       for bucket in self.engine.weight_buckets(self.weight_bucket_bytes)]
        return buckets if self.rank == 0 else None

    # ------------------------------------------------------------------ forward passes

    @register(Dispatch.DP_SPLIT, mesh="actor")
    def compute_log_prob(self, batch: Batch, with_sum_pi_squared: bool = False) -> Batch:
        """`old_log_probs` and `entropys` [N, R] under the current weights (+ `sum_pi_squared` when asked)."""
        with self.engine.on_device():
            out = self.engine.infer(batch, self.spec.old_log_prob, temperature=self._temperature(batch),
                                    with_entropy=True, with_sum_pi_squared=with_sum_pi_squared)
        result = Batch({"old_log_probs": out["log_probs"], "entropys": out["entropy"]})
        if with_sum_pi_squared:
            result["sum_pi_squared"] = out["sum_pi_squared"]
        return result

    @register(Dispatch.DP_SPLIT, mesh="ref")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """`ref_log_prob` [N, R] under the frozen reference policy (the base model of a LoRA actor)."""
        if self.ref is None:
            raise RuntimeError("no reference policy was loaded: set actor_rollout_ref.actor.use_kl_loss=True or "
                               "algorithm.use_kl_in_reward=True")
        sizes = self.spec.ref_log_prob or self.spec.old_log_prob
        with self.ref.on_device():
            out = self.ref.infer(batch, sizes, temperature=self._temperature(batch),
                                 adapter=self.ref is not self.engine)
        return Batch({"ref_log_prob": out["log_probs"]})

    @register(Dispatch.REPLICATE)
    def update_reference(self) -> None:
        """The frozen reference policy takes the actor's current weights (trainer.ref_update_freq): each rank copies
        its own parameters and buffers (both models are sharded alike), no communication."""
        if self.ref is None or self.ref is self.engine:
            raise RuntimeError("update_reference needs a reference policy of its own (not the LoRA actor's base)")
        ref_tensors = {**dict(self.ref.module.named_parameters()), **dict(self.ref.module.named_buffers())}
        with torch.no_grad(), self.engine.on_device(), self.ref.on_device():
            for name, tensor in [*self.engine.module.named_parameters(), *self.engine.module.named_buffers()]:
                ref_tensors[name].data.copy_(tensor.data)

    # ------------------------------------------------------------------ training
    def _temperature(self, batch: Batch) -> float:
        """The sampling temperature the batch was generated at (the rollout's unless the driver says)."""
        return batch.meta.get("temperature", self.spec.rollout.section.temperature)

    @register(Dispatch.DP_MINI_BATCHES, pad=False, mesh="actor")
    def update_actor(self, batch: Batch) -> Batch:
        """PPO-style policy update over the step's samples; returns a row-less Batch carrying the metrics.
        Loss = policy loss (by name) - entropy_coeff * entropy + kl_loss_coef * KL (`actor_loss_fn`)."""
        loss = self.spec.loss
        on_policy = "old_log_probs" not in batch  # the driver skipped the recompute: pi_old = pi_theta
        sizes = self.spec.batches  # the derived arithmetic: samples of a mini-batch on this device, epochs
        plan = UpdatePlan(mini_batch_size=max(1, int(sizes.samples_per_device)), epochs=sizes.ppo_epochs,
                          shuffle=self.spec.shuffle, sizes=sizes,
                          seed=self.spec.data_loader_seed + int(batch.meta.get("global_step", 0)) * 7919,
                          loss_agg_mode=loss.loss_agg_mode, metric_prefix="actor",
                          count_rows=("pair_sign",) if loss.pair_preference is not None else ())
        topk = loss.distillation is not None and uses_topk(loss.distillation.loss_mode)
        with self.engine.on_device(optimizer=True):
            metrics = self.engine.update(batch, plan, actor_loss_fn(loss, on_policy), columns=RESPONSE_KEYS,
                                         temperature=self._temperature(batch),
                                         with_entropy=loss.entropy_coeff != 0 or on_policy,
                                         topk_column="teacher_topk_ids" if topk else None)
        if loss.use_kl_loss:
            metrics["actor/kl_coef"] = [loss.kl_loss_coef]
        return Batch(meta={"metrics": metrics})

    # ------------------------------------------------------------------ checkpoints
    # state_dict / load_state_dict / save_sharded_checkpoint / load_sharded_checkpoint: EngineCheckpoints
    def after_weights_loaded(self) -> None:
        """A loaded checkpoint's weights reach the rollout engine too."""
        self.sync_rollout_weights()

    @register(Dispatch.REPLICATE, collect=Collect.FIRST)
    def hf_model(self):
        """(policy as a plain Hugging Face module with full weights, LoRA merged, tokenizer) on rank 0, None on
        the others. Without FSDP2 or LoRA this is the trained module itself; else a CPU fp32 copy is built from
        the gathered (collective) full weights."""
        if self.strategy != "fsdp2" and self.engine.lora is None:
            return (unwrap_model(self.model), self.tokenizer) if self.rank == 0 else None
        with self.engine.on_device():
            state = self.engine.full_model_state()
        if self.rank != 0:
            return None
        model = self._model_class(self._model_config).to(device="cpu", dtype=torch.float32)
        expected = {name for name, _ in iter_full_tensors(model)}  # tied weights once, persistent buffers
        if set(state) != expected:
            raise RuntimeError(f"the gathered weights do not match {type(model).__name__}: missing "
                               f"{sorted(expected - set(state))[:4]}, unexpected {sorted(set(state) - expected)[:4]}")
        model.load_state_dict(state, strict=False)  # only the tied aliases (lm_head.weight) are not in `state`
        return model, self.tokenizer


def actor_loss_fn(loss: ActorLossSpec, on_policy: bool) -> LossFn:
    """The engine's loss function of one actor micro-batch (`TrainEngine.update`): the terms the spec names
    (`loss.terms`, with `loss.term_knobs()`), composed by `hyflow.algos.loss_terms.compose_actor_loss` on pi_old
    (`old_log_probs`, or with `on_policy` the forward itself, detached)."""
    knobs = loss.term_knobs()

    def loss_fn(out: dict, cols: dict, ctx: MicroContext) -> tuple[torch.Tensor, dict]:
        mask = cols["response_mask"].float()
        share = MicroBatchShare(ctx.norms, token_weight=ctx.token_weight(mask), n_micro=ctx.n_micro,
                                world_size=ctx.world_size, counts=ctx.counts)
        x = TermInputs(out, cols, old_log_prob=out["log_probs"].detach() if on_policy else cols["old_log_probs"],
                       response_mask=mask, share=share, loss_agg_mode=loss.loss_agg_mode,
                       loss_scale_factor=loss.loss_scale_factor)
        return compose_actor_loss(loss.terms, x, knobs, on_policy=on_policy)

    return loss_fn
