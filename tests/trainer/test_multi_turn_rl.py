"""Multi-turn RL end to end on CPU: the calculator task, an SFT warm start on its tool-call conversations, then
GRPO through the agent loop with the calculator tool (what `make demo-tools` runs, smaller)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from learning import SEED, assert_sft_premise, report_margin

from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

# the first test also runs the SFT warm start (one to three runs of 2,500 steps, 5-25 minutes each on 2 free
# cores): past the suite's 900 s per-test limit on a slow or loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(7200)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tools"
TOOLS_YAML = EXAMPLE / "tools.yaml"


# The SFT warm start. GRPO learns to call the tool only from calls that work, and the copying that makes them work
# (the question's numbers into the call, the tool's result into the answer) is learnt in a sudden transition whose
# step the CPU's rounding decides, chaotically: the loss plateaus at ~0.22 (nothing copied), then falls to ~0.12.
# So the warm start tries these (learning rate, data-order seed offset) runs of SFT_STEPS steps in turn, each from
# the tiny model, until one has passed the transition (its sampled calls work): a second draw is more likely to pass
# than continuing a run stuck on the plateau. Measured, seed 0 on this AMD EPYC: at 3e-3, natively (avx512) the
# transition comes at ~1,650 steps (0.12 at 2,500), but under ATEN_CPU_CAPABILITY=default the run stays on the
# plateau through 4,500 steps (0.21 -> 0.19, 0 of 57 sampled calls working); at 6e-3 that run passes by ~2,250
# steps (0.137 at 2,500), while natively 6e-3 was still on the plateau at 2,250 (0.217). Seeds 1 and 2 passed at
# 3e-3 under default.
SFT_STEPS = 2500
SFT_ATTEMPTS = ((3e-3, 0), (6e-3, 0), (3e-3, 1))
# the premise of the test: of the warm start's sampled answers (32 prompts x 4, temperature 1) at least CALLS_MIN
# call the tool and at least WORKING_MIN of those score 1 (answers without a call score ~0: 4-digit sums in its head)
CALLS_MIN, WORKING_MIN = 16, 0.5
# the loss past the transition (over the SFT's last 50 steps): ~0.12, against ~0.22 on the plateau before it
SFT_LOSS_PREMISE = 0.17


@pytest.fixture(scope="module")
def tool_warm(tiny_model_dir, tmp_path_factory):
    """(SFT model dir, data dir): the calculator task and the demo's SFT warm start (examples/tools/sft.yaml) on its
    conversations, half of which call the tool, from the tiny model of seed HYFLOW_TEST_SEED, trained until it is
    past its copying transition (see SFT_ATTEMPTS); asserts the premise with its figures."""
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.sft_trainer import SFTTrainer

    root = tmp_path_factory.mktemp("tool_warm")
    if SEED != 0:  # seed 0 is the session's tiny model
        tiny_model_dir = make_tiny_model(root / "tiny", preset="tiny", seed=SEED)
    make_task("calculator", root / "data", n_train=3000, n_test=32, seed=0, digits=4, tool_use_rate=0.5)
    tried = []
    for attempt, (lr, data_seed) in enumerate(SFT_ATTEMPTS):
        run = root / f"sft_{attempt}"
        SFTTrainer(load_sft_config([
            f"model.partial_pretrain={tiny_model_dir}", f"data.train_files={root}/data/train.parquet",
            "trainer.test_freq=-1", "trainer.logger=[file]", f"trainer.total_training_steps={SFT_STEPS}",
            f"trainer.seed={SEED + 1000 * data_seed}", f"trainer.default_local_dir={run}", f"optim.lr={lr}"],
            EXAMPLE / "sft.yaml")).fit()
        model = export_checkpoint(run / f"global_step_{SFT_STEPS}", root / f"sft_model_{attempt}")
        calls, working = sampled_calls_that_work((model, root / "data"), root / f"premise_{attempt}")
        tried.append(f"lr {lr:g}, data seed +{data_seed}: {calls} of 128 call the tool, {working:.0%} of those work")
        print(f"[premise] SFT warm start attempt {attempt + 1} ({tried[-1]}; needs >= {CALLS_MIN} and >= "
              f"{WORKING_MIN:.0%})")
        if calls >= CALLS_MIN and working >= WORKING_MIN:
            break
    assert calls >= CALLS_MIN and working >= WORKING_MIN, (
        f"premise: no SFT warm start's tool calls work after {SFT_STEPS} steps ({'; '.join(tried)}): it has not "
        "learnt to copy the numbers, and GRPO learns to call the tool only from calls that work")
    assert_sft_premise(run, SFT_LOSS_PREMISE)
    return model, root / "data"



def sampled_calls_that_work(warm, out: Path) -> tuple[int, float]:
    """Validate the model once (4 samples at temperature 1 per test prompt; every test prompt is a tool task) and
    return (the number of answers that call the tool, the share of those that score 1: the call copied the numbers
    and the answer copied the tool's result)."""
    grpo(warm, out / "run", 1, "trainer.val_only=true", f"trainer.validation_data_dir={out / 'val'}",
         "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
         "actor_rollout_ref.rollout.val_kwargs.n=4")
    rows = [json.loads(line) for line in (out / "val" / "0.jsonl").read_text().splitlines()]
    calls = [row for row in rows if "<tool_call>" in row["output"]]
    return len(calls), (sum(row["score"] == 1 for row in calls) / len(calls) if calls else 0.0)


def grpo(warm, run_dir, steps, *extra):
    """The demo's GRPO config (examples/tools/grpo.yaml) with the tool config, shortened."""
    from hyflow.config import load_config

    model, data = warm
    return RLTrainer(load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet", f"trainer.default_local_dir={run_dir}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS_YAML}", "trainer.logger=[file]",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
        "actor_rollout_ref.rollout.calculate_log_probs=true", f"trainer.seed={SEED + 1}", *extra,
    ], config_file=EXAMPLE / "grpo.yaml")).fit()


