"""Options that change speed, not results: `actor_rollout_ref.actor.use_prefix_grouper=true` (the actor's and
the reference's packed forwards run each prompt once per micro-batch for all its samples) and
`actor_rollout_ref.actor.use_torch_compile=true` (MLPs and norms compiled for the engine's passes). The first
update is the same as without them."""

from __future__ import annotations

import pytest

import hyflow.models.packing as packing
from hyflow.config import load_config, validate_config
from hyflow.trainer.rl_trainer import RLTrainer, speed_defaults_line


def test_on_by_default_where_packing_is_and_follows_it():
    """hyflow's default (verl's is false): on with packing, off without it, so use_remove_padding=false alone is valid."""
    assert load_config([]).actor_rollout_ref.actor.use_prefix_grouper is True
    assert load_config([]).critic.model.use_remove_padding is True
    unpacked = load_config(["actor_rollout_ref.model.use_remove_padding=false"])
    assert unpacked.actor_rollout_ref.actor.use_prefix_grouper is False
    assert unpacked.critic.model.use_remove_padding is False
    validate_config(unpacked, n_devices=1)


def test_start_line_names_the_defaults_unlike_verls():
    line = speed_defaults_line(load_config([]))
    assert ("actor_rollout_ref.actor.use_prefix_grouper=true (verl: false; same values and gradients" in line
            and "critic.model.use_remove_padding=true (verl: false" in line
            and "actor_rollout_ref.actor.use_torch_compile=false (verl: true" in line)
    assert "critic." not in speed_defaults_line(load_config(["algorithm.adv_estimator=grpo"]))
    verl_like = load_config(["actor_rollout_ref.actor.use_prefix_grouper=false", "critic.model.use_remove_padding=false",
                             "actor_rollout_ref.actor.use_torch_compile=true"])
    assert speed_defaults_line(verl_like).endswith(": none")


def test_without_packing_shares_nothing_and_says_so():
    """verl's padded prefix grouper: hyflow shares prompts inside packed micro-batches only, so with
    use_remove_padding=false the key is performance-only (the same numbers), named at start."""
    from hyflow.config.support import performance_only_warning

    cfg = load_config(["actor_rollout_ref.actor.use_prefix_grouper=true", "actor_rollout_ref.model.use_remove_padding=false"])
    validate_config(cfg, n_devices=1)
    assert "actor_rollout_ref.actor.use_prefix_grouper=true (hyflow shares a prompt among its samples inside packed" in \
        performance_only_warning(cfg)
    assert "use_prefix_grouper" not in (performance_only_warning(load_config([])) or "")


def first_update(tiny_model_dir, task_dir, run_dir, *extra) -> dict:
    args = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={task_dir}/train.parquet",
            f"trainer.default_local_dir={run_dir}", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
            "data.max_prompt_length=48", "data.max_response_length=12", "reward_model.num_workers=0",
            "trainer.logger=[file]", "trainer.total_training_steps=1", "trainer.val_before_train=false", *extra]
    return RLTrainer(args, reward_fn=lambda **kw: float(len(kw["solution_str"]) % 3)).fit()[-1]


def assert_same_first_update(got: dict, want: dict) -> None:
    assert got["response_length/mean"] == want["response_length/mean"]  # same rollout (same weights)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl",
                "critic/score/mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_prefix_grouper_same_first_update_with_fewer_tokens(tiny_model_dir, task_dir, tmp_path, monkeypatch):
    shared_tokens: list[int] = []
    real = packing._pack_shared_prefixes

    def spy(*args, **kwargs):
        packed = real(*args, **kwargs)
        shared_tokens.append(packed.shared.shared_tokens if packed is not None else 0)
        return packed

    monkeypatch.setattr(packing, "_pack_shared_prefixes", spy)
    plain = first_update(tiny_model_dir, task_dir, tmp_path / "plain", "actor_rollout_ref.actor.use_prefix_grouper=false")
    assert shared_tokens == []
    grouped = first_update(tiny_model_dir, task_dir, tmp_path / "grouped", "actor_rollout_ref.actor.use_prefix_grouper=true")
    # 2 micro-batches of 8 rows each for the old log-probs, the reference and each of the 2 update epochs: each
    # holds 2 prompts x 4 samples, so 3 of every 4 rows skip their prompt
    assert len(shared_tokens) == 8 and all(n > 0 for n in shared_tokens)
    assert_same_first_update(grouped, plain)


@pytest.mark.slow
def test_torch_compile_same_first_update(tiny_model_dir, task_dir, tmp_path, monkeypatch, capsys):
    import hyflow.models.compile as compile_module

    entered = []
    real = compile_module.CompiledModules.active

    def spy(self):
        entered.append(len(self.modules))
        return real(self)

    monkeypatch.setattr(compile_module.CompiledModules, "active", spy)
    plain = first_update(tiny_model_dir, task_dir, tmp_path / "plain")
    assert entered == []
    compiled = first_update(tiny_model_dir, task_dir, tmp_path / "compiled", "actor_rollout_ref.actor.use_torch_compile=true")
    assert "actor: use_torch_compile: 7 modules (Qwen2MLP, Qwen2RMSNorm) compile at their first" in capsys.readouterr().out
    assert len(entered) == 6  # old log-probs, reference (a separate model), 2 epochs x 2 update micro-batches
    assert_same_first_update(compiled, plain)
