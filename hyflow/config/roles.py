"""One spec per role, derived once from a validated config (the types are in `hyflow.specs`).

`hyflow config` prints these specs; the trainer hands each role its own spec and nothing else of the config.
"""

from __future__ import annotations

import dataclasses

from hyflow.config.arithmetic import (
    batch_arithmetic,
    micro_per_device,
    prm_batches,
    role_devices,
    uses_critic,
    uses_prm,
    uses_reference,
)
from hyflow.config.keys import ConfigError
from hyflow.config.lora import lora_settings
from hyflow.config.schema import HyflowConfig
from hyflow.specs import (
    ActorLossSpec,
    ActorSpec,
    BatchArithmetic,
    CriticSpec,
    DistillationLossSpec,
    FsdpSettings,
    JudgeSpec,
    ModelSpec,
    OptimizerSpec,
    PairPreferenceSpec,
    PRMSpec,
    RewardModelSpec,
    RoleSpecs,
    RolloutSpec,
    TeacherModelSpec,
    TeacherSpec,
    TrainEngineSpec,
)

# ------------------------------------------------------------------------------------------ RL roles


def role_specs(cfg: HyflowConfig, *, n_devices: int | None = None, total_steps: int = 1,
               judge: bool | None = None) -> RoleSpecs:
    """Every RL role's spec, derived once from a validated config: the batch arithmetic on `n_devices` devices
    (default trainer.nnodes x trainer.n_gpus_per_node; `batch_arithmetic`, what `hyflow config` prints) and, for
    the LR schedules, `total_steps` training steps (a role's optimizer steps = total_steps x its optimizer steps
    per training step). A role the run does not have gets None.

    The reward model's slot holds PRIME's implicit PRM (`prm`), a generative judge (`judge`) or a classifier
    (`reward_model`). Whether a model behind `reward_model.rollout.name` is a judge is its architecture's call
    (`judge`: True / False); with `judge` None that slot stays empty until `with_reward_model` fills it."""
    batches = batch_arithmetic(cfg, n_devices=n_devices)
    specs = RoleSpecs(batches=batches, actor=actor_spec(cfg, batches, total_steps),
                      critic=critic_spec(cfg, batches, total_steps) if uses_critic(cfg) else None,
                      rollout=rollout_spec(cfg),
                      prm=prm_spec(cfg, n_devices=batches.n_devices, total_steps=total_steps) if uses_prm(cfg) else None,
                      teacher=teacher_spec(cfg) if cfg.distillation.enabled else None)
    if judge is not None or not uses_judge(cfg):
        specs = with_reward_model(cfg, specs, judge=bool(judge))
    return specs


def with_reward_model(cfg: HyflowConfig, specs: RoleSpecs, *, judge: bool) -> RoleSpecs:
    """`specs` with the reward model's spec: a judge's (`judge_spec`) when `judge`, else the classifier's
    (`reward_model_spec`, on the devices of `specs.batches`) when reward_model.enable (and the section is not
    PRIME's PRM)."""
    if uses_prm(cfg) or not cfg.reward_model.enable:
        return specs
    if judge:
        return dataclasses.replace(specs, judge=judge_spec(cfg))
    return dataclasses.replace(specs, reward_model=reward_model_spec(cfg, n_devices=specs.batches.n_devices))


def optimizer_spec(optim, *, lr_scheduler_type: str | None = None) -> OptimizerSpec:
    """An `optim` section (the actor's, the critic's, SFT's) as an OptimizerSpec: the same values, plain.
    `lr_scheduler_type`: the schedule's name when the section spells the key otherwise (SFT's `lr_scheduler`)."""
    return OptimizerSpec(optimizer=optim.optimizer, optimizer_impl=optim.optimizer_impl, lr=optim.lr,
                         betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                         override_optimizer_config=dict(optim.override_optimizer_config or {}),
                         lr_warmup_steps=optim.lr_warmup_steps, lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio,
                         lr_scheduler_type=lr_scheduler_type or optim.lr_scheduler_type,
                         min_lr_ratio=optim.min_lr_ratio, num_cycles=optim.num_cycles)


