"""Which config keys hyflow accepts without acting on them: the one table of "not supported yet" and
"performance-only" keys.

The typed schemas (`HyflowConfig`, `SFTConfig`) hold the keys hyflow reads. The keys of verl's config that
hyflow accepts without acting on them, or refuses, are entries here; most are no schema leaves at all (the
loader accepts them by their entry and keeps their values beside the config: `declared_values`, compared with
verl's default kept below), and a few are leaves because their decision needs a value the code reads (an entry
with an `asked` predicate, or a leaf the code reads elsewhere). Every verl key is exactly one of:

- read by the code that runs (a schema leaf, no entry here);
- `NOT_SUPPORTED`: a verl feature hyflow has not built, or a knob that would change results and that hyflow
  cannot honour. Asking for it (a non-default value, or what the entry's `asked` predicate says) is a
  ConfigError `"<key> is not supported by this hyflow version yet (got VALUE): <reason>"`;
- `PERFORMANCE_ONLY`: a knob that only changes speed or memory (or that only matters for a feature that is off
  or refused elsewhere), so hyflow's results are the same whatever it holds. Setting it is accepted, and the
  trainer prints one line at start naming every such key that was set (`performance_only_warning`).

`tests/config/test_key_support.py` walks every leaf of both schemas and fails on a key that is in neither this
table nor read by hyflow's code, on an entry here that names a key the code reads, and on an entry without a
predicate that is also a schema leaf (but for the few it lists, with the code that reads them).

The verl-0.10-names module (`hyflow.config.verl_compat`, when present) adds its own entries through two dicts,
`PERFORMANCE_ONLY_KEYS` and `NOT_SUPPORTED_KEYS` (key -> reason); they are merged in below.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hyflow.config.catalog import engine_capabilities, splits_model, stream_serves
from hyflow.config.engine_compat import ENGINES as ENGINE_NAMES
from hyflow.config.engine_compat import ROLES as ENGINE_ROLES
from hyflow.specs import FSDP2_STRATEGIES

NOT_SUPPORTED = "not_supported"
PERFORMANCE_ONLY = "performance_only"

RL, SFT = "rl", "sft"

WARNING_PREFIX = "hyflow: performance-only key(s) accepted, results unchanged:"


@dataclass(frozen=True)
class KeySupport:
    """One key that hyflow accepts by name but does not act on.

    `asked(cfg) -> bool` says whether the config asks for the key's effect; None = its value differs from the
    schema's default. `schema` is RL (`HyflowConfig`) or SFT (`SFTConfig`).
    """

    key: str
    kind: str
    reason: str
    asked: Callable[[Any], bool] | None = None
    schema: str = RL


def _unsupported(key: str, reason: str, asked: Callable[[Any], bool] | None = None, schema: str = RL) -> KeySupport:
    return KeySupport(key, NOT_SUPPORTED, reason, asked, schema)


def _performance(key: str, reason: str, asked: Callable[[Any], bool] | None = None, schema: str = RL) -> KeySupport:
    return KeySupport(key, PERFORMANCE_ONLY, reason, asked, schema)


ARR = "actor_rollout_ref"
FSDP_SECTIONS = (f"{ARR}.actor.fsdp_config", f"{ARR}.ref.fsdp_config", "critic.model.fsdp_config",
                 "reward_model.model.fsdp_config")
# The role whose devices an FSDP section shards over (for fsdp_size: -1 or that many devices is plain FSDP).
_FSDP_ROLE = {f"{ARR}.actor.fsdp_config": None, f"{ARR}.ref.fsdp_config": None,
              "critic.model.fsdp_config": "critic", "reward_model.model.fsdp_config": "reward_model"}

LEAVE = "leave it at its default"
ONLY_WITH_LORA = "a LoRA setting: only read when lora_rank > 0 (or lora_adapter_path is set), and LoRA is off"
VLLM_ONLY = "a vllm engine knob; the hf engine (rollout.name=hf) does not use it and generates the same samples"


def _lora_off(section: str, key: str) -> Callable[[Any], bool]:
    """True when `section.key` was changed from its default while the section trains without LoRA."""
    def off(cfg: Any) -> bool:
        return (not lookup(cfg, f"{section}.lora_rank") and not lookup(cfg, f"{section}.lora_adapter_path")
                and non_default(cfg, f"{section}.{key}"))
    return off


# The strategy key of the role an FSDP section belongs to (the reward model runs unwrapped: a full copy per rank).
_FSDP_STRATEGY = {f"{ARR}.actor.fsdp_config": f"{ARR}.actor.strategy", f"{ARR}.ref.fsdp_config": f"{ARR}.ref.strategy",
                  "critic.model.fsdp_config": "critic.strategy", "reward_model.model.fsdp_config": None}


def _section_devices(cfg: Any, section: str) -> int:
    """The devices the role of an FSDP section runs on."""
    from hyflow.config.arithmetic import role_devices, total_devices

    role = _FSDP_ROLE[section]
    return total_devices(cfg) if role is None else role_devices(cfg, role)


def _fsdp_size_asked(section: str) -> Callable[[Any], bool]:
    def asked(cfg: Any) -> bool:  # anything but -1 or all the role's devices is hybrid sharding (HSDP)
        return lookup(cfg, f"{section}.fsdp_size") not in (-1, _section_devices(cfg, section))

    return asked


def _offload_policy_without_fsdp2(section: str) -> Callable[[Any], bool]:
    """offload_policy for a role that runs without the FSDP2 wrapper: one device (the model runs unwrapped), DDP,
    or the reward model."""
    def asked(cfg: Any) -> bool:
        strategy = _FSDP_STRATEGY[section]
        return bool(lookup(cfg, f"{section}.offload_policy")) and (
            strategy is None or lookup(cfg, strategy) not in FSDP2_STRATEGIES or _section_devices(cfg, section) < 2)

    return asked


def _set(key: str) -> Callable[[Any], bool]:
    return lambda cfg: bool(lookup(cfg, key))


def _fsdp_entries() -> list[KeySupport]:
    entries = []
    for s in FSDP_SECTIONS:
        entries += [
            _unsupported(f"{s}.offload_policy", "FSDP2's CPUOffloadPolicy is an option of the FSDP2 wrapper, which a "
                         "role has only with strategy fsdp/fsdp2 on 2 or more devices (one device runs the model "
                         "unwrapped, the reward model is a full copy on each rank); use param_offload / "
                         "optimizer_offload there", _offload_policy_without_fsdp2(s)),
            _unsupported(f"{s}.wrap_policy.min_num_params", "hyflow always wraps each transformer layer; " + LEAVE),
            _unsupported(f"{s}.seed", "hyflow seeds model set-up with trainer.seed; set trainer.seed instead"),
            _performance(f"{s}.forward_prefetch", "FSDP2 prefetch order only changes overlap, not the numbers"),
            _performance(f"{s}.use_orig_params", "an FSDP1 option; FSDP2 always keeps the original parameters"),
        ]
    # The actor's and the critic's offload keys and the reference's param_offload are read (hyflow.config.roles);
    # these three have nothing to act on.
    rm = "reward_model.model.fsdp_config"
    entries.append(_unsupported(f"{rm}.fsdp_size", "the reward model runs unwrapped (a full copy on each rank): "
                                "there is no shard group to size; use -1", _fsdp_size_asked(rm)))
    entries += [
        _performance(f"{rm}.param_offload", "the reward model's worker keeps its frozen model on the device (no "
                     "offload): the same scores, more device memory", _set(f"{rm}.param_offload")),
        *(_performance(f"{s}.optimizer_offload", "a frozen model has no optimizer: nothing to offload",
                       _set(f"{s}.optimizer_offload")) for s in (f"{ARR}.ref.fsdp_config", rm)),
    ]
    for s in FSDP_SECTIONS[:3]:  # the reward model reads its model_dtype; the trained roles keep fp32 masters
        entries.append(_unsupported(f"{s}.model_dtype", "hyflow keeps fp32 master weights for this role "
                                    "(mixed precision follows fsdp_config.dtype); use fp32",
                                    lambda cfg, s=s: lookup(cfg, f"{s}.model_dtype") not in ("fp32", "float32")))
    return entries


def _engine_kwargs_unsupported(cfg: Any) -> bool:
    """Engine arguments for the running engine when it takes none (hf; vllm passes engine_kwargs.vllm to vllm.LLM)."""
    name = cfg.actor_rollout_ref.rollout.name
    return not _reads(cfg, "engine_kwargs") and bool(dict(cfg.actor_rollout_ref.rollout.engine_kwargs or {}).get(name))


def _engine_kwargs_irrelevant(cfg: Any) -> bool:
    """Arguments for other engines (vllm, sglang, trtllm while hf runs): they have nothing to act on."""
    kwargs = dict(cfg.actor_rollout_ref.rollout.engine_kwargs or {})
    return any(v for k, v in kwargs.items() if k != cfg.actor_rollout_ref.rollout.name)


def _rollout_engine(cfg: Any) -> Any | None:
    """The running rollout engine's declared capabilities (None: no catalog, or an engine not registered)."""
    return engine_capabilities(cfg.actor_rollout_ref.rollout.name)


