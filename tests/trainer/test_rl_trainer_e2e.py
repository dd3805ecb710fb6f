"""End-to-end RL runs on CPU with the tiny model: every stage, checkpoints, exact resume, export, the CLI."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyflow.trainer.rl_trainer import RLTrainer
from hyflow.trainer.tracking import read_metrics

# the console script beside the interpreter (an installed hyflow), else the one on PATH (`benchmarks/gpu_check.py`
# puts a launcher there on a machine whose own Python runs hyflow from the source tree)
_BESIDE = Path(sys.executable).parent / "hyflow"
HYFLOW = str(_BESIDE) if _BESIDE.exists() else shutil.which("hyflow") or str(_BESIDE)

pytestmark = pytest.mark.slow


def digit_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Dense toy reward: the share of digits in the response (gives a learning signal to a random model)."""
    digits = sum(c.isdigit() for c in solution_str)
    return {"score": digits / max(len(solution_str), 1), "digits": digits}


def overrides(model_dir, task_dir, run_dir, *extra):
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={task_dir}/train.parquet",
        f"data.val_files={task_dir}/test.parquet", f"trainer.default_local_dir={run_dir}",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48", "data.max_response_length=12",
        "actor_rollout_ref.actor.optim.lr=3e-3", "reward_model.num_workers=0", "trainer.logger=[file]",
        "trainer.total_training_steps=4", "trainer.test_freq=2", "data.seed=3", "trainer.save_freq=2", *extra,
    ]


def comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))} for row in rows]


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_resume_is_exact(tiny_model_dir, task_dir, tmp_path, fmt):
    full = tmp_path / "full"
    RLTrainer(overrides(tiny_model_dir, task_dir, full), reward_fn=digit_reward).fit()
    part = tmp_path / "part"
    RLTrainer(overrides(tiny_model_dir, task_dir, part, "trainer.total_training_steps=2",
                        f"trainer.checkpoint_format={fmt}"), reward_fn=digit_reward).fit()
    assert (part / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    manifest = json.loads((part / "global_step_2" / "manifest.json").read_text())
    assert ("actor_model" in manifest["components"]) == (fmt == "full")
    assert ("actor" in manifest["sharded"]) == (fmt == "sharded")
    RLTrainer(overrides(tiny_model_dir, task_dir, part, "trainer.total_training_steps=4",
                        f"trainer.checkpoint_format={fmt}"), reward_fn=digit_reward).fit()
    full_rows, part_rows = comparable(read_metrics(full)), comparable(read_metrics(part))
    assert [r["step"] for r in part_rows] == [0, 1, 2, 3, 4]
    for a, b in zip(full_rows[3:], part_rows[3:]):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert full_rows[-1]["critic/score/mean"] != full_rows[1]["critic/score/mean"]  # it did train
    assert "reward/digits/mean" in full_rows[-1]  # extra keys of the reward become metrics
    assert any(k.startswith("val-aux/hyflow/arithmetic/digits/") for k in full_rows[-1])


def test_export_loads_with_transformers(tiny_model_dir, task_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=1"),
              reward_fn=digit_reward).fit()
    out = tmp_path / "hf"
    proc = subprocess.run([HYFLOW, "export", "--ckpt", str(run / "global_step_1"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    saved = torch.load(run / "global_step_1" / "trainer_state.pt", weights_only=False)
    assert saved["global_step"] == 1
    assert isinstance(model(torch.tensor([[1, 2, 3]])).logits, torch.Tensor)


def test_sharded_checkpoint_exports_the_weights_a_resume_loads(tiny_model_dir, task_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=1",
                        "trainer.checkpoint_format=sharded"), reward_fn=digit_reward).fit()
    ckpt = run / "global_step_1"
    assert (ckpt / "actor" / ".metadata").is_file() and not (ckpt / "actor_model.safetensors").exists()
    out = tmp_path / "hf"
    proc = subprocess.run([HYFLOW, "export", "--ckpt", str(ckpt), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    resumed = RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=2"),
                        reward_fn=digit_reward)
    resumed.setup()
    try:
        assert resumed.global_step == 1
        loaded = resumed.actor.state_dict()["actor_model"]
    finally:
        resumed.tracker.close()
        resumed.shutdown()
    assert set(exported) == set(loaded)
    for name, tensor in loaded.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(initial[k], loaded[k]) for k in loaded)  # the step changed the weights


def test_checkpoint_contents_are_honoured_on_save_and_resume(tiny_model_dir, task_dir, tmp_path):
    run = tmp_path / "run"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=1",
                        "actor_rollout_ref.actor.checkpoint.save_contents=[model]", "trainer.test_freq=-1"),
              reward_fn=digit_reward).fit()
    names = set(json.loads((run / "global_step_1" / "manifest.json").read_text())["components"])
    assert names == {"actor_model", "trainer_state"}
    assert "rng" not in torch.load(run / "global_step_1" / "trainer_state.pt", weights_only=False)
    with pytest.warns(UserWarning, match="has no actor optimizer or extra state"):
        RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=2", "trainer.test_freq=-1"),
                  reward_fn=digit_reward).fit()
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    with pytest.raises(ValueError, match="holds no critic state"):
        RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=3",
                            "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2"),
                  reward_fn=digit_reward).fit()
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]  # nothing written was lost