def pipeline_settings(section) -> dict:
    """A role section's pipeline keys as `TrainEngineSpec` fields (virtual stages: null = 1)."""
    return {"pipeline_parallel_size": int(section.pipeline_parallel_size),
            "virtual_pipeline_parallel_size": int(section.virtual_pipeline_parallel_size or 1),
            "pipeline_schedule": section.pipeline_schedule}


def fsdp_settings(fsdp_config, *, offload: bool = True) -> FsdpSettings:
    """What the parallel wrapper and the engine read of an `fsdp_config` section (or SFT's `engine` section).
    `offload=False`: the role's worker does not offload (the reward model's)."""
    def read(key: str) -> bool:
        return offload and bool(getattr(fsdp_config, key, False))

    return FsdpSettings(dtype=fsdp_config.dtype, reshard_after_forward=fsdp_config.reshard_after_forward,
                        param_offload=read("param_offload"), optimizer_offload=read("optimizer_offload"),
                        offload_policy=read("offload_policy"), fsdp_size=int(getattr(fsdp_config, "fsdp_size", -1)))


def policy_model_spec(cfg: HyflowConfig) -> ModelSpec:
    """actor_rollout_ref.model: the policy (and its tokenizer) that the actor and the rollout load."""
    m = cfg.actor_rollout_ref.model
    return ModelSpec(path=m.path, tokenizer_path=m.tokenizer_path, trust_remote_code=m.trust_remote_code,
                     override_config=dict(m.override_config or {}),
                     enable_gradient_checkpointing=m.enable_gradient_checkpointing,
                     custom_chat_template=m.custom_chat_template)


def rollout_spec(cfg: HyflowConfig) -> RolloutSpec:
    """The rollout's spec: the policy's path, the rollout section whole, the agent loop's chat-template kwargs,
    the weight-push bucket, and whether an asynchronous run streams in the actor's processes."""
    rollout = cfg.actor_rollout_ref.rollout
    return RolloutSpec(model=policy_model_spec(cfg), section=rollout, device=cfg.trainer.device,
                       chat_template_kwargs=dict(cfg.data.apply_chat_template_kwargs or {}),
                       weight_bucket_bytes=rollout.checkpoint_engine.update_weights_bucket_megabytes << 20,
                       stream=cfg.async_training.mode != "sync" and cfg.rollout.n_gpus_per_node == 0,
                       image_kwargs=dict(cfg.data.mm_processor_kwargs or {}))


def actor_spec(cfg: HyflowConfig, batches: BatchArithmetic, total_steps: int) -> ActorSpec:
    """The actor + rollout + reference worker's spec (`batches`: the run's `batch_arithmetic`)."""
    arr = cfg.actor_rollout_ref
    actor, ref, model = arr.actor, arr.ref, arr.model
    engine = TrainEngineSpec(
        name="actor", head="lm", strategy=actor.strategy, fsdp=fsdp_settings(actor.fsdp_config),
        compute_dtype=actor.fsdp_config.dtype, device=cfg.trainer.device, optim=optimizer_spec(actor.optim),
        grad_clip=actor.grad_clip, total_optimizer_steps=total_steps * int(batches.actor.optimizer_steps),
        use_remove_padding=model.use_remove_padding, share_prompts=actor.use_prefix_grouper,
        use_torch_compile=actor.use_torch_compile, lora=lora_settings(model, config_key="actor_rollout_ref.model"),
        freeze_vision_tower=actor.freeze_vision_tower, ulysses_sequence_parallel_size=actor.ulysses_sequence_parallel_size,
        tensor_parallel_size=actor.tensor_parallel_size, expert_parallel_size=actor.expert_parallel_size,
        **pipeline_settings(actor))
    ref_engine = None
    if uses_reference(cfg):  # frozen (no optimizer), computing in the actor's dtype
        ref_engine = TrainEngineSpec(
            name="ref", head="lm", strategy=ref.strategy, fsdp=fsdp_settings(ref.fsdp_config),
            compute_dtype=actor.fsdp_config.dtype, device=cfg.trainer.device,
            use_remove_padding=model.use_remove_padding, share_prompts=actor.use_prefix_grouper,
            use_torch_compile=ref.use_torch_compile, ulysses_sequence_parallel_size=ref.ulysses_sequence_parallel_size,
            tensor_parallel_size=ref.tensor_parallel_size, expert_parallel_size=ref.expert_parallel_size,
            **pipeline_settings(ref))
    distillation, pair_preference = distillation_loss_spec(cfg), pair_preference_spec(cfg)
    loss = ActorLossSpec(
        loss_mode=actor.policy_loss.loss_mode,
        policy_loss_kwargs={
            "clip_ratio": actor.clip_ratio, "clip_ratio_low": actor.clip_ratio_low,
            "clip_ratio_high": actor.clip_ratio_high, "clip_ratio_c": actor.clip_ratio_c,
            "tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg, "loss_scale_factor": actor.loss_scale_factor,
            "sppo_eta": actor.sppo_eta, **{k: v for k, v in vars(actor.policy_loss).items() if k != "loss_mode"},
        },
        loss_agg_mode=actor.loss_agg_mode, loss_scale_factor=actor.loss_scale_factor,
        entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type, distillation=distillation, pair_preference=pair_preference,
        terms=actor_loss_terms(entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss,
                               distillation=distillation, pair_preference=pair_preference))
    return ActorSpec(model=policy_model_spec(cfg), engine=engine, ref=ref_engine, ref_model_path=ref.model.path or None,
                     loss=loss, batches=batches.actor, old_log_prob=batches.old_log_prob,
                     ref_log_prob=batches.ref_log_prob, rollout=rollout_spec(cfg), seed=cfg.trainer.seed,
                     full_determinism=actor.fsdp_config.full_determinism or ref.fsdp_config.full_determinism,
                     shuffle=actor.shuffle, data_loader_seed=actor.data_loader_seed)


