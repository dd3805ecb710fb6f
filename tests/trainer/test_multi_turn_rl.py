"""Multi-turn RL end to end on CPU: the calculator task, an SFT warm start on its tool-call conversations, then
GRPO through the agent loop with the calculator tool (what `make demo-tools` runs, smaller)."""

from __future__ import annotations

import contextlib
import json

import pytest
from learning import assert_beats_frozen, assert_sft_premise, control_seeds, rise
from run_cache import cache_root
from warm_starts import CALLS_MIN, TOOL_SFT_STEPS, WORKING_MIN, tool_grpo, warm_start

from hyflow.trainer.tracking import read_metrics

# the SFT warm start is committed (tests/fixtures/tool_warm; its premise is sampled here, ~30 s); with
# HYFLOW_TEST_BUILD_WARM=1, or when it is stale, the first test builds it (one to three runs of 2,500 steps, 5-25
# minutes each on 2 free cores): past the suite's 900 s per-test limit on a slow or loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(7200)]

# The margins by which the rises (last 6 - first 6 of 30 steps) of the tool-call share and the score must beat the
# frozen control's (the same run, same seeds, actor lr 0; issue 37). The share control's rise over RL seeds 0-10 (the
# warm start of seed 0, its first attempt; AMD EPYC, avx512): +0.018 -0.061 +0.005 +0.010 +0.013 +0.005 -0.001 -0.007
# +0.017 +0.016 +0.001, SD 0.022: a margin of 0.10 is 3.2 SD of D (0.07 % false passes, 0 of 110 control pairs beat
# it). The score control's over seeds 0-11: +0.051 -0.057 +0.021 +0.000 -0.030 -0.003 +0.020 +0.042 +0.035 +0.052
# +0.012 -0.014, SD 0.033: a margin of 0.12 is 2.5 SD of D (0.55 % false passes, 0 of 132 pairs beat it).
# Measured at seed 0 (native): share D = +0.311 (rise +0.329), score D = +0.233 (rise +0.284). From the committed
# warm start (tests/fixtures/tool_warm, built on an Intel Xeon), seed 0, under ATEN_CPU_CAPABILITY avx512 / avx2 /
# default: share D = +0.415 / +0.415 / +0.421, score D = +0.307 / +0.307 / +0.311 (2026-12-03, commit 55e04dc); the
# control SDs above are the AMD-built warm start's, not re-measured for the committed one.
TOOL_SHARE_MARGIN, TOOL_SCORE_MARGIN = 0.10, 0.12
# the loss past the copying transition (over the SFT's last 50 steps): ~0.12, against ~0.22 on the plateau before it
SFT_LOSS_PREMISE = 0.17


@pytest.fixture(scope="module")
def tool_warm(tmp_path_factory):
    """(SFT model dir, data dir): the calculator task and the demo's SFT warm start (examples/tools/sft.yaml) on its
    conversations, half of which call the tool, from the tiny model of seed HYFLOW_TEST_SEED, trained until it is
    past its copying transition (tests/warm_starts.py: the committed one, or TOOL_SFT_ATTEMPTS); asserts the premise
    with its figures."""
    root = warm_start("tool_warm", cache_root(tmp_path_factory))
    premise = json.loads((root / "premise.json").read_text())
    for line in premise["tried"]:
        print(f"[premise] SFT warm start attempt: {line} (needs >= {CALLS_MIN} calls and >= {WORKING_MIN:.0%})")
    assert premise["taken"] is not None, (
        f"premise: no SFT warm start's tool calls work after {TOOL_SFT_STEPS} steps ({'; '.join(premise['tried'])}): "
        "it has not learnt to copy the numbers, and GRPO learns to call the tool only from calls that work")
    assert_sft_premise(root / f"sft_{premise['taken']}", SFT_LOSS_PREMISE)
    return root / f"sft_{premise['taken']}_model", root / "data"


def grpo(warm, run_dir, steps, *extra, **kwargs):
    """The demo's GRPO config (examples/tools/grpo.yaml) with the tool config, shortened."""
    return tool_grpo(*warm, run_dir, steps, *extra, **kwargs)


_CONTROL_ROWS: dict[tuple, list[dict]] = {}  # (warm start, RL seed) -> the frozen run's rows (both statistics)
STATISTICS = {"share": ("tool/samples_with_call", "tool-call share rise (last 6 - first 6 of 30 steps)"),
              "score": ("critic/score/mean", "score rise (last 6 - first 6 of 30 steps)")}


def check_beats_frozen(tool_warm, tmp_path_factory, share, score, which):
    """assert_beats_frozen for the tool-call share or the score: the frozen control is the same 30-step run with
    the actor's lr 0 (one run per RL seed serves both)."""

    def frozen(seed):
        if (tool_warm, seed) not in _CONTROL_ROWS:
            history = grpo(tool_warm, tmp_path_factory.mktemp("tool_frozen"), 30, "actor_rollout_ref.actor.optim.lr=0",
                           "trainer.val_before_train=false", seed=seed + 1)
            _CONTROL_ROWS[(tool_warm, seed)] = [row for row in history if "tool/samples_with_call" in row]
        return [row[STATISTICS[which][0]] for row in _CONTROL_ROWS[(tool_warm, seed)]]

    values = {"share": share, "score": score}[which]
    assert_beats_frozen("test_grpo_with_the_calculator_learns_to_call_it", STATISTICS[which][1],
                        lambda: rise(values, 6), frozen, lambda v: rise(v, 6), ("tools", str(tool_warm[0]), 30, which),
                        {"share": TOOL_SHARE_MARGIN, "score": TOOL_SCORE_MARGIN}[which])


