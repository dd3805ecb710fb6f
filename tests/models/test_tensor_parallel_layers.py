"""Tensor parallelism of a Hugging Face decoder on 2 gloo ranks (hyflow.models.tensor_parallel): each rank holds
half of every layer's heads and MLP columns, and the packed and padded log-probs, the values of a value model and
the gradients (gathered to full tensors) equal one process's, with grouped-query heads; a model whose heads the
group does not divide, or whose linears are wrapped (LoRA), is refused by name."""

from __future__ import annotations

import pytest
import torch
from ranks import init_gloo, spawn_ranks

from hyflow.models import tensor_parallel as tp

R = 5


def _batch(seed: int = 0):
    """Left-padded prompts + right-padded responses of different lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(7, 5), (4, 3), (9, 4), (3, 5)]
    P = max(p for p, _ in lengths)
    ids = torch.zeros(len(lengths), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, n) in enumerate(lengths):
        ids[b, P - p:P + n] = torch.randint(5, 400, (p + n,), generator=g)
        mask[b, P - p:P + n] = 1
    return ids, mask


def _model(path: str, kv_heads: int, value: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path)
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    if value:
        config.num_labels = 1
        return AutoModelForTokenClassification.from_config(config, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _weights(mask: torch.Tensor) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, R * mask.shape[0]).view(mask.shape[0], R) * mask[:, -R:]


def _outputs_and_grads(model, ids, mask, packed: bool):
    from hyflow.models.forward import response_logprobs
    from hyflow.models.packing import packed_attention, packed_response_logprobs

    model.zero_grad()
    if packed:
        with packed_attention(model):
            logp, _ = packed_response_logprobs(model, ids, mask, R)
    else:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logp, _ = response_logprobs(model, ids, mask, positions, R)
    (logp * _weights(mask)).sum().backward()
    return logp.detach(), {n: _full(p.grad).clone() for n, p in model.named_parameters()}


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _rank(rank: int, init_file: str, path: str, kv_heads: int, packed: bool) -> None:
    import torch.distributed as dist

    from hyflow.workers.fsdp import decoder_layers

    init_gloo(rank, 2, init_file)
    model = _model(path, kv_heads)
    ids, mask = _batch()
    reference, reference_grads = _outputs_and_grads(model, ids, mask, packed)
    mesh = tp.tp_mesh("cpu", 2, 2)
    tp.apply_tensor_parallel(model, decoder_layers(model), mesh["tp"])
    q = decoder_layers(model)[0].self_attn.q_proj.weight
    assert q.to_local().shape[0] == q.shape[0] // 2  # each rank holds half of the query heads
    logp, grads = _outputs_and_grads(model, ids, mask, packed)
    real = mask[:, -R:].bool()
    assert torch.allclose(logp[real], reference[real], atol=1e-5, rtol=0), (logp - reference).abs().max()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    dist.destroy_process_group()


@pytest.mark.parametrize(("kv_heads", "packed"), [(2, True), (2, False), (4, True)])
def test_tensor_parallel_log_probs_and_gradients_equal_one_process(tiny_model_dir, tmp_path, kv_heads, packed):
    spawn_ranks(_rank, args=(str(tmp_path / "init"), str(tiny_model_dir), kv_heads, packed), timeout_s=300)


def _values_rank(rank: int, init_file: str, path: str) -> None:
    import torch.distributed as dist

    from hyflow.models.packing import packed_attention, packed_values
    from hyflow.workers.fsdp import decoder_layers

    init_gloo(rank, 2, init_file)
    model = _model(path, 2, value=True)
    ids, mask = _batch(1)
    with packed_attention(model):
        reference = packed_values(model, ids, mask, R).detach()
    tp.apply_tensor_parallel(model, decoder_layers(model), tp.tp_mesh("cpu", 2, 2)["tp"])
    with packed_attention(model):
        values = packed_values(model, ids, mask, R).detach()
    real = mask[:, -R:].bool()
    assert torch.allclose(values[real], reference[real], atol=1e-5, rtol=0), (values - reference).abs().max()
    dist.destroy_process_group()


def test_tensor_parallel_value_model_equals_one_process(tiny_model_dir, tmp_path):
    spawn_ranks(_values_rank, args=(str(tmp_path / "init"), str(tiny_model_dir)), timeout_s=300)


def test_models_tensor_parallelism_cannot_split_are_refused_by_name(tiny_model_dir):
    from hyflow.models.lora import apply_lora
    from hyflow.specs import LoraSettings
    from hyflow.workers.fsdp import decoder_layers

    model = _model(str(tiny_model_dir), 1)
    assert tp.tp_problem(model, decoder_layers(model), 2) == (
        "tensor_parallel_size=2 must divide the model's 1 key-value heads")
    assert "must divide the model's 4 attention heads" in tp.tp_problem(model, decoder_layers(model), 3)
    assert tp.tp_problem(_model(str(tiny_model_dir), 2), decoder_layers(model), 2) is None
    lora = apply_lora(_model(str(tiny_model_dir), 2), LoraSettings(rank=4, alpha=8),
                      task="causal_lm")
    problem = tp.tp_problem(lora, decoder_layers(lora), 2)
    assert "needs a plain nn.Linear at self_attn.q_proj" in problem and "without LoRA" in problem
