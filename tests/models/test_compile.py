"""`hyflow.models.compile` (verl's use_torch_compile): the MLPs and RMSNorms run compiled inside `active()` only,
with the eager values and gradients, and the module is plain outside."""

from __future__ import annotations

import copy

import pytest
import torch

from hyflow.models.compile import CompiledModules
from hyflow.models.loading import load_causal_lm
from hyflow.models.packing import packed_attention, packed_response_logprobs

pytestmark = pytest.mark.slow


def batch(rows=((4, 9), (7, 3), (2, 12)), width=(8, 12), seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 400, (len(rows), sum(width)), generator=gen)
    mask = torch.zeros_like(ids)
    for b, (p, r) in enumerate(rows):
        mask[b, width[0] - p : width[0] + r] = 1
    return ids * mask, mask, width[1]


def logprobs_and_grads(model, ids, mask, response_length):
    model.zero_grad(set_to_none=True)
    with packed_attention(model):
        logp, entropy = packed_response_logprobs(model, ids, mask, response_length, calculate_entropy=True)
        (-(logp + 0.1 * entropy).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logp.detach(), grads


def test_compiled_passes_match_eager_and_leave_the_module_plain(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir).train()
    compiled = CompiledModules(model)
    assert compiled.names == ["Qwen2MLP", "Qwen2RMSNorm"]
    assert len(compiled.modules) == 3 * model.config.num_hidden_layers + 1  # an MLP and 2 norms per layer, + final
    ids, mask, R = batch()
    want, want_grads = logprobs_and_grads(model, ids, mask, R)
    with compiled.active():
        assert all(m._compiled_call_impl is not None for m in compiled.modules)
        got, got_grads = logprobs_and_grads(model, ids, mask, R)
        ids2, mask2, R2 = batch(rows=((8, 12), (1, 1)), seed=1)  # another token count: no error, same values
        got2, _ = logprobs_and_grads(model, ids2, mask2, R2)
    assert all(m._compiled_call_impl is None for m in compiled.modules)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5 * float(grad.abs().max()) + 1e-7, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
    want2, _ = logprobs_and_grads(model, ids2, mask2, R2)
    torch.testing.assert_close(got2, want2, atol=1e-5, rtol=0)
    copy.deepcopy(model)  # nothing compiled is left on the module


def test_a_model_without_mlp_or_rmsnorm_classes_is_refused_by_name():
    with pytest.raises(ValueError, match=r"use_torch_compile: Sequential has no module whose class name ends in "
                                         r"MLP or RMSNorm.*set use_torch_compile=false"):
        CompiledModules(torch.nn.Sequential(torch.nn.Linear(2, 2)))
