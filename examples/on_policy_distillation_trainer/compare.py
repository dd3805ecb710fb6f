"""On-policy distillation against GRPO alone, from the same sparse-reward student, on CPU (issue 27's demo).

    .venv/bin/python examples/on_policy_distillation_trainer/compare.py [--out runs/distillation]

1. The quickstart's pieces (examples/quickstart): a random tiny model, the arithmetic task (3,000 training and 200
   held-out prompts, half the SFT demonstrations without the `#### value` line the checker reads) and its SFT warm
   start (sft.yaml, 600 steps).
2. The teacher: the warm start after GRPO (grpo.yaml, TEACHER_STEPS steps): it writes the answer line nearly always.
3. The student: the warm start after 40 more SFT steps on the same problems with no answer line at all. It still
   adds, but almost never writes the line, so almost every sample scores 0: GRPO's groups are all 0, their
   advantages are 0, and GRPO has nothing to learn from. This is the setting where a teacher's dense per-token
   signal is worth most: a student that does not yet produce what the verifier rewards.
4. From that student, STEPS steps of each (16 prompts x 8 samples per step, greedy validation on the 200 held-out
   prompts every EVAL_EVERY steps):
   - GRPO alone (lr 3e-4, the best of 1e-4 / 3e-4 / 1e-3 from an earlier SFT checkpoint);
   - on-policy distillation (`distillation.*`, lr 1e-3): the teacher scores every token of the student's own
     samples, the loss is the forward KL over the teacher's top-16 tokens, the task's reward is not used
     (use_task_rewards=false; it is only logged).
5. The summary (OUT/summary.json, `tools/gen_figures.py`'s `distillation.json`) holds each run's validation accuracy
   by step, read back from the runs' metrics.jsonl, and the teacher's and student's starting accuracy; the figure
   OUT/distillation_vs_grpo.png plots them (docs/figures/distillation_vs_grpo.png is a copy).

Where distillation does not win: from a student that already writes the line sometimes (the SFT checkpoints of
step 300 or 600 of the warm start), GRPO and distillation climb at about the same rate on this task (measured
on 128 held-out prompts, +-0.05: from SFT step 300, GRPO 0.03 -> 0.46 and forward-KL distillation 0.03 -> 0.43
greedy accuracy in 40 steps; from step 600 both reach about 0.75 in 5 steps): the gap there is mostly the answer
line, which GRPO's reward sees as well as the teacher does, and the arithmetic itself moves slowly under either.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parent / "quickstart"
ACC = "val-core/hyflow/arithmetic/acc/mean@1"


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, greedy validation accuracy) from a run's metrics.jsonl."""
    from hyflow.trainer.tracking import read_metrics

    return [(row["step"], row[ACC]) for row in read_metrics(run_dir) if ACC in row]


