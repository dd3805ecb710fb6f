"""The pipeline-parallel bubble fraction of torch.distributed.pipelining's schedules, measured against the schedules'
theory, on CPU with gloo.

Model: a stack of `--blocks` identical residual MLP blocks (x + Linear(4w -> w)(GELU(Linear(w -> 4w)(x))), width
`--width`, fp32), cut into p stages of consecutive blocks (p = `--pp`); for the interleaved schedule into p x v chunks
(v = `--virtual`), chunk i on rank i mod p, so each rank holds v chunks of blocks / (p v) blocks. One training step is
the schedule's `step()` over m micro-batches of `--rows` rows each (the batch grows with m, so every micro-batch has
the same work and the per-micro-batch overheads are the same share of it for every m): forward, an MSE loss on the
last stage, backward. No optimizer step (it is not pipelined and would only add the same time to every case);
gradients are set to None before each step; `scale_grads=False` (dividing every gradient by m is non-pipelined work
that the theory does not model). Schedules: `ScheduleGPipe` (all forwards, then all backwards), `Schedule1F1B`
(PipeDream-Flush: after a warm-up of p - rank forwards, one backward then one forward), `ScheduleInterleaved1F1B`
(1F1B over v chunks per rank, depth first).

Each p runs in p freshly spawned processes (tests/ranks.py's `spawn_ranks`, the tests' guarded spawner) that form one
gloo group on loopback (GLOO_SOCKET_IFNAME=lo, a file store, one torch thread per rank: torch.set_num_threads(1)) and
build every case of that p. Each case runs `--warmup` unmeasured steps (the first one also infers the stages' shapes
and warms the p2p connections); then the `--steps` measured steps go round-robin over the cases (step k of every case
before step k + 1 of any), so that a slow spell of a shared machine falls on all cases alike. Every step starts after
a barrier, with the gradients freed and the garbage collector run before it. On every rank:

    busy     the time inside its stages' `forward_one_chunk` and `backward_one_chunk` and the loss function
             (time.perf_counter around each call, the stage's methods wrapped on the instance). The schedule receives
             a chunk's input (activations or gradients) and waits for it before calling these, so the time blocked
             on a receive is not busy; the sends are started after them and waited on later.
    span     one step's wall time: from the earliest rank's start to the latest rank's end (time.perf_counter is
             CLOCK_MONOTONIC, one clock for all processes of the machine). The theory's step is the whole
             pipeline's, not one rank's: in GPipe the last stage finishes its own work (p - 1) backwards before the
             first stage does.

Measured bubble of a rank = 1 - busy / span, per step; its median over the measured steps is the rank's figure; the
table shows their mean over ranks and their max. Step ms = the median span.

Theory (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
SC'21, arXiv 2104.04473, section 2.2): with p equal stages, m micro-batches, forward and backward times t_f, t_b per
stage and micro-batch, and free communication, GPipe and 1F1B (PipeDream-Flush) idle each device for
(p - 1)(t_f + t_b) per step against m (t_f + t_b) of work: the paper's "bubble time fraction" (p - 1) / m is bubble
time / ideal compute time. The interleaved schedule with v chunks per device shrinks the bubble time to
(p - 1)(t_f + t_b) / v, fraction (p - 1) / (v m). This script reports the bubble as the idle share of the step (what
1 - busy/span measures), which is x / (1 + x) of the paper's x:

    GPipe, 1F1B:       (p - 1) / (m + p - 1)          (the same for both: 1F1B saves activation memory, not time)
    interleaved 1F1B:  (p - 1) / (v m + p - 1)

The formulas hold for Schedule1F1B only with m >= p (torch refuses m < p) and for the interleaved schedule when m is
a multiple of p (the paper's condition; torch runs other m with another warm-up, whose bubble the formula does not
give): such grid points are skipped with a note. They assume equal stages; here the first stage's backward skips the
input gradient of its first linear (its input needs none) and the last stage adds the loss, so the stages differ by a
few percent (each rank's compute per micro-batch is in the JSON).

Why the measurement exceeds the theory (the table's "excess ms" = span - (v m + p - 1) / v x the mean rank's compute
per micro-batch, the step time the theory does not explain): every activation and gradient crosses gloo over loopback
(a copy through the kernel's TCP stack, measured once per run as the one-way time of one micro-batch's activation,
"p2p ms"); a receive waited on is bubble, and the schedules sit on the critical path of several of them per
micro-batch (the interleaved one of p v - 1 crossings each way, not p - 1); a rank blocked in a receive must be woken
and get a core back when the data arrives, which takes long when other processes hold the cores; the schedule's own
Python between compute calls (posting sends and receives, bookkeeping) is not busy either; unequal stages pace the
pipeline at the slowest one. So the measured bubble includes communication waiting
and overhead, as it would on a real cluster, and tends to the theory as the compute per micro-batch grows against
them.

Cores: with p ranks on a machine of fewer than p cores the processes time-share the cores. A rank that is runnable
but descheduled counts as busy (wall time inside its compute), and the steady-state phases, where every rank
computes, run slower than with one core per rank. The "desched" column is 1 - (thread CPU time / wall time) inside
the compute calls, mean over ranks: the share of "busy" during which the rank did not run (other ranks or other
processes held the core). The default runs p = 2 only, which fits 2 cores; `--pp 2,4` adds p = 4, which on 2 cores
time-shares (its numbers then say more about the machine than the schedule). Other processes on the machine disturb
the timings too: the load average before and after the run is in the JSON.

Run:  python benchmarks/bench_pipeline_bubble.py --json benchmarks/results/pipeline_bubble.json
      python benchmarks/bench_pipeline_bubble.py --pp 2,4 --schedules 1f1b,interleaved --microbatches 4,8
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also when loaded by path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/ranks.py: the guarded rank spawner
from machine import load_average, run_provenance

SCHEDULES = ("gpipe", "1f1b", "interleaved")
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


# ------------------------------------------------------------------------------------------ the theory


def case_problem(schedule: str, p: int, m: int, v: int = 1) -> str | None:
    """Why (schedule, p, m, v) has no theory value or cannot run, in words; None when it can (module docstring)."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}; choose from {list(SCHEDULES)}"
    if p < 2 or m < 1:
        return f"needs p >= 2 stages and m >= 1 micro-batches (got p={p}, m={m})"
    if schedule == "interleaved":
        if v < 2:
            return f"the interleaved schedule needs v >= 2 chunks per rank (got v={v})"
        if m % p:
            return f"the interleaved theory needs m a multiple of p (m={m}, p={p})"
    elif v != 1:
        return f"{schedule} holds one stage per rank (v=1, got v={v})"
    if schedule == "1f1b" and m < p:
        return f"Schedule1F1B needs m >= p (m={m}, p={p}; torch refuses fewer)"
    return None


