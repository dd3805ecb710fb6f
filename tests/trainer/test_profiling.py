"""verl's profiler keys drive torch.profiler (`hyflow.trainer.profiling`): the steps, roles, ranks and contents asked
for give Chrome traces that open and hold the step's stages; what is not done is named at start."""

from __future__ import annotations

import gzip
import json

import pytest

from hyflow.config import load_config
from hyflow.trainer.profiling import profile_plan
from hyflow.trainer.rl_trainer import RLTrainer

ARR = "actor_rollout_ref"
TORCH = ["global_profiler.tool=torch", f"{ARR}.actor.profiler.enable=true"]


def digit_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def overrides(model_dir, task_dir, run_dir, *extra):
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={task_dir}/train.parquet",
            f"trainer.default_local_dir={run_dir}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48",
            "data.max_response_length=6", "reward_model.num_workers=0", "trainer.logger=[file]",
            "trainer.total_training_steps=3", *extra]


def trace_names(path) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {event.get("name") for event in json.load(f)["traceEvents"]}


def test_the_plan_reads_verls_keys_and_its_start_line_says_what_runs():
    assert profile_plan(load_config([])).start_line() is None and not profile_plan(load_config([])).active
    plan = profile_plan(load_config([*TORCH, "global_profiler.steps=[2,1]", "global_profiler.save_path=/tmp/p",
                                     f"{ARR}.actor.profiler.ranks=[1]", "critic.profiler.enable=true",
                                     "critic.profiler.all_ranks=true",
                                     f"{ARR}.actor.profiler.tool_config.torch.contents=[cpu,shapes]"]))
    assert plan.active and plan.steps == (1, 2) and plan.profiled(2) and not plan.profiled(3)
    actor = plan.group_spec(("actor",), 2)
    assert actor == {"ranks": [1], "save_path": "/tmp/p", "step": 2, "contents": ["cpu", "shapes"], "prefix": "actor"}
    assert plan.group_spec(("critic",), 1)["ranks"] is None  # all_ranks
    assert plan.group_spec(("reward_model",), 1) is None
    assert plan.group_spec(("rollout",), 1) is None  # the rollout's own profiler is not enabled
    line = plan.start_line()
    assert line.startswith("Profiler: torch.profiler on steps [1, 2] for actor_rollout_ref.actor (ranks [1]), "
                           "critic (ranks all)") and "/tmp/p" in line

    rank0 = profile_plan(load_config([*TORCH, "global_profiler.steps=[1]"])).group_spec(("actor", "rollout"), 1)
    assert rank0["ranks"] == [0] and rank0["prefix"] == "actor-rollout"  # neither ranks nor all_ranks: rank 0


@pytest.mark.parametrize(("extra", "why"), [
    ([f"{ARR}.actor.profiler.enable=true", "global_profiler.tool=torch"], "global_profiler.steps is empty"),
    (["global_profiler.steps=[1]", "global_profiler.tool=torch"], "no role has profiler.enable=true"),
    (["global_profiler.steps=[1]", f"{ARR}.actor.profiler.enable=true", "global_profiler.tool=nsys"],
     "not run by hyflow: actor_rollout_ref.actor.profiler.tool=nsys"),
])
def test_a_profiler_setting_that_profiles_nothing_says_why(extra, why):
    plan = profile_plan(load_config(extra))
    assert not plan.active
    assert plan.start_line().startswith("Profiler: nothing is profiled") and why in plan.start_line()


def test_asked_for_but_not_done_is_named_on_the_performance_only_line():
    from hyflow.config.support import performance_only_warning

    line = performance_only_warning(load_config([*TORCH, "global_profiler.steps=[1]",
                                                 f"{ARR}.actor.profiler.tool_config.torch.discrete=true",
                                                 "global_profiler.finish_hook_cmd=ls"]))
    assert "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true" in line
    assert "global_profiler.finish_hook_cmd=ls" in line and "does not do this" in line
    assert "global_profiler.steps" not in line  # acted on: not performance-only


@pytest.mark.parametrize(("override", "message"), [
    (f"{ARR}.actor.profiler.tool_config.torch.contents=[gpu]", "contents has ['gpu']: verl's torch profiler records"),
    ("global_profiler.tool=perf", "global_profiler.tool='perf' is not one of verl's profilers"),
    ("critic.profiler.tool=nvprof", "critic.profiler.tool='nvprof' is not one of verl's profilers"),
    ("global_profiler.steps=[0,2]", "global_profiler.steps=[0, 2]: steps count from 1"),
])
def test_names_verl_does_not_have_are_refused_by_name(override, message):
    from hyflow.config import ConfigError, validate_config

    with pytest.raises(ConfigError) as info:
        validate_config(load_config([*TORCH, override]))
    assert message in str(info.value)


@pytest.mark.slow
def test_profiled_steps_write_traces_that_hold_the_steps_stages(tiny_model_dir, task_dir, tmp_path, capsys):
    traces = tmp_path / "traces"
    RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "run", *TORCH, "global_profiler.steps=[1,3]",
                        f"global_profiler.save_path={traces}"), reward_fn=digit_reward).fit()
    out = capsys.readouterr().out
    assert "Profiler: torch.profiler on steps [1, 3] for actor_rollout_ref.actor (ranks [0]); " in out
    files = sorted(traces.iterdir())
    assert [f.name.split("_")[1] for f in files] == ["step1", "step3"]  # one per profiled step, none for step 2
    assert all(f.name.startswith("actor_") and f.name.endswith(".json.gz") for f in files)
    names = trace_names(files[0])
    assert {"hyflow/gen", "hyflow/adv", "hyflow/update_actor"} <= names  # the trainer's stages
    assert "aten::mm" in names  # and the operators under them


@pytest.mark.slow
def test_continuous_steps_share_one_trace(tiny_model_dir, task_dir, tmp_path):
    traces = tmp_path / "traces"
    RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "run", *TORCH, "global_profiler.steps=[1,2]",
                        "global_profiler.profile_continuous_steps=true", f"global_profiler.save_path={traces}"),
              reward_fn=digit_reward).fit()
    (only,) = traces.iterdir()
    assert "_step1_" in only.name
    with gzip.open(only, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert sum(e.get("name") == "hyflow/update_actor" for e in events) == 2  # both steps in it


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_on_ray_only_the_chosen_rank_of_the_workers_writes_a_trace(tiny_model_dir, task_dir, tmp_path):
    """2 Ray workers (gloo, FSDP2), `ranks=[1]`: one trace, written by rank 1's own process (not the driver)."""
    import os

    traces = tmp_path / "traces"
    RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "run", *TORCH, "global_profiler.steps=[2]",
                        f"{ARR}.actor.profiler.ranks=[1]", f"global_profiler.save_path={traces}",
                        "trainer.total_training_steps=2", "trainer.executor=ray", "trainer.n_gpus_per_node=2",
                        "data.train_batch_size=2", "actor_rollout_ref.actor.strategy=fsdp2"),
              reward_fn=digit_reward).fit()
    (only,) = traces.iterdir()
    assert only.name.startswith("actor_step2_rank1-of-2_pid") and f"_pid{os.getpid()}_" not in only.name
    assert {"hyflow/worker/actor_update_actor", "aten::mm"} <= trace_names(only)  # the worker's calls, as ranges
