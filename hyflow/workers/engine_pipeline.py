"""A `TrainEngine`'s passes under pipeline parallelism (a mixin; `hyflow.parallel.pipeline` cuts the model and runs
the schedules).

The schedules need micro-batches of one shape, so the pipeline passes run the padded layout (the packed one
gives the same log-probs: `use_remove_padding` is then a speed setting only, said at start): the mini-batch's
columns are trimmed once (`trim_padding` over all its rows), its micro-batches are the role's
(`micro_batches_as_derived`: a sample count or token budgets), and a micro-batch with fewer rows than the largest is
filled up with copies of its first row, whose outputs are dropped before anything reads them (they get no loss and
no gradient); a schedule that needs more micro-batches than the role's (1F1B: one per stage) gets the largest ones
halved, and idle ones (filled the same way) when the rows run out. Prompt sharing (`use_prefix_grouper`) does not apply to the stages (performance-only under pipeline
parallelism, said at start); use_torch_compile's compiled MLPs and norms do. The last stage computes the role's loss
per micro-batch (`loss_fn(out, cols, ctx)`, as the other passes call it) and its metric parts, which it then
broadcasts to the pipeline's other ranks; a forward-only pass's outputs are broadcast from the last stage too, so
every rank of the pipeline returns them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hyflow.batch import Batch
from hyflow.models.moe import STATS
from hyflow.workers.engine import (
    MicroContext,
    merge_metric,
    micro_batches_as_derived,
    pad_response,
    trim_padding,
)

__all__ = ["PipelinePasses", "pipeline_problem"]


def pipeline_problem(engine) -> str | None:
    """Why this engine's settings cannot run pipeline-parallel (None when they can)."""
    spec = engine.spec
    where = f"{engine.name}: pipeline_parallel_size={spec.pipeline_parallel_size}"
    if engine.head == "score":
        return f"{where} for a reward model is not built; use 1"
    if engine.vision:
        return f"{where} of a vision-language model is not built; use 1"
    if engine.lora is not None:
        return f"{where} with LoRA is not built yet; use lora_rank=0 or pipeline_parallel_size=1"
    if engine.sp_size > 1:
        return (f"{where} with ulysses_sequence_parallel_size={engine.sp_size} is not built (the pipeline runs padded "
                "micro-batches, Ulysses cuts packed ones); use one of them")
    return None