def actor_loss_terms(*, entropy_coeff: float, use_kl_loss: bool, distillation: DistillationLossSpec | None,
                     pair_preference: PairPreferenceSpec | None) -> tuple[str, ...]:
    """The actor's loss terms in order (`hyflow.algos.loss_terms`): the task's loss (the policy loss, or online
    DPO's pair loss in its place; with its entropy bonus when entropy_coeff != 0 and KL loss with use_kl_loss),
    which on-policy distillation computes only with use_task_rewards or use_policy_gradient (as verl does), then
    distillation's term."""
    terms: list[str] = []
    if distillation is None or distillation.use_task_rewards or distillation.use_policy_gradient:
        terms.append("policy" if pair_preference is None else "pair_preference")
        terms += ["entropy"] if entropy_coeff != 0 else []
        terms += ["kl"] if use_kl_loss else []
    if distillation is not None:
        terms.append("distillation")
    return tuple(terms)


PAIR_ESTIMATORS = ("online_dpo", "spin")  # estimators whose pairs the actor trains with the DPO loss


def pair_preference_spec(cfg: HyflowConfig) -> PairPreferenceSpec | None:
    """Online DPO's actor term (algorithm.adv_estimator=online_dpo or spin), else None."""
    if cfg.algorithm.adv_estimator not in PAIR_ESTIMATORS:
        return None
    algo = cfg.algorithm
    return PairPreferenceSpec(loss_type=algo.dpo_loss_type, beta=cfg.actor_rollout_ref.actor.dpo_beta,
                              label_smoothing=algo.dpo_label_smoothing)


def critic_spec(cfg: HyflowConfig, batches: BatchArithmetic, total_steps: int) -> CriticSpec:
    """The critic worker's spec: the value model (critic.model.path, else the policy's), its engine and loss."""
    critic = cfg.critic
    m = critic.model
    engine = TrainEngineSpec(
        name="critic", head="value", strategy=critic.strategy, fsdp=fsdp_settings(m.fsdp_config),
        compute_dtype=m.fsdp_config.dtype, device=cfg.trainer.device, optim=optimizer_spec(critic.optim),
        grad_clip=critic.grad_clip, total_optimizer_steps=total_steps * int(batches.critic.optimizer_steps),
        use_remove_padding=m.use_remove_padding, lora=lora_settings(m, config_key="critic.model"),
        ulysses_sequence_parallel_size=critic.ulysses_sequence_parallel_size,
        tensor_parallel_size=critic.tensor_parallel_size, expert_parallel_size=critic.expert_parallel_size,
        **pipeline_settings(critic))
    model = ModelSpec(path=m.path or cfg.actor_rollout_ref.model.path, trust_remote_code=m.trust_remote_code,
                      override_config=dict(m.override_config or {}),
                      enable_gradient_checkpointing=m.enable_gradient_checkpointing, config_key="critic.model.path")
    return CriticSpec(model=model, engine=engine, batches=batches.critic, values=batches.critic_values,
                      cliprange_value=critic.cliprange_value, loss_agg_mode=critic.loss_agg_mode,
                      shuffle=critic.shuffle, seed=cfg.trainer.seed, full_determinism=m.fsdp_config.full_determinism)


