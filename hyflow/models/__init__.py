"""Loading HF causal LMs and tokenizers, the tiny-model factory, log-prob/entropy kernels, packing."""

from hyflow.models.forward import (
    backbone_hidden_states,
    compute_position_ids,
    lm_head_logprobs,
    response_logprobs,
    reward_scores,
    token_values,
    values_from_model,
)
from hyflow.models.loading import (
    apply_config_overrides,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
    save_value_model,
)
from hyflow.models.tiny import PRESETS, make_tiny_model, preset_config, train_bpe_tokenizer

__all__ = [
    "PRESETS",
    "apply_config_overrides",
    "backbone_hidden_states",
    "compute_position_ids",
    "lm_head_logprobs",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "load_value_model",
    "make_tiny_model",
    "preset_config",
    "resolve_model_path",
    "response_logprobs",
    "reward_scores",
    "save_value_model",
    "token_values",
    "train_bpe_tokenizer",
    "values_from_model",
]
