"""The per-token forward of one micro-batch, for `hyflow.workers.train_engine.TrainEngine` (a mixin: the engine
holds the model, its device, head and packing settings that these methods read).

Per-token outputs of a micro-batch (`forward_micro`), for a response span of the last R columns:
- head "lm": `log_probs` [b, r] (and `entropy`, `sum_pi_squared` when asked) of the response tokens at the
  sampling temperature (`hyflow.models.forward.response_logprobs`);
- head "value": `values` [b, r], V(s_t) read before response token t (`hyflow.models.forward.values_from_model`);
- head "score": `scores` [b], one per sequence, the classifier head on its last real token (a reward model,
  `hyflow.models.forward.reward_scores`); no response span (r = 0).
Padded path: the micro-batch is trimmed to the columns that hold a real token (`trim_padding`), so r <= R.
Packed path (`use_remove_padding=True`): the real tokens of all rows run as one row without pads
(`hyflow.models.packing`), position ids restarting per sequence, attention never crossing a sequence; r = R; under
sequence parallelism each rank of the `sp` group runs a slice of it (`hyflow.models.ulysses`).
With `share_prompts` (verl's `actor.use_prefix_grouper`) the rows of a micro-batch that have the same prompt
pack it once and their responses attend to that copy: the same outputs and gradients, fewer tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hyflow.batch import Batch
from hyflow.models.forward import (
    backbone_hidden_states,
    response_logprobs,
    reward_scores,
    unwrap_model,
    values_from_model,
)
from hyflow.models.vision import (
    concat_multi_modal_inputs,
    image_placeholders,
    placeholder_mask,
    split_prompt_images,
)
from hyflow.workers.engine import SEQUENCE_KEYS, trim_padding

__all__ = ["MicroForward", "autocast"]


def autocast(device: torch.device, dtype_name: str):
    """bf16/fp16 autocast on accelerators (fsdp_config.dtype); full precision on CPU."""
    if device.type == "cpu" or dtype_name in ("fp32", "float32"):
        return contextlib.nullcontext()
    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16}[dtype_name]
    return torch.autocast(device_type=device.type, dtype=dtype)


class MicroForward:
    """`forward_micro` and the context of the engine's passes (module docstring). Reads the engine's `model`,
    `device`, `head`, `compute_dtype`, `use_remove_padding`, `share_prompts`, `vision`, `vision_tokens`,
    `sp_group`, `compiled` and `name`."""

    def _sp(self):
        """The sequence-parallel block of a packed forward (a no-op without sequence parallelism)."""
        from hyflow.models.ulysses import sequence_parallel

        return sequence_parallel(self.sp_group)

    @contextlib.contextmanager
    def passes(self, packing: bool = True) -> Iterator[None]:
        """The context this engine's forwards (and their backward, which may recompute layers under gradient
        checkpointing) run in: the model attends within each packed sequence (`hyflow.models.packing`) when
        packing, and its MLPs and norms run compiled under use_torch_compile (`hyflow.models.compile`)."""
        with contextlib.ExitStack() as stack:
            if self.use_remove_padding and packing:
                from hyflow.models.packing import packed_attention

                stack.enter_context(packed_attention(self.model))
            if self.compiled is not None:
                stack.enter_context(self.compiled.active())
            yield

    def forward_micro(self, micro: Batch, response_length: int, *, temperature: float = 1.0,
                      with_entropy: bool = False, with_sum_pi_squared: bool = False,
                      topk_column: str | None = None) -> tuple[dict, int]:
        """Per-token outputs of one micro-batch over its response span (module docstring); returns (outputs, r).
        `topk_column`: a [N, R, K] column of token ids (a teacher's top-k); the outputs then hold `topk_log_probs`
        (this model's log-probs at those ids) and `own_topk_ids` ([.., r, K] each)."""
        R = response_length
        if self.head == "score":
            seq = {key: micro[key].to(self.device) for key in SEQUENCE_KEYS}
            with autocast(self.device, self.compute_dtype):
                return {"scores": reward_scores(self.model, seq["input_ids"], seq["attention_mask"],
                                                seq["position_ids"])}, 0
        if self.sp_group is not None and with_sum_pi_squared:
            raise ValueError(f"{self.name}: sum_pi_squared (the entropy-change metrics) runs the padded forward, "
                             "which sequence parallelism (ulysses_sequence_parallel_size > 1) does not split; turn "
                             "those metrics off or use ulysses_sequence_parallel_size=1")
        if self.use_remove_padding and not with_sum_pi_squared:
            with self._sp():
                return self._packed_micro(micro, R, temperature, with_entropy, topk_column)
        seq, r = trim_padding(micro, R)
        seq = {k: v.to(self.device) for k, v in seq.items()}
        images = self._images(micro)
        # generated image-pad tokens are text to the model, as they were to the rollout engine (placeholder_mask)
        placeholders = (image_placeholders(self.model, placeholder_mask(
            seq["input_ids"], list(micro["multi_modal_inputs"]), self.vision_tokens)) if images
            else contextlib.nullcontext())
        with autocast(self.device, self.compute_dtype), placeholders:
            if self.head == "value":
                values = values_from_model(self.model, seq["input_ids"], seq["attention_mask"],
                                           seq["position_ids"], r, **images)
                return {"values": values}, r
            topk = {} if topk_column is None else {"topk_ids": micro[topk_column][:, :r].to(self.device)}
            logp, entropy, *gathered = response_logprobs(self.model, seq["input_ids"], seq["attention_mask"],
                                                         seq["position_ids"], r, temperature=temperature,
                                                         calculate_entropy=with_entropy, **topk, **images)
            out = {"log_probs": logp, "entropy": entropy}
            if gathered:
                out["topk_log_probs"], out["own_topk_ids"] = gathered
            if with_sum_pi_squared:
                from hyflow.models.logprobs import sum_pi_squared_from_logits

                hidden = backbone_hidden_states(self.model, seq["input_ids"], seq["attention_mask"],
                                                seq["position_ids"], **images)
                logits = unwrap_model(self.model).get_output_embeddings()(hidden[:, -r - 1 : -1])
                out["sum_pi_squared"] = sum_pi_squared_from_logits(logits, temperature)
        return out, r

    def _packed_micro(self, micro: Batch, R: int, temperature: float, with_entropy: bool,
                      topk_column: str | None = None) -> tuple[dict, int]:
        """`forward_micro` on the packed path (sequence-parallel inside `self._sp()`)."""
        from hyflow.models.packing import packed_response_logprobs, packed_values

        ids = micro["input_ids"].to(self.device)
        mask = micro["attention_mask"].to(self.device)
        images = self._images(micro)
        vision = {}
        if self.vision:  # M-RoPE positions, the rows' images and the tokens that take their features
            rows = list(micro["multi_modal_inputs"]) if images else None
            image_mask = placeholder_mask(ids, rows, self.vision_tokens) if images else None
            vision = {"position_ids": micro["position_ids"].to(self.device), "images": images,
                      "image_mask": image_mask}
            if images and self.share_prompts:  # each part with its packed token
                vision["images"] = None
                vision["image_parts"] = split_prompt_images(
                    rows, image_mask[:, : ids.shape[1] - R].sum(-1).tolist(), self.vision_tokens.spatial_merge_size)
        with autocast(self.device, self.compute_dtype):
            if self.head == "value":
                return {"values": packed_values(self.model, ids, mask, R, share_prompts=self.share_prompts,
                                                **vision)}, R
            topk = {} if topk_column is None else {"topk_ids": micro[topk_column].to(self.device)}
            logp, entropy, *gathered = packed_response_logprobs(self.model, ids, mask, R, temperature=temperature,
                                                                calculate_entropy=with_entropy,
                                                                share_prompts=self.share_prompts, **topk, **vision)
        out = {"log_probs": logp, "entropy": entropy}
        if gathered:
            out["topk_log_probs"], out["own_topk_ids"] = gathered
        return out, R

    def _images(self, micro: Batch) -> dict[str, torch.Tensor]:
        """The micro-batch's image inputs for the model call (`pixel_values`, `image_grid_thw`), {} without."""
        if not self.vision or "multi_modal_inputs" not in micro.non_tensors:
            return {}
        images = concat_multi_modal_inputs(list(micro["multi_modal_inputs"]))
        return {key: value.to(self.device) for key, value in images.items()}
