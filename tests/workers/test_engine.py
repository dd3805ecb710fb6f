"""The training engine's optimizer construction from the config (verl's optim.optimizer / optimizer_impl)."""

import pytest
import torch

from hyflow.config import load_config
from hyflow.workers.engine import build_optimizer


def optim_of(*overrides: str):
    keys = [f"+actor_rollout_ref.actor.optim.{o[1:]}" if o.startswith("+") else f"actor_rollout_ref.actor.optim.{o}"
            for o in overrides]
    return load_config(keys).actor_rollout_ref.actor.optim


def params():
    return torch.nn.Linear(3, 2).parameters()


def test_default_is_adamw_with_the_configured_hyperparameters():
    opt = build_optimizer(params(), optim_of("lr=0.01", "betas=[0.8,0.9]", "weight_decay=0.1"))
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.01, (0.8, 0.9), 0.1)


def test_any_optimizer_class_with_extra_keywords():
    opt = build_optimizer(params(), optim_of("optimizer=SGD", "lr=0.1", "+override_optimizer_config.momentum=0.9"))
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["momentum"] == 0.9  # SGD takes no betas


def test_unknown_optimizer_or_module_names_the_fix():
    with pytest.raises(ValueError, match=r"optim.optimizer='AdamWW' is not an optimizer class in torch.optim\. "
                                         r"Did you mean 'AdamW'\?"):
        build_optimizer(params(), optim_of("optimizer=AdamWW"))
    with pytest.raises(ValueError, match=r"optim.optimizer_impl='no_such_pkg.optim' cannot be imported"):
        build_optimizer(params(), optim_of("optimizer_impl=no_such_pkg.optim"))


def test_the_sft_optim_section_builds_the_same_way():
    from hyflow.config.sft_schema import load_sft_config

    optim = load_sft_config(["optim.optimizer=SGD", "optim.lr=0.5", "+optim.override_optimizer_config.nesterov=true",
                             "+optim.override_optimizer_config.momentum=0.5"]).optim
    opt = build_optimizer(params(), optim)
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["nesterov"] is True
