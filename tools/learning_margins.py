"""Run the learning tests over seeds and CPU capabilities and tabulate the margins they report.

    python tools/learning_margins.py --seeds 0 1 2 --capabilities default avx2 avx512 [--tests NODEID ...]

Each (seed, capability) is one pytest run with `HYFLOW_TEST_SEED` and `ATEN_CPU_CAPABILITY` set; the learning
tests append their measured margins to `HYFLOW_MARGINS_FILE` (tests/learning.py's `report_margin`). The table
printed at the end (and written as JSON lines to --out) is what the tests' docstrings and the session notes quote:
a learning test's threshold must hold with room to spare in every cell.

    python tools/learning_margins.py --control-seeds 0-11 --capabilities default avx2 [--tests NODEID ...]

measures the noise the margins are set from instead: each test that compares its rise with a frozen control (the
same run with the actor's lr 0; tests/learning.py's `assert_beats_frozen`; CONTROLLED_TESTS) runs only that control,
under each RL seed of --control-seeds (`HYFLOW_CONTROL_SEEDS`), and the table gives per test the control rise's SD
over RL seeds (sigma_c), the margin 2.4 x sqrt(2) x sigma_c, the test's margin, its false-pass rate under a normal
model (a learner that moves at random scores D = rise - control with SD sqrt(2) x sigma_c) and the empirical count
over ordered pairs of control seeds (one seed's rise taken as the learner's, another's as the control's). A
measurement, not a test: slow (one run per seed and test; tests that share a rollout share the run).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the tests that compare their rise with a frozen control (tests/learning.py's assert_beats_frozen): a control sweep
# runs these (the GRPO family, the preference algorithms and LoRA share one control per RL seed)
CONTROLLED_TESTS = [
    "tests/trainer/test_rl_learns.py::test_reward_rises",
    "tests/trainer/test_rl_learns.py::test_preference_reward_rises",
    "tests/trainer/test_lora_rl.py::test_lora_grpo_learns_the_arithmetic_task",
    "tests/trainer/test_async.py::test_one_step_off_and_fully_async_learn_like_the_synchronous_run",
    "tests/trainer/test_multi_turn_rl.py::test_grpo_with_the_calculator_learns_to_call_it",
    "tests/trainer/test_vl_learns.py::test_grpo_on_a_vision_language_model_beats_a_frozen_policy",
    "tests/trainer/test_moe_learns.py::test_grpo_on_a_moe_model_with_expert_parallelism_beats_a_frozen_policy",
]
# the tests that assert that something rises; the vLLM one runs in .venv-vllm
LEARNING_TESTS = [
    *CONTROLLED_TESTS,
    "tests/trainer/test_rl_learns.py::test_on_policy_distillation_learns_where_grpo_cannot",
]
VLLM_LEARNING_TESTS = ["tests/trainer/test_vllm_trainer.py::test_grpo_with_vllm_raises_the_reward"]


def run(python: str, tests: list[str], seed: int, capability: str, out: Path, marker: str,
        control_seeds: str = "") -> int:
    env = {**os.environ, "HYFLOW_TEST_SEED": str(seed), "HYFLOW_MARGINS_FILE": str(out)}
    extra = []
    if control_seeds:  # one test runs its control over every seed: far past the 15 min limit of one test
        env["HYFLOW_CONTROL_SEEDS"] = control_seeds
        extra = ["--timeout=86400"]  # not 0: tests/conftest.py's backstop reads 0 as unset and falls back to 900 s
    if capability != "native":
        env["ATEN_CPU_CAPABILITY"] = capability
        # torch 2.13's inductor reuses a precompiled header built for another ISA: one cache per capability
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"hyflow-inductor-{capability}")
    cmd = [python, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", *extra, *tests]
    print(f"== seed {seed}, capability {capability}: {' '.join(cmd[3:])}", flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    print(f"== seed {seed}, capability {capability}: rc {rc} in {time.perf_counter() - start:.0f} s", flush=True)
    return rc


def table(rows: list[dict]) -> str:
    """One line per (test, measured quantity): every cell's margin and the smallest."""
    cells = collections.defaultdict(list)
    for row in rows:
        cells[(row["test"], row["what"])].append(row)
    lines = []
    for (test, what), got in sorted(cells.items()):
        smallest = min(r["margin"] for r in got)
        each = ", ".join(f"s{r['seed']}/{r['capability']} {r['margin']:+.3f}" for r in got)
        lines.append(f"{test} | {what} | min margin {smallest:+.3f} | {each}")
    return "\n".join(lines)


