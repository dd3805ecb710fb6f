"""Per-rank parameter, gradient and optimizer-state memory of each parallel dimension of `TrainEngine`, against one
process: the division the layout predicts and the one measured.

Each case builds hyflow's `TrainEngine` (`TrainEngine.from_spec`, strategy fsdp2, fp32, AdamW) in fresh spawned
processes that form one gloo group on loopback (GLOO_SOCKET_IFNAME=lo, a file store, one torch thread per rank),
gives each rank its data-parallel share of one batch (`engine.data_layout()`: the ranks of a tensor-parallel group
get the same rows) and runs one real update: forward, backward, gradient clipping, one AdamW step (so the
optimizer state exists). On every rank it counts, in bytes (numel x element size; a DTensor by its local part,
`to_local()`):

    params      the model's parameters after the step (FSDP2's local shards; the experts' local slice);
    grads       every gradient just before the AdamW step (an optimizer step pre-hook: the engine sets them to None
                after the step), after FSDP2's reduce-scatter and the experts' gradient averaging;
    optimizer   every tensor of the AdamW state after the step: exp_avg and exp_avg_sq (the parameters' layout) and
                `step` (one fp32 scalar per parameter tensor, which no layout divides).

Measured ratio = one-process bytes / per-rank bytes of the fullest rank (the rank that bounds memory; all ranks are
equal when every sharded dimension divides). Expected ratio = one-process bytes / the bytes the layout gives that
rank, computed from the one-process model's parameter shapes, tensor by tensor (`layout_numel`):

- a tensor FSDP2 shards is cut on dim 0 over the F ranks of a shard group in torch.chunk's pieces (ceil(d0/F)
  rows for the first ranks, what is left for the last: uneven first dimensions make the division below F);
- HSDP (fsdp_size=k of W ranks) shards over k and replicates over W/k: a rank holds 1/k, not 1/W;
- tensor parallelism over T splits each decoder layer's q/k/v/gate/up weights (and q/k/v biases) on dim 0 and
  o/down weights on dim 1; the embedding (tied with the lm_head), the norms and everything else stay whole on every
  rank of the group, and FSDP2 then shards each rank's piece over dp_shard;
- expert parallelism over E gives each rank E/ep of every MoE layer's routed experts (`gate_up_proj`, `down_proj`),
  which FSDP2 leaves alone (so dp_shard does not divide them further); the rest (attention, router, norms,
  embedding) is sharded by FSDP2 over dp_shard x sp (or under HSDP over the shard group);
- gradients and exp_avg / exp_avg_sq have their parameter's layout; `step` scalars are 4 bytes per tensor on every
  rank.

Cases (the expectation in one line; the table's expected figure is the exact one): one process; FSDP2 over 2 and 4
(~2, ~4); HSDP 2x2 (2, not 4); tp=2 (< 2: embeddings and norms replicated); tp=2 x dp_shard=2 (< 4); and on a MoE
model: FSDP2 over 4 alone for comparison (4: FSDP2 shards the experts too), ep=2 (2), ep=2 x dp_shard=4 (experts only
halved, the rest quartered: well under 4), ep=2 with HSDP 2x2 (2). Models: the `small` preset of
`hyflow.models.tiny` (Qwen2, hidden 256, 4 layers, 3.9 M parameters) for the dense cases and a Qwen3-MoE built here
from `Qwen3MoeConfig` (`small-qwen3-moe`: hidden 256, 4 layers, 8 experts of 256, 2 per token, 7.1 M parameters,
89% of them experts; no tokenizer: random token ids), or `--moe-preset tiny-qwen3-moe` (hyflow's tiny MoE preset).

Not measured: activations, the all-gathered (unsharded) parameters FSDP2 holds while a layer runs, FSDP2's padding
of an uneven shard (its storage holds ceil(d0/F) rows on every rank; `to_local()` shows the real ones), allocator
overhead, RSS. The counts are exact and do not depend on the machine, only on the model and the layout.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_parallel_memory.py --json benchmarks/results/parallel_memory.json
      python benchmarks/bench_parallel_memory.py --cases fsdp2 --dense-preset tiny       (one case + its baseline)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also when loaded by path
from machine import load_average, run_provenance

COLLECTIVE_TIMEOUT_S = 300.0
GRACE_S = 30.0


@dataclass(frozen=True)
class Case:
    """One layout: `ranks` processes, the engine's fsdp_size (HSDP when 0 < fsdp_size < ranks / tp), tp and ep
    sizes, on the dense or the MoE model; `expect`: what the layout should divide, in words."""

    name: str
    model: str  # "dense" | "moe"
    ranks: int
    fsdp_size: int = -1
    tp: int = 1
    ep: int = 1
    expect: str = ""


CASES = (
    Case("one", "dense", 1, expect="the baseline: every tensor whole in one process"),
    Case("fsdp2", "dense", 2, expect="FSDP2 over 2: every tensor cut in 2 on dim 0; ~2 (below only where a first "
                                     "dimension is odd; optimizer steps are not divided)"),
    Case("fsdp4", "dense", 4, expect="FSDP2 over 4: ~4 (below where a first dimension does not divide by 4)"),
    Case("hsdp2x2", "dense", 4, fsdp_size=2, expect="HSDP 2x2: sharded over the 2 ranks of a replica, the 2 replicas "
                                                    "hold the same shards: 2, not 4"),
    Case("tp2", "dense", 2, tp=2, expect="tp=2: the decoder layers' linears halved; the embedding (tied lm_head) and "
                                         "norms whole on both ranks: < 2"),
    Case("tp2xdp2", "dense", 4, tp=2, expect="tp=2 x dp_shard=2: the layers' linears quartered, the embedding and "
                                             "norms halved (FSDP2 only): < 4"),
    Case("one-moe", "moe", 1, expect="the MoE baseline: every tensor whole in one process"),
    Case("fsdp4-moe", "moe", 4, expect="FSDP2 over 4 without ep (for comparison): the experts are sharded too: ~4"),
    Case("ep2", "moe", 2, ep=2, expect="ep=2 on 2 ranks: E/2 experts per rank, the rest sharded by FSDP2 over the "
                                       "same 2 ranks: ~2"),
    Case("ep2xdp4", "moe", 4, ep=2, expect="ep=2 x dp_shard=4: the experts only halved (each half on 2 ranks), the "
                                           "rest quartered: experts/2 + rest/4"),
    Case("ep2-hsdp2x2", "moe", 4, ep=2, fsdp_size=2, expect="ep=2 with HSDP 2x2: experts halved, the rest sharded "
                                                            "over 2 (replicated over 2): ~2"),
)
BASELINE = {"dense": "one", "moe": "one-moe"}

# tensor parallelism's split (hyflow.models.tensor_parallel, Megatron's layout): the module paths inside a decoder
# layer whose weight (and bias) is cut on dim 0 (column-wise) or whose weight is cut on dim 1 (row-wise)
TP_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
TP_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# the script's own MoE model (`--moe-preset small-qwen3-moe`): Qwen3-MoE's routing, every layer sparse
SMALL_MOE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 32, "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 8,
             "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True, "tie_word_embeddings": True}


# ------------------------------------------------------------------------------------------ the expected layout


def chunk(size: int, parts: int, index: int) -> int:
    """The length of piece `index` of `size` cut into `parts` as torch.chunk (and DTensor's Shard) cuts it."""
    if parts == 1:
        return size
    step = -(-size // parts)
    return max(0, min(step, size - index * step))


def kind(name: str, ndim: int) -> str:
    """"expert", "tp_col", "tp_row" (the weight; a row-wise bias stays whole) or "other" for a parameter name."""
    if ".layers." not in name:
        return "other"
    module, _, leaf = name.rpartition(".")
    path = module.split(".layers.", 1)[1].split(".", 1)[-1]  # the path inside the decoder layer
    if f"{path}.{leaf}" in EXPERT_WEIGHTS and ndim == 3:
        return "expert"
    if path in TP_COLWISE:
        return "tp_col"
    if path in TP_ROWWISE and leaf == "weight":
        return "tp_row"
    return "other"


def coordinates(case: Case, rank: int) -> dict[str, int]:
    """This rank's place: the FSDP2 shard group's size and index, the tp and ep sizes and indexes. The mesh is laid
    out (dp_replicate, dp_shard, tp) outermost first (rank = (r x F + f) x T + t); the expert mesh is (world / ep) x
    ep, so a rank's ep index is rank mod ep."""
    per_tp = case.ranks // case.tp
    shard = case.fsdp_size if 0 < case.fsdp_size < per_tp else per_tp
    return {"F": shard, "f": (rank // case.tp) % shard, "T": case.tp, "t": rank % case.tp, "E": case.ep,
            "e": rank % case.ep}


def layout_numel(name: str, shape: tuple[int, ...], case: Case, rank: int) -> int:
    """The elements of parameter `name` (one-process `shape`) that `rank` holds under `case` (module docstring)."""
    c = coordinates(case, rank)
    dims = list(shape)
    what = kind(name, len(dims))
    if what == "expert" and case.ep > 1:  # the experts' slice; FSDP2 leaves them alone
        dims[0] = chunk(dims[0], c["E"], c["e"])
        return math.prod(dims)
    if what == "tp_col" and case.tp > 1:
        dims[0] = chunk(dims[0], c["T"], c["t"])
    elif what == "tp_row" and case.tp > 1:
        dims[1] = chunk(dims[1], c["T"], c["t"])
    if dims and c["F"] > 1:
        dims[0] = chunk(dims[0], c["F"], c["f"])
    return math.prod(dims)


def ideal_divisor_bytes(shapes: dict[str, tuple[int, ...]], case: Case, element_size: int) -> float:
    """The per-rank bytes without any rounding: each tensor's bytes / the ranks it is spread over."""
    c = coordinates(case, 0)
    total = 0.0
    for name, shape in shapes.items():
        what = kind(name, len(shape))
        if what == "expert" and case.ep > 1:
            divisor = c["E"]
        elif what in ("tp_col", "tp_row"):
            divisor = c["T"] * c["F"]
        else:
            divisor = c["F"]
        total += math.prod(shape) * element_size / divisor
    return total


# ------------------------------------------------------------------------------------------ one rank


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _nbytes(tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def make_batch(vocab: int, rows: int, prompt: int, response: int):
    """`rows` rows of `prompt` + `response` random tokens (every token real), an advantage per response token."""
    import torch

    from hyflow.batch import Batch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab - 1, (rows, prompt + response), generator=generator)
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "position_ids": torch.arange(prompt + response).expand(rows, -1).clone(),
                  "responses": ids[:, prompt:], "response_mask": torch.ones(rows, response),
                  "advantages": torch.randn(rows, response, generator=generator)})


def pg_loss(out: dict, cols: dict, ctx):
    """-A log p, token-mean over the mini-batch (global normalisers: the engine's contract)."""
    from hyflow.algos import agg_loss

    loss = agg_loss(-out["log_probs"] * cols["advantages"], cols["response_mask"], "token-mean", **ctx.norms)
    return loss, {"actor/pg_loss": float(loss.detach())}


def measure_rank(rank: int, case: Case, model_dir: str, init_file: str, out_dir: str, opts: dict) -> None:
    """Build the case's engine on this rank, one AdamW update on its share of the batch, write its byte counts."""
    import torch
    import torch.distributed as dist
    from transformers.utils import logging as transformers_logging

    from hyflow.models.loading import load_causal_lm
    from hyflow.specs import ForwardBatches, FsdpSettings, OptimizerSpec, TrainEngineSpec
    from hyflow.workers.train_engine import TrainEngine, UpdatePlan

    transformers_logging.disable_progress_bar()
    if case.ranks > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=case.ranks,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, dtype="float32")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # the one-process shapes
    spec = TrainEngineSpec(name="actor", head="lm", strategy="fsdp2", compute_dtype="fp32",
                           fsdp=FsdpSettings(dtype="fp32", fsdp_size=case.fsdp_size), use_remove_padding=True,
                           optim=OptimizerSpec(optimizer="AdamW", lr=1e-4, weight_decay=0.01, lr_warmup_steps=0),
                           grad_clip=1.0, tensor_parallel_size=case.tp, expert_parallel_size=case.ep)
    engine = TrainEngine.from_spec(model, spec, device=torch.device("cpu"), world_size=case.ranks)
    grads: dict = {}

    def before_step(optimizer, args, kwargs):  # the gradients as the step reads them (set to None after it)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads["bytes"] = sum(_nbytes(p.grad) for p in params)
        grads["tensors"] = len(params)

    engine.optimizer.register_step_pre_hook(before_step)
    layout = engine.data_layout()
    batch = make_batch(model.config.vocab_size, opts["rows"], opts["prompt"], opts["response"])
    share = opts["rows"] // layout.dp_size
    mine = batch[layout.dp_rank * share:(layout.dp_rank + 1) * share]
    micro = min(opts["micro"], share)
    sizes = ForwardBatches(share, False, micro, share // micro, None)
    plan = UpdatePlan(mini_batch_size=share, epochs=1, shuffle=False, seed=0, sizes=sizes,
                      loss_agg_mode="token-mean", metric_prefix="actor")
    start = time.perf_counter()
    metrics = engine.update(mine, plan, pg_loss, columns=("advantages", "response_mask"))
    seconds = time.perf_counter() - start
    named = dict(engine.model.named_parameters())
    local_numel = {name: _local(p).numel() for name, p in named.items()}
    state = [(key, value) for s in engine.optimizer.state.values() for key, value in s.items()
             if isinstance(value, torch.Tensor)]
    predicted = {name: layout_numel(name, shape, case, rank) for name, shape in shapes.items()}
    mismatches = sorted(name for name in set(predicted) | set(local_numel)
                        if predicted.get(name) != local_numel.get(name))
    element = next(iter(named.values())).element_size()
    result = {
        "rank": rank, "dp_rank": layout.dp_rank, "dp_size": layout.dp_size, "rows": len(mine),
        "mesh": list(engine.mesh.root.mesh_dim_names) if engine.mesh.root is not None else [],
        "param_bytes": sum(_nbytes(p) for p in named.values()), "param_tensors": len(named),
        "grad_bytes": grads.get("bytes", 0), "grad_tensors": grads.get("tensors", 0),
        "optimizer_bytes": sum(_nbytes(v) for _, v in state),
        "optimizer_moment_bytes": sum(_nbytes(v) for k, v in state if k in ("exp_avg", "exp_avg_sq")),
        "optimizer_step_bytes": sum(_nbytes(v) for k, v in state if k == "step"),
        "optimizer_state_params": len(engine.optimizer.state),
        "predicted_param_bytes": sum(predicted.values()) * element,
        "layout_mismatches": mismatches[:10], "layout_mismatch_count": len(mismatches),
        "grad_norm": metrics["actor/grad_norm"][0], "step_skipped": metrics["actor/grad_norm_skipped"][0],
        "update_s": seconds,
    }
    if rank == 0:
        result["shapes"] = {name: list(shape) for name, shape in shapes.items()}
        result["element_size"] = element
    Path(out_dir, f"{case.name}-rank{rank}.json").write_text(json.dumps(result))
    if case.ranks > 1:
        dist.barrier()
        dist.destroy_process_group()


def _rank_entry(rank: int, timeout_s: float, case_fields: dict, model_dir: str, init_file: str, out_dir: str,
                opts: dict) -> None:
    """A spawned rank: gloo's sockets on loopback, one torch thread, a watchdog that dumps the stacks and ends the
    rank `timeout_s` after it started (a collective a peer never enters cannot hang the run)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
    try:
        measure_rank(rank, Case(**case_fields), model_dir, init_file, out_dir, opts)
    finally:
        faulthandler.cancel_dump_traceback_later()


def spawn_case(case: Case, model_dir: str, workdir: Path, opts: dict, timeout_s: float) -> list[dict]:
    """Run `case` in `case.ranks` spawned processes; every rank's measurements, by rank. A rank's exception is
    raised here; no rank outlives the call."""
    import torch.multiprocessing as mp

    init_file = workdir / f"init-{case.name}"
    init_file.unlink(missing_ok=True)
    context = mp.start_processes(_rank_entry, args=(timeout_s, asdict(case), model_dir, str(init_file),
                                                    str(workdir), opts),
                                 nprocs=case.ranks, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s + GRACE_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"case {case.name}: ranks still running {timeout_s + GRACE_S:.0f} s after start")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join(10)
    return [json.loads((workdir / f"{case.name}-rank{r}.json").read_text()) for r in range(case.ranks)]


# ------------------------------------------------------------------------------------------ models, summary


def make_moe_model(out: Path, preset: str) -> Path:
    """`small-qwen3-moe` (SMALL_MOE, built here from Qwen3MoeConfig, vocab 512, no tokenizer) or one of
    hyflow.models.tiny's MoE presets."""
    if preset != "small-qwen3-moe":
        from hyflow.models.tiny import make_tiny_model

        return make_tiny_model(out, preset)
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0,
                            eos_token_id=2, pad_token_id=0, **SMALL_MOE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def parameter_counts(shapes: dict[str, list[int]]) -> dict[str, int]:
    counts = {"total": 0, "experts": 0, "tp_split": 0, "other": 0}
    for name, shape in shapes.items():
        n, what = math.prod(shape), kind(name, len(shape))
        counts["total"] += n
        counts["experts" if what == "expert" else "tp_split" if what in ("tp_col", "tp_row") else "other"] += n
    return counts


def summarize(case: Case, ranks: list[dict], base: dict) -> dict:
    """Per-rank bytes (the fullest rank and the emptiest), measured and expected ratios against the baseline."""
    shapes = {name: tuple(shape) for name, shape in base["shapes"].items()}
    element = base["element_size"]
    steps = base["optimizer_step_bytes"]  # one fp32 scalar per parameter tensor, on every rank
    total = {r["rank"]: r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in ranks}
    fullest = max(ranks, key=lambda r: total[r["rank"]])
    one = {key: base[key] for key in ("param_bytes", "grad_bytes", "optimizer_bytes")}
    one["total_bytes"] = sum(one.values())
    predicted = [sum(layout_numel(n, s, case, r["rank"]) for n, s in shapes.items()) * element for r in ranks]
    expected_rank = max(predicted)
    expected_total = 4 * expected_rank + steps  # params + grads + exp_avg + exp_avg_sq + step scalars
    ideal = ideal_divisor_bytes(shapes, case, element)
    out = {
        "case": asdict(case), "mesh": fullest["mesh"],
        "per_rank": [{key: r[key] for key in ("rank", "dp_rank", "rows", "param_bytes", "grad_bytes",
                                              "optimizer_bytes", "optimizer_moment_bytes", "optimizer_step_bytes",
                                              "predicted_param_bytes", "layout_mismatch_count",
                                              "layout_mismatches", "grad_norm", "step_skipped", "update_s")}
                     for r in ranks],
        "fullest_rank": fullest["rank"],
        "param_bytes": fullest["param_bytes"], "grad_bytes": fullest["grad_bytes"],
        "optimizer_bytes": fullest["optimizer_bytes"], "total_bytes": total[fullest["rank"]],
        "min_total_bytes": min(total.values()),
        "one_process": one,
        "measured_ratio": {
            "params": one["param_bytes"] / fullest["param_bytes"], "grads": one["grad_bytes"] / fullest["grad_bytes"],
            "optimizer": one["optimizer_bytes"] / fullest["optimizer_bytes"],
            "total": one["total_bytes"] / total[fullest["rank"]]},
        "expected_param_bytes": expected_rank, "expected_total_bytes": expected_total,
        "expected_ratio": {"params": one["param_bytes"] / expected_rank,
                           "total": one["total_bytes"] / expected_total},
        "ideal_ratio": one["param_bytes"] / ideal,
        "layout_matches": all(r["layout_mismatch_count"] == 0 for r in ranks)
        and [r["param_bytes"] for r in ranks] == predicted,
        "grads_follow_params": all(r["grad_bytes"] == r["param_bytes"] for r in ranks),
        "optimizer_is_2x_params_plus_steps": all(r["optimizer_bytes"] == 2 * r["param_bytes"] + steps
                                                 for r in ranks),
        "steps_taken": all(not r["step_skipped"] and math.isfinite(r["grad_norm"]) for r in ranks),
        "grad_norm": [r["grad_norm"] for r in ranks],
    }
    return out


def _layout_text(case: Case) -> str:
    parts = []
    c = coordinates(case, 0)
    if case.ranks == 1:
        return "1 process"
    if c["F"] < case.ranks // case.tp:
        parts.append(f"HSDP {case.ranks // case.tp // c['F']}x{c['F']}")
    elif c["F"] > 1:
        parts.append(f"dp_shard={c['F']}")
    if case.tp > 1:
        parts.append(f"tp={case.tp}")
    if case.ep > 1:
        parts.append(f"ep={case.ep}")
    return " x ".join(parts) if parts else f"dp_shard={c['F']}"


def print_table(summary: dict) -> None:
    print("| case | model | ranks | layout | params B/rank | grads B/rank | optimizer B/rank | total B/rank | "
          "1 process B | measured ratio | expected ratio | layout exact |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, s in summary["cases"].items():
        case = Case(**s["case"])
        model = summary["models"][case.model]["name"]
        uneven = f" (min {s['min_total_bytes']:,})" if s["min_total_bytes"] != s["total_bytes"] else ""
        print(f"| {name} | {model} | {case.ranks} | {_layout_text(case)} | {s['param_bytes']:,} | "
              f"{s['grad_bytes']:,} | {s['optimizer_bytes']:,} | {s['total_bytes']:,}{uneven} | "
              f"{s['one_process']['total_bytes']:,} | {s['measured_ratio']['total']:.3f} | "
              f"{s['expected_ratio']['total']:.3f} | {'yes' if s['layout_matches'] else 'NO'} |")
    for name, s in summary["cases"].items():
        print(f"- {name}: {s['case']['expect']}; params ratio measured {s['measured_ratio']['params']:.4f}, "
              f"expected {s['expected_ratio']['params']:.4f}, without rounding {s['ideal_ratio']:.4f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="all", help="comma-separated case names (their baselines are added): "
                        + ", ".join(c.name for c in CASES))
    parser.add_argument("--dense-preset", default="small", help="hyflow.models.tiny preset of the dense cases")
    parser.add_argument("--moe-preset", default="small-qwen3-moe",
                        help="small-qwen3-moe (built here) or a hyflow.models.tiny MoE preset (tiny-qwen3-moe)")
    parser.add_argument("--rows", type=int, default=8, help="rows of the batch (split over the data-parallel ranks)")
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--response", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a case's ranks may run")
    parser.add_argument("--workdir", default=None, help="where the models and the ranks' files go (default: a "
                        "temporary directory, removed after)")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)
    by_name = {c.name: c for c in CASES}
    wanted = [c.name for c in CASES] if args.cases == "all" else [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(by_name)}")
    for name in list(wanted):
        base = BASELINE[by_name[name].model]
        if base not in wanted:
            wanted.insert(0, base)
    cases = [c for c in CASES if c.name in wanted]  # the baselines run before the cases they divide
    if any(args.rows % max(1, c.ranks // c.tp) for c in cases):
        parser.error(f"--rows {args.rows} must divide over every case's data-parallel ranks")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    load_before = load_average()
    started = time.perf_counter()
    opts = {"rows": args.rows, "prompt": args.prompt, "response": args.response, "micro": args.micro}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        models = {}
        if any(c.model == "dense" for c in cases):
            from hyflow.models.tiny import make_tiny_model

            models["dense"] = {"name": args.dense_preset,
                               "dir": str(make_tiny_model(workdir / args.dense_preset, args.dense_preset))}
        if any(c.model == "moe" for c in cases):
            models["moe"] = {"name": args.moe_preset,
                             "dir": str(make_moe_model(workdir / args.moe_preset, args.moe_preset))}
        raw: dict[str, list[dict]] = {}
        timings = {}
        for case in cases:
            t0 = time.perf_counter()
            raw[case.name] = spawn_case(case, models[case.model]["dir"], workdir, opts, args.timeout)
            timings[case.name] = round(time.perf_counter() - t0, 1)
            print(f"# {case.name}: {case.ranks} rank(s), {timings[case.name]} s", flush=True)
    for kind_name, model in models.items():
        base = raw[BASELINE[kind_name]][0]
        model.pop("dir")
        model["parameters"] = parameter_counts(base["shapes"])
        model["parameter_tensors"] = len(base["shapes"])
    summary = {"args": vars(args), "models": models, "cases": {}, "case_wall_s": timings}
    for case in cases:
        summary["cases"][case.name] = summarize(case, raw[case.name], raw[BASELINE[case.model]][0])
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    summary.update(run_provenance(load_before))
    print(f"# per-rank parameter + gradient + AdamW-state bytes, one update, fp32 on CPU (gloo); "
          f"{summary['machine']['cpu']}, {summary['machine']['cores']} cores; {summary['wall_s']} s")
    for kind_name, model in models.items():
        p = model["parameters"]
        print(f"# {kind_name} model {model['name']}: {p['total']:,} parameters ({p['experts']:,} in routed experts, "
              f"{p['tp_split']:,} in the layers' q/k/v/o/gate/up/down linears, {p['other']:,} in embeddings, norms "
              f"and routers), {model['parameter_tensors']} tensors")
    print_table(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
