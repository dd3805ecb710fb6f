"""Human-readable views of a config: the batch arithmetic in words with units, the role specs, and the config
with its help.

`describe_batch_arithmetic` is what the trainer prints at start and `hyflow config` shows: prompts, samples and
tokens per step, per mini-batch, per device and per micro-batch, each number followed by the keys it comes
from. `describe_role_specs` lists what each role's worker is built from. `render_config` prints the resolved
config as YAML with every leaf's help text as a trailing comment (valid YAML: loading it gives
`config_to_dict(cfg)`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hyflow.config.arithmetic import (
    BatchArithmetic,
    ForwardBatches,
    RoleBatches,
    batch_arithmetic,
    prm_batches,
    uses_prm,
)
from hyflow.config.keys import format_value
from hyflow.config.schema import HyflowConfig
from hyflow.specs import RoleSpecs, SFTBatches

R = "actor_rollout_ref.rollout"
SKIPPED_SPEC_TYPES = (BatchArithmetic, RoleBatches, ForwardBatches, SFTBatches)  # printed in words instead

LOSS_AGG_WORDS = {
    "token-mean": "token-mean: the summed per-token loss of a mini-batch is divided by its response-token count over "
    "all devices",
    "token-sum": "token-sum: the per-token loss summed over the mini-batch's response tokens on all devices (no "
    "normaliser)",
    "seq-mean-token-sum": "seq-mean-token-sum: each sample's summed token loss, averaged over the mini-batch's "
    "samples on all devices",
    "seq-mean-token-mean": "seq-mean-token-mean: each sample's mean token loss, averaged over the mini-batch's "
    "samples on all devices",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm: each sample's summed token loss divided by a constant "
    "(loss_scale_factor, default the response length), averaged over the mini-batch's samples on all devices",
}


def describe_batch_arithmetic(cfg: HyflowConfig, n_devices: int | None = None,
                              batches: BatchArithmetic | None = None) -> str:
    """The step's batch sizes in words with units: prompts x samples per step, optimizer steps, samples per
    device and micro-batches (or token budgets with use_dynamic_bsz) for actor, log-probs, reference and critic.

    `batches`: the `batch_arithmetic(cfg, n_devices)` object the workers receive (derived here when None)."""
    b = batches if batches is not None else batch_arithmetic(cfg, n_devices)
    actor = cfg.actor_rollout_ref.actor
    source = (
        f"trainer.nnodes {cfg.trainer.nnodes} x trainer.n_gpus_per_node {cfg.trainer.n_gpus_per_node}"
        if n_devices is None
        else "given"
    )
    lines = [
        f"Batch arithmetic on {b.n_devices} device{'s' if b.n_devices != 1 else ''} ({source}):",
        f"Each step: {b.prompts_per_step} prompts x {_count(b.samples_per_prompt, 'sample')} = {b.samples_per_step} samples "
        f"(data.train_batch_size x {R}.n); a sample is at most {b.max_sequence_tokens} tokens "
        f"({b.max_prompt_tokens} prompt + {b.max_response_tokens} response: {R}.prompt_length + {R}.response_length), "
        f"so a step holds at most {b.samples_per_step * b.max_sequence_tokens:,} tokens.",
        _rollout_line(cfg, b),
        "Actor: " + _role_line(b.actor, "actor_rollout_ref.actor", cfg.actor_rollout_ref.actor, b),
        _forward_line(
            "Old log-probs (actor forward)",
            b.old_log_prob,
            b.actor.dp_size,
            _micro_source(R, cfg.actor_rollout_ref.rollout, "log_prob_micro_batch_size", "the actor's micro-batch size"),
            f"{R}.log_prob_max_token_len_per_gpu",
            b,
        ),
    ]
    if b.ref_log_prob is not None:
        lines.append(
            _forward_line(
                "Reference log-probs",
                b.ref_log_prob,
                b.actor.dp_size,
                _micro_source(
                    "actor_rollout_ref.ref",
                    cfg.actor_rollout_ref.ref,
                    "log_prob_micro_batch_size",
                    "the old log-probs' size",
                ),
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                b,
            )
        )
    if b.critic is not None and b.critic_values is not None:
        lines.append("Critic: " + _role_line(b.critic, "critic", cfg.critic, b))
        lines.append(
            _forward_line(
                "Critic values (forward)",
                b.critic_values,
                b.critic.dp_size,
                _micro_source(
                    "critic", cfg.critic, "forward_micro_batch_size", "the critic's micro-batch size"
                ),
                "critic.forward_max_token_len_per_gpu",
                b,
            )
        )
    if uses_prm(cfg):
        lines.append(_prm_line(cfg, n_devices))
    offload = _offload_line(cfg, with_ref=b.ref_log_prob is not None, with_critic=b.critic is not None)
    if offload:
        lines.append(offload)
    words = LOSS_AGG_WORDS.get(actor.loss_agg_mode, actor.loss_agg_mode)
    lines.append(
        f"Loss (actor_rollout_ref.actor.loss_agg_mode) {words}, so gradients do not depend on micro-batch "
        "or device count."
    )
    lines.append(_length_line(cfg))
    return "\n".join(lines)


def render_config(cfg: HyflowConfig, with_help: bool = True, section: str | None = None) -> str:
    """The resolved config as YAML, one key per line, each followed by `# help text` when `with_help`.

    `section` (a dotted key such as `actor_rollout_ref.actor` or `data.train_batch_size`) renders only that
    section or leaf, under its full dotted name; a key that names nothing is a ConfigError naming the closest one.
    """
    lines: list[str] = []
    if not section:
        _render_section(cfg, 0, with_help, lines)
        return "\n".join(lines) + "\n"
    from hyflow.config.keys import lookup
    from hyflow.config.verl_compat import canonical_key

    info = lookup(canonical_key(section, type(cfg)), schema=type(cfg))
    *parents, name = info.field_path.split(".")
    parent = cfg
    for part in parents:
        parent = getattr(parent, part)
    field = next(f for f in dataclasses.fields(parent) if f.name == name)
    value = getattr(parent, name)
    comment = f"  # {field.metadata['help']}" if with_help and field.metadata.get("help") else ""
    if info.kind == "section":
        lines.append(f"{info.field_path}:{comment}")
        _render_section(value, 1, with_help, lines)
    else:
        lines.append(f"{info.field_path}: {format_value(value)}{comment}")
    return "\n".join(lines) + "\n"


def describe_role_specs(specs: RoleSpecs, *, total_steps_known: bool = True, **more: Any) -> str:
    """What each role's worker is built from (`hyflow.config.roles.role_specs`), one `role.field: value` line per
    setting: the actor (with its reference and loss), the critic, the rollout, and the specs passed in `more`
    (e.g. `reward_model=`). The batch sizes are the arithmetic printed above, and the rollout section is the
    config's `actor_rollout_ref.rollout`, so neither is repeated. `total_steps_known=False`: the LR schedules'
    `total_optimizer_steps` count one training step (the run multiplies them by its number of steps)."""
    lines = ["Role specs (what each worker is built from; the batch sizes are the arithmetic above):"]
    if not total_steps_known:
        lines.append("(trainer.total_training_steps is unset: engine.total_optimizer_steps below count one training "
                     "step; the run multiplies them by its steps)")
    roles = {"actor": specs.actor, "critic": specs.critic, "rollout": specs.rollout, **more}
    for role, spec in roles.items():
        if spec is not None:
            _spec_lines(spec, role, lines)
    return "\n".join(lines)


def _spec_lines(node: Any, key: str, lines: list[str]) -> None:
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if f.name == "section" or isinstance(value, SKIPPED_SPEC_TYPES) or (f.name == "rollout" and key == "actor"):
            continue  # printed above (the rollout section, the batch arithmetic) or under its own role
        if dataclasses.is_dataclass(value):
            _spec_lines(value, f"{key}.{f.name}", lines)
        else:
            lines.append(f"  {key}.{f.name}: {format_value(list(value) if isinstance(value, tuple) else value)}")


# ---------------------------------------------------------------------------------------- lines


def _offload_line(cfg: HyflowConfig, *, with_ref: bool, with_critic: bool) -> str:
    """Where each offloading role keeps its parameters and optimizer state (its fsdp_config's param_offload,
    optimizer_offload, offload_policy); empty when no role offloads."""
    roles = [("actor", "actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.fsdp_config, True)]
    if with_ref:
        roles.append(("reference", "actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.fsdp_config, False))
    if with_critic:
        roles.append(("critic", "critic.model", cfg.critic.model.fsdp_config, True))
    parts = []
    for name, key, fsdp, has_optimizer in roles:
        if fsdp.offload_policy:
            parts.append(f"{name} under FSDP2's CPUOffloadPolicy: shards, gradients and the optimizer step in host "
                         f"memory, each layer copied to the device for its forward and backward "
                         f"({key}.fsdp_config.offload_policy)")
            continue
        where = []
        if fsdp.param_offload:
            where.append("parameters in host memory between uses, on the device for each forward and update, weight "
                         "sync and checkpoint" + (", on the host while the rollout generates" if name == "actor" else "")
                         + f" ({key}.fsdp_config.param_offload)")
        if fsdp.optimizer_offload:
            where.append(f"optimizer state in host memory between updates ({key}.fsdp_config.optimizer_offload)"
                         if has_optimizer else
                         f"nothing for {key}.fsdp_config.optimizer_offload to move (it has no optimizer)")
        if where:
            parts.append(f"{name}: " + "; ".join(where))
    if not parts:
        return ""
    same_memory = (" On trainer.device=cpu host and device are the same memory: each move is a copy, for testing."
                   if cfg.trainer.device == "cpu" else "")
    return "Offload: " + ". ".join(parts) + "." + same_memory


def _rollout_line(cfg: HyflowConfig, b: BatchArithmetic) -> str:
    rollout = cfg.actor_rollout_ref.rollout
    val = rollout.val_kwargs
    val_mode = f"sampled at temperature {val.temperature}" if val.do_sample else "greedy"
    return (
        f"Rollout ({R}.name={rollout.name}): {b.samples_per_step} samples per step, "
        f"{_num(b.samples_per_step / b.actor.dp_size)} per device, each up to {b.max_response_tokens} new tokens "
        f"at temperature {rollout.temperature}; validation: {val.n} sample{'s' if val.n != 1 else ''} per prompt "
        f"({R}.val_kwargs.n), {val_mode}."
    )


def _prm_line(cfg: HyflowConfig, n_devices: int | None) -> str:
    """PRIME's implicit PRM: its optimizer steps per step (mini-batches of samples) and micro-batches."""
    update, _ = prm_batches(cfg, n_devices)
    key = "reward_model.mini_batch_size" if cfg.reward_model.mini_batch_size else (
        "reward_model.mini_batch_size unset: actor_rollout_ref.actor.ppo_mini_batch_size, counted in samples as in "
        "verl-recipe prime")
    micro = ("packed by reward_model.forward_max_token_len_per_gpu (use_dynamic_bsz)" if update.use_dynamic_bsz else
             f"in {_count(update.micro_batches, 'micro-batch')} of {_num(update.micro_batch_size_per_device)} samples "
             "(reward_model.micro_batch_size_per_gpu)")
    return (f"PRIME implicit PRM (reward_model.model.update={cfg.reward_model.model.update}): "
            f"{_count(update.optimizer_steps, 'optimizer step')} per step (mini-batches of "
            f"{update.mini_batch_samples} samples; {key}); per device {_num(update.samples_per_device)} samples per "
            f"mini-batch, {micro}; then one scoring pass, and the frozen reference's forward once.")


