"""GRPO speed benchmark: hyflow's RLTrainer and TRL's GRPOTrainer on the same work, side by side in one process.

Workload (identical in both libraries as far as their options allow; remaining differences are listed in
`benchmarks/README.md` and BENCHMARKS.md):

    model     a random-weight Qwen2 from `hyflow.models.tiny` (preset `--preset`) with its local BPE tokenizer
    data      the built-in arithmetic task (verl-schema parquet), prompts in file order (no shuffle)
    one step  P prompts x G samples (temperature 1.0, top-p 1, top-k off, at most T new tokens), reward =
              `hyflow.rewards.scorers.arithmetic.compute_score`, GRPO advantages (group mean / group std),
              PPO-clip loss (eps 0.2) aggregated as a token mean over the step's P*G samples, one forward/backward
              over all P*G samples, one AdamW step (same lr, weight decay 0.01, constant schedule, grad clip 1.0)
    no KL     TRL beta=0 (no reference model); hyflow use_kl_loss=False, use_kl_in_reward=False
    off       gradient checkpointing, validation, trackers (files only), checkpoints (TRL save_strategy="no";
              hyflow's trainer always saves after its last step, which falls outside the timed steps)

Measured per library, after `--warmup` steps: the wall time of each RL step (hyflow: `RLTrainer.step`, i.e.
rollout+score -> log-probs -> advantages -> update -> weight sync; TRL: `on_step_begin` -> `on_step_end`, i.e.
generate+score -> loss -> backward -> optimizer step), its median and mean, steps/s, generated tokens/s
(response tokens incl. EOS / step time), and a stage breakdown: rollout+score, old log-prob recomputation,
actor update; on a GPU also the peak allocated GPU memory of each run. The ratio printed is hyflow steps/s
over TRL steps/s (median step times; also the ratio of the fastest steps, the least disturbed by other load
on a shared machine); with `--rounds` > 1 the two libraries alternate order each round and the statistics
pool all measured steps.

Contention (`--contended N`): N busy processes (`while True: pass`), each pinned to one of the last N cores this
process may use, run during the whole benchmark (started by the script, killed by their PIDs at its end): the case
of a shared machine, or of several workers on one node, with someone else holding a core. With it, `--threads`
(1, N, 0 = torch's default, auto = hyflow.threads' rule) and `--omp-wait-policy` (hyflow: idle OpenMP threads
sleep, OMP_WAIT_POLICY=PASSIVE, what importing hyflow sets; torch: libgomp's default, threads spin before they
sleep) say how each library's threads behave. Both libraries run in one process and so share both settings; to
give each its own defaults run them in two processes (`--skip-trl` and `--skip-hyflow`).

Run:  python benchmarks/bench_grpo.py     (defaults: tiny, P=8, G=8, T=64, 1 thread; 4 rounds x (2 + 8) steps)
      python benchmarks/bench_grpo.py --preset small --skip-trl --steps 3
      python benchmarks/bench_grpo.py --contended 1 --threads auto            (hyflow's thread rule, a core taken)
      python benchmarks/bench_grpo.py --contended 1 --threads 0 --omp-wait-policy torch --skip-hyflow  (TRL's way)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA_SOURCE = "hyflow/arithmetic"
LIBRARIES = ("hyflow", "trl")


@dataclass
class RunResult:
    """Per-step measurements of one library's run (all steps, warm-up included)."""

    library: str
    step_s: list[float] = field(default_factory=list)
    gen_tokens: list[float] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=dict)
    fit_wall_s: float = 0.0
    outside_steps_s: float = 0.0
    peak_gpu_gib: float | None = None

    def add_stage(self, name: str, seconds: float) -> None:
        self.stages.setdefault(name, []).append(seconds)


