"""What a run prints: the end-of-run summary, the line for a run that is already complete, the plain progress
lines without a terminal, and verl's memory metrics in metrics.jsonl (RL and SFT trainers, tiny model on CPU)."""

from __future__ import annotations

import json
import re

import pytest

from hyflow.trainer.rl_trainer import RLTrainer, memory_metrics
from hyflow.trainer.tracking import (
    format_already_complete,
    format_duration,
    format_run_summary,
    read_metrics,
    validation_results,
)


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# ------------------------------------------------------------------------------------ the summary


def test_summary_block_names_final_and_best_validation_checkpoint_and_export(tmp_path):
    run = tmp_path / "my run"
    write_metrics(run, [
        {"step": 0, "val-core/gsm8k/acc/mean@4": 0.25, "val-core/math/acc/mean@4": 0.5},
        {"step": 1, "critic/score/mean": 0.1},
        {"step": 2, "val-core/gsm8k/acc/mean@4": 0.75, "val-core/math/acc/mean@4": None},  # NaN -> null: skipped
        {"step": 3, "val-core/gsm8k/acc/mean@4": 0.625, "val-core/math/acc/mean@4": 0.5, "val-aux/x/mean@4": 9.0},
    ])
    text = format_run_summary(run, elapsed_s=192.4, step=3, total_steps=3, checkpoint=run / "global_step_3")
    assert text.splitlines() == [
        "======================== hyflow: run complete ========================",
        "elapsed          3m12s",
        "steps            3 of 3",
        "validation       val-core/gsm8k/acc/mean@4: final 0.625 (step 3), best 0.75 (step 2)",
        "                 val-core/math/acc/mean@4: final 0.5 (step 3), best 0.5 (step 0)",
        f"run directory    {run}",
        f"last checkpoint  {run}/global_step_3",
        f"export           hyflow export --ckpt '{run}/global_step_3' --out '{run}/hf_global_step_3'",
        "======================================================================",
    ]


def test_summary_of_a_resumed_run_without_validation_or_checkpoint(tmp_path):
    text = format_run_summary(tmp_path, elapsed_s=5, step=40, total_steps=40, start_step=30,
                              history=[{"step": 31, "critic/score/mean": 0.5}])  # no metrics.jsonl: history
    assert "steps            40 of 40 (resumed at step 30, 10 trained now)" in text
    assert "validation       none logged" in text
    assert "last checkpoint  none saved (trainer.save_freq > 0 saves them, and the last step)" in text
    assert "export" not in text


def test_sft_summary_takes_the_lowest_val_loss_as_best():
    rows = [{"step": 1, "val/loss": 2.0}, {"step": 2, "val/loss": 1.5}, {"step": 3, "val/loss": 1.75}]
    assert validation_results(rows, "val/loss", higher_is_better=False) == {
        "val/loss": {"final": (3, 1.75), "best": (2, 1.5)}}


def test_already_complete_line(tmp_path):
    text = format_already_complete(tmp_path, 40, 40, tmp_path / "global_step_40")
    assert text.splitlines()[0] == (
        f"hyflow: the run in {tmp_path} is already complete at step 40 (total steps: 40); nothing to train.")
    assert f"hyflow export --ckpt {tmp_path}/global_step_40 --out {tmp_path}/hf_global_step_40" in text
    assert "raise trainer.total_training_steps" in text


@pytest.mark.parametrize(("seconds", "text"), [(0.25, "0.2s"), (7.5, "7.5s"), (45, "45s"), (192, "3m12s"),
                                               (1730, "28m50s"), (7509, "2h05m09s")])
def test_durations(seconds, text):
    assert format_duration(seconds) == text


def test_memory_metrics_have_verls_names():
    metrics = memory_metrics()
    assert 0 < metrics["perf/cpu_memory_used_gb"] < 1e5  # the machine's used memory, GiB (verl's definition)
    import torch

    gpu = {"perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb"}
    assert (gpu <= metrics.keys()) == torch.cuda.is_initialized()


# ---------------------------------------------------------------------------------- the trainers


def reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def rl_overrides(model_dir, task_dir, run_dir, *extra):
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={task_dir}/train.parquet",
        f"data.val_files={task_dir}/test.parquet", f"trainer.default_local_dir={run_dir}",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48", "data.max_response_length=6",
        "reward_model.num_workers=0", "trainer.logger=[console]", "trainer.total_training_steps=2",
        "trainer.test_freq=1", "trainer.save_freq=2", *extra,
    ]


@pytest.mark.slow
def test_rl_run_prints_progress_lines_and_summary_then_says_it_is_complete(tiny_model_dir, task_dir, tmp_path,
                                                                           capsys):
    run = tmp_path / "run"
    RLTrainer(rl_overrides(tiny_model_dir, task_dir, run), reward_fn=reward).fit()
    out = capsys.readouterr().out
    # stderr is not a terminal under pytest: plain progress lines on stdout, every max(1, 2 // 20) = 1 step
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(progress) == 2
    assert re.fullmatch(r"step 1/2 \(50 %\) - elapsed \S+ - ETA \S+ - reward \S+ - val \S+", progress[0])
    assert re.fullmatch(r"step 2/2 \(100 %\) - elapsed \S+ - reward \S+ - val \S+", progress[1])
    assert "more" not in out  # console lines end with their last curated key
    summary = out[out.index("hyflow: run complete"):]
    assert "steps            2 of 2\n" in summary
    assert re.search(r"validation       val-core/hyflow/arithmetic/reward/mean@1: final \S+ \(step 2\), "
                     r"best \S+ \(step \d\)", summary)
    assert f"run directory    {run}\n" in summary
    assert f"last checkpoint  {run / 'global_step_2'}\n" in summary
    assert f"hyflow export --ckpt {run / 'global_step_2'} --out {run / 'hf_global_step_2'}" in summary
    # metrics.jsonl although trainer.logger=[console]; verl's memory metric on every step
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["perf/cpu_memory_used_gb"] > 0 for r in rows[1:])

    again = RLTrainer(rl_overrides(tiny_model_dir, task_dir, run), reward_fn=reward).fit()
    out = capsys.readouterr().out
    assert again == []
    assert f"hyflow: the run in {run} is already complete at step 2 (total steps: 2); nothing to train." in out
    assert "run complete =" not in out
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]


@pytest.mark.slow
def test_sft_run_prints_summary_with_val_loss_then_says_it_is_complete(tiny_model_dir, task_dir, tmp_path, capsys):
    from hyflow.trainer.sft_trainer import SFTTrainer

    run = tmp_path / "sft"
    overrides = [f"model.partial_pretrain={tiny_model_dir}", f"data.train_files={task_dir}/train.parquet",
                 f"data.val_files={task_dir}/test.parquet", "data.response_key=extra_info.answer",
                 "data.train_batch_size=8", "data.micro_batch_size_per_gpu=8", "data.max_length=64",
                 "model.enable_gradient_checkpointing=false", "trainer.logger=[]", "trainer.total_training_steps=2",
                 "trainer.test_freq=1", f"trainer.default_local_dir={run}"]
    SFTTrainer(overrides).fit()
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(progress) == 2 and re.fullmatch(r"step 2/2 \(100 %\) - elapsed \S+ - loss \S+ - val_loss \S+",
                                               progress[1])
    summary = out[out.index("hyflow: run complete"):]
    rows = read_metrics(run)
    best = min(rows, key=lambda r: r["val/loss"])
    assert (f"validation       val/loss: final {rows[-1]['val/loss']:.4g} (step 2), "
            f"best {best['val/loss']:.4g} (step {best['step']})") in summary
    assert f"hyflow export --ckpt {run / 'global_step_2'} --out {run / 'hf_global_step_2'}" in summary

    SFTTrainer(overrides).fit()
    out = capsys.readouterr().out
    assert f"hyflow: the run in {run} is already complete at step 2 (total steps: 2); nothing to train." in out


# ------------------------------------------------------------ what a run prints off a terminal (issue 22)


