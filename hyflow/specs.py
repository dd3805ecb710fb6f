"""Role specs: what each role (actor, reference, critic, reward model, rollout, SFT) is built from.

The config layer (`hyflow.config.roles`) derives one spec per role, once, from the validated config; workers and
the training engine (`TrainEngine.from_spec`) receive their spec and never see the whole config. Specs are plain
frozen dataclasses of plain values, so this module imports nothing of hyflow and every layer may import it. The
one exception is the rollout section (`RolloutSpec.section`), which travels whole: the rollout engines and the
agent loop read it by attribute, as verl's `actor_rollout_ref.rollout` section.

The batch arithmetic types (`BatchArithmetic`, `RoleBatches`, `ForwardBatches`, `SFTBatches`) are the numbers
`hyflow config` prints; `hyflow.config.arithmetic.batch_arithmetic` derives them and each role spec carries its
share. `LoraSettings` is what a model section's LoRA keys ask for (`hyflow.config.lora` parses them,
`hyflow.models.lora` applies them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

ALL_LINEAR = "all-linear"


# ------------------------------------------------------------------------------------------ batch arithmetic


@dataclass(frozen=True)
class RoleBatches:
    """Batch sizes of one trained role (actor or critic) for one training step."""

    mini_batch_prompts: int
    mini_batch_samples: int
    mini_batches_per_epoch: float
    ppo_epochs: int
    optimizer_steps: float
    dp_size: int
    samples_per_device: float
    use_dynamic_bsz: bool
    micro_batch_size_per_device: float | None
    micro_batches: float | None
    max_token_len_per_device: int | None
    max_micro_batches: int | None


@dataclass(frozen=True)
class ForwardBatches:
    """Batch sizes of a forward-only pass over the whole step (log-probs, values)."""

    samples_per_device: float
    use_dynamic_bsz: bool
    micro_batch_size_per_device: float | None
    micro_batches: float | None
    max_token_len_per_device: int | None


@dataclass(frozen=True)
class BatchArithmetic:
    """Every derived batch number of one training step."""

    n_devices: int
    prompts_per_step: int
    samples_per_prompt: int
    samples_per_step: int
    max_prompt_tokens: int
    max_response_tokens: int
    max_sequence_tokens: int
    actor: RoleBatches
    old_log_prob: ForwardBatches
    ref_log_prob: ForwardBatches | None
    critic: RoleBatches | None
    critic_values: ForwardBatches | None


@dataclass(frozen=True)
class SFTBatches:
    """The derived batch sizes of one SFT step: what the trainer prints and what every worker runs.

    The micro-batch fields are the ones `hyflow.workers.engine.micro_batches_as_derived` reads (as RL's
    `RoleBatches`): `micro_batch_size_per_device` samples per pass, or with `use_dynamic_bsz` micro-batches of at
    most `max_token_len_per_device` real tokens.
    """

    n_devices: int
    samples_per_step: int
    samples_per_device: int
    use_dynamic_bsz: bool
    micro_batch_size_per_device: int
    micro_batches: int | None
    max_token_len_per_device: int | None
    max_sequence_tokens: int

    def describe(self) -> str:
        """The sizes in words, with units."""
        share = (f"{self.n_devices} device(s) x {self.samples_per_device} samples" if self.n_devices > 1
                 else f"{self.samples_per_device} samples on one device")
        if self.use_dynamic_bsz:
            micro = f"micro-batches of at most {self.max_token_len_per_device} tokens per device"
        else:
            micro = (f"{self.micro_batches} micro-batch(es) of {self.micro_batch_size_per_device} samples per "
                     "device")
        return (f"{self.samples_per_step} samples per step = {share}, in {micro}, at most "
                f"{self.max_sequence_tokens} tokens per sample")


# ------------------------------------------------------------------------------------------ engine settings


@dataclass
class LoraSettings:
    """What the config asks for (`hyflow.models.lora`'s docstring gives the meaning of each key).

    rank: r (0 only together with `adapter_path`); alpha: the scale numerator (update = alpha / r * B @ A);
    target_modules: "all-linear", a regex string or a list of names; exclude_modules: None, a regex or a list;
    adapter_path: a peft adapter directory to start from; dropout: LoRA dropout (0, verl's);
    config_key: the config section, for error messages ("actor_rollout_ref.model", "critic.model").
    """

    rank: int
    alpha: float = 16
    target_modules: str | list[str] = ALL_LINEAR
    exclude_modules: str | list[str] | None = None
    adapter_path: str | None = None
    dropout: float = 0.0
    config_key: str = "actor_rollout_ref.model"

    @property
    def scaling(self) -> float:
        """alpha / r: the factor of B @ A in W' = W + (alpha / r) * B @ A."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class ModelSpec:
    """Where a role's model (and tokenizer) load from. `config_key` names the path's key in error messages."""

    path: str | None
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    override_config: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    custom_chat_template: str | None = None
    config_key: str = "actor_rollout_ref.model.path"


# The strategies a role trains with under hyflow's FSDP2 wrapper: its own names and verl's other engines, which run
# on it (hyflow.config.engine_compat).
FSDP2_STRATEGIES = ("fsdp", "fsdp2", "megatron", "veomni", "torchtitan")


@dataclass(frozen=True)
class FsdpSettings:
    """What the parallel wrapper and the engine read of a role's `fsdp_config`: the mixed-precision dtype (FSDP2 on
    accelerators), whether each layer's gathered parameters are freed after its forward, and offload: the
    parameters (`param_offload`) and the optimizer state (`optimizer_offload`) in host memory between the engine's
    uses (`TrainEngine.on_device`), or FSDP2's `CPUOffloadPolicy` (`offload_policy`, FSDP2 only; it replaces the
    other two, as in verl)."""

    dtype: str = "bfloat16"
    reshard_after_forward: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    fsdp_size: int = -1


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer (`optimizer_impl`.`optimizer`, built with lr, weight_decay, betas and
    `override_optimizer_config`) and its LR schedule: linear warm-up over `lr_warmup_steps` (or
    `lr_warmup_steps_ratio` x the total optimizer steps when negative), then `lr_scheduler_type` (constant or
    cosine down to `min_lr_ratio` x lr over `num_cycles`)."""

    optimizer: str = "AdamW"
    optimizer_impl: str = "torch.optim"
    lr: float = 1e-6
    betas: tuple[float, ...] = (0.9, 0.999)
    weight_decay: float = 0.01
    override_optimizer_config: dict = field(default_factory=dict)
    lr_warmup_steps: int | None = -1
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5


@dataclass(frozen=True)
class TrainEngineSpec:
    """Everything `TrainEngine.from_spec` builds one role's engine from (see `hyflow.workers.train_engine`).

    name: the role (metric prefix, checkpoint component prefix unless `checkpoint_prefix`); head: "lm" or
    "value"; strategy: the config's `strategy` (fsdp, fsdp2, ddp), resolved against the world size by the
    engine; fsdp: the wrapper's settings; compute_dtype: the autocast dtype on accelerators; optim: None for a
    frozen model (the reference policy); total_optimizer_steps: the LR schedule's length (training steps x
    optimizer steps per training step); device: `trainer.device` (auto, cpu, cuda), resolved by the worker;
    ulysses_sequence_parallel_size: ranks per sequence-parallel group (`hyflow.models.ulysses`; 1 = none);
    tensor_parallel_size: ranks per tensor-parallel group (`hyflow.models.tensor_parallel`; 1 = none);
    expert_parallel_size: ranks that split a mixture-of-experts model's experts (`hyflow.parallel.expert`; 1 = none);
    pipeline_parallel_size: pipeline stages' ranks (`hyflow.parallel.pipeline`; 1 = none), each holding
    virtual_pipeline_parallel_size stages, run by `pipeline_schedule` (None: 1F1B, or Interleaved1F1B with virtual
    stages).
    """

    name: str
    head: str
    strategy: str
    fsdp: FsdpSettings
    compute_dtype: str
    device: str = "auto"
    optim: OptimizerSpec | None = None
    grad_clip: float | None = None
    total_optimizer_steps: int = 1
    use_remove_padding: bool = False
    share_prompts: bool = False
    use_torch_compile: bool = False
    lora: LoraSettings | None = None
    checkpoint_prefix: str | None = None
    freeze_vision_tower: bool = False
    ulysses_sequence_parallel_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    virtual_pipeline_parallel_size: int = 1
    pipeline_schedule: str | None = None


# ------------------------------------------------------------------------------------------ roles


@dataclass(frozen=True)
class DistillationLossSpec:
    """On-policy distillation's loss knobs (`distillation.distillation_loss`, `hyflow.algos.distillation`): the
    per-token loss `loss_mode` (top-k forward KL over the teacher's `topk` tokens, or a KL estimator on the
    sampled token), its clamps, supervised or as a policy gradient (`policy_loss_mode` with `policy_loss_kwargs`),
    and how it joins the task's loss (`use_task_rewards`, `distillation_loss_coef`)."""

    loss_mode: str = "k3"
    topk: int = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    policy_loss_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PairPreferenceSpec:
    """Online DPO's term (`hyflow.algos.online_preference.pair_preference_loss`), which takes the policy loss's
    place: the DPO `loss_type` (sigmoid, ipo, hinge, robust), `beta` and cDPO's `label_smoothing`."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class ActorLossSpec:
    """The actor's loss: the terms `terms` names, in order (`hyflow.algos.loss_terms`: "policy" or
    "pair_preference", "entropy", "kl", "distillation"), each called with its knobs (`term_knobs`): loss = policy
    loss (`loss_mode`, called with `policy_loss_kwargs`) - entropy_coeff * entropy + kl_loss_coef * KL(pi || ref)
    (when `use_kl_loss`, estimator `kl_loss_type`), each term aggregated with `loss_agg_mode` (and
    `loss_scale_factor` for seq-mean-token-sum-norm); with `distillation`, its term joins them."""

    loss_mode: str = "vanilla"
    policy_loss_kwargs: dict = field(default_factory=dict)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    distillation: DistillationLossSpec | None = None  # on-policy distillation's term (None: none)
    pair_preference: PairPreferenceSpec | None = None  # online DPO's term in the policy loss's place (None: none)
    terms: tuple[str, ...] = ("policy",)  # the registered terms, in order (`hyflow.config.roles.actor_loss_terms`)

    def term_knobs(self) -> dict[str, dict]:
        """Each term's keyword arguments, by term name (what `hyflow.algos.loss_terms` calls it with)."""
        knobs = {"policy": {"loss_mode": self.loss_mode, "policy_loss_kwargs": self.policy_loss_kwargs},
                 "entropy": {"entropy_coeff": self.entropy_coeff},
                 "kl": {"kl_loss_coef": self.kl_loss_coef, "kl_loss_type": self.kl_loss_type}}
        for name, spec in (("distillation", self.distillation), ("pair_preference", self.pair_preference)):
            if spec is not None:
                knobs[name] = {f.name: getattr(spec, f.name) for f in fields(spec)}
        return knobs