def _reads(cfg: Any, key: str) -> bool:
    """Whether the running engine reads rollout key `key` (True when nothing is known of it: no note then)."""
    caps = _rollout_engine(cfg)
    return caps is None or key in caps.knobs


def _one_copy_per_device(cfg: Any) -> bool:
    """The running engine holds one full copy of the model per device (reads no tensor-parallel size: hf)."""
    caps = _rollout_engine(cfg)
    return caps is not None and not splits_model(caps)


def _splits_model(cfg: Any) -> bool:
    """The running engine splits a model over devices (tensor_model_parallel_size: vllm)."""
    caps = _rollout_engine(cfg)
    return caps is not None and splits_model(caps)


def _engine_knob(key: str, reason: str = VLLM_ONLY) -> KeySupport:
    """A setting of the engines that declare it as a knob (vllm's); an engine that does not read it (hf) generates
    the same samples without it (speed/memory only)."""
    return _performance(f"{ARR}.rollout.{key}", reason,
                        lambda cfg: non_default(cfg, f"{ARR}.rollout.{key}") and not _reads(cfg, key))


def _pipelined(cfg: Any, *roles: str) -> bool:
    """Some of `roles` runs pipeline-parallel (its pipeline_parallel_size > 1)."""
    return any((lookup(cfg, f"{role}.pipeline_parallel_size") or 1) > 1 for role in roles)


