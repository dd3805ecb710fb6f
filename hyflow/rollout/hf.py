"""The `hf` rollout engine: batched sampling with a transformers causal LM and its KV cache.

Works on CPU and GPU with any Hugging Face decoder. Per call:
1. prompts arrive left-padded (`input_ids`, `attention_mask`); each chunk of prompts is prefilled ONCE and the
   KV cache is repeated n times (no n-fold prefill);
2. decode token by token with `SamplingParams` (temperature, top-k, top-p or greedy), recording the log-prob of
   every drawn token under softmax(logits / T);
3. a row stops at its first EOS (or extra stop id) or at `max_new_tokens` (or at its prompt's own budget, an
   optional `max_new_tokens` column of the prompt batch: the agent loop's turns have different budgets left);
   finished rows are dropped from the KV cache as they accumulate, so long-tail samples do not pay for short ones;
4. the output Batch carries verl's keys: `prompts` [N, P] (left-padded), `responses` [N, R] (right-padded with
   the pad id, R = max_new_tokens), `response_mask` (1 up to and including the first EOS), `input_ids`,
   `attention_mask`, `position_ids` [N, P + R], `rollout_log_probs` [N, R] (0 where masked), and every other
   column of the prompt batch repeated per sample (interleaved: rows 0..n-1 are prompt 0's samples).

Vision-language models (`hyflow.models.vision`): a prompt row's `multi_modal_inputs` (the batch's column, or a
TokenRequest's field) go into the prefill with the prompt's M-RoPE positions, which the engine computes from the
row's token ids and image grids; each decoded token continues every position row from its maximum + 1 (verl's and
transformers' rule), so the positions are those `position_ids [N, 4, P + R]` of the rollout batch.

Per decoding step the loop does only what the step needs (on CPU at small sizes the Python and allocation
overhead of a step is comparable to the model's arithmetic): the KV cache of every full-attention layer
is written in place into buffers sized for prompt + `max_new_tokens` (transformers' `DynamicCache`
concatenates, i.e. copies the whole cache of every layer at every step), the attention mask is a view
of one preallocated buffer, and finished rows are written with masked writes instead of boolean
indexing. With SDPA attention and only full-attention layers, the decoding steps hand the model the
4-D boolean mask SDPA receives anyway ([rows, 1, 1, keys], True = attend; transformers passes a 4-D mask
through as is; no mask while no row is padded, as transformers does), instead of a 2-D mask from which
transformers rebuilds it at every step. The arithmetic is unchanged: the same logits, tokens and
log-probs for the same seed (tests/rollout/test_hf_engine.py compares them with transformers' own cache and
masks).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache

try:  # transformers >= 4.56: the cache is a list of per-layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover - older transformers: plain DynamicCache
    DynamicLayer = None

from hyflow.batch import Batch
from hyflow.models.forward import response_token_scores
from hyflow.models.loading import as_torch_dtype
from hyflow.models.vision import (
    VisionTokens,
    concat_multi_modal_inputs,
    image_placeholders,
    is_vision_config,
    placeholder_mask,
    row_position_ids,
)
from hyflow.rollout.base import (
    EngineCapabilities,
    EngineSpec,
    SamplingParams,
    TokenOutput,
    TokenRequest,
    register_engine,
)
from hyflow.rollout.output import generate_rollout, left_pad, padded_outputs, position_ids_from_mask
from hyflow.rollout.sampling import sample_next_token

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@register_engine("hf")
class HFRolloutEngine:
    """Generation with a transformers model.

    `model` may be the trainer's own module (one process, zero-copy weights: `shares_weights=True`) or a separate
    copy that receives weights through `load_weights`. `max_batch_size` bounds the sequences decoded at once
    (samples, not prompts).
    """

    # a stream (hf_stream.HFTokenStream), one full copy of the model per device, the module of EngineSpec (the
    # trainer's, or a copy of it); it reads the rollout's batch bound and dtype, and takes no engine arguments
    capabilities = EngineCapabilities(streams=True, loads_model=False, max_tensor_parallel=1, serves_frozen=True,
                                      knobs=frozenset({"max_num_seqs", "dtype"}))

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
        self._on_host = False  # asleep on an accelerator: the weights wait in pinned host buffers
        self._host_buffers: dict[str, torch.Tensor] = {}
        self._device = next(model.parameters()).device
        self.shares_weights = False  # from_spec sets it when the model is the trainer's own module
        # transformers >= 5.24 names the KV-cache argument `cache` (`past_key_values` is deprecated there)
        forward_args = inspect.signature(type(model).forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        config = getattr(model, "config", None)
        self._vision = VisionTokens.from_config(config) if is_vision_config(config) else None

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses per prompt; see the module docstring for the output keys
        (`hyflow.rollout.output.generate_rollout` over `decode_batch`)."""
        return generate_rollout(self, prompts, params)

    @torch.inference_mode()
    def decode_batch(self, prompts: Batch, params: SamplingParams, budgets: torch.Tensor) -> list[TokenOutput]:
        """The batch decoder: `params.n` samples of each left-padded prompt row (`input_ids`, `attention_mask`; new
        tokens at most `budgets` [B]), the whole call sampled from one generator seeded `params.seed`, each prompt
        prefilled once and its KV cache repeated n times; one TokenOutput per sample (rows interleaved)."""
        if self._asleep:
            raise RuntimeError("the hf rollout engine is asleep; call wake() before generate()")
        input_ids = prompts["input_ids"].to(self._device)
        prompt_mask = prompts["attention_mask"].to(self._device)
        budgets = budgets.to(self._device)
        stop_set = set(self.eos_token_ids) | set(params.stop_token_ids)
        stop_ids = torch.tensor(sorted(stop_set), device=self._device)
        generator = torch.Generator(device=self._device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)

        mm_rows = self._multi_modal_rows(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            prompts_per_chunk = max(1, self.max_batch_size // params.n)
            parts = [
                self._generate_chunk(input_ids[i : i + prompts_per_chunk], prompt_mask[i : i + prompts_per_chunk],
                                     params, stop_ids, generator, budgets[i : i + prompts_per_chunk],
                                     mm_rows=None if mm_rows is None else mm_rows[i : i + prompts_per_chunk])
                for i in range(0, len(input_ids), prompts_per_chunk)
            ]
        finally:
            self.model.train(was_training)
        logprobs = torch.cat([p[1] for p in parts]) if params.calculate_log_probs else None
        return padded_outputs(torch.cat([p[0] for p in parts]), logprobs, torch.cat([p[2] for p in parts]),
                              budgets.repeat_interleave(params.n), stop_set)

    @torch.inference_mode()
    def prompt_log_probs(self, sequences: Batch, response_length: int, topk: int = 0) -> dict[str, torch.Tensor]:
        """The engine's model scoring given sequences (a teacher scoring a student's samples): `log_probs` [N, R]
        of each of the last R tokens (`input_ids`, `attention_mask`, `position_ids` columns, responses
        right-padded), and with `topk` its own `topk_log_probs` / `topk_ids` [N, R, K]
        (`hyflow.models.forward.response_token_scores`), `max_batch_size` rows per forward. On CPU."""
        if self._asleep:
            raise RuntimeError("the hf engine is asleep; call wake() before prompt_log_probs()")
        was_training = self.model.training
        self.model.eval()
        try:
            parts = [response_token_scores(self.model, *(sequences[key][i : i + self.max_batch_size].to(self._device)
                                                         for key in ("input_ids", "attention_mask", "position_ids")),
                                           response_length, topk=topk)
                     for i in range(0, len(sequences), self.max_batch_size)]
        finally:
            self.model.train(was_training)
        return {key: torch.cat([part[key] for part in parts]).cpu() for key in parts[0]}

    # ------------------------------------------------------------------ the token-level protocol
    def open_stream(self, params: SamplingParams):
        """A token stream over this engine (`hyflow.rollout.hf_stream.HFTokenStream`): submit TokenRequests,
        get each TokenOutput back as it finishes; `abort`, `close`."""
        from hyflow.rollout.hf_stream import HFTokenStream

        if self._asleep:
            raise RuntimeError("the hf rollout engine is asleep; call wake() before open_stream()")
        return HFTokenStream(self, params)

    @torch.inference_mode()
    def generate_requests(self, requests: Sequence[TokenRequest], params: SamplingParams, aborted=None,
                          on_output=None) -> list[TokenOutput]:
        """Decode `requests` (prompt ids, at most `max_tokens` new tokens each, each sampled with its own seed) as
        one batch padded here; one TokenOutput per request, in order. `aborted()` (optional), asked before every
        decoding step: a bool per request, True for requests to end there (stop reason "abort").
        `on_output(i, output)` (optional) gets request i's output the step it finishes, before the batch ends."""
        if self._asleep:
            raise RuntimeError("the hf rollout engine is asleep; call wake() before generate_requests()")
        if not requests:
            return []
        empty = next((r.request_id for r in requests if not r.prompt_ids), None)
        if empty is not None:
            raise ValueError(f"request {empty!r} has no prompt token ids")
        budgets = [max(1, min(int(r.max_tokens), params.max_new_tokens)) for r in requests]
        input_ids, prompt_mask = left_pad((r.prompt_ids for r in requests), self.pad_token_id)
        generators = []
        for request in requests:
            generator = torch.Generator()
            if request.seed is None:
                generator.seed()
            else:
                generator.manual_seed(int(request.seed) % (2**63 - 1))
            generators.append(generator)
        stop_set = set(self.eos_token_ids) | set(params.stop_token_ids)
        outputs: list[TokenOutput | None] = [None] * len(requests)
        mm_rows = [r.multi_modal_inputs for r in requests] if self._vision is not None else None
        if mm_rows is None and any(r.multi_modal_inputs for r in requests):
            raise ValueError("a request carries images but the rollout model is not a vision-language model")

        def finish(rows, responses, logprobs, lengths, cut) -> None:
            for row in rows:
                length = int(lengths[row])
                ids = responses[row, :length].tolist()
                if cut[row]:
                    reason = "abort"
                elif (ids and ids[-1] in stop_set) or length < budgets[row]:
                    reason = "stop"
                else:
                    reason = "length"
                outputs[row] = TokenOutput(ids, logprobs[row, :length].tolist() if params.calculate_log_probs
                                           else None, reason)
                if on_output is not None:
                    on_output(row, outputs[row])

        chunk_params = dataclasses.replace(params, n=1, max_new_tokens=max(budgets))
        was_training = self.model.training
        self.model.eval()
        try:
            self._generate_chunk(input_ids.to(self._device), prompt_mask.to(self._device), chunk_params,
                                 torch.tensor(sorted(stop_set), device=self._device), generators,
                                 torch.tensor(budgets, device=self._device), aborted, finish, mm_rows=mm_rows)
        finally:
            self.model.train(was_training)
        return outputs

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, loaded_names: set | None = None) -> int:
        """Copy tensors into the model by parameter name; returns how many were loaded.

        Names may carry wrapper prefixes (DDP `module.`, `torch.compile`'s `_orig_mod.`, FSDP1); a name the model
        does not have is an error. Partial updates (one bucket at a time) are allowed. `loaded_names` collects the
        model's names of the tensors written.
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
                if loaded_names is not None:
                    loaded_names.add(key)
        return loaded

    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> int:
        """Load the trainer's weights bucket by bucket (each bucket is gathered only when it is reached).

        On an accelerator, an engine asleep (its weights on the host) first takes fresh device storage without
        copying the host copy into it, receives the new weights there (device to device), and copies from the host
        only what the update did not cover; it stays asleep until `wake`, which then moves nothing. Before, the new
        weights went device -> host and then host -> device at wake: 2 GB over PCIe per step for a 0.5B model.
        """
        if self.shares_weights:
            return 0
        if not self._on_host:
            return sum(self.load_weights(bucket) for bucket in buckets)
        host = {name: t.data for name, t in self._tensors()}
        self._to_device(copy_params=False)
        written: set = set()
        try:
            loaded = sum(self.load_weights(bucket, loaded_names=written) for bucket in buckets)
        finally:  # whatever the update did not write (or did not reach) comes from the host copy
            with torch.no_grad():
                for name, t in self._tensors():
                    if name not in written:
                        t.data.copy_(host[name], non_blocking=True)
        return loaded

    def sleep(self) -> None:
        """Free accelerator memory between rollouts: the weights move to pinned host buffers (allocated once and
        reused). A no-op on CPU."""
        if self._device.type != "cpu" and not self._on_host:
            with torch.no_grad():
                for name, t in self._tensors():
                    buffer = self._host_buffers.get(name)
                    if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
                        buffer = self._host_buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    buffer.copy_(t.data, non_blocking=True)
                    t.data = buffer
            torch.cuda.synchronize(self._device)
            self._on_host = True
            torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        """Bring the weights back to the device before the next `generate` (nothing to move when an update
        already put new weights there)."""
        if self._on_host:
            self._to_device(copy_params=True)
        self._asleep = False

    def _tensors(self):
        """(name, tensor) of every parameter and buffer, each shared tensor once (tied embeddings)."""
        seen = set()
        for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                yield name, t

    def _to_device(self, *, copy_params: bool) -> None:
        """Give every tensor device storage again; parameters keep their host values only with `copy_params`."""
        with torch.no_grad():
            params = {id(p) for p in self.model.parameters()}
            for _, t in self._tensors():
                storage = torch.empty(t.shape, dtype=t.dtype, device=self._device)
                if copy_params or id(t) not in params:
                    storage.copy_(t.data, non_blocking=True)
                t.data = storage
        torch.cuda.synchronize(self._device)
        self._on_host = False

    # ------------------------------------------------------------------ internals
    def _multi_modal_rows(self, prompts: Batch) -> list | None:
        """The prompt rows' `multi_modal_inputs` for a vision-language model (None for a text model); images for a
        text model are an error."""
        rows = list(prompts["multi_modal_inputs"]) if "multi_modal_inputs" in prompts.non_tensors else None
        if self._vision is None:
            if rows is not None and any(row for row in rows):
                raise ValueError("the prompts carry images but the rollout model is not a vision-language model")
            return None
        return rows if rows is not None else [None] * len(prompts)

    def _vision_prefill(self, input_ids, prompt_mask, mm_rows) -> tuple[torch.Tensor, dict]:
        """Positions [B, 4, P] (left-padded with 0) of the rows' real tokens and the chunk's image inputs."""
        positions = torch.zeros((input_ids.shape[0], 4, input_ids.shape[1]), dtype=torch.long)
        for b in range(input_ids.shape[0]):
            real = prompt_mask[b].bool().cpu()
            positions[b, :, real] = row_position_ids(self._vision, input_ids[b].cpu()[real], mm_rows[b])
        images = {k: v.to(self._device) for k, v in concat_multi_modal_inputs(mm_rows).items()}
        if "pixel_values" in images:
            images["pixel_values"] = images["pixel_values"].to(next(self.model.parameters()).dtype)
        return positions.to(self._device), images

    def _generate_chunk(self, input_ids, prompt_mask, params: SamplingParams, stop_ids, generator, budgets,
                        aborted=None, finished=None, mm_rows=None):
        """Decode one chunk. `generator`: one for the chunk, or a list of CPU generators, one per row (n = 1).
        `aborted()` (optional), asked before every step: a bool per row, True for rows to end there with the
        tokens they have (their length is the step's index). `finished(rows, responses, logprobs, lengths, cut)`
        (optional) is told the rows whose outputs are final, as soon as they are (`cut`: a bool per row, True for
        rows `aborted` ended). Returns (responses, log-probs, lengths)."""
        n, max_new = params.n, params.max_new_tokens
        per_row = isinstance(generator, (list, tuple))
        cache, logits, positions = self._prefill(input_ids, prompt_mask, n, max_new, mm_rows)
        run = _ChunkRun(self, prompt_mask, positions, budgets, n, max_new, finished)
        for t in range(max_new):
            if aborted is not None and run.abort(aborted(), t):
                break
            rows_generator = generator
            if per_row:
                rows_generator = generator if run.active is None else [generator[i] for i in run.active.tolist()]
            tokens, token_logprobs = sample_next_token(
                logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                greedy=params.greedy, generator=rows_generator)
            if run.record(t, tokens, token_logprobs, stop_ids) or t == max_new - 1:
                break
            if run.n_done * 4 >= len(run.done):  # compact the cache once a quarter of the rows are finished
                tokens = run.compact(cache, tokens)
            step_mask, step_pos = run.step_inputs(t, vision=self._vision is not None)
            out = self.model(input_ids=tokens[:, None], attention_mask=step_mask, position_ids=step_pos,
                             **{self._cache_arg: cache}, use_cache=True)
            logits = out.logits[:, -1]
            run.next_pos = run.next_pos + 1
        run.flush()
        return run.responses, run.logprobs, run.lengths

    def _prefill(self, input_ids, prompt_mask, n: int, max_new: int, mm_rows):
        """The prompts' forward into a fresh cache: (cache with each prompt's rows repeated n times, the last
        position's logits per sample row, the prompts' positions: [B, P], or [B, 4, P] M-RoPE for a VLM)."""
        # the decode steps feed one token each: the prompt and at most max_new - 1 of them are ever cached
        cache = _preallocated_cache(getattr(self.model, "config", None), capacity=input_ids.shape[1] + max_new - 1)
        images = {}
        if self._vision is not None:  # [B, 4, P] M-RoPE positions; the model takes [4, B, P]
            mm_rows = mm_rows or [None] * len(input_ids)
            positions, images = self._vision_prefill(input_ids, prompt_mask, mm_rows)
            prefill_positions = positions.transpose(0, 1)
        else:
            positions = prefill_positions = position_ids_from_mask(prompt_mask)
        placeholders = (image_placeholders(self.model, placeholder_mask(input_ids, mm_rows, self._vision)) if images
                        else contextlib.nullcontext())  # pad tokens a previous turn generated are text
        with placeholders:
            out = self.model(input_ids=input_ids, attention_mask=prompt_mask, position_ids=prefill_positions,
                             **{self._cache_arg: cache}, use_cache=True, logits_to_keep=1, **images)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)
        if n > 1:
            cache.batch_repeat_interleave(n)
        return cache, logits, positions


class _ChunkRun:
    """The state of one chunk's decode loop (`HFRolloutEngine._generate_chunk`): the outputs by chunk row, the rows
    still in the cache (`active`: their chunk row numbers, None for all in order) and what is aligned with them
    (`done`, the attention mask, the next positions, the budgets)."""

    def __init__(self, engine, prompt_mask, positions, budgets, n: int, max_new: int, finished):
        device, num_rows = engine._device, len(prompt_mask) * n
        self.pad_token_id, self.finished = engine.pad_token_id, finished
        self.prompt_width = prompt_width = prompt_mask.shape[1]
        self.responses = torch.full((num_rows, max_new), engine.pad_token_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((num_rows, max_new), dtype=torch.float32, device=device)
        self.lengths = budgets.repeat_interleave(n)  # a row that never stops ends at its budget
        # rows whose budget is below max_new_tokens (agent-loop turns) stop there; None when every row has it all
        self.row_budgets = None if bool((self.lengths == max_new).all()) else self.lengths.clone()
        # attention mask of prompt + every decoded token: step t attends to columns [0, prompt_width + t + 1)
        self.mask_4d = decodes_with_4d_mask(engine.model)
        self.mask = torch.ones((num_rows, prompt_width + max_new),
                               dtype=torch.bool if self.mask_4d else prompt_mask.dtype, device=device)
        self.mask[:, :prompt_width] = prompt_mask.repeat_interleave(n, dim=0)
        # SDPA gets no mask when no row is padded (what transformers does with an all-ones mask; a mask of all True
        # would change the kernel's rounding), so the ready-made mask is passed only while some row is padded
        self.unpadded = bool(self.mask[:, :prompt_width].all())
        if positions.dim() == 3:  # [rows, 4]: each M-RoPE position row continues from its maximum
            self.next_pos = positions.max(dim=-1).values.repeat_interleave(n, dim=0) + 1
        else:
            self.next_pos = positions[:, -1].repeat_interleave(n, dim=0) + 1
        self.active = None  # row ids still held in the cache (None: all rows, in order)
        self.done = torch.zeros(num_rows, dtype=torch.bool, device=device)  # aligned with the cache's rows
        self.n_done = 0
        self.cut_rows = torch.zeros(num_rows, dtype=torch.bool, device=device)  # rows `aborted` ended

    def _tell(self, aligned: torch.Tensor) -> None:
        if self.finished is not None:
            self.finished(_rows(aligned, self.active), self.responses, self.logprobs, self.lengths, self.cut_rows)

    def abort(self, asked, t: int) -> bool:
        """End the rows `asked` (a bool per chunk row) cuts at step t; True when no row is left."""
        cut = torch.tensor(asked, dtype=torch.bool, device=self.done.device)
        cut_now = (cut if self.active is None else cut[self.active]) & ~self.done
        if not bool(cut_now.any()):
            return False
        if self.active is None:
            self.lengths.masked_fill_(cut_now, t)
            self.cut_rows |= cut_now
        else:
            self.lengths[self.active] = torch.where(cut_now, t, self.lengths[self.active])
            self.cut_rows[self.active] |= cut_now
        self.done |= cut_now
        self._tell(cut_now)
        self.n_done = int(self.done.sum())
        return self.n_done == len(self.done)

    def record(self, t: int, tokens, token_logprobs, stop_ids) -> bool:
        """Write step t's sampled tokens; rows that stop there end. True when every row has ended."""
        n_done, done = self.n_done, self.done
        # rows finished earlier (still in the cache until the next compaction) keep their padding
        new_tokens = tokens.masked_fill(done, self.pad_token_id) if n_done else tokens
        new_logprobs = token_logprobs.masked_fill(done, 0.0) if n_done else token_logprobs
        stopped = torch.isin(tokens, stop_ids)
        if self.row_budgets is not None:
            stopped |= self.row_budgets == t + 1  # lengths already hold the budget
        if n_done:
            stopped &= ~done
        if self.active is None:
            self.responses[:, t] = new_tokens
            self.logprobs[:, t] = new_logprobs
            self.lengths.masked_fill_(stopped, t + 1)
        else:
            self.responses[self.active, t] = new_tokens
            self.logprobs[self.active, t] = new_logprobs
            self.lengths[self.active] = torch.where(stopped, t + 1, self.lengths[self.active])
        done |= stopped
        if bool(stopped.any()):
            self._tell(stopped)
        self.n_done = int(done.sum())
        return self.n_done == len(done)

    def compact(self, cache, tokens):
        """Drop the finished rows from the cache and from what is aligned with it; returns the kept rows' tokens."""
        keep = (~self.done).nonzero().squeeze(-1)
        cache.batch_select_indices(keep)
        self.active = keep if self.active is None else self.active[keep]
        self.mask, self.next_pos, self.done = self.mask[keep], self.next_pos[keep], self.done[keep]
        if self.row_budgets is not None:
            self.row_budgets = self.row_budgets[keep]
        self.n_done = 0
        self.unpadded = bool(self.mask[:, :self.prompt_width].all())
        return tokens[keep]

    def step_inputs(self, t: int, vision: bool):
        """(attention mask, position ids) of the decode step after step t."""
        step_mask = self.mask[:, : self.prompt_width + t + 1]
        if self.mask_4d:
            step_mask = None if self.unpadded else step_mask[:, None, None]
        step_pos = self.next_pos.T[:, :, None] if vision else self.next_pos[:, None]
        return step_mask, step_pos

    def flush(self) -> None:
        """Tell `finished` the rows that ran to the end without stopping."""
        unfinished = ~self.done
        if self.finished is not None and bool(unfinished.any()):
            self._tell(unfinished)


def _rows(aligned: torch.Tensor, active: torch.Tensor | None) -> list[int]:
    """The chunk's row numbers of a mask aligned with the rows still in the cache (`active`: their numbers)."""
    return (aligned.nonzero().flatten() if active is None else active[aligned]).tolist()


def decodes_with_4d_mask(model: torch.nn.Module) -> bool:
    """Whether a decoding step may get its [rows, 1, 1, keys] boolean mask ready-made: SDPA attention and only
    full-attention layers (a sliding-window or chunked layer needs transformers to build its own mask)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    if getattr(config, "attention_chunk_size", None) is not None:
        return False
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


def _preallocated_cache(config, capacity: int) -> DynamicCache:
    """A `DynamicCache` whose full-attention layers write into buffers of `capacity` positions.

    Other layer kinds (sliding-window, linear attention) and transformers versions without per-layer cache objects
    keep transformers' own layers.
    """
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if DynamicLayer is not None and isinstance(layers, list):
        for i, layer in enumerate(layers):
            if type(layer) is DynamicLayer:
                layers[i] = _PreallocatedLayer(capacity)
    return cache


if DynamicLayer is not None:

    class _PreallocatedLayer(DynamicLayer):
        """A full-attention KV-cache layer that writes new keys/values in place into [B, H, capacity, D] buffers
        and hands attention views of the filled part; `DynamicLayer` concatenates instead (a copy of the whole
        layer cache per step). Past `capacity` it grows by doubling, so it is never wrong, only slower."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = max(1, int(capacity))
            self.length = 0
            self._key_buf = self._value_buf = None

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
            # written out rather than super()'s: its signature changed between transformers releases
            value_states = key_states if value_states is None else value_states
            self.dtype, self.device = key_states.dtype, key_states.device
            batch, heads, _, _ = key_states.shape
            self._key_buf = key_states.new_empty(batch, heads, self.capacity, key_states.shape[-1])
            self._value_buf = value_states.new_empty(batch, value_states.shape[1], self.capacity,
                                                     value_states.shape[-1])
            self.is_initialized = True
            self._refresh_views()

        def _refresh_views(self) -> None:
            self.keys = self._key_buf[:, :, : self.length]
            self.values = self._value_buf[:, :, : self.length]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                self.capacity = max(end, 2 * self.capacity)
                grown_k = self._key_buf.new_empty(*self._key_buf.shape[:2], self.capacity, self._key_buf.shape[-1])
                grown_v = self._value_buf.new_empty(*self._value_buf.shape[:2], self.capacity,
                                                    self._value_buf.shape[-1])
                grown_k[:, :, : self.length] = self.keys
                grown_v[:, :, : self.length] = self.values
                self._key_buf, self._value_buf = grown_k, grown_v
            self._key_buf[:, :, self.length : end] = key_states
            self._value_buf[:, :, self.length : end] = value_states
            self.length = end
            self._refresh_views()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self._key_buf = self._key_buf.repeat_interleave(repeats, dim=0)
                self._value_buf = self._value_buf.repeat_interleave(repeats, dim=0)
                self._refresh_views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self._key_buf = self._key_buf[indices]
                self._value_buf = self._value_buf[indices]
                self._refresh_views()

        def reset(self) -> None:
            super().reset()
            self.length = 0
            self._key_buf = self._value_buf = None

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove < 0 and self.is_initialized:
                self.length = max(0, self.length + tokens_to_remove)
                self._refresh_views()
            else:
                super().crop(tokens_to_remove)
