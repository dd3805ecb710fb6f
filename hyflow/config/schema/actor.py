"""The `actor_rollout_ref` section's actor (policy training, policy loss) and reference, and the section itself
(model + actor + rollout + ref)."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass

from hyflow.config.schema.base import KL_PENALTY_NAMES, LOSS_AGG_MODES, option, section
from hyflow.config.schema.common import CheckpointConfig, FSDPConfig, ModelConfig, OptimConfig, ProfilerConfig
from hyflow.config.schema.rollout import RolloutConfig


@dataclass
class PolicyLossConfig:
    """Which policy-gradient loss the actor optimises, and its knobs."""

    loss_mode: str = option(
        "vanilla",
        "Registered policy loss: vanilla (PPO clip, Schulman et al. 2017, arXiv 1707.06347), gspo (arXiv "
        "2507.18071), sapo (arXiv 2511.20347), gpg, clip_cov, kl_cov (arXiv 2505.22617), geo_mean (GMPO, arXiv "
        "2507.20673), cispo (arXiv 2506.13585), dppo_tv / dppo_kl (arXiv 2602.04879), dro (needs dro_beta), "
        "reinforce, bypass_mode (PPO clip against the rollout log-probs, with "
        "algorithm.rollout_correction.bypass_mode=true), sppo (SPPO's square loss, with "
        "algorithm.adv_estimator=sppo, arXiv 2405.00675); see hyflow.algos.POLICY_LOSSES.",
    )
    clip_cov_ratio: float = option(
        0.0002, "clip_cov: fraction of tokens whose gradient is dropped (arXiv 2505.22617)."
    )
    clip_cov_lb: float = option(1.0, "clip_cov: lower bound of the covariance window of dropped tokens.")
    clip_cov_ub: float = option(5.0, "clip_cov: upper bound of the covariance window of dropped tokens.")
    kl_cov_ratio: float = option(
        0.0002, "kl_cov: fraction of tokens (highest covariance) that get the KL penalty."
    )
    ppo_kl_coef: float = option(0.1, "kl_cov: coefficient of the |log-ratio| penalty on those tokens.")
    dro_beta: float | None = option(
        None, "dro: weight beta of the quadratic log-ratio penalty (required, > 0, for loss_mode=dro; verl).")


@dataclass
class ActorConfig:
    """The policy being trained: mini-batches, micro-batches, the PPO objective and its optimizer."""

    strategy: str = option(
        "fsdp",
        "Data-parallel training strategy: fsdp, fsdp2 or ddp; verl's megatron, veomni and torchtitan "
        "engines run on hyflow's fsdp2 engine (model_engine).",
        choices=("fsdp", "fsdp2", "ddp", "megatron", "veomni", "torchtitan"),
    )
    ppo_mini_batch_size: int = option(
        256,
        "Prompts per optimizer step (global); each mini-batch holds ppo_mini_batch_size x rollout.n samples.",
    )
    ppo_micro_batch_size: int | None = option(
        None,
        "Deprecated (verl): samples per forward summed over all devices. Use ppo_micro_batch_size_per_gpu.",
    )
    ppo_micro_batch_size_per_gpu: int | None = option(
        None,
        "Samples per device per forward/backward pass (gradient accumulation inside a mini-batch). None = the "
        "whole per-device mini-batch in one pass (verl: required).",
    )
    use_dynamic_bsz: bool = option(
        False,
        "Build micro-batches by token budget (ppo_max_token_len_per_gpu) instead of a fixed sample count.",
    )
    ppo_max_token_len_per_gpu: int = option(
        16384,
        "With use_dynamic_bsz: tokens (prompt + response) per device per forward pass; must cover the longest "
        "sequence.",
    )
    ppo_epochs: int = option(
        1,
        "Passes over each step's samples (each pass makes train_batch_size / ppo_mini_batch_size optimizer steps).",
    )
    shuffle: bool = option(False, "Shuffle samples before splitting them into mini-batches.")
    data_loader_seed: int = option(42, "Seed of the mini-batch shuffle.")
    clip_ratio: float = option(
        0.2,
        "PPO clip range epsilon (Schulman et al. 2017, arXiv 1707.06347); fallback for clip_ratio_low/high.",
    )
    clip_ratio_low: float = option(
        0.2, "Lower clip range: ratio clipped below at 1 - clip_ratio_low; >= 0 (1 or more: no lower clip, as verl's "
        "CISPO example's 10)."
    )
    clip_ratio_high: float = option(
        0.2,
        "Upper clip range: ratio clipped above at 1 + clip_ratio_high (DAPO clip-higher uses 0.28, arXiv 2503.14476).",
    )
    clip_ratio_c: float = option(
        3.0,
        "Dual-clip bound for negative advantages: loss capped at -A x clip_ratio_c; must be > 1 (Ye et al. 2020, "
        "arXiv 1912.09729).",
    )
    policy_loss: PolicyLossConfig = section(PolicyLossConfig, "Policy loss choice and its knobs.")
    tau_pos: float = option(1.0, "SAPO gate temperature for positive advantages (arXiv 2511.20347).")
    tau_neg: float = option(1.05, "SAPO gate temperature for negative advantages.")
    loss_agg_mode: str = option(
        "token-mean",
        "How per-token losses become one number: token-mean (mean over all response tokens of the mini-batch, "
        "DAPO), token-sum (their sum, no normaliser), seq-mean-token-sum, seq-mean-token-mean (GRPO paper), "
        "seq-mean-token-sum-norm (Dr. GRPO, arXiv 2503.20783).",
        choices=LOSS_AGG_MODES,
    )
    loss_scale_factor: float | None = option(
        None, "seq-mean-token-sum-norm: constant divisor (None = the padded response length, Dr. GRPO)."
    )
    entropy_coeff: float = option(0.0, "Weight of the entropy bonus: loss -= entropy_coeff x entropy.")
    use_kl_loss: bool = option(
        False,
        "Add a KL(policy || reference) term to the actor loss (GRPO style, DeepSeekMath arXiv 2402.03300).",
    )
    kl_loss_coef: float = option(0.001, "Weight of the KL loss term.")
    kl_loss_type: str = option(
        "low_var_kl",
        "KL estimator of the loss: kl/k1, abs, mse/k2, low_var_kl/k3 (Schulman 2020, 'Approximating KL "
        "divergence'); a trailing '+' uses k2's gradient (straight-through); full: verl's full-vocabulary KL, not"
        " supported yet.",
        choices=(*KL_PENALTY_NAMES, "full"),
    )
    dpo_beta: float = option(
        0.1, "algorithm.adv_estimator=online_dpo or spin: beta of the DPO loss on each prompt's pair, the strength "
        "of the implicit KL toward the reference policy (Rafailov et al. 2023, arXiv 2305.18290; verl-recipe spin's "
        "actor.dpo_beta).")
    sppo_eta: float = option(
        1.0, "policy_loss.loss_mode=sppo: eta of SPPO's square loss (log pi(y) - log pi_old(y) - eta x A)^2, A the "
        "sample's centred score (Wu et al. 2024, arXiv 2405.00675; verl-recipe sppo's actor.sppo_eta).")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this value before each optimizer step.")
    ulysses_sequence_parallel_size: int = option(
        1,
        "Devices that split one sequence (DeepSpeed-Ulysses, arXiv 2309.14509): groups of this many consecutive "
        "devices hold the same samples, each runs a slice of every packed row and attention exchanges heads for "
        "tokens by all-to-all (hyflow.models.ulysses); needs use_remove_padding; data-parallel size = devices / "
        "this.",
    )
    tensor_parallel_size: int = option(
        1,
        "Devices that split each decoder layer's attention heads and MLP columns/rows with PyTorch tensor "
        "parallelism (torch.distributed.tensor.parallel: q/k/v and gate/up column-wise, o and down row-wise; "
        "embeddings, norms and the heads replicated), composed with FSDP2 over the data-parallel dimension of a "
        "(devices / this) x this device mesh, as torchtitan does (verl's torchtitan.tensor_parallel_size): groups "
        "of this many consecutive devices hold the same samples; data-parallel size = devices / this. Needs "
        "strategy fsdp/fsdp2; it must divide the model's attention and key-value heads. Not combined with "
        "ulysses_sequence_parallel_size > 1 or LoRA yet.",
    )
    expert_parallel_size: int = option(
        1,
        "Devices that split a mixture-of-experts model's routed experts (Megatron's expert_model_parallel_size): "
        "each of a group of this many consecutive devices holds experts / this of every MoE layer and the tokens "
        "travel to their experts and back by all-to-all (hyflow.parallel.expert); composed with FSDP2, which shards "
        "everything else; beside tensor_parallel_size the MoE blocks stay whole and each tensor-parallel rank sends its "
        "share of the tokens (Megatron's layout with expert_tensor_parallel_size=1). Needs strategy fsdp/fsdp2 and a "
        "MoE model whose experts it divides; must divide the devices of an FSDP shard group (fsdp_config.fsdp_size, "
        "or all the role's) x tensor_parallel_size; not with LoRA yet.",
    )
    pipeline_parallel_size: int = option(
        1,
        "Devices that hold consecutive pipeline stages of the model (Megatron's pipeline_model_parallel_size; "
        "torch.distributed.pipelining, hyflow.parallel.pipeline): the decoder layers split evenly over "
        "pipeline_parallel_size x virtual_pipeline_parallel_size stages, stage 0 with the embedding, the last with "
        "the final norm and the head; the role's micro-batches flow through them by pipeline_schedule, the loss on "
        "the last stage. Composes with FSDP2 (each stage sharded over the data-parallel devices), "
        "tensor_parallel_size and expert_parallel_size (within a stage's devices); data-parallel size = devices / "
        "(this x tensor_parallel_size). The stages run the padded micro-batch (the packed one gives the same "
        "log-probs: use_remove_padding and use_prefix_grouper are performance-only here), a token-budget "
        "micro-batch filled to the largest one's rows. Not combined with ulysses_sequence_parallel_size > 1, LoRA, "
        "a vision-language model yet; the model needs at least as many decoder layers as stages.",
    )
    virtual_pipeline_parallel_size: int | None = option(
        None,
        "Pipeline stages per pipeline device (Megatron's virtual_pipeline_model_parallel_size; null = 1): with "
        "more than 1 each device holds that many non-consecutive stages (stage s on device s mod "
        "pipeline_parallel_size) and the schedule is Interleaved1F1B, whose idle fraction is about (p - 1) / (v x"
        " m + p - 1) instead of (p - 1) / (m + p - 1) for m micro-batches.",
    )
    pipeline_schedule: str | None = option(
        None,
        "The pipeline schedule (torch.distributed.pipelining): 1F1B (one forward, one backward: at most p "
        "micro-batches' activations live), GPipe (all forwards, then all backwards), or Interleaved1F1B (several "
        "stages per device: virtual_pipeline_parallel_size > 1); null = Interleaved1F1B with virtual stages, else"
        " 1F1B.",
        choices=(None, "1F1B", "GPipe", "Interleaved1F1B"),
    )
    use_torch_compile: bool = option(
        False,
        "torch.compile the model's MLPs and RMSNorms for the actor's training and log-prob passes (hyflow.models."
        "compile; the rollout decodes eagerly). hyflow's default is false (verl's: true): it costs a one-time "
        "compile of seconds per model, which only long runs earn back (1.09-1.13x training tokens/s on CPU, "
        "BENCHMARKS.md).",
    )
    freeze_vision_tower: bool = option(
        False,
        "A vision-language model (Qwen2-VL family): train the language model only; the vision tower's weights "
        "(the model's `visual` module, its patch merger included) get no gradient and no optimizer state. No effect "
        "on a text model.",
    )
    use_prefix_grouper: bool = option(
        "${actor_rollout_ref.model.use_remove_padding}",
        "Run each prompt's tokens once per micro-batch for all its samples (PrefixGrouper, arXiv 2506.05433): the "
        "responses attend to one copy of the prompt. Same log-probs and gradients, less compute in the actor's and "
        "reference's forwards and the update (the share is prompt/(prompt+response) x (n-1)/n of the tokens; "
        "1.47x TRL's GRPO steps/s instead of 1.35x on CPU, BENCHMARKS.md). Needs actor_rollout_ref.model."
        "use_remove_padding=true (verl's needs false: hyflow builds it into packing). hyflow's default follows "
        "use_remove_padding, so on by default (verl's: false).",
    )
    checkpoint: CheckpointConfig = section(CheckpointConfig, "What the actor's checkpoints contain.")
    optim: OptimConfig = section(OptimConfig, "Actor optimizer and learning-rate schedule.")
    fsdp_config: FSDPConfig = section(FSDPConfig, "FSDP settings of the actor.")
    profiler: ProfilerConfig = section(ProfilerConfig, "Profiling the actor's worker processes (docs/profiling.md).")


@dataclass
class RefModelConfig:
    """Where the reference policy comes from."""

    path: str | None = option(
        None, "Reference model directory or hub id (None = actor_rollout_ref.model.path, the initial policy)."
    )


@dataclass
class RefConfig:
    """The frozen reference policy (needed for use_kl_loss or use_kl_in_reward)."""

    strategy: str = option(
        "${actor_rollout_ref.actor.strategy}", "Data-parallel strategy of the reference (default = actor's).",
        choices=("fsdp", "fsdp2", "ddp", "megatron", "veomni", "torchtitan"),
    )
    model: RefModelConfig = section(RefModelConfig, "Reference model source.")
    log_prob_micro_batch_size: int | None = option(
        None,
        "Deprecated (verl): samples per forward over all devices. Use log_prob_micro_batch_size_per_gpu.",
    )
    log_prob_micro_batch_size_per_gpu: int | None = option(
        None, "Samples per device per reference forward (None = rollout.log_prob_micro_batch_size_per_gpu)."
    )
    log_prob_use_dynamic_bsz: bool = option(
        "${actor_rollout_ref.actor.use_dynamic_bsz}", "Build reference micro-batches by token budget."
    )
    log_prob_max_token_len_per_gpu: int = option(
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
        "Token budget per device per reference forward with log_prob_use_dynamic_bsz.",
    )
    ulysses_sequence_parallel_size: int = option(
        "${actor_rollout_ref.actor.ulysses_sequence_parallel_size}",
        "Sequence-parallel size of the reference.",
    )
    tensor_parallel_size: int = option(
        "${actor_rollout_ref.actor.tensor_parallel_size}",
        "Tensor-parallel size of the reference (see actor_rollout_ref.actor.tensor_parallel_size).",
    )
    expert_parallel_size: int = option(
        "${actor_rollout_ref.actor.expert_parallel_size}",
        "Expert-parallel size of the reference (see actor_rollout_ref.actor.expert_parallel_size).",
    )
    pipeline_parallel_size: int = option(
        "${actor_rollout_ref.actor.pipeline_parallel_size}",
        "Pipeline-parallel size of the reference (see actor_rollout_ref.actor.pipeline_parallel_size).",
    )
    virtual_pipeline_parallel_size: int | None = option(
        "${actor_rollout_ref.actor.virtual_pipeline_parallel_size}",
        "Pipeline stages per device of the reference (see actor_rollout_ref.actor.virtual_pipeline_parallel_size).",
    )
    pipeline_schedule: str | None = option(
        "${actor_rollout_ref.actor.pipeline_schedule}",
        "The reference's pipeline schedule (see actor_rollout_ref.actor.pipeline_schedule).",
        choices=(None, "1F1B", "GPipe", "Interleaved1F1B"),
    )
    use_torch_compile: bool = option(
        "${actor_rollout_ref.actor.use_torch_compile}",
        "torch.compile a separate reference model's MLPs and RMSNorms for its log-prob pass (under LoRA the reference "
        "is the actor: the actor's setting applies).",
    )
    fsdp_config: FSDPConfig = section(
        FSDPConfig, "FSDP settings of the reference (frozen: no optimizer; param_offload keeps it in host memory "
        "but for its log-prob pass)."
    )
    profiler: ProfilerConfig = section(
        ProfilerConfig, "Profiling the reference's worker processes (the actor's: one worker hosts both).")


@dataclass
class ActorRolloutRefConfig:
    """Actor, rollout engine and reference policy: one model, three roles, sharing devices."""

    hybrid_engine: bool = option(True, "Actor, rollout and reference share devices (one process per device).")
    model: ModelConfig = section(ModelConfig, "The policy model.")
    actor: ActorConfig = section(ActorConfig, "Policy training.")
    rollout: RolloutConfig = section(RolloutConfig, "Generation.")
    ref: RefConfig = section(RefConfig, "Reference policy.")
