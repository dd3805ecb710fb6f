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

`assert_beats_frozen` compares a rise with a control's: the same run, same seeds, with the actor's learning rate 0,
so a policy that never moves fails however its sampling noise falls. Its margin comes from the control's measured
noise: `tools/learning_margins.py --control-seeds 0-11 --tests ...` (`HYFLOW_CONTROL_SEEDS`) runs only the controls,
over RL seeds, and prints their SD and each margin's false-pass rate.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence

import pytest
import torch

from hyflow.trainer.tracking import read_metrics

SEED = int(os.environ.get("HYFLOW_TEST_SEED", "0"))
# the frozen controls' (key, RL seed) -> per-step scores, for the whole session: with lr 0 the weights never move, so a
# control depends only on the rollout's inputs, and the tests that share those share one control run
_CONTROLS: dict[tuple, list[float]] = {}

# The margin by which the score rise (last 6 - first 6 of 24 steps) of an RL run from the `warm` fixture (16 prompts
# x 8 samples) must beat its frozen control's (tests/trainer/test_rl_learns.py, test_lora_rl.py). The control's rise
# over RL seeds 0-11 (warm start of seed 0, AMD EPYC, native avx512; issue 37): -0.052 +0.026 +0.020 +0.036 +0.022
# -0.039 -0.038 +0.027 -0.007 +0.003 +0.004 +0.014, mean +0.001, SD sigma_c 0.029 (one step's score SD 0.052 within
# a run: 0.052 x sqrt(2/6) = 0.030 agrees). A learner that moves at random scores D = rise - control with SD about
# sqrt(2) x 0.029 = 0.042; 0.11 is 2.65 of those: 0.4 % false passes (normal), 0 of the 132 ordered pairs of
# control seeds beat it (the largest difference 0.088).
WARM_RISE_MARGIN = 0.11


def capability() -> str:
    """The CPU kernel set torch dispatches to here (what `ATEN_CPU_CAPABILITY` selects)."""
    return torch.backends.cpu.get_cpu_capability()


def report_margin(test: str, what: str, value: float, threshold: float) -> float:
    """Print `what` = value against its threshold and record it; returns value - threshold (the margin)."""
    margin = value - threshold
    print(f"[margin] {test}: {what} = {value:.4f}, needs > {threshold:.4f}, margin {margin:+.4f} "
          f"(seed {SEED}, {capability()})")
    _record({"test": test, "what": what, "value": value, "threshold": threshold, "margin": margin, "seed": SEED,
             "capability": capability()})
    return margin


def _record(row: dict) -> None:
    """Append `row` as one JSON line to `HYFLOW_MARGINS_FILE` when it is set."""
    path = os.environ.get("HYFLOW_MARGINS_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


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


def rise(scores: Sequence[float], k: int) -> float:
    """Mean of the last `k` values minus mean of the first `k`."""
    if len(scores) < 2 * k:
        raise ValueError(f"a rise over windows of {k} needs at least {2 * k} values, got {len(scores)}")
    return sum(scores[-k:]) / k - sum(scores[:k]) / k


def control_seeds() -> list[int]:
    """The RL seeds of a control sweep (`HYFLOW_CONTROL_SEEDS`, e.g. "0-11" or "0 3 5"); [] outside a sweep."""
    spec = os.environ.get("HYFLOW_CONTROL_SEEDS", "").strip()
    seeds = []
    for part in spec.replace(",", " ").split():
        low, _, high = part.partition("-")
        if not (low.isdigit() and (not high or high.isdigit())):
            raise ValueError(f"HYFLOW_CONTROL_SEEDS={spec!r}: give seeds and ranges of seeds, as '0-11' or '0 3 5'")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


def frozen_scores(key: tuple, frozen: Callable[[int], list[float]], seed: int) -> list[float]:
    """The control's per-step scores under RL seed `seed`: `frozen(seed)` (the learning run with the actor's lr 0),
    run once per (key, seed) in the session. `key` must name every input of the rollout.

    Under pytest-xdist with a run cache (`make test`: HYFLOW_TEST_CACHE, 2 workers) the workers of one session share
    the run through a directory of that session's own (tests/run_cache.py's lock: a worker that asks while another
    runs it waits for its scores), so two modules that share a control on two workers (test_rl_learns.py and
    test_lora_rl.py) run it once. Another pytest session (a mutation's, a later run) never sees it."""
    if (key, seed) not in _CONTROLS:
        root, session = os.environ.get("HYFLOW_TEST_CACHE"), os.environ.get("PYTEST_XDIST_TESTRUNUID")
        if root and session:
            from pathlib import Path

            from run_cache import built_once

            def build(out: Path) -> None:
                (out / "scores.json").write_text(json.dumps(list(frozen(seed))))

            out = built_once(Path(root) / f"frozen-controls-{session}", "frozen", {"key": key, "seed": seed}, build)
            _CONTROLS[(key, seed)] = json.loads((out / "scores.json").read_text())
        else:
            _CONTROLS[(key, seed)] = list(frozen(seed))
    return _CONTROLS[(key, seed)]


def assert_beats_frozen(test: str, what: str, learn: Callable[[], float], frozen: Callable[[int], list[float]],
                        statistic: Callable[[list[float]], float], key: tuple, margin: float) -> float:
    """Assert that the learning run's rise `learn()` beats its frozen control's, `statistic(frozen(seed))`, by more
    than `margin`.

    The control is the same run with the actor's learning rate 0 under the same seeds (`frozen(seed)`: its per-step
    scores, cached by `key`), so the decision statistic D = rise - control is 0 for a policy that never moves, and
    its SD for one that moves at random is about sqrt(2) x the control's SD over seeds: a margin of 2.4 x that or
    more lets under 1 % of such learners pass (D normal). In a control sweep (`HYFLOW_CONTROL_SEEDS`)
    it records the control for every seed of the sweep and skips the test (the learning run is not run). Returns D."""
    seeds = control_seeds()
    if seeds:
        for seed in seeds:
            scores = frozen_scores(key, frozen, seed)
            value = statistic(scores)
            print(f"[control] {test}: {what}, frozen policy, RL seed {seed}: {value:+.4f} ({capability()})")
            _record({"test": test, "what": what, "control": value, "rl_seed": seed, "margin_needed": margin,
                     "scores": scores, "seed": SEED, "capability": capability()})
        pytest.skip(f"control sweep over RL seeds {seeds}: the learning run is not run")
    control = statistic(frozen_scores(key, frozen, SEED))
    learned = learn()
    if not (math.isfinite(learned) and math.isfinite(control)):
        raise AssertionError(f"{test}: {what} is not finite (learning run {learned}, frozen control {control})")
    print(f"[control] {test}: {what}: learning run {learned:+.4f}, frozen control (lr 0, same seeds) {control:+.4f}")
    difference = learned - control
    report_margin(test, f"{what}: learning run - frozen control", difference, margin)
    assert difference > margin, (
        f"{test}: {what} of the learning run ({learned:+.4f}) beats the frozen control's ({control:+.4f}, the same "
        f"run with the actor's lr 0) by {difference:+.4f}, not by more than {margin}: the run did not learn more than "
        "a policy that never moves")
    return difference