def bubble_theory(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a pipeline step with p equal stages and m micro-batches and free communication
    (Narayanan et al. 2021, section 2.2, as idle / step time): GPipe and 1F1B (p - 1) / (m + p - 1), interleaved 1F1B
    with v chunks per rank (p - 1) / (v m + p - 1). ValueError (with the reason) where the formula does not apply."""
    problem = case_problem(schedule, p, m, v)
    if problem:
        raise ValueError(problem)
    return (p - 1) / (v * m + p - 1)


@dataclass(frozen=True)
class Case:
    """One measured point: a schedule over p ranks with v chunks per rank (1 but for interleaved) and m micro-batches."""

    schedule: str
    p: int
    v: int
    m: int

    @property
    def name(self) -> str:
        return f"{self.schedule}-p{self.p}-v{self.v}-m{self.m}"


# ------------------------------------------------------------------------------------------ one rank


def make_chunk(stage_index: int, blocks: int, width: int):
    """The blocks of pipeline stage `stage_index` (its own seed: the same weights whatever the schedule)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.act, self.down = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(self.act(self.up(x)))

    torch.manual_seed(1000 + stage_index)
    return nn.Sequential(*(Block() for _ in range(blocks)))


def instrument(stage, log: list) -> None:
    """Time every call of the stage's forward_one_chunk / backward_one_chunk into `log` as (kind, start, end, cpu)."""
    for method in ("forward_one_chunk", "backward_one_chunk"):
        original = getattr(stage, method)

        def timed(*args, _original=original, _kind=method[0], **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                log.append((_kind, start, time.perf_counter(), time.thread_time() - cpu))

        setattr(stage, method, timed)


def timed_mse(log: list):
    """The loss (mean squared error), timed into `log` as kind "l"."""
    import torch.nn.functional as F

    def loss(output, target):
        start, cpu = time.perf_counter(), time.thread_time()
        value = F.mse_loss(output, target)
        log.append(("l", start, time.perf_counter(), time.thread_time() - cpu))
        return value

    return loss


class RankCase:
    """This rank's part of one case: its stages (instrumented), the schedule, the batch, and the steps measured."""

    def __init__(self, case: Case, rank: int, opts: dict):
        import torch
        from torch.distributed import pipelining

        n_stages = case.p * case.v
        self.case, self.rank, self.log, self.steps = case, rank, [], []
        self.indices = [rank + k * case.p for k in range(case.v)]  # the looped placement: chunk i on rank i mod p
        self.per_chunk = opts["blocks"] // n_stages
        stages, self.modules = [], []
        for index in self.indices:
            module = make_chunk(index, self.per_chunk, opts["width"])
            stage = pipelining.PipelineStage(module, index, n_stages, torch.device("cpu"))
            instrument(stage, self.log)
            stages.append(stage)
            self.modules.append(module)
        schedule_class = getattr(pipelining, SCHEDULE_CLASSES[case.schedule])
        self.schedule = schedule_class(stages if case.schedule == "interleaved" else stages[0],
                                       n_microbatches=case.m, loss_fn=timed_mse(self.log), scale_grads=False)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(case.m * opts["rows"], opts["width"], generator=generator)
        self.y = torch.randn(case.m * opts["rows"], opts["width"], generator=generator)
        self.first, self.last = 0 in self.indices, n_stages - 1 in self.indices

    def step(self, measured: bool) -> None:
        """One training step after a barrier (gradients freed and the garbage collected before it)."""
        import torch.distributed as dist

        for module in self.modules:
            module.zero_grad(set_to_none=True)
        gc.collect()
        self.log.clear()
        dist.barrier()
        start = time.perf_counter()
        self.schedule.step(*((self.x,) if self.first else ()), target=self.y if self.last else None,
                           losses=[] if self.last else None, return_outputs=False)
        end = time.perf_counter()
        if measured:
            self.steps.append({"start": start, "end": end, "calls": list(self.log)})

    def result(self) -> dict:
        return {"rank": self.rank, "stage_indices": self.indices, "blocks_per_chunk": self.per_chunk,
                "steps": self.steps}


def run_cases(cases: list[Case], rank: int, opts: dict) -> list[dict]:
    """Every case's warm-up steps, then the measured steps round-robin over the cases (step k of every case before
    step k + 1 of any), so that a slow spell of the machine falls on all cases alike; this rank's raw timings."""
    mine = [RankCase(case, rank, opts) for case in cases]
    for part in mine:
        for _ in range(opts["warmup"]):
            part.step(measured=False)
    for _ in range(opts["steps"]):
        for part in mine:
            part.step(measured=True)
    return [part.result() for part in mine]


def measure_p2p(rank: int, opts: dict, repeats: int = 30) -> float | None:
    """The one-way time of one micro-batch's activation (rows x width fp32) between ranks 0 and 1: half the median
    round trip of a blocking send / recv ping-pong (seconds; on rank 0, None elsewhere)."""
    import torch
    import torch.distributed as dist

    buffer = torch.randn(opts["rows"], opts["width"])
    trips = []
    for i in range(5 + repeats):
        if rank == 0:
            start = time.perf_counter()
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
            if i >= 5:
                trips.append(time.perf_counter() - start)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
    dist.barrier()
    return statistics.median(trips) / 2 if rank == 0 else None


def rank_main(rank: int, p: int, cases: list[dict], init_file: str, out_file: str, opts: dict) -> None:
    """One rank of the p-rank group: the p2p probe, then every case; rank 0 writes everything gathered."""
    import torch.distributed as dist
    from ranks import init_gloo

    init_gloo(rank, p, init_file)
    p2p = measure_p2p(rank, opts)
    cases = [Case(**fields) for fields in cases]
    gathered: list = [None] * p
    dist.all_gather_object(gathered, run_cases(cases, rank, opts))
    if rank == 0:
        results = {case.name: [by_rank[i] for by_rank in gathered] for i, case in enumerate(cases)}
        Path(out_file).write_text(json.dumps({"p2p_one_way_s": p2p, "cases": results}))
    dist.barrier()
    dist.destroy_process_group()


def spawn(p: int, cases: list[Case], workdir: Path, opts: dict) -> dict:
    """Run `cases` (all of pipeline size p) in p spawned processes (tests/ranks.py's `spawn_ranks`: gloo on loopback,
    one torch thread, a watchdog that ends a rank `--timeout` seconds after it started, no rank outlives the call);
    what rank 0 gathered."""
    from ranks import spawn_ranks

    init_file, out_file = workdir / f"init-p{p}", workdir / f"result-p{p}.json"
    init_file.unlink(missing_ok=True)
    spawn_ranks(rank_main, args=(p, [asdict(c) for c in cases], str(init_file), str(out_file), opts), nprocs=p,
                timeout_s=opts["timeout"])
    return json.loads(out_file.read_text())


# ------------------------------------------------------------------------------------------ summary


def summarize(case: Case, ranks: list[dict], p2p_s: float | None) -> dict:
    """Per step: span = latest end - earliest start; per rank busy (seconds inside compute) and CPU time inside it.
    Per rank the median over steps; the case's figures over ranks (module docstring)."""
    n_steps = len(ranks[0]["steps"])
    spans = [max(r["steps"][s]["end"] for r in ranks) - min(r["steps"][s]["start"] for r in ranks)
             for s in range(n_steps)]
    per_rank, per_step = [], []
    for r in ranks:
        busy = [sum(end - start for _, start, end, _ in step["calls"]) for step in r["steps"]]
        cpu = [sum(c for *_, c in step["calls"]) for step in r["steps"]]
        kinds = {k: [end - start for step in r["steps"] for kind, start, end, _ in step["calls"] if kind == k]
                 for k in ("f", "b", "l")}
        per_step.append([1 - b / s for b, s in zip(busy, spans, strict=True)])
        per_rank.append({
            "rank": r["rank"], "stage_indices": r["stage_indices"],
            "bubble": statistics.median(per_step[-1]),
            "busy_ms": statistics.median(busy) * 1e3,
            "own_wall_ms": statistics.median(st["end"] - st["start"] for st in r["steps"]) * 1e3,
            "compute_per_microbatch_ms": statistics.median(busy) * 1e3 / case.m,
            "forward_call_ms": statistics.median(kinds["f"]) * 1e3,
            "backward_call_ms": statistics.median(kinds["b"]) * 1e3,
            "loss_call_ms": statistics.median(kinds["l"]) * 1e3 if kinds["l"] else 0.0,
            "calls_per_step": len(r["steps"][0]["calls"]),
            "descheduled": 1 - sum(cpu) / sum(busy),
        })
    bubbles = [r["bubble"] for r in per_rank]
    step_ms = statistics.median(spans) * 1e3
    compute = statistics.fmean(r["compute_per_microbatch_ms"] for r in per_rank)
    ideal_ms = (case.v * case.m + case.p - 1) / case.v * compute
    return {
        "case": {**asdict(case), "schedule_class": SCHEDULE_CLASSES[case.schedule]},
        "theory": bubble_theory(case.schedule, case.p, case.m, case.v),
        "measured_mean": statistics.fmean(bubbles), "measured_max": max(bubbles), "measured_min": min(bubbles),
        "step_ms": step_ms, "step_ms_min": min(spans) * 1e3, "step_ms_max": max(spans) * 1e3,
        "steps_measured": n_steps,
        "compute_per_microbatch_ms": compute, "ideal_step_ms": ideal_ms, "excess_ms": step_ms - ideal_ms,
        "p2p_one_way_ms": None if p2p_s is None else p2p_s * 1e3,
        "descheduled_mean": statistics.fmean(r["descheduled"] for r in per_rank),
        "per_rank": per_rank,
        "bubble_per_step": [statistics.fmean(step) for step in zip(*per_step, strict=True)],  # mean over ranks
        "step_ms_per_step": [span * 1e3 for span in spans],
    }


def print_table(summary: dict) -> None:
    print("| schedule | p | v | m | theory | measured mean | measured max | step ms | compute ms/mb | excess ms | "
          "p2p ms | desched |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summary["cases"].values():
        c = s["case"]
        print(f"| {c['schedule']} | {c['p']} | {c['v']} | {c['m']} | {s['theory']:.3f} | {s['measured_mean']:.3f} | "
              f"{s['measured_max']:.3f} | {s['step_ms']:.1f} | {s['compute_per_microbatch_ms']:.1f} | "
              f"{s['excess_ms']:.1f} | {s['p2p_one_way_ms']:.2f} | {s['descheduled_mean']:.1%} |")
    for note in summary["skipped"]:
        print(f"- skipped {note}")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def plan_cases(schedules: list[str], pps: list[int], microbatches: list[int], v: int) -> tuple[list[Case], list[str]]:
    """The grid schedule x p x m: the cases the theory covers, and a note for each grid point it does not."""
    cases, skipped = [], []
    for p in pps:
        for schedule in schedules:
            for m in microbatches:
                case = Case(schedule, p, v if schedule == "interleaved" else 1, m)
                problem = case_problem(case.schedule, p, m, case.v)
                if problem:
                    skipped.append(f"{case.name}: {problem}")
                else:
                    cases.append(case)
    return cases, skipped


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated: " + ", ".join(SCHEDULES))
    parser.add_argument("--pp", type=_int_list, default=[2], help="pipeline sizes p (ranks), comma-separated; p=4 "
                        "on a 2-core machine time-shares the cores")
    parser.add_argument("--virtual", type=int, default=2, help="chunks per rank v of the interleaved schedule")
    parser.add_argument("--microbatches", type=_int_list, default=[1, 2, 4, 8], help="micro-batch counts m")
    parser.add_argument("--blocks", type=int, default=8, help="MLP blocks in the whole model (divisible by p, and "
                        "by p x v for the interleaved schedule)")
    parser.add_argument("--width", type=int, default=512, help="block width w (hidden 4w)")
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per case (the first infers shapes)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per case (median)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the ranks of one p may run")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        parser.error(f"unknown schedule(s) {unknown}; choose from {list(SCHEDULES)}")
    if min(args.pp) < 2:
        parser.error(f"--pp {args.pp}: a pipeline needs at least 2 stages")
    if min(args.microbatches) < 1:
        parser.error(f"--microbatches {args.microbatches}: at least 1 micro-batch")
    if "interleaved" in schedules and args.virtual < 2:
        parser.error(f"--virtual {args.virtual}: the interleaved schedule needs at least 2 chunks per rank")
    for p in args.pp:
        chunks = p * args.virtual if "interleaved" in schedules else p
        if args.blocks % chunks:
            parser.error(f"--blocks {args.blocks} does not divide into {chunks} equal stages (p={p}"
                         + (f" x v={args.virtual})" if "interleaved" in schedules else ")"))
    if min(args.width, args.rows, args.steps) < 1 or args.warmup < 1:
        parser.error("--width, --rows, --steps and --warmup must be at least 1 (the first step infers shapes)")
    cases, skipped = plan_cases(schedules, args.pp, args.microbatches, args.virtual)
    if not cases:
        parser.error("no case to run: " + "; ".join(skipped))
    opts = {"blocks": args.blocks, "width": args.width, "rows": args.rows, "warmup": args.warmup,
            "steps": args.steps, "timeout": args.timeout}
    load_before = load_average()
    started = time.perf_counter()
    raw, timings = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.pp:
            mine = [c for c in cases if c.p == p]
            if not mine:
                continue
            t0 = time.perf_counter()
            raw[p] = spawn(p, mine, Path(tmp), opts)
            timings[f"p{p}"] = round(time.perf_counter() - t0, 1)
            print(f"# p={p}: {len(mine)} case(s) on {p} ranks, {timings[f'p{p}']} s", flush=True)
    summary = {"args": vars(args), "model": {"blocks": args.blocks, "width": args.width, "hidden": 4 * args.width,
                                             "rows_per_microbatch": args.rows,
                                             "parameters": args.blocks * (8 * args.width ** 2 + 5 * args.width)},
               "cases": {}, "skipped": skipped, "spawn_wall_s": timings}
    for case in cases:
        summary["cases"][case.name] = summarize(case, raw[case.p]["cases"][case.name], raw[case.p]["p2p_one_way_s"])
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    summary.update(run_provenance(load_before))
    machine = summary["machine"]
    print(f"# pipeline bubble, forward + backward, fp32 on CPU (gloo, loopback), {args.blocks} blocks of width "
          f"{args.width}, {args.rows} rows per micro-batch; {machine['cpu']}, {machine['cores']} cores, torch "
          f"{machine['torch']}; load {summary['load_average_before']} -> {summary['load_average_after']}; "
          f"{summary['wall_s']} s")
    print_table(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