_PADDED = ("pipeline parallelism runs the padded micro-batch (its schedule needs one shape): the same log-probs and "
           "gradients as ")


def _pipeline_padded(key: str, what: str, *roles: str) -> KeySupport:
    """A packing setting of a pipeline-parallel role: true, it does not change what that role's passes run."""
    return _performance(key, _PADDED + what, lambda cfg: bool(lookup(cfg, key)) and _pipelined(cfg, *roles))


def _vllm_parallel(key: str) -> KeySupport:
    """Engine parallelism hyflow's vllm engine lacks (data, expert, pipeline); nothing to act on for hf."""
    return _unsupported(f"{ARR}.rollout.{key}", "hyflow's vllm engine runs one engine per device or one "
                        "tensor-parallel engine over all the actor's devices (no data, expert or pipeline "
                        "parallelism inside an engine yet); use 1",
                        lambda cfg: _rollout_engine(cfg) is not None and key in _rollout_engine(cfg).knobs
                        and lookup(cfg, f"{ARR}.rollout.{key}") != 1)


def _vllm_tensor_parallel_unbuilt(cfg: Any) -> bool:
    """vllm with tensor_model_parallel_size other than 1 or all the actor's devices (engine DP is not built)."""
    from hyflow.config.arithmetic import total_devices

    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    return _splits_model(cfg) and tp not in (1, total_devices(cfg))


R, A, M = f"{ARR}.rollout", f"{ARR}.actor", f"{ARR}.model"

