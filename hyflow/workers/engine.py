"""The training engine shared by the actor and the critic: optimizer, LR schedule, micro-batching, stepping.

Micro-batches come in two kinds (verl's knobs, same units):
- fixed: `micro_batch_size` samples per forward/backward on this device;
- dynamic (`use_dynamic_bsz`): samples are packed greedily, longest first, into micro-batches whose summed real
  token count stays under `max_token_len` per device; a sample longer than the budget is an error naming it.

Every micro-batch is trimmed to the columns that hold a real token in at least one of its rows (left padding of
the prompts, right padding of the responses), so compute follows the real lengths. Loss normalisation is the
caller's business (`hyflow.algos.loss_normalisers` over the whole mini-batch), which is what makes gradients
independent of how a mini-batch is cut.

Data parallelism (several ranks, each holding its share of the batch): the normaliser counts are summed over
the ranks (`all_reduce_sum`); under FSDP every forward is a collective, so ranks must run the same number of
micro-batches (`sync_micro_batch_count` splits dynamic ones up to the largest count); per-rank metric parts are
summed into global values (`all_reduce_metrics`); the gradient norm of FSDP2's DTensor shards is reduced to the
global norm before clipping (`clip_grad_norm`), so it equals the single-process norm.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hyflow.algos.metrics import MAX_SUFFIXES, MIN_SUFFIXES
from hyflow.batch import Batch

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def build_optimizer(params: Iterable[torch.nn.Parameter], optim) -> torch.optim.Optimizer:
    """`optim.optimizer` from module `optim.optimizer_impl` (default torch.optim.AdamW), built with lr,
    weight_decay, betas (when the class takes them) and `optim.override_optimizer_config`."""
    module_name, class_name = str(optim.optimizer_impl), str(optim.optimizer)
    if module_name == "torch.optim" and class_name.lower() == "adamw":
        class_name = "AdamW"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"optim.optimizer_impl={module_name!r} cannot be imported ({e}); install it or use "
                         "torch.optim") from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = [n for n, v in vars(module).items()
                 if isinstance(v, type) and issubclass(v, torch.optim.Optimizer) and v is not torch.optim.Optimizer]
        close = difflib.get_close_matches(class_name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"optim.optimizer={class_name!r} is not an optimizer class in {module_name}.{hint} "
                         f"Optimizers there: {', '.join(sorted(names)) or 'none'}")
    kwargs = {"lr": optim.lr, "weight_decay": optim.weight_decay}
    if "betas" in inspect.signature(cls).parameters:
        kwargs["betas"] = tuple(optim.betas)
    kwargs.update(dict(getattr(optim, "override_optimizer_config", None) or {}))
    return cls(params, **kwargs)


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float = 0.0,
              num_cycles: float = 0.5) -> float:
    """LR multiplier at optimizer step `step`: linear warm-up from 0 over `warmup_steps`, then constant or cosine.

    cosine: `min + (1 - min) * 0.5 * (1 + cos(2 pi num_cycles p))` with progress p after warm-up (verl's form).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"optim.lr_scheduler_type={schedule!r} is not supported; use constant or cosine")
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * min(progress, 1.0)))
    return max(0.0, min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def build_scheduler(optimizer: torch.optim.Optimizer, optim, total_optimizer_steps: int):
    """LambdaLR from `optim.lr_warmup_steps` (or `lr_warmup_steps_ratio` x total) and `lr_scheduler_type`."""
    warmup = optim.lr_warmup_steps
    if warmup is None or warmup < 0:
        warmup = int(optim.lr_warmup_steps_ratio * total_optimizer_steps)
    kwargs = dict(warmup_steps=warmup, total_steps=total_optimizer_steps, schedule=optim.lr_scheduler_type,
                  min_lr_ratio=optim.min_lr_ratio, num_cycles=optim.num_cycles)
    lr_lambda(0, **kwargs)  # validates the schedule name now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_lambda(step, **kwargs))


def sequence_lengths(batch: Batch) -> torch.Tensor:
    """Real tokens per sample (prompt + response)."""
    return batch["attention_mask"].sum(-1)


def _token_budget_items(batch: Batch, lengths: list[int], max_token_len: int,
                        share_prompts: bool) -> list[tuple[list[int], int]]:
    """What the token-budget bin packing places: (rows, tokens) items. One row each; with `share_prompts` (packed
    micro-batches that run a prompt once for its samples) the rows of one prompt as one item, costing the prompt
    once, cut into several items where the group exceeds the budget."""
    if not (share_prompts and "responses" in batch):
        return [([i], n_tok) for i, n_tok in enumerate(lengths)]
    from hyflow.models.packing import prompt_group_ids

    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    group = prompt_group_ids(batch["input_ids"], batch["attention_mask"], width).tolist()
    prompt_len = batch["attention_mask"][:, :width].sum(-1).tolist()
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group):
        members.setdefault(g, []).append(row)
    items = []
    for rows in members.values():
        chunk, cost = [], 0
        for i in rows:
            extra = lengths[i] - (prompt_len[i] if chunk else 0)
            if chunk and cost + extra > max_token_len:
                items.append((chunk, cost))
                chunk, cost, extra = [], 0, lengths[i]
            chunk.append(i)
            cost += extra
        items.append((chunk, cost))
    return items


