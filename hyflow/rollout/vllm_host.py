"""What the vLLM engine reads of the host before it starts: a checkpoint's tensor shapes (headers only), the KV-cache
memory one rank needs, and the stale shared-memory segments a killed tensor-parallel run leaves behind. No vLLM
import here."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape of the safetensors checkpoint at `model_path` (headers only), or None without one."""
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def kv_cache_bytes(hf_config, *, dtype_bytes: int, max_num_seqs: int, max_model_len: int, fraction: float,
                   tensor_parallel_size: int = 1) -> int:
    """KV cache of one rank for `max_num_seqs` sequences of `max_model_len` tokens (rounded up to vLLM's 128-token
    CPU blocks): 2 (K and V) x layers x kv_heads / tp x head_dim x dtype bytes per token, capped at `fraction` of
    the memory this machine has free, and never less than one full sequence (vLLM refuses to start with less)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = max(1, kv_heads // tensor_parallel_size)
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    block = 128  # vLLM's CPU block size: a sequence holds whole blocks
    one_sequence = per_token * block * -(-max_model_len // block)
    import psutil

    cap = int(psutil.virtual_memory().available * fraction)
    return max(min(one_sequence * max_num_seqs, cap), one_sequence)


def remove_stale_cpu_shm(shm_dir: str = "/dev/shm") -> list[str]:
    """Delete the shared-memory segments of vLLM's CPU tensor-parallel all-reduce (`*-cpushm_*`) that no live
    process maps, and return their names.

    vLLM names them after the process group, the same name every run (its external launcher's `env://`), and a run
    whose workers were killed leaves them behind; the next tensor-parallel engine then fails with "create shm in
    SHMManager failed. errno: 17". A segment some process still maps (another live engine) is left alone.
    """
    root = Path(shm_dir)
    candidates = {f.name for f in root.glob("*-cpushm_*")} if root.is_dir() else set()
    if not candidates:
        return []
    in_use: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # gone, or not ours to read
        in_use.update(name for name in candidates if f"{shm_dir}/{name}" in text)
    removed = []
    for name in sorted(candidates - in_use):
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()
            removed.append(name)
    return removed


def checkpoint_layout(hf_config, trust_remote_code: bool = False):
    """A weightless (meta-device) copy of the model when transformers loads its checkpoint through a conversion: its
    mixture-of-experts families fuse each layer's per-expert `experts.{e}.{gate,up,down}_proj` into 3-D
    `gate_up_proj` / `down_proj` in memory (and Mixtral's `block_sparse_moe` is renamed `mlp`), while the checkpoint,
    which vLLM loads, keeps the per-expert names. The vLLM engine sends the trainer's weights back to the checkpoint's
    names and shapes with it, through transformers' own `revert_weight_conversion` (what `save_pretrained` does).
    None when the in-memory names are the checkpoint's (dense models) or the config has no causal-LM class here."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError):
        return None
    return model if get_model_conversion_mapping(model, add_legacy=False) else None
