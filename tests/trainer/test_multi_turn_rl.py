"""Multi-turn RL end to end on CPU: the calculator task, an SFT warm start on its tool-call conversations, then
GRPO through the agent loop with the calculator tool (what `make demo-tools` runs, smaller)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tools"
TOOLS_YAML = EXAMPLE / "tools.yaml"


@pytest.fixture(scope="module")
def tool_warm(tiny_model_dir, tmp_path_factory):
    """(SFT model dir, data dir): the calculator task and the demo's SFT warm start (examples/tools/sft.yaml, 1,500
    steps, about 3 minutes on 2 cores) on its conversations, half of which call the tool. Shorter is not enough:
    at 1,000 steps the model copies the question's numbers into the call 5 % of the time, at 1,500 always
    (measured), and GRPO needs calls that work to learn from."""
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.data.tasks import make_task
    from hyflow.trainer.export import export_checkpoint
    from hyflow.trainer.sft_trainer import SFTTrainer

    root = tmp_path_factory.mktemp("tool_warm")
    make_task("calculator", root / "data", n_train=3000, n_test=32, seed=0, digits=4, tool_use_rate=0.5)
    SFTTrainer(load_sft_config([
        f"model.partial_pretrain={tiny_model_dir}", f"data.train_files={root}/data/train.parquet",
        "trainer.test_freq=-1", "trainer.logger=[file]",
        f"trainer.default_local_dir={root}/sft"], EXAMPLE / "sft.yaml")).fit()
    return export_checkpoint(root / "sft" / "global_step_1500", root / "sft_model"), root / "data"


def grpo(warm, run_dir, steps, *extra):
    """The demo's GRPO config (examples/tools/grpo.yaml) with the tool config, shortened."""
    from hyflow.config import load_config

    model, data = warm
    return RLTrainer(load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet", f"trainer.default_local_dir={run_dir}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS_YAML}", "trainer.logger=[file]",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
        "actor_rollout_ref.rollout.calculate_log_probs=true", *extra,
    ], config_file=EXAMPLE / "grpo.yaml")).fit()


def test_grpo_with_the_calculator_learns_to_call_it(tool_warm, tmp_path):
    history = grpo(tool_warm, tmp_path / "grpo", 30)
    first = history[1]  # history[0] is the validation before training
    # the run went through the agent loop: tool turns, their metrics, rollout/trainer agreement
    assert first["num_turns/max"] >= 4 and "tool/latency_s/mean" in first
    assert "val-aux/tool/samples_with_call" in history[0] and "val-aux/num_turns/mean" in history[0]
    assert all(abs(row["rollout_corr/kl"]) < 1e-4 for row in history[1:])  # log-probs agree on model tokens
    assert all(row["tool/errors/mean"] == 0 and row["tool/timeouts/mean"] == 0 for row in history[1:])
    # the policy learns to call the tool: the sampled share of answers with a call rises, and the reward with it
    # (SFT leaves it at about one half: half of the demonstrations answer directly)
    share = [row["tool/samples_with_call"] for row in history[1:]]
    score = [row["critic/score/mean"] for row in history[1:]]
    print("share of samples calling the tool per step:", [round(s, 2) for s in share])
    print("mean score per step:", [round(s, 2) for s in score])
    assert sum(share[-6:]) / 6 > sum(share[:6]) / 6 + 0.08
    assert sum(score[-6:]) / 6 > sum(score[:6]) / 6 + 0.04
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