def split_micro_batches(batch: Batch, *, micro_batch_size: int | None, use_dynamic_bsz: bool = False,
                        max_token_len: int | None = None, min_micro_batches: int = 1, share_prompts: bool = False
                        ) -> list[tuple[Batch, torch.Tensor]]:
    """Cut `batch` into micro-batches; returns (micro-batch, row indices into `batch`) pairs.

    Fixed: consecutive rows, `micro_batch_size` each (None = all rows at once). Dynamic: longest-first greedy
    bin packing under `max_token_len` real tokens per micro-batch, then the fullest bins (by rows) halved until
    there are at least `min_micro_batches` (data-parallel ranks must run the same number of forward passes
    under FSDP: see `sync_micro_batch_count`).
    """
    n = len(batch)
    if not use_dynamic_bsz:
        size = micro_batch_size or n
        return [(batch[i : i + size], torch.arange(i, min(i + size, n))) for i in range(0, n, size)]
    if not max_token_len:
        raise ValueError("use_dynamic_bsz needs a token budget (ppo_max_token_len_per_gpu / "
                         "log_prob_max_token_len_per_gpu)")
    lengths = sequence_lengths(batch).tolist()
    too_long = [(i, n_tok) for i, n_tok in enumerate(lengths) if n_tok > max_token_len]
    if too_long:
        _, n_tok = too_long[0]
        raise ValueError(f"a sample has {n_tok} tokens, more than the token budget of {max_token_len} per "
                         "micro-batch; raise ppo_max_token_len_per_gpu (it must cover max_prompt_length + "
                         "max_response_length)")
    bins: list[list[int]] = []
    loads: list[int] = []
    for rows, cost in sorted(_token_budget_items(batch, lengths, max_token_len, share_prompts), key=lambda x: -x[1]):
        for b, load in enumerate(loads):
            if load + cost <= max_token_len:
                bins[b].extend(rows)
                loads[b] += cost
                break
        else:
            bins.append(list(rows))
            loads.append(cost)
    if min_micro_batches > n:
        raise ValueError(f"cannot cut {n} samples into {min_micro_batches} micro-batches; every data-parallel rank "
                         "needs as many samples as the largest micro-batch count")
    while len(bins) < min_micro_batches:
        largest = max(range(len(bins)), key=lambda b: len(bins[b]))
        rows = bins.pop(largest)
        bins += [rows[0::2], rows[1::2]]  # rows are longest first: alternate to halve the tokens too
    return [(batch[torch.tensor(sorted(rows))], torch.tensor(sorted(rows))) for rows in bins]


def sync_micro_batch_count(batch: Batch, *, micro_batch_size: int | None, use_dynamic_bsz: bool = False,
                           max_token_len: int | None = None, share_prompts: bool = False
                           ) -> list[tuple[Batch, torch.Tensor]]:
    """`split_micro_batches` with the same number of micro-batches on every data-parallel rank.

    FSDP all-gathers parameters in every forward, so ranks must run equally many; fixed-size micro-batches of
    equal shares already do, dynamic ones are split further up to the largest count over the ranks.
    """
    micros = split_micro_batches(batch, micro_batch_size=micro_batch_size, use_dynamic_bsz=use_dynamic_bsz,
                                 max_token_len=max_token_len, share_prompts=share_prompts)
    if not use_dynamic_bsz:
        return micros
    target = all_reduce_max(len(micros))
    if target == len(micros):
        return micros
    return split_micro_batches(batch, micro_batch_size=micro_batch_size, use_dynamic_bsz=True,
                               max_token_len=max_token_len, min_micro_batches=target, share_prompts=share_prompts)


