"""Run the learning tests over seeds and CPU capabilities and tabulate the margins they report.

    python tools/learning_margins.py --seeds 0 1 2 --capabilities default avx2 avx512 [--tests NODEID ...]

Each (seed, capability) is one pytest run with `HYFLOW_TEST_SEED` and `ATEN_CPU_CAPABILITY` set; the learning
tests append their measured margins to `HYFLOW_MARGINS_FILE` (tests/learning.py's `report_margin`). The table
printed at the end (and written as JSON lines to --out) is what the tests' docstrings and the session notes quote:
a learning test's threshold must hold with room to spare in every cell.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the tests that assert that something rises; the vLLM one runs in .venv-vllm
LEARNING_TESTS = [
    "tests/trainer/test_rl_learns.py::test_reward_rises",
    "tests/trainer/test_lora_rl.py::test_lora_grpo_learns_the_arithmetic_task",
    "tests/trainer/test_async.py::test_one_step_off_and_fully_async_learn_like_the_synchronous_run",
    "tests/trainer/test_multi_turn_rl.py::test_grpo_with_the_calculator_learns_to_call_it",
]
VLLM_LEARNING_TESTS = ["tests/trainer/test_vllm_trainer.py::test_grpo_with_vllm_raises_the_reward"]


def run(python: str, tests: list[str], seed: int, capability: str, out: Path, marker: str) -> int:
    env = {**os.environ, "HYFLOW_TEST_SEED": str(seed), "HYFLOW_MARGINS_FILE": str(out)}
    if capability != "native":
        env["ATEN_CPU_CAPABILITY"] = capability
        # torch 2.13's inductor reuses a precompiled header built for another ISA: one cache per capability
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"hyflow-inductor-{capability}")
    cmd = [python, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", *tests]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--capabilities", nargs="+", default=["default", "avx2", "avx512"])
    parser.add_argument("--tests", nargs="+", default=None, help="pytest node ids (default: every learning test)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="the interpreter of the vLLM venv ('' to skip the vLLM learning test)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning_margins.jsonl")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.unlink(missing_ok=True)
    failed = []
    for capability in args.capabilities:
        for seed in args.seeds:
            tests = args.tests or LEARNING_TESTS
            if run(sys.executable, tests, seed, capability, args.out, "not vllm"):
                failed.append((seed, capability, "hf"))
            vllm = args.tests is None and args.vllm_python and Path(args.vllm_python).exists()
            if vllm and run(args.vllm_python, VLLM_LEARNING_TESTS, seed, capability, args.out, "vllm"):
                failed.append((seed, capability, "vllm"))
    rows = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    print("\n" + table(rows))
    print(f"\n{len(rows)} margins in {args.out}; failed runs: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