_TABLE: list[KeySupport] = [
    # ------------------------------------------------------------------ pipeline-parallel roles' packing settings
    _pipeline_padded(f"{ARR}.model.use_remove_padding", "packed rows, more padding to compute", f"{ARR}.actor",
                     f"{ARR}.ref"),
    _performance(f"{ARR}.actor.use_prefix_grouper", "hyflow shares a prompt among its samples inside packed "
                 "micro-batches; padded ones (model.use_remove_padding=false, or pipeline parallelism's stages) run "
                 "every sample's prompt: the same log-probs and gradients, more prompt tokens to compute",
                 lambda cfg: bool(lookup(cfg, f"{ARR}.actor.use_prefix_grouper")) and (
                     not lookup(cfg, f"{ARR}.model.use_remove_padding") or _pipelined(cfg, f"{ARR}.actor", f"{ARR}.ref"))),
    *(_performance(f"{role}.pad_to_length", "pads packed micro-batches to fixed shapes (verl's FSDP engine): speed "
                   "only; hyflow packs each micro-batch to its own length")
      for role in (f"{ARR}.actor", f"{ARR}.ref")),
    _pipeline_padded("critic.model.use_remove_padding", "packed rows, more padding to compute", "critic"),
    # ------------------------------------------------------------------ features not built yet
    *(_unsupported(f"{role}.optim.clip_grad", f"hyflow clips gradients at {role}.grad_clip; set that instead",
                   lambda cfg, role=role: non_default(cfg, f"{role}.optim.clip_grad")
                   and lookup(cfg, f"{role}.optim.clip_grad") != lookup(cfg, f"{role}.grad_clip"))
      for role in (A, "critic")),
    _unsupported("reward_model.model.optim.clip_grad", "PRIME's implicit PRM clips gradients at "
                 "reward_model.model.optim.grad_clip (verl-recipe prime's key); set that instead",
                 lambda cfg: non_default(cfg, "reward_model.model.optim.clip_grad")),
    _unsupported(f"{M}.use_liger", "Liger kernels are not wired; " + LEAVE),
    _unsupported(f"{M}.enable_activation_offload", "activation offload is not built yet; " + LEAVE),
    _unsupported("critic.model.enable_activation_offload", "activation offload is not built yet; " + LEAVE),
    _unsupported(f"{R}.multi_turn.function_tool_path", "@function_tool files are not built; declare BaseTool "
                 "classes in multi_turn.tool_config_path; " + LEAVE),
    _unsupported(f"{R}.multi_turn.use_inference_chat_template", "hyflow trains on the token ids the rollout "
                 "produced (token in, token out), never on a re-rendered conversation; use false",
                 lambda cfg: lookup(cfg, f"{R}.multi_turn.use_inference_chat_template") is not False),
    _unsupported(f"{R}.agent.custom_async_server.name", "custom async servers are not built: the agent loop runs "
                 "on the rollout engine (rollout.name); " + LEAVE),
    _unsupported(f"{R}.agent.custom_async_server.path", "custom async servers are not built: the agent loop runs "
                 "on the rollout engine (rollout.name); " + LEAVE),
    _unsupported(f"{R}.multi_turn.enable", "multi-turn rollouts on a tensor-parallel vllm engine spanning several "
                 "ranks are not built (its ranks would have to decode every turn in lockstep); use "
                 "tensor_model_parallel_size=1 (one engine per device) or the hf engine",
                 lambda cfg: cfg.actor_rollout_ref.rollout.multi_turn.enable
                 and _rollout_engine(cfg) is not None
                 and not stream_serves(_rollout_engine(cfg), cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)),
    _unsupported(f"{A}.checkpoint.async_save", "checkpoints are written synchronously; " + LEAVE),
    _unsupported("critic.checkpoint.async_save", "checkpoints are written synchronously; " + LEAVE),
    _unsupported("trainer.default_hdfs_dir", "HDFS copies are not built yet; " + LEAVE),
    _unsupported("trainer.del_local_ckpt_after_load", "it needs default_hdfs_dir, which is not built yet; " + LEAVE),
    _unsupported("reward_model.sandbox_fusion.url", "Sandbox Fusion is not wired; code runs in hyflow's local "
                 "sandbox; " + LEAVE),
    *(_unsupported(f"data.sampler.{k}", "custom (curriculum) samplers are not built yet (verl 0.10 removed its "
                   "own, verl#6302); order the data with data.shuffle/data.seed or a data.custom_cls dataset; " + LEAVE)
      for k in ("class_path", "class_name")),
    _unsupported(f"{M}.hf_config_path", "the model's config.json is read from actor_rollout_ref.model.path; "
                 + LEAVE),
    _unsupported(f"{R}.nnodes", "a standalone rollout on devices of its own is the top-level rollout.nnodes / "
                 "rollout.n_gpus_per_node in hyflow (verl's fully-async rollout.nnodes / n_gpus_per_node); set "
                 "those and leave this at 0 (colocated)", lambda cfg: lookup(cfg, f"{R}.nnodes") > 0),
    _unsupported(f"{R}.n_gpus_per_node", "verl reads it only for a standalone rollout (rollout.nnodes > 0); set "
                 "the top-level rollout.n_gpus_per_node instead",
                 lambda cfg: lookup(cfg, f"{R}.nnodes") > 0 and lookup(cfg, f"{R}.n_gpus_per_node") is not None),
    _unsupported(f"{R}.ignore_eos", "generation always stops at end-of-sequence; " + LEAVE),
    _unsupported("data.tool_config_path", "hyflow puts the schemas of actor_rollout_ref.rollout.multi_turn."
                 "tool_config_path into the prompts' chat template; set that key instead"),
    _unsupported("data.tokenizer", "hyflow tokenizes prompts with the policy's tokenizer; set "
                 "actor_rollout_ref.model.tokenizer_path instead"),
    _unsupported(f"{ARR}.hybrid_engine", "actor, rollout and reference always share devices in hyflow; use true",
                 lambda cfg: cfg.actor_rollout_ref.hybrid_engine is not True),
    _unsupported(f"{M}.external_lib", "only reward_model.model.external_lib is imported so far; import your "
                 "module in a .pth file or sitecustomize instead"),
    _unsupported("critic.model.external_lib", "only reward_model.model.external_lib is imported so far; import "
                 "your module in a .pth file or sitecustomize instead"),
    _unsupported(f"{R}.engine_kwargs", "the running engine's entry (engine_kwargs.<rollout.name>) must be empty: "
                 "the hf engine takes no engine arguments (engine_kwargs.vllm goes to vllm.LLM with "
                 "rollout.name=vllm)", _engine_kwargs_unsupported),
    _unsupported(f"{R}.tensor_model_parallel_size", "hyflow's vllm engine runs one engine per device (1) or one "
                 "tensor-parallel engine over all the actor's devices (trainer.nnodes x n_gpus_per_node); several "
                 "engines of several devices each (engine data parallelism) is not built yet",
                 _vllm_tensor_parallel_unbuilt),
    *(_vllm_parallel(k) for k in ("data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size")),
    _unsupported(f"{R}.logprobs_mode", "the trainer recomputes log_softmax(logits / T), which is vLLM's "
                 "processed_logprobs; the raw modes (before temperature) would make rollout_log_probs and rollout "
                 "correction compare different quantities; use processed_logprobs"),
    *_fsdp_entries(),
    # ------------------------------------------------------------------ speed / memory only
    _performance(f"{R}.engine_kwargs", "arguments for engines other than the running one (rollout.name): not "
                 "used", _engine_kwargs_irrelevant),
    _performance(f"{R}.mode", "verl 0.10 has only async (server) rollouts; hyflow's engine decodes each batch "
                 "in one call either way and single-turn samples are the same"),
    _performance(f"{R}.tensor_model_parallel_size", "the hf engine runs one full copy per device",
                 lambda cfg: _one_copy_per_device(cfg) and lookup(cfg, f"{R}.tensor_model_parallel_size") != 1),
    _performance("reward_model.rollout.tensor_model_parallel_size", "hyflow runs a whole judge on each of its "
                 "devices; splitting it changes memory and speed, not its answers",
                 lambda cfg: cfg.reward_model.rollout.tensor_model_parallel_size != 1),
    *(_engine_knob(k) for k in ("gpu_memory_utilization", "enforce_eager", "data_parallel_size",
                              "expert_parallel_size", "pipeline_model_parallel_size", "max_num_batched_tokens",
                              "max_model_len", "enable_chunked_prefill", "enable_prefix_caching", "load_format")),
    _engine_knob("disable_log_stats", "a vllm logging knob; the hf engine has no statistics log"),
    _engine_knob("cudagraph_capture_sizes", "a vllm CUDA-graph knob (speed only); the hf engine has none"),
    _performance("reward_model.strategy", "hyflow runs a full copy of the reward model on each of its ranks "
                 "(inference only: the same scores as sharded)",
                 lambda cfg: cfg.reward_model.strategy != cfg.actor_rollout_ref.actor.strategy),
    _performance("reward_model.model.fsdp_config.reshard_after_forward", "the reward model is not sharded (see "
                 "reward_model.strategy)"),
    _performance(f"{M}.use_fused_kernels", "hyflow computes log-probs and entropy from the lm_head in "
                 "checkpointed row chunks (hyflow.models.forward.lm_head_logprobs) whenever the full logits would "
                 "exceed 2^24 elements, which is what the fused kernel is for: same values"),
    _performance(f"{M}.fused_kernel_options.impl_backend", "only for use_fused_kernels (see there)"),
    _performance(f"{A}.entropy_from_logits_with_chunking", "hyflow always computes entropy in row chunks; same "
                 "values"),
    _performance(f"{A}.entropy_checkpointing", "hyflow always recomputes each chunk's logits in the backward pass "
                 "(checkpointed); same values"),
    _performance(f"{A}.calculate_entropy", "hyflow computes entropy when the loss or its metrics need it; "
                 "training is the same"),
    _performance(f"{A}.calculate_sum_pi_squared", "hyflow computes sum_pi_squared whenever the advantage estimator "
                 "requires it (optimal_token_baseline), and only then"),
    _performance("reward_model.overlong_buffer.log", "hyflow always records the overlong penalty per sample "
                 "(reward/overlong_reward/mean, reward/overlong/mean) when the buffer is on"),
    _performance("critic.model.tokenizer_path", "the critic reads the policy's token ids; no second tokenizer is "
                 "loaded"),
    _performance(f"{M}.use_shm", "copying the model to /dev/shm only speeds up loading"),
    _performance("data.use_shm", "copying the data to /dev/shm only speeds up loading"),
    _performance("data.dataloader_num_workers", "hyflow batches prompts in the main process (each prompt is "
                 "tokenized once and cached); the batches are the same"),
    _performance("data.filter_overlong_prompts_workers", "filtering runs in one process; same prompts kept"),
    _unsupported("async_training.require_batches", "a hyflow asynchronous step trains on data.train_batch_size "
                 "prompts, as a synchronous one does; size the step with data.train_batch_size (and "
                 "ppo_mini_batch_size) and " + LEAVE),
    _performance("async_training.use_trainer_do_validate", "hyflow validates on the trainer's workers with its "
                 "current weights in every mode; the key only says where verl validates"),
    _performance("reward_model.launch_reward_fn_async", "scoring in the background overlaps time only; the "
                 "rewards are the same (reward_model.num_workers parallelises scoring)"),
    _performance(f"{A}.optim.total_training_steps", "filled in by the trainer from the run length (verl "
                 "overwrites it too)"),
    _performance("critic.optim.total_training_steps", "filled in by the trainer from the run length (verl "
                 "overwrites it too)"),
    *(_performance(f"{M}.{k}", ONLY_WITH_LORA, _lora_off(M, k)) for k in ("lora_alpha", "target_modules",
                                                                           "exclude_modules")),
    *(_performance(f"model.{k}", ONLY_WITH_LORA, _lora_off("model", k), schema=SFT)
      for k in ("lora_alpha", "target_modules", "exclude_modules")),
    _unsupported("engine.offload_policy", "FSDP2's CPUOffloadPolicy is an option of the FSDP2 wrapper, which SFT "
                 "has only with engine.strategy fsdp/fsdp2 on 2 or more devices (one device runs the model "
                 "unwrapped); use engine.param_offload / engine.optimizer_offload there",
                 lambda cfg: bool(lookup(cfg, "engine.offload_policy")) and (
                     lookup(cfg, "engine.strategy") not in ("fsdp", "fsdp2")
                     or lookup(cfg, "trainer.nnodes") * lookup(cfg, "trainer.n_gpus_per_node") < 2), schema=SFT),
    *(_performance(f"critic.model.{k}", ONLY_WITH_LORA, _lora_off("critic.model", k))
      for k in ("lora_alpha", "target_modules", "exclude_modules")),
    *(_performance(f"data.{k}", "an extra batch column that hyflow's reward model and rollout do not need "
                   "(they re-template from the prompt themselves)")
      for k in ("return_raw_input_ids", "return_raw_chat", "return_full_prompt")),
    _performance("data.return_multi_modal_inputs", "hyflow always carries a vision-language prompt's processed "
                 "images in the batch (the rollout and the trainer's forward need them); the same samples either way"),
    *(_performance(f"{R}.multi_turn.{k}", "only read by the tool agent loop, which runs with multi_turn.enable=true",
                   lambda cfg, k=k: not cfg.actor_rollout_ref.rollout.multi_turn.enable
                   and non_default(cfg, f"{R}.multi_turn.{k}"))
      for k in ("max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length",
                "tool_response_truncate_side", "interaction_config_path", "format", "tool_timeout",
                "max_env_observation_length")),
    *(_performance(f"reward_model.sandbox_fusion.{k}", "only used with sandbox_fusion.url, which is not "
                   "supported yet") for k in ("max_concurrent", "memory_limit_mb")),
]


