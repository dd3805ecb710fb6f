"""load_config: composition (defaults <- YAML <- overrides), unknown keys with suggestions, type errors,
interpolations, free-form `+`/`~` edits and the YAML round trip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hyflow.config import (
    ConfigError,
    HyflowConfig,
    config_from_yaml_file,
    config_to_dict,
    config_to_yaml,
    load_config,
)
from hyflow.config.support import value_of


def test_defaults_load_as_typed_dataclass():
    cfg = load_config()
    assert isinstance(cfg, HyflowConfig)
    assert cfg.data.train_batch_size == 1024
    assert cfg == HyflowConfig()


# ------------------------------------------------------------------------------------ unknown keys


def test_misspelt_key_names_the_closest_valid_key_exactly():
    with pytest.raises(ConfigError) as info:
        load_config(["actor_rollout_ref.actor.ppo_mini_batchsize=4"])
    assert str(info.value) == (
        "unknown config key 'actor_rollout_ref.actor.ppo_mini_batchsize'. "
        "Did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'?"
    )


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("trainr.total_epochs=3", "trainer.total_epochs"),  # top-level typo
        ("actor_rollout_ref.actr.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size"),
        (
            "actor_rollout_ref.rollout.val_kwargs.temprature=0.5",
            "actor_rollout_ref.rollout.val_kwargs.temperature",
        ),
        (
            "actor_rollout_ref.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size",
        ),  # wrong level
        ("algorithm.kl_ctrl.kl_coeff=0.1", "algorithm.kl_ctrl.kl_coef"),
        ("reward_modle.reward_kwargs.x=1", "reward_model.reward_kwargs.x"),
    ],
)
def test_typos_at_any_depth_suggest_the_full_valid_key(override, suggestion):
    key = override.split("=")[0]
    with pytest.raises(
        ConfigError, match=re.escape(f"unknown config key {key!r}. Did you mean {suggestion!r}?")
    ):
        load_config([override])


def test_key_far_from_everything_points_to_the_key_listing():
    with pytest.raises(ConfigError, match=r"unknown config key 'zzzz'\. Run `hyflow config`"):
        load_config(["zzzz=1"])


def test_subkey_of_a_leaf_is_an_error_naming_the_leaf():
    with pytest.raises(
        ConfigError, match=r"'actor_rollout_ref.rollout.n' is a single value \(int\), not a section"
    ):
        load_config(["actor_rollout_ref.rollout.n.x=1"])


def test_section_given_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match=r"'critic' is a section, not a value\. Set its keys instead"):
        load_config(["critic=3"])


# ------------------------------------------------------------------------------------- type errors


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor_rollout_ref.rollout.n=abc",
            "actor_rollout_ref.rollout.n='abc' (a str) is not a valid int. Give actor_rollout_ref.rollout.n an int, e.g. actor_rollout_ref.rollout.n=1.",
        ),
        ("trainer.val_before_train=maybe", "trainer.val_before_train='maybe' (a str) is not a valid bool"),
        ("trainer.total_epochs=2.5", "trainer.total_epochs=2.5 (a float) is not a valid int"),
        (
            "actor_rollout_ref.actor.optim.betas=[a,b]",
            "actor_rollout_ref.actor.optim.betas=['a', 'b'] (a list) is not a valid list of float. Give actor_rollout_ref.actor.optim.betas a list of float, e.g. actor_rollout_ref.actor.optim.betas=[0.9, 0.999].",
        ),
        (
            "data.train_batch_size=null",
            "data.train_batch_size=None (a NoneType) is not a valid int. Give data.train_batch_size an int, e.g. data.train_batch_size=1024.",
        ),
        (
            "actor_rollout_ref.rollout.temperature=hot",
            "actor_rollout_ref.rollout.temperature='hot' (a str) is not a valid float",
        ),
    ],
)
def test_type_errors_name_key_value_and_expected_type(override, message):
    with pytest.raises(ConfigError, match="type error: " + re.escape(message)):
        load_config([override])


def test_values_are_converted_to_the_field_type():
    cfg = load_config(
        ["actor_rollout_ref.actor.optim.lr=3e-6", "algorithm.gamma=1", "trainer.experiment_name=123"]
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    assert isinstance(cfg.algorithm.gamma, float)
    assert cfg.trainer.experiment_name == "123"


def test_a_home_directory_tilde_in_a_value_is_expanded_as_a_shell_would(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(["data.train_files=~/data/train.parquet", "data.val_files=[~/a.parquet, ~/b.parquet]",
                       "trainer.project_name='~/kept'"])
    assert cfg.data.train_files == f"{tmp_path}/data/train.parquet"
    assert list(cfg.data.val_files) == [f"{tmp_path}/a.parquet", f"{tmp_path}/b.parquet"]
    with pytest.raises(ConfigError, match=r"a '~' inside a value must be quoted: trainer.experiment_name='a~b'"):
        load_config(["trainer.experiment_name=a~b"])  # not a home directory: Hydra's grammar refuses it
    assert cfg.trainer.project_name == "~/kept"  # quoted: as written


def test_unparseable_override_and_sweeps_are_errors():
    with pytest.raises(ConfigError, match=r"cannot parse override 'data.train_batch_size=\[1'"):
        load_config(["data.train_batch_size=[1"])
    with pytest.raises(ConfigError, match=r"is a sweep \(several values\); give one value per key"):
        load_config(["actor_rollout_ref.rollout.n=1,2"])


# ---------------------------------------------------------------------------- lists, sections


def test_lists_and_bare_strings_for_list_fields():
    assert load_config(["trainer.logger=[console,wandb]"]).trainer.logger == ["console", "wandb"]
    assert load_config(["trainer.logger=console"]).trainer.logger == ["console"]


def test_a_mapping_value_sets_keys_of_a_section():
    cfg = load_config(["actor_rollout_ref.rollout.val_kwargs={n:4,temperature:0.6,do_sample:true}"])
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.n, val.temperature, val.do_sample, val.top_p) == (4, 0.6, True, 1.0)
    with pytest.raises(ConfigError, match="unknown config key 'actor_rollout_ref.rollout.val_kwargs.nn'"):
        load_config(["actor_rollout_ref.rollout.val_kwargs={nn:4}"])


def test_later_overrides_win():
    assert (
        load_config(
            ["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.n=5"]
        ).actor_rollout_ref.rollout.n
        == 5
    )


# ------------------------------------------------------------------------------- interpolation


def test_interpolation_from_the_command_line_resolves():
    cfg = load_config(
        ["data.max_response_length=77", "actor_rollout_ref.rollout.prompt_length=${data.max_response_length}"]
    )
    assert cfg.actor_rollout_ref.rollout.prompt_length == 77


def test_interpolated_defaults_follow_their_source():
    cfg = load_config(
        [
            "data.max_response_length=300",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.project_name=p",
        ]
    )
    assert cfg.actor_rollout_ref.rollout.response_length == 300
    assert cfg.critic.ppo_mini_batch_size == 8
    assert cfg.trainer.default_local_dir == "checkpoints/p/default"


def test_broken_interpolation_names_the_key_and_the_closest_target():
    with pytest.raises(ConfigError, match=re.escape("Did you mean ${data.max_response_length}?")) as info:
        load_config(["actor_rollout_ref.rollout.response_length=${data.max_respons_length}"])
    assert "cannot resolve actor_rollout_ref.rollout.response_length='${data.max_respons_length}'" in str(
        info.value
    )


# ------------------------------------------------------------------------------ free-form dicts


def test_plus_adds_entries_to_free_form_dicts():
    cfg = load_config(
        [
            "+reward_model.reward_kwargs.strict=true",
            "+reward_model.reward_kwargs.nested.depth=3",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "+custom_reward_function.reward_kwargs.scale=[1,2]",
            "ray_kwargs.ray_init.num_cpus=2",  # exists already: no '+' needed
        ]
    )
    assert cfg.reward_model.reward_kwargs == {"strict": True, "nested": {"depth": 3}}
    assert cfg.actor_rollout_ref.model.override_config == {"attn_implementation": "sdpa"}
    assert cfg.custom_reward_function.reward_kwargs == {"scale": [1, 2]}
    assert cfg.ray_kwargs.ray_init == {"num_cpus": 2, "runtime_env": {"py_executable": None}}


def test_new_free_form_entry_without_plus_says_to_use_plus():
    with pytest.raises(
        ConfigError, match=re.escape("so add new entries with '+': +reward_model.reward_kwargs.strict=true")
    ):
        load_config(["reward_model.reward_kwargs.strict=true"])


def test_plus_on_a_schema_key_just_sets_it():
    assert load_config(["+trainer.total_epochs=3"]).trainer.total_epochs == 3


def test_tilde_deletes_entries_and_resets_optional_keys():
    cfg = load_config(
        [
            "+reward_model.reward_kwargs.a=1",
            "+reward_model.reward_kwargs.b=2",
            "~reward_model.reward_kwargs.a",
            "data.val_files=x.parquet",
            "~data.val_files",
        ]
    )
    assert cfg.reward_model.reward_kwargs == {"b": 2}
    assert cfg.data.val_files is None
    with pytest.raises(ConfigError, match=r"cannot delete 'data.train_batch_size': it is a required int"):
        load_config(["~data.train_batch_size"])
    with pytest.raises(ConfigError, match=r"'reward_model.reward_kwargs' has no entry 'zz'"):
        load_config(["~reward_model.reward_kwargs.zz"])


# ------------------------------------------------------------------------------------ YAML file


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_file_then_overrides(tmp_path):
    path = _write(
        tmp_path,
        "data:\n  train_batch_size: 64\n  max_response_length: 128\n"
        "actor_rollout_ref:\n  rollout:\n    n: 8\n  actor:\n    ppo_mini_batch_size: 16\n"
        "trainer:\n  logger: console\nreward_model:\n  reward_kwargs:\n    strict: true\ncritic:\n",
    )
    cfg = load_config(["actor_rollout_ref.rollout.n=4"], config_file=path)
    assert cfg.data.train_batch_size == 64
    assert cfg.actor_rollout_ref.rollout.n == 4  # the command line wins over the file
    assert cfg.actor_rollout_ref.rollout.response_length == 128  # interpolated default sees the file's value
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 16
    assert cfg.trainer.logger == ["console"]
    assert cfg.reward_model.reward_kwargs == {"strict": True}


def test_yaml_typo_at_depth_names_file_and_closest_key(tmp_path):
    path = _write(tmp_path, "actor_rollout_ref:\n  actor:\n    optim:\n      lrr: 1.0e-5\n")
    expected = (
        f"unknown config key 'actor_rollout_ref.actor.optim.lrr' in config file {str(path)!r}. "
        "Did you mean 'actor_rollout_ref.actor.optim.lr'?"
    )
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(config_file=path)


def test_yaml_top_level_typo(tmp_path):
    path = _write(tmp_path, "algoritm:\n  adv_estimator: grpo\n")
    expected = f"unknown config key 'algoritm' in config file {str(path)!r}. Did you mean 'algorithm'?"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(config_file=path)


def test_yaml_type_error_names_key_value_and_file(tmp_path):
    path = _write(tmp_path, "data:\n  train_batch_size: lots\n")
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"type error in config file {str(path)!r}: data.train_batch_size='lots' (a str) is not a valid int"
        ),
    ):
        load_config(config_file=path)


def test_yaml_scalar_for_section_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"'trainer' is a section, not a value in config file"):
        load_config(config_file=_write(tmp_path, "trainer: 3\n"))
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(config_file=tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------- round trip


def test_round_trip_through_yaml_equals(tmp_path):
    cfg = load_config(
        [
            "data.train_batch_size=48",
            "data.train_files=[a.parquet,b.parquet]",
            "actor_rollout_ref.model.path=/models/tiny",
            "actor_rollout_ref.actor.optim.lr=2e-6",
            "+reward_model.reward_kwargs.nested={a:1,b:[x,y]}",
            "algorithm.adv_estimator=grpo",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
            "trainer.logger=[console]",
        ]
    )
    text = config_to_yaml(cfg)
    assert "${" not in text  # resolved
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert config_from_yaml_file(path) == cfg
    assert config_to_dict(cfg)["reward_model"]["reward_kwargs"] == {"nested": {"a": 1, "b": ["x", "y"]}}


@pytest.mark.parametrize("name", ["n", "off", "yes", "null", "007", "1e3", "true", "a: b", "- x", "", "# c"])
def test_config_yaml_keeps_strings_that_yaml_would_read_as_something_else(tmp_path, name):
    cfg = load_config([f"trainer.experiment_name='{name}'"])
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    assert config_from_yaml_file(path).trainer.experiment_name == name


def test_ctrl_c_inside_config_to_yaml_stays_a_keyboard_interrupt():
    """The trainer writes config.yaml at every checkpoint; a Ctrl-C landing at any point of it must surface as
    KeyboardInterrupt (through OmegaConf's node building, ~3 % of them became a ConfigKeyError or were lost)."""
    import gc
    import random
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread")
    cfg = load_config([])

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    rng = random.Random(0)
    outcomes = []
    # no garbage collection meanwhile: an interrupt raised inside a gc callback (hypothesis installs one) is
    # printed and dropped by Python itself, whatever the code under test does
    gc.disable()
    try:
        for _ in range(150):
            try:  # the timer is armed inside the try: it may fire at once
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0005, 0.02))
                for _ in range(100):  # ~20 ms each: the timer always fires inside one of them
                    config_to_yaml(cfg)
                outcomes.append("not interrupted")
            except KeyboardInterrupt:
                outcomes.append("interrupted")
            except Exception as exc:  # what the test looks for
                outcomes.append(f"{type(exc).__name__}: {exc}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
        gc.enable()
    assert set(outcomes) == {"interrupted"}, [o for o in outcomes if o != "interrupted"][:3]


@settings(max_examples=10, deadline=None)
@given(
    batch=st.integers(1, 10**6),
    n=st.integers(1, 64),
    lr=st.floats(1e-9, 1.0, allow_nan=False),
    name=st.text(alphabet="abcxyz_-0123456789", min_size=1, max_size=12),
)
@example(batch=1, n=1, lr=1.0, name="0b_")  # PyYAML reads a plain 0b_ as a binary int and fails: written quoted
def test_overrides_land_and_round_trip(tmp_path_factory, batch, n, lr, name):
    cfg = load_config(
        [
            f"data.train_batch_size={batch}",
            f"actor_rollout_ref.rollout.n={n}",
            f"actor_rollout_ref.actor.optim.lr={lr!r}",
            f"trainer.experiment_name='{name}'",
        ]
    )
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n) == (batch, n)
    assert cfg.actor_rollout_ref.actor.optim.lr == lr
    assert cfg.trainer.experiment_name == name
    path = tmp_path_factory.mktemp("roundtrip") / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    assert config_from_yaml_file(path) == cfg


