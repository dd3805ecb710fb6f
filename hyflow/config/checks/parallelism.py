"""Devices and parallel sizes: a device count, Ulysses sequence parallelism (with packing), tensor parallelism of
the trained roles (FSDP2, not with LoRA yet; with Ulysses on one sp x tp mesh, whose product divides the role's
devices), hybrid sharding (fsdp_size) and expert parallelism of the trained roles, and the rollout engine's tensor
parallelism."""

from __future__ import annotations

from typing import Any

from hyflow.config.arithmetic import role_devices, total_devices
from hyflow.config.catalog import engine_capabilities, splits_model
from hyflow.config.checks import ACTOR, ROLLOUT, check
from hyflow.config.schema import HyflowConfig
from hyflow.specs import FSDP2_STRATEGIES


@check(200, devices=True)
def device_problems(cfg: HyflowConfig, n_devices: int | None) -> list[str]:
    """The device count and the parallel sizes that must divide it (the batch checks run only when these pass)."""
    t = cfg.trainer
    if n_devices is not None and n_devices < 1:
        return [f"n_devices={n_devices}: need at least 1 device."]
    if n_devices is None and (t.nnodes < 1 or t.n_gpus_per_node < 1):
        return [
            f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node} gives no devices; "
            "set both to at least 1."
        ]
    devices = total_devices(cfg, n_devices)
    problems = []
    for key, sp, packing in (
        (f"{ACTOR}.ulysses_sequence_parallel_size", cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size,
         ("actor_rollout_ref.model.use_remove_padding", cfg.actor_rollout_ref.model.use_remove_padding)),
        ("actor_rollout_ref.ref.ulysses_sequence_parallel_size", cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size,
         ("actor_rollout_ref.model.use_remove_padding", cfg.actor_rollout_ref.model.use_remove_padding)),
        ("critic.ulysses_sequence_parallel_size", cfg.critic.ulysses_sequence_parallel_size,
         ("critic.model.use_remove_padding", cfg.critic.model.use_remove_padding)),
    ):
        if sp < 1 or devices % sp:
            problems.append(
                f"{key}={sp} must be >= 1 and divide the {devices} devices; set it to a divisor of {devices}."
            )
        elif sp > 1 and not packing[1]:
            problems.append(f"{key}={sp} needs sequence packing ({packing[0]}=true, as verl requires): each packed "
                            "row is cut across the group's devices; set it, or the sequence-parallel size to 1.")
    problems += _check_tensor_parallel(cfg, devices, role_devices(cfg, "critic", n_devices))
    problems += _check_sharding_and_experts(cfg, devices, role_devices(cfg, "critic", n_devices))
    problems += _check_pipeline(cfg, devices, role_devices(cfg, "critic", n_devices))
    rollout = cfg.actor_rollout_ref.rollout
    caps = engine_capabilities(rollout.name)
    if caps is not None and splits_model(caps) and devices % max(rollout.tensor_model_parallel_size, 1):
        problems.append(
            f"{ROLLOUT}.tensor_model_parallel_size={rollout.tensor_model_parallel_size} does not divide the {devices} "
            f"devices; set it to a divisor of {devices}."
        )
    return problems