def _role_line(role: RoleBatches, key: str, knobs: Any, b: BatchArithmetic) -> str:
    dp = role.dp_size
    head = (
        f"{_count(role.optimizer_steps, 'optimizer step')} per step (ppo_epochs {role.ppo_epochs} x "
        f"{b.prompts_per_step}/{role.mini_batch_prompts} = {_count(role.mini_batches_per_epoch, 'mini-batch')} of "
        f"{role.mini_batch_prompts} prompts = {role.mini_batch_samples} samples; {key}.ppo_mini_batch_size); "
        f"per device: {role.mini_batch_samples} samples per mini-batch / {_dp_words(dp, knobs)} = "
        f"{_num(role.samples_per_device)} samples"
    )
    if role.use_dynamic_bsz:
        return head + (
            f", packed into micro-batches of at most {role.max_token_len_per_device} tokens "
            f"({key}.ppo_max_token_len_per_gpu, use_dynamic_bsz); the longest sample is {b.max_sequence_tokens} "
            f"tokens (prompt + response){_budget_warning(role.max_token_len_per_device, b)}, so at most "
            f"{role.max_micro_batches} micro-batches per device per mini-batch."
        )
    return head + (
        f", in {_count(role.micro_batches, 'micro-batch')} of {_num(role.micro_batch_size_per_device)} samples "
        f"({_micro_source(key, knobs)}) = {_count(role.micro_batches, 'gradient-accumulation step')}."
    )