def score_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mean training score of the step's samples) from a run's metrics.jsonl."""
    from hyflow.trainer.tracking import read_metrics

    return [(row["step"], row["critic/score/mean"]) for row in read_metrics(run_dir) if "critic/score/mean" in row]


def plot(summary: dict, path: Path) -> Path:
    """Validation accuracy vs step of both runs, the teacher's as a line; saved as a PNG."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.add_subplot()
    for name, label, colour in (("distillation", "on-policy distillation (forward KL, top-16)", "tab:blue"),
                                ("grpo", "GRPO alone", "tab:orange")):
        steps, acc = zip(*summary["runs"][name]["val_acc"], strict=True)
        ax.plot(steps, acc, marker="o", color=colour, label=label)
    ax.axhline(summary["teacher_val_acc"], color="grey", linestyle="--",
               label=f"teacher ({summary['teacher_steps']} GRPO steps after SFT)")
    ax.set_xlabel("RL step (16 prompts x 8 samples)")
    ax.set_ylabel("greedy accuracy, 200 held-out prompts")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title("A student that never writes the answer line: distillation vs GRPO")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def provenance(load_before: list[float] | None) -> dict:
    """The run's date, load and machine with its hyflow commit (benchmarks/machine.py's `run_provenance`), for
    `tools/gen_figures.py`; only the load when the example was copied out of the repository."""
    sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
    try:
        from machine import run_provenance
    except ImportError:
        return {"load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    finally:
        sys.path.pop(0)
    return run_provenance(load_before)


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/distillation", help="output folder (replaced)")
    parser.add_argument("--steps", type=int, default=20, help="RL steps of each compared run")
    parser.add_argument("--eval-every", type=int, default=2, help="validation every this many steps")
    parser.add_argument("--teacher-steps", type=int, default=10, help="GRPO steps that make the teacher")
    parser.add_argument("--sft-steps", type=int, default=600, help="SFT warm-start steps")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the tiny model, the SFT and the RL runs")
    parser.add_argument("--figure", default=None, help="also copy the figure here (docs/figures/...)")
    args = parser.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]

    from transformers.utils import logging as transformers_logging

    from hyflow import RLTrainer, SFTTrainer, load_config
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model
    from hyflow.trainer.export import export_checkpoint

    transformers_logging.disable_progress_bar()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    task = dict(digits=1, n_operands=3, operators="+-")

    print("== 1/4 the quickstart's tiny model, task and SFT warm start")
    init_model = make_tiny_model(out / "init_model", preset="tiny", seed=args.seed)
    make_task("arithmetic", out / "data", n_train=3000, n_test=200, seed=0, answer_line_rate=0.5, **task)
    SFTTrainer(load_sft_config([
        f"model.partial_pretrain={init_model}", f"data.train_files={out}/data/train.parquet",
        f"trainer.default_local_dir={out}/sft", f"trainer.total_training_steps={args.sft_steps}", "trainer.test_freq=-1",
        f"trainer.seed={args.seed}", "trainer.logger=[file]"], QUICKSTART / "sft.yaml")).fit()
    warm = export_checkpoint(out / "sft" / f"global_step_{args.sft_steps}", out / "sft_model")

    def rl(model: Path, name: str, steps: int, *extra: str) -> list[dict]:
        return RLTrainer(load_config([
            f"actor_rollout_ref.model.path={model}", f"data.train_files={out}/data/train.parquet",
            f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/{name}",
            f"trainer.total_training_steps={steps}", f"trainer.test_freq={args.eval_every}", "trainer.logger=[file]",
            f"trainer.seed={args.seed}", *extra], config_file=QUICKSTART / "grpo.yaml")).fit()

    print(f"\n== 2/4 the teacher: the warm start after {args.teacher_steps} GRPO steps (quickstart's grpo.yaml)")
    rl(warm, "teacher_grpo", args.teacher_steps, f"trainer.save_freq={args.teacher_steps}")
    teacher = export_checkpoint(out / "teacher_grpo" / f"global_step_{args.teacher_steps}", out / "teacher")

    print("\n== 3/4 the student: the warm start after 40 SFT steps on demonstrations without the answer line")
    make_task("arithmetic", out / "data_no_line", n_train=3000, n_test=200, seed=0, answer_line_rate=0.0, **task)
    SFTTrainer(load_sft_config([
        f"model.partial_pretrain={warm}", f"data.train_files={out}/data_no_line/train.parquet",
        f"trainer.default_local_dir={out}/student_sft", "trainer.total_training_steps=40", "optim.lr=1e-3",
        "trainer.test_freq=-1", f"trainer.seed={args.seed}", "trainer.logger=[file]"], QUICKSTART / "sft.yaml")).fit()
    student = export_checkpoint(out / "student_sft" / "global_step_40", out / "student")

    print(f"\n== 4/4 from the student, {args.steps} steps of GRPO alone, then of on-policy distillation")
    rl(student, "grpo", args.steps, "actor_rollout_ref.actor.optim.lr=3e-4")
    rl(student, "distillation", args.steps, "actor_rollout_ref.actor.optim.lr=1e-3", "distillation.enabled=true",
       f"distillation.teacher_models.teacher_model.model_path={teacher}",
       "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=16",
       "distillation.distillation_loss.use_task_rewards=false")

    teacher_curve = val_curve(out / "teacher_grpo")
    summary = {
        "teacher_val_acc": teacher_curve[-1][1],
        "warm_start_val_acc": teacher_curve[0][1],
        "teacher_steps": args.teacher_steps,
        "sft_steps": args.sft_steps,
        "steps": args.steps,
        "seed": args.seed,
        "runs": {name: {"val_acc": val_curve(out / name), "train_score": score_curve(out / name)}
                 for name in ("grpo", "distillation")},
        "wall_time_s": round(time.perf_counter() - start, 1),
        **provenance(load_before),
        "command": "python " + " ".join([str(Path(sys.argv[0])), *(argv if argv is not None else sys.argv[1:])]),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    figure = plot(summary, out / "distillation_vs_grpo.png")
    if args.figure:
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(figure, args.figure)

    print("\non-policy distillation vs GRPO (greedy accuracy on 200 held-out prompts, from the runs' metrics.jsonl)")
    print(f"  SFT warm start {summary['warm_start_val_acc']:.3f}; teacher (after {args.teacher_steps} GRPO steps) "
          f"{summary['teacher_val_acc']:.3f}")
    print("  step   GRPO   distillation")
    grpo, dist = dict(summary["runs"]["grpo"]["val_acc"]), dict(summary["runs"]["distillation"]["val_acc"])
    for step in sorted(grpo):
        print(f"  {step:4d}  {grpo[step]:.3f}  {dist.get(step, float('nan')):.3f}")
    print(f"  figure: {figure}   summary: {out}/summary.json   wall time {summary['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