def _engine_entry(key: str, kind: str, reason: str, test) -> KeySupport:
    """A table entry of `hyflow.config.engine_compat`'s rule: asked when `test` of the key's value says so."""
    asked = None if test is None else (lambda cfg: bool(test(value_of(cfg, key))))
    return KeySupport(key, kind, reason, asked)


def _merged_table() -> tuple[KeySupport, ...]:
    """hyflow's own entries plus those of `hyflow.config.verl_compat` (verl 0.10's names)."""
    import hyflow.config.verl_compat as compat
    from hyflow.config.engine_compat import ENGINE_ENTRIES

    entries = list(_TABLE) + [_engine_entry(*rule) for rule in ENGINE_ENTRIES]
    own = {(e.key, e.kind, e.schema) for e in entries}
    for schema, kind, extra in ((RL, PERFORMANCE_ONLY, compat.PERFORMANCE_ONLY_KEYS),
                                (RL, NOT_SUPPORTED, compat.NOT_SUPPORTED_KEYS),
                                (SFT, PERFORMANCE_ONLY, compat.SFT_PERFORMANCE_ONLY_KEYS),
                                (SFT, NOT_SUPPORTED, compat.SFT_NOT_SUPPORTED_KEYS)):
        entries += [KeySupport(key, kind, reason, None, schema) for key, reason in extra.items()
                    if (key, kind, schema) not in own]
    return tuple(entries)


