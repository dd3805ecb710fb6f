"""MFU's FLOPs count and device peaks (hyflow.models.flops)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from hyflow.models.flops import device_peak_flops, matmul_parameters, training_flops
from hyflow.models.tiny import preset_config


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_matmul_parameters_are_the_models_linear_weights(preset):
    """N counts every nn.Linear weight a token goes through (q, k, v, o, gate, up, down, lm_head), once."""
    config = preset_config(preset, 300, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_parameters(config) == linear
    assert matmul_parameters(config, head="value") == linear - config.vocab_size * config.hidden_size + config.hidden_size


def test_training_flops_by_hand():
    config = Qwen2Config(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=10)
    # per layer: attention 8 x (2 + 2) x 4 + 2 x 4 x 8 = 192, MLP 3 x 8 x 16 = 384; head 10 x 8 = 80
    n = 2 * (192 + 384) + 80
    assert matmul_parameters(config) == n
    flops = training_flops(config, [3, 5])
    assert flops == 6 * n * 8 + 6 * 2 * 2 * 4 * (9 + 25)
    assert training_flops(config, [3, 5], frozen_weights=True) == 4 * n * 8 + 6 * 2 * 2 * 4 * (9 + 25)


def test_device_peaks_match_by_name_and_unknown_devices_have_none():
    assert device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops("NVIDIA L40S") == 362e12  # not L40's
    assert device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_peak_flops("NVIDIA GeForce GTX 1080") is None
    assert device_peak_flops(None) is None
