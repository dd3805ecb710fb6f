"""What the learning tests share: the seed they run under and the margins they report.

A learning test asserts that something rises (a score, an accuracy, a tool-call rate) by more than a threshold.
Whether it does is decided by rounding as much as by the algorithm when the margin is thin: another CPU (or
`ATEN_CPU_CAPABILITY=default|avx2|avx512` on this one) rounds differently, and a warm start that sits on its
learning transition lands on either side of it. So every learning test

- runs under `HYFLOW_TEST_SEED` (default 0): the seed of its tiny model, its SFT warm start and its RL run, so a
  sweep over seeds needs no edit (`make learning-margins` runs the sweep over seeds and capabilities);
- asserts its premise first (the warm start is past its transition), so a failure names its cause;
- reports its measured margin with `report_margin`: printed, and appended as one JSON line to
  `HYFLOW_MARGINS_FILE` when set, which `tools/learning_margins.py` tabulates.
"""

from __future__ import annotations

import json
import os

import torch

from hyflow.trainer.tracking import read_metrics

SEED = int(os.environ.get("HYFLOW_TEST_SEED", "0"))


def capability() -> str:
    """The CPU kernel set torch dispatches to here (what `ATEN_CPU_CAPABILITY` selects)."""
    return torch.backends.cpu.get_cpu_capability()


def report_margin(test: str, what: str, value: float, threshold: float) -> float:
    """Print `what` = value against its threshold and record it; returns value - threshold (the margin)."""
    margin = value - threshold
    print(f"[margin] {test}: {what} = {value:.4f}, needs > {threshold:.4f}, margin {margin:+.4f} "
          f"(seed {SEED}, {capability()})")
    path = os.environ.get("HYFLOW_MARGINS_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": test, "what": what, "value": value, "threshold": threshold,
                                "margin": margin, "seed": SEED, "capability": capability()}) + "\n")
    return margin


def assert_sft_premise(run_dir, below: float, last: int = 50) -> float:
    """The premise of a learning test that starts from an SFT warm start: the mean training loss of its last `last`
    steps is below `below` (past the learning transition), so that the test's outcome is decided by the RL run,
    not by which side of the transition the rounding of this CPU put the warm start on."""
    losses = [row["train/loss"] for row in read_metrics(run_dir) if "train/loss" in row][-last:]
    loss = sum(losses) / len(losses)
    print(f"[premise] SFT warm start {run_dir}: mean train loss of the last {len(losses)} steps {loss:.4f} "
          f"(must be < {below})")
    assert loss < below, (f"the SFT warm start did not pass its learning transition (mean loss {loss:.4f} over the "
                          f"last {len(losses)} steps, premise < {below}): the RL test after it would measure the "
                          "rounding of this CPU, not the algorithm")
    return loss