@dataclass(frozen=True)
class RolloutSpec:
    """What a rollout engine and its agent loop are built from.

    model: the policy's path (the vllm engine and a rollout-only worker load it); section: the
    `actor_rollout_ref.rollout` config section, whole (engines and agent loops read it); chat_template_kwargs:
    `data.apply_chat_template_kwargs`; weight_bucket_bytes: the largest bucket of a weight push;
    stream: asynchronous training with the rollout in the actor's processes (a second engine there);
    image_kwargs: `data.mm_processor_kwargs` (a vision-language policy's agent loop processes its tools' images so).
    """

    model: ModelSpec
    section: Any
    device: str = "auto"
    chat_template_kwargs: dict = field(default_factory=dict)
    weight_bucket_bytes: int = 512 << 20
    stream: bool = False
    image_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ActorSpec:
    """The actor + rollout + reference worker: the policy's model and engine, the reference (None when nothing
    reads a KL term; loaded from `ref_model_path`, else a copy of the policy, else with LoRA the policy with its
    adapter off), the loss, the batch sizes of the update (`batches`) and of the log-prob passes, the update's
    shuffling, and the rollout."""

    model: ModelSpec
    engine: TrainEngineSpec
    ref: TrainEngineSpec | None
    ref_model_path: str | None
    loss: ActorLossSpec
    batches: RoleBatches
    old_log_prob: ForwardBatches
    ref_log_prob: ForwardBatches | None
    rollout: RolloutSpec
    seed: int = 0
    full_determinism: bool = False
    shuffle: bool = False
    data_loader_seed: int = 0


