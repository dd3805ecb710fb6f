"""Multi-turn rollout throughput: the agent loop's batched decoding against one trajectory at a time.

Measured: trajectories per second and generated (model) tokens per second of one multi-turn rollout of P prompts
x n samples with hyflow's agent loop on the `hf` engine, two ways, same model, prompts, seeds and turns:

    batched      `AgentLoopManager.generate(all prompts)`: every trajectory is a task of one event loop and the
                 engine decodes all waiting turns in one call (what the trainer does)
    one-by-one   the same manager called once per prompt with n = 1 for each sample: each trajectory's turns are
                 decoded alone (what a per-sample tool loop without a request queue does)

Workload: every trajectory has `--turns` model turns: after each model turn a scripted interaction (verl's
BaseInteraction methods) answers as the user, "Say it again, shorter.", until the last turn. Turns end at EOS or
at one of a set of stop ids (every 5th token id: a few tokens on a random model, of varying length as real turns
are); the response budget is `--turns` x `--turn-tokens` plus room for the user turns. Random-weight models from `hyflow.models.tiny` (`--presets`). Each way runs one untimed
warm-up and then `--rounds` timed rounds (alternating order); reported: median seconds, trajectories/s, model
tokens/s and the ratio batched / one-by-one of the medians, plus the engine calls and mean batch size of the
batched way. The samples of the two ways differ (batched rows draw from one generator), the workload does not.

Run:  python benchmarks/bench_agent_loop.py                         (tiny; 16 prompts x 4 samples x 3 turns)
      python benchmarks/bench_agent_loop.py --presets tiny,small --prompts 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info


class AskAgain:
    """An interaction that asks for the answer again until the trajectory has `turns` model turns."""

    name = "again"

    def __init__(self, turns: int) -> None:
        self.turns = turns

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        done = sum(m["role"] == "assistant" for m in messages) >= self.turns
        return done, "Say it again, shorter.", 0.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        return None


def build(preset: str, workdir: Path, turns: int, turn_tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyflow.config import load_config
    from hyflow.models.tiny import make_tiny_model
    from hyflow.rollout.agent_loop import AgentLoopManager
    from hyflow.rollout.hf import HFRolloutEngine

    model_dir = make_tiny_model(workdir / preset, preset=preset, seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    budget = turns * turn_tokens + (turns - 1) * 24  # model turns + the user turns between them
    rollout = load_config(["actor_rollout_ref.model.path=x", f"data.max_response_length={budget}",
                           "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={turns}"]
                          ).actor_rollout_ref.rollout
    loops = AgentLoopManager(engine, tok, rollout, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                             interactions={"again": AskAgain(turns)})
    return tok, loops, budget


def prompts_batch(tok, count: int):
    from hyflow.data.rl_dataset import collate_prompts
    from hyflow.data.tasks import get_task

    rows = get_task("arithmetic").generate(n_train=count, n_test=0, seed=0, digits=2)["train"]
    items = []
    for i, row in enumerate(rows):
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        items.append({"raw_prompt_ids": tok(text, add_special_tokens=False)["input_ids"], "raw_prompt": row["prompt"],
                      "uid": f"p{i}", "agent_name": "tool_agent", "interaction_kwargs": {"name": "again"}})
    return collate_prompts(items, tok.pad_token_id)


def run_way(way: str, loops, prompts, params) -> tuple[float, int, int, dict]:
    import dataclasses

    start = time.perf_counter()
    if way == "batched":
        outs = [loops.generate(prompts, params)]
        stats = {"engine_calls": loops.last_server.calls,
                 "mean_batch": statistics.mean(loops.last_server.batch_sizes)}
    else:
        outs, stats = [], {}
        for i in range(len(prompts)):
            for j in range(params.n):
                one = dataclasses.replace(params, n=1, seed=params.seed + i * params.n + j)
                outs.append(loops.generate(prompts[i : i + 1], one))
    seconds = time.perf_counter() - start
    trajectories = sum(len(o) for o in outs)
    tokens = sum(int(o["response_mask"].sum()) for o in outs)
    return seconds, trajectories, tokens, stats


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)

    from hyflow.rollout.base import SamplingParams

    info = machine_info()
    print(f"machine: {info}")
    print(f"torch threads: {torch.get_num_threads()}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            tok, loops, budget = build(preset, Path(tmp), args.turns, args.turn_tokens)
            prompts = prompts_batch(tok, args.prompts)
            params = SamplingParams(n=args.n, max_new_tokens=budget, seed=0, calculate_log_probs=True,
                                    stop_token_ids=tuple(range(3, len(tok), 5)))
            ways = ["batched", "one-by-one"]
            for way in ways:  # warm-up
                run_way(way, loops, prompts, params)
            timings: dict[str, list[tuple[float, int, int]]] = {way: [] for way in ways}
            stats = {}
            for r in range(args.rounds):
                for way in (ways if r % 2 == 0 else ways[::-1]):
                    seconds, trajectories, tokens, extra = run_way(way, loops, prompts, params)
                    timings[way].append((seconds, trajectories, tokens))
                    stats.update(extra)
            row = {"preset": preset, "prompts": args.prompts, "n": args.n, "turns": args.turns,
                   "turn_tokens": args.turn_tokens, **stats}
            for way in ways:
                seconds = statistics.median(t[0] for t in timings[way])
                row[way] = {"median_s": round(seconds, 3),
                            "trajectories_per_s": round(statistics.median(t[1] / t[0] for t in timings[way]), 2),
                            "model_tokens_per_s": round(statistics.median(t[2] / t[0] for t in timings[way]), 1)}
            row["ratio_batched_vs_one_by_one"] = round(
                row["batched"]["model_tokens_per_s"] / row["one-by-one"]["model_tokens_per_s"], 2)
            results.append(row)
            print(f"{preset}: batched {row['batched']['trajectories_per_s']} trajectories/s "
                  f"({row['batched']['model_tokens_per_s']} model tokens/s, {row.get('engine_calls')} engine calls, "
                  f"mean batch {row.get('mean_batch', 0):.1f}); one-by-one {row['one-by-one']['trajectories_per_s']} "
                  f"trajectories/s ({row['one-by-one']['model_tokens_per_s']} tokens/s); "
                  f"ratio {row['ratio_batched_vs_one_by_one']}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "results": results}, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