def test_console_off_a_terminal_prints_about_ten_lines_per_tenfold_and_the_last_step():
    import io

    from hyflow.trainer.tracking import ConsoleLogger, console_step_shown

    assert [s for s in range(1, 1001) if console_step_shown(s)] == [
        *range(1, 11), *range(20, 101, 10), *range(200, 1001, 100)]
    stream = io.StringIO()  # not a terminal
    console = ConsoleLogger(stream)
    console.log({"val-core/a/acc/mean@1": 0.1}, step=0)
    for step in range(1, 601):
        console.log({"train/loss": 1.0} | ({"val/loss": 2.0} if step in (300, 555) else {}), step=step)
    console.close()
    steps = [int(line.split(" - ")[0].removeprefix("step:")) for line in stream.getvalue().splitlines()]
    assert steps == [0, *range(1, 11), *range(20, 101, 10), 200, 300, 400, 500, 555, 600]  # 26 lines, not 601
    assert stream.getvalue().splitlines()[-1] == "step:600 - train/loss:1"

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    console = ConsoleLogger(terminal)
    for step in range(1, 31):
        console.log({"train/loss": 1.0}, step=step)
    console.close()
    assert len(terminal.getvalue().splitlines()) == 30  # on a terminal: every step, as verl's LocalLogger

    resumed = io.StringIO()
    console = ConsoleLogger(resumed)
    for step in range(4501, 4551):
        console.log({"train/loss": 1.0}, step=step)
    console.close()
    assert [line.split(" - ")[0] for line in resumed.getvalue().splitlines()] == ["step:4501", "step:4550"]


def test_progress_inside_a_stage_on_the_bar_and_off_a_terminal(monkeypatch):
    import io
    import time

    from hyflow.trainer.tracking import ProgressBar

    out = io.StringIO()
    with ProgressBar(4, disable=False, file=out, heartbeat_s=0) as bar:
        bar.update({"critic/score/mean": 0.25})
        bar.stage("gen")
        bar.advance("rollout", 57, 128, "trajectories", "1234 tokens")
        assert bar.bar.postfix == "reward=0.25 | generating: 57/128 trajectories, 1234 tokens"
        bar.stage("update_actor")
        bar.advance("update_actor", 8, 8, "micro-batches", "mini-batch 2/2")
        assert bar.bar.postfix == "reward=0.25 | updating actor: 8/8 micro-batches, mini-batch 2/2"
        bar.stage("testing")  # validation generates too: the trainer's name for the stage stays
        bar.advance("rollout", 200, 200, "trajectories", "800 tokens")
        assert bar.bar.postfix.endswith("validating: 200/200 trajectories, 800 tokens")
        bar.update({"critic/score/mean": 0.5})
        assert bar.bar.postfix == "reward=0.5"  # the stage ends with the step

    lines = io.StringIO()  # off a terminal: a line per heartbeat while a stage runs, none between stages
    with ProgressBar(4, disable=True, lines_file=lines, heartbeat_s=0.2) as bar:
        bar.update({"critic/score/mean": 0.25})
        bar.stage("gen")
        bar.advance("rollout", 3, 16, "trajectories", "96 tokens")
        time.sleep(1.5)
        bar.update({"critic/score/mean": 0.5})
        quiet = len(lines.getvalue().splitlines())
        time.sleep(1.2)
        assert len(lines.getvalue().splitlines()) == quiet
    printed = lines.getvalue().splitlines()
    beats = [line for line in printed if "in this stage" in line]
    assert 1 <= len(beats) <= 8
    assert re.fullmatch(r"step 2/4 - generating: 3/16 trajectories, 96 tokens - \S+ in this stage - elapsed \S+",
                        beats[0])