@dataclass(frozen=True)
class CriticSpec:
    """The critic worker: the value model and its engine, the clipped value loss's knobs, the batch sizes of its
    update (`batches`) and of its value pass (`values`)."""

    model: ModelSpec
    engine: TrainEngineSpec
    batches: RoleBatches
    values: ForwardBatches
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    shuffle: bool = False
    seed: int = 0
    full_determinism: bool = False


@dataclass(frozen=True)
class PRMSpec:
    """PRIME's implicit process reward model (`hyflow.workers.prm`, `hyflow.config.roles.prm_spec`): a causal LM
    trained online (`engine`, head "lm" with its optimizer) beside a frozen reference (`ref_engine`, loaded from
    `ref_model`); `batches`: its update's mini-batches (counted in samples) and micro-batches, `forward`: the
    micro-batches of its scoring pass; `beta`: beta_train of the implicit reward and of the cross-entropy loss."""

    model: ModelSpec
    ref_model: ModelSpec
    engine: TrainEngineSpec
    ref_engine: TrainEngineSpec
    batches: RoleBatches
    forward: ForwardBatches
    beta: float = 0.05
    seed: int = 0
    full_determinism: bool = False


@dataclass(frozen=True)
class SFTSpec:
    """The SFT worker: the model (`model.partial_pretrain`), its engine and the step's batch sizes."""

    model: ModelSpec
    engine: TrainEngineSpec
    batches: SFTBatches
    seed: int = 0


