"""verl's other training engines on hyflow's one engine: `model_engine=megatron|veomni|torchtitan` and the roles'
`strategy=megatron|veomni|torchtitan`, with their `<role>.megatron.*` / `<role>.veomni.*` keys.

verl picks a training engine per run (`model_engine`, a Hydra config group: dp = FSDP, megatron = Megatron-Core,
veomni, torchtitan). hyflow has one: FSDP2 with PyTorch tensor parallelism, Ulysses sequence parallelism, expert
parallelism and hybrid sharding on one device mesh (`hyflow.parallel`). A verl command line written for another
engine runs on it: its parallel sizes and offload switches are aliases of hyflow's keys (`ENGINE_ALIASES`, merged into
`hyflow.config.verl_compat.RL_ALIASES`), the engine's kernel, fusion and layout knobs are performance-only (the same
numbers), and what hyflow cannot honour is refused by name (`ENGINE_ENTRIES`, merged into `hyflow.config.support`'s
table). The trainer's start line says which keys mapped where (`hyflow.config.support.engine_line`).

Maps (Megatron -> hyflow): tensor_model_parallel_size -> tensor_parallel_size (PyTorch TP: each layer's attention
heads and MLP split, as Megatron's); context_parallel_size -> ulysses_sequence_parallel_size (the same attention over
a sequence cut across ranks, by all-to-all of heads instead of Megatron's ring of key/value blocks: same math, another
communication pattern); expert_model_parallel_size -> expert_parallel_size (`hyflow.parallel.expert`);
pipeline_model_parallel_size / virtual_pipeline_model_parallel_size -> pipeline_parallel_size /
virtual_pipeline_parallel_size (`hyflow.parallel.pipeline`: torch.distributed.pipelining's 1F1B or interleaved
schedule; the stage-split layout knobs are performance-only: hyflow splits the layers evenly);
param_offload / optimizer_offload -> fsdp_config.param_offload / optimizer_offload; dtype -> fsdp_config.dtype.
(VeOmni -> hyflow): fsdp_size -> fsdp_config.fsdp_size (HSDP), ulysses_parallel_size -> ulysses_sequence_parallel_size,
expert_parallel_size, param_offload / optimizer_offload, enable_full_shard -> fsdp_config.reshard_after_forward
(ZeRO-3 or ZeRO-2), enable_fsdp_offload -> fsdp_config.offload_policy.

Refused (not built): Megatron expert_tensor_parallel_size > 1 (experts split over tensor-parallel ranks), use_dist_checkpointing (initial weights
from a Megatron checkpoint), override_mcore_model_config (changes the model), MoE auxiliary / z-loss coefficients in
the loss, a router load-balancing type other than none, router replay; VeOmni mixed_precision=false,
load_checkpoint_path, full_determinism, another seed.
"""

from __future__ import annotations

from typing import Any

ARR = "actor_rollout_ref"
ENGINES = ("megatron", "veomni", "torchtitan")
# role -> its FSDP section in hyflow
ROLES = {f"{ARR}.actor": f"{ARR}.actor.fsdp_config", f"{ARR}.ref": f"{ARR}.ref.fsdp_config",
         "critic": "critic.model.fsdp_config"}

_MEGATRON_MAP = {"tensor_model_parallel_size": "tensor_parallel_size",
                 "context_parallel_size": "ulysses_sequence_parallel_size",
                 "expert_model_parallel_size": "expert_parallel_size",
                 "pipeline_model_parallel_size": "pipeline_parallel_size",
                 "virtual_pipeline_model_parallel_size": "virtual_pipeline_parallel_size"}
_MEGATRON_FSDP_MAP = {"param_offload": "param_offload", "optimizer_offload": "optimizer_offload", "dtype": "dtype"}
_VEOMNI_MAP = {"ulysses_parallel_size": "ulysses_sequence_parallel_size", "expert_parallel_size": "expert_parallel_size"}
_VEOMNI_FSDP_MAP = {"fsdp_size": "fsdp_size", "param_offload": "param_offload", "optimizer_offload": "optimizer_offload",
                    "enable_full_shard": "reshard_after_forward", "enable_fsdp_offload": "offload_policy"}