def micro_batches_as_derived(batch: Batch, sizes, *, share_prompts: bool = False,
                             token_scale: int = 1) -> list[tuple[Batch, torch.Tensor]]:
    """`sync_micro_batch_count` with the sizes the role spec carries for a pass (`hyflow.specs`
    `RoleBatches` or `ForwardBatches`): the numbers printed at start are the numbers that run, deprecated
    global knobs and each pass's own fallbacks included. `share_prompts`: token budgets count a prompt once for
    its samples, which stay together (`split_micro_batches`). `token_scale`: the token budget per device times this
    (Ulysses sequence parallelism over S devices: each holds 1/S of a micro-batch's tokens, so the group's budget is
    S times a device's, as verl's dp_actor computes it)."""
    micro = sizes.micro_batch_size_per_device
    budget = sizes.max_token_len_per_device
    return sync_micro_batch_count(batch, micro_batch_size=None if micro is None else max(1, int(micro)),
                                  use_dynamic_bsz=sizes.use_dynamic_bsz,
                                  max_token_len=None if budget is None else int(budget) * max(1, int(token_scale)),
                                  share_prompts=share_prompts)


def trim_padding(micro: Batch, response_length: int) -> tuple[dict[str, torch.Tensor], int]:
    """The sequence tensors cut to the columns holding a real token in some row; and the kept response length.

    Responses are the last `response_length` columns; right padding cut from them shortens the response span.
    """
    mask = micro["attention_mask"]
    used = mask.any(dim=0).nonzero().squeeze(-1)
    if used.numel() == 0:
        first, last = mask.shape[1] - 1, mask.shape[1] - 1
    else:
        first, last = int(used[0]), int(used[-1])
    prompt_width = mask.shape[1] - response_length
    first = min(first, prompt_width - 1)  # keep the prompt's last column: it predicts the first response token
    last = max(last, prompt_width)  # keep at least one response column
    trimmed = {key: micro[key][..., first : last + 1] for key in SEQUENCE_KEYS}  # position_ids may be [B, 4, L]
    return trimmed, last + 1 - prompt_width


def pad_response(values_BR: torch.Tensor, response_length: int) -> torch.Tensor:
    """Right-pad a [B, R'] per-response-token tensor with zeros back to [B, response_length]."""
    missing = response_length - values_BR.shape[1]
    return values_BR if missing == 0 else torch.nn.functional.pad(values_BR, (0, missing))