def test_grpo_with_the_calculator_learns_to_call_it(tool_warm, tmp_path):
    """30 GRPO steps through the agent loop raise the share of sampled answers that call the calculator and the
    score with it (first 6 steps against the last 6). The premise (the warm start's calls work) is the fixture's.
    Margins measured, seed 0 on this AMD EPYC (avx512, 1 thread, the 2,500-step warm start): tool-call share
    0.50 -> 0.84 (+0.25 over its 0.08), score 0.33 -> 0.61 (+0.24 over its 0.04); the warm start's greedy calls
    worked in 4 of 6. Under ATEN_CPU_CAPABILITY=default (session of issue 24): seed 0 (the second warm-start
    attempt, lr 6e-3: 55 % of its sampled calls working) share +0.055, score +0.049 (the same again in the session
    after); seeds 1 / 2 (the first attempt) share +0.222 / +0.342, score +0.224 / +0.328. Under avx2, seed 0: the
    first two attempts stay on the plateau (0 % of their calls work), the third passes (loss 0.10-0.12, 88 % of
    its 60 sampled calls working): share +0.332, score +0.322."""
    history = grpo(tool_warm, tmp_path / "grpo", 30)
    first = history[1]  # history[0] is the validation before training
    # the run went through the agent loop: tool turns, their metrics, rollout/trainer agreement
    assert first["num_turns/max"] >= 4 and "tool/latency_s/mean" in first
    assert "val-aux/tool/samples_with_call" in history[0] and "val-aux/num_turns/mean" in history[0]
    assert all(abs(row["rollout_corr/kl"]) < 1e-4 for row in history[1:])  # log-probs agree on model tokens
    assert all(row["tool/errors/mean"] == 0 and row["tool/timeouts/mean"] == 0 for row in history[1:])
    # the policy learns to call the tool: the sampled share of answers with a call rises, and the reward with it
    # (SFT leaves it at about one half: half of the demonstrations answer directly)
    rows = [row for row in history[1:] if "tool/samples_with_call" in row]
    share = [row["tool/samples_with_call"] for row in rows]
    score = [row["critic/score/mean"] for row in rows]
    print("share of samples calling the tool per step:", [round(s, 2) for s in share])
    print("mean score per step:", [round(s, 2) for s in score])
    test = "test_grpo_with_the_calculator_learns_to_call_it"
    share_rise = sum(share[-6:]) / 6 - sum(share[:6]) / 6
    score_rise = sum(score[-6:]) / 6 - sum(score[:6]) / 6
    report_margin(test, "tool-call share rise (last 6 - first 6 steps)", share_rise, 0.08)
    report_margin(test, "score rise (last 6 - first 6 steps)", score_rise, 0.04)
    assert share_rise > 0.08
    assert score_rise > 0.04
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
