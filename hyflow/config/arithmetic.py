"""Derived batch sizes: one place that turns the config's batch knobs into per-step, per-device numbers.

With P = data.train_batch_size (prompts), n = rollout.n, M = ppo_mini_batch_size (prompts), W = devices,
sp = ulysses_sequence_parallel_size, tp = tensor_parallel_size, pp = pipeline_parallel_size and D = W / (sp * tp * pp)
(data-parallel size), as in verl (a group of sp, tp or pp devices holds the same samples):
    samples per step              = P * n
    optimizer steps per step      = ppo_epochs * P / M
    samples per mini-batch        = M * n                  (global)
    samples per device per mini   = M * n / D
    gradient-accumulation steps   = (M * n / D) / ppo_micro_batch_size_per_gpu
Micro-batch sizes left unset fall back in a fixed order (documented in the schema's help):
    actor micro   = ppo_micro_batch_size_per_gpu | ppo_micro_batch_size / D | the whole per-device mini-batch
    old log-probs = rollout.log_prob_micro_batch_size_per_gpu | rollout.log_prob_micro_batch_size / D | actor micro
    ref log-probs = ref.log_prob_micro_batch_size_per_gpu | ref.log_prob_micro_batch_size / D | old log-probs
Workers read these numbers instead of rewriting config values in place. Quotients that do not divide evenly
are kept as floats so a description can show them; `validate_config` rejects such configs. The result types
(`BatchArithmetic`, `RoleBatches`, `ForwardBatches`) are in `hyflow.specs`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hyflow.config.catalog import algorithm_catalog
from hyflow.config.schema import HyflowConfig
from hyflow.specs import BatchArithmetic, ForwardBatches, RoleBatches


def uses_critic(cfg: HyflowConfig) -> bool:
    """critic.enable, or when it is null: whether the advantage estimator declares that it needs `values`."""
    enable = cfg.critic.enable
    if enable is not None:
        return bool(enable)
    catalog = algorithm_catalog()
    return catalog is not None and "values" in catalog.estimator_requires(cfg.algorithm.adv_estimator)


def uses_reference(cfg: HyflowConfig) -> bool:
    """A reference policy is needed for a KL term (actor.use_kl_loss or algorithm.use_kl_in_reward), or by an
    advantage estimator that declares `ref_log_prob` among its inputs (online DPO)."""
    if cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        return True
    catalog = algorithm_catalog()
    return catalog is not None and "ref_log_prob" in catalog.estimator_requires(cfg.algorithm.adv_estimator)


def total_devices(cfg: HyflowConfig, n_devices: int | None = None) -> int:
    """`n_devices` if given, else trainer.nnodes * trainer.n_gpus_per_node."""
    return n_devices if n_devices is not None else cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


POOL_ROLES = ("critic", "reward_model", "distillation")


def has_own_pool(cfg: HyflowConfig, role: str) -> bool:
    """Whether `role` (critic, reward_model, distillation: its teacher) runs in its own worker processes
    (`<role>.enable_resource_pool`; the teacher's: `distillation.nnodes` > 0, as in verl)."""
    if role == "distillation":
        return cfg.distillation.nnodes > 0
    return bool(getattr(cfg, role).enable_resource_pool)


def role_is_on(cfg: HyflowConfig, role: str) -> bool:
    """Whether the run has `role` (critic, reward_model, distillation) at all."""
    if role == "distillation":
        return bool(cfg.distillation.enabled)
    return uses_critic(cfg) if role == "critic" else bool(cfg.reward_model.enable)


def own_pool_roles(cfg: HyflowConfig) -> list[str]:
    """The roles (critic, reward_model) this run has that run in pools of their own."""
    return [role for role in POOL_ROLES if has_own_pool(cfg, role) and role_is_on(cfg, role)]


def role_pool_shape(cfg: HyflowConfig, role: str) -> tuple[int, int]:
    """(nodes, devices per node) of `role`'s own pool: `<role>.nnodes` x `<role>.n_gpus_per_node`, 0 meaning the
    trainer's value."""
    section, t = getattr(cfg, role), cfg.trainer
    return section.nnodes or t.nnodes, section.n_gpus_per_node or t.n_gpus_per_node


def role_devices(cfg: HyflowConfig, role: str, n_devices: int | None = None) -> int:
    """The devices `role` (critic, reward_model) runs on: its own pool's with `<role>.enable_resource_pool`
    (`role_pool_shape`), else the actor's (`total_devices`)."""
    if not has_own_pool(cfg, role):
        return total_devices(cfg, n_devices)
    nodes, per_node = role_pool_shape(cfg, role)
    return nodes * per_node


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator as an int when it divides evenly (and the denominator is positive)."""
    if denominator <= 0:
        return float("nan")
    return int(numerator // denominator) if numerator % denominator == 0 else numerator / denominator


def batch_arithmetic(cfg: HyflowConfig, n_devices: int | None = None) -> BatchArithmetic:
    """All derived batch sizes of `cfg` on `n_devices` devices (default trainer.nnodes * n_gpus_per_node)."""
    arr = cfg.actor_rollout_ref
    devices = total_devices(cfg, n_devices)
    prompts, n = cfg.data.train_batch_size, arr.rollout.n
    samples = prompts * n
    max_prompt, max_response = arr.rollout.prompt_length, arr.rollout.response_length
    max_sequence = max_prompt + max_response

    actor_batches = _role_batches(arr.actor, devices, prompts, n, max_sequence)
    actor_dp = actor_batches.dp_size
    rollout = arr.rollout
    old_micro = micro_per_device(rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_micro_batch_size, actor_dp)
    if old_micro is None:
        old_micro = actor_batches.micro_batch_size_per_device
    old_log_prob = _forward_batches(
        ratio(samples, actor_dp),
        old_micro,
        rollout.log_prob_use_dynamic_bsz,
        rollout.log_prob_max_token_len_per_gpu,
    )
    ref_log_prob = None
    if uses_reference(cfg):
        ref = arr.ref
        ref_micro = micro_per_device(ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_micro_batch_size, actor_dp)
        ref_log_prob = _forward_batches(
            ratio(samples, actor_dp),
            ref_micro if ref_micro is not None else old_log_prob.micro_batch_size_per_device,
            ref.log_prob_use_dynamic_bsz,
            ref.log_prob_max_token_len_per_gpu,
        )

    critic_batches = critic_values = None
    if uses_critic(cfg):
        critic = cfg.critic
        critic_batches = _role_batches(critic, role_devices(cfg, "critic", n_devices), prompts, n, max_sequence)
        critic_dp = critic_batches.dp_size
        forward_micro = micro_per_device(
            critic.forward_micro_batch_size_per_gpu, critic.forward_micro_batch_size, critic_dp
        )
        critic_values = _forward_batches(
            ratio(samples, critic_dp),
            forward_micro if forward_micro is not None else critic_batches.micro_batch_size_per_device,
            critic.use_dynamic_bsz,
            critic.forward_max_token_len_per_gpu,
        )

    return BatchArithmetic(
        n_devices=devices,
        prompts_per_step=prompts,
        samples_per_prompt=n,
        samples_per_step=samples,
        max_prompt_tokens=max_prompt,
        max_response_tokens=max_response,
        max_sequence_tokens=max_sequence,
        actor=actor_batches,
        old_log_prob=old_log_prob,
        ref_log_prob=ref_log_prob,
        critic=critic_batches,
        critic_values=critic_values,
    )


def uses_prm(cfg: HyflowConfig) -> bool:
    """Whether the run trains PRIME's implicit process reward model (algorithm.adv_estimator=prime): the reward
    model section then describes that PRM."""
    return cfg.algorithm.adv_estimator == "prime"


def prm_mini_batch_size(cfg: HyflowConfig) -> int:
    """The implicit PRM's global mini-batch, in samples: reward_model.mini_batch_size, else the actor's
    ppo_mini_batch_size (verl-recipe prime's default, which it counts in rows there)."""
    return cfg.reward_model.mini_batch_size or cfg.actor_rollout_ref.actor.ppo_mini_batch_size


def prm_batches(cfg: HyflowConfig, n_devices: int | None = None) -> tuple[RoleBatches, ForwardBatches]:
    """PRIME's implicit PRM on its devices (`role_devices(cfg, "reward_model")`): its update walks the step's
    samples in mini-batches of reward_model.mini_batch_size samples (verl-recipe prime counts rows there; default
    the actor's ppo_mini_batch_size), one epoch, micro-batched by reward_model.micro_batch_size_per_gpu (or the
    token budget reward_model.forward_max_token_len_per_gpu with use_dynamic_bsz); its scoring pass the same."""
    rm, arr = cfg.reward_model, cfg.actor_rollout_ref
    devices = role_devices(cfg, "reward_model", n_devices)
    samples = cfg.data.train_batch_size * arr.rollout.n
    knobs = SimpleNamespace(
        ppo_mini_batch_size=prm_mini_batch_size(cfg), ppo_epochs=1,
        use_dynamic_bsz=rm.use_dynamic_bsz, ppo_max_token_len_per_gpu=rm.forward_max_token_len_per_gpu,
        ppo_micro_batch_size_per_gpu=rm.micro_batch_size_per_gpu, ppo_micro_batch_size=rm.micro_batch_size,
        ulysses_sequence_parallel_size=1, tensor_parallel_size=1)
    update = _role_batches(knobs, devices, samples, 1, arr.rollout.prompt_length + arr.rollout.response_length)
    forward = _forward_batches(ratio(samples, update.dp_size), update.micro_batch_size_per_device,
                               rm.use_dynamic_bsz, rm.forward_max_token_len_per_gpu)
    return update, forward


def micro_per_device(per_gpu: int | None, global_size: int | None, dp: int) -> float | None:
    """The per-device micro-batch size from the per-GPU knob, else the deprecated global one / dp (a float when it
    does not divide), None when neither is set: the one place this fallback is written."""
    if per_gpu is not None:
        return per_gpu
    if global_size is not None:
        return ratio(global_size, dp)
    return None


def data_parallel_size(knobs: Any, devices: int) -> int:
    """A trained role's data-parallel size: its devices / (ulysses_sequence_parallel_size x tensor_parallel_size x
    pipeline_parallel_size) (the devices of a sequence-, tensor- or pipeline-parallel group hold the same samples)."""
    pp = max(int(getattr(knobs, "pipeline_parallel_size", 1) or 1), 1)
    return max(devices // (max(knobs.ulysses_sequence_parallel_size, 1) * max(knobs.tensor_parallel_size, 1) * pp), 1)


def _role_batches(knobs: Any, devices: int, prompts: int, n: int, max_sequence: int) -> RoleBatches:
    """The PPO batches of a trained role (the actor or the critic: both sections hold the same ppo_* knobs) on
    `devices` devices, data-parallel over devices / (ulysses_sequence_parallel_size x tensor_parallel_size). A
    sequence-parallel group splits each sequence, so its token budget per device counts sp x the per-GPU one (as
    verl's); a tensor-parallel group's devices each run every token of its samples, so tp leaves it alone."""
    sp = max(knobs.ulysses_sequence_parallel_size, 1)
    dp = data_parallel_size(knobs, devices)
    mini_prompts, ppo_epochs, dynamic = knobs.ppo_mini_batch_size, knobs.ppo_epochs, knobs.use_dynamic_bsz
    max_token_len = knobs.ppo_max_token_len_per_gpu * sp
    mini_batches = ratio(prompts, mini_prompts)
    per_device = ratio(mini_prompts * n, dp)
    micro = micro_batches = max_micro = token_len = None
    if dynamic:
        token_len = max_token_len
        max_micro = -(-int(per_device * max_sequence) // max(max_token_len, 1))
    else:
        micro = micro_per_device(knobs.ppo_micro_batch_size_per_gpu, knobs.ppo_micro_batch_size, dp)
        micro = per_device if micro is None else micro
        micro_batches = ratio(per_device, micro)
    return RoleBatches(
        mini_batch_prompts=mini_prompts,
        mini_batch_samples=mini_prompts * n,
        mini_batches_per_epoch=mini_batches,
        ppo_epochs=ppo_epochs,
        optimizer_steps=ppo_epochs * mini_batches,
        dp_size=dp,
        samples_per_device=per_device,
        use_dynamic_bsz=dynamic,
        micro_batch_size_per_device=micro,
        micro_batches=micro_batches,
        max_token_len_per_device=token_len,
        max_micro_batches=max_micro,
    )


def _forward_batches(
    per_device: float, micro: float | None, dynamic: bool, max_token_len: int
) -> ForwardBatches:
    if dynamic:
        return ForwardBatches(per_device, True, None, None, max_token_len)
    if micro is not None and micro == micro and micro != int(micro):
        micro = max(1, int(micro))  # a deprecated global size over devices, rounded down (as verl's workers do)
    micro = per_device if micro is None else micro
    return ForwardBatches(per_device, False, micro, ratio(per_device, micro), None)