ENGINE_ALIASES: dict[str, str] = {
    # verl's FSDP engine's mixed_precision dict (verl/workers/engine/fsdp/transformer_impl.py): its compute dtype
    **{f"{fsdp}.mixed_precision.param_dtype": f"{fsdp}.dtype" for fsdp in ROLES.values()},
    **{f"{role}.megatron.{verl}": f"{role}.{ours}" for role in ROLES for verl, ours in _MEGATRON_MAP.items()},
    **{f"{role}.megatron.{verl}": f"{fsdp}.{ours}" for role, fsdp in ROLES.items()
       for verl, ours in _MEGATRON_FSDP_MAP.items()},
    **{f"{role}.veomni.{verl}": f"{role}.{ours}" for role in ROLES for verl, ours in _VEOMNI_MAP.items()},
    **{f"{role}.veomni.{verl}": f"{fsdp}.{ours}" for role, fsdp in ROLES.items()
       for verl, ours in _VEOMNI_FSDP_MAP.items()},
}

_SAME = "runs on hyflow's engine, which computes the same numbers"
_STAGE_SPLIT = ("how the layers (and embedding, loss) are divided between pipeline stages: hyflow splits the decoder "
                "layers evenly (hyflow.parallel.pipeline); another split changes memory and speed, not the numbers")
_PERF_MEGATRON = {
    "sequence_parallel": "Megatron's sequence parallelism shards the activations between tensor-parallel layers: "
                         "memory only",
    "use_distributed_optimizer": "FSDP2 shards the optimizer state already: memory only",
    "use_megatron_fsdp": "hyflow's engine is FSDP2 already: memory only",
    "grad_offload": "gradients live where their parameters do (fsdp_config.param_offload): memory only",
    "use_mbridge": "converts weights between Hugging Face and Megatron layouts; hyflow trains the Hugging Face model "
                   "itself",
    "vanilla_mbridge": "converts weights between Hugging Face and Megatron layouts; hyflow trains the Hugging Face "
                       "model itself",
    "dist_checkpointing_path": "only read with use_dist_checkpointing (refused)",
    "dist_checkpointing_prefix": "only read with use_dist_checkpointing (refused)",
    "dist_ckpt_optim_fully_reshardable": "Megatron's checkpoint layout; hyflow's DCP checkpoints reshard to any world "
                                         "size",
    "distrib_optim_fully_reshardable_mem_efficient": "Megatron's checkpoint layout; hyflow's DCP checkpoints reshard "
                                                     "to any world size",
    "use_remove_padding": "packing or padding the rows gives the same log-probs (hyflow packs by "
                          "model.use_remove_padding)",
    "entropy_from_logits_with_chunking": "chunked entropy: memory only",
    "entropy_from_logits_chunk_size": "chunked entropy: memory only",
    "forward_only": "set by verl for its frozen roles; hyflow's reference is frozen anyway",
    "dynamic_context_parallel": "how context-parallel groups are sized per batch: speed only",
    "max_seqlen_per_dp_cp_rank": "a per-rank packing bound: speed and memory only",
    "pad_bshd_to_minibatch_max": "padding layout: speed only",
    "pad_to_length": "padding packed micro-batches to fixed shapes: speed only",
    "pad_to_length_bucket": "padding packed micro-batches to fixed shapes: speed only",
    "override_ddp_config": "Megatron's data-parallel wrapper knobs (bucket sizes, overlap): speed and memory only",
}
_PERF_TRANSFORMER = {
    **dict.fromkeys(("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"),
                    "activation recomputation: memory for time, the same numbers (hyflow's is "
                    "model.enable_gradient_checkpointing)"),
    **dict.fromkeys(("apply_rope_fusion", "gradient_accumulation_fusion", "bias_activation_fusion",
                     "masked_softmax_fusion", "bias_dropout_fusion", "persist_layer_norm", "use_fused_swiglu",
                     "use_fused_rmsnorm", "moe_permute_fusion", "moe_grouped_gemm", "use_flash_attn",
                     "attention_backend"), "a fused kernel of the same computation: speed only"),
    **dict.fromkeys(("moe_token_dispatcher_type", "moe_enable_deepep"),
                    "how tokens reach their experts (hyflow: all-to-all): speed only"),
    "moe_router_dtype": "transformers' MoE routers take the softmax in fp32 already",
    "context_parallel_algo": "which context-parallel algorithm (hyflow's is Ulysses): the same attention",
    "moe_shared_expert_overlap": "overlaps the shared experts with the token dispatch: speed only",
    "use_naive_l2norm": "an L2-norm kernel choice of the same computation: speed only",
    **dict.fromkeys(("apply_dsa_kernel_fusion", "use_fused_mhc"), "a fused kernel of the same computation: speed only"),
    "pipeline_model_parallel_layout": _STAGE_SPLIT,
    "sequence_parallel": "Megatron's sequence parallelism shards the activations between tensor-parallel layers: "
                         "memory only",
    **dict.fromkeys(("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                     "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                     "deallocate_pipeline_outputs"),
                    _STAGE_SPLIT),
}
_PERF_VEOMNI = {
    **dict.fromkeys(("attn_implementation", "moe_implementation", "cross_entropy_loss_implementation",
                     "rms_norm_implementation", "swiglu_mlp_implementation", "rotary_pos_emb_implementation",
                     "rms_norm_gated_implementation", "causal_conv1d_implementation",
                     "chunk_gated_delta_rule_implementation", "load_balancing_loss_implementation",
                     "dsa_indexer_implementation", "dsa_attention_implementation", "mhc_implementation"),
                    "a kernel implementation of the same computation: speed only"),
    "init_device": "where the model is materialised before sharding: memory only",
    "forward_prefetch": "FSDP2 prefetch order: overlap only",
    "ckpt_manager": "VeOmni's checkpoint writer; hyflow's checkpoints are DCP or full",
    "strategy": "the engine's name; hyflow runs it on its FSDP2 engine",
    "use_torch_compile": "torch.compile of the same modules: speed only (hyflow's is <role>.use_torch_compile)",
    "entropy_from_logits_with_chunking": "chunked entropy: memory only",
    "entropy_checkpointing": "recomputed entropy: memory only",
    "forward_only": "set by verl for its frozen roles; hyflow's reference is frozen anyway",
    "enable_reentrant": "the activation-checkpoint implementation: the same numbers",
    "activation_gpu_limit": "activation offload budget: memory only",
    "basic_modules": "FSDP wrap units (hyflow wraps each decoder layer): memory only",
    "force_use_huggingface": "hyflow always runs the Hugging Face model code",
    "pad_to_length": "padding packed micro-batches to fixed shapes: speed only",
    "pad_to_length_bucket": "padding packed micro-batches to fixed shapes: speed only",
}
_ROUTER_REPLAY = ("router replay (recording MoE routing at rollout or log-prob time and replaying it in the update) "
                  "is not built yet (issue 39); use disabled")
