"""hyflow quickstart: a tiny model learns a task on CPU, first by SFT, then by GRPO against a checker.

    make demo        (or: .venv/bin/python examples/quickstart/run.py [--out DIR])

1. A random 0.5M-parameter Qwen2-shaped model (OUT/init_model) and a byte-level BPE tokenizer are made locally
   (no download). The built-in arithmetic task writes 3,000 training and 200 held-out prompts like
   "What is 7 - 3 + 5?". Its SFT demonstrations are imperfect on purpose: half of them stop after the worked
   calculation and never write the `#### answer` line that the checker reads (`answer_line_rate=0.5`) — the kind
   of format drift a real SFT set collected from several sources has.
2. SFT (sft.yaml) teaches the arithmetic; the model ends about half its answers without the answer line.
3. GRPO (grpo.yaml) trains on the same prompts with the checker's 0/1 score as the only signal, and saves a
   checkpoint at its last step.
4. That checkpoint is exported as a Hugging Face model directory, OUT/model (`hyflow export` does the same).
5. The summary reports greedy accuracy on the 200 held-out prompts after SFT and after RL, how often the
   answer line is written, and the wall time; plots go to OUT/plots (answer_line.png: the answer-line rate and the
   accuracy at each validation; training_curves.png: every metric). It ends with the transformers lines that
   load OUT/model and generate.

What RL fixes here is mostly the format the checker demands (plus some arithmetic): the answer-line rate is
printed next to the accuracy so the gain can be read for what it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUESTION = "What is 7 - 3 + 5? Put the final answer after '####'."
TRY_IT = "  try the RL-trained model with transformers:"


def answer_line_rate(generations: Path) -> float:
    rows = [json.loads(line) for line in generations.read_text().splitlines() if line.strip()]
    return sum("####" in row["output"] for row in rows) / max(len(rows), 1)


def accuracy(row: dict) -> float:
    return next(v for k, v in row.items() if k.startswith("val-core/") and k.endswith("/acc/mean@1"))


def plot_answer_line(history: list[dict], generations: Path, path: Path) -> Path:
    """The demo's own point in one picture: at each validation of the RL run, how often the greedy answers write
    the `#### answer` line the checker reads, beside their accuracy (both in % of the held-out prompts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    validated = [row for row in history if any(k.startswith("val-core/") for k in row)]
    steps = [row["step"] for row in validated]
    rates = [100 * answer_line_rate(generations / f"val_step_{step}.jsonl") for step in steps]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(steps, rates, marker="o", label="answer line written")
    ax.plot(steps, [100 * accuracy(row) for row in validated], marker="s", label="accuracy (checker)")
    ax.set(xlabel="GRPO step (0 = the SFT model)", ylabel="% of held-out prompts, greedy", ylim=(-2, 102),
           title="What GRPO fixes: the format the checker reads")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def transformers_lines(model: Path, question: str) -> list[str]:
    """Python lines that load the exported model, apply its chat template to `question` and decode greedily."""
    path = json.dumps(str(model))
    return [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"tok = AutoTokenizer.from_pretrained({path}); model = AutoModelForCausalLM.from_pretrained({path})",
        f"inputs = tok.apply_chat_template([{{\"role\": \"user\", \"content\": {json.dumps(question)}}}], "
        "add_generation_prompt=True, return_dict=True, return_tensors=\"pt\")",
        "print(tok.decode(model.generate(**inputs, max_new_tokens=32, do_sample=False)"
        "[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))",
    ]


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def provenance(load_before: list[float] | None) -> dict:
    """The run's command, date, load and machine (benchmarks/machine.py's `run_provenance`), for
    `tools/gen_figures.py`; only the load when the example was copied out of the repository."""
    import sys

    sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
    try:
        from machine import run_provenance
    except ImportError:
        return {"load_average_before": load_before, "load_average_after": load_average()}
    finally:
        sys.path.pop(0)
    return run_provenance(load_before)


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/quickstart", help="output folder (replaced)")
    parser.add_argument("--sft-steps", type=int, default=None, help="override sft.yaml's total_training_steps")
    parser.add_argument("--rl-steps", type=int, default=None, help="override grpo.yaml's total_training_steps")
    parser.add_argument("--n-test", type=int, default=200, help="held-out prompts the accuracy is measured "
                        "on (default 200; fewer: a quicker, noisier summary)")
    args = parser.parse_args()
    load_before = load_average()

    from transformers.utils import logging as transformers_logging

    from hyflow import RLTrainer, SFTTrainer, load_config
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.plot import plot_run

    # transformers' "Loading weights" / "Writing model shards" bars would interleave with the story; hyflow's own
    # step bar (on a terminal) and step lines stay.
    transformers_logging.disable_progress_bar()

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)

    print("== 1/5 a random tiny model and the arithmetic task's data")
    init_model = make_tiny_model(out / "init_model", preset="tiny", seed=0)
    make_task("arithmetic", out / "data", n_train=3000, n_test=args.n_test, seed=0, digits=1, n_operands=3, operators="+-",
              answer_line_rate=0.5)

    print("\n== 2/5 SFT warm start on imperfect demonstrations (sft.yaml)")
    sft_overrides = [f"model.partial_pretrain={init_model}", f"data.train_files={out}/data/train.parquet",
                     f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/sft"]
    if args.sft_steps:
        sft_overrides.append(f"trainer.total_training_steps={args.sft_steps}")
    sft_history = SFTTrainer(load_sft_config(sft_overrides, HERE / "sft.yaml")).fit()
    sft_model = export_checkpoint(out / "sft" / f"global_step_{sft_history[-1]['step']}", out / "sft_model")

    print("\n== 3/5 GRPO with the checker's 0/1 score as the only reward (grpo.yaml)")
    rl_overrides = [f"actor_rollout_ref.model.path={sft_model}", f"data.train_files={out}/data/train.parquet",
                    f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/grpo"]
    if args.rl_steps:
        rl_overrides.append(f"trainer.total_training_steps={args.rl_steps}")
    # a checkpoint at the last step (and only there: save_freq = the run's length), exported in stage 4
    rl_steps = load_config(rl_overrides, config_file=HERE / "grpo.yaml").trainer.total_training_steps
    rl_overrides.append(f"trainer.save_freq={rl_steps}")
    history = RLTrainer(load_config(rl_overrides, config_file=HERE / "grpo.yaml")).fit()
    before, after = history[0], history[-1]

    print(f"\n== 4/5 export the RL-trained model (checkpoint of step {after['step']}) as a Hugging Face directory")
    model = export_checkpoint(out / "grpo" / f"global_step_{after['step']}", out / "model")
    print(f"  -> {model}")

    print("\n== 5/5 plots and summary")
    plots = plot_run(out / "grpo", out_dir=out / "plots")
    gens = out / "grpo" / "generations"
    answer_plot = plot_answer_line(history, gens, out / "plots" / "answer_line.png")
    summary = {
        "accuracy_after_sft": accuracy(before),
        "accuracy_after_rl": accuracy(after),
        "answer_line_rate_after_sft": answer_line_rate(gens / "val_step_0.jsonl"),
        "answer_line_rate_after_rl": answer_line_rate(gens / f"val_step_{after['step']}.jsonl"),
        "sft_steps": sft_history[-1]["step"],
        "rl_steps": after["step"],
        "model": str(model),
        "wall_time_s": round(time.perf_counter() - start, 1),
        **provenance(load_before),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    gain = 100 * (summary["accuracy_after_rl"] - summary["accuracy_after_sft"])
    print()
    print(f"hyflow quickstart: summary (greedy decoding, {args.n_test} held-out prompts)")
    print(f"  accuracy after SFT ({summary['sft_steps']} steps): {100 * summary['accuracy_after_sft']:5.1f}%   "
          f"answer line written: {100 * summary['answer_line_rate_after_sft']:5.1f}%")
    print(f"  accuracy after GRPO ({summary['rl_steps']} steps): {100 * summary['accuracy_after_rl']:5.1f}%   "
          f"answer line written: {100 * summary['answer_line_rate_after_rl']:5.1f}%")
    print(f"  gain from RL: {gain:+.1f} points")
    print(f"  wall time: {minutes(summary['wall_time_s'])} (this machine, at its current load)")
    print(f"  plots: {answer_plot} (answer line and accuracy), {plots[0]} (every metric)")
    print(f"  run directories: {out}/sft, {out}/grpo   summary: {out}/summary.json")
    print(f"  RL-trained model (Hugging Face format): {model}")
    print()
    print(TRY_IT)
    for line in transformers_lines(model, QUESTION):
        print(f"    {line}")


if __name__ == "__main__":
    main()
