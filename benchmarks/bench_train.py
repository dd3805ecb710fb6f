"""Training throughput: packed sequences (`use_remove_padding=true`) vs the padded micro-batch, same model and data.

Measured: real tokens per second of one training micro-batch step, forward + backward of the token-mean response
log-prob loss

    loss = -(1 / N) * sum_{b, t: response_mask[b, t] = 1} log pi(y[b, t] | x[b, <t]),    N = response tokens

(plus an AdamW step with `--optimizer-step`), along two paths in one process, on the same module and batches:

    padded   what the workers do without packing: `hyflow.workers.engine.trim_padding` cuts the columns no row
             uses, then `hyflow.models.forward.response_logprobs` on the [B, L'] batch (attention `--attn`)
    packed   `hyflow.models.packing.packed_response_logprobs`: the real tokens as one row, attention per sequence
             (on CPU: SDPA over each sequence's slice), the lm_head on the real response tokens only

Workload: micro-batches of `--batch-size` sequences whose total lengths n are drawn uniformly from
[`--min-len`, `--max-len`] (seeded); each splits into a prompt of p ~ U[1, min(`--prompt-max`, n // 2)] tokens,
left-padded, and a response of n - p tokens, right-padded (the layout rollouts produce). Random token ids, a
random-weight model from `hyflow.models.tiny` (`--preset`, seed 0), float32 on CPU. Both paths count the same
real tokens (the padded path also computes the pad positions, reported as "computed positions").

Protocol: `--warmup` untimed steps per path, then `--rounds` rounds of `--steps` steps per path; within a round
both paths run the round's same batches, each batch by both paths back to back, the order alternating from one
batch to the next and from one round to the next, so load from other processes hits both alike. Reported per path: median over rounds of (real tokens / seconds of
the round), median seconds per step, and the ratio packed / padded of the median tokens/s (per-round ratios
too). Before timing, both paths' losses on one batch are compared (they must agree to float rounding).
Torch threads are set to `--threads` (default 1; the machines are shared).

`--compare compile` times the packed path against itself with the MLPs and norms compiled
(`hyflow.models.compile.CompiledModules`, what `use_torch_compile=true` turns on); the compile falls in the warm-up.

`--sp N` times Ulysses sequence parallelism (`hyflow.models.ulysses`): the packed step in one process (sp=1)
against N processes (gloo on CPU, NCCL on CUDA; spawned, `--threads` threads each) that run the same micro-batches
as one sequence-parallel group, each rank a 1/N slice of every packed row. Reported per path: median seconds per
step and real tokens per second (of the whole micro-batch, i.e. of the group), the activation memory per rank
(the bytes of the tensors autograd saves for backward during the forward, parameters excluded, unique storages:
what sequence parallelism divides; `torch.cuda.max_memory_allocated` too on CUDA) and the peak resident memory of
each rank's process. Rounds alternate which path runs first (one spawn per path and round). Use long sequences:
e.g. `--sp 2 --batch-size 1 --min-len 4096 --max-len 4096 --prompt-max 256`.

`--tp N` times tensor parallelism (`hyflow.models.tensor_parallel`) the same way: the packed step in one process
(tp=1) against N spawned processes over which every decoder layer is split (q/k/v/gate/up column-wise, o/down
row-wise; embeddings, norms and the lm_head stay whole on every rank), all N running the same whole micro-batch
and computing the same loss. Reported per path, beside the --sp numbers: the parameter and the gradient memory
per rank (bytes of each tensor's local part, `DTensor.to_local()`), and the ratios tp=N / tp=1. N must divide the
preset's attention and key-value heads (tiny: 4 / 2, small: 8 / 2); `--sp` and `--tp` cannot be combined.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_train.py                     (small, 16 x U[8, 512], 3 rounds)
      OMP_NUM_THREADS=1 python benchmarks/bench_train.py --compare compile --warmup 2
      python benchmarks/bench_train.py --preset tiny --batch-size 4 --max-len 64 --rounds 1 --steps 1 --json o.json
      python benchmarks/bench_train.py --sp 2 --batch-size 1 --min-len 4096 --max-len 4096 --prompt-max 256
      python benchmarks/bench_train.py --tp 2 --batch-size 1 --min-len 4096 --max-len 4096 --prompt-max 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also when loaded by path
from machine import load_average, machine_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PATHS = ("padded", "packed")  # the paths of --compare padding (the default); --compare compile: COMPILE_PATHS
COMPILE_PATHS = ("packed", "packed+compile")


# ---------------------------------------------------------------------------------------------- options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from hyflow.models.tiny import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model of hyflow.models.tiny")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--min-len", type=int, default=8, help="shortest total sequence length (prompt + response)")
    p.add_argument("--max-len", type=int, default=512, help="longest total sequence length")
    p.add_argument("--prompt-max", type=int, default=64, help="longest prompt (at most half the sequence)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (the path order alternates per round)")
    p.add_argument("--steps", type=int, default=4, help="micro-batch steps per path per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per path before the rounds")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention of the padded path")
    p.add_argument("--optimizer-step", action="store_true", help="also time an AdamW step (lr 1e-6) per step")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--compare", default="padding", choices=("padding", "compile"),
                   help="padding: padded vs packed; compile: packed vs packed with the MLPs and norms compiled "
                        "(hyflow.models.compile, what use_torch_compile does; the compile falls in the warm-up)")
    p.add_argument("--sp", type=int, default=1, help="compare one process with N sequence-parallel ranks (Ulysses)")
    p.add_argument("--tp", type=int, default=1,
                   help="compare one process with N tensor-parallel ranks (hyflow.models.tensor_parallel: every "
                        "decoder layer split over them, all on the same micro-batch); N must divide the preset's "
                        "attention and key-value heads")
    p.add_argument("--seed", type=int, default=0, help="seed of the sequence lengths and token ids")
    p.add_argument("--workdir", default=None, help="keep the model here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write every number and the machine facts to this file")
    args = p.parse_args(argv)
    for name in ("batch_size", "rounds", "steps", "threads", "prompt_max"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    for name in ("sp", "tp"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.sp > 1 and args.tp > 1:
        p.error("--sp and --tp cannot be combined: each compares one process with N ranks of its own kind")
    if max(args.sp, args.tp) > 1 and (args.optimizer_step or args.compare != "padding" or args.attn != "sdpa"):
        p.error("--sp / --tp time the packed forward and backward only: --optimizer-step, --compare and --attn "
                "apply to the one-process comparison; drop them")
    if args.tp > 1:
        shape = PRESETS[args.preset]
        for key, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "key-value heads")):
            if shape[key] % args.tp:
                p.error(f"--tp {args.tp} must divide the {args.preset} preset's {shape[key]} {what}")
    if not 2 <= args.min_len <= args.max_len:
        p.error(f"need 2 <= --min-len <= --max-len (a prompt and a response token); got {args.min_len}, "
                f"{args.max_len}")
    return args


# ---------------------------------------------------------------------------------------------- workload
def make_batch(args: argparse.Namespace, seed: int, vocab_size: int, device):
    """B sequences: left-padded prompts ++ right-padded responses; returns (input_ids, attention_mask, R)."""
    import torch

    rng = random.Random(seed)
    shapes = []
    for _ in range(args.batch_size):
        n = rng.randint(args.min_len, args.max_len)
        p = rng.randint(1, max(1, min(args.prompt_max, n // 2)))
        shapes.append((p, n - p))
    prompt_width = max(p for p, _ in shapes)
    response_width = max(max(r for _, r in shapes), 1)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (args.batch_size, prompt_width + response_width), generator=gen)
    mask = torch.zeros_like(ids)
    for b, (p, r) in enumerate(shapes):
        mask[b, prompt_width - p : prompt_width + r] = 1
    return (ids * mask).to(device), mask.to(device), response_width


def path_step(name: str, model, batch):
    """One forward of `name` on `batch` -> (loss, computed positions). The caller times it with the backward
    (inside `compiled.active()` for "packed+compile")."""
    from hyflow.batch import Batch
    from hyflow.models.forward import response_logprobs
    from hyflow.models.packing import packed_response_logprobs
    from hyflow.workers.engine import trim_padding

    ids, mask, R, position_ids = batch
    if name.startswith("packed"):
        logp, _ = packed_response_logprobs(model, ids, mask, R)
        response_mask = mask[:, -R:]
        computed = int(mask.sum())
    else:
        seq, r = trim_padding(Batch({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}), R)
        logp, _ = response_logprobs(model, seq["input_ids"], seq["attention_mask"], seq["position_ids"], r)
        response_mask = seq["attention_mask"][:, -r:]
        computed = seq["input_ids"].numel()
    response_mask = response_mask.float()
    return -(logp * response_mask).sum() / response_mask.sum().clamp(min=1), computed


def timed_step(name: str, model, optimizer, batch, device: str, compiled=None) -> dict:
    import torch

    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with compiled.active() if name.endswith("+compile") else contextlib.nullcontext():
        loss, computed = path_step(name, model, batch)
        loss.backward()
    if optimizer is not None:
        optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"s": seconds, "tokens": int(batch[1].sum()), "computed_positions": computed, "loss": float(loss.detach())}


def summarize(rounds: dict[str, list[list[dict]]]) -> dict:
    """Per path: tokens/s per round and medians; the ratio of the second path over the first (dict order)."""
    summary: dict = {"paths": {}}
    for name, per_round in rounds.items():
        tps = [sum(s["tokens"] for s in steps) / sum(s["s"] for s in steps) for steps in per_round]
        all_steps = [s for steps in per_round for s in steps]
        summary["paths"][name] = {
            "rounds_tokens_per_s": tps,
            "median_tokens_per_s": statistics.median(tps),
            "median_s_per_step": statistics.median(s["s"] for s in all_steps),
            "tokens_per_step": statistics.mean(s["tokens"] for s in all_steps),
            "computed_positions_per_step": statistics.mean(s["computed_positions"] for s in all_steps),
        }
    by = summary["paths"]
    base, new = list(rounds)
    summary[f"ratio_{new}_over_{base}"] = by[new]["median_tokens_per_s"] / by[base]["median_tokens_per_s"]
    summary["per_round_ratios"] = [a / b for a, b in zip(by[new]["rounds_tokens_per_s"],
                                                         by[base]["rounds_tokens_per_s"])]
    return summary


def format_table(summary: dict) -> str:
    header = (f"{'path':<14} {'median s/step':>13} {'real tokens/step':>16} {'computed positions/step':>23} "
              f"{'tokens/s':>9}")
    lines = [header, "-" * len(header)]
    for name, s in summary["paths"].items():
        lines.append(f"{name:<14} {s['median_s_per_step']:>13.3f} {s['tokens_per_step']:>16.0f} "
                     f"{s['computed_positions_per_step']:>23.0f} {s['median_tokens_per_s']:>9.0f}")
    base, new = summary["paths"]
    lines.append(f"ratio {new}/{base} (median tokens/s): {summary[f'ratio_{new}_over_{base}']:.2f}x; per round: "
                 + ", ".join(f"{v:.2f}x" for v in summary["per_round_ratios"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; run with --device cpu")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.sp > 1:
            return _run_parallel(args, "sp")
        if args.tp > 1:
            return _run_parallel(args, "tp")
        return _run_benchmark(args)
    finally:
        torch.set_num_threads(threads_before)  # main() may run inside another process (the smoke test)


def _run_benchmark(args: argparse.Namespace) -> dict:
    import torch

    from hyflow.models.forward import compute_position_ids
    from hyflow.models.loading import load_causal_lm
    from hyflow.models.tiny import make_tiny_model

    machine = machine_info()
    machine["load_average_before"] = load_average()
    print(f"train benchmark: preset={args.preset} batch={args.batch_size} lengths U[{args.min_len}, {args.max_len}] "
          f"prompt<= {args.prompt_max} rounds={args.rounds} steps={args.steps} warmup={args.warmup} "
          f"attn(padded)={args.attn} optimizer_step={args.optimizer_step} dtype={args.dtype} device={args.device} "
          f"compare={args.compare}",
          flush=True)
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']} "
          f"(OMP_NUM_THREADS={machine['OMP_NUM_THREADS']}), load average {machine['load_average_before']}; "
          f"python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}"
          + (f", gpu {machine['gpu']}" if "gpu" in machine else ""), flush=True)

    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model_dir = make_tiny_model(workdir / f"model-{args.preset}", preset=args.preset, seed=0)
        model = load_causal_lm(str(model_dir), dtype=args.dtype, attn_implementation=args.attn, device=args.device)
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6) if args.optimizer_step else None
    vocab = model.config.vocab_size

    def batch(seed: int):
        ids, mask, R = make_batch(args, seed, vocab, args.device)
        return ids, mask, R, compute_position_ids(mask)

    paths = COMPILE_PATHS if args.compare == "compile" else PATHS
    compiled = None
    if args.compare == "compile":
        from hyflow.models.compile import CompiledModules

        compiled = CompiledModules(model)
    check = batch(args.seed * 100_003 + 99_991)
    losses = {}
    for name in paths:
        with torch.no_grad(), compiled.active() if name.endswith("+compile") else contextlib.nullcontext():
            losses[name] = float(path_step(name, model, check)[0])
    loss_diff = abs(losses[paths[1]] - losses[paths[0]])
    print(f"loss check: {paths[0]} {losses[paths[0]]:.6f}, {paths[1]} {losses[paths[1]]:.6f}, |diff| {loss_diff:.2e}",
          flush=True)
    for i in range(args.warmup):
        for name in paths:
            timed_step(name, model, optimizer, batch(args.seed * 100_003 + 50_000 + i), args.device, compiled)

    rounds: dict[str, list[list[dict]]] = {name: [] for name in paths}
    for r in range(args.rounds):
        batches = [batch(args.seed * 100_003 + r * args.steps + s) for s in range(args.steps)]
        steps: dict[str, list[dict]] = {name: [] for name in paths}
        for s, b in enumerate(batches):  # both paths on each batch back to back; the order alternates
            for name in paths if (r + s) % 2 == 0 else paths[::-1]:
                steps[name].append(timed_step(name, model, optimizer, b, args.device, compiled))
        for name in paths:
            rounds[name].append(steps[name])
            seconds = sum(step["s"] for step in steps[name])
            print(f"round {r + 1}/{args.rounds} {name}: {seconds:.2f} s, "
                  f"{sum(step['tokens'] for step in steps[name]) / seconds:.0f} tokens/s", file=sys.stderr, flush=True)
    summary = summarize(rounds)
    machine["load_average_after"] = load_average()
    print(format_table(summary))
    print(f"load average before {machine['load_average_before']}, after {machine['load_average_after']}; "
          f"{parameters:,} parameters")
    report = {"args": vars(args), "machine": machine, "parameters": parameters, "loss_check": losses,
              "loss_check_abs_diff": loss_diff, "results": summary, "rounds": rounds}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


# ---------------------------------------------------------------------------------------------- --sp N / --tp N
MODES = {"sp": "sequence-parallel", "tp": "tensor-parallel"}


def _activation_bytes(model, step) -> tuple:
    """(result of step(), bytes of the unique non-parameter tensors autograd saved during it). A saved DTensor
    (tensor parallelism) counts as its local part."""
    import torch

    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = _local(tensor).untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = step()
    return out, sum(seen.values())


def _local(tensor):
    """This rank's part of a DTensor (a tensor-parallel split), or the tensor itself (`DTensor.to_local()`, as
    `hyflow.workers.fsdp.local_tensor`; kept here so that --sp needs nothing of the tensor-parallel work)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor; None entries skipped."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def _parallel_rank(rank: int, mode: str, args: argparse.Namespace, model_dir: str, init_file: str, out_file: str,
                   world: int) -> None:
    """One rank of a `--sp` / `--tp` run (`mode`; world 1: the one-process baseline): warm-up, then `--steps`
    timed packed steps on each round's batches; rank 0 writes every rank's numbers to `out_file`. sp: the ranks
    form one Ulysses group, each a slice of every row; tp: every decoder layer is split over the ranks
    (`hyflow.models.tensor_parallel`), all of which run the whole micro-batch."""
    import resource
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hyflow.models import ulysses
    from hyflow.models.forward import compute_position_ids
    from hyflow.models.loading import load_causal_lm

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=600))
    model = load_causal_lm(model_dir, dtype=args.dtype, device=device)
    model.train()
    group = None
    if world > 1 and mode == "sp":
        from hyflow.parallel import ParallelDims

        group = ParallelDims(world_size=world, sp=world).build_mesh(args.device).group("sp")
    elif world > 1:
        from hyflow.models.tensor_parallel import apply_tensor_parallel
        from hyflow.parallel import ParallelDims
        from hyflow.parallel.fsdp import decoder_layers

        mesh = ParallelDims(world_size=world, tp=world).build_mesh(args.device)
        apply_tensor_parallel(model, decoder_layers(model), mesh.get("tp"))
    vocab = model.config.vocab_size

    def batch(seed: int):
        ids, mask, R = make_batch(args, seed, vocab, device)
        return ids, mask, R, compute_position_ids(mask)

    def step(b):
        model.zero_grad(set_to_none=True)
        with ulysses.sequence_parallel(group) if mode == "sp" else contextlib.nullcontext():
            loss, _ = path_step("packed", model, b)
        loss.backward()
        return loss

    for i in range(args.warmup):
        step(batch(args.seed * 100_003 + 50_000 + i))
    records = []
    for r in range(args.rounds):
        for s in range(args.steps):
            b = batch(args.seed * 100_003 + r * args.steps + s)
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            dist.barrier()
            t0 = time.perf_counter()
            loss, saved = _activation_bytes(model, lambda b=b: step(b))
            if args.device == "cuda":
                torch.cuda.synchronize()
            record = {"round": r, "s": time.perf_counter() - t0, "tokens": int(b[1].sum()),
                      "loss": float(loss.detach()), "saved_bytes": saved}
            if mode == "tp":
                record["parameter_bytes"] = _local_bytes(model.parameters())
                record["gradient_bytes"] = _local_bytes(p.grad for p in model.parameters())
            if args.device == "cuda":
                record["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            records.append(record)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
    everything = [None] * world
    dist.all_gather_object(everything, {"rank": rank, "records": records, "peak_rss_bytes": rss})
    if rank == 0:
        Path(out_file).write_text(json.dumps(everything))
    dist.destroy_process_group()


def _spawn(mode: str, args: argparse.Namespace, model_dir: str, world: int, workdir: Path, tag: str) -> list[dict]:
    import torch.multiprocessing as mp

    init_file, out_file = workdir / f"init-{tag}", workdir / f"out-{tag}.json"
    init_file.unlink(missing_ok=True)
    mp.start_processes(_parallel_rank, args=(mode, args, model_dir, str(init_file), str(out_file), world),
                       nprocs=world, join=True, start_method="spawn")
    return json.loads(out_file.read_text())


def _run_parallel(args: argparse.Namespace, mode: str) -> dict:
    """`--sp N` or `--tp N` (`mode`): the packed step in one process against N ranks, one spawn per path and
    round."""
    from hyflow.models.tiny import make_tiny_model

    size = getattr(args, mode)
    machine = machine_info()
    machine["load_average_before"] = load_average()
    print(f"{MODES[mode]} benchmark: {mode}={size} preset={args.preset} batch={args.batch_size} lengths "
          f"U[{args.min_len}, {args.max_len}] prompt<= {args.prompt_max} rounds={args.rounds} steps={args.steps} "
          f"warmup={args.warmup} threads/rank={args.threads} dtype={args.dtype} device={args.device}", flush=True)
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, load average {machine['load_average_before']}; "
          f"torch {machine['torch']}" + (f", gpu {machine['gpu']}" if "gpu" in machine else ""), flush=True)
    paths = {f"{mode}=1": 1, f"{mode}={size}": size}
    results: dict[str, list] = {name: [] for name in paths}
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model_dir = str(make_tiny_model(workdir / f"model-{args.preset}", preset=args.preset, seed=0))
        rounds, args.rounds = args.rounds, 1  # one spawn per path and round; the order alternates per round
        try:
            for r in range(rounds):
                for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                    ranks = _spawn(mode, args, model_dir, paths[name], workdir, f"{name}-{r}")
                    results[name].append(ranks)
                    steps = ranks[0]["records"]
                    seconds = sum(x["s"] for x in steps)
                    print(f"round {r + 1}/{rounds} {name}: {seconds:.2f} s, "
                          f"{sum(x['tokens'] for x in steps) / seconds:.0f} tokens/s", file=sys.stderr, flush=True)
        finally:
            args.rounds = rounds
    summary: dict = {"paths": {}}
    for name, per_round in results.items():
        tps = [sum(x["tokens"] for x in ranks[0]["records"]) / max(max(sum(x["s"] for x in rk["records"])
                                                                         for rk in ranks), 1e-9)
               for ranks in per_round]
        steps = [x for ranks in per_round for x in ranks[0]["records"]]
        every = [x for ranks in per_round for rk in ranks for x in rk["records"]]  # every rank's steps
        summary["paths"][name] = {
            "ranks": paths[name], "rounds_tokens_per_s": tps, "median_tokens_per_s": statistics.median(tps),
            "median_s_per_step": statistics.median(x["s"] for x in steps),
            "tokens_per_step": statistics.mean(x["tokens"] for x in steps),
            "activation_mb_per_rank": max(x["saved_bytes"] for x in every) / 2**20,
            "peak_rss_mb_per_rank": max(rk["peak_rss_bytes"] for ranks in per_round for rk in ranks) / 2**20,
            "losses": [x["loss"] for x in steps],
        }
        if mode == "tp":
            summary["paths"][name]["parameter_mb_per_rank"] = max(x["parameter_bytes"] for x in every) / 2**20
            summary["paths"][name]["gradient_mb_per_rank"] = max(x["gradient_bytes"] for x in every) / 2**20
            # every rank of the group computes the same loss: the largest spread within a step
            summary["paths"][name]["max_loss_spread_across_ranks"] = max(
                (max(rk["records"][i]["loss"] for rk in ranks) - min(rk["records"][i]["loss"] for rk in ranks))
                for ranks in per_round for i in range(len(ranks[0]["records"])))
        cuda = [x["cuda_peak_bytes"] for x in every if "cuda_peak_bytes" in x]
        if cuda:
            summary["paths"][name]["cuda_peak_mb_per_rank"] = max(cuda) / 2**20
    one, many = (summary["paths"][name] for name in paths)
    summary["ratio_tokens_per_s"] = many["median_tokens_per_s"] / one["median_tokens_per_s"]
    summary["ratio_activation_memory"] = many["activation_mb_per_rank"] / one["activation_mb_per_rank"]
    if mode == "tp":
        summary["ratio_parameter_memory"] = many["parameter_mb_per_rank"] / one["parameter_mb_per_rank"]
        summary["ratio_parameters_and_gradients"] = (
            (many["parameter_mb_per_rank"] + many["gradient_mb_per_rank"])
            / (one["parameter_mb_per_rank"] + one["gradient_mb_per_rank"]))
        if "cuda_peak_mb_per_rank" in one and "cuda_peak_mb_per_rank" in many:
            summary["ratio_cuda_peak_memory"] = many["cuda_peak_mb_per_rank"] / one["cuda_peak_mb_per_rank"]
    summary["max_loss_abs_diff"] = max(abs(a - b) for a, b in zip(one["losses"], many["losses"]))
    machine["load_average_after"] = load_average()
    print(_format_parallel_table(summary, mode))
    many_name = f"{mode}={size}"
    if mode == "sp":
        print(f"ratio {many_name}/sp=1: tokens/s {summary['ratio_tokens_per_s']:.2f}x, activation memory per rank "
              f"{summary['ratio_activation_memory']:.2f}x; losses equal to {summary['max_loss_abs_diff']:.1e}; load "
              f"average before {machine['load_average_before']}, after {machine['load_average_after']}")
    else:
        cuda = (f", CUDA peak memory per rank {summary['ratio_cuda_peak_memory']:.2f}x"
                if "ratio_cuda_peak_memory" in summary else "")
        print(f"ratio {many_name}/tp=1: tokens/s {summary['ratio_tokens_per_s']:.2f}x, parameters+gradients per rank "
              f"{summary['ratio_parameters_and_gradients']:.2f}x (parameters {summary['ratio_parameter_memory']:.2f}x"
              f"; embeddings, norms and lm_head are replicated), activation memory per rank "
              f"{summary['ratio_activation_memory']:.2f}x{cuda}; losses equal to {summary['max_loss_abs_diff']:.1e}; "
              f"load average before {machine['load_average_before']}, after {machine['load_average_after']}")
    report = {"args": vars(args), "machine": machine, "results": summary, "raw": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _format_parallel_table(summary: dict, mode: str) -> str:
    """The per-path table of `--sp` / `--tp`: (title, summary key, width, format) per column after the path."""
    columns = [("ranks", "ranks", 5, "d"), ("median s/step", "median_s_per_step", 13, ".3f"),
               ("real tokens/step", "tokens_per_step", 16, ".0f"), ("tokens/s", "median_tokens_per_s", 9, ".0f")]
    if mode == "tp":
        columns += [("params MB/rank", "parameter_mb_per_rank", 14, ".1f"),
                    ("grads MB/rank", "gradient_mb_per_rank", 13, ".1f")]
    columns += [("activations MB/rank", "activation_mb_per_rank", 19, ".1f"),
                ("peak RSS MB/rank", "peak_rss_mb_per_rank", 16, ".0f")]
    if mode == "tp" and any("cuda_peak_mb_per_rank" in x for x in summary["paths"].values()):
        columns.append(("CUDA peak MB/rank", "cuda_peak_mb_per_rank", 17, ".1f"))
    header = f"{'path':<8} " + " ".join(f"{title:>{width}}" for title, _, width, _ in columns)
    lines = [header, "-" * len(header)]
    for name, x in summary["paths"].items():
        lines.append(f"{name:<8} " + " ".join(f"{x.get(key, float('nan')):>{width}{fmt}}"
                                              for _, key, width, fmt in columns))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