# ---------------------------------------------------------------------------------------------- set-up
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model preset of hyflow.models.tiny (tiny, small, ...)")
    p.add_argument("--prompts", type=int, default=8, help="P: prompts per RL step")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt (>= 2)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="T: most new tokens per sample")
    p.add_argument("--steps", type=int, default=8, help="measured steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per run, not measured")
    p.add_argument("--rounds", type=int, default=4, help="runs per library; the order alternates each round")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate of both optimizers")
    p.add_argument("--threads", default="1",
                   help="torch.set_num_threads for both libraries: a number, 0 = torch's choice (one per core), or "
                        "auto = hyflow.threads' rule (usable cores, one process); 1 by default, the figures of "
                        "BENCHMARKS.md before the contention section")
    p.add_argument("--omp-wait-policy", default="hyflow", choices=("hyflow", "torch"),
                   help="hyflow: import hyflow before torch, so idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE "
                        "unless set); torch: import torch first with libgomp's default (spin, then sleep)")
    p.add_argument("--contended", type=int, default=0, metavar="N",
                   help="keep N other processes busy, each pinned to one core, during the whole run")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: fp32 everywhere; cuda: each library's bf16 mixed precision (TRL bf16=True)")
    p.add_argument("--prefix-grouper", default="on", choices=("on", "off"),
                   help="hyflow's actor_rollout_ref.actor.use_prefix_grouper (each prompt's tokens run once for its G "
                        "samples in the update; same numbers). TRL has no such option: it runs every copy")
    p.add_argument("--torch-compile", default="off", choices=("on", "off"),
                   help="hyflow's actor_rollout_ref.actor.use_torch_compile (MLPs and norms compiled for the update "
                        "and log-prob passes; the compile falls in the warm-up steps, whose time is printed)")
    p.add_argument("--skip-trl", action="store_true", help="run hyflow only (no ratio)")
    p.add_argument("--skip-hyflow", action="store_true", help="run TRL only (no ratio)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights, the data and both trainers")
    p.add_argument("--workdir", default=None, help="keep the model, data and logs here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the last round's measured steps, run one more step per library under torch.profiler "
                        "(not counted in the timings) and write DIR/profile-<library>.txt: the operators by self "
                        "device time (CPU time on CPU); hyflow's stages show as hyflow/<stage> ranges")
    args = p.parse_args(argv)
    if args.group < 2:
        p.error("--group must be >= 2 (GRPO needs at least two samples per prompt)")
    for name in ("prompts", "max_new_tokens", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.threads != "auto" and not (args.threads.isdigit() or args.threads.startswith("-")):
        p.error(f"--threads must be a number or auto, got {args.threads!r}")
    if args.threads != "auto" and int(args.threads) < 0:
        p.error("--threads must be >= 0 (0 = torch's choice)")
    if args.contended < 0:
        p.error("--contended must be >= 0")
    if args.skip_trl and args.skip_hyflow:
        p.error("--skip-trl and --skip-hyflow leave nothing to run")
    return args


def start_busy_processes(n: int) -> list[tuple[int, int | None]]:
    """Start `n` processes that spin (`while True: pass`), each pinned to one of the last `n` cores this process
    may use; returns their (pid, core). The caller kills them (`stop_busy_processes`)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cores = []
    busy = []
    for i in range(n):
        core = cores[-1 - i % len(cores)] if cores else None
        proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                preexec_fn=(lambda c=core: os.sched_setaffinity(0, {c})) if core is not None else None)
        busy.append((proc, core))
    return busy


def stop_busy_processes(busy: list) -> None:
    """Kill the processes of `start_busy_processes` by their PIDs and reap them."""
    for proc, _ in busy:
        proc.kill()
    for proc, _ in busy:
        proc.wait()


def build_assets(workdir: Path, preset: str, n_prompts: int, seed: int, device: str) -> tuple[Path, Path]:
    """A random-weight model + tokenizer and an arithmetic train split of `n_prompts` rows (no downloads)."""
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model

    model_dir = make_tiny_model(workdir / f"model-{preset}", preset=preset, seed=seed,
                                device=device if device == "cuda" else None)
    task_dir = workdir / "arithmetic"
    make_task("arithmetic", task_dir, n_train=n_prompts, n_test=1, seed=seed)
    return model_dir, task_dir


def arithmetic_rows(task_dir: Path) -> list[dict]:
    """The train split as TRL rows: conversational `prompt` plus the columns the reward function reads."""
    from hyflow.data.io import read_rows

    rows = []
    for row in read_rows(task_dir / "train.parquet"):
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["prompt"]]
        rows.append({"prompt": messages, "ground_truth": str(row["reward_model"]["ground_truth"]),
                     "data_source": str(row["data_source"])})
    return rows


def trl_arithmetic_reward(prompts, completions, ground_truth, data_source=None, **kwargs) -> list[float]:
    """TRL's reward signature around hyflow's arithmetic scorer: one float per completion."""
    from hyflow.rewards.scorers.arithmetic import compute_score

    sources = data_source or [DATA_SOURCE] * len(completions)
    scores = []
    for completion, truth, source in zip(completions, ground_truth, sources, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        scores.append(float(compute_score(source, text, truth)["score"]))
    return scores


@contextlib.contextmanager
def quiet(log_path: Path):
    """Send everything the libraries print (progress, warnings, banners) to `log_path`."""
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


# ---------------------------------------------------------------------------------------------- profile
PROFILE_TOP = 40


class StepProfiler:
    """Runs one chosen step of a run under torch.profiler and writes what it saw (`--profile`)."""

    def __init__(self, out_dir: Path, library: str, device: str) -> None:
        self.out_dir, self.library, self.device = Path(out_dir), library, device
        self.summary: dict | None = None
        self._prof = None

    def start(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()

    def stop(self, step_s: float) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        averages = self._prof.key_averages()  # once: on a GPU step's trace (~10^5 events) it takes seconds
        self.summary = profile_summary(averages, self.device, step_s)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        sort = "self_device_time_total" if self.device == "cuda" else "self_cpu_time_total"
        table = averages.table(sort_by=sort, row_limit=PROFILE_TOP)
        (self.out_dir / f"profile-{self.library}.txt").write_text(
            f"{self.library}: one GRPO step ({step_s:.3f} s wall, under the profiler), operators by {sort}\n"
            + table + "\n")
        self._prof = None


def profile_summary(averages, device: str, step_s: float, top: int = 15) -> dict:
    """The profiled step as JSON: its wall time, the busiest operators by self time on the device (or CPU), and the
    `hyflow/<stage>` ranges the trainer's timers record: `cpu_s` the range's wall time on the CPU, `device_s` its
    span on the GPU's timeline (not a sum of kernel times: the GPU may idle inside it)."""
    on_device = device == "cuda"

    def self_us(e) -> float:
        return float(e.self_device_time_total if on_device else e.self_cpu_time_total)

    ops = sorted((e for e in averages if not e.key.startswith("hyflow/")), key=self_us, reverse=True)
    total = sum(self_us(e) for e in averages if not e.key.startswith("hyflow/"))
    return {
        "step_s": step_s, "time_kind": "self device time" if on_device else "self CPU time",
        "total_self_s": total / 1e6,
        "top_ops": [{"name": e.key, "calls": e.count, "self_s": self_us(e) / 1e6,
                     "share": self_us(e) / total if total else 0.0} for e in ops[:top]],
        "stages": {e.key: {"cpu_s": e.cpu_time_total / 1e6,
                           **({"device_s": e.device_time_total / 1e6} if on_device else {})}
                   for e in averages if e.key.startswith("hyflow/")},
    }


# ---------------------------------------------------------------------------------------------- hyflow
def hyflow_overrides(args: argparse.Namespace, model_dir: Path, task_dir: Path, run_dir: Path,
                     extra_steps: int = 0) -> list[str]:
    """verl-style overrides of the shared workload (see the module docstring)."""
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={task_dir}/train.parquet",
        f"trainer.default_local_dir={run_dir}", f"trainer.device={args.device}", f"trainer.seed={args.seed}",
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=True", "algorithm.use_kl_in_reward=False",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.clip_ratio=0.2",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.grad_clip=1.0",
        f"actor_rollout_ref.actor.optim.lr={args.lr}", "actor_rollout_ref.actor.optim.weight_decay=0.01",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.actor.use_prefix_grouper={args.prefix_grouper == 'on'}",
        f"actor_rollout_ref.actor.use_torch_compile={args.torch_compile == 'on'}",
        f"actor_rollout_ref.rollout.n={args.group}", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=-1",
        "data.max_prompt_length=128", f"data.max_response_length={args.max_new_tokens}", "data.shuffle=False",
        "reward_model.num_workers=0", "trainer.logger=[file]", "trainer.val_before_train=False",
        f"trainer.total_training_steps={args.warmup + args.steps + extra_steps}",
    ]