def _dp_words(dp: int, knobs: Any) -> str:
    """`N devices`, or with Ulysses sequence parallelism or tensor parallelism `N data-parallel groups of S devices
    (...)`."""
    sp = max(int(getattr(knobs, "ulysses_sequence_parallel_size", 1) or 1), 1)
    tp = max(int(getattr(knobs, "tensor_parallel_size", 1) or 1), 1)
    if sp == tp == 1:
        return f"{dp} device{'s' if dp != 1 else ''}"
    parts = []
    if sp > 1:
        parts.append(f"ulysses_sequence_parallel_size {sp}")
    if tp > 1:
        parts.append(f"tensor_parallel_size {tp}")
    each = [f"runs 1/{sp} of every sequence"] if sp > 1 else []
    each += [f"holds 1/{tp} of every layer's attention heads and MLP"] if tp > 1 else []
    return (f"{dp} data-parallel group{'s' if dp != 1 else ''} of {sp * tp} devices ({' x '.join(parts)}: a "
            f"group's devices share its samples, each {' and '.join(each)})")


def _forward_line(
    name: str, fwd: ForwardBatches, dp: int, micro_source: str, budget_key: str, b: BatchArithmetic
) -> str:
    per_device = fwd.samples_per_device  # whole in a valid config: the update's mini-batches split evenly
    head = (f"{name}: {b.samples_per_step} samples / {dp} device{'s' if dp != 1 else ''} = "
            f"{_num(per_device)} samples per device")
    if fwd.use_dynamic_bsz:
        return head + (
            f", in micro-batches of at most {fwd.max_token_len_per_device} tokens ({budget_key})"
            f"{_budget_warning(fwd.max_token_len_per_device, b)}."
        )
    micro = fwd.micro_batch_size_per_device
    if not (_whole(per_device) and _whole(micro) and micro > 0) or per_device % micro == 0:  # no short last pass
        return head + f", in {_count(fwd.micro_batches, 'forward pass')} of {_count(micro, 'sample')} ({micro_source})."
    passes = math.ceil(per_device / micro)  # consecutive rows, micro each; the last pass takes the rest
    return head + (f", in {passes} forward passes of {int(micro)} samples ({micro_source}), the last of "
                   f"{int(per_device - (passes - 1) * micro)}.")