@functools.cache
def table() -> tuple[KeySupport, ...]:
    """The declared table (hyflow's entries, then verl_compat's)."""
    return _merged_table()


# ------------------------------------------------------------------------------ keys the schema does not hold
#
# Most entries name keys that the typed schema does not hold at all (hyflow reads nothing there). The loader
# (`hyflow.config.loader`) accepts such a key by its entry, records its value beside the config
# (`declared_values(cfg)`: entry key -> value; a key below an entry, `...tool_config.torch.contents`, is merged
# into its entry's value) and leaves it out of the dataclasses, so the run directory's config.yaml omits it.
# Its value asks for the entry's effect when it differs from verl's default below. The entries whose decision
# needs a value the code also reads (LoRA knobs while LoRA is off, vllm knobs under the hf engine, HSDP sizes,
# ...) name schema leaves and carry a predicate (`asked`).

# verl's profiler tool_config sub-dicts and global_profiler.global_tool_config (verl's defaults).
_PROFILER_TOOL_CONFIG = {"nsys": {"discrete": False}, "npu": {"contents": [], "level": "level0", "analysis": True,
                         "discrete": False}, "torch": {"contents": [], "discrete": False},
                         "torch_memory": {"trace_alloc_max_entries": 100000, "stack_depth": 32},
                         "precision_debugger": {"config_path": None, "steps": None, "stages": None, "strict": False}}
