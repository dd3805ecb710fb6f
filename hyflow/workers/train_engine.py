"""TrainEngine: one object per trained (or frozen, forward-only) model of a worker role.

`TrainEngine(model, spec, mesh)`: the model, the role's spec (`hyflow.specs.TrainEngineSpec`, from `role_specs`)
and the role's one DeviceMesh (`hyflow.parallel.ParallelMesh`, from `ParallelDims.build_mesh`). The constructor
applies LoRA when configured, then `hyflow.parallel.parallelize` once (tensor and sequence parallelism, compile,
FSDP2 or DDP, in torchtitan's order), then builds the optimizer and LR schedule; `TrainEngine.from_spec(model, spec,
device=..., world_size=W)` builds the mesh of the spec's sizes over W ranks first. The engine owns what every role
repeats: autocast, micro-batching (by sample count or token budget, the sizes of the role's spec:
`hyflow.specs.RoleBatches`), sequence packing (`use_remove_padding`), the per-token forward of a micro-batch
(`hyflow.workers.engine_forward`), the PPO mini-batch loop with global loss normalisation, clipping and stepping,
and the weights a rollout engine receives. A role (actor, critic, SFT) says which columns its loss reads and what
the loss is:

    engine = TrainEngine.from_spec(model, spec.engine, device=device, world_size=W)
    values = engine.infer(batch, sizes)["values"]                          # no-grad pass, [N, R]
    metrics = engine.update(batch, plan, loss_fn, columns=("returns", "values", "response_mask"))

The loss function of `update` / `forward_backward` is called once per micro-batch as
`loss_fn(out, cols, ctx) -> (loss, parts)`: `out` the per-token outputs (`hyflow.workers.engine_forward`), `cols` the
micro-batch's columns named in `columns` cut to the same r response columns, `ctx` a `MicroContext` (the mini-batch's
global loss normalisers, its global token count, the micro-batch count, the data-parallel size). `loss` must already
be normalised by the global counts (`hyflow.algos.agg_loss(..., **ctx.norms)`): then the gradients summed over
micro-batches and ranks are the full mini-batch's gradient whatever the cut. `parts` maps metric names to this
micro-batch's share of the mini-batch value; they are summed over micro-batches and all-reduced over ranks.

The ranks of a sequence x tensor-parallel group (the mesh's `sp_tp` dimension) compute on the same rows: the engine
reports its `data_layout()` (data-parallel rank and size from the mesh), the controller cuts a batch once per
data-parallel rank and sends every rank of a group the same part (`@register(..., mesh=...)`,
`hyflow.controller.dispatch`); a group whose ranks got different rows is an error, not a silent mix.
Offload (verl's `fsdp_config.param_offload` / `optimizer_offload`): the parameters (and the optimizer state) live
in host memory between the passes a role wraps in `engine.on_device(optimizer=...)`; the state machine is
`hyflow.workers.offload`. The checkpoint state (full state dicts, sharded DCP directories) and the checkpoint
methods a role mixes in (`EngineCheckpoints`) are `hyflow.workers.state_io`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hyflow.algos import loss_normalisers
from hyflow.batch import Batch
from hyflow.controller.dispatch import DataLayout
from hyflow.models.flops import device_peak_flops, training_flops
from hyflow.models.forward import unwrap_model
from hyflow.models.lora import adapter_disabled, apply_lora, merged_named_tensors, parameter_counts
from hyflow.models.moe import RouterStats
from hyflow.models.vision import VisionTokens, is_vision_config, vision_tower
from hyflow.parallel import ParallelDims, ParallelizeSpec, ParallelMesh, parallelize
from hyflow.specs import TrainEngineSpec
from hyflow.workers.engine import (
    EXTREME_SUFFIXES,
    LossFn,
    MicroContext,
    UpdatePlan,
    all_reduce_metrics,
    all_reduce_sum,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    merge_metric,
    micro_batches_as_derived,
    mini_batches,
    pad_response,
    resolve_device,
)
from hyflow.workers.engine_forward import MicroForward, autocast
from hyflow.workers.engine_pipeline import PipelinePasses, pipeline_problem
from hyflow.workers.fsdp import (
    WEIGHT_BUCKET_BYTES,
    iter_full_tensors,
    parallel_strategy,
    tensor_buckets,
    uses_offload_policy,
)
from hyflow.workers.offload import Offload, OffloadMove
from hyflow.workers.state_io import CHECKPOINT_CONTENTS, EngineCheckpoints, EngineState

__all__ = ["CHECKPOINT_CONTENTS", "EngineCheckpoints", "LossFn", "MicroContext", "OffloadMove", "TrainEngine",
           "UpdatePlan", "autocast", "engine_dims", "resolve_device"]

HEADS = ("lm", "value", "score")


def engine_dims(spec: TrainEngineSpec, world_size: int) -> ParallelDims:
    """The parallel dimensions of a role's `world_size` ranks: its spec's sequence-, tensor-, expert- and
    pipeline-parallel sizes; `fsdp_config.fsdp_size` (verl's key: the ranks of one FSDP shard group, sp ranks
    included) between 1 and the ranks / (tp x pp) makes hybrid sharding (HSDP: dp_replicate = ranks / (fsdp_size x
    tp x pp) copies of groups of fsdp_size / sp data-parallel shards), -1 or more is plain FSDP; the data-parallel
    size the rest. Raises ValueError, naming the role and the keys, when they do not divide the ranks."""
    sp, tp = max(1, int(spec.ulysses_sequence_parallel_size)), max(1, int(spec.tensor_parallel_size))
    ep, fsdp_size = max(1, int(spec.expert_parallel_size)), int(getattr(spec.fsdp, "fsdp_size", -1))
    pp = max(1, int(spec.pipeline_parallel_size))
    sizes = (f"ulysses_sequence_parallel_size={spec.ulysses_sequence_parallel_size} x tensor_parallel_size="
             f"{spec.tensor_parallel_size} x pipeline_parallel_size={pp}")
    replicate = 1
    if 0 < fsdp_size < world_size // (tp * pp):
        if world_size % (fsdp_size * tp * pp) or fsdp_size % sp:
            raise ValueError(f"{spec.name}: fsdp_config.fsdp_size={fsdp_size} (hybrid sharding) must divide the role's "
                             f"{world_size} ranks / (tensor_parallel_size={tp} x pipeline_parallel_size={pp}) and be a "
                             f"multiple of ulysses_sequence_parallel_size={sp} (an FSDP shard group holds whole "
                             "sequence-parallel groups); or use -1 to shard over all of them")
        replicate = world_size // (fsdp_size * tp * pp)
    try:
        return ParallelDims(world_size=world_size, dp_replicate=replicate, sp=sp, tp=tp, ep=ep, pp=pp)
    except ValueError as error:
        raise ValueError(f"{spec.name}: {sizes} (expert_parallel_size={ep}, fsdp_size={fsdp_size}) must divide the "
                         f"role's {world_size} ranks ({error})") from error


class TrainEngine(MicroForward, PipelinePasses):
    """One model of a role, parallelized on `mesh` as `spec` says, optionally with LoRA, with its optimizer and LR
    schedule (none when `spec.optim` is None: a frozen model such as a separate reference policy). `device`: where
    the model's forwards run (default: where its parameters are)."""

    def __init__(self, model: nn.Module, spec: TrainEngineSpec, mesh: ParallelMesh, *,
                 device: torch.device | None = None):
        if spec.head not in HEADS:
            raise ValueError(f"head={spec.head!r}; use one of {HEADS}")
        self.spec, self.mesh, dims = spec, mesh, mesh.dims
        self.name, self.head = spec.name, spec.head
        self.device = device if device is not None else next(model.parameters()).device
        # progress(stage, done, total, unit, detail): called after each micro-batch of an update (the trainer's bar)
        self.progress: Callable[..., None] | None = None
        self._mini: tuple[int, int] | None = None  # (mini-batch, of) while `update` runs
        # checkpoint component names: `<prefix>model`, `<prefix>optimizer`, ... (default prefix `<name>_`)
        self.prefix = f"{self.name}_" if spec.checkpoint_prefix is None else spec.checkpoint_prefix
        self.world_size = dims.world_size
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.strategy = parallel_strategy(spec.strategy, self.world_size)
        self.grad_clip = spec.grad_clip
        # a vision-language model (hyflow.models.vision): its rows' images and M-RoPE positions go into every
        # forward, packed or padded
        self.vision = is_vision_config(getattr(model, "config", None))
        self.vision_tokens = VisionTokens.from_config(model.config) if self.vision else None
        self.use_remove_padding = bool(spec.use_remove_padding)
        # verl's use_prefix_grouper: in a packed micro-batch the samples of one prompt run its tokens once (a
        # vision-language prompt: its images once too, and only rows whose prompt images are equal share it)
        # (not under pipeline parallelism, whose stages run padded micro-batches: performance-only there)
        self.share_prompts = (bool(spec.share_prompts) and self.use_remove_padding
                              and int(spec.pipeline_parallel_size) == 1)
        self.compute_dtype = spec.compute_dtype or getattr(spec.fsdp, "dtype", "fp32")
        self.lora = spec.lora
        self._init_groups(dims)
        if spec.freeze_vision_tower and self.vision:  # verl's key: the vision tower keeps its weights
            vision_tower(model).requires_grad_(False)
        if self.lora is not None:
            model = apply_lora(model, self.lora, task="causal_lm" if self.head == "lm" else "value")
        trainable = spec.optim is not None
        if not trainable:
            model.requires_grad_(False).eval()
        self.module = model  # before wrapping (FSDP2 shards it in place; DDP holds it as .module)
        try:
            done = parallelize(model, dims, self._parallelize_spec(trainable), mesh)
        except ValueError as error:  # a model a dimension cannot split: say which role
            raise ValueError(f"{self.name}: {error}") from error
        # verl's use_torch_compile: the MLPs and norms compiled for this engine's own passes (hyflow.models.compile)
        self.model, self.compiled = done.model, done.compiled
        self.parallelized = done  # its sync_grads: what FSDP2 does not average (expert parallelism's experts)
        self.pipeline = self._pipeline_runner(done.pipeline)
        # a MoE model's router diagnostics in the update's metrics: <name>/moe/{load_balancing_loss,z_loss,...}
        self.router_stats = RouterStats(self.module)
        self.optimizer = self.scheduler = None
        if trainable:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = build_optimizer(params, spec.optim)
            self.scheduler = build_scheduler(self.optimizer, spec.optim, max(1, int(spec.total_optimizer_steps)))
        self.state_io = EngineState(name=self.name, model=self.model, module=self.module, optimizer=self.optimizer,
                                    scheduler=self.scheduler, lora=self.lora, prefix=self.prefix, rank=self.rank,
                                    pipeline=done.pipeline)
        # the offload state machine (hyflow.workers.offload): what is offloaded, then the initial move to the host
        self.offload = Offload(self.name, self.model, self.optimizer, self.device, self.strategy, spec.fsdp,
                               copies=lambda: self.offload_copies)

    @classmethod
    def from_spec(cls, model: nn.Module, spec: TrainEngineSpec, *, device: torch.device,
                  world_size: int = 1) -> TrainEngine:
        """The engine a role's `TrainEngineSpec` describes, for `model` on `device` (the worker resolved
        `spec.device` there before loading the model), on the mesh of the spec's sizes over `world_size` ranks
        (`engine_dims`; collective: every rank of the role calls it, in the same order)."""
        return cls(model, spec, engine_dims(spec, world_size).build_mesh(device.type), device=device)

    def _init_groups(self, dims: ParallelDims) -> None:
        """The mesh's groups the passes use (`sp_group`: Ulysses'; `row_group` / `group_size` / `group_rank`: the sp x
        tp group whose ranks share rows, None / 1 / 0 without), `dp_size`; what sp and tp need of the role."""
        where = f"{self.name}: ulysses_sequence_parallel_size={dims.sp}"
        if dims.sp > 1 and not self.use_remove_padding:
            raise ValueError(f"{where} needs sequence packing (use_remove_padding=true, as verl requires): the "
                             "sequence is cut across the ranks of the packed row")
        where = f"{self.name}: tensor_parallel_size={dims.tp}"
        if dims.tp > 1 and self.strategy != "fsdp2":
            raise ValueError(f"{where} composes with FSDP2 (strategy fsdp or fsdp2 on 2 or more ranks), not "
                             f"{self.strategy}")
        if dims.tp > 1 and self.lora is not None:
            raise ValueError(f"{where} with LoRA is not built yet (the adapters wrap the linears it splits); use "
                             "lora_rank=0 or tensor_parallel_size=1")
        if dims.tp > 1 and self.vision:
            raise ValueError(f"{where}: tensor parallelism of a vision-language model is not built yet; use 1")
        if dims.ep > 1 and self.lora is not None:  # (ep and HSDP without FSDP2: parallelize refuses them by name)
            raise ValueError(f"{self.name}: expert_parallel_size={dims.ep} with LoRA is not built yet; use lora_rank=0 "
                             "or expert_parallel_size=1")
        self.sp_size, self.tp_size, self.dp_size = dims.sp, dims.tp, dims.dp_size
        self.sp_group = self.mesh.group("sp")
        self.row_group = self.mesh.group("sp_tp")
        self.group_size, self.group_rank = dims.row_group_size, self.mesh.local_rank("sp_tp")
        # under pipeline parallelism the pp ranks share their rows too: the last stage's rank counts them (its
        # loss and metrics are the pipeline's), the first pp rank returns the results the controller collects
        self.pp_size, self.pp_rank = dims.pp, self.mesh.local_rank("pp")
        self.counts_rows = self.group_rank == 0 and self.pp_rank == self.pp_size - 1

    def _pipeline_runner(self, parts):
        """The `PipelineRunner` of this rank's stages (None without pipeline parallelism); raises ValueError for
        settings a pipeline does not run (`pipeline_problem`)."""
        if parts is None:
            return None
        problem = pipeline_problem(self)
        if problem is not None:
            raise ValueError(problem)
        from hyflow.parallel.fsdp import MIXED_PRECISION
        from hyflow.parallel.pipeline import PipelineRunner, schedule_name

        precision = self._parallelize_spec(self.spec.optim is not None).mixed_precision
        dtype = MIXED_PRECISION.get(precision) if precision else None
        dtype = dtype or next(p for p in self.module.parameters()).dtype
        config = unwrap_model(self.module).config
        hidden = (getattr(config, "text_config", None) or config).hidden_size
        schedule = schedule_name(self.spec.pipeline_schedule, max(1, int(self.spec.virtual_pipeline_parallel_size)))
        return PipelineRunner(parts, self.device, schedule, dtype, hidden)

    def data_layout(self) -> DataLayout:
        """This rank's place in the data-parallel split (`hyflow.controller.dispatch`): the mesh's `dp` rank and size;
        a group's first rank is the one whose results are collected."""
        return DataLayout(dp_rank=self.mesh.local_rank("dp"), dp_size=self.dp_size,
                          collects=self.group_rank == 0 and self.pp_rank == 0)

    def _check_group_rows(self, batch: Batch) -> None:
        """The ranks of a sequence x tensor-parallel group must hold the same rows (the group's data-parallel share):
        a fingerprint of the rows (count, token sums) compared over the group; raises RuntimeError naming the fix."""
        if self.row_group is None:
            return
        ids = batch["input_ids"].to(torch.float64)
        weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.float64)
        mine = torch.stack([torch.tensor(float(len(batch)), dtype=torch.float64), ids.sum(), (ids * weights).sum()])
        mine = mine.to(self.device)
        parts = [torch.zeros_like(mine) for _ in range(self.group_size)]
        dist.all_gather(parts, mine, group=self.row_group)
        if any(not torch.equal(part, parts[0]) for part in parts):
            rows = [int(part[0]) for part in parts]
            raise RuntimeError(f"{self.name}: the {self.group_size} ranks of a sequence x tensor-parallel group got "
                               f"different rows ({rows} rows): they compute on one data-parallel share, so the worker "
                               "method must be dispatched by this engine's mesh: @register(Dispatch.DP_SPLIT, "
                               "mesh=<name>) with the engine listed in the worker's MESHES")

    def _parallelize_spec(self, trainable: bool) -> ParallelizeSpec:
        """How `parallelize` wraps this model: the resolved strategy; FSDP2 mixed precision follows
        `fsdp_config.dtype` on accelerators (CPU models compute in fp32, as the engine's autocast does)."""
        fsdp = self.spec.fsdp
        return ParallelizeSpec(strategy=self.strategy,
                               mixed_precision=None if self.device.type == "cpu" else fsdp.dtype,
                               reshard_after_forward=fsdp.reshard_after_forward,
                               offload_policy=uses_offload_policy(self.strategy, fsdp),
                               compile=bool(self.spec.use_torch_compile), trainable=trainable,
                               virtual_stages=max(1, int(self.spec.virtual_pipeline_parallel_size)), head=self.head)

    # ------------------------------------------------------------------------------------------ describing

    def describe_parameters(self) -> str:
        """`<name>: trainable params T of N (x %), LoRA rank r | full fine-tuning` (unsharded counts)."""
        trainable, total = parameter_counts(self.model)
        share = 100.0 * trainable / max(total, 1)
        kind = f"LoRA rank {self.lora.rank}" if self.lora is not None else "full fine-tuning"
        return f"{self.name}: trainable params {trainable:,} of {total:,} ({share:.2f} %), {kind}{self.offload.describe()}"

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Forwards inside run the base model (LoRA off): the reference policy without a second copy."""
        if self.lora is None:
            raise RuntimeError(f"{self.name} has no LoRA adapter to disable")
        with adapter_disabled(self.model):
            yield

    # ------------------------------------------------------------------------------------------ offload

    # A move to the device a tensor is already on copies it anyway: what a move between host and accelerator does,
    # so that path (FSDP2's shard re-registration, the optimizer's references) runs on a CPU-only machine (tests).
    offload_copies = False

    def on_device(self, optimizer: bool = False):
        """Parameters (and with `optimizer` the optimizer state) on the device inside (`hyflow.workers.offload`)."""
        return self.offload.on_device(optimizer)

    def location(self) -> dict[str, str | None]:
        """Where the parameters and the optimizer state live now ("device" / "host"; `Offload.location`)."""
        return self.offload.location()

    @property
    def offload_log(self) -> list[OffloadMove]:
        return self.offload.moves

    @property
    def offload_counts(self) -> Counter[str]:
        return self.offload.counts

    # ------------------------------------------------------------------------------------------ inference

    def infer(self, batch: Batch, sizes, *, temperature: float = 1.0, with_entropy: bool = False,
              with_sum_pi_squared: bool = False, adapter: bool = True) -> dict[str, torch.Tensor]:
        """No-grad per-token outputs [N, R] (CPU, float32, 0 off the response mask) of every sample of `batch`,
        micro-batched as `sizes` says. `adapter=False` runs the base model of a LoRA model. Head "score":
        `scores` [N] (CPU, float32), one per sequence of `batch` (which needs no response columns)."""
        if self.head == "score":
            scores = torch.zeros(len(batch))
            self.model.eval()
            with torch.no_grad(), self.passes(packing=False):
                for micro, rows in micro_batches_as_derived(batch, sizes):
                    scores[rows] = self.forward_micro(micro, 0)[0]["scores"].float().cpu()
            return {"scores": scores}
        self._check_group_rows(batch)
        if self.pipeline is not None:
            if with_sum_pi_squared or not adapter:
                raise ValueError(f"{self.name}: pipeline parallelism does not compute sum_pi_squared or run the base "
                                 "model of an adapter; turn those off or use pipeline_parallel_size=1")
            self.model.eval()
            with torch.no_grad(), self.passes(packing=False):  # (compiled MLPs and norms under use_torch_compile)
                return self._pipeline_infer(batch, sizes, temperature=temperature, with_entropy=with_entropy)
        R = batch["responses"].shape[1]
        outputs: dict[str, torch.Tensor] = {}
        self.model.eval()
        off = self.adapter_disabled() if not adapter else contextlib.nullcontext()
        with torch.no_grad(), off, self.passes(packing=not with_sum_pi_squared):
            for micro, rows in micro_batches_as_derived(batch, sizes, share_prompts=self.share_prompts,
                                                        token_scale=self.sp_size):
                out, _ = self.forward_micro(micro, R, temperature=temperature, with_entropy=with_entropy,
                                            with_sum_pi_squared=with_sum_pi_squared)
                for key, value in out.items():
                    if value is None:
                        continue
                    if key not in outputs:
                        outputs[key] = torch.zeros(len(batch), R)
                    outputs[key][rows] = pad_response(value.float().cpu(), R)
        mask = batch["response_mask"].float()
        return {key: value * mask for key, value in outputs.items()}

    # ------------------------------------------------------------------------------------------ training

    def forward_backward(self, batch: Batch, sizes, loss_fn: LossFn, *, columns: Sequence[str], norms: dict,
                         temperature: float = 1.0, with_entropy: bool = False,
                         topk_column: str | None = None, counts: dict | None = None) -> dict[str, float]:
        """Forward and backward every micro-batch of `batch` (one mini-batch of this rank) with `loss_fn`;
        gradients accumulate in `.grad`. Returns this rank's metric parts, summed over the micro-batches (the least
        / greatest of a name ending in `_min` / `_max`: `merge_metric`)."""
        if self.pipeline is not None:
            if topk_column is not None:
                raise ValueError(f"{self.name}: pipeline parallelism does not gather a teacher's top-k log-probs yet; "
                                 "use pipeline_parallel_size=1 for top-k distillation")
            return self._pipeline_forward_backward(batch, sizes, loss_fn, columns=columns, norms=norms,
                                                   temperature=temperature, with_entropy=with_entropy, counts=counts)
        R = batch["responses"].shape[1]
        micros = micro_batches_as_derived(batch, sizes, share_prompts=self.share_prompts, token_scale=self.sp_size)
        ctx = MicroContext(norms=norms, global_tokens=max(float(norms["global_token_count"]), 1.0),
                           n_micro=len(micros), world_size=self.dp_size, counts=dict(counts or {}))
        sums: dict[str, float] = {}
        for done, (micro, _) in enumerate(micros, 1):
            # forward and backward (a checkpointed layer re-runs its attention in backward); a MoE model's routers hooked
            with self.passes(), self.router_stats:
                out, r = self.forward_micro(micro, R, temperature=temperature, with_entropy=with_entropy,
                                            topk_column=topk_column)
                cols = {key: micro[key][:, :r].to(self.device) for key in columns if key in micro}
                loss, parts = loss_fn(out, cols, ctx)
                if loss.requires_grad:  # DDP/FSDP average gradients over the ranks; the losses are global sums.
                    # The S x T ranks of a sequence x tensor group compute the same loss; FSDP2 averages over the dp x
                    # S ranks, where an sp group's average is its whole gradient (hyflow.models.ulysses): so the
                    # average is multiplied by the data-parallel size (world / (S x T)), not the world size
                    (loss * self.dp_size).backward()
            if self.router_stats:  # this rank's micro-batch means, summed to a mean over micro-batches and ranks
                weight = 1.0 / (len(micros) * self.dp_size)
                parts = {**parts, **{f"{self.name}/moe/{key}": value * weight
                                     for key, value in self.router_stats.take().items()}}
            for key, value in parts.items():
                sums[key] = merge_metric(key, sums.get(key), value)
            if self.progress is not None:
                mini = f"mini-batch {self._mini[0]}/{self._mini[1]}" if self._mini and self._mini[1] > 1 else ""
                self.progress(f"update_{self.name}", done, len(micros), "micro-batches", mini)
        return sums

    def step(self) -> dict[str, float]:
        """Clip the global gradient norm, step (skipped when the norm is not finite), advance the LR schedule."""
        self.parallelized.sync_grads()
        pipeline = self.parallelized.pipeline
        if pipeline is None:
            return clip_and_step(self.model, self.optimizer, self.scheduler, self.grad_clip)
        # the norm is over every stage's gradients (a tied embedding's two copies once)
        tied = pipeline.tied.param if not pipeline.tied.counts_in_norm else None
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.grad_clip, norm_group=pipeline.group,
                             norm_skip=tied)

    def peak_flops(self) -> float | None:
        """This device's dense bf16 peak FLOP/s (hyflow.models.flops), or None: on CPU and unknown GPUs no MFU."""
        if self.device.type != "cuda":
            return None
        return device_peak_flops(torch.cuda.get_device_name(self.device))

    def update(self, batch: Batch, plan: UpdatePlan, loss_fn: LossFn, *, columns: Sequence[str],
               temperature: float = 1.0, with_entropy: bool = False,
               topk_column: str | None = None) -> dict[str, list[float]]:
        """`plan.epochs` passes over this rank's `batch` in mini-batches, one optimizer step each; returns every
        mini-batch's global metric values (all-reduced, the same on every rank), plus `<prefix>/grad_norm`,
        `<prefix>/lr` and `<prefix>/grad_norm_skipped`."""
        self.model.train()
        self._check_group_rows(batch)
        metrics: dict[str, list[float]] = {}
        peak = self.peak_flops()
        start = time.perf_counter()
        n_mini = plan.epochs * -(-len(batch) // max(plan.mini_batch_size, 1))
        for j, (_, mini) in enumerate(mini_batches(batch, plan.mini_batch_size, epochs=plan.epochs,
                                                   shuffle=plan.shuffle, seed=plan.seed), 1):
            self._mini = (j, n_mini)
            local = loss_normalisers(mini["response_mask"], plan.loss_agg_mode)
            for column in plan.count_rows:
                local[f"rows:{column}"] = ((mini[column][:, 0] != 0).sum() if column in mini
                                           else torch.zeros((), dtype=torch.long))
            if not self.counts_rows:  # the group's rows are counted (and its metrics summed) once, by one rank
                local = {key: torch.zeros_like(value) for key, value in local.items()}
            norms = all_reduce_sum(local)
            counts = {key.removeprefix("rows:"): norms.pop(key) for key in [k for k in norms if k.startswith("rows:")]}
            sums = self.forward_backward(mini, plan.sizes, loss_fn, columns=columns, norms=norms,
                                         temperature=temperature, with_entropy=with_entropy,
                                         topk_column=topk_column, counts=counts)
            # a sequence-parallel group's sums count once (its first rank's); its extremes are every rank's alike
            sums = all_reduce_metrics({key: 0.0 if not self.counts_rows and not key.endswith(EXTREME_SUFFIXES) else value
                                       for key, value in sums.items()})
            stepped = self.step()
            for key, value in {**sums, **{f"{plan.metric_prefix}/{k}": v for k, v in stepped.items()}}.items():
                metrics.setdefault(key, []).append(value)
        if peak is not None:  # verl's perf/mfu/<role>: this rank's FLOPs over its time and its device's peak
            torch.cuda.synchronize(self.device)
            flops = training_flops(unwrap_model(self.model).config, batch["attention_mask"].sum(-1).tolist(),
                                   head=self.head, frozen_weights=self.lora is not None) * plan.epochs
            metrics[f"perf/mfu/{self.name}"] = [flops / ((time.perf_counter() - start) * peak)]
        return metrics

    # ------------------------------------------------------------------------------------------ weights out

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of the plain Hugging Face model, LoRA merged in; collective under FSDP2. Under pipeline
        parallelism every stage's tensors on the pipeline's first rank (`hyflow.parallel.pipeline`), none on the
        others."""
        pipeline = self.parallelized.pipeline
        if pipeline is not None:
            from hyflow.parallel.pipeline import gather_stage_tensors
            from hyflow.workers.engine import collective_device

            def local():
                for stage in pipeline.stages:  # an FSDP2 root stays gathered after a forward
                    if hasattr(stage, "reshard"):
                        stage.reshard()
                return iter_full_tensors(self.model)

            wanted = self.mesh.local_rank("dp") == 0 and self.group_rank == 0
            yield from gather_stage_tensors(pipeline, local, wanted=wanted, device=collective_device())
        elif self.lora is not None:
            yield from merged_named_tensors(self.model)
        else:
            yield from iter_full_tensors(self.model)

    def weight_buckets(self, bucket_bytes: int = WEIGHT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`named_full_tensors` in lists of at most `bucket_bytes` (a larger tensor is a bucket alone)."""
        return tensor_buckets(self.named_full_tensors(), bucket_bytes)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The plain model's full state dict (LoRA merged) on rank 0, `{}` elsewhere; collective (every rank walks
        the tensors; only rank 0 keeps copies)."""
        state = {}
        for name, tensor in self.named_full_tensors():
            if self.rank == 0:
                state[name] = tensor.detach().cpu().clone()
        return state

    # ------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self, contents=CHECKPOINT_CONTENTS) -> dict:
        """Full checkpoint components (`hyflow.workers.state_io.EngineState.state_dict`); collective."""
        return self.state_io.state_dict(contents)

    def load_state_dict(self, components: dict, contents=CHECKPOINT_CONTENTS) -> None:
        """Restore what `state_dict` returned, saved at any world size (`EngineState.load_state_dict`)."""
        self.state_io.load_state_dict(components, contents)

    def save_sharded(self, path, contents=CHECKPOINT_CONTENTS) -> None:
        """Every rank's shards (DCP) of the engine's state (`EngineState.save_sharded`); collective."""
        self.state_io.save_sharded(path, contents)

    def load_sharded(self, path, contents=CHECKPOINT_CONTENTS) -> None:
        """Read a `save_sharded` directory written at any world size."""
        self.state_io.load_sharded(path, contents)