# ------------------------------------------------------------------------------------------ reward model


def reward_model_spec(cfg: HyflowConfig, *, n_devices: int | None = None) -> RewardModelSpec:
    """The reward model's spec (`hyflow.specs.RewardModelSpec`); `n_devices` = the actor's devices (default
    trainer.nnodes x trainer.n_gpus_per_node).

    Its data-parallel size D is the number of devices it runs on (`role_devices`: its own pool's with
    reward_model.enable_resource_pool, else the actor's). The one micro-batch rule, as for the actor and the critic:

        micro per device = reward_model.micro_batch_size_per_gpu
                         | reward_model.micro_batch_size / D   (verl's deprecated global size; must divide evenly)
                         | None                                (all of a device's samples in one forward)

    and it must be at least 1. A global size that does not split evenly over D, or a size below 1, is a
    ConfigError naming the fix (never rounded). With reward_model.use_dynamic_bsz the forward is cut by the token
    budget reward_model.forward_max_token_len_per_gpu instead. The policy's tokenizer is
    reward_model.model.input_tokenizer, else actor_rollout_ref.model.tokenizer_path, else .path.
    """
    rm, actor_model = cfg.reward_model, cfg.actor_rollout_ref.model
    dp = role_devices(cfg, "reward_model", n_devices)
    micro = micro_per_device(rm.micro_batch_size_per_gpu, rm.micro_batch_size, dp)
    if rm.micro_batch_size_per_gpu is None and rm.micro_batch_size is not None:
        if micro != int(micro):
            raise ConfigError(
                f"reward_model.micro_batch_size={rm.micro_batch_size} (deprecated, global) does not split evenly "
                f"over the reward model's {dp} devices; set reward_model.micro_batch_size_per_gpu instead (e.g. "
                f"{max(rm.micro_batch_size // dp, 1)}), or make reward_model.micro_batch_size a multiple of {dp}.")
        micro_key = f"reward_model.micro_batch_size / {dp} devices"
    else:
        micro_key = "reward_model.micro_batch_size_per_gpu"
    if micro is not None and micro < 1:
        raise ConfigError(f"{micro_key}={micro} must be at least 1 sample per device; set "
                          "reward_model.micro_batch_size_per_gpu >= 1.")
    if rm.model.input_tokenizer:
        policy_tokenizer = ModelSpec(rm.model.input_tokenizer, config_key="reward_model.model.input_tokenizer")
    elif actor_model.tokenizer_path or actor_model.path:
        key = "actor_rollout_ref.model.tokenizer_path" if actor_model.tokenizer_path else "actor_rollout_ref.model.path"
        policy_tokenizer = ModelSpec(actor_model.tokenizer_path or actor_model.path,
                                     trust_remote_code=actor_model.trust_remote_code, config_key=key)
    else:
        policy_tokenizer = None
    fsdp = rm.model.fsdp_config
    # every rank holds the whole frozen model (no wrapper) and scores its share of the samples
    engine = TrainEngineSpec(name="reward_model", head="score", strategy="single",
                             fsdp=fsdp_settings(fsdp, offload=False), compute_dtype=fsdp.dtype,
                             device=cfg.trainer.device)
    return RewardModelSpec(
        model=ModelSpec(rm.model.path, trust_remote_code=rm.model.trust_remote_code,
                        override_config=dict(rm.model.override_config or {}), config_key="reward_model.model.path"),
        engine=engine,
        policy_tokenizer=policy_tokenizer,
        external_lib=rm.model.external_lib,
        model_dtype=fsdp.model_dtype,
        max_length=rm.max_length,
        full_determinism=fsdp.full_determinism,
        dp_size=dp,
        micro_batch_size_per_device=None if rm.use_dynamic_bsz or micro is None else int(micro),
        use_dynamic_bsz=rm.use_dynamic_bsz,
        max_token_len_per_device=rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None,
    )


