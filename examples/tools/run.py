"""hyflow tool-use demo: a tiny model learns to call a calculator, first by SFT, then by GRPO with the agent loop.

    make demo-tools        (or: .venv/bin/python examples/tools/run.py [--out DIR])

1. A random 0.5M-parameter Qwen2-shaped model and a byte-level BPE tokenizer are made locally (no download).
2. The built-in `calculator` task writes 4-digit additions and subtractions ("What is 7634 - 5969? Use the
   calculator. ...") that such a model cannot do in its head. Its SFT demonstrations are multi-turn
   conversations; on purpose only half of them call the tool (`tool_use_rate=0.5`): the other half answer
   "in the head" with the right number, a habit the model can copy in form but not in substance.
3. SFT (sft.yaml) on those conversations: the model learns the call format and to answer from the tool's result,
   and answers directly about half of the time.
4. GRPO (grpo.yaml) with the agent loop (rollout.multi_turn.enable, tools.yaml): the model's calls run the
   calculator, its answer comes back as a tool turn, and only the final `#### value` is scored.
5. The summary reports greedy accuracy on 200 held-out prompts after SFT and after RL, the share of answers that
   called the tool, and the share of calls that were well-formed (parsed, named a known tool, fit its schema).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def metric(row: dict, suffix: str) -> float:
    return next(v for k, v in row.items() if k.endswith(suffix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/tools", help="output folder (replaced)")
    parser.add_argument("--sft-steps", type=int, default=None, help="override sft.yaml's total_training_steps")
    parser.add_argument("--rl-steps", type=int, default=None, help="override grpo.yaml's total_training_steps")
    args = parser.parse_args()

    from hyflow import RLTrainer, SFTTrainer, load_config
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.plot import plot_run

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()

    print("== 1/4 tiny model and calculator-task data")
    model_dir = make_tiny_model(out / "model", preset="tiny", seed=0)
    make_task("calculator", out / "data", n_train=3000, n_test=200, seed=0, digits=4, tool_use_rate=0.5)

    print("== 2/4 SFT on tool-call conversations (sft.yaml)")
    sft_overrides = [f"model.partial_pretrain={model_dir}", f"data.train_files={out}/data/train.parquet",
                     f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/sft"]
    if args.sft_steps:
        sft_overrides.append(f"trainer.total_training_steps={args.sft_steps}")
    sft_history = SFTTrainer(load_sft_config(sft_overrides, HERE / "sft.yaml")).fit()
    sft_model = export_checkpoint(out / "sft" / f"global_step_{sft_history[-1]['step']}", out / "sft_model")

    print("== 3/4 GRPO with the agent loop and the calculator tool (grpo.yaml, tools.yaml)")
    rl_overrides = [f"actor_rollout_ref.model.path={sft_model}", f"data.train_files={out}/data/train.parquet",
                    f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/grpo",
                    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={HERE / 'tools.yaml'}"]
    if args.rl_steps:
        rl_overrides.append(f"trainer.total_training_steps={args.rl_steps}")
    history = RLTrainer(load_config(rl_overrides, config_file=HERE / "grpo.yaml")).fit()

    print("== 4/4 plots")
    plots = plot_run(out / "grpo", out_dir=out / "plots")
    before, after = history[0], history[-1]
    summary = {
        "accuracy_after_sft": metric(before, "/acc/mean@1"),
        "accuracy_after_rl": metric(after, "/acc/mean@1"),
        "tool_use_after_sft": metric(before, "val-aux/tool/samples_with_call"),
        "tool_use_after_rl": metric(after, "val-aux/tool/samples_with_call"),
        "well_formed_calls_after_sft": before.get("val-aux/tool/well_formed_share"),
        "well_formed_calls_after_rl": after.get("val-aux/tool/well_formed_share"),
        "sft_steps": sft_history[-1]["step"],
        "rl_steps": after["step"],
        "wall_time_s": round(time.perf_counter() - start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def pct(value) -> str:
        return "  n/a" if value is None else f"{100 * value:5.1f}%"

    print()
    print("hyflow tool-use demo: summary (greedy decoding, 200 held-out prompts)")
    for stage, steps in (("sft", summary["sft_steps"]), ("rl", summary["rl_steps"])):
        name = f"after {'SFT' if stage == 'sft' else 'GRPO'} ({steps} steps)"
        print(f"  {name:24s} accuracy {pct(summary[f'accuracy_after_{stage}'])}   answers that called the tool "
              f"{pct(summary[f'tool_use_after_{stage}'])}   well-formed calls "
              f"{pct(summary[f'well_formed_calls_after_{stage}'])}")
    gain = 100 * (summary["accuracy_after_rl"] - summary["accuracy_after_sft"])
    print(f"  gain from RL: {gain:+.1f} points; wall time {summary['wall_time_s'] / 60:.1f} min")
    print(f"  plot: {plots[0]}   run directories: {out}/sft, {out}/grpo   summary: {out}/summary.json")


if __name__ == "__main__":
    main()