@pytest.mark.slow
def test_a_run_off_a_terminal_prints_few_lines_and_progress_inside_the_step(tiny_model_dir, task_dir, tmp_path,
                                                                             capsys, monkeypatch):
    from hyflow.trainer.tracking import ProgressBar

    reported = []
    advance = ProgressBar.advance

    def recording(self, stage, done, total, unit, detail=""):
        reported.append((stage, done, total, unit, detail))
        return advance(self, stage, done, total, unit, detail)

    monkeypatch.setattr(ProgressBar, "advance", recording)
    run = tmp_path / "run"
    RLTrainer(rl_overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=40", "trainer.test_freq=20",
                           "trainer.save_freq=-1", "data.max_response_length=4", "actor_rollout_ref.rollout.n=2",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"),
              reward_fn=reward).fit()
    out = capsys.readouterr().out.splitlines()  # stdout is not a terminal under pytest
    console = [int(line.split(" - ")[0].removeprefix("step:")) for line in out if line.startswith("step:")
               and "samples" not in line]
    progress = [line for line in out if re.match(r"step \d+/40 \(", line)]
    # console: validation before training, steps 1-10, 20, 30, 40 (20 and 40 validate): 14 lines, not 41
    assert console == [0, *range(1, 11), 20, 30, 40]
    # progress: the first step and every 40 // 20 = 2 steps (the last among them): 21 lines
    assert len(progress) == 21 and progress[0].startswith("step 1/40 (2 %)") and progress[-1].startswith(
        "step 40/40 (100 %)")
    assert len(out) < 100
    rollout = [r for r in reported if r[0] == "rollout"]
    assert ("rollout", 4, 4, "trajectories") in {r[:4] for r in rollout}  # 2 prompts x 2 samples, then done
    assert rollout[0][:4] == ("rollout", 1, 8, "trajectories")  # the validation before training: 8 prompts
    assert all(r[4].endswith(" tokens") for r in rollout)
    assert ("update_actor", 1, 2, "micro-batches", "") in reported  # 4 samples in micro-batches of 2
    assert ("update_actor", 2, 2, "micro-batches", "") in reported


# ------------------------------------------------------------------- trainer.resume_mode=disable


def test_a_run_that_starts_over_names_only_its_own_checkpoints(tmp_path, capsys):
    """resume_mode=disable in a directory holding a previous run's global_step_2: the summary and the Ctrl-C line
    name no checkpoint until this run saves one (failed before: both named the previous run's global_step_2)."""
    from hyflow.trainer.checkpoint import CheckpointManager
    from hyflow.trainer.report import latest_checkpoint, where_interrupted
    from hyflow.trainer.run_dir import claim_run_directory

    run = tmp_path / "run"
    CheckpointManager(run).save(2, {"trainer_state": {"step": 2}})
    write_metrics(run, [{"step": 1}, {"step": 2}])
    manager = CheckpointManager(run)
    claim = claim_run_directory(run, "disable", None, manager)
    try:
        assert "starting from step 0" in capsys.readouterr().out
        assert latest_checkpoint(manager) is None
        assert "no checkpoint saved yet" in where_interrupted(1, 3, None, manager)
        summary = format_run_summary(run, elapsed_s=1, step=1, total_steps=3, checkpoint=latest_checkpoint(manager))
        assert "global_step_2" not in summary and "last checkpoint  none saved" in summary
        manager.save(1, {"trainer_state": {"step": 1}})
        assert latest_checkpoint(manager) == run / "global_step_1"
        manager.save(2, {"trainer_state": {"step": 2}})  # replaces the previous run's step 2: now this run's
        assert latest_checkpoint(manager) == run / "global_step_2"
    finally:
        claim.release()
    resumed = CheckpointManager(run)
    claim = claim_run_directory(run, "auto", None, resumed)
    try:
        assert latest_checkpoint(resumed) == run / "global_step_2"  # resuming: the directory's checkpoints count
    finally:
        claim.release()


@pytest.mark.slow
def test_rl_run_with_resume_disabled_does_not_claim_the_previous_checkpoint(tiny_model_dir, task_dir, tmp_path,
                                                                              capsys):
    run = tmp_path / "run"
    RLTrainer(rl_overrides(tiny_model_dir, task_dir, run), reward_fn=reward).fit()
    assert (run / "global_step_2").is_dir()
    capsys.readouterr()
    RLTrainer(rl_overrides(tiny_model_dir, task_dir, run, "trainer.resume_mode=disable", "trainer.save_freq=0",
                           "trainer.total_training_steps=1"), reward_fn=reward).fit()
    out = capsys.readouterr().out
    summary = out[out.index("hyflow: run complete"):]
    assert "steps            1 of 1\n" in summary
    assert "global_step_2" not in summary and "last checkpoint  none saved" in summary