def prm_spec(cfg: HyflowConfig, *, n_devices: int | None = None, total_steps: int = 1) -> PRMSpec:
    """PRIME's implicit PRM (`hyflow.specs.PRMSpec`): reward_model.model.path (else the policy's) trained with
    reward_model.model.optim, the frozen reference from reward_model.model.ref_path (else the PRM's own path);
    both compute like the actor (its use_remove_padding and gradient checkpointing, reward_model.model.fsdp_config's
    dtype and offload) on the reward model's devices (`prm_batches`)."""
    rm, arr = cfg.reward_model, cfg.actor_rollout_ref
    m = rm.model
    batches, forward = prm_batches(cfg, n_devices)
    path = m.path or arr.model.path
    fsdp = fsdp_settings(m.fsdp_config)
    common = {"head": "lm", "strategy": rm.strategy, "fsdp": fsdp, "compute_dtype": m.fsdp_config.dtype,
              "device": cfg.trainer.device, "use_remove_padding": arr.model.use_remove_padding}
    engine = TrainEngineSpec(name="prm", optim=optimizer_spec(m.optim), grad_clip=m.optim.grad_clip,
                             total_optimizer_steps=total_steps * max(1, int(batches.optimizer_steps)), **common)
    ref_engine = TrainEngineSpec(name="prm_ref", **common)
    model = ModelSpec(path, trust_remote_code=m.trust_remote_code, override_config=dict(m.override_config or {}),
                      enable_gradient_checkpointing=arr.model.enable_gradient_checkpointing,
                      config_key="reward_model.model.path" if m.path else "actor_rollout_ref.model.path")
    ref_model = ModelSpec(m.ref_path or path, trust_remote_code=m.trust_remote_code,
                          override_config=dict(m.override_config or {}),
                          config_key="reward_model.model.ref_path" if m.ref_path else model.config_key)
    return PRMSpec(model=model, ref_model=ref_model, engine=engine, ref_engine=ref_engine, batches=batches,
                   forward=forward, beta=m.beta_train, seed=cfg.trainer.seed,
                   full_determinism=m.fsdp_config.full_determinism)


def teacher_models(cfg: HyflowConfig) -> dict[str, dict]:
    """distillation.teacher_models with every entry's defaults filled in (`TEACHER_DEFAULTS`); the default
    `teacher_model` entry is dropped when other entries are given and it has no model_path (verl's rule)."""
    from hyflow.config.schema.distillation import INFERENCE_DEFAULTS, TEACHER_DEFAULTS

    entries = {}
    for name, entry in dict(cfg.distillation.teacher_models or {}).items():
        entry = {**TEACHER_DEFAULTS, **dict(entry or {})}
        entry["inference"] = {**INFERENCE_DEFAULTS, **dict(entry.get("inference") or {})}
        entries[name] = entry
    if len(entries) > 1 and not entries.get("teacher_model", {"model_path": "kept"}).get("model_path"):
        entries.pop("teacher_model")
    return entries


def teacher_spec(cfg: HyflowConfig) -> TeacherSpec:
    """The distillation teacher worker's spec from a validated config (`validate_config` checked the entries)."""
    from hyflow.config.schema.distillation import TOPK_LOSS_MODES

    d, rollout = cfg.distillation, cfg.actor_rollout_ref.rollout
    teachers = []
    for name, entry in teacher_models(cfg).items():
        inference = dict(entry.get("inference") or {})
        teachers.append(TeacherModelSpec(
            name=name, key=entry.get("key"),
            model=ModelSpec(path=entry["model_path"], trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
                            config_key=f"distillation.teacher_models.{name}.model_path"),
            engine=inference.get("name") or rollout.name, dtype=inference.get("dtype") or rollout.dtype,
            max_num_seqs=int(inference.get("max_num_seqs") or rollout.max_num_seqs), inference=inference))
    topk = d.distillation_loss.topk if d.distillation_loss.loss_mode in TOPK_LOSS_MODES else 0
    return TeacherSpec(teachers=tuple(teachers), teacher_key=d.teacher_key, topk=topk, device=cfg.trainer.device,
                       rollout=rollout)


