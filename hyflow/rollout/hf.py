"""The `hf` rollout engine: batched sampling with a transformers causal LM and its KV cache.

Works on CPU and GPU with any Hugging Face decoder. Per call:
1. prompts arrive left-padded (`input_ids`, `attention_mask`); each chunk of prompts is prefilled ONCE and the
   KV cache is repeated n times (no n-fold prefill);
2. decode token by token with `SamplingParams` (temperature, top-k, top-p or greedy), recording the log-prob of
   every drawn token under softmax(logits / T);
3. a row stops at its first EOS (or extra stop id) or at `max_new_tokens`; finished rows are dropped from the
   KV cache as they accumulate, so long-tail samples do not pay for short ones;
4. the output Batch carries verl's keys: `prompts` [N, P] (left-padded), `responses` [N, R] (right-padded with
   the pad id, R = max_new_tokens), `response_mask` (1 up to and including the first EOS), `input_ids`,
   `attention_mask`, `position_ids` [N, P + R], `rollout_log_probs` [N, R] (0 where masked), and every other
   column of the prompt batch repeated per sample (interleaved: rows 0..n-1 are prompt 0's samples).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache

from hyflow.batch import Batch
from hyflow.models.loading import as_torch_dtype
from hyflow.rollout.base import EngineSpec, SamplingParams, register_engine
from hyflow.rollout.output import assemble_rollout, position_ids_from_mask
from hyflow.rollout.sampling import sample_next_token

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@register_engine("hf")
class HFRolloutEngine:
    """Generation with a transformers model.

    `model` may be the trainer's own module (one process, zero-copy weights: `shares_weights=True`) or a separate
    copy that receives weights through `load_weights`. `max_batch_size` bounds the sequences decoded at once
    (samples, not prompts).
    """

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> HFRolloutEngine:
        """The engine on the trainer's module itself (`spec.share_module`) or on a frozen copy of it.

        The copy is in `rollout.dtype` on accelerators and in the trainer's dtype on CPU (CPU kernels for
        bf16 are slow and the copy exists only for sharded trainers there).
        """
        if spec.module is None:
            raise ValueError("the hf rollout engine generates with the trainer's module: EngineSpec.module is None")
        if spec.share_module:
            model = spec.module
        else:
            on_cpu = torch.device(spec.device).type == "cpu"
            dtype = next(spec.module.parameters()).dtype if on_cpu else as_torch_dtype(spec.rollout.dtype)
            model = copy.deepcopy(spec.module).to(dtype=dtype)
            model.requires_grad_(False)
        engine = cls(model, eos_token_id=list(spec.eos_token_ids), pad_token_id=spec.pad_token_id,
                     max_batch_size=getattr(spec.rollout, "max_num_seqs", 256))
        engine.shares_weights = spec.share_module
        return engine

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int | Iterable[int],
        pad_token_id: int,
        max_batch_size: int = 256,
    ) -> None:
        self.model = model
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not self.eos_token_ids:
            raise ValueError("the rollout engine needs at least one EOS token id (tokenizer.eos_token_id is None)")
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max(1, int(max_batch_size))
        self._asleep = False
        self._device = next(model.parameters()).device
        self.shares_weights = False  # from_spec sets it when the model is the trainer's own module
        # transformers >= 5.24 names the KV-cache argument `cache` (`past_key_values` is deprecated there)
        forward_args = inspect.signature(type(model).forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"

    # ------------------------------------------------------------------ protocol
    @torch.inference_mode()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses per prompt; see the module docstring for the output keys."""
        if self._asleep:
            raise RuntimeError("the hf rollout engine is asleep; call wake() before generate()")
        for key in ("input_ids", "attention_mask"):
            if key not in prompts:
                raise KeyError(f"generate() needs a {key!r} column of left-padded prompt token ids")
        input_ids = prompts["input_ids"].to(self._device)
        prompt_mask = prompts["attention_mask"].to(self._device)
        if (prompt_mask[:, -1] == 0).any():
            raise ValueError("prompts must be LEFT-padded (the last position of every row must be a real token)")

        stop_ids = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), device=self._device)
        generator = torch.Generator(device=self._device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)

        was_training = self.model.training
        self.model.eval()
        try:
            prompts_per_chunk = max(1, self.max_batch_size // params.n)
            parts = [
                self._generate_chunk(input_ids[i : i + prompts_per_chunk], prompt_mask[i : i + prompts_per_chunk],
                                     params, stop_ids, generator)
                for i in range(0, len(input_ids), prompts_per_chunk)
            ]
        finally:
            self.model.train(was_training)
        responses = torch.cat([p[0] for p in parts])
        logprobs = torch.cat([p[1] for p in parts])
        lengths = torch.cat([p[2] for p in parts])
        return assemble_rollout(prompts, input_ids, prompt_mask, responses, logprobs, lengths, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model by parameter name; returns how many were loaded.

        Names may carry wrapper prefixes (DDP `module.`, `torch.compile`'s `_orig_mod.`, FSDP1); a name the model
        does not have is an error. Partial updates (one bucket at a time) are allowed.
        """
        state = self.model.state_dict(keep_vars=True)
        loaded = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                key = name
                for prefix in _WRAPPER_PREFIXES:
                    key = key.replace(prefix, "")
                if key not in state:
                    raise KeyError(f"load_weights: the rollout model has no parameter {name!r}")
                target = state[key]
                if target.shape != tensor.shape:
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects "
                                     f"{tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                loaded += 1
        return loaded

    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int:
        """Load the trainer's weights bucket by bucket (each bucket is gathered only when it is reached)."""
        if self.shares_weights:
            return 0
        return sum(self.load_weights(bucket) for bucket in buckets)

    def sleep(self) -> None:
        """Free accelerator memory between rollouts (weights moved to host). A no-op on CPU."""
        if self._device.type != "cpu":
            self.model.to("cpu")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        """Bring the weights back to the device before the next `generate`."""
        if self._device.type != "cpu":
            self.model.to(self._device)
        self._asleep = False

    # ------------------------------------------------------------------ internals
    def _generate_chunk(self, input_ids, prompt_mask, params: SamplingParams, stop_ids, generator):
        n, max_new = params.n, params.max_new_tokens
        num_rows = len(input_ids) * n
        responses = torch.full((num_rows, max_new), self.pad_token_id, dtype=torch.long, device=self._device)
        logprobs = torch.zeros((num_rows, max_new), dtype=torch.float32, device=self._device)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=self._device)

        cache = DynamicCache(config=getattr(self.model, "config", None))
        positions = position_ids_from_mask(prompt_mask)
        out = self.model(input_ids=input_ids, attention_mask=prompt_mask, position_ids=positions,
                         **{self._cache_arg: cache}, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)
        if n > 1:
            cache.batch_repeat_interleave(n)
        mask = prompt_mask.repeat_interleave(n, dim=0)
        next_pos = positions[:, -1].repeat_interleave(n, dim=0) + 1

        active = torch.arange(num_rows, device=self._device)  # row ids still held in the cache
        done = torch.zeros(num_rows, dtype=torch.bool, device=self._device)  # aligned with `active`
        for t in range(max_new):
            tokens, token_logprobs = sample_next_token(
                logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                greedy=params.greedy, generator=generator)
            live = ~done
            responses[active[live], t] = tokens[live]
            logprobs[active[live], t] = token_logprobs[live]
            stopped = live & torch.isin(tokens, stop_ids)
            lengths[active[stopped]] = t + 1
            done |= stopped
            if bool(done.all()) or t == max_new - 1:
                break
            if int(done.sum()) * 4 >= len(done):  # compact the cache once a quarter of the rows are finished
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, tokens, mask, next_pos = active[keep], tokens[keep], mask[keep], next_pos[keep]
                done = done[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                             **{self._cache_arg: cache}, use_cache=True)
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
        return responses, logprobs, lengths
