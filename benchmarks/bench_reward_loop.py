"""The reward loop (`reward_model.use_reward_loop`) against the batch path: RL step time with a slow scorer.

Measured, side by side in one process on one trainer: a full RL step (`RLTrainer.step`: generate, score, old
log-probs, values, advantages, updates) two ways, the order alternating every round:

    batch   generate the whole rollout, then score every sample (the reward manager's process pool)
    loop    each trajectory scored the moment it finishes, on the driver, while the others still generate
            (`hyflow.rewards.reward_loop`); the scores are the same

Workload: the arithmetic task, a random-weight tiny model (`hyflow.models.tiny`), the hf engine, `--prompts` x `--n`
samples of up to `--response-length` tokens, and a scorer that sleeps `--sleep-ms` per sample (a slow verifier: a
sandbox, a math checker, an API) in `--num-workers` processes (0: in the driver). Trajectories must finish at
different times for scoring to overlap generation: `--batching continuous` with `--max-num-seqs` sequences decoded
at once (the hf engine's token stream resolves each request the step it finishes; with the default barrier batching
a single-turn rollout comes back from one engine call, all at once). Each way runs one untimed warm-up step, then
`--rounds` timed steps; reported: median step seconds, median generate+score seconds (`timing_s/gen`), scoring
seconds (`timing_s/reward`), the loop's `reward/overlap_share`, and the ratio batch / loop of the step time.

Run:  python benchmarks/bench_reward_loop.py                              (8 prompts x 4, 50 ms a sample)
      python benchmarks/bench_reward_loop.py --sleep-ms 100 --rounds 5 --json benchmarks/results/reward_loop.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load_average, machine_info

WAYS = ("batch", "loop")


class SlowScorer:
    """The arithmetic checker's score after `sleep_s` seconds (a slow verifier)."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        time.sleep(self.sleep_s)
        return float(str(ground_truth) in solution_str)


def build_trainer(root: Path, args):
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model
    from hyflow.trainer.rl_trainer import RLTrainer

    model = make_tiny_model(root / "model", preset=args.preset, seed=0)
    make_task("arithmetic", root / "data", n_train=max(64, args.prompts * 4), n_test=4, seed=0, digits=1)
    trainer = RLTrainer([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={root}/data/train.parquet",
        f"trainer.default_local_dir={root}/run", f"actor_rollout_ref.rollout.n={args.n}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "data.max_prompt_length=48", f"data.max_response_length={args.response_length}",
        f"reward_model.num_workers={args.num_workers}", "trainer.logger=[file]", "trainer.device=cpu",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"actor_rollout_ref.rollout.agent.batching={args.batching}",
        f"actor_rollout_ref.rollout.max_num_seqs={args.max_num_seqs}", "algorithm.adv_estimator=grpo",
    ], reward_fn=SlowScorer(args.sleep_ms / 1000))
    trainer.setup()
    return trainer


def one_step(trainer, way: str) -> dict:
    trainer.use_reward_loop = way == "loop"
    trainer.global_step += 1
    start = time.perf_counter()
    metrics = trainer.step(trainer.loader.next_batch())
    return {"step_s": time.perf_counter() - start, "gen_s": metrics["timing_s/gen"],
            "reward_s": metrics["timing_s/reward"], "overlap_share": metrics.get("reward/overlap_share", 0.0)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="the scorer's seconds per sample, in ms")
    parser.add_argument("--num-workers", type=int, default=0, help="reward_model.num_workers (0: in the driver)")
    parser.add_argument("--batching", default="continuous", choices=("barrier", "eager", "continuous"))
    parser.add_argument("--max-num-seqs", type=int, default=4, help="sequences the engine decodes at once")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    info = machine_info()
    info["load_average_before"] = load_average()  # other processes on the cores move the seconds
    with tempfile.TemporaryDirectory(prefix="bench_reward_loop_") as tmp:
        trainer = build_trainer(Path(tmp), args)
        try:
            for way in WAYS:  # warm-up: first calls, forks, caches
                one_step(trainer, way)
            runs: dict[str, list[dict]] = {way: [] for way in WAYS}
            for round_ in range(args.rounds):
                for way in (WAYS if round_ % 2 == 0 else WAYS[::-1]):
                    runs[way].append(one_step(trainer, way))
        finally:
            trainer.shutdown()
    info["load_average_after"] = load_average()
    row = {"workload": {k: getattr(args, k) for k in ("prompts", "n", "response_length", "sleep_ms", "num_workers",
                                                       "batching", "max_num_seqs", "preset", "rounds")}}
    for way in WAYS:
        row[way] = {key: statistics.median(r[key] for r in runs[way]) for key in runs[way][0]}
        row[way]["rounds"] = runs[way]
    row["ratio_batch_vs_loop_step"] = row["batch"]["step_s"] / row["loop"]["step_s"]
    row["ratio_batch_vs_loop_gen_and_score"] = row["batch"]["gen_s"] / row["loop"]["gen_s"]
    samples = args.prompts * args.n
    print(f"reward loop vs batch path: {samples} samples/step, scorer {args.sleep_ms:g} ms/sample "
          f"({args.num_workers} scoring processes), batching={args.batching}, max_num_seqs={args.max_num_seqs}, "
          f"{args.rounds} rounds (median), {info.get('cpu', '?')}, load average {info['load_average_before']} -> "
          f"{info['load_average_after']}")
    print(f"{'way':<6} {'step s':>8} {'gen+score s':>12} {'reward s':>9} {'overlap':>8}")
    for way in WAYS:
        r = row[way]
        print(f"{way:<6} {r['step_s']:>8.3f} {r['gen_s']:>12.3f} {r['reward_s']:>9.3f} {r['overlap_share']:>8.2f}")
    print(f"batch / loop step time: {row['ratio_batch_vs_loop_step']:.2f}x; generate+score: "
          f"{row['ratio_batch_vs_loop_gen_and_score']:.2f}x")
    result = {"machine": info, "results": [row]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return row


if __name__ == "__main__":
    main()