def _whole(value: float | None) -> bool:
    return value is not None and value == value and float(value).is_integer()


def _length_line(cfg: HyflowConfig) -> str:
    t = cfg.trainer
    if t.total_training_steps is not None:
        return f"Length: {t.total_training_steps} steps (trainer.total_training_steps)."
    return (
        f"Length: trainer.total_epochs {t.total_epochs} epochs x (training prompts / {cfg.data.train_batch_size}) "
        "steps per epoch (set trainer.total_training_steps to fix the number of steps)."
    )


def _micro_source(
    key: str, knobs: Any, knob: str = "ppo_micro_batch_size", unset: str = "the whole per-device mini-batch"
) -> str:
    """Which knob sets a micro-batch size: `<key>.<knob>_per_gpu`, else the deprecated global `<key>.<knob>` /
    devices, else neither (`unset` says what is used then)."""
    if getattr(knobs, f"{knob}_per_gpu") is not None:
        return f"{key}.{knob}_per_gpu"
    if getattr(knobs, knob) is not None:
        return f"{key}.{knob} / devices"
    return f"{key}.{knob}_per_gpu unset: {unset}"


def _budget_warning(budget: int | None, b: BatchArithmetic) -> str:
    if budget is not None and budget < b.max_sequence_tokens:
        return f" (TOO SMALL: the budget {budget} is below the longest sample {b.max_sequence_tokens})"
    return ""


def _count(value: float | None, noun: str) -> str:
    """`2 mini-batches`, `1 micro-batch`: a number and its noun, plural unless exactly one."""
    if value == 1:
        return f"1 {noun}"
    plural = noun + ("es" if noun.endswith(("s", "ch")) else "s")
    return f"{_num(value)} {plural}"


def _num(value: float | None) -> str:
    """An int as is; a quotient that does not divide evenly with two decimals and a warning."""
    if value is None or value != value:  # None, or NaN from a division by zero
        return "? (division by zero: validate_config rejects this)"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.2f} (not a whole number: validate_config rejects this)"


# --------------------------------------------------------------------------------------- render


def _render_section(node: Any, depth: int, with_help: bool, lines: list[str]) -> None:
    indent = "  " * depth
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        comment = f"  # {f.metadata['help']}" if with_help and f.metadata.get("help") else ""
        if dataclasses.is_dataclass(value):
            lines.append(f"{indent}{f.name}:{comment}")
            _render_section(value, depth + 1, with_help, lines)
        else:
            lines.append(f"{indent}{f.name}: {format_value(value)}{comment}")
