"""hyflow's configuration: one typed schema (verl's key names), composed from defaults, a YAML file and
Hydra-style command-line overrides, then validated and explained in words.

    cfg = load_config(["data.train_batch_size=32", "actor_rollout_ref.rollout.n=4"], config_file="run.yaml")
    validate_config(cfg)                      # ConfigError naming keys, values and the fix
    print(describe_batch_arithmetic(cfg))     # prompts, samples, tokens per step / mini-batch / device
    print(render_config(cfg))                 # resolved YAML, every key with its help text
"""

from hyflow.config.arithmetic import (
    BatchArithmetic,
    ForwardBatches,
    RoleBatches,
    batch_arithmetic,
    total_devices,
    uses_critic,
    uses_reference,
)
from hyflow.config.describe import describe_batch_arithmetic, render_config
from hyflow.config.keys import ConfigError
from hyflow.config.loader import config_from_yaml_file, config_to_dict, config_to_yaml, load_config
from hyflow.config.schema import HyflowConfig
from hyflow.config.validate import validate_config

__all__ = [
    "BatchArithmetic",
    "ConfigError",
    "ForwardBatches",
    "HyflowConfig",
    "RoleBatches",
    "batch_arithmetic",
    "config_from_yaml_file",
    "config_to_dict",
    "config_to_yaml",
    "describe_batch_arithmetic",
    "load_config",
    "render_config",
    "total_devices",
    "uses_critic",
    "uses_reference",
    "validate_config",
]