_NOT_BUILT_MEGATRON = {
    "expert_tensor_parallel_size": ("splitting each expert over tensor-parallel ranks is not built; use 1 (whole "
                                    "experts, split over ranks by expert_model_parallel_size)",
                                    lambda v: v not in (None, 1)),
    "use_dist_checkpointing": ("hyflow loads the initial weights from the Hugging Face model at model.path, not "
                               "from a Megatron distributed checkpoint; convert it to Hugging Face and use false",
                               bool),
    "override_mcore_model_config": ("changes Megatron's model definition; hyflow runs the Hugging Face model as its "
                                    "config.json says (override_config for its keys); use {}", bool),
    "seed": ("hyflow seeds model set-up with trainer.seed; set trainer.seed instead", lambda v: v != 42),
    "router_replay.mode": (_ROUTER_REPLAY, lambda v: v != "disabled"),
}
_NOT_BUILT_TRANSFORMER = {
    "moe_aux_loss_coeff": ("a MoE load-balancing loss added to the actor's loss is not built yet; use 0 (verl "
                           "turns it off for RL too: moe_router_load_balancing_type none)", lambda v: bool(v)),
    "moe_z_loss_coeff": ("a router z-loss added to the actor's loss is not built yet; use null or 0",
                         lambda v: bool(v)),
    "moe_router_load_balancing_type": ("only none is built (no load-balancing loss, verl's setting for RL)",
                                       lambda v: v not in (None, "none")),
    "dsa_indexer_loss_coeff": ("a sparse-attention indexer loss in the actor's loss is not built; use 0",
                               lambda v: bool(v)),
    "dsa_indexer_use_sparse_loss": ("a sparse-attention indexer loss in the actor's loss is not built; use false",
                                    lambda v: bool(v)),
}
_NOT_BUILT_VEOMNI = {
    "mixed_precision": ("fp32 compute under VeOmni's switch is hyflow's fsdp_config.dtype=float32; set that and "
                        "leave this true", lambda v: v is not True),
    "load_checkpoint_path": ("hyflow resumes from trainer.resume_mode / resume_from_path checkpoints; use null", bool),
    "full_determinism": ("set fsdp_config.full_determinism instead", bool),
    "seed": ("hyflow seeds model set-up with trainer.seed; set trainer.seed instead", lambda v: v != 42),
    "router_replay.mode": (_ROUTER_REPLAY, lambda v: v != "disabled"),
}

