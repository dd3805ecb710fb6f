"""Model FLOPs utilisation (MFU): the FLOPs a training pass over some sequences needs, and a device's peak.

Training FLOPs of a decoder-only transformer over sequences of lengths s_i (Kaplan et al. 2020, arXiv 2001.08361;
the PaLM paper's MFU, arXiv 2204.02311, appendix B):

    F = 6 * N * sum_i s_i  +  6 * L * H * d * sum_i s_i^2

- N = the parameters of the matrix multiplications every token goes through: per layer the attention projections
  (q, k, v, o: hidden x (H + 2 K) d + H d x hidden) and the gated MLP (3 x hidden x intermediate), and the output
  head (vocab x hidden for a language model, hidden x 1 for a value head). The embedding lookup is not a matmul
  and is not counted. 6 = 2 (multiply-add) x 3 (forward, and backward for activations and weights).
- The attention scores and their weighted sum cost 2 x 2 s^2 H d per layer in the forward for full attention;
  causal attention needs half (2 s^2 H d), and training three times that: 6 L H d s^2.

MFU = F / (seconds x peak FLOP/s of the devices). The peak is the dense bf16 tensor-core figure from the vendor's
data sheet (`DEVICE_PEAK_FLOPS`, matched by the CUDA device name); a device not in the table, and a CPU, have
none and no MFU is reported (a made-up peak would make the number meaningless).
"""

from __future__ import annotations

from collections.abc import Iterable

# dense bf16 tensor FLOP/s (no sparsity), from the vendors' data sheets; matched as substrings of the CUDA device
# name, longest name first (so "H100" does not claim an "H100 NVL" entry of its own, were one added)
DEVICE_PEAK_FLOPS: dict[str, float] = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L20": 119.5e12,
    "A40": 149.7e12,
    "A10G": 70e12,
    "MI300X": 1307e12,
}


def device_peak_flops(device_name: str | None) -> float | None:
    """The table's peak for a CUDA device name (e.g. "NVIDIA H100 80GB HBM3"), or None when unknown."""
    if not device_name:
        return None
    for key in sorted(DEVICE_PEAK_FLOPS, key=len, reverse=True):
        if key in device_name:
            return DEVICE_PEAK_FLOPS[key]
    return None


def matmul_parameters(config, head: str = "lm") -> int:
    """N of the module docstring from a Hugging Face decoder config (hidden_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size)."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * int(config.intermediate_size)
    output = hidden * (int(config.vocab_size) if head == "lm" else 1)
    return int(config.num_hidden_layers) * (attention + mlp) + output


def training_flops(config, sequence_lengths: Iterable[int], head: str = "lm", frozen_weights: bool = False) -> float:
    """F of the module docstring: one forward and backward pass over sequences of these token lengths.
    `frozen_weights` (LoRA): the base weights get no gradient, so their matmuls cost 4 N per token, not 6 N (the
    adapters' own FLOPs, rank x (in + out) per matrix, are left out)."""
    lengths = [int(s) for s in sequence_lengths]
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    dense = (4.0 if frozen_weights else 6.0) * matmul_parameters(config, head) * sum(lengths)
    attention = 6.0 * int(config.num_hidden_layers) * heads * head_dim * sum(s * s for s in lengths)
    return dense + attention
