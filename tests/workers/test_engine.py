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


def test_sequence_parallel_groups_get_their_devices_token_budget_times_the_group():
    """verl's dp_actor: with Ulysses over S devices each holds 1/S of a micro-batch's tokens, so a group's budget
    is S times the per-device token budget (fewer, larger micro-batches; the same loss: it is normalised over the
    whole mini-batch)."""
    import torch

    from hyflow.batch import Batch
    from hyflow.specs import ForwardBatches
    from hyflow.workers.engine import micro_batches_as_derived

    mask = torch.ones(8, 10, dtype=torch.long)
    batch = Batch({"input_ids": torch.ones(8, 10, dtype=torch.long), "attention_mask": mask,
                   "responses": torch.ones(8, 4, dtype=torch.long), "response_mask": mask[:, -4:]})
    sizes = ForwardBatches(samples_per_device=8, use_dynamic_bsz=True, micro_batch_size_per_device=None,
                           micro_batches=None, max_token_len_per_device=20)
    assert len(micro_batches_as_derived(batch, sizes)) == 4  # 2 rows of 10 tokens per 20-token budget
    assert len(micro_batches_as_derived(batch, sizes, token_scale=2)) == 2
