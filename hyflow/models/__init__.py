"""Loading HF causal LMs and tokenizers, the tiny-model factory, log-prob/entropy kernels, packing."""
