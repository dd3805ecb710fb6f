"""`hyflow config` as users run it: one section at a time, the quick checks the README and docs/install.md show,
and verl's entry point `python -m hyflow.trainer.main_ppo`."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hyflow.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_config_section_prints_one_section_under_its_full_name(capsys):
    assert main(["config", "--no-help", "--section", "actor_rollout_ref.actor.optim", "critic.optim.lr=3e-5"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0] == "actor_rollout_ref.actor.optim:"
    assert "  lr: 1.0e-06" in lines and "  lr_scheduler_type: constant" in lines
    assert "data:" not in out and "Batch arithmetic" not in out and len(lines) < 25


def test_config_section_takes_a_leaf_and_verl_0_10_names(capsys):
    assert main(["config", "-s", "data.train_batch_size", "data.train_batch_size=64",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("data.train_batch_size: 64  # Prompts per training step")
    assert main(["config", "--no-help", "-s", "reward.reward_manager.name"]) == 0  # verl 0.10's name
    assert capsys.readouterr().out.strip() == "reward_model.reward_manager: naive"


def test_config_section_that_names_nothing_suggests_the_closest(capsys):
    assert main(["config", "--section", "actor_rollout_ref.actr"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'actor_rollout_ref.actr'. Did you mean 'actor_rollout_ref.actor'?" in err


def test_config_prints_tensor_parallel_groups(capsys):
    """`hyflow config` with verl's torchtitan name: the actor's 8 devices are 4 data-parallel groups of 2, the
    spec says so, and a size that does not divide the devices is the named error (exit 2)."""
    assert main(["config", "--no-help", "trainer.n_gpus_per_node=8", "data.train_batch_size=32",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                 "actor_rollout_ref.actor.torchtitan.tensor_parallel_size=2"]) == 0
    out = capsys.readouterr().out
    assert ("per device: 16 samples per mini-batch / 4 data-parallel groups of 2 devices (tensor_parallel_size 2: a "
            "group's devices share its samples, each holds 1/2 of every layer's attention heads and MLP) = 4 samples"
            in out)
    assert "    tensor_parallel_size: 2\n" in out and "  actor.engine.tensor_parallel_size: 2\n" in out
    assert main(["config", "--no-help", "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.tensor_parallel_size=3"]) == 2
    assert "actor_rollout_ref.actor.tensor_parallel_size=3 must be >= 1 and divide the 8 devices" in capsys.readouterr().err


def _quick_check_commands() -> list[tuple[str, str]]:
    """The `hyflow config ...` lines of README.md's and docs/install.md's code blocks (the install checks)."""
    commands = []
    for name in ("README.md", "docs/install.md"):
        in_block = False
        for line in (ROOT / name).read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
                continue
            match = re.match(r"^(?:\.venv/bin/)?hyflow (config(?:\s.*)?)$", line.strip())
            if in_block and match:
                commands.append((name, match.group(1).split("  #")[0].strip()))
    return commands


def test_the_docs_show_a_quick_check():
    assert [name for name, _ in _quick_check_commands()].count("docs/install.md") >= 1
    assert [name for name, _ in _quick_check_commands()].count("README.md") >= 1


@pytest.mark.parametrize("source, command", _quick_check_commands())
def test_every_quick_check_command_in_the_docs_exits_0(source, command, capsys):
    assert main(shlex.split(command)) == 0, f"{source}: hyflow {command}\n{capsys.readouterr().err}"


def test_python_m_main_ppo_is_hyflow_train():
    help_text = subprocess.run([sys.executable, "-m", "hyflow.trainer.main_ppo", "--help"], capture_output=True,
                               text=True, timeout=120, cwd=ROOT)
    assert help_text.returncode == 0 and help_text.stdout.startswith("usage: hyflow train")
    bad = subprocess.run([sys.executable, "-m", "hyflow.trainer.main_ppo", "data.train_batch_size=4"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("hyflow train: error: actor_rollout_ref.actor.ppo_mini_batch")