def run_hyflow(args: argparse.Namespace, model_dir: Path, task_dir: Path, run_dir: Path,
               profiler: StepProfiler | None = None) -> RunResult:
    """Train with hyflow's RLTrainer; time every `step` call from outside and keep its own stage timings. With a
    `profiler`, one more step runs after the measured ones, under the profiler and not counted."""
    from hyflow.rewards.scorers.arithmetic import compute_score
    from hyflow.trainer.rl_trainer import RLTrainer

    result = RunResult("hyflow")
    samples = args.prompts * args.group
    measured = args.warmup + args.steps

    class TimedRLTrainer(RLTrainer):
        def step(self, prompts):
            if profiler is not None and len(result.step_s) == measured:
                profiler.start()
                start = time.perf_counter()
                metrics = super().step(prompts)
                profiler.stop(time.perf_counter() - start)
                return metrics
            start = time.perf_counter()
            metrics = super().step(prompts)
            result.step_s.append(time.perf_counter() - start)
            result.gen_tokens.append(metrics["response_length/mean"] * samples)
            result.add_stage("rollout+score", metrics["timing_s/gen"])
            result.add_stage("old_log_prob", metrics.get("timing_s/old_log_prob", 0.0))
            result.add_stage("update", metrics.get("timing_s/update_actor", 0.0))
            result.add_stage("weight_sync", metrics.get("timing_s/update_weights", 0.0))
            return metrics

    start = time.perf_counter()
    with quiet(run_dir.parent / f"{run_dir.name}.log"):
        trainer = TimedRLTrainer(hyflow_overrides(args, model_dir, task_dir, run_dir, int(profiler is not None)),
                                 reward_fn=compute_score)
        trainer.fit()
    result.fit_wall_s = time.perf_counter() - start
    result.outside_steps_s = result.fit_wall_s - sum(result.step_s)
    return result