@dataclass(frozen=True)
class PreferenceSpec(SFTSpec):
    """The preference worker (`hyflow dpo`): the SFT worker's spec (`batches` in sequences: 2 per pair) and the loss
    (`hyflow.algos.preference`): its `loss_type`, `beta`, the `knobs` it reads, whether it needs a `reference`
    model (a frozen copy, or the model with its LoRA adapter off) and whether rows come in chosen/rejected pairs."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    knobs: dict = field(default_factory=dict)
    reference: bool = True
    paired: bool = True


@dataclass(frozen=True)
class RoleSpecs:
    """The specs of one RL run's roles, derived once (`hyflow.config.roles.role_specs`): what `hyflow config`
    prints and what the trainer hands each role (None: the run has no such role). `batches` is the whole step's
    arithmetic (printed in words). The reward model's slot: PRIME's implicit PRM (`prm`), a classifier
    (`reward_model`) or a generative judge (`judge`); `teacher`: on-policy distillation's teachers."""

    batches: BatchArithmetic
    actor: ActorSpec
    critic: CriticSpec | None
    rollout: RolloutSpec
    reward_model: RewardModelSpec | None = None
    judge: JudgeSpec | None = None
    prm: PRMSpec | None = None
    teacher: TeacherSpec | None = None


# ------------------------------------------------------------------------------------------ reward model


@dataclass(frozen=True)
class RewardModelSpec:
    """The reward-model worker (`hyflow.config.roles.reward_model_spec`): a frozen sequence classifier.

    model: where it loads from (`external_lib` imported first); model_dtype: its weights' dtype on an accelerator
    (fp32 on CPU); engine: its forward-only engine (head "score", no optimizer; autocast in `compute_dtype`);
    policy_tokenizer: the tokenizer the samples were made with, when the trainer does not hand it over (None when
    no key names one); max_length: the longest re-rendered input, in tokens; the forward's micro-batch sizes under
    the names the engine's micro-batching reads (`micro_batch_size_per_device`, or with `use_dynamic_bsz` a
    budget of `max_token_len_per_device` tokens), so the spec is the `sizes` of `TrainEngine.infer`; dp_size: the
    ranks that split a batch.
    """

    model: ModelSpec
    engine: TrainEngineSpec
    policy_tokenizer: ModelSpec | None
    external_lib: str | None = None
    model_dtype: str = "float32"
    max_length: int | None = None
    full_determinism: bool = False
    dp_size: int = 1
    micro_batch_size_per_device: int | None = None
    use_dynamic_bsz: bool = False
    max_token_len_per_device: int | None = None


# ------------------------------------------------------------------------------------------ distillation teacher


@dataclass(frozen=True)
class TeacherModelSpec:
    """One frozen teacher of on-policy distillation: its name in `distillation.teacher_models`, the routing `key`
    (a value of the teacher_key field; None with one teacher), its model, the engine that serves it (`hf` or
    `vllm`), that engine's weights dtype on an accelerator, rows per forward (`max_num_seqs`) and the vllm
    engine's `inference` settings (gpu_memory_utilization, enforce_eager, max_model_len, engine_kwargs)."""

    name: str
    key: str | None
    model: ModelSpec
    engine: str = "hf"
    dtype: str = "bfloat16"
    max_num_seqs: int = 256
    inference: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TeacherSpec:
    """The teacher worker (`hyflow.config.roles.teacher_spec`): its teachers, the sample field that routes a
    sample to one of them (`teacher_key`), `topk` (the teacher's top-k per position for forward_kl_topk; 0 = the
    log-prob of the sampled token only), the device setting, and the rollout section (the vllm engine's defaults)."""

    teachers: tuple[TeacherModelSpec, ...]
    teacher_key: str = "data_source"
    topk: int = 0
    device: str = "auto"
    rollout: Any = None


@dataclass(frozen=True)
class JudgeSpec:
    """The generative reward model's worker (`hyflow.config.roles.judge_spec`): the judge's model, the engine
    serving it (`reward_model.rollout.name`: hf or vllm), its dtype on an accelerator, rows per engine batch, the
    vllm settings (`overrides`: gpu_memory_utilization, enforce_eager, max_model_len, engine_kwargs, seed), the
    device setting and the rollout section the vllm engine's other defaults come from."""

    model: ModelSpec
    engine: str = "hf"
    dtype: str = "bfloat16"
    max_num_seqs: int = 1024
    overrides: dict = field(default_factory=dict)
    device: str = "auto"
    rollout: Any = None