def collective_device() -> torch.device:
    """Where small tensors go for a collective: CPU under gloo (also `cpu:gloo,cuda:nccl`), the GPU under NCCL."""
    backend = str(dist.get_backend())
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum each tensor over the data-parallel group, in place (identity in one process)."""
    if _is_distributed():
        device = collective_device()
        for value in tensors.values():
            reduced = value.to(device)
            dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
            value.copy_(reduced)
    return tensors


EXTREME_SUFFIXES = MIN_SUFFIXES + MAX_SUFFIXES


def merge_metric(name: str, total: float | None, value: float) -> float:
    """One more contribution `value` to the metric `name`: the smaller for a name ending in `_min` or `/min`, the
    larger for `_max` or `/max` (verl's AggregationType.MIN / MAX, e.g. `distillation/loss_min`; the names
    `hyflow.algos.reduce_metrics` reduces so), else the sum (`total` None: none yet)."""
    if total is None:
        return float(value)
    if name.endswith(MIN_SUFFIXES):
        return min(total, float(value))
    if name.endswith(MAX_SUFFIXES):
        return max(total, float(value))
    return total + float(value)


def all_reduce_metrics(values: dict[str, float]) -> dict[str, float]:
    """Reduce scalar metric contributions over the data-parallel group: every rank gets the same global values.

    Sums, but the group's minimum / maximum of a name ending in `_min` or `/min` / `_max` or `/max`, as
    `merge_metric`. One float64 all-reduce of the sums and one of the extremes (the minima negated into a MAX), in
    sorted-name order, so every rank must hold the same names (they follow from the config and the batch columns,
    which all ranks share). Identity in one process.
    """
    if not _is_distributed() or not values:
        return dict(values)
    out = {}
    device = collective_device()
    extremes = sorted(name for name in values if name.endswith(EXTREME_SUFFIXES))
    sums = sorted(name for name in values if not name.endswith(EXTREME_SUFFIXES))
    for names, op in ((sums, dist.ReduceOp.SUM), (extremes, dist.ReduceOp.MAX)):
        if not names:
            continue
        signs = [-1.0 if name.endswith(MIN_SUFFIXES) else 1.0 for name in names]
        packed = torch.tensor([sign * float(values[name]) for sign, name in zip(signs, names, strict=True)],
                              dtype=torch.float64, device=device)
        dist.all_reduce(packed, op=op)
        out.update({name: sign * v for sign, name, v in zip(signs, names, packed.tolist(), strict=True)})
    return out


def all_reduce_max(value: int) -> int:
    """The largest `value` over the data-parallel group (identity in one process)."""
    if not _is_distributed():
        return value
    packed = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return int(packed.item())


def _by_mesh(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """`params` grouped by their gradient's (mesh, placements) (plain tensors one group): torch's norm and clip
    functions stack or batch per-tensor results, which DTensors of different meshes (tensor-parallel weights on
    (dp, tp) beside FSDP2-sharded norms on dp) or placements cannot be."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        key = (id(grad.device_mesh), tuple(grad.placements)) if isinstance(grad, DTensor) else "plain"
        groups.setdefault(key, []).append(param)
    return list(groups.values())


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, *, norm_group=None,
                   norm_skip: torch.nn.Parameter | None = None) -> torch.Tensor:
    """Total L2 norm ||g|| = sqrt(sum_p ||g_p||^2) over all gradients; scale them by min(1, max_norm / (||g|| + 1e-6)).

    FSDP2 gradients are DTensor shards: their norm is a DTensor, made a plain tensor (the global norm, the same
    on every rank and equal to the single-process norm) with `full_tensor()` before clipping. Under tensor
    parallelism the gradients live on different meshes (the split weights on (dp, tp), the rest on dp): each
    group of one mesh and layout gets its norm so, and the total is the root of their squares. Under pipeline
    parallelism each rank holds its stages' gradients: the squares are summed over `norm_group` (the pp ranks),
    `norm_skip` (the last stage's copy of a tied embedding, the same weight as the first stage's) left out of it.
    """
    from torch.distributed.tensor import DTensor

    groups = _by_mesh(params)
    parts = []
    for group in groups:
        counted = [p.grad for p in group if p is not norm_skip]
        if not counted:
            continue
        part = torch.nn.utils.get_total_norm(counted, norm_type=2.0)
        parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
    if not parts:
        parts = [torch.zeros((), device=params[0].grad.device if params else collective_device())]
    total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack([p.float() for p in parts]))
    if norm_group is not None:
        squared = total.float().pow(2).to(collective_device())
        dist.all_reduce(squared, group=norm_group)
        total = squared.sqrt().to(total.device)
    if math.isfinite(max_norm):
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, grad_clip: float | None, *, norm_group=None,
                  norm_skip: torch.nn.Parameter | None = None) -> dict[str, float]:
    """Clip the global gradient norm, step unless it is not finite (then skip, as verl does), advance the LR.
    `norm_group`, `norm_skip`: the pipeline's (`clip_grad_norm`)."""
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip and grad_clip > 0 else float("inf")
    if norm_group is not None:  # every pp rank joins the norm's all-reduce, with or without gradients
        grad_norm = clip_grad_norm(params or [], max_norm, norm_group=norm_group, norm_skip=norm_skip)
    else:
        grad_norm = clip_grad_norm(params, max_norm) if params else torch.tensor(0.0)
    skipped = not torch.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(grad_norm), "lr": lr, "grad_norm_skipped": float(skipped)}


def mini_batches(batch: Batch, mini_batch_size: int, *, epochs: int, shuffle: bool, seed: int):
    """(epoch, mini-batch) pairs: `epochs` passes over `batch` in mini-batches of `mini_batch_size` samples."""
    for epoch in range(epochs):
        if shuffle:
            generator = torch.Generator().manual_seed(seed + epoch)
            batch_e = batch[torch.randperm(len(batch), generator=generator)]
        else:
            batch_e = batch
        for part in batch_e.split(mini_batch_size):
            yield epoch, part


def apply_full_determinism(enabled: bool) -> None:
    """`fsdp_config.full_determinism`: deterministic kernels in this process (torch.use_deterministic_algorithms,
    warning where an op has no deterministic version; cuBLAS workspace pinned; no cuDNN autotuning)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`trainer.device`: auto = cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device(name)


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
