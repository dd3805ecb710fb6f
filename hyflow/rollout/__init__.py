"""Generation engines behind one protocol, built by name: `hf` (transformers, the default) and `vllm`."""