def test_features_not_built_yet_are_errors_not_surprises():
    from hyflow.config import ConfigError, load_config, validate_config

    cfg = load_config(["reward_model.model.fsdp_config.fsdp_size=1", "trainer.n_gpus_per_node=2",
                       "algorithm.use_pf_ppo=true"])
    with pytest.raises(ConfigError, match=r"reward_model.model.fsdp_config.fsdp_size is not supported "
                                          r"by this hyflow version"):
        validate_config(cfg)


def test_checkpoint_settings_that_cannot_be_honoured_are_errors():
    from hyflow.config import ConfigError, load_config, validate_config

    cfg = load_config(["actor_rollout_ref.actor.checkpoint.save_contents=[optimizer,extras]",
                       "trainer.default_hdfs_dir=hdfs://x/y", "critic.checkpoint.async_save=true",
                       "trainer.checkpoint_format=sharded"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    text = str(info.value)
    assert "actor_rollout_ref.actor.checkpoint.save_contents has unknown part(s) ['extras']" in text
    assert "leaves out 'model'" in text and "add model" in text
    assert "load_contents" in text  # it defaults to save_contents, so it inherits the problem
    assert "trainer.default_hdfs_dir is not supported" in text
    assert "critic.checkpoint.async_save is not supported" in text
    with pytest.raises(ConfigError, match="trainer.checkpoint_format"):
        validate_config(load_config(["trainer.checkpoint_format=shards"]))


def test_gen_batch_size_needs_dynamic_sampling():
    from hyflow.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match=r"data.gen_batch_size=64 differs .* set algorithm.filter_groups.enable=true"):
        validate_config(load_config(["data.gen_batch_size=64", "data.train_batch_size=32"]))
    validate_config(load_config(["data.gen_batch_size=64", "data.train_batch_size=32", "algorithm.filter_groups.enable=true",
                                 "algorithm.filter_groups.metric=acc", "algorithm.adv_estimator=grpo",
                                 "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]))


def test_verl_knobs_that_would_change_results_but_are_not_built_are_errors():
    from hyflow.config import ConfigError, load_config, validate_config

    cfg = load_config(["actor_rollout_ref.rollout.ignore_eos=true", "reward_model.sandbox_fusion.url=http://x:8080",
                       "reward_model.model.fsdp_config.fsdp_size=4", "trainer.n_gpus_per_node=8",
                       "reward_model.model.fsdp_config.offload_policy=true",
                       "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params=1000",
                       "actor_rollout_ref.model.hf_config_path=/models/cfg"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    text = str(info.value)
    for key in ("actor_rollout_ref.rollout.ignore_eos", "reward_model.sandbox_fusion.url",
                "reward_model.model.fsdp_config.fsdp_size", "reward_model.model.fsdp_config.offload_policy",
                "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params", "actor_rollout_ref.model.hf_config_path"):
        assert f"{key} is not supported by this hyflow version yet" in text, key
    # fsdp_size equal to the number of devices is plain FSDP; fewer is hybrid sharding (HSDP), built for the trained
    # roles (tests/parallel/test_expert_parallel.py), with shard groups that must divide the devices
    for size in (8, 4):
        validate_config(load_config([f"actor_rollout_ref.actor.fsdp_config.fsdp_size={size}", "trainer.n_gpus_per_node=8",
                                     "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]))
    with pytest.raises(ConfigError, match=r"fsdp_config.fsdp_size=3 \(hybrid sharding: .* must divide the role's 8 "
                                          r"devices"):
        validate_config(load_config(["actor_rollout_ref.actor.fsdp_config.fsdp_size=3", "trainer.n_gpus_per_node=8",
                                     "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]))
    validate_config(load_config(["trainer.n_gpus_per_node=8", "data.train_batch_size=16",  # Megatron's layout
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                                 "actor_rollout_ref.actor.tensor_parallel_size=2",
                                 "actor_rollout_ref.actor.expert_parallel_size=8"]))
    for extra, problem in ((["actor_rollout_ref.actor.expert_parallel_size=3"], "expert_parallel_size=3 must divide "
                                                                                 "the 8 devices"),
                           (["actor_rollout_ref.actor.expert_parallel_size=2", "actor_rollout_ref.actor.strategy=ddp"],
                            "expert_parallel_size=2 needs actor_rollout_ref.actor.strategy fsdp or fsdp2"),
                           (["critic.tensor_parallel_size=2", "critic.enable=true",
                             "actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "critic.model.fsdp_config.fsdp_size=2",
                             "critic.expert_parallel_size=8"],
                            "critic.expert_parallel_size=8 must divide the 4 devices of an FSDP shard group x "
                            "critic.tensor_parallel_size")):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            validate_config(load_config(["trainer.n_gpus_per_node=8", "data.train_batch_size=16",
                                         "actor_rollout_ref.actor.ppo_mini_batch_size=8", *extra]))


def test_bypass_loss_type_custom_sampler_and_rm_micro_batches():
    from hyflow.config import ConfigError, load_config, validate_config

    cfg = load_config(["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
                       "actor_rollout_ref.rollout.calculate_log_probs=true", "data.sampler.class_path=my_sampler.py",
                       "reward_model.micro_batch_size=8", "reward_model.micro_batch_size_per_gpu=4"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    text = str(info.value)
    assert "algorithm.rollout_correction.loss_type='reinforce' is not supported" in text
    assert "data.sampler.class_path is not supported" in text
    assert "reward_model.micro_batch_size" in text and "reward_model.micro_batch_size_per_gpu" in text


# ------------------------------------------------------------------------ verl 0.10's names and key list


def test_verl_010_reward_names_mean_the_legacy_keys():
    cfg = load_config([
        "reward.reward_manager.name=dapo", "reward.custom_reward_function.path=/r.py",
        "reward.custom_reward_function.name=score", "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
        "reward.num_workers=3", "reward.reward_model.enable=true", "reward.reward_model.model_path=/rm",
        "critic.fsdp.optimizer_offload=true", "reward.sandbox_fusion.max_concurrent=8",
    ])
    assert cfg.reward_model.reward_manager == "dapo"
    assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == ("/r.py", "score")
    assert cfg.reward_model.reward_kwargs == {"overlong_buffer_cfg": {"len": 4}}
    assert cfg.reward_model.num_workers == 3 and cfg.reward_model.enable is True
    assert cfg.reward_model.model.path == "/rm"
    # keys the schema does not hold (hyflow.config.support's table): their values are kept beside the config
    from hyflow.config.support import declared_values

    assert declared_values(cfg) == {"reward_model.sandbox_fusion.max_concurrent": 8}
    assert cfg.critic.model.fsdp_config.optimizer_offload is True  # a schema key (the critic offloads)


def test_both_spellings_agreeing_are_fine_disagreeing_name_both():
    cfg = load_config(["reward.reward_manager.name=dapo", "reward_model.reward_manager=dapo"])
    assert cfg.reward_model.reward_manager == "dapo"
    with pytest.raises(ConfigError) as err:
        load_config(["reward_model.reward_manager=naive", "reward.reward_manager.name=dapo"])
    assert "reward.reward_manager.name=dapo" in str(err.value) and "reward_model.reward_manager=naive" in str(err.value)


def test_verl_010_names_in_a_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("reward:\n  reward_manager:\n    name: prime\n  custom_reward_function:\n    path: /r.py\n"
                    "critic:\n  fsdp:\n    param_offload: true\n")
    cfg = load_config(config_file=path)
    assert cfg.reward_model.reward_manager == "prime" and cfg.custom_reward_function.path == "/r.py"
    assert value_of(cfg, "critic.model.fsdp_config.param_offload") is True
    path.write_text("reward:\n  reward_manager:\n    name: prime\nreward_model:\n  reward_manager: naive\n")
    with pytest.raises(ConfigError, match="reward.reward_manager.name=prime and reward_model.reward_manager=naive"):
        load_config(config_file=path)


def test_every_unknown_key_is_reported_at_once_and_verl_keys_say_so():
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.actor.profiler.rangs=[0]", "actor_rollout_ref.rollout.quantization=fp8",
                     "trainer.use_v1=false", "critic.fsdp.qat.enable=true", "data.train_batch_size=4"])
    text = str(err.value)
    assert text.startswith("4 unknown config keys:")
    assert "'actor_rollout_ref.actor.profiler.rangs'. Did you mean 'actor_rollout_ref.actor.profiler.ranks'?" in text
    for key in ("actor_rollout_ref.rollout.quantization", "trainer.use_v1", "critic.fsdp.qat.enable"):
        assert f"'{key}' is a verl key that hyflow does not support yet" in text


def test_verl_keys_hyflow_now_has_are_accepted():
    cfg = load_config([
        "actor_rollout_ref.actor.profiler.ranks=[0,1]", "actor_rollout_ref.actor.profiler.enable=true",
        "global_profiler.tool=nsys", "actor_rollout_ref.rollout.layered_summon=true",
        "actor_rollout_ref.rollout.multi_stage_wake_up=true", "+trainer.use_legacy_worker_impl=disable",
        "reward_model.use_reward_loop=true", "actor_rollout_ref.model.torch_dtype=bfloat16",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
        "ray_kwargs.ray_init.runtime_env.py_executable=null", "actor_rollout_ref.actor.profiler.finish_hook_cmd=ls",
    ])
    assert cfg.actor_rollout_ref.actor.profiler.ranks == [0, 1]  # the schema's now (docs/profiling.md)
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes == 64
    assert value_of(cfg, "trainer.use_legacy_worker_impl") == "disable"
    assert value_of(cfg, "actor_rollout_ref.actor.profiler.finish_hook_cmd") == "ls"
    # kept beside the schema's keys, not in the resolved config.yaml
    assert "finish_hook_cmd" not in config_to_yaml(cfg) and "use_legacy_worker_impl" not in config_to_yaml(cfg)


def test_verl_keys_list_ships_with_the_package():
    from hyflow.config.verl_compat import is_verl_key, verl_keys

    keys, free = verl_keys("rl")
    assert len(keys) > 800 and "actor_rollout_ref.rollout.engine_kwargs.vllm" in free
    assert is_verl_key("+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space", HyflowConfig)
    assert not is_verl_key("actor_rollout_ref.actor.ppo_mini_batchsize", HyflowConfig)


# ---------------------------------------------------------------------- Hydra's --config-path/--config-name


def test_config_name_with_defaults_list(tmp_path):
    from hyflow.config.loader import config_file_from_hydra_flags

    (tmp_path / "base.yaml").write_text("data:\n  train_batch_size: 8\n  max_prompt_length: 32\n")
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "small.yaml").write_text("ppo_mini_batch_size: 4\n")
    (tmp_path / "exp.yaml").write_text("defaults:\n  - ppo_trainer\n  - base\n  - actor@actor_rollout_ref.actor: small\n"
                                       "  - _self_\ndata:\n  max_prompt_length: 64\n")
    for name in ("exp", "exp.yaml"):
        path = config_file_from_hydra_flags(tmp_path, name)
        cfg = load_config(["data.train_batch_size=16"], config_file=path)
        assert cfg.data.train_batch_size == 16 and cfg.data.max_prompt_length == 64
        assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4


def test_config_name_errors_are_clear(tmp_path):
    from hyflow.config.loader import config_file_from_hydra_flags

    with pytest.raises(ConfigError, match="looks like one of verl's own configs"):
        config_file_from_hydra_flags("config", "ppo_unknown_trainer.yaml")
    assert config_file_from_hydra_flags("config", "ppo_megatron_trainer.yaml") is None  # verl's: no file
    (tmp_path / "exp.yaml").write_text("defaults:\n  - override actor@actor_rollout_ref.actor: dp_actor\n")
    with pytest.raises(ConfigError, match="override"):
        load_config(config_file=tmp_path / "exp.yaml")
    (tmp_path / "exp.yaml").write_text("defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\n")
    with pytest.raises(ConfigError, match="config group of verl's own config tree"):
        load_config(config_file=tmp_path / "exp.yaml")


# ------------------------------------------------------------------------------- SFT: verl's current names


def test_sft_accepts_verl_current_names():
    from hyflow.config.sft_schema import SFTConfig, load_sft_config

    cfg = load_sft_config(["model.path=/m", "engine.param_offload=true", "data.use_dynamic_bsz=true",
                           "data.max_token_len_per_gpu=4096", "trainer.n_gpus_per_node=1",
                           "data.prompt_key=extra_info", "data.prompt_dict_keys=[question]",
                           "data.response_key=extra_info", "data.response_dict_keys=[answer]"])
    assert cfg.model.partial_pretrain == "/m" and value_of(cfg, "engine.param_offload") is True
    assert (cfg.data.prompt_key, cfg.data.response_key) == ("extra_info.question", "extra_info.answer")
    assert cfg.data.prompt_dict_keys is None
    with pytest.raises(ConfigError, match="model.path=/a and model.partial_pretrain=/b"):
        load_config(["model.partial_pretrain=/b", "model.path=/a"], schema=SFTConfig)
    with pytest.raises(ConfigError, match="cannot be split evenly over"):
        load_sft_config(["trainer.n_gpus_per_node=3"])
    with pytest.raises(ConfigError, match="'engine.qat.enable' is a verl key that hyflow does not support yet"):
        load_config(["engine.qat.enable=true"], schema=SFTConfig)


def test_sft_verl_scheduler_and_padding_names():
    from hyflow.config.sft_schema import load_sft_config

    cfg = load_sft_config(["optim.lr_scheduler_type=constant", "model.use_remove_padding=true",
                           "data.pad_mode=right", "data.num_workers=2"])
    assert cfg.optim.lr_scheduler == "constant" and value_of(cfg, "data.pad_mode") == "right"
    with pytest.raises(ConfigError) as err:
        load_sft_config(["engine.tensor_model_parallel_size=2", "optim.min_lr=0.1"])
    assert "'engine.tensor_model_parallel_size' is a verl key" in str(err.value)
    assert "Tensor parallelism" not in str(err.value)  # SFT has no tensor parallelism
    with pytest.raises(ConfigError, match="'engine.tensor_parallel_size' is a verl key that hyflow does not support"):
        load_sft_config(["engine.tensor_parallel_size=2"])
    assert "'optim.min_lr' is a verl key" in str(err.value)


def test_sft_sequence_parallel_size_is_checked():
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.trainer.sft_trainer import sft_batch_arithmetic

    cfg = load_sft_config(["engine.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=4",
                           "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2"])
    assert sft_batch_arithmetic(cfg).samples_per_device == 4  # 8 samples over 2 data-parallel groups of 2 devices
    with pytest.raises(ConfigError, match=r"engine.ulysses_sequence_parallel_size=3 must be >= 1 and divide the 2"):
        load_sft_config(["engine.ulysses_sequence_parallel_size=3", "trainer.n_gpus_per_node=2"])
    with pytest.raises(ConfigError, match=r"needs sequence packing \(model.use_remove_padding=true"):
        load_sft_config(["engine.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2",
                         "model.use_remove_padding=false"])


def test_sft_offload_keys_are_read_and_the_policy_needs_fsdp2_on_several_devices():
    from hyflow.config.roles import fsdp_settings
    from hyflow.config.sft_schema import load_sft_config
    from hyflow.config.support import performance_only_warning

    cfg = load_sft_config(["engine.param_offload=true", "engine.optimizer_offload=true"])
    settings = fsdp_settings(cfg.engine)
    assert settings.param_offload and settings.optimizer_offload and not settings.offload_policy
    assert performance_only_warning(cfg) is None
    with pytest.raises(ConfigError, match=r"engine.offload_policy is not supported .*which SFT has only with "
                                          r"engine.strategy fsdp/fsdp2 on 2 or more devices"):
        load_sft_config(["engine.offload_policy=true"])
    load_sft_config(["engine.offload_policy=true", "trainer.n_gpus_per_node=2"])  # FSDP2 on two devices


def test_verl_010_fsdp_config_role_names():
    cfg = load_config(["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
                       "actor_rollout_ref.ref.fsdp_config.entropy_from_logits_with_chunking=true",
                       "critic.fsdp.ulysses_sequence_parallel_size=2"])
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert value_of(cfg, "actor_rollout_ref.ref.entropy_from_logits_with_chunking") is True
    assert cfg.critic.ulysses_sequence_parallel_size == 2
    with pytest.raises(ConfigError, match="is a verl key that hyflow does not support yet"):
        load_config(["actor_rollout_ref.actor.megatron.qat.enable=true"])


def test_verl_torchtitan_tensor_parallel_sizes_are_hyflows():
    """verl's PyTorch-native FSDP2 + tensor-parallel engine is its torchtitan engine: its tensor_parallel_size of
    each role lands on hyflow's key (the reference's follows the actor's unless given); the section's other keys
    stay verl keys hyflow lacks."""
    cfg = load_config(["actor_rollout_ref.actor.torchtitan.tensor_parallel_size=2",
                       "critic.torchtitan.tensor_parallel_size=4"])
    arr = cfg.actor_rollout_ref
    assert (arr.actor.tensor_parallel_size, arr.ref.tensor_parallel_size, cfg.critic.tensor_parallel_size) == (2, 2, 4)
    cfg = load_config(["actor_rollout_ref.ref.torchtitan.tensor_parallel_size=2"])
    assert (cfg.actor_rollout_ref.actor.tensor_parallel_size, cfg.actor_rollout_ref.ref.tensor_parallel_size) == (1, 2)
    assert load_config([]).critic.tensor_parallel_size == 1
    cfg = load_config(["critic.torchtitan.pipeline_parallel_size=2"])  # and its pipeline size
    assert (cfg.critic.pipeline_parallel_size, cfg.actor_rollout_ref.actor.pipeline_parallel_size) == (2, 1)
    with pytest.raises(ConfigError, match="set the same thing"):
        load_config(["actor_rollout_ref.actor.torchtitan.tensor_parallel_size=2",
                     "actor_rollout_ref.actor.tensor_parallel_size=4"])
    for key in ("actor_rollout_ref.actor.torchtitan.attn_type=flex", "actor_rollout_ref.ref.torchtitan.strategy=fsdp2",
                "critic.torchtitan.context_parallel_size=2", "actor_rollout_ref.actor.torchtitan.data_parallel_size=2"):
        with pytest.raises(ConfigError, match="is a verl key that hyflow does not support yet: remove it"):
            load_config([key])


def test_verl_torchtitan_section_in_a_yaml_file_keeps_its_tensor_parallel_size_only(tmp_path):
    path = _write(tmp_path, "actor_rollout_ref:\n  actor:\n    torchtitan:\n      tensor_parallel_size: 2\n")
    assert load_config([], config_file=path).actor_rollout_ref.actor.tensor_parallel_size == 2
    path = _write(tmp_path, "critic:\n  torchtitan:\n    tensor_parallel_size: 2\n    context_parallel_size: 2\n")
    with pytest.raises(ConfigError, match="'critic.torchtitan' in config file .* is a verl key"):
        load_config([], config_file=path)


def test_verl_megatron_and_veomni_parallel_sizes_are_hyflows():
    """verl's Megatron and VeOmni engines run on hyflow's: their parallel sizes and offload switches land on hyflow's
    keys for every role (hyflow.config.engine_compat); the same thing given two values is an error naming both."""
    cfg = load_config(["model_engine=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                       "actor_rollout_ref.actor.megatron.context_parallel_size=2",
                       "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4",
                       "actor_rollout_ref.ref.megatron.param_offload=true", "critic.megatron.optimizer_offload=true",
                       "critic.megatron.tensor_model_parallel_size=4"])
    arr = cfg.actor_rollout_ref
    assert (arr.actor.tensor_parallel_size, arr.actor.ulysses_sequence_parallel_size,
            arr.actor.expert_parallel_size) == (2, 2, 4)
    assert (arr.ref.tensor_parallel_size, arr.ref.fsdp_config.param_offload) == (2, True)  # ref follows the actor
    assert (cfg.critic.tensor_parallel_size, cfg.critic.model.fsdp_config.optimizer_offload) == (4, True)
    cfg = load_config(["model_engine=veomni", "actor_rollout_ref.actor.veomni.fsdp_size=4",
                       "actor_rollout_ref.actor.veomni.ulysses_parallel_size=2",
                       "actor_rollout_ref.actor.veomni.enable_full_shard=false",
                       "actor_rollout_ref.actor.veomni.enable_fsdp_offload=true"])
    fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    assert (fsdp.fsdp_size, fsdp.reshard_after_forward, fsdp.offload_policy) == (4, False, True)
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    with pytest.raises(ConfigError, match="fsdp_config.param_offload=true and actor_rollout_ref.actor.veomni."
                                          "param_offload=false .* set the same thing"):
        load_config(["actor_rollout_ref.actor.veomni.param_offload=false",
                     "actor_rollout_ref.actor.fsdp_config.param_offload=true"])


VERL_STYLE_CONFIG = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

actor_rollout_ref:
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    ppo_mini_batch_size: 4
reward:
  _target_: verl.workers.config.RewardConfig
  reward_manager:
    _target_: verl.workers.config.reward.RewardManagerConfig
    source: register
    name: dapo
  custom_reward_function:
    path: null
    name: compute_score
data:
  train_batch_size: 8
"""


def test_a_verl_style_config_file(tmp_path):
    from hyflow.config.loader import config_file_from_hydra_flags

    (tmp_path / "my_trainer.yaml").write_text(VERL_STYLE_CONFIG)
    cfg = load_config(["hydra.searchpath=[file://elsewhere]"],
                      config_file=config_file_from_hydra_flags(tmp_path, "my_trainer"))
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4 and cfg.data.train_batch_size == 8
    assert cfg.reward_model.reward_manager == "dapo" and value_of(cfg, "reward_model.reward_loop_source") == "register"
    with pytest.raises(ConfigError, match="Hydra's own runtime"):
        load_config(["hydra.run.dir=/tmp/x"])
    (tmp_path / "bad.yaml").write_text("actor_rollout_ref:\n  actor:\n    _target_: my.Class\n")
    with pytest.raises(ConfigError, match="cannot instantiate another class"):
        load_config(config_file=tmp_path / "bad.yaml")


def test_sft_config_file_on_verls_sft_base(tmp_path):
    from hyflow.config.sft_schema import SFTConfig

    (tmp_path / "sft.yaml").write_text("defaults:\n  - sft_trainer_engine\n  - _self_\nmodel:\n  path: /m\n")
    assert load_config(config_file=tmp_path / "sft.yaml", schema=SFTConfig).model.partial_pretrain == "/m"
    (tmp_path / "sft.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\n")
    with pytest.raises(ConfigError, match="verl's base config of this trainer"):
        load_config(config_file=tmp_path / "sft.yaml", schema=SFTConfig)


# ------------------------------------------------------------------------------------ derived defaults

ASYNC_MODE = ["async_training.mode=one_step_off", "actor_rollout_ref.rollout.calculate_log_probs=true"]
BYPASS_NOTE = ("hyflow: async_training.mode=one_step_off: off-policy correction algorithm.rollout_correction."
               "bypass_mode=true: pi_old = the rollout's per-token log-probs (async_training.off_policy_correction="
               "bypass; bypass, decoupled or off)")


def test_an_asynchronous_mode_gets_its_off_policy_correction_when_the_config_is_built():
    from hyflow.config.loader import derived_default_notes

    cfg = load_config(ASYNC_MODE)
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    assert "bypass_mode: true" in config_to_yaml(cfg)  # config.yaml says what runs
    assert derived_default_notes(cfg) == [BYPASS_NOTE]
    decoupled = load_config([*ASYNC_MODE, "async_training.off_policy_correction=decoupled"])
    rc = decoupled.algorithm.rollout_correction
    assert (rc.rollout_is, rc.bypass_mode) == ("token", False)
    assert derived_default_notes(decoupled) == [
        "hyflow: async_training.mode=one_step_off: off-policy correction algorithm.rollout_correction.rollout_is="
        f"token at threshold {rc.rollout_is_threshold:g}, pi_old recomputed (async_training.off_policy_correction="
        "decoupled; bypass, decoupled or off)"]
    for untouched in ([], [*ASYNC_MODE, "async_training.off_policy_correction=off"],
                      [*ASYNC_MODE, "algorithm.rollout_correction.rollout_rs=token_k1"]):
        cfg = load_config(untouched)
        assert not cfg.algorithm.rollout_correction.bypass_mode and derived_default_notes(cfg) == []


def test_validate_config_applies_the_derived_defaults_to_a_config_built_in_code_once():
    from hyflow.config import validate_config
    from hyflow.config.loader import derived_default_notes

    cfg = HyflowConfig()
    cfg.async_training.mode = "one_step_off"
    cfg.actor_rollout_ref.rollout.calculate_log_probs = True
    validate_config(cfg)
    validate_config(cfg)
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    assert derived_default_notes(cfg) == [BYPASS_NOTE]


# ------------------------------------------------------------------ keys the schema does not hold (the table's)


def test_a_verl_yaml_setting_keys_hyflow_does_not_act_on_loads_and_config_yaml_omits_them(tmp_path):
    from hyflow.config import support, validate_config

    path = tmp_path / "verl.yaml"
    path.write_text(
        "global_profiler:\n  tool: null\n  steps: null\n  save_path: outputs/profile\n  relocate_results: false\n"
        "actor_rollout_ref:\n  actor:\n    fsdp_config:\n      forward_prefetch: false\n      dtype: bfloat16\n"
        "      wrap_policy:\n        min_num_params: 0\n"
        "    profiler:\n      enable: ${actor_rollout_ref.ref.profiler.enable}\n"
        "      finish_hook_cmd: ${actor_rollout_ref.ref.profiler.finish_hook_cmd}\n"
        "  ref:\n    profiler:\n      enable: true\n      finish_hook_cmd: ls\n  rollout:\n    profiler:\n"
        "data:\n  dataloader_num_workers: 8\n  train_batch_size: 512\n")
    cfg = load_config(config_file=path)
    assert cfg.data.train_batch_size == 512 and cfg.actor_rollout_ref.actor.fsdp_config.dtype == "bfloat16"
    assert cfg.actor_rollout_ref.actor.profiler.enable is True  # a schema key's interpolation resolved
    declared = support.declared_values(cfg)
    assert declared["actor_rollout_ref.actor.profiler.finish_hook_cmd"] == "ls"  # and one beside the schema's
    assert declared["global_profiler.relocate_results"] is False
    validate_config(cfg)
    line = support.performance_only_warning(cfg)  # only the values other than verl's defaults are named
    assert ("actor_rollout_ref.actor.profiler.finish_hook_cmd=ls" in line
            and "actor_rollout_ref.ref.profiler.finish_hook_cmd=ls" in line)
    assert "forward_prefetch" not in line and "global_profiler" not in line and "dataloader_num_workers" not in line
    saved = config_to_yaml(cfg)
    assert "finish_hook_cmd" not in saved and "forward_prefetch" not in saved  # config.yaml holds the schema's keys
    assert "profiler:" in saved  # the profiler sections are the schema's
    (tmp_path / "config.yaml").write_text(saved)
    assert config_from_yaml_file(tmp_path / "config.yaml").data.train_batch_size == 512
    path.write_text("global_profiler:\n  tol: nsys\n")
    with pytest.raises(ConfigError, match="'global_profiler.tol' in config file .*Did you mean 'global_profiler.tool'"):
        load_config(config_file=path)


def test_a_key_the_schema_does_not_hold_is_refused_by_its_entry_when_asked():
    from hyflow.config import validate_config

    validate_config(load_config(["trainer.default_hdfs_dir=null", "~trainer.default_hdfs_dir"]))
    with pytest.raises(ConfigError, match=r"trainer.default_hdfs_dir is not supported by this hyflow version yet "
                                          r"\(got hdfs://x\): HDFS copies are not built yet"):
        validate_config(load_config(["trainer.default_hdfs_dir=hdfs://x"]))


@pytest.mark.parametrize("override, suggestion", [
    ("actor_rollout_ref.actor.profilr.enable=true", "actor_rollout_ref.actor.profiler.enable"),
    ("actor_rollout_ref.actor.profiler={enable: true, finish_hook_cmb: ls}",
     "actor_rollout_ref.actor.profiler.finish_hook_cmd"),
    ("data.dataloader_num_worker=2", "data.dataloader_num_workers"),
    ("data.train_batch_sise=3", "data.train_batch_size"),  # a schema key still wins when it is closer
])
def test_a_misspelt_key_the_table_accepts_gets_the_closest_name(override, suggestion):
    with pytest.raises(ConfigError, match=rf"Did you mean '{re.escape(suggestion)}'\?"):
        load_config([override])


@pytest.mark.parametrize("key", ["critic.strategy", "actor_rollout_ref.ref.strategy", "reward_model.strategy"])
def test_the_other_roles_strategies_are_checked_too(key):
    """A strategy that names no engine is an error for every role, not a silent fsdp run; verl's other engines'
    names are accepted (they run on hyflow's FSDP2 engine)."""
    from hyflow.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=rf"{key}='deepspeed' is not one of: fsdp, fsdp2, ddp, megatron, veomni, "
                                          "torchtitan"):
        validate_config(load_config([f"{key}=deepspeed"]))
    validate_config(load_config([f"{key}=megatron"]))


def test_an_invalid_actor_strategy_is_said_once_not_by_every_role_that_follows_it():
    from hyflow.config import ConfigError, validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(load_config(["actor_rollout_ref.actor.strategy=deepspeed"]))
    text = str(err.value)
    assert text.count("is not one of: fsdp, fsdp2, ddp") == 1 and "actor_rollout_ref.actor.strategy=" in text