# verl's defaults of the keys these entries name (megatron.yaml, veomni.yaml, Megatron-Core's TransformerConfig)
_DEFAULTS = {
    "megatron": {"expert_tensor_parallel_size": None, "use_dist_checkpointing": False, "override_mcore_model_config": {},
                 "seed": 42, "router_replay.mode": "disabled", "sequence_parallel": True,
                 "use_distributed_optimizer": True, "use_megatron_fsdp": False, "grad_offload": False,
                 "use_mbridge": True, "vanilla_mbridge": True, "dist_checkpointing_path": None,
                 "dist_checkpointing_prefix": "", "dist_ckpt_optim_fully_reshardable": False,
                 "distrib_optim_fully_reshardable_mem_efficient": False, "use_remove_padding": True,
                 "entropy_from_logits_with_chunking": False, "entropy_from_logits_chunk_size": 2048,
                 "forward_only": False, "dynamic_context_parallel": False, "max_seqlen_per_dp_cp_rank": None,
                 "pad_bshd_to_minibatch_max": False, "pad_to_length": False, "pad_to_length_bucket": 1024,
                 "override_ddp_config": {}},
    "transformer": {"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None, "moe_router_load_balancing_type": "none",
                    "dsa_indexer_loss_coeff": 0.0, "dsa_indexer_use_sparse_loss": False,
                    **dict.fromkeys(_PERF_TRANSFORMER)},
    "veomni": {"mixed_precision": True, "load_checkpoint_path": None, "full_determinism": False, "seed": 42,
               "router_replay.mode": "disabled", **dict.fromkeys(_PERF_VEOMNI)},
}


_FP32 = (None, "fp32", "float32")
_MIXED_PRECISION = {
    "reduce_dtype": ("hyflow's FSDP2 reduces gradients in fp32 (MixedPrecisionPolicy reduce_dtype); reducing in "
                     "another dtype is not built: use fp32", lambda v: v not in _FP32),
    "buffer_dtype": ("hyflow keeps the model's buffers in fp32; use fp32", lambda v: v not in _FP32),
}


def _entries() -> tuple[list[tuple], dict[str, Any]]:
    entries, defaults = [], {}
    for fsdp in ROLES.values():
        for leaf, (reason, test) in _MIXED_PRECISION.items():
            key = f"{fsdp}.mixed_precision.{leaf}"
            entries.append((key, "not_supported", reason, test))
            defaults[key] = "fp32"
    for role in ROLES:
        sections = (("megatron", _PERF_MEGATRON, _NOT_BUILT_MEGATRON, _DEFAULTS["megatron"]),
                    ("megatron.override_transformer_config", _PERF_TRANSFORMER, _NOT_BUILT_TRANSFORMER,
                     _DEFAULTS["transformer"]),
                    ("veomni", _PERF_VEOMNI, _NOT_BUILT_VEOMNI, _DEFAULTS["veomni"]))
        for section, performance, refused, verl_defaults in sections:
            for leaf, reason in performance.items():
                key = f"{role}.{section}.{leaf}"
                entries.append((key, "performance_only", f"verl's {section.split('.')[0]} engine knob: {reason}",
                                None))
                defaults[key] = verl_defaults.get(leaf)
            for leaf, (reason, test) in refused.items():
                key = f"{role}.{section}.{leaf}"
                entries.append((key, "not_supported", reason, test))
                defaults[key] = verl_defaults.get(leaf)
    return entries, defaults


# (key, kind, reason, test of the key's value or None): hyflow.config.support makes its table entries of them
ENGINE_ENTRIES, ENGINE_DEFAULTS = _entries()