_PROFILER_TOOL_CONFIG["torch"]["schedule"] = {"skip_first": 0, "wait": 0, "warmup": 0, "active": 0, "repeat": 0}
_NSIGHT_OPTIONS = {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph"}
_GLOBAL_TOOL_CONFIG = {
    "nsys": {"discrete": False, "controller_nsight_options": dict(_NSIGHT_OPTIONS),
             "worker_nsight_options": {**_NSIGHT_OPTIONS, "capture-range": "cudaProfilerApi",
                                       "capture-range-end": None, "kill": "none"}},
    "torch_memory": {"trace_alloc_max_entries": 100000, "stack_depth": 32, "context": "all", "stacks": "all",
                     "kw_args": {}},
    "precision_debugger": {"config_path": None, "steps": None, "stages": None, "strict": False}}

# verl's default of every entry the schema does not hold, by the key's last segment (one dotted key where two
# entries of one name differ).
_VERL_DEFAULTS: dict[str, Any] = {
    **dict.fromkeys((
        "all_ranks", "async_save", "calculate_entropy", "calculate_sum_pi_squared",
        "del_local_ckpt_after_load", "enable", "enable_activation_offload", "entropy_checkpointing",
        "entropy_from_logits_with_chunking", "finish_hook_all_ranks", "forward_prefetch",
        "full_determinism", "ignore_eos", "launch_reward_fn_async", "layered_summon",
        "log", "merge", "multi_stage_wake_up", "offload_policy", "optimizer_offload", "pad_to_length",
        "param_offload",
        "profile_continuous_steps", "relocate_results", "return_full_prompt", "return_raw_input_ids",
        "use_fused_kernels", "use_liger", "use_orig_params", "use_remove_padding", "use_shm",
        "use_trainer_do_validate"), False),
    **dict.fromkeys((
        "class_name", "class_path", "custom_backend_module", "default_hdfs_dir", "external_lib",
        "finish_hook_cmd", "function_tool_path", "hf_config_path", "name", "num_repeat_rollouts", "path",
        "reward_loop_module_path", "save_path", "steps", "tokenizer", "tokenizer_path", "tool",
        "tool_config_path", "torch_dtype", "url"), None),
    **dict.fromkeys((
        "return_multi_modal_inputs", "return_raw_chat", "skip_tokenizer_init", "strict",
        "use_torch_compile", "zero_indexed_step"), True),
    "backend": "naive", "dataloader_num_workers": 8, "num_workers": 8, "engine_kwargs": {},
    "filter_overlong_prompts_workers": 1, "require_batches": 1, "ulysses_sequence_parallel_size": 1,
    "finish_hook_ranks": [], "ranks": [], "fsdp_size": -1, "total_training_steps": -1,
    "impl_backend": "torch", "logprobs_mode": "processed_logprobs", "max_concurrent": 64, "memory_limit_mb":
    1024, "min_num_params": 0, "mode": "async", "model_dtype": "fp32", "nccl_timeout": 600, "over_sample_rate":
    0.0, "pad_mode": "no_padding", "reward_loop_class_name": "custom_reward_manager", "reward_loop_source":
    "register", "scheduling_policy": "fcfs", "seed": 42, "use_legacy_worker_impl": "auto",
    "global_tool_config": _GLOBAL_TOOL_CONFIG,
    # the profiler tool_config entries the schema does not hold (its `torch.contents` it does)
    **{tool: _PROFILER_TOOL_CONFIG[tool] for tool in ("nsys", "npu", "torch_memory", "precision_debugger")},
    "discrete": False, "profile_token_start": None, "profile_token_end": None,
    "schedule": _PROFILER_TOOL_CONFIG["torch"]["schedule"],
}
_VERL_DEFAULTS_BY_KEY: dict[str, Any] = {
    "global_profiler.save_path": "outputs/profile",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": False,
    # verl's reward.yaml: the judge engine's keys hyflow does not hold (their leaf names are the actor rollout's)
    **{f"reward_model.rollout.{leaf}": value for leaf, value in {
        "free_cache_engine": True, "data_parallel_size": 1, "expert_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "layered_summon": False, "scheduling_policy": "fcfs",
        "multi_stage_wake_up": False, "limit_images": None, "skip_tokenizer_init": False,
        "full_determinism": False, "ignore_eos": False, "quantization": None, "quantization_config_file": None,
        "mtp": None, "disaggregation.enabled": False, "disaggregation.prefill_replicas": 1,
        "disaggregation.decode_replicas": 1, "disaggregation.decode_tensor_model_parallel_size": None,
        "disaggregation.transfer_backend": "nixl", "disaggregation.bootstrap_port": None,
        "disaggregation.ib_device": None}.items()},
}

DECLARED = "_declared_keys"  # the config's instance attribute (not a field) that holds declared_values(cfg)


def verl_default(key: str) -> Any:
    """verl's default value of the table key `key` that the schema does not hold (a fresh copy)."""
    if key in _VERL_DEFAULTS_BY_KEY:
        return copy.deepcopy(_VERL_DEFAULTS_BY_KEY[key])
    from hyflow.config.engine_compat import ENGINE_DEFAULTS

    if key in ENGINE_DEFAULTS:  # verl's Megatron / VeOmni engine keys
        return copy.deepcopy(ENGINE_DEFAULTS[key])
    return copy.deepcopy(_VERL_DEFAULTS[key.rsplit(".", 1)[-1]])


def in_schema(entry: KeySupport, root: type) -> bool:
    """Whether the root dataclass `root` of `entry`'s schema holds `entry`'s key (an entry with a predicate on a
    value hyflow also reads, or a leaf the code reads elsewhere)."""
    return _resolves(_default(root), entry.key)


@functools.cache
def _outside(root: type) -> dict[str, KeySupport]:
    name = _name_of(root)
    return {e.key: e for e in table() if e.schema == name and not in_schema(e, root)}


def outside_keys(root: type) -> tuple[str, ...]:
    """The table keys that the root dataclass `root` (HyflowConfig or SFTConfig) does not hold."""
    return tuple(_outside(root))


def outside_entry(key: str, root: type) -> KeySupport | None:
    """The entry that accepts or refuses `key`, a key the root dataclass `root` does not hold: the entry of `key`
    itself or of a key above it (`...profiler.tool_config` for `...profiler.tool_config.torch.contents`)."""
    entries, parts = _outside(root), key.split(".")
    for i in range(len(parts), 0, -1):
        if (entry := entries.get(".".join(parts[:i]))) is not None:
            return entry
    return None


def holds_outside_entries(key: str, root: type) -> bool:
    """Whether entries `root` does not hold lie below `key` (`global_profiler`, a section the schema lacks)."""
    return any(k.startswith(key + ".") for k in _outside(root))


def declared_values(cfg: Any) -> dict[str, Any]:
    """The values `cfg` gives keys that the schema does not hold (entry key -> value), as the loader recorded them."""
    return vars(cfg).get(DECLARED, {})


def value_of(cfg: Any, key: str) -> Any:
    """The value of the table key `key` in `cfg`: the schema's, else the declared one, else verl's default."""
    if _resolves(cfg, key):
        return lookup(cfg, key)
    declared = declared_values(cfg)
    return declared[key] if key in declared else verl_default(key)


# ---------------------------------------------------------------------------------------- lookups


@functools.cache
def _default(root: type) -> Any:
    """The root dataclass built with its defaults (once per class)."""
    return root()


def _name_of(root: type) -> str:
    # the preference trainer's schema (DPOConfig) is built from the SFT schema's sections: SFT's entries apply
    return SFT if root.__name__ in ("SFTConfig", "DPOConfig") else RL


def schema_name(cfg: Any) -> str:
    """RL for a HyflowConfig, SFT for an SFTConfig."""
    return _name_of(type(cfg))


def lookup(cfg: Any, key: str) -> Any:
    """The value at dotted `key` (dataclass attributes, then dict items)."""
    node = cfg
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _resolves(cfg: Any, key: str) -> bool:
    try:
        lookup(cfg, key)
    except (AttributeError, KeyError, TypeError):
        return False
    return True


def non_default(cfg: Any, key: str) -> bool:
    """Whether `cfg`'s value of the schema key `key` differs from the schema's default."""
    value, default = lookup(cfg, key), lookup(_default(type(cfg)), key)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value) != dataclasses.asdict(default)
    return value != default


