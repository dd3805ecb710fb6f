"""Asynchronous training: samples/s and time to a target reward of `async_training.mode` sync, one_step_off and
fully_async, side by side in one run, on the same two worker processes.

Workload (the quickstart's, `examples/quickstart/`): the built-in arithmetic task (3-operand one-digit sums and
differences, half of the SFT demonstrations without the `#### answer` line the checker reads), a random-weight
model from `hyflow.models.tiny` (`--preset`) warm-started by SFT on it (`--sft-steps`, once, shared by every
mode; 0 = no warm start: the random model, which learns nothing in a few steps), then GRPO with the checker's 0/1
score: P prompts (`--prompts`) x G samples (`--group`) of at most T new tokens (`--max-new-tokens`) per step,
temperature 1, one AdamW step per RL step, no KL, no validation, no checkpoints. The same seed, data order and
start weights in every mode. Each mode runs in a process of its own (`trainer.executor=ray`, a local Ray
cluster on 127.0.0.1), on two worker processes:

    sync          trainer.n_gpus_per_node=2: FSDP2 over 2 workers (gloo on CPU), the rollout colocated (each
                  worker generates half the batch, then both train on it)
    one_step_off  trainer.n_gpus_per_node=1 rollout.n_gpus_per_node=1: one trainer worker, one rollout worker;
                  step k+1's rollout runs while step k trains, every sample one version old
    fully_async   the same two workers; the rollout generates continuously into a bounded buffer, weight pushes
                  reach trajectories in flight (partial rollouts); async_training defaults otherwise

The asynchronous modes need the rollout's log-probs (`calculate_log_probs=true`) and, by default, correct for the
staleness with token-level importance weights, which costs one more forward pass over the batch (pi_old is
recomputed); the synchronous step is on-policy and skips it.

Measured per mode, from the steps' own timers (`timing_s/step_total`: start-up, Ray and the model load are
excluded and printed apart): samples/s = P x G x measured steps / their seconds (the first `--warmup` steps
are not measured), the median step time, the trainer's wait for a batch, the rollout's busy time, the overlap
share, staleness, weight-sync time; and the time to target: the seconds of steps 1..k (warm-up included)
where k is the first step at which the mean `critic/score/mean` of the last `--smooth` steps reaches
`--target` ("-" when it never does). With `--rounds` > 1 each mode runs again, the order rotating each round,
and the summary takes the median over rounds.

Run:  python benchmarks/bench_async.py                  (tiny, 600 SFT steps, 16 prompts x 8 x 32 tokens,
                                                         2 rounds x 60 RL steps per mode; ~6 min on 2 CPU cores)
      python benchmarks/bench_async.py --quick          (the smoke test's setting: no SFT, 3 steps, ~1 min)
      python benchmarks/bench_async.py --modes sync,fully_async --chunk 32 --seed 1 --rounds 1 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load_average, machine_info

for _key, _value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                     "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

SCRIPT = Path(__file__).resolve()
MODES = ("sync", "one_step_off", "fully_async")
# what each mode adds to the shared overrides: the same two worker processes, split differently
MODE_OVERRIDES = {
    "sync": ["trainer.n_gpus_per_node=2"],
    "one_step_off": ["trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1", "async_training.mode=one_step_off",
                     "actor_rollout_ref.rollout.calculate_log_probs=true"],
    "fully_async": ["trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1", "async_training.mode=fully_async",
                    "actor_rollout_ref.rollout.calculate_log_probs=true"],
}
WORKERS = {"sync": "2 (FSDP2, rollout colocated)", "one_step_off": "1 trainer + 1 rollout",
           "fully_async": "1 trainer + 1 rollout"}
QUICK = {"sft_steps": 0, "steps": 3, "rounds": 1, "warmup": 1, "prompts": 2, "group": 2, "max_new_tokens": 8,
         "smooth": 2, "n_train": 64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the smallest setting (smoke test): no SFT, 2 prompts x 2 samples x 8 tokens, 3 steps; "
                        "options given explicitly still win")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--preset", default="tiny", help="model preset of hyflow.models.tiny")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start steps (default 600; 0 = none)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 60)")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of samples/s (default 2)")
    p.add_argument("--prompts", type=int, default=None, help="P: prompts per step (default 16)")
    p.add_argument("--group", type=int, default=None, help="G: samples per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="T: most new tokens per sample (default 32)")
    p.add_argument("--n-train", type=int, default=None, help="training prompts of the task (default 3000)")
    p.add_argument("--lr", type=float, default=1e-4, help="RL learning rate (the quickstart's)")
    p.add_argument("--target", type=float, default=0.5, help="target of the smoothed critic/score/mean")
    p.add_argument("--smooth", type=int, default=None, help="steps in the score's moving mean (default 5)")
    p.add_argument("--chunk", type=int, default=None,
                   help="fully_async: async_training.partial_rollout_chunk (default: the trainer's, a quarter of T)")
    p.add_argument("--rounds", type=int, default=None, help="runs per mode; the order rotates each round (default 2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (OMP_NUM_THREADS of the workers and of the SFT)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: 2 GPUs, one per worker (never run: no GPU was available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the data, SFT and RL")
    p.add_argument("--workdir", default=None, help="keep the model, data, run directories and logs here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra config override for the asynchronous modes (repeatable), e.g. "
                   "algorithm.rollout_correction.bypass_mode=true")
    p.add_argument("--json", default=None, help="also write the results (every step's metrics too) here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one mode from a spec file
    args = p.parse_args(argv)
    defaults = {"sft_steps": 600, "steps": 60, "rounds": 2, "warmup": 2, "prompts": 16, "group": 8,
                "max_new_tokens": 32, "smooth": 5, "n_train": 3000}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if min(args.prompts, args.group, args.max_new_tokens, args.smooth, args.rounds, args.threads) < 1:
        p.error("--prompts, --group, --max-new-tokens, --smooth, --rounds and --threads must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------- set-up
@contextlib.contextmanager
def quiet(log_path: Path):
    """Send what the library prints (progress, banners) to `log_path`."""
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


def build_assets(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path, float]:
    """(start model, task dir, SFT seconds): the tiny model, the arithmetic task and the SFT warm start."""
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model

    init = make_tiny_model(workdir / "init_model", preset=args.preset, seed=args.seed)
    task = workdir / "data"
    make_task("arithmetic", task, n_train=args.n_train, n_test=8, seed=args.seed, digits=1, n_operands=3,
              operators="+-", answer_line_rate=0.5)
    if args.sft_steps <= 0:
        return init, task, 0.0
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.sft_trainer import SFTTrainer

    start = time.perf_counter()
    with quiet(workdir / "sft.log"):  # the quickstart's sft.yaml
        SFTTrainer(load_sft_config([
            f"model.partial_pretrain={init}", f"data.train_files={task}/train.parquet",
            "data.response_key=extra_info.answer", "data.max_length=96", "data.train_batch_size=32",
            "data.micro_batch_size_per_gpu=32", "optim.lr=3e-3", "optim.lr_scheduler=cosine",
            "optim.lr_warmup_steps_ratio=0.05", f"trainer.total_training_steps={args.sft_steps}",
            "trainer.logger=[file]", f"trainer.default_local_dir={workdir}/sft", "trainer.device=cpu",
            "model.enable_gradient_checkpointing=false", f"trainer.seed={args.seed}", "trainer.save_freq=-1",
        ])).fit()
        model = export_checkpoint(workdir / "sft" / f"global_step_{args.sft_steps}", workdir / "sft_model")
    return model, task, time.perf_counter() - start


def overrides(args: argparse.Namespace, mode: str, model: Path, task: Path, run_dir: Path) -> list[str]:
    """The shared GRPO workload (the quickstart's grpo.yaml) plus the mode's devices."""
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={task}/train.parquet",
        f"trainer.default_local_dir={run_dir}", f"trainer.device={args.device}", "trainer.executor=ray",
        f"trainer.seed={args.seed}", f"data.seed={args.seed}", "algorithm.adv_estimator=grpo",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"actor_rollout_ref.rollout.n={args.group}", "actor_rollout_ref.rollout.temperature=1.0",
        "data.max_prompt_length=64", f"data.max_response_length={args.max_new_tokens}",
        "reward_model.num_workers=0", "trainer.logger=[file]", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.total_training_steps={args.steps}",
        *MODE_OVERRIDES[mode],
        *([f"async_training.partial_rollout_chunk={args.chunk}"] if args.chunk and mode == "fully_async" else []),
        *(args.set if mode != "sync" else []),
    ]


def child(spec_path: str) -> None:
    """Run one mode (in a process of its own: its own Ray cluster, nothing left from the previous mode)."""
    from hyflow.trainer.rl_trainer import RLTrainer

    spec = json.loads(Path(spec_path).read_text())
    RLTrainer(spec["overrides"]).fit()


def run_mode(args: argparse.Namespace, mode: str, model: Path, task: Path, workdir: Path, r: int) -> dict:
    """One mode's run in a fresh process; returns its per-step metrics and its wall time."""
    run_dir = workdir / f"run-{mode}-{r}"
    spec = workdir / f"spec-{mode}-{r}.json"
    spec.write_text(json.dumps({"overrides": overrides(args, mode, model, task, run_dir)}))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    log = workdir / f"run-{mode}-{r}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(SCRIPT), "--child", str(spec)], stdout=out,
                              stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"mode {mode} failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"mode": mode, "round": r, "wall_s": wall, "steps": rows}


# ---------------------------------------------------------------------------------------------- figures
def smoothed(scores: list[float], window: int) -> list[float | None]:
    """The mean of the last `window` scores at every step (None before `window` steps)."""
    return [None if k + 1 < window else statistics.fmean(scores[k + 1 - window:k + 1]) for k in range(len(scores))]


def summarize_run(run: dict, args: argparse.Namespace) -> dict:
    steps = run["steps"]
    measured = steps[args.warmup:]
    step_s = [s["timing_s/step_total"] for s in steps]
    samples = args.prompts * args.group
    dropped = sum(s.get("async/dropped_stale", 0.0) for s in measured) * args.group
    curve = smoothed([s["critic/score/mean"] for s in steps], args.smooth)
    hit = next((k for k, v in enumerate(curve) if v is not None and v >= args.target), None)

    def mean(key: str) -> float | None:
        values = [s[key] for s in measured if key in s]
        return statistics.fmean(values) if values else None

    return {
        "mode": run["mode"], "round": run["round"], "steps": len(steps), "measured_steps": len(measured),
        "samples_per_s": (samples * len(measured) - dropped) / sum(step_s[args.warmup:]),
        "step_s_median": statistics.median(step_s[args.warmup:]),
        "steps_s_total": sum(step_s), "startup_and_exit_s": run["wall_s"] - sum(step_s),
        "gen_s_mean": mean("timing_s/gen"), "update_s_mean": mean("timing_s/update_actor"),
        "old_log_prob_s_mean": mean("timing_s/old_log_prob"),
        "trainer_wait_s_mean": mean("async/trainer_wait_s"), "rollout_busy_s_mean": mean("async/rollout_busy_s"),
        "overlap_share_mean": mean("async/overlap_share"), "weight_sync_s_mean": mean("async/weight_sync_s"),
        "staleness_mean": mean("async/staleness/mean"), "staleness_max": max(
            (s["async/staleness/max"] for s in measured if "async/staleness/max" in s), default=None),
        "score_first": steps[0]["critic/score/mean"], "score_final_smoothed": curve[-1],
        "time_to_target_s": None if hit is None else sum(step_s[:hit + 1]),
        "steps_to_target": None if hit is None else hit + 1,
    }


def median_of(rows: list[dict], key: str):
    values = [r[key] for r in rows if r[key] is not None]
    if len(values) < len(rows) or not values:  # a round that never reached the target: no median time
        return None
    return statistics.median(values)


def summarize_mode(rows: list[dict]) -> dict:
    out = {"mode": rows[0]["mode"], "rounds": len(rows)}
    for key in rows[0]:
        if key not in ("mode", "round"):
            out[key] = median_of(rows, key)
    return out


def fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def format_report(args: argparse.Namespace, info: dict, summaries: list[dict], per_run: list[dict], sft_s: float,
                  load_before, load_after) -> str:
    header = (f"{'mode':<13} {'workers':<30} {'samples/s':>9} {'vs sync':>7} {'step s':>7} {'gen/wait s':>10} "
              f"{'update s':>8} {'old lp s':>8} {'rollout busy s':>14} {'overlap':>7} {'stale mean/max':>14} "
              f"{'sync s':>6} {'time to target':>17} {'score first->last':>17} {'start-up s':>10}")
    lines = [
        f"async benchmark: preset={args.preset} SFT steps={args.sft_steps} P={args.prompts} G={args.group} "
        f"T={args.max_new_tokens} RL steps={args.steps} (first {args.warmup} not in samples/s) rounds={args.rounds} "
        f"lr={args.lr:g} target={args.target:g} (mean score of the last {args.smooth} steps) seed={args.seed}"
        + (f" fully_async chunk={args.chunk}" if args.chunk else ""),
        f"machine: {info['cpu']}, {info['cores']} CPUs, {info.get('ram_gib')} GiB RAM; python {info['python']}, "
        f"torch {info['torch']}, transformers {info['transformers']}; {args.threads} torch thread(s) per process, "
        f"device {args.device}" + (f", gpu {info['gpu']}" if "gpu" in info else ""),
        f"load average (1/5/15 min) before {load_before}, after {load_after}; SFT warm start {sft_s:.0f} s",
        "samples/s = trained samples / seconds of the measured steps (timing_s/step_total); gen/wait s: sync = the "
        "rollout + scoring, async = the trainer's wait for a batch + scoring; rollout busy s = the rollout worker's "
        "generation time per step; time to target = seconds of steps 1..k (steps to target in brackets); "
        "start-up s = the process's wall time outside its steps (Ray, workers, model load, exit)",
        header, "-" * len(header),
    ]
    sync = next((s for s in summaries if s["mode"] == "sync"), None)
    for s in summaries:
        ratio = (s["samples_per_s"] / sync["samples_per_s"]) if sync else None
        stale = "-" if s["staleness_mean"] is None else f"{s['staleness_mean']:.2f}/{s['staleness_max']:.0f}"
        target = ("-" if s["time_to_target_s"] is None
                  else f"{s['time_to_target_s']:.1f} ({s['steps_to_target']:.0f})")
        score = f"{s['score_first']:.3f}->{fmt(s['score_final_smoothed'], '.3f')}"
        lines.append(
            f"{s['mode']:<13} {WORKERS[s['mode']]:<30} {s['samples_per_s']:>9.1f} {fmt(ratio, '.2f') + 'x':>7} "
            f"{s['step_s_median']:>7.3f} {fmt(s['gen_s_mean'], '.3f'):>10} {fmt(s['update_s_mean'], '.3f'):>8} "
            f"{fmt(s['old_log_prob_s_mean'], '.3f'):>8} {fmt(s['rollout_busy_s_mean'], '.3f'):>14} "
            f"{fmt(s['overlap_share_mean'], '.2f'):>7} {stale:>14} {fmt(s['weight_sync_s_mean'], '.3f'):>6} "
            f"{target:>17} {score:>17} {s['startup_and_exit_s']:>10.1f}")
    if args.rounds > 1:
        lines.append("columns: medians over the rounds; per round (in the order run), samples/s | time to target s:")
        for s in summaries:
            rows = [r for r in per_run if r["mode"] == s["mode"]]
            lines.append(f"  {s['mode']:<13} " + ", ".join(f"{r['samples_per_s']:.1f}" for r in rows) + " | "
                         + ", ".join(fmt(r["time_to_target_s"], ".1f") for r in rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        child(args.child)
        return {}
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Writing model shards" bars between the report's lines
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs 2 visible GPUs (one per worker)")
    load_before = load_average()
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"building the model and data{' and the SFT warm start' if args.sft_steps else ''} in {workdir} ...",
              file=sys.stderr, flush=True)
        model, task, sft_s = build_assets(args, workdir)
        runs = []
        for r in range(args.rounds):
            order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
            for mode in order:
                print(f"round {r + 1}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
                runs.append(run_mode(args, mode, model, task, workdir, r))
        per_run = [summarize_run(run, args) for run in runs]
        summaries = [summarize_mode([row for row in per_run if row["mode"] == mode]) for mode in args.modes]
        info = machine_info()
        load_after = load_average()
        print(format_report(args, info, summaries, per_run, sft_s, load_before, load_after))
        report = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "machine": info,
                  "load_avg_before": load_before, "load_avg_after": load_after, "sft_s": sft_s,
                  "summaries": summaries, "runs": per_run,
                  "steps": [{"mode": run["mode"], "round": run["round"], "wall_s": run["wall_s"],
                             "metrics": run["steps"]} for run in runs]}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
