"""TrainEngine: one object per trained (or frozen, forward-only) model of a worker role.

It owns what every trained role repeats: the model (with LoRA adapters when configured), the parallel wrapper
(one device, DDP or FSDP2; `hyflow.workers.fsdp`), autocast, the optimizer and LR schedule, micro-batching
(by sample count or token budget, the sizes of the role's spec: `hyflow.specs.RoleBatches`), sequence
packing (`use_remove_padding`), the per-token forward of a micro-batch, the PPO mini-batch loop with global loss
normalisation, clipping and stepping, the weights a rollout engine receives, and the checkpoint state (full and
sharded). It is built from the role's spec (`hyflow.specs.TrainEngineSpec`, derived once by the config
layer's `role_specs`). A role (actor, critic, SFT) says which columns its loss reads and what the loss is:

    engine = TrainEngine.from_spec(model, spec.engine, device=device, world_size=W, rank=r)
    values = engine.infer(batch, sizes)["values"]                          # no-grad pass, [N, R]
    metrics = engine.update(batch, plan, loss_fn, columns=("returns", "values", "response_mask"))

Per-token outputs of a micro-batch (`forward_micro`), for a response span of the last R columns:
- head "lm": `log_probs` [b, r] (and `entropy`, `sum_pi_squared` when asked) of the response tokens at the
  sampling temperature (`hyflow.models.forward.response_logprobs`);
- head "value": `values` [b, r], V(s_t) read before response token t (`hyflow.models.forward.values_from_model`);
- head "score": `scores` [b], one per sequence, the classifier head on its last real token (a reward model,
  `hyflow.models.forward.reward_scores`); no response span (r = 0), so `infer` returns `scores` [N].
Padded path: the micro-batch is trimmed to the columns that hold a real token (`trim_padding`), so r <= R.
Packed path (`use_remove_padding=True`): the real tokens of all rows run as one row without pads
(`hyflow.models.packing`), position ids restarting per sequence, attention never crossing a sequence; r = R.
With `share_prompts` (verl's `actor.use_prefix_grouper`) the rows of a micro-batch that have the same prompt
pack it once and their responses attend to that copy: the same outputs and gradients, fewer tokens.

The loss function of `update` / `forward_backward` is called once per micro-batch as
`loss_fn(out, cols, ctx) -> (loss, parts)`: `out` the per-token outputs above, `cols` the micro-batch's columns
named in `columns` cut to the same r response columns, `ctx` a `MicroContext` (the mini-batch's global loss
normalisers, its global token count, the micro-batch count, the world size). `loss` must already be normalised by
the global counts (`hyflow.algos.agg_loss(..., **ctx.norms)`): then the gradients summed over micro-batches and
ranks are the full mini-batch's gradient whatever the cut. `parts` maps metric names to this micro-batch's
share of the mini-batch value; they are summed over micro-batches and all-reduced over ranks.

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
from dataclasses import dataclass, field

import torch
from torch import nn

from hyflow.algos import loss_normalisers
from hyflow.batch import Batch
from hyflow.models.flops import device_peak_flops, training_flops
from hyflow.models.forward import (
    backbone_hidden_states,
    response_logprobs,
    reward_scores,
    unwrap_model,
    values_from_model,
)
from hyflow.models.lora import adapter_disabled, apply_lora, merged_named_tensors, parameter_counts
from hyflow.models.vision import (
    VisionTokens,
    concat_multi_modal_inputs,
    image_placeholders,
    is_vision_config,
    placeholder_mask,
    split_prompt_images,
    vision_tower,
)
from hyflow.specs import TrainEngineSpec
from hyflow.workers.engine import (
    EXTREME_SUFFIXES,
    SEQUENCE_KEYS,
    all_reduce_metrics,
    all_reduce_sum,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    merge_metric,
    micro_batches_as_derived,
    mini_batches,
    pad_response,
    trim_padding,
)
from hyflow.workers.fsdp import (
    WEIGHT_BUCKET_BYTES,
    decoder_layers,
    iter_full_tensors,
    parallel_strategy,
    tensor_buckets,
    wrap_model,
)
from hyflow.workers.offload import Offload, OffloadMove
from hyflow.workers.state_io import CHECKPOINT_CONTENTS, EngineCheckpoints, EngineState

__all__ = ["CHECKPOINT_CONTENTS", "EngineCheckpoints", "LossFn", "MicroContext", "OffloadMove", "TrainEngine",
           "UpdatePlan", "autocast", "resolve_device"]

HEADS = ("lm", "value", "score")


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


@dataclass(frozen=True)
class UpdatePlan:
    """How one `update` call walks its batch: `epochs` passes in mini-batches of `mini_batch_size` samples (this
    rank's share), shuffled per epoch with `seed` when `shuffle`, each cut into micro-batches as `sizes` says
    (`RoleBatches` of `batch_arithmetic`); the loss normalisers follow `loss_agg_mode`. `count_rows`: columns
    whose rows with a nonzero first entry are counted over each mini-batch on all ranks (`MicroContext.counts`,
    e.g. the rows of online DPO's pairs)."""

    mini_batch_size: int
    epochs: int
    shuffle: bool
    seed: int
    sizes: object
    loss_agg_mode: str
    metric_prefix: str
    count_rows: tuple[str, ...] = ()


@dataclass(frozen=True)
class MicroContext:
    """What a loss function needs to know about the micro-batch it scores (see the module docstring)."""

    norms: dict
    global_tokens: float
    n_micro: int
    world_size: int
    counts: dict = field(default_factory=dict)  # UpdatePlan.count_rows: column -> its counted rows, all ranks

    def token_weight(self, mask: torch.Tensor) -> float:
        """The micro-batch's share of the mini-batch's tokens: weight of a per-token mean metric."""
        return float(mask.sum()) / self.global_tokens


LossFn = Callable[[dict, dict, MicroContext], tuple[torch.Tensor, dict]]

class TrainEngine:
    """One model of a role: wrapped for `strategy`, optionally with LoRA, with its optimizer and LR schedule
    (none when `optim` is None: a frozen model such as a separate reference policy)."""

    def __init__(self, model: nn.Module, *, name: str, head: str, device: torch.device, strategy: str,
                 fsdp_config, optim=None, total_optimizer_steps: int = 1, grad_clip: float | None = None,
                 use_remove_padding: bool = False, share_prompts: bool = False, use_torch_compile: bool = False,
                 lora=None, world_size: int = 1, rank: int = 0, compute_dtype: str | None = None,
                 checkpoint_prefix: str | None = None, freeze_vision_tower: bool = False,
                 sequence_parallel_size: int = 1, tensor_parallel_size: int = 1):
        if head not in HEADS:
            raise ValueError(f"head={head!r}; use one of {HEADS}")
        self.name, self.head, self.device = name, head, device
        # progress(stage, done, total, unit, detail): called after each micro-batch of an update (the trainer's bar)
        self.progress: Callable[..., None] | None = None
        self._mini: tuple[int, int] | None = None  # (mini-batch, of) while `update` runs
        # checkpoint component names: `<prefix>model`, `<prefix>optimizer`, ... (default prefix `<name>_`)
        self.prefix = f"{name}_" if checkpoint_prefix is None else checkpoint_prefix
        self.strategy, self.world_size, self.rank = strategy, world_size, rank
        self.grad_clip = grad_clip
        # a vision-language model (hyflow.models.vision): its rows' images and M-RoPE positions go into every
        # forward, packed or padded
        self.vision = is_vision_config(getattr(model, "config", None))
        self.vision_tokens = VisionTokens.from_config(model.config) if self.vision else None
        self.use_remove_padding = bool(use_remove_padding)
        # verl's use_prefix_grouper: in a packed micro-batch the samples of one prompt run its tokens once (a
        # vision-language prompt: its images once too, and only rows whose prompt images are equal share it)
        self.share_prompts = bool(share_prompts) and self.use_remove_padding
        self._init_sequence_parallel(int(sequence_parallel_size), model)
        self._init_tensor_parallel(int(tensor_parallel_size), model, lora, strategy)
        self.compute_dtype = compute_dtype or getattr(fsdp_config, "dtype", "fp32")
        self.lora = lora
        if freeze_vision_tower and self.vision:  # verl's key: the vision tower keeps its weights
            vision_tower(model).requires_grad_(False)
        if lora is not None:
            model = apply_lora(model, lora, task="causal_lm" if head == "lm" else "value")
        trainable = optim is not None
        if not trainable:
            model.requires_grad_(False).eval()
        self.module = model  # before wrapping (FSDP2 shards it in place; DDP holds it as .module)
        mesh = None
        if self.tp_mesh is not None:  # split each layer over the tp dimension, then FSDP2 over the dp dimension
            from hyflow.models.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, decoder_layers(model), self.tp_mesh["tp"])
            mesh = self.tp_mesh["dp"]
        self.model = wrap_model(model, strategy, fsdp_config, trainable=trainable, mesh=mesh)
        # verl's use_torch_compile: the MLPs and norms compiled for this engine's own passes (hyflow.models.compile)
        self.compiled = None
        if use_torch_compile:
            from hyflow.models.compile import CompiledModules

            self.compiled = CompiledModules(self.model)
        self.optimizer = self.scheduler = None
        if trainable:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = build_optimizer(params, optim)
            self.scheduler = build_scheduler(self.optimizer, optim, max(1, int(total_optimizer_steps)))
        self.state_io = EngineState(name=name, model=self.model, module=self.module, optimizer=self.optimizer,
                                    scheduler=self.scheduler, lora=lora, prefix=self.prefix, rank=rank)
        self._init_offload(fsdp_config)

    @classmethod
    def from_spec(cls, model: nn.Module, spec: TrainEngineSpec, *, device: torch.device, world_size: int = 1,
                  rank: int = 0) -> TrainEngine:
        """The engine a role's `TrainEngineSpec` describes, for `model` on `device` (the worker resolved
        `spec.device` there before loading the model), as rank `rank` of `world_size`: the spec's strategy is
        resolved against the world size (`parallel_strategy`: one device runs unwrapped)."""
        return cls(model, name=spec.name, head=spec.head, device=device,
                   strategy=parallel_strategy(spec.strategy, world_size), fsdp_config=spec.fsdp, optim=spec.optim,
                   total_optimizer_steps=spec.total_optimizer_steps, grad_clip=spec.grad_clip,
                   use_remove_padding=spec.use_remove_padding, share_prompts=spec.share_prompts,
                   use_torch_compile=spec.use_torch_compile, lora=spec.lora, world_size=world_size, rank=rank,
                   compute_dtype=spec.compute_dtype, checkpoint_prefix=spec.checkpoint_prefix,
                   freeze_vision_tower=spec.freeze_vision_tower,
                   sequence_parallel_size=spec.ulysses_sequence_parallel_size,
                   tensor_parallel_size=spec.tensor_parallel_size)

    def _init_sequence_parallel(self, size: int, model: nn.Module) -> None:
        """Ulysses sequence parallelism over groups of `size` consecutive ranks (`hyflow.workers.
        sequence_parallel`, `hyflow.models.ulysses`): the ranks of a group hold the group's rows and each runs a
        slice of every packed row; the data-parallel size is world_size / size."""
        self.sp_size = max(1, size)
        self.dp_size = self.world_size // self.sp_size
        self.sp_group = None
        self.sp_rank = 0
        if self.sp_size == 1:
            return
        where = f"{self.name}: ulysses_sequence_parallel_size={self.sp_size}"
        if self.world_size % self.sp_size:
            raise ValueError(f"{where} must divide the role's {self.world_size} ranks")
        if not self.use_remove_padding:
            raise ValueError(f"{where} needs sequence packing (use_remove_padding=true, as verl requires): the "
                             "sequence is cut across the ranks of the packed row")
        heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
        if heads is not None and heads % self.sp_size:
            raise ValueError(f"{where} must divide the model's {heads} attention heads (each rank attends with "
                             f"heads / {self.sp_size} of them)")
        from hyflow.workers.sequence_parallel import new_groups

        self.sp_group = new_groups(self.world_size, self.rank, self.sp_size)
        self.sp_rank = self.rank % self.sp_size

    def _init_tensor_parallel(self, size: int, model: nn.Module, lora, strategy: str) -> None:
        """Tensor parallelism over groups of `size` consecutive ranks (`hyflow.models.tensor_parallel`): the ranks
        of a group hold the group's rows (as a Ulysses group does) and each runs its share of every layer's heads
        and MLP columns; FSDP2 shards over the data-parallel dimension; data-parallel size = world_size / size.

        `row_group` / `group_size` / `group_rank`: the ranks that share rows (the Ulysses or the tensor-parallel
        group; None / 1 / 0 without either)."""
        self.tp_size = max(1, size)
        self.tp_mesh = None
        self.row_group, self.group_size, self.group_rank = self.sp_group, self.sp_size, self.sp_rank
        if self.tp_size == 1:
            return
        where = f"{self.name}: tensor_parallel_size={self.tp_size}"
        if self.world_size % self.tp_size:
            raise ValueError(f"{where} must divide the role's {self.world_size} ranks")
        if self.sp_size > 1:
            raise ValueError(f"{where} with ulysses_sequence_parallel_size={self.sp_size}: both at once are not "
                             "built yet; use one of them")
        if strategy != "fsdp2":
            raise ValueError(f"{where} composes with FSDP2 (strategy fsdp or fsdp2 on 2 or more ranks), not "
                             f"{strategy}")
        if lora is not None:
            raise ValueError(f"{where} with LoRA is not built yet (the adapters wrap the linears it splits); use "
                             "lora_rank=0 or tensor_parallel_size=1")
        if self.vision:
            raise ValueError(f"{where}: tensor parallelism of a vision-language model is not built yet; use 1")
        from hyflow.models.tensor_parallel import tp_mesh, tp_problem

        problem = tp_problem(model, decoder_layers(model), self.tp_size)
        if problem is not None:
            raise ValueError(f"{self.name}: {problem}")
        self.tp_mesh = tp_mesh(next(model.parameters()).device.type, self.world_size, self.tp_size)
        self.dp_size = self.world_size // self.tp_size
        self.row_group = self.tp_mesh["tp"].get_group()
        self.group_size, self.group_rank = self.tp_size, self.tp_mesh["tp"].get_local_rank()

    def _sp(self):
        """The sequence-parallel block of a packed forward (a no-op without sequence parallelism)."""
        from hyflow.models.ulysses import sequence_parallel

        return sequence_parallel(self.sp_group)

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

    def _init_offload(self, fsdp_config) -> None:
        """The offload state machine (`hyflow.workers.offload`): what is offloaded, then the initial move to the
        host."""
        self.offload = Offload(self.name, self.model, self.optimizer, self.device, self.strategy, fsdp_config,
                               copies=lambda: self.offload_copies)

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

    # ------------------------------------------------------------------------------------------ forward

    @contextlib.contextmanager
    def passes(self, packing: bool = True) -> Iterator[None]:
        """The context this engine's forwards (and their backward, which may recompute layers under gradient
        checkpointing) run in: the model attends within each packed sequence (`hyflow.models.packing`) when
        packing, and its MLPs and norms run compiled under use_torch_compile (`hyflow.models.compile`)."""
        with contextlib.ExitStack() as stack:
            if self.use_remove_padding and packing:
                from hyflow.models.packing import packed_attention

                stack.enter_context(packed_attention(self.model))
            if self.compiled is not None:
                stack.enter_context(self.compiled.active())
            yield

    def forward_micro(self, micro: Batch, response_length: int, *, temperature: float = 1.0,
                      with_entropy: bool = False, with_sum_pi_squared: bool = False,
                      topk_column: str | None = None) -> tuple[dict, int]:
        """Per-token outputs of one micro-batch over its response span (module docstring); returns (outputs, r).
        `topk_column`: a [N, R, K] column of token ids (a teacher's top-k); the outputs then hold `topk_log_probs`
        (this model's log-probs at those ids) and `own_topk_ids` ([.., r, K] each)."""
        R = response_length
        if self.head == "score":
            seq = {key: micro[key].to(self.device) for key in SEQUENCE_KEYS}
            with autocast(self.device, self.compute_dtype):
                return {"scores": reward_scores(self.model, seq["input_ids"], seq["attention_mask"],
                                                seq["position_ids"])}, 0
        if self.sp_group is not None and with_sum_pi_squared:
            raise ValueError(f"{self.name}: sum_pi_squared (the entropy-change metrics) runs the padded forward, "
                             "which sequence parallelism (ulysses_sequence_parallel_size > 1) does not split; turn "
                             "those metrics off or use ulysses_sequence_parallel_size=1")
        if self.use_remove_padding and not with_sum_pi_squared:
            with self._sp():
                return self._packed_micro(micro, R, temperature, with_entropy, topk_column)
        seq, r = trim_padding(micro, R)
        seq = {k: v.to(self.device) for k, v in seq.items()}
        images = self._images(micro)
        # generated image-pad tokens are text to the model, as they were to the rollout engine (placeholder_mask)
        placeholders = (image_placeholders(self.model, placeholder_mask(
            seq["input_ids"], list(micro["multi_modal_inputs"]), self.vision_tokens)) if images
            else contextlib.nullcontext())
        with autocast(self.device, self.compute_dtype), placeholders:
            if self.head == "value":
                values = values_from_model(self.model, seq["input_ids"], seq["attention_mask"],
                                           seq["position_ids"], r, **images)
                return {"values": values}, r
            topk = {} if topk_column is None else {"topk_ids": micro[topk_column][:, :r].to(self.device)}
            logp, entropy, *gathered = response_logprobs(self.model, seq["input_ids"], seq["attention_mask"],
                                                         seq["position_ids"], r, temperature=temperature,
                                                         calculate_entropy=with_entropy, **topk, **images)
            out = {"log_probs": logp, "entropy": entropy}
            if gathered:
                out["topk_log_probs"], out["own_topk_ids"] = gathered
            if with_sum_pi_squared:
                from hyflow.algos import sum_pi_squared_from_logits

                hidden = backbone_hidden_states(self.model, seq["input_ids"], seq["attention_mask"],
                                                seq["position_ids"], **images)
                logits = unwrap_model(self.model).get_output_embeddings()(hidden[:, -r - 1 : -1])
                out["sum_pi_squared"] = sum_pi_squared_from_logits(logits, temperature)
        return out, r

    def _packed_micro(self, micro: Batch, R: int, temperature: float, with_entropy: bool,
                      topk_column: str | None = None) -> tuple[dict, int]:
        """`forward_micro` on the packed path (sequence-parallel inside `self._sp()`)."""
        from hyflow.models.packing import packed_response_logprobs, packed_values

        ids = micro["input_ids"].to(self.device)
        mask = micro["attention_mask"].to(self.device)
        images = self._images(micro)
        vision = {}
        if self.vision:  # M-RoPE positions, the rows' images and the tokens that take their features
            rows = list(micro["multi_modal_inputs"]) if images else None
            image_mask = placeholder_mask(ids, rows, self.vision_tokens) if images else None
            vision = {"position_ids": micro["position_ids"].to(self.device), "images": images,
                      "image_mask": image_mask}
            if images and self.share_prompts:  # each part with its packed token
                vision["images"] = None
                vision["image_parts"] = split_prompt_images(
                    rows, image_mask[:, : ids.shape[1] - R].sum(-1).tolist(), self.vision_tokens.spatial_merge_size)
        with autocast(self.device, self.compute_dtype):
            if self.head == "value":
                return {"values": packed_values(self.model, ids, mask, R, share_prompts=self.share_prompts,
                                                **vision)}, R
            topk = {} if topk_column is None else {"topk_ids": micro[topk_column].to(self.device)}
            logp, entropy, *gathered = packed_response_logprobs(self.model, ids, mask, R, temperature=temperature,
                                                                calculate_entropy=with_entropy,
                                                                share_prompts=self.share_prompts, **topk, **vision)
        out = {"log_probs": logp, "entropy": entropy}
        if gathered:
            out["topk_log_probs"], out["own_topk_ids"] = gathered
        return out, R

    def _images(self, micro: Batch) -> dict[str, torch.Tensor]:
        """The micro-batch's image inputs for the model call (`pixel_values`, `image_grid_thw`), {} without."""
        if not self.vision or "multi_modal_inputs" not in micro.non_tensors:
            return {}
        images = concat_multi_modal_inputs(list(micro["multi_modal_inputs"]))
        return {key: value.to(self.device) for key, value in images.items()}

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
        own = None
        if self.row_group is not None:  # the group's rows, computed sequence- or tensor-parallel; this rank
            from hyflow.workers.sequence_parallel import gather_rows  # keeps its own

            batch, own, _ = gather_rows(batch, self.row_group)
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
        return {key: (value * mask)[own if own is not None else slice(None)] for key, value in outputs.items()}

    # ------------------------------------------------------------------------------------------ training

    def forward_backward(self, batch: Batch, sizes, loss_fn: LossFn, *, columns: Sequence[str], norms: dict,
                         temperature: float = 1.0, with_entropy: bool = False,
                         topk_column: str | None = None, counts: dict | None = None) -> dict[str, float]:
        """Forward and backward every micro-batch of `batch` (one mini-batch of this rank) with `loss_fn`;
        gradients accumulate in `.grad`. Returns this rank's metric parts, summed over the micro-batches (the least
        / greatest of a name ending in `_min` / `_max`: `merge_metric`)."""
        R = batch["responses"].shape[1]
        micros = micro_batches_as_derived(batch, sizes, share_prompts=self.share_prompts, token_scale=self.sp_size)
        ctx = MicroContext(norms=norms, global_tokens=max(float(norms["global_token_count"]), 1.0),
                           n_micro=len(micros), world_size=self.dp_size, counts=dict(counts or {}))
        sums: dict[str, float] = {}
        for done, (micro, _) in enumerate(micros, 1):
            with self.passes():  # forward and backward: a checkpointed layer re-runs its attention in backward
                out, r = self.forward_micro(micro, R, temperature=temperature, with_entropy=with_entropy,
                                            topk_column=topk_column)
                cols = {key: micro[key][:, :r].to(self.device) for key in columns if key in micro}
                loss, parts = loss_fn(out, cols, ctx)
                if loss.requires_grad:  # DDP/FSDP average gradients over the ranks; the losses are global sums.
                    # Sequence parallel: the S ranks of a group compute the same loss, and the group's average is
                    # its whole gradient (hyflow.models.ulysses), so the average over all ranks is multiplied by
                    # the data-parallel size (world / S), not the world size
                    (loss * self.dp_size).backward()
            for key, value in parts.items():
                sums[key] = merge_metric(key, sums.get(key), value)
            if self.progress is not None:
                mini = f"mini-batch {self._mini[0]}/{self._mini[1]}" if self._mini and self._mini[1] > 1 else ""
                self.progress(f"update_{self.name}", done, len(micros), "micro-batches", mini)
        return sums

    def _group_rows(self, batch: Batch, mini_batch_size: int) -> Batch:
        """Sequence parallel: the rows of this rank's group for an update, each mini-batch's slices together (the
        dispatcher gave each rank the same slice of every mini-batch; `hyflow.workers.sequence_parallel`).
        `mini_batch_size`: the rows of a mini-batch of the group (per data-parallel rank)."""
        from hyflow.workers.sequence_parallel import gather_rows, mini_batch_order

        rows, _, lengths = gather_rows(batch, self.row_group)
        size = self.group_size
        order = mini_batch_order(lengths, mini_batch_size // size) if mini_batch_size % size == 0 else None
        return rows if order is None else rows[order]

    def step(self) -> dict[str, float]:
        """Clip the global gradient norm, step (skipped when the norm is not finite), advance the LR schedule."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.grad_clip)

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
        if self.row_group is not None:
            batch = self._group_rows(batch, plan.mini_batch_size)
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
            if self.group_rank:  # the group's rows are counted (and its metrics summed) once, by its first rank
                local = {key: torch.zeros_like(value) for key, value in local.items()}
            norms = all_reduce_sum(local)
            counts = {key.removeprefix("rows:"): norms.pop(key) for key in [k for k in norms if k.startswith("rows:")]}
            sums = self.forward_backward(mini, plan.sizes, loss_fn, columns=columns, norms=norms,
                                         temperature=temperature, with_entropy=with_entropy,
                                         topk_column=topk_column, counts=counts)
            # a sequence-parallel group's sums count once (its first rank's); its extremes are every rank's alike
            sums = all_reduce_metrics({key: 0.0 if self.group_rank and not key.endswith(EXTREME_SUFFIXES) else value
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
        """(name, full tensor) of the plain Hugging Face model, LoRA merged in; collective under FSDP2."""
        if self.lora is not None:
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