def teacher_performance_notes(cfg: HyflowConfig) -> list[str]:
    """One line per teacher whose `inference` sets keys that change only the teacher engine's speed or memory
    (`INFERENCE_PERFORMANCE_ONLY`: how vLLM batches, caches, splits or loads; the scores are the same), printed
    at start so that no key is taken silently."""
    from hyflow.config.schema.distillation import INFERENCE_DEFAULTS, INFERENCE_PERFORMANCE_ONLY

    if not cfg.distillation.enabled:
        return []
    lines = []
    for name, entry in teacher_models(cfg).items():
        inference = entry["inference"]
        given = sorted(key for key in INFERENCE_PERFORMANCE_ONLY if inference.get(key) != INFERENCE_DEFAULTS.get(key))
        if given:
            lines.append(f"hyflow: distillation.teacher_models.{name}.inference.{{{', '.join(given)}}} only change "
                         "the teacher engine's speed or memory (the teacher's scores are the same); accepted as "
                         "performance hints")
    return lines


def distillation_loss_spec(cfg: HyflowConfig) -> DistillationLossSpec | None:
    """The actor's distillation term (`hyflow.specs.DistillationLossSpec`), None without distillation."""
    if not cfg.distillation.enabled:
        return None
    loss = cfg.distillation.distillation_loss
    return DistillationLossSpec(
        loss_mode=loss.loss_mode, topk=loss.topk, use_task_rewards=loss.use_task_rewards,
        distillation_loss_coef=loss.distillation_loss_coef, loss_max_clamp=loss.loss_max_clamp,
        log_prob_min_clamp=loss.log_prob_min_clamp, use_policy_gradient=loss.use_policy_gradient,
        policy_loss_mode=loss.policy_loss_mode,
        policy_loss_kwargs={"clip_ratio": loss.clip_ratio, "clip_ratio_low": loss.clip_ratio_low,
                            "clip_ratio_high": loss.clip_ratio_high})


def uses_judge(cfg: HyflowConfig) -> bool:
    """Whether the config asks for a reward-model engine (`reward_model.rollout.name` with reward_model.enable).
    verl serves discriminative and generative reward models alike through it; the trainer tells them apart by the
    model's architecture (`hyflow.models.loading.is_score_model`): a causal LM becomes a judge, a classifier is
    scored by hyflow's own forward."""
    return bool(cfg.reward_model.enable and cfg.reward_model.rollout.name)


def judge_spec(cfg: HyflowConfig) -> JudgeSpec:
    """The judge worker's spec (`hyflow.specs.JudgeSpec`) from `reward_model.model.path` and `reward_model.rollout`."""
    rm, r = cfg.reward_model, cfg.reward_model.rollout
    overrides = {"dtype": r.dtype, "gpu_memory_utilization": r.gpu_memory_utilization,
                 "enforce_eager": r.enforce_eager, "max_model_len": r.max_model_len or r.prompt_length + r.response_length,
                 "engine_kwargs": dict(r.engine_kwargs or {}), "seed": r.seed, "prompt_length": r.prompt_length,
                 "response_length": r.response_length, "max_num_batched_tokens": r.max_num_batched_tokens,
                 "enable_chunked_prefill": r.enable_chunked_prefill, "enable_prefix_caching": r.enable_prefix_caching,
                 "disable_log_stats": r.disable_log_stats, "cudagraph_capture_sizes": r.cudagraph_capture_sizes,
                 "tensor_model_parallel_size": 1}  # a whole judge per device
    return JudgeSpec(model=ModelSpec(rm.model.path, trust_remote_code=rm.model.trust_remote_code,
                                     config_key="reward_model.model.path"),
                     engine=r.name, dtype=r.dtype, max_num_seqs=r.max_num_seqs, overrides=overrides,
                     device=cfg.trainer.device, rollout=cfg.actor_rollout_ref.rollout)
