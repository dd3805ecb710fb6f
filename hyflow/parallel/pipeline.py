"""Pipeline parallelism: a Hugging Face decoder cut into stages that `torch.distributed.pipelining` schedules.

The `pp` ranks of the mesh hold `pp x virtual` stages in torch's looped placement (stage s on pp rank s mod pp: with
`virtual_pipeline_parallel_size` v > 1 each rank holds v stages, Megatron's interleaved layout). The decoder layers
are split evenly (`stage_layer_ranges`, the first stages take one more when they do not divide); stage 0 holds the
token embedding, the last stage the final norm and the head (the lm_head of a policy, the value head of a critic).

`cut_model` cuts the model in place on each rank: the decoder's `layers` become an `nn.ModuleDict` of the layers
this rank holds, keyed by their index, and what it does not hold is set to None, so every parameter keeps its name
(`model.layers.5.mlp...`): a state dict, a DCP checkpoint or a weight export of one stage is a subset of the whole
model's, and checkpoints move between pp sizes (torchtitan's scheme). Each stage is a `PipelineStageModule` whose
forward runs the decoder layers the way the family's own decoder does (rotary embeddings, the causal mask of each
layer type from `transformers.masking_utils`, no cache) and passes the token ids, attention mask and position ids
on with the hidden states; the last stage ends with the head and returns per-token outputs of the response span:
log-probs [b, r] (and the entropy [b, r] when asked) at the sampling temperature, from the lm_head rows of
`hyflow.models.forward` (chunked and checkpointed for a large vocabulary), or values [b, r]. A stage is its own
FSDP2 root (`hyflow.parallel.fsdp.apply_fsdp` on it), which torch's `PipelineStage` drives: gradient reduction once
after the last micro-batch's backward.

`PipelineRunner.run` runs one pass over equal-shaped micro-batches of padded rows (the schedules need one shape:
the engine trims the columns once per mini-batch and pads rows so every micro-batch has as many): a training pass
with the schedule (`1F1B`, `GPipe`, or `Interleaved1F1B` for v > 1) calling the role's loss on the last stage per
micro-batch, whose loss is summed (not averaged: hyflow's losses are already normalised by the global counts,
`scale_grads=False`); or a forward-only pass (`schedule.eval`), whose outputs reach the last stage.

Tied input and output embeddings (Qwen2's small models): the first stage's embedding and the last stage's lm_head
are two copies of one weight; `TiedCopies.sync` sums their gradients (each copy gets the gradient the tied weight
gets in one process), so both take the same step; the gradient norm counts it once, and the export names it once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyflow.models.forward import decoder_of, lm_head_rows, unwrap_model

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """[start, end) of the decoder layers of each of `n_stages` stages: n_layers / n_stages each, the first
    n_layers mod n_stages stages one more. Raises ValueError when a stage would get no layer."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"pipeline parallelism: {n_stages} stages need at least one decoder layer each; the model "
                         f"has {n_layers} (use pipeline_parallel_size x virtual_pipeline_parallel_size <= {n_layers})")
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for stage in range(n_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def rank_stages(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages pp rank `pp_rank` holds, in torch's looped placement: pp_rank, pp_rank + pp, ..."""
    return [pp_rank + k * pp for k in range(virtual)]


def schedule_name(name: str | None, virtual: int) -> str:
    """The schedule of `name` (default: 1F1B, Interleaved1F1B with virtual stages); raises ValueError for one that
    does not fit the stages per rank."""
    chosen = name or ("Interleaved1F1B" if virtual > 1 else "1F1B")
    if chosen not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={chosen!r}; use one of {SCHEDULES}")
    if (chosen == "Interleaved1F1B") != (virtual > 1):
        raise ValueError(f"pipeline_schedule={chosen} with virtual_pipeline_parallel_size={virtual}: Interleaved1F1B "
                         "runs several stages per rank (virtual > 1), 1F1B and GPipe one")
    return chosen


def schedule_micro_batches(n: int, pp: int, schedule: str) -> int:
    """The fewest micro-batches >= n that `schedule` runs on pp ranks: 1F1B at least pp (torch's Schedule1F1B),
    Interleaved1F1B a multiple of its rounds (max(1, m // pp)), GPipe any."""
    m = max(n, 1)
    if schedule == "1F1B":
        return max(m, pp)
    if schedule == "Interleaved1F1B":
        while m % max(1, m // pp):
            m += 1
    return m


class PipelineStageModule(nn.Module):
    """Stage `stage` of `n_stages` of a cut model (module docstring): the embedding on the first, the layers of
    `layer_ids`, the final norm and `head` ("lm" / "value") on the last. The pass's settings (response length,
    temperature, entropy) are set by `PipelineRunner.run` before a schedule runs (`configure`)."""

    def __init__(self, inner: nn.Module, stage: int, n_stages: int, layer_ids: list[int], head: str):
        super().__init__()
        decoder = decoder_of(inner)
        self.stage, self.n_stages, self.head_kind = stage, n_stages, head
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.config = decoder.config
        self.embed = decoder.embed_tokens if self.first else None
        self.layers = nn.ModuleDict({str(i): decoder.layers[str(i)] for i in layer_ids})
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm if self.last else None
        self.head = None
        self.dropout = None
        if self.last:
            self.head = inner.get_output_embeddings() if head == "lm" else inner.score
            self.dropout = getattr(inner, "dropout", None) if head == "value" else None
        self.settings: dict = {}
        # called with each micro-batch's real-token mask [b * L] before its layers run (a MoE model's router
        # metrics count only those tokens: `hyflow.models.moe.RouterStats.token_mask`)
        self.token_observer: Callable | None = None

    def configure(self, **settings) -> None:
        """The pass's response length `r`, `temperature` and `with_entropy` (read by the last stage's head)."""
        self.settings = settings

    def _masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> dict:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = {"config": self.config, "inputs_embeds": hidden, "attention_mask": attention_mask, "cache": None,
                  "position_ids": position_ids}
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def forward(self, *args):
        if self.first:
            input_ids, attention_mask, position_ids, real = args
            hidden = self.embed(input_ids)
        else:
            hidden, input_ids, attention_mask, position_ids, real = args
        if self.token_observer is not None:
            self.token_observer(real.reshape(-1).bool())
        masks = self._masks(hidden, attention_mask, position_ids)
        position_embeddings = self.rotary(hidden, position_ids)
        layer_types = getattr(self.config, "layer_types", None)
        for index, layer in self.layers.items():
            kind = layer_types[int(index)] if layer_types else "full_attention"
            out = layer(hidden, attention_mask=masks[kind], position_embeddings=position_embeddings,
                        position_ids=position_ids)
            hidden = out[0] if isinstance(out, tuple) else out
        if not self.last:
            return hidden, input_ids, attention_mask, position_ids, real
        return self._head_outputs(self.norm(hidden), input_ids)

    def _head_outputs(self, hidden: torch.Tensor, input_ids: torch.Tensor):
        """The last stage's per-token outputs of the response span (the last r columns): values [b, r], or
        log-probs [b, r] (+ entropy [b, r]) at the pass's temperature (`hyflow.models.forward`'s lm_head rows)."""
        r = int(self.settings["r"])
        rows = hidden[:, -r - 1 : -1]
        if self.head_kind == "value":
            if self.dropout is not None:
                rows = self.dropout(rows)
            return self.head(rows)[..., 0].float()
        batch, width = rows.shape[0], rows.shape[-1]
        with_entropy = bool(self.settings.get("with_entropy"))
        logp, entropy, _, _ = lm_head_rows(rows.reshape(-1, width), input_ids[:, -r:].reshape(-1), self.head, None,
                                            float(self.settings.get("temperature", 1.0)), with_entropy, 1024,
                                            1 << 24)
        logp = logp.view(batch, r)
        return (logp, entropy.view(batch, r)) if with_entropy else logp


@dataclass
class TiedCopies:
    """The two copies of a tied embedding under pipeline parallelism: the module holding this rank's copy (the
    first stage's embedding or the last stage's lm_head; None on a rank with neither: its `weight` is read when
    used, since FSDP2 replaces the parameter) and the group of the rank pair that holds them (one pair per data /
    tensor-parallel coordinate)."""

    module: nn.Module | None = None
    group: object = None
    counts_in_norm: bool = True  # the last stage's copy is left out of the gradient norm (it is the same weight)

    @property
    def param(self) -> nn.Parameter | None:
        return None if self.module is None else self.module.weight

    def sync(self) -> None:
        """Sum the two copies' gradients (in place, both ranks): the tied weight's gradient in one process."""
        if self.module is None or self.group is None:
            return
        grad = self.param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local is None:
            raise RuntimeError("pipeline parallelism: a tied embedding copy has no gradient to sum")
        dist.all_reduce(local, group=self.group)


@dataclass
class PipelineParts:
    """What `cut_model` made on this rank: its stage modules (in stage order), their stage indices, the stage
    count, the pp process group, the tied-embedding copies, and the parameter names this rank exports twice
    (the last stage's copy of a tied lm_head)."""

    stages: list[PipelineStageModule]
    stage_ids: list[int]
    n_stages: int
    group: object
    pp_rank: int
    pp_size: int
    tied: TiedCopies = field(default_factory=TiedCopies)
    export_skip: set = field(default_factory=set)

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids


def _tied_pairs(root_mesh) -> list[list[int]]:
    """Every (first pp rank, last pp rank) pair of global ranks: one per coordinate of the other mesh dims."""
    names = list(root_mesh.mesh_dim_names)
    grid = root_mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, root_mesh.mesh.shape[names.index("pp")])
    return [[int(row[0]), int(row[-1])] for row in grid]


def cut_model(model: nn.Module, mesh, virtual: int, head: str) -> PipelineParts:
    """Cut `model` in place into this rank's stages (module docstring) on `mesh` (a `ParallelMesh` with pp > 1);
    collective (the tied-embedding pairs' groups are created on every rank). Raises ValueError for a model whose
    decoder cannot be cut (no `layers` list, a vision-language model) or too few layers."""
    dims = mesh.dims
    inner = unwrap_model(model)
    decoder = decoder_of(inner) if hasattr(inner, "get_decoder") or hasattr(inner, "base_model_prefix") else None
    layers = getattr(decoder, "layers", None)
    needed = ("embed_tokens", "norm", "rotary_emb")
    if not isinstance(layers, nn.ModuleList) or any(getattr(decoder, name, None) is None for name in needed):
        raise ValueError(f"pipeline parallelism cuts a decoder with embed_tokens, layers, norm and rotary_emb "
                         f"(Llama, Qwen2/3, Mistral and their MoE kin); {type(inner).__name__} is not one")
    if head == "value" and not isinstance(getattr(inner, "score", None), nn.Module):
        raise ValueError(f"pipeline parallelism of a critic needs a token-classification value head (`score`); "
                         f"{type(inner).__name__} has none")
    pp, pp_rank = dims.pp, mesh.local_rank("pp")
    n_stages = pp * virtual
    ranges = stage_layer_ranges(len(layers), n_stages)
    stage_ids = rank_stages(pp_rank, pp, virtual)
    tied_config = bool(getattr(inner.config, "tie_word_embeddings", False)) and head == "lm"
    out_head = inner.get_output_embeddings() if head == "lm" else inner.score
    owned = [i for stage in stage_ids for i in range(*ranges[stage])]
    decoder.layers = nn.ModuleDict({str(i): layers[i] for i in owned})
    stages = [PipelineStageModule(inner, stage, n_stages, list(range(*ranges[stage])), head) for stage in stage_ids]
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    tied = TiedCopies()
    export_skip = set()
    if tied_config:
        tied.module = decoder.embed_tokens if first else (out_head if last else None)
        tied.counts_in_norm = first
        group, _ = dist.new_subgroups_by_enumeration(_tied_pairs(mesh.root))
        tied.group = group if tied.module is not None else None
        if last:
            export_skip = {name for name, module in inner.named_modules() if module is out_head}
            export_skip = {f"{name}.weight" for name in export_skip}
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = None
        for name, child in list(inner.named_children()):
            if child is out_head:
                setattr(inner, name, None)
    return PipelineParts(stages, stage_ids, n_stages, mesh.group("pp"), pp_rank, pp, tied, export_skip)


class PipelineRunner:
    """Runs passes of a cut model's stages on this rank with a `torch.distributed.pipelining` schedule."""

    def __init__(self, parts: PipelineParts, device: torch.device, schedule: str, hidden_dtype: torch.dtype,
                 hidden_size: int):
        self.parts, self.device, self.schedule_kind = parts, device, schedule
        self.hidden_dtype, self.hidden_size = hidden_dtype, hidden_size

    def _metas(self, module: PipelineStageModule, shape: tuple[int, int], train: bool, settings: dict):
        """The stage's input and output examples (meta tensors): torch's static metadata mode, which sends no
        shapes and runs no forward on uninitialised buffers (token ids would index garbage)."""
        def meta(size, dtype, grad=False):
            return torch.empty(size, dtype=dtype, device="meta").requires_grad_(grad and train)

        tokens = tuple(meta(shape, torch.long) for _ in range(4))
        hidden = meta((*shape, self.hidden_size), self.hidden_dtype, grad=True)
        inputs = tokens if module.first else (hidden, *tokens)
        if not module.last:
            return inputs, (hidden, *tokens)
        out = meta((shape[0], int(settings["r"])), torch.float32, grad=True)
        return inputs, ((out, meta(out.shape, torch.float32, grad=True)) if settings.get("with_entropy")
                        and module.head_kind == "lm" else out)

    def _schedule(self, n_micro: int, loss_fn: Callable | None, shape: tuple[int, int], settings: dict):
        from torch.distributed import pipelining

        stages = []
        for module, stage in zip(self.parts.stages, self.parts.stage_ids, strict=True):
            inputs, outputs = self._metas(module, shape, loss_fn is not None, settings)
            stages.append(pipelining.PipelineStage(module, stage, self.parts.n_stages, self.device, input_args=inputs,
                                                   output_args=outputs, group=self.parts.group))
        cls = getattr(pipelining, f"Schedule{self.schedule_kind}")
        if self.schedule_kind == "Interleaved1F1B":
            return cls(stages, n_micro, loss_fn=loss_fn, scale_grads=False)
        return cls(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False)

    def run(self, micro_args: list[tuple[torch.Tensor, ...]], *, loss_fn: Callable | None = None, **settings):
        """One pass over equal-shaped micro-batches (each `(input_ids, attention_mask, position_ids, real)` [b, L];
        `real`: the attention mask of the micro-batch's own rows, 0 on rows that only fill it to the shape).
        With `loss_fn(outputs, index) -> loss` (index: the micro-batch's number) forward and backward, the losses
        summed into the gradients; without, forward only. Returns the last stage's outputs per micro-batch (a
        tensor or a tuple, see `PipelineStageModule`) on the rank holding it, else None; collective over the pp
        group (every pp rank calls it with micro-batches of the same shapes)."""
        n_micro = len(micro_args)
        for module in self.parts.stages:
            module.configure(**settings)
        args = [torch.cat([micro[i] for micro in micro_args]).to(self.device) for i in range(4)]
        shape = tuple(micro_args[0][0].shape)
        outputs: list = [None] * n_micro
        if loss_fn is None:
            merged = self._schedule(n_micro, None, shape, settings).eval(*args) if n_micro else None
            if not self.parts.has_last or merged is None:
                return None
            parts = merged if isinstance(merged, tuple) else (merged,)
            chunks = [part.chunk(n_micro) for part in parts]
            return [tuple(c[j] for c in chunks) if isinstance(merged, tuple) else chunks[0][j] for j in range(n_micro)]

        def loss(output, target):
            index = int(target.reshape(-1)[0])
            outputs[index] = output
            return loss_fn(output, index)

        target = torch.arange(n_micro, device=self.device)
        self._schedule(n_micro, loss, shape, settings).step(*args, target=target, return_outputs=False)
        return outputs if self.parts.has_last else None


def gather_stage_tensors(parts: PipelineParts, local: Callable[[], Iterator[tuple[str, torch.Tensor]]], *,
                         wanted: bool, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's (name, full tensor) pairs on the first pp rank of the pp group whose ranks are `wanted` (those
    of data- and tensor-parallel coordinate 0: the collecting rank's), stage by stage in pp-rank order; nothing
    elsewhere. `local()` iterates this rank's own (collective within its stage's data/tensor groups: every rank runs
    it). Stage s's tensors travel from its pp rank to pp rank 0 one at a time (a header of name, shape and dtype,
    then the tensor on `device`), so at most one tensor is in flight; the last stage's copy of a tied lm_head is not
    sent (stage 0's embedding is that weight)."""
    group, pp_rank = parts.group, parts.pp_rank
    ranks = dist.get_process_group_ranks(group)
    for source in range(parts.pp_size):
        if pp_rank == source:
            for name, tensor in local():
                if name in parts.export_skip or not wanted:
                    continue
                if source == 0:
                    yield name, tensor
                else:
                    dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=ranks[0], group=group)
                    dist.send(tensor.detach().to(device).contiguous(), dst=ranks[0], group=group)
            if source != 0 and wanted:
                dist.send_object_list([None], dst=ranks[0], group=group)
        elif pp_rank == 0 and wanted:
            while True:
                header = [None]
                dist.recv_object_list(header, src=ranks[source], group=group)
                if header[0] is None:
                    break
                name, shape, dtype = header[0]
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(tensor, src=ranks[source], group=group)
                yield name, tensor


# ------------------------------------------------------------------------------------------ full checkpoints


def gather_stage_objects(parts: PipelineParts, value, *, wanted: bool) -> list | None:
    """Every pp rank's `value` (a picklable object) in pp-rank order on the pipeline's first rank when `wanted`
    (None elsewhere); collective over the pp group (every rank calls it)."""
    values = [None] * parts.pp_size
    dist.all_gather_object(values, value, group=parts.group)
    return values if wanted and parts.pp_rank == 0 else None


def merge_optimizer_states(states: list[dict]) -> dict:
    """One name-keyed optimizer state of the stages' (`get_optimizer_state_dict` full, each over its own
    parameters): their states joined, each parameter group's names joined in stage order (hyperparameters the first
    stage's); {} when the optimizer has not stepped."""
    states = [state for state in states if state]
    if not states:
        return {}
    merged = {"state": {}, "param_groups": [dict(group) for group in states[0]["param_groups"]]}
    for group in merged["param_groups"]:
        group["params"] = []
    for state in states:
        merged["state"].update(state["state"])
        for group, own in zip(merged["param_groups"], state["param_groups"], strict=True):
            group["params"] += [name for name in own["params"] if name not in group["params"]]
    return merged


def local_optimizer_state(state: dict, names: set[str], aliases: dict[str, str]) -> dict:
    """The part of a whole model's name-keyed optimizer `state` whose parameters are `names` (this rank's), a name
    missing there read from its alias (a tied lm_head copy from the embedding's entry)."""
    if not state or not state.get("state"):
        return state
    entries = state["state"]
    own = {}
    for name in names:
        source = name if name in entries else aliases.get(name)
        if source in entries:
            own[name] = entries[source]
    groups = [{**group, "params": [name for name in names if name in own or name in group["params"]
                                   or aliases.get(name) in group["params"]]}
              for group in state["param_groups"]]
    return {"state": own, "param_groups": groups}
