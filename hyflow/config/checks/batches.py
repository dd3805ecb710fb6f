"""Batch sizes (verl's rules, with P = data.train_batch_size prompts, n = rollout.n, M = ppo_mini_batch_size
prompts, D = data-parallel devices):
    M <= P,  P % M == 0,  (P * n) % D == 0 and (M * n) % D == 0 unless use_dynamic_bsz,
    (M * n / D) % ppo_micro_batch_size_per_gpu == 0,
    with use_dynamic_bsz: ppo_max_token_len_per_gpu x ulysses_sequence_parallel_size >= prompt_length +
    response_length;
and a deprecated global micro-batch size never beside its per-GPU twin."""

from __future__ import annotations

from typing import Any

from hyflow.config.arithmetic import (
    data_parallel_size,
    has_own_pool,
    micro_per_device,
    role_devices,
    role_pool_shape,
    total_devices,
    uses_critic,
    uses_reference,
)
from hyflow.config.checks import ACTOR, ROLLOUT, check
from hyflow.config.checks.parallelism import device_problems
from hyflow.config.schema import HyflowConfig


@check(210, devices=True)
def role_batches(cfg: HyflowConfig, n_devices: int | None) -> list[str]:
    """The actor's batch sizes, and the critic's when there is one, on the devices `device_problems` accepts."""
    if device_problems(cfg, n_devices):
        return []  # reported by device_problems: no device count to divide
    problems = _check_actor_batches(cfg, total_devices(cfg, n_devices))
    if uses_critic(cfg):
        # The critic's sizes default to the actor's: report a shared problem once, under the actor's keys.
        seen = set(problems)
        critic_problems = _check_critic_batches(cfg, role_devices(cfg, "critic", n_devices))
        problems += [p for p in critic_problems if p.replace("critic.", f"{ACTOR}.") not in seen]
    return problems


@check(710)
def reward_model_batches(cfg: HyflowConfig) -> list[str]:
    """The reward model's micro-batch size: the deprecated global one or the per-GPU one."""
    return _check_exclusive("reward_model.micro_batch_size", cfg.reward_model.micro_batch_size,
                            cfg.reward_model.micro_batch_size_per_gpu)


def _check_actor_batches(cfg: HyflowConfig, devices: int) -> list[str]:
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    dp = data_parallel_size(actor, devices)
    problems = _check_positive(
        {
            "data.train_batch_size": cfg.data.train_batch_size,
            f"{ROLLOUT}.n": rollout.n,
            f"{ACTOR}.ppo_mini_batch_size": actor.ppo_mini_batch_size,
            f"{ACTOR}.ppo_epochs": actor.ppo_epochs,
            "data.max_prompt_length": cfg.data.max_prompt_length,
            "data.max_response_length": cfg.data.max_response_length,
        }
    )
    if problems:
        return problems
    problems += _check_role_batches(cfg, ACTOR, actor, devices, dp)
    problems += _check_exclusive(
        f"{ROLLOUT}.log_prob_micro_batch_size",
        rollout.log_prob_micro_batch_size,
        rollout.log_prob_micro_batch_size_per_gpu,
    )
    problems += _check_exclusive(
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        cfg.actor_rollout_ref.ref.log_prob_micro_batch_size,
        cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
    )
    if rollout.log_prob_use_dynamic_bsz:
        problems += _check_token_budget(
            cfg, f"{ROLLOUT}.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu,
            actor.ulysses_sequence_parallel_size)
    ref = cfg.actor_rollout_ref.ref
    if uses_reference(cfg) and ref.log_prob_use_dynamic_bsz:
        problems += _check_token_budget(
            cfg, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu,
            ref.ulysses_sequence_parallel_size)
    return problems


def _check_critic_batches(cfg: HyflowConfig, devices: int) -> list[str]:
    critic = cfg.critic
    problems = _check_positive(
        {"critic.ppo_mini_batch_size": critic.ppo_mini_batch_size, "critic.ppo_epochs": critic.ppo_epochs}
    )
    if problems:
        return problems
    problems += _check_role_batches(
        cfg, "critic", critic, devices, data_parallel_size(critic, devices)
    )
    problems += _check_exclusive(
        "critic.forward_micro_batch_size",
        critic.forward_micro_batch_size,
        critic.forward_micro_batch_size_per_gpu,
    )
    if critic.use_dynamic_bsz:
        problems += _check_token_budget(
            cfg, "critic.forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu,
            critic.ulysses_sequence_parallel_size)
    return problems