def _check_tensor_parallel(cfg: HyflowConfig, devices: int, critic_devices: int) -> list[str]:
    """tensor_parallel_size of the actor, the reference and the critic: >= 1 and a divisor of the role's devices
    (times ulysses_sequence_parallel_size, when both split the role: one (sp, tp) mesh), with the FSDP2 wrapper
    (strategy fsdp/fsdp2), and not yet with LoRA (the reference has no adapter of its own: under LoRA it is the
    actor, or a full model from ref.model.path).
    A reference problem that only repeats the actor's (its sizes follow the actor's) is reported once."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    problems: list[str] = []
    for role, section, strategy, role_devices_, lora in (
        (ACTOR, arr.actor, arr.actor.strategy, devices, ("actor_rollout_ref.model", arr.model)),
        ("actor_rollout_ref.ref", arr.ref, arr.ref.strategy, devices, None),
        ("critic", critic, critic.strategy, critic_devices, ("critic.model", critic.model)),
    ):
        found = _tensor_parallel_problems(role, section, strategy, role_devices_, lora)
        problems += [p for p in found if p.replace("actor_rollout_ref.ref.", f"{ACTOR}.") not in problems]
    return problems


def _tensor_parallel_problems(role: str, section: Any, strategy: str, devices: int,
                              lora: tuple[str, Any] | None) -> list[str]:
    key, tp, sp = f"{role}.tensor_parallel_size", section.tensor_parallel_size, section.ulysses_sequence_parallel_size
    if tp < 1 or devices % tp:
        return [f"{key}={tp} must be >= 1 and divide the {devices} devices; set it to a divisor of {devices}."]
    if tp == 1:
        return []
    problems = []
    if sp > 1 and devices % (sp * tp):
        problems.append(f"{key}={tp} x {role}.ulysses_sequence_parallel_size={sp} = {sp * tp} must divide the "
                        f"{devices} devices (sequence x tensor parallelism in one role is one (sp, tp) mesh per "
                        f"data-parallel rank); set sizes whose product divides {devices}.")
    if strategy not in FSDP2_STRATEGIES:
        problems.append(f"{key}={tp} needs {role}.strategy fsdp or fsdp2 (tensor parallelism is composed with the "
                        f"FSDP2 wrapper over a data-parallel x tensor-parallel device mesh), got {role}.strategy="
                        f"{strategy}; set {role}.strategy=fsdp2, or {key}=1.")
    if lora is not None:
        lora_key, model = lora
        rank, adapter = model.lora_rank, model.lora_adapter_path
        if (isinstance(rank, int) and rank > 0) or adapter:
            given = f"lora_rank={rank}" if isinstance(rank, int) and rank > 0 else f"lora_adapter_path={adapter}"
            problems.append(f"{key}={tp} with LoRA ({lora_key}.{given}): tensor parallelism of a LoRA model is not "
                            f"built yet; set {key}=1, or train without LoRA ({lora_key}.lora_rank=0"
                            f"{', lora_adapter_path=null' if adapter else ''}).")
    return problems


def _check_sharding_and_experts(cfg: HyflowConfig, devices: int, critic_devices: int) -> list[str]:
    """fsdp_config.fsdp_size (hybrid sharding) and expert_parallel_size of the actor, the reference and the critic
    (`hyflow.workers.train_engine.engine_dims`): an FSDP shard group of fsdp_size devices (sp ranks included) that
    divides the role's devices / tp, ep dividing a shard group's devices x tp, both with the FSDP2 wrapper; ep not
    with LoRA. A reference problem that repeats the actor's is reported once."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    problems: list[str] = []
    for role, section, fsdp_key, fsdp, role_devices_, lora in (
        (ACTOR, arr.actor, f"{ACTOR}.fsdp_config", arr.actor.fsdp_config, devices, arr.model),
        ("actor_rollout_ref.ref", arr.ref, "actor_rollout_ref.ref.fsdp_config", arr.ref.fsdp_config, devices, None),
        ("critic", critic, "critic.model.fsdp_config", critic.model.fsdp_config, critic_devices, critic.model),
    ):
        found = _sharding_problems(role, section, fsdp_key, fsdp.fsdp_size, role_devices_, lora)
        problems += [p for p in found if p.replace("actor_rollout_ref.ref.", f"{ACTOR}.") not in problems]
    return problems


def _sharding_problems(role: str, section: Any, fsdp_key: str, fsdp_size: int, devices: int, lora: Any) -> list[str]:
    tp, sp, ep = section.tensor_parallel_size, section.ulysses_sequence_parallel_size, section.expert_parallel_size
    pp = section.pipeline_parallel_size
    if tp < 1 or sp < 1 or pp < 1 or devices % (tp * pp):
        return []  # the tensor/sequence/pipeline-parallel checks say so
    strategy, problems = section.strategy, []
    key, shard = f"{fsdp_key}.fsdp_size", devices // (tp * pp)
    if fsdp_size == 0 or fsdp_size < -1:
        problems.append(f"{key}={fsdp_size}: use -1 (shard over all the role's devices) or the devices of one shard "
                        "group (hybrid sharding).")
    elif 0 < fsdp_size < shard:
        if shard % fsdp_size or fsdp_size % sp:
            per = f"{role}.tensor_parallel_size={tp}" + (f" x {role}.pipeline_parallel_size={pp}" if pp > 1 else "")
            problems.append(f"{key}={fsdp_size} (hybrid sharding: shard groups of that many devices, replicated) must "
                            f"divide the role's {devices} devices / {per} and be a multiple "
                            f"of {role}.ulysses_sequence_parallel_size={sp}; set a divisor of {shard}, or -1.")
        elif strategy not in FSDP2_STRATEGIES:
            problems.append(f"{key}={fsdp_size} (hybrid sharding) needs {role}.strategy fsdp or fsdp2, got "
                            f"{strategy}; set {role}.strategy=fsdp2, or {key}=-1.")
        else:
            shard = fsdp_size
    ekey = f"{role}.expert_parallel_size"
    if ep < 1:
        problems.append(f"{ekey}={ep} must be >= 1.")
    elif ep > 1:
        ranks = shard * tp  # an FSDP shard group's devices with their tensor-parallel ranks: one replica
        if ranks % ep:
            problems.append(f"{ekey}={ep} must divide the {ranks} devices of an FSDP shard group x "
                            f"{role}.tensor_parallel_size (the devices experts are split over); set a divisor of "
                            f"{ranks}.")
        if strategy not in FSDP2_STRATEGIES:
            problems.append(f"{ekey}={ep} needs {role}.strategy fsdp or fsdp2 (the experts are split beside the "
                            f"FSDP2 wrapper), got {role}.strategy={strategy}; set {role}.strategy=fsdp2.")
        if lora is not None and ((isinstance(lora.lora_rank, int) and lora.lora_rank > 0) or lora.lora_adapter_path):
            problems.append(f"{ekey}={ep} with LoRA: expert parallelism of a LoRA model is not built yet; set "
                            f"{ekey}=1, or train without LoRA.")
    return problems


