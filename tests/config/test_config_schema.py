"""The schema: every field documented, verl's key names and defaults, hyflow's documented deviations,
interpolated defaults, and render_config's help comments."""

from __future__ import annotations

import dataclasses
import re

import yaml

from hyflow.config import HyflowConfig, config_to_dict, load_config, render_config
from hyflow.config.schema import DataConfig


def _fields(cls: type = HyflowConfig, prefix: str = ""):
    """(dotted key, dataclasses.Field, annotation class or None) for every field of the schema."""
    for f in dataclasses.fields(cls):
        yield f"{prefix}{f.name}", f
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _fields(type(default), f"{prefix}{f.name}.")


def test_every_field_has_help_text():
    missing = [key for key, f in _fields() if len(f.metadata.get("help", "")) < 10]
    assert missing == []


def test_sizes_say_their_unit():
    for key, f in _fields():
        leaf = key.rsplit(".", 1)[-1]
        help_text = f.metadata["help"].lower()
        if re.search(r"(batch_size|micro_batch)", leaf) and leaf != "val_batch_size":
            assert "prompts" in help_text or "samples" in help_text, key
        if "token_len" in leaf or leaf.endswith("_length"):
            assert "token" in help_text or "characters" in help_text, key


def test_algorithm_knobs_cite_their_paper():
    helps = {key: f.metadata["help"] for key, f in _fields()}
    for key in (
        "actor_rollout_ref.actor.clip_ratio",
        "actor_rollout_ref.actor.clip_ratio_high",
        "actor_rollout_ref.actor.clip_ratio_c",
        "algorithm.lam",
        "algorithm.adv_estimator",
        "algorithm.kl_ctrl.type",
        "actor_rollout_ref.actor.loss_agg_mode",
    ):
        assert "arXiv" in helps[key], key


def test_verl_keys_and_defaults():
    cfg = HyflowConfig()
    arr = cfg.actor_rollout_ref
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (
        1024,
        512,
        512,
    )
    assert (arr.actor.ppo_mini_batch_size, arr.actor.ppo_epochs, arr.actor.ppo_max_token_len_per_gpu) == (
        256,
        1,
        16384,
    )
    assert (arr.actor.clip_ratio_low, arr.actor.clip_ratio_high, arr.actor.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert (arr.actor.loss_agg_mode, arr.actor.kl_loss_type, arr.actor.policy_loss.loss_mode) == (
        "token-mean",
        "low_var_kl",
        "vanilla",
    )
    assert arr.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5
    assert arr.actor.checkpoint.save_contents == ["model", "optimizer", "extra"]
    assert (arr.rollout.n, arr.rollout.temperature, arr.rollout.top_k, arr.rollout.top_p) == (1, 1.0, -1, 1.0)
    val = arr.rollout.val_kwargs
    assert (val.n, val.temperature, val.do_sample) == (1, 0.0, False)
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.gamma, cfg.algorithm.lam) == ("gae", 1.0, 1.0)
    assert dataclasses.asdict(cfg.algorithm.kl_ctrl) == {
        "type": "fixed",
        "kl_coef": 0.001,
        "horizon": 10000,
        "target_kl": 0.1,
    }
    assert (cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.max_num_gen_batches) == (False, 0)
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 2.0
    assert cfg.critic.enable is None and cfg.critic.cliprange_value == 0.5
    assert (cfg.reward_model.enable, cfg.reward_model.reward_manager) == (False, "naive")
    assert cfg.custom_reward_function.name == "compute_score"
    assert (cfg.trainer.total_epochs, cfg.trainer.save_freq, cfg.trainer.resume_mode) == (30, -1, "auto")
    assert arr.model.path is None  # verl's ??? stays required, checked by whoever needs it


def test_hyflow_defaults_and_their_documented_deviations():
    cfg = HyflowConfig()
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.trainer.n_gpus_per_node == 1
    assert cfg.trainer.logger == ["console", "file"]
    assert (cfg.trainer.device, cfg.trainer.executor, cfg.trainer.seed) == ("auto", "auto", 1)
    assert (cfg.reward_model.timeout_s, cfg.reward_model.num_workers) == (30.0, 1)
    helps = {key: f.metadata["help"] for key, f in _fields()}
    for key in ("actor_rollout_ref.rollout.name", "trainer.n_gpus_per_node", "trainer.logger"):
        assert "verl:" in helps[key], key
    assert "cpu, cuda, or auto" in helps["trainer.device"]


def test_interpolated_defaults_resolve_when_built_directly():
    cfg = HyflowConfig(data=DataConfig(max_prompt_length=64, max_response_length=100))
    assert cfg.actor_rollout_ref.rollout.prompt_length == 64
    assert cfg.actor_rollout_ref.rollout.response_length == 100
    assert cfg.critic.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 32768
    checkpoint = cfg.actor_rollout_ref.actor.checkpoint
    assert checkpoint.load_contents == checkpoint.save_contents
    assert checkpoint.load_contents is not checkpoint.save_contents
    assert cfg.trainer.default_local_dir == "checkpoints/hyflow/default"
    assert cfg == load_config(["data.max_prompt_length=64", "data.max_response_length=100"])


def test_mutable_defaults_are_not_shared():
    a, b = HyflowConfig(), HyflowConfig()
    a.trainer.logger.append("wandb")
    a.reward_model.reward_kwargs["x"] = 1
    assert b.trainer.logger == ["console", "file"] and b.reward_model.reward_kwargs == {}


def test_render_config_carries_help_and_is_the_config_as_yaml():
    cfg = load_config(["data.train_batch_size=32", "+reward_model.reward_kwargs.strict=true"])
    text = render_config(cfg)
    assert "  train_batch_size: 32  # Prompts per training step (global)" in text
    assert "actor_rollout_ref:  # Policy model" in text
    assert "    name: hf  # Generation engine: hf" in text
    assert "reward_kwargs: {strict: true}  # Extra keyword arguments" in text
    assert yaml.safe_load(text) == config_to_dict(cfg)
    plain = render_config(cfg, with_help=False)
    assert "#" not in plain and yaml.safe_load(plain) == config_to_dict(cfg)