def is_asked(entry: KeySupport, cfg: Any) -> bool:
    """Whether `cfg` asks for `entry`'s key (its predicate, or a non-default value)."""
    if entry.schema != schema_name(cfg):
        return False
    if not _resolves(cfg, entry.key):  # a key the schema does not hold: given, and its predicate or a value other
        declared = declared_values(cfg)  # than verl's default asks
        if entry.key not in declared:
            return False
        return bool(entry.asked(cfg)) if entry.asked is not None else declared[entry.key] != verl_default(entry.key)
    return bool(entry.asked(cfg)) if entry.asked is not None else non_default(cfg, entry.key)


def _entries(cfg: Any, kind: str) -> Iterable[KeySupport]:
    return (e for e in table() if e.kind == kind and is_asked(e, cfg))


def not_supported_problems(cfg: Any) -> list[str]:
    """One message per not-supported key that `cfg` asks for (RL or SFT config)."""
    return [f"{e.key} is not supported by this hyflow version yet (got {_show(value_of(cfg, e.key))}): {e.reason}"
            for e in _entries(cfg, NOT_SUPPORTED)]


def performance_only_keys(cfg: Any) -> list[KeySupport]:
    """The performance-only entries whose keys `cfg` sets."""
    return list(_entries(cfg, PERFORMANCE_ONLY))


def performance_only_warning(cfg: Any) -> str | None:
    """The one line the trainers print at start naming every performance-only key set, or None."""
    entries = performance_only_keys(cfg)
    if not entries:
        return None
    return WARNING_PREFIX + " " + "; ".join(f"{e.key}={_show(value_of(cfg, e.key))} ({e.reason})" for e in entries)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)


# ------------------------------------------------------------------ verl's other engines (engine_compat)


def role_engine(cfg: Any, role: str) -> str:
    """The verl engine a role's keys are written for: its strategy when that names one, else `model_engine`."""
    strategy = lookup(cfg, f"{role}.strategy")
    return strategy if strategy in ENGINE_NAMES else getattr(cfg, "model_engine", "dp")


def engine_line(cfg: Any) -> str | None:
    """The start line for a run written for verl's Megatron, VeOmni or torchtitan engine (`model_engine` or a role's
    strategy), naming what runs instead and where its parallel keys went; None for verl's default (dp) engine."""
    roles = {role: role_engine(cfg, role) for role in ENGINE_ROLES}
    asked = sorted({engine for engine in roles.values() if engine in ENGINE_NAMES})
    if not asked:
        return None
    sizes = []
    for role in ENGINE_ROLES:
        parts = [f"{name}={lookup(cfg, f'{role}.{name}')}" for name in
                 ("tensor_parallel_size", "ulysses_sequence_parallel_size", "expert_parallel_size",
                  "pipeline_parallel_size", "virtual_pipeline_parallel_size")
                 if lookup(cfg, f"{role}.{name}") not in (None, 1)]
        fsdp_size = lookup(cfg, f"{ENGINE_ROLES[role]}.fsdp_size")
        if fsdp_size not in (None, -1):
            parts.append(f"fsdp_config.fsdp_size={fsdp_size}")
        if parts:
            sizes.append(f"{role.rsplit('.', 1)[-1]}: " + ", ".join(parts))
    return (f"hyflow: verl's {' and '.join(asked)} engine runs on hyflow's FSDP2 engine (hyflow.parallel); "
            "megatron tensor_model_parallel_size -> tensor_parallel_size (PyTorch tensor parallelism), "
            "context_parallel_size -> ulysses_sequence_parallel_size (Ulysses all-to-all: the same attention as "
            "Megatron's ring context parallelism, another communication pattern), expert_model_parallel_size and "
            "veomni expert_parallel_size -> expert_parallel_size, pipeline_model_parallel_size and "
            "virtual_pipeline_model_parallel_size -> pipeline_parallel_size and virtual_pipeline_parallel_size "
            "(torch.distributed.pipelining; the padded micro-batch, the same log-probs as the packed one), veomni "
            "fsdp_size -> fsdp_config.fsdp_size (HSDP), param/optimizer offload -> fsdp_config"
            + (f"; {'; '.join(sizes)}" if sizes else ""))
