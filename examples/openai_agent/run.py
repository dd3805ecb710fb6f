"""hyflow OpenAI-client agent demo: an agent written against the OpenAI client (agent.py) learns the calculator
task by GRPO, unchanged, through hyflow's OpenAI-compatible endpoint.

    make demo-openai        (or: .venv/bin/python examples/openai_agent/run.py [--out DIR] [--sft-model DIR])

1. The tool demo's task (examples/tools): a random 0.5M-parameter model and 4-digit additions and subtractions
   that such a model cannot do in its head; every row's agent_name is `calculator_client`, the `openai_agent`
   loop running agent.py's `run(client, sample)` (registered in OUT/loops.yaml).
2. The tool demo's SFT warm start (examples/tools/sft.yaml: the call format, half of the answers without a call),
   or `--sft-model DIR` to reuse one (e.g. runs/tools/sft_model from `make demo-tools`).
3. GRPO (grpo.yaml): each sample is one episode of the agent. Its client talks to 127.0.0.1; hyflow renders the
   requests with the chat template, the policy answers, the endpoint parses the calculator call into `tool_calls`,
   the agent runs the calculator itself and asks again. The conversation, token-in/token-out, is the sample (the
   calculator's answers masked out of the loss); the agent's return is its score (no reward function).
4. The last checkpoint, exported as a Hugging Face directory (OUT/model).
5. The summary: greedy accuracy of the agent on 200 held-out questions after SFT and after GRPO, and the share of
   episodes in which it called the calculator, from the run's metrics (OUT/summary.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
from run import load_average, minutes, provenance  # noqa: E402 (the tool demo's helpers)

sys.path.pop(0)

LOOPS = """# the agent loop every row of this demo names (rows' agent_name: calculator_client)
- name: calculator_client
  _target_: hyflow.rollout.openai_agent.OpenAIAgentLoop
  run: {agent}:run
  sample: concat
"""


def val_metric(row: dict, suffix: str) -> float | None:
    return next((v for k, v in row.items() if k.startswith("val-") and k.endswith(suffix)), None)


def retarget(parquet: Path, agent_name: str) -> None:
    """Every row of the file runs the agent loop `agent_name`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(parquet)
    column = pa.array([agent_name] * len(table), pa.string())
    pq.write_table(table.set_column(table.schema.get_field_index("agent_name"), "agent_name", column), parquet)


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/openai_agent", help="output folder (replaced)")
    parser.add_argument("--sft-model", default=None, help="reuse this SFT warm start (a Hugging Face directory)")
    parser.add_argument("--sft-steps", type=int, default=None, help="override sft.yaml's total_training_steps")
    parser.add_argument("--rl-steps", type=int, default=None, help="override grpo.yaml's total_training_steps")
    parser.add_argument("--n-test", type=int, default=200, help="held-out questions the accuracy is measured "
                        "on (default 200; fewer: a quicker, noisier summary)")
    args = parser.parse_args()
    load_before = load_average()

    from transformers.utils import logging as transformers_logging

    from hyflow import RLTrainer, load_config
    from hyflow.data.tasks import make_task
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.plot import plot_run

    transformers_logging.disable_progress_bar()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)

    print("== 1/5 the calculator task, every row run by the OpenAI-client agent (agent.py)")
    make_task("calculator", out / "data", n_train=3000, n_test=args.n_test, seed=0, digits=4, tool_use_rate=0.5)
    for split in ("train", "test"):
        retarget(out / "data" / f"{split}.parquet", "calculator_client")
    loops = out / "loops.yaml"
    loops.write_text(LOOPS.format(agent=HERE / "agent.py"))

    print("\n== 2/5 the SFT warm start: the tool demo's (examples/tools/sft.yaml)")
    sys.path.insert(0, str(HERE.parent / "tools"))
    from warm_start import sft_warm_start

    sft_model, sft_steps = sft_warm_start(out, args.sft_model, args.sft_steps)

    print("\n== 3/5 GRPO on the agent's episodes, through hyflow's OpenAI endpoint on 127.0.0.1 (grpo.yaml)")
    rl_overrides = [f"actor_rollout_ref.model.path={sft_model}", f"data.train_files={out}/data/train.parquet",
                    f"data.val_files={out}/data/test.parquet", f"trainer.default_local_dir={out}/grpo",
                    f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}"]
    if args.rl_steps:
        rl_overrides.append(f"trainer.total_training_steps={args.rl_steps}")
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
        "accuracy_after_sft": val_metric(before, "/reward/mean@1"),
        "accuracy_after_rl": val_metric(after, "/reward/mean@1"),
        "requests_per_episode_after_sft": val_metric(before, "openai/requests/mean"),
        "requests_per_episode_after_rl": val_metric(after, "openai/requests/mean"),
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

    def calls(value) -> str:  # each calculator call adds one request to the episode's first
        return "n/a" if value is None else f"{value - 1:.2f}"

    print()
    print(f"hyflow OpenAI-client agent demo: summary (greedy decoding, {args.n_test} held-out questions)")
    for stage, label in (("sft", "after SFT"), ("rl", f"after GRPO ({summary['rl_steps']} steps)")):
        print(f"  {label:24s} accuracy {pct(summary[f'accuracy_after_{stage}'])}   calculator calls per episode "
              f"{calls(summary[f'requests_per_episode_after_{stage}'])}")
    gain = 100 * (summary["accuracy_after_rl"] - summary["accuracy_after_sft"])
    print(f"  gain from RL: {gain:+.1f} points")
    print(f"  wall time: {minutes(summary['wall_time_s'])} (this machine, at its current load)")
    print(f"  plot: {plots[0]}   run directory: {out}/grpo   summary: {out}/summary.json")
    print(f"  RL-trained model (Hugging Face format): {model}")


if __name__ == "__main__":
    main()