def test_grpo_with_the_calculator_learns_to_call_it(tool_warm, tmp_path, tmp_path_factory):
    """30 GRPO steps through the agent loop raise the share of sampled answers that call the calculator and the
    score with it (first 6 steps against the last 6) by more than a frozen control's (the same run with the actor's
    lr 0) plus TOOL_SHARE_MARGIN / TOOL_SCORE_MARGIN. The premise (the warm start's calls work) is the fixture's.
    Figures below are the rises alone, measured before the control was added:
    Margins measured, seed 0 on this AMD EPYC (avx512, 1 thread, the 2,500-step warm start): tool-call share
    0.50 -> 0.84 (+0.25 over its 0.08), score 0.33 -> 0.61 (+0.24 over its 0.04); the warm start's greedy calls
    worked in 4 of 6. Under ATEN_CPU_CAPABILITY=default (session of issue 24): seed 0 (the second warm-start
    attempt, lr 6e-3: 55 % of its sampled calls working) share +0.055, score +0.049 (the same again in the session
    after); seeds 1 / 2 (the first attempt) share +0.222 / +0.342, score +0.224 / +0.328. Under avx2, seed 0: the
    first two attempts stay on the plateau (0 % of their calls work), the third passes (loss 0.10-0.12, 88 % of
    its 60 sampled calls working): share +0.332, score +0.322."""
    if control_seeds():  # a control sweep (tests/learning.py): the frozen runs only, both statistics recorded
        with contextlib.suppress(pytest.skip.Exception):
            check_beats_frozen(tool_warm, tmp_path_factory, None, None, "share")
        check_beats_frozen(tool_warm, tmp_path_factory, None, None, "score")
    history = grpo(tool_warm, tmp_path / "grpo", 30)
    first = history[1]  # history[0] is the validation before training
    # the run went through the agent loop: tool turns, their metrics, rollout/trainer agreement
    assert first["num_turns/max"] >= 4 and "tool/latency_s/mean" in first
    assert "val-aux/tool/samples_with_call" in history[0] and "val-aux/num_turns/mean" in history[0]
    assert all(abs(row["rollout_corr/kl"]) < 1e-4 for row in history[1:])  # log-probs agree on model tokens
    # no call timed out; a call the calculator refuses (a sampled expression it cannot evaluate: its error text goes
    # back to the model) counts in tool/errors: 1 of 128 samples at two steps of a clean-clone run, so not zero
    assert all(row["tool/errors/mean"] <= 0.05 and row["tool/timeouts/mean"] == 0 for row in history[1:])
    # the policy learns to call the tool: the sampled share of answers with a call rises, and the reward with it
    # (SFT leaves it at about one half: half of the demonstrations answer directly)
    rows = [row for row in history[1:] if "tool/samples_with_call" in row]
    share = [row["tool/samples_with_call"] for row in rows]
    score = [row["critic/score/mean"] for row in rows]
    print("share of samples calling the tool per step:", [round(s, 2) for s in share])
    print("mean score per step:", [round(s, 2) for s in score])
    check_beats_frozen(tool_warm, tmp_path_factory, share, score, "share")
    check_beats_frozen(tool_warm, tmp_path_factory, share, score, "score")
    assert read_metrics(tmp_path / "grpo")[-1]["step"] == 30


def test_a_verl_style_command_line_with_a_tool_config(tool_warm, tmp_path):
    """`hyflow train` with verl's keys: agent_name from the data, tools from the YAML, the multi-turn limits."""
    history = grpo(tool_warm, tmp_path / "cli", 1, "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2",
                   "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=32",
                   "actor_rollout_ref.rollout.agent.num_workers=2", "trainer.val_before_train=false")
    assert history[-1]["step"] == 1 and history[-1]["num_turns/min"] >= 2


def test_multi_turn_on_two_ray_workers_with_fsdp2(tool_warm, tmp_path):
    """The agent loop runs on each rank of the ray executor (2 CPU workers, gloo, FSDP2): each loads the tools,
    rolls out its share of the trajectories, and the step trains on them."""
    history = grpo(tool_warm, tmp_path / "ray", 2, "trainer.executor=ray", "trainer.n_gpus_per_node=2",
                   "trainer.val_before_train=false", "actor_rollout_ref.actor.strategy=fsdp2")
    last = history[-1]
    assert last["step"] == 2 and last["num_turns/max"] >= 4 and last["tool/samples_with_call"] > 0
    assert abs(last["rollout_corr/kl"]) < 1e-4