def test_corrupt_checkpoint_is_reported_not_used(tiny_model_dir, task_dir, tmp_path):
    run = tmp_path / "run"
    RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=1"),
              reward_fn=digit_reward).fit()
    weights = run / "global_step_1" / "actor_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(Exception, match="global_step_1"):
        RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=2",
                            "trainer.resume_mode=resume_path", f"trainer.resume_from_path={run}/global_step_1"),
                  reward_fn=digit_reward).fit()


def test_verl_style_command_line(tiny_model_dir, task_dir, tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return {'score': float(len(solution_str) > 3), 'long': len(solution_str)}\n")
    run = tmp_path / "run"
    args = overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=2",
                     f"custom_reward_function.path={reward_file}", f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
                     f"trainer.validation_data_dir={tmp_path / 'val'}")
    proc = subprocess.run([HYFLOW, "train", *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run)
    assert rows[-1]["step"] == 2 and "reward/long/mean" in rows[-1]
    assert any(k.startswith("val-aux/hyflow/arithmetic/long/mean@1") for k in rows[-1])
    assert (run / "config.yaml").exists() and (run / "generations" / "val_step_2.jsonl").exists()
    first = json.loads((run / "generations" / "val_step_0.jsonl").read_text().splitlines()[0])
    assert {"input", "output", "score"} <= first.keys()
    dumped = [json.loads(line) for line in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and {r["step"] for r in dumped} == {2}  # 4 prompts x 4 samples
    assert {"input", "output", "score", "ground_truth", "long", "data_source"} <= dumped[0].keys()
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl", "2.jsonl"]


def test_model_based_reward(tiny_model_dir, tiny_tokenizer, task_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.config.pad_token_id = tiny_tokenizer.pad_token_id
    rm.save_pretrained(tmp_path / "rm")
    tiny_tokenizer.save_pretrained(tmp_path / "rm")
    history = RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "run", "trainer.total_training_steps=1",
                                  "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'rm'}",
                                  "trainer.val_before_train=false")).fit()
    last = history[-1]
    assert last["reward/rm_score/mean"] == pytest.approx(last["critic/score/mean"], abs=1e-5)
    assert last["critic/score/max"] > last["critic/score/min"]  # a real model's scores differ per sample


def test_full_determinism_turns_on_deterministic_kernels(tiny_model_dir, task_dir, tmp_path):
    assert not torch.are_deterministic_algorithms_enabled()
    trainer = RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "run",
                                  "actor_rollout_ref.actor.fsdp_config.full_determinism=true"), reward_fn=digit_reward)
    try:
        trainer.setup()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        if getattr(trainer, "tracker", None) is not None:
            trainer.tracker.close()
        trainer.shutdown()
