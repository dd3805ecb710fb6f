"""hyflow tool-use demo: a tiny model learns to call a calculator, first by SFT, then by GRPO with the agent loop.

    make demo-tools        (or: .venv/bin/python examples/tools/run.py [--out DIR])

1. A random 0.5M-parameter Qwen2-shaped model (OUT/init_model) and a byte-level BPE tokenizer are made locally
   (no download). The built-in `calculator` task writes 4-digit additions and subtractions ("What is 7634 - 5969?
   Use the calculator. ...") that such a model cannot do in its head. Its SFT demonstrations are multi-turn
   conversations; on purpose only half of them call the tool (`tool_use_rate=0.5`): the other half answer
   "in the head" with the right number, a habit the model can copy in form but not in substance.
2. SFT (sft.yaml) on those conversations: the model learns the call format and to answer from the tool's result,
   and answers directly about half of the time.
3. GRPO (grpo.yaml) with the agent loop (rollout.multi_turn.enable, tools.yaml): the model's calls run the
   calculator, its answer comes back as a tool turn, and only the final `#### value` is scored. A checkpoint is
   saved at the last step.
4. That checkpoint is exported as a Hugging Face model directory, OUT/model (`hyflow export` does the same).
5. The summary reports greedy accuracy on 200 held-out prompts after SFT and after RL, the share of answers that
   called the tool, and the share of calls that were well-formed (parsed, named a known tool, fit its schema).
   It ends with the transformers lines that load OUT/model and generate its first turn, a calculator call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from warm_start import sft_warm_start

HERE = Path(__file__).resolve().parent
QUESTION = "What is 7634 - 5969? Use the calculator. Put the final answer after '####'."
TRY_IT = "  try the RL-trained model with transformers (it writes its first turn; after GRPO, a calculator call):"


def metric(row: dict, suffix: str) -> float:
    return next(v for k, v in row.items() if k.endswith(suffix))


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s"


def transformers_lines(model: Path, question: str, tools: list[dict]) -> list[str]:
    """Python lines that load the exported model, apply its chat template to `question` with the tool schemas
    and decode greedily (the agent loop would run the call and append the result as a tool turn)."""
    path = json.dumps(str(model))
    return [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"tok = AutoTokenizer.from_pretrained({path}); model = AutoModelForCausalLM.from_pretrained({path})",
        f"tools = {json.dumps(tools)}",
        f"inputs = tok.apply_chat_template([{{\"role\": \"user\", \"content\": {json.dumps(question)}}}], "
        "tools=tools, add_generation_prompt=True, return_dict=True, return_tensors=\"pt\")",
        "print(tok.decode(model.generate(**inputs, max_new_tokens=128, do_sample=False)"
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
    parser.add_argument("--out", default="runs/tools", help="output folder (replaced)")
    parser.add_argument("--sft-model", default=None, help="reuse this SFT warm start (a Hugging Face directory, "
                        "e.g. OUT/sft_model of an earlier run) instead of training it")
    parser.add_argument("--sft-steps", type=int, default=None, help="override sft.yaml's total_training_steps")
    parser.add_argument("--rl-steps", type=int, default=None, help="override grpo.yaml's total_training_steps")
    parser.add_argument("--n-test", type=int, default=200, help="held-out prompts the accuracy is measured "
                        "on (default 200; fewer: a quicker, noisier summary)")
    args = parser.parse_args()
    load_before = load_average()

    import yaml
    from transformers.utils import logging as transformers_logging

    from hyflow import RLTrainer, load_config
    from hyflow.data.tasks import make_task
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.plot import plot_run

    # transformers' "Loading weights" / "Writing model shards" bars would interleave with the story; hyflow's own
    # step bar (on a terminal) and step lines stay.
    transformers_logging.disable_progress_bar()

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)

    print("== 1/5 the calculator task's data")
    make_task("calculator", out / "data", n_train=3000, n_test=args.n_test, seed=0, digits=4, tool_use_rate=0.5)

    print("\n== 2/5 SFT on tool-call conversations, half of which skip the tool (sft.yaml)")
    sft_model, sft_steps = sft_warm_start(out, args.sft_model, args.sft_steps)

    print("\n== 3/5 GRPO with the agent loop and the calculator tool (grpo.yaml, tools.yaml)")
    rl_overrides = [f"actor_rollout_ref.model.path={sft_model}", f"data.train_files={out}/data/train.parquet",
                    f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/grpo",
                    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={HERE / 'tools.yaml'}"]
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
    summary = {
        "accuracy_after_sft": metric(before, "/acc/mean@1"),
        "accuracy_after_rl": metric(after, "/acc/mean@1"),
        "tool_use_after_sft": metric(before, "val-aux/tool/samples_with_call"),
        "tool_use_after_rl": metric(after, "val-aux/tool/samples_with_call"),
        "well_formed_calls_after_sft": before.get("val-aux/tool/well_formed_share"),
        "well_formed_calls_after_rl": after.get("val-aux/tool/well_formed_share"),
        "sft_steps": sft_steps,
        "sft_model": str(sft_model),
        "rl_steps": after["step"],
        "model": str(model),
        "wall_time_s": round(time.perf_counter() - start, 1),
        **provenance(load_before),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def pct(value) -> str:
        return "  n/a" if value is None else f"{100 * value:5.1f}%"

    print()
    print(f"hyflow tool-use demo: summary (greedy decoding, {args.n_test} held-out prompts)")
    for stage, steps in (("sft", summary["sft_steps"]), ("rl", summary["rl_steps"])):
        name = f"after {'SFT' if stage == 'sft' else 'GRPO'} ({steps} steps)" if steps else "after SFT (reused)"
        print(f"  {name:24s} accuracy {pct(summary[f'accuracy_after_{stage}'])}   answers that called the tool "
              f"{pct(summary[f'tool_use_after_{stage}'])}   well-formed calls "
              f"{pct(summary[f'well_formed_calls_after_{stage}'])}")
    gain = 100 * (summary["accuracy_after_rl"] - summary["accuracy_after_sft"])
    print(f"  gain from RL: {gain:+.1f} points")
    print(f"  wall time: {minutes(summary['wall_time_s'])} (this machine, at its current load)")
    print(f"  plot: {plots[0]}   run directories: {out}/sft, {out}/grpo   summary: {out}/summary.json")
    print(f"  RL-trained model (Hugging Face format): {model}")
    print()
    print(TRY_IT)
    tools = [tool["tool_schema"] for tool in yaml.safe_load((HERE / "tools.yaml").read_text())["tools"]]
    for line in transformers_lines(model, QUESTION, tools):
        print(f"    {line}")


if __name__ == "__main__":
    main()