def normal_tail(z: float) -> float:
    """P(N(0, 1) > z)."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def control_table(rows: list[dict]) -> str:
    """One line per (test, measured quantity, capability) of a control sweep, and one pooling the capabilities:
    sigma_c, the margin it calls for, the test's margin and its false-pass rates (normal model, empirical), and the
    SD of one step's score within a control run. A frozen policy's steps are independent draws (other prompts, other
    sampling seeds, the same weights), so a rise of the last k steps over the first k has SD sigma_step x sqrt(2/k):
    a check on sigma_c that every step of every seed informs."""
    cells = collections.defaultdict(dict)
    for row in rows:
        cells[(row["test"], row["what"], row["capability"])][row["rl_seed"]] = row
    groups = collections.defaultdict(list)
    for (test, what, cap), got in cells.items():
        groups[(test, what)].append((cap, got))
    lines = []
    for (test, what), caps in sorted(groups.items()):
        for cap, got in sorted(caps) + ([("pooled", None)] if len(caps) > 1 else []):
            if got is None:  # the capabilities pooled: their SDs' root mean square, pairs within each capability
                sd = math.sqrt(statistics.mean(statistics.variance([r["control"] for r in g.values()])
                                               for _, g in caps if len(g) > 1))
                values = [[r["control"] for r in g.values()] for _, g in caps]
                needed = next(iter(caps[0][1].values()))["margin_needed"]
                n = sum(len(v) for v in values)
            else:
                if len(got) < 2:
                    continue
                values = [[r["control"] for r in got.values()]]
                sd = statistics.stdev(values[0])
                needed = next(iter(got.values()))["margin_needed"]
                n = len(values[0])
            pairs = sum(len(v) * (len(v) - 1) for v in values)
            passes = sum(a - b > needed for v in values for i, a in enumerate(v) for j, b in enumerate(v) if i != j)
            z = needed / (math.sqrt(2) * sd) if sd > 0 else math.inf
            runs = [r["scores"] for _, g in caps for r in g.values()] if got is None else \
                [r["scores"] for r in got.values()]
            step_sd = math.sqrt(statistics.mean(statistics.variance(scores) for scores in runs))
            lines.append(f"{test} | {what} | {cap} | {n} seeds | control rise mean "
                         f"{statistics.mean(x for v in values for x in v):+.4f}, sigma_c {sd:.4f} | 2.4 x sqrt(2) x "
                         f"sigma_c = {2.4 * math.sqrt(2) * sd:.4f} | margin {needed:.4f} = {z:.2f} SD of D, "
                         f"false passes {100 * normal_tail(z):.2f} % (normal), {passes} of {pairs} seed pairs | "
                         f"per-step score SD {step_sd:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--capabilities", nargs="+", default=["default", "avx2", "avx512"])
    parser.add_argument("--tests", nargs="+", default=None,
                        help="pytest node ids (default: every learning test; with --control-seeds, CONTROLLED_TESTS)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="the interpreter of the vLLM venv ('' to skip the vLLM learning test)")
    parser.add_argument("--control-seeds", default="",
                        help="RL seeds ('0-11', '0 3 5'): run only the tests' frozen controls over them, print sigma_c")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning_margins.jsonl")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.unlink(missing_ok=True)
    failed = []
    for capability in args.capabilities:
        for seed in args.seeds:
            tests = args.tests or (CONTROLLED_TESTS if args.control_seeds else LEARNING_TESTS)
            if run(sys.executable, tests, seed, capability, args.out, "not vllm", args.control_seeds):
                failed.append((seed, capability, "hf"))
            vllm = args.tests is None and not args.control_seeds and args.vllm_python and \
                Path(args.vllm_python).exists()
            if vllm and run(args.vllm_python, VLLM_LEARNING_TESTS, seed, capability, args.out, "vllm"):
                failed.append((seed, capability, "vllm"))
    rows = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    print("\n" + table([row for row in rows if "margin" in row]))
    if args.control_seeds:
        print("\n" + control_table([row for row in rows if "control" in row]))
    print(f"\n{len(rows)} margins in {args.out}; failed runs: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