def _check_role_batches(cfg: HyflowConfig, role: str, knobs: Any, devices: int, dp: int) -> list[str]:
    """The mini/micro-batch rules for the actor or critic (`knobs` is its config section)."""
    prompts, n, mini = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, knobs.ppo_mini_batch_size
    where = _devices_words(cfg, devices, dp, role)
    if mini > prompts:
        return [
            f"{role}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={prompts} (both in prompts): "
            f"a step cannot fill one mini-batch. Set {role}.ppo_mini_batch_size to a divisor of {prompts} "
            f"(e.g. {_divisors_near(prompts, mini)}) or raise data.train_batch_size."
        ]
    problems = []
    if prompts % mini:
        problems.append(
            f"data.train_batch_size={prompts} is not divisible by {role}.ppo_mini_batch_size={mini} (prompts): "
            f"each step must split into whole mini-batches. Set {role}.ppo_mini_batch_size to a divisor of "
            f"{prompts} (e.g. {_divisors_near(prompts, mini)}) or make data.train_batch_size a multiple of {mini}."
        )
    if not knobs.use_dynamic_bsz:
        if (prompts * n) % dp:
            problems.append(
                f"data.train_batch_size x {ROLLOUT}.n = {prompts} x {n} = {prompts * n} samples per step do not split "
                f"evenly over {where}. Make data.train_batch_size x {ROLLOUT}.n a multiple of {dp}, or set "
                f"{role}.use_dynamic_bsz=true."
            )
        elif (mini * n) % dp:
            problems.append(
                f"{role}.ppo_mini_batch_size x {ROLLOUT}.n = {mini} x {n} = {mini * n} samples per mini-batch do not "
                f"split evenly over {where}. Make {role}.ppo_mini_batch_size x {ROLLOUT}.n a multiple of {dp}."
            )
    problems += _check_exclusive(
        f"{role}.ppo_micro_batch_size", knobs.ppo_micro_batch_size, knobs.ppo_micro_batch_size_per_gpu
    )
    micro = micro_per_device(knobs.ppo_micro_batch_size_per_gpu, knobs.ppo_micro_batch_size, dp)
    if knobs.ppo_micro_batch_size_per_gpu is None and knobs.ppo_micro_batch_size is not None:
        micro_key = f"{role}.ppo_micro_batch_size / {dp} devices"
        if micro != int(micro):
            problems.append(f"{role}.ppo_micro_batch_size={knobs.ppo_micro_batch_size} (deprecated, global) does not "
                            f"split evenly over {dp} devices; set {role}.ppo_micro_batch_size_per_gpu instead.")
            micro = None
    else:
        micro_key = f"{role}.ppo_micro_batch_size_per_gpu"
    if knobs.use_dynamic_bsz:
        problems += _check_token_budget(
            cfg, f"{role}.ppo_max_token_len_per_gpu", knobs.ppo_max_token_len_per_gpu,
            knobs.ulysses_sequence_parallel_size)
    elif micro is not None and micro < 1:
        problems.append(
            f"{micro_key}={micro} must be at least 1 sample per device; set {role}.ppo_micro_batch_size_per_gpu >= 1."
        )
    elif micro is not None and (mini * n) % dp == 0 and ((mini * n) // dp) % micro:
        per_device = (mini * n) // dp
        problems.append(
            f"a mini-batch puts {role}.ppo_mini_batch_size x {ROLLOUT}.n / devices = {mini} x {n} / {dp} = {per_device} "
            f"samples on each device, which is not divisible by {micro_key}={micro}. Set "
            f"{role}.ppo_micro_batch_size_per_gpu to a divisor of {per_device} (e.g. {_divisors_near(per_device, micro)})."
        )
    return problems


def _check_token_budget(cfg: HyflowConfig, key: str, budget: int, sp: int = 1) -> list[str]:
    """A dynamic micro-batch must hold the longest sample. A sequence-parallel group of `sp` devices packs
    budget x sp tokens per micro-batch (each device holds a 1/sp slice: verl's `max_token_len_per_gpu x sp_size`,
    verl/workers/engine/utils.py; hyflow's `token_scale`), so that is what must hold it."""
    rollout = cfg.actor_rollout_ref.rollout
    longest = rollout.prompt_length + rollout.response_length
    sp = max(1, int(sp))
    if budget * sp >= longest:
        return []
    group = f" x ulysses_sequence_parallel_size {sp} = {budget * sp}" if sp > 1 else ""
    return [
        f"{key}={budget}{group} tokens cannot hold the longest sample: {ROLLOUT}.prompt_length {rollout.prompt_length} + "
        f"{ROLLOUT}.response_length {rollout.response_length} = {longest} tokens. Set {key} to at least "
        f"{-(-longest // sp)} (verl suggests rollout.n x max_prompt_length + max_response_length)."
    ]


def _check_exclusive(global_key: str, global_value: Any, per_gpu_value: Any) -> list[str]:
    if global_value is None or per_gpu_value is None:
        return []
    return [
        f"both {global_key}={global_value} (deprecated, global) and {global_key}_per_gpu={per_gpu_value} are set; "
        f"set only {global_key}_per_gpu and remove {global_key} (~{global_key})."
    ]


def _check_positive(values: dict[str, int]) -> list[str]:
    return [
        f"{key}={value} must be at least 1; set {key} >= 1." for key, value in values.items() if value < 1
    ]


def _devices_words(cfg: HyflowConfig, devices: int, dp: int, role: str = "actor") -> str:
    t = cfg.trainer
    if role == "critic" and has_own_pool(cfg, "critic"):
        nodes, per_node = role_pool_shape(cfg, "critic")
        source = f"critic's own pool: critic.nnodes {nodes} x critic.n_gpus_per_node {per_node}"
    elif devices == t.nnodes * t.n_gpus_per_node:
        source = f"trainer.nnodes {t.nnodes} x trainer.n_gpus_per_node {t.n_gpus_per_node}"
    else:
        source = "n_devices"
    words = f"{devices} devices ({source})"
    return words if dp == devices else f"{words}, {dp} data-parallel groups"


def _divisors_near(total: int, target: int) -> str:
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    return ", ".join(str(d) for d in sorted(sorted(divisors, key=lambda d: abs(d - target))[:4]))