# ---------------------------------------------------------------------------------------------- TRL
def trl_config(args: argparse.Namespace, run_dir: Path, extra_steps: int = 0):
    """GRPOConfig of the shared workload: one generation batch of P*G samples = one optimizer step."""
    from trl import GRPOConfig

    samples = args.prompts * args.group
    on_gpu = args.device == "cuda"
    return GRPOConfig(
        output_dir=str(run_dir), per_device_train_batch_size=samples, gradient_accumulation_steps=1,
        generation_batch_size=samples, num_generations=args.group, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, weight_decay=0.01, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        use_cpu=not on_gpu, bf16=on_gpu, fp16=False, gradient_checkpointing=False,
        shuffle_dataset=False, seed=args.seed, data_seed=args.seed, max_steps=args.warmup + args.steps + extra_steps,
        report_to=[], logging_steps=1, save_strategy="no", eval_strategy="no", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0,
    )


def run_trl(args: argparse.Namespace, model_dir: Path, task_dir: Path, run_dir: Path,
            profiler: StepProfiler | None = None) -> RunResult:
    """Train with TRL's GRPOTrainer; time steps with a callback and the generation stages with a subclass. With a
    `profiler`, one more step runs after the measured ones, under the profiler and not counted."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    result = RunResult("trl")
    stage: dict[str, float] = {}
    measured = args.warmup + args.steps

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            stage["generate"] = stage.get("generate", 0.0) + time.perf_counter() - start
            stage["tokens"] = stage.get("tokens", 0.0) + sum(len(ids) for ids in out[1])
            return out

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            stage["rollout+score"] = stage.get("rollout+score", 0.0) + time.perf_counter() - start
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kwargs):
            stage.clear()
            if profiler is not None and len(result.step_s) == measured:
                profiler.start()
                stage["profiled"] = 1.0
            stage["start"] = time.perf_counter()

        def on_step_end(self, _args, state, control, **kwargs):
            seconds = time.perf_counter() - stage["start"]
            if "profiled" in stage:
                profiler.stop(seconds)
                return
            result.step_s.append(seconds)
            result.gen_tokens.append(stage.get("tokens", 0.0))
            result.add_stage("rollout+score", stage.get("rollout+score", 0.0))
            result.add_stage("old_log_prob", 0.0)  # skipped by TRL when generation and update are aligned
            result.add_stage("update", seconds - stage.get("rollout+score", 0.0))
            result.add_stage("weight_sync", 0.0)  # TRL generates with the module it trains

    start = time.perf_counter()
    with quiet(run_dir.parent / f"{run_dir.name}.log"):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        dataset = Dataset.from_list(arithmetic_rows(task_dir))
        trainer = TimedGRPOTrainer(model=model, reward_funcs=[trl_arithmetic_reward], args=trl_config(args, run_dir, int(profiler is not None)),
                                   train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()])
        trainer.train()
    result.fit_wall_s = time.perf_counter() - start
    result.outside_steps_s = result.fit_wall_s - sum(result.step_s)
    return result


# ---------------------------------------------------------------------------------------------- report
def summarize(results: list[RunResult], warmup: int) -> dict:
    """Pool the measured (post-warm-up) steps of all runs of one library: medians, means, throughput."""
    steps = [s for r in results for s in r.step_s[warmup:]]
    tokens = [t for r in results for t in r.gen_tokens[warmup:]]
    median = statistics.median(steps)
    summary = {
        "library": results[0].library, "measured_steps": len(steps),
        "step_s_median": median, "step_s_mean": statistics.fmean(steps),
        "step_s_min": min(steps), "step_s_max": max(steps),
        "steps_per_s": 1.0 / median,
        "gen_tokens_per_step": statistics.fmean(tokens),
        "gen_tokens_per_s": sum(tokens) / sum(steps),
        "outside_steps_s_mean": statistics.fmean(r.outside_steps_s for r in results),
        "warmup_s_mean": statistics.fmean(sum(r.step_s[:warmup]) for r in results),
    }
    if results[0].peak_gpu_gib is not None:
        summary["peak_gpu_gib"] = max(r.peak_gpu_gib for r in results)
    for name in results[0].stages:
        values = [v for r in results for v in r.stages[name][warmup:]]
        summary[f"stage_s_median/{name}"] = statistics.median(values)
    return summary


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): other processes on a shared machine."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info(load_before: list[float] | None = None) -> dict:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": _cpu_model(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_avg_before": load_before,
            "load_avg_after": load_average()}
    try:
        import trl
        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def format_report(summaries: dict[str, dict], args: argparse.Namespace, info: dict, per_round: list[float]) -> str:
    stage_names = ("rollout+score", "old_log_prob", "update", "weight_sync")
    header = (f"{'library':<8} {'steps':>5} {'median s':>9} {'mean s':>8} {'min s':>7} {'max s':>7} {'steps/s':>8} "
              f"{'gen tok/s':>10} " + " ".join(f"{n:>13}" for n in stage_names) + f" {'warm-up s':>9} {'other s':>8}")
    lines = [
        f"GRPO benchmark: preset={args.preset} P={args.prompts} G={args.group} T={args.max_new_tokens} "
        f"steps={args.steps} (+{args.warmup} warm-up) rounds={args.rounds} device={args.device} seed={args.seed} "
        f"hyflow prefix grouper {args.prefix_grouper}, torch compile {args.torch_compile}",
        f"threads: {info['threads_line']}; contended: {info['contended']}",
        f"machine: {info['cpu']}, {info['cores']} cores, torch threads {info['torch_threads']}; "
        f"python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, trl {info['trl']}"
        + (f", gpu {info['gpu']}" if "gpu" in info else ""),
        f"load average (1/5/15 min) before {info.get('load_avg_before')}, after {info.get('load_avg_after')}",
        "stage columns are medians in seconds; gen tok/s = generated tokens / step time; warm-up s = the run's "
        "unmeasured first steps (torch.compile falls here); other s = seconds of a run outside its steps "
        "(loading, data, logging, hyflow's final checkpoint)",
        header, "-" * len(header),
    ]
    for name, s in summaries.items():
        stages = " ".join(f"{s.get(f'stage_s_median/{n}', float('nan')):>13.3f}" for n in stage_names)
        lines.append(f"{name:<8} {s['measured_steps']:>5} {s['step_s_median']:>9.3f} {s['step_s_mean']:>8.3f} "
                     f"{s['step_s_min']:>7.3f} {s['step_s_max']:>7.3f} {s['steps_per_s']:>8.3f} "
                     f"{s['gen_tokens_per_s']:>10.0f} {stages} {s['warmup_s_mean']:>9.1f} "
                     f"{s['outside_steps_s_mean']:>8.1f}"
                     + (f"  peak GPU memory {s['peak_gpu_gib']:.2f} GiB" if "peak_gpu_gib" in s else ""))
    if len(summaries) == 2:
        hy, trl = summaries["hyflow"], summaries["trl"]
        lines.append(f"ratio hyflow/TRL steps per second (median step times): "
                     f"{hy['steps_per_s'] / trl['steps_per_s']:.2f}x; fastest steps: "
                     f"{trl['step_s_min'] / hy['step_s_min']:.2f}x; generated tokens/s: "
                     f"{hy['gen_tokens_per_s'] / trl['gen_tokens_per_s']:.2f}x")
        if len(per_round) > 1:
            lines.append("per-round ratio (steps/s): " + ", ".join(f"{r:.2f}x" for r in per_round))
    return "\n".join(lines)


def write_partial(path: Path, args: argparse.Namespace, results: dict[str, list[RunResult]], profiles: dict,
                  round_index: int) -> None:
    """The JSON so far ("partial": true): the finished runs' raw steps and each library's summary of them."""
    summaries = {name: summarize(runs, args.warmup) for name, runs in results.items() if runs}
    path.write_text(json.dumps({"partial": True, "args": vars(args), "rounds_started": round_index + 1,
                                "summaries": summaries, "profile": profiles,
                                "raw": {name: [vars(r) for r in runs] for name, runs in results.items()}},
                               indent=2) + "\n")


def format_profiles(profiles: dict[str, dict], out_dir: str, top: int = 8) -> str:
    """The profiled step of each library in a few lines: hyflow's stage ranges and the busiest operators."""
    lines = [f"profiled step (one extra step per library, not in the table; full tables in {out_dir}):"]
    for name, prof in profiles.items():
        lines.append(f"  {name}: {prof['step_s']:.3f} s wall, {prof['total_self_s']:.3f} s {prof['time_kind']}")
        for stage, t in sorted(prof["stages"].items(), key=lambda kv: -kv[1]["cpu_s"]):
            device = f", device {t['device_s']:.3f} s" if "device_s" in t else ""
            lines.append(f"    {stage:<28} wall {t['cpu_s']:.3f} s{device}")
        for op in prof["top_ops"][:top]:
            lines.append(f"    {op['share']:6.1%} {op['self_s']:8.4f} s  {op['calls']:>6}x  {op['name'][:60]}")
    return "\n".join(lines)