class PipelinePasses:
    """`_pipeline_infer` and `_pipeline_forward_backward`: the engine's `infer` / `forward_backward` under pipeline
    parallelism. Reads the engine's `pipeline` (a `PipelineRunner`), `head`, `name`, `dp_size`, `device`, `router_stats`,
    `progress` and its `passes()` context."""

    def _last_stage_rank(self) -> int:
        """The global rank of this pipeline's last pp rank (where the outputs and the loss are)."""
        return dist.get_process_group_ranks(self.pipeline.parts.group)[-1]

    def _pipeline_micros(self, batch: Batch, sizes, R: int):
        """The micro-batches as (input_ids, attention_mask, position_ids, real tokens) of one shape, their rows of
        `batch`, and the kept response length r (module docstring: short micro-batches filled with copies of a row,
        idle ones added for the schedule)."""
        from hyflow.parallel.pipeline import schedule_micro_batches

        seq, r = trim_padding(batch, R)
        micros = micro_batches_as_derived(batch, sizes)
        rows = [torch.as_tensor(index) for _, index in micros]
        parts, schedule = self.pipeline.parts, self.pipeline.schedule_kind
        # a schedule that needs more micro-batches (1F1B: one per stage) gets the largest ones halved (the same sums,
        # smaller micro-batches), then idle ones if rows run out
        while len(rows) < schedule_micro_batches(len(rows), parts.pp_size, schedule):
            largest = max(range(len(rows)), key=lambda i: len(rows[i]))
            if len(rows[largest]) < 2:
                break
            half = len(rows[largest]) // 2
            rows[largest:largest + 1] = [rows[largest][:half], rows[largest][half:]]
        width = max(len(index) for index in rows)
        args = []
        for index in rows:
            full = torch.cat([index, index[:1].repeat(width - len(index))])
            ids, mask, positions = (seq[key][full] for key in ("input_ids", "attention_mask", "position_ids"))
            real = mask.clone()
            real[len(index):] = 0  # the filling copies' tokens count nowhere (router metrics)
            args.append((ids, mask, positions, real))
        for _ in range(schedule_micro_batches(len(args), parts.pp_size, schedule) - len(args)):  # idle: no real token
            ids, mask, positions, real = args[0]
            args.append((ids, mask, positions, torch.zeros_like(real)))
            rows.append(rows[0][:0])
        return args, rows, r

    @contextlib.contextmanager
    def _real_tokens(self):
        """The stages tell the router metrics which tokens are real (not padding, not filling rows) while inside."""
        def observe(mask):
            self.router_stats.token_mask = mask

        for stage in self.pipeline.parts.stages:
            stage.token_observer = observe
        try:
            yield
        finally:
            self.router_stats.token_mask = None
            for stage in self.pipeline.parts.stages:
                stage.token_observer = None

    def _broadcast_from_last(self, value):
        """`value` of the last pp rank on every rank of this pipeline (an object broadcast over the pp group)."""
        box = [value]
        dist.broadcast_object_list(box, src=self._last_stage_rank(), group=self.pipeline.parts.group)
        return box[0]

    def _names(self, with_entropy: bool) -> tuple[str, ...]:
        return ("values",) if self.head == "value" else (("log_probs", "entropy") if with_entropy else ("log_probs",))

    def _pipeline_infer(self, batch: Batch, sizes, *, temperature: float, with_entropy: bool) -> dict:
        R = batch["responses"].shape[1]
        micros, rows, r = self._pipeline_micros(batch, sizes, R)
        outs = self.pipeline.run(micros, r=r, temperature=temperature, with_entropy=with_entropy)
        names = self._names(with_entropy)
        result = None
        if outs is not None:
            result = {name: torch.zeros(len(batch), R) for name in names}
            for out, index in zip(outs, rows, strict=True):
                parts = out if isinstance(out, tuple) else (out,)
                for name, part in zip(names, parts, strict=True):
                    result[name][index] = pad_response(part[: len(index)].detach().float().cpu(), R)
        result = self._broadcast_from_last(result)
        mask = batch["response_mask"].float()
        return {key: value * mask for key, value in result.items()}

    def _pipeline_forward_backward(self, batch: Batch, sizes, loss_fn, *, columns, norms: dict, temperature: float,
                                   with_entropy: bool, counts: dict) -> dict[str, float]:
        R = batch["responses"].shape[1]
        micros, rows, r = self._pipeline_micros(batch, sizes, R)
        ctx = MicroContext(norms=norms, global_tokens=max(float(norms["global_token_count"]), 1.0),
                           n_micro=sum(1 for index in rows if len(index)), world_size=self.dp_size,
                           counts=dict(counts or {}))
        names = self._names(with_entropy)
        sums: dict[str, float] = {}

        def micro_loss(output, j: int) -> torch.Tensor:
            parts = output if isinstance(output, tuple) else (output,)
            real = len(rows[j])  # the filled rows' outputs go nowhere: no loss, no gradient
            if real == 0:  # an idle micro-batch (the schedule's minimum count): a zero loss on its outputs
                return parts[0].sum() * 0.0
            out = {name: part[:real] for name, part in zip(names, parts, strict=True)}
            if self.head == "lm":
                out.setdefault("entropy", None)
            cols = {key: batch[key][rows[j]][:, :r].to(self.device) for key in columns if key in batch}
            loss, metrics = loss_fn(out, cols, ctx)
            for key, value in metrics.items():
                sums[key] = merge_metric(key, sums.get(key), value)
            # gradients summed over micro-batches and (FSDP2 averages) the data-parallel ranks: as `forward_backward`
            return loss * self.dp_size

        # a MoE model's routers on this rank's stages (real tokens only); compiled MLPs and norms under use_torch_compile
        with self.router_stats, self._real_tokens(), self.passes(packing=False):
            self.pipeline.run(micros, loss_fn=micro_loss, r=r, temperature=temperature, with_entropy=with_entropy)
        if self.progress is not None:
            self.progress(f"update_{self.name}", len(micros), len(micros), "micro-batches", "")
        sums = self._broadcast_from_last(sums if self.pipeline.parts.has_last else None)
        if self.router_stats:  # the mean over every stage's MoE-layer calls, a data-parallel replica's share
            stats = [None] * self.pipeline.parts.pp_size
            dist.all_gather_object(stats, self.router_stats.take_sums(), group=self.pipeline.parts.group)
            count = sum(n for _, n in stats)
            for key in STATS if count else ():
                total = sum(s.get(key, 0.0) for s, _ in stats)
                sums[f"{self.name}/moe/{key}"] = total / count / self.dp_size
        return sums