def _check_pipeline(cfg: HyflowConfig, devices: int, critic_devices: int) -> list[str]:
    """pipeline_parallel_size, virtual_pipeline_parallel_size and pipeline_schedule of the actor, the reference and
    the critic (`hyflow.parallel.pipeline`): pp x tp divides the role's devices, FSDP2, an interleaved schedule with
    virtual stages, and what a pipeline does not run yet refused by name (packing, prompt sharing and compile are
    performance-only there: `hyflow.config.support`'s table says so at start). A reference problem that repeats
    the actor's is reported once."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    problems: list[str] = []
    for role, section, lora, role_devices_ in (
        (ACTOR, arr.actor, arr.model, devices),
        ("actor_rollout_ref.ref", arr.ref, None, devices),
        ("critic", critic, critic.model, critic_devices),
    ):
        found = _pipeline_problems(cfg, role, section, lora, role_devices_)
        problems += [p for p in found if p.replace("actor_rollout_ref.ref.", f"{ACTOR}.") not in problems]
    return problems


def _pipeline_problems(cfg: HyflowConfig, role: str, section: Any, lora: Any, devices: int) -> list[str]:
    pp, virtual, schedule = section.pipeline_parallel_size, section.virtual_pipeline_parallel_size, \
        section.pipeline_schedule
    key = f"{role}.pipeline_parallel_size"
    if pp < 1 or (virtual is not None and virtual < 1):
        return [f"{key}={pp} and {role}.virtual_pipeline_parallel_size={virtual} must be >= 1 (virtual: or null)."]
    virtual = virtual or 1
    if pp == 1:
        if virtual > 1:
            return [f"{role}.virtual_pipeline_parallel_size={virtual} needs {key} > 1 (stages per pipeline device); "
                    "set it to null, or set the pipeline size."]
        return []
    tp = max(section.tensor_parallel_size, 1)
    problems = []
    if devices % (pp * tp):
        problems.append(f"{key}={pp} x {role}.tensor_parallel_size={tp} must divide the role's {devices} devices; "
                        f"set a pipeline size that does.")
    if schedule is not None and (schedule == "Interleaved1F1B") != (virtual > 1):
        problems.append(f"{role}.pipeline_schedule={schedule} with virtual_pipeline_parallel_size={virtual}: "
                        "Interleaved1F1B runs several stages per device (virtual > 1), 1F1B and GPipe one; set "
                        "pipeline_schedule=null to choose by the virtual size.")
    refused = {
        f"{role}.strategy={section.strategy} (needs fsdp or fsdp2: each stage is sharded by FSDP2)":
            section.strategy not in FSDP2_STRATEGIES,
        f"{role}.ulysses_sequence_parallel_size={section.ulysses_sequence_parallel_size} (the pipeline runs padded "
        "micro-batches, Ulysses cuts packed ones)": section.ulysses_sequence_parallel_size > 1,
        "LoRA": lora is not None and ((isinstance(lora.lora_rank, int) and lora.lora_rank > 0)
                                      or bool(lora.lora_adapter_path)),
    }
    problems += [f"{key}={pp} with {what} is not built yet; use one of them." for what, bad in refused.items() if bad]
    return problems