def set_threads(args: argparse.Namespace) -> str:
    """Import torch as `--omp-wait-policy` says (hyflow first: idle threads sleep), size its threads by `--threads`;
    returns what applies, as a line."""
    if args.omp_wait_policy == "torch":
        import torch  # first: libgomp loads with OMP_WAIT_POLICY as it is
    # importing hyflow sets OMP_WAIT_POLICY=PASSIVE unless it is set, if torch is not imported yet
    threads = importlib.import_module("hyflow.threads")
    import torch

    wait = threads.openmp_wait_note()
    if args.threads == "auto":  # hyflow's trainer applies the same rule again at its start
        choice = threads.choose_threads(1)
        threads.apply_threads(choice.threads)
        return choice.line(wait)
    if int(args.threads) > 0:
        torch.set_num_threads(int(args.threads))
    # hyflow's trainer keeps this count (its rule honours HYFLOW_NUM_THREADS)
    os.environ[threads.THREADS_ENV] = str(torch.get_num_threads())
    how = f"--threads {args.threads}" if int(args.threads) > 0 else "torch's default"
    return f"torch threads: {torch.get_num_threads()} ({how}; {wait})"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads_line = set_threads(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; run with --device cpu")
    libraries = ["hyflow"] if args.skip_trl else ["trl"] if args.skip_hyflow else list(LIBRARIES)
    if not args.skip_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: pip install -e '.[bench]' (or pass --skip-trl)") from None
    runners = {"hyflow": run_hyflow, "trl": run_trl}
    load_before = load_average()
    with contextlib.ExitStack() as stack:
        busy = start_busy_processes(args.contended)
        stack.callback(stop_busy_processes, busy)
        contended = (f"{len(busy)} busy process(es), pid/core " + ", ".join(f"{p.pid}/{c}" for p, c in busy)
                     if busy else "no")
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        extra_steps = int(args.profile is not None)
        model_dir, task_dir = build_assets(workdir, args.preset,
                                           args.prompts * (args.warmup + args.steps + extra_steps), args.seed,
                                           args.device)
        results: dict[str, list[RunResult]] = {name: [] for name in libraries}
        per_round: list[float] = []
        profiles: dict[str, dict] = {}
        for r in range(args.rounds):
            order = libraries if r % 2 == 0 else libraries[::-1]
            for name in order:
                print(f"round {r + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                profiler = (StepProfiler(Path(args.profile), name, args.device)
                            if args.profile is not None and r == args.rounds - 1 else None)
                run = runners[name](args, model_dir, task_dir, workdir / f"run-{name}-{r}", profiler)
                if args.device == "cuda":
                    run.peak_gpu_gib = torch.cuda.max_memory_allocated() / 2**30
                results[name].append(run)
                if profiler is not None and profiler.summary is not None:
                    profiles[name] = profiler.summary
                if args.json:  # after every run: a run cut short (a time limit) still leaves what it measured
                    write_partial(Path(args.json), args, results, profiles, r)
            if len(results) == 2:
                per_round.append(statistics.median(results["trl"][-1].step_s[args.warmup:])
                                 / statistics.median(results["hyflow"][-1].step_s[args.warmup:]))
        summaries = {name: summarize(runs, args.warmup) for name, runs in results.items()}
        info = {**machine_info(load_before), "threads_line": threads_line, "contended": contended}
        print(format_report(summaries, args, info, per_round))
        if args.profile is not None:
            print(format_profiles(profiles, args.profile))
        report = {"partial": False, "args": vars(args), "machine": info, "summaries": summaries,
                  "per_round_ratio": per_round,
                  "raw": {name: [vars(r) for r in runs] for name, runs in results.items()}}
        if args.profile is not None:
            report["profile"] = profiles
        if len(summaries) == 2:
            report["ratio_steps_per_s"] = summaries["hyflow"]["steps_per_s"] / summaries["trl"]["steps_per_s"]
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
