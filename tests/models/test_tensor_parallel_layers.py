"""Tensor parallelism of a Hugging Face decoder on 2 gloo ranks (hyflow.models.tensor_parallel): each rank holds
half of every layer's heads and MLP columns, and the packed and padded log-probs, the values of a value model and
the gradients (gathered to full tensors) equal one process's, with grouped-query heads; a model whose heads the
group does not divide, or whose linears are wrapped (LoRA), is refused by name. Every split module of every layer
holds its rank's slice (shape and contents) and everything else stays whole; per rank the parameters and gradients
of the benchmark's model weigh what BENCHMARKS.md states (0.52x). The 2-rank cases run one after another in one spawn
of 2 ranks (the `two_ranks` fixture: a spawn costs each rank its imports, ~5 CPU-s, a case under one), and each
test asserts that its own case failed no check."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
from ranks import spawn_cases

from hyflow.models import tensor_parallel as tp
from hyflow.parallel import ParallelDims

R = 5

# Megatron's layout, written out here rather than read from tp.LAYER_PLAN (a module dropped from the plan must fail
# the test): the dim of the nn.Linear weight [out, in] each rank holds a slice of; colwise biases are split likewise,
# rowwise ones (none in Qwen2) stay whole.
SPLIT_DIMS = {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0, "self_attn.o_proj": 1,
              "mlp.gate_proj": 0, "mlp.up_proj": 0, "mlp.down_proj": 1}


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


def _assert_split(model, whole: dict, rank: int, size: int) -> None:
    """Each parameter of a SPLIT_DIMS module of every decoder layer is a DTensor on the tp mesh, sharded on its dim
    (a rowwise bias replicated), whose local part is this rank's slice of the unsplit tensor (`whole`); every other
    parameter is the plain unsplit tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hyflow.parallel.fsdp import decoder_layers

    names = {module: name for name, module in model.named_modules()}
    placements = {}
    for layer in decoder_layers(model):
        for path, dim in SPLIT_DIMS.items():
            linear = layer.get_submodule(path)
            placements[f"{names[linear]}.weight"] = Shard(dim)
            if linear.bias is not None:
                placements[f"{names[linear]}.bias"] = Shard(0) if dim == 0 else Replicate()
    assert len(placements) >= len(SPLIT_DIMS) * model.config.num_hidden_layers
    for name, param in model.named_parameters():
        placement = placements.pop(name, None)
        if placement is None:
            assert not isinstance(param, DTensor), f"{name} is split: {param.placements}"
            torch.testing.assert_close(param.detach(), whole[name], atol=0, rtol=0, msg=name)
            continue
        assert isinstance(param, DTensor) and param.placements == (placement,), (name, type(param))
        assert param.shape == whole[name].shape, name
        want = whole[name].chunk(size, dim=placement.dim)[rank] if placement.is_shard() else whole[name]
        local = param.to_local()
        assert local.shape == want.shape, (name, tuple(local.shape), tuple(want.shape))
        torch.testing.assert_close(local.detach(), want, atol=0, rtol=0, msg=name)
    assert not placements, f"not parameters of the model: {sorted(placements)}"


def _logprobs_case(rank: int, checks, path: str, kv_heads: int, packed: bool) -> None:
    from hyflow.parallel.fsdp import decoder_layers

    model = _model(path, kv_heads)
    ids, mask = _batch()
    reference, reference_grads = _outputs_and_grads(model, ids, mask, packed)
    whole = {name: p.detach().clone() for name, p in model.named_parameters()}
    mesh = ParallelDims(world_size=2, tp=2).build_mesh("cpu")
    tp.apply_tensor_parallel(model, decoder_layers(model), mesh.get("tp"))
    with checks.check("the split"):
        _assert_split(model, whole, rank, 2)
    logp, grads = _outputs_and_grads(model, ids, mask, packed)
    real = mask[:, -R:].bool()
    with checks.check("log-probs"):
        assert torch.allclose(logp[real], reference[real], atol=1e-5, rtol=0), (logp - reference).abs().max()
    with checks.check("gradients"):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], atol=2e-5, rtol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _values_case(rank: int, checks, path: str) -> None:
    from hyflow.models.packing import packed_attention, packed_values
    from hyflow.parallel.fsdp import decoder_layers

    model = _model(path, 2, value=True)
    ids, mask = _batch(1)
    with packed_attention(model):
        reference = packed_values(model, ids, mask, R).detach()
    tp.apply_tensor_parallel(model, decoder_layers(model), ParallelDims(world_size=2, tp=2).build_mesh("cpu").get("tp"))
    with packed_attention(model):
        values = packed_values(model, ids, mask, R).detach()
    real = mask[:, -R:].bool()
    with checks.check("values"):
        assert torch.allclose(values[real], reference[real], atol=1e-5, rtol=0), (values - reference).abs().max()


LOGPROBS_CASES = [(2, True), (2, False), (4, True)]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    """{case: failures} of every case of this module, run in one spawn of 2 gloo ranks."""
    cases = [(f"log-probs and gradients, {kv} K/V heads, packed {packed}", _logprobs_case,
              (str(tiny_model_dir), kv, packed)) for kv, packed in LOGPROBS_CASES]
    cases.append(("values", _values_case, (str(tiny_model_dir),)))
    return spawn_cases(cases, tmp_path_factory.mktemp("tensor_parallel_ranks"), timeout_s=300)


@pytest.mark.parametrize(("kv_heads", "packed"), LOGPROBS_CASES)
def test_tensor_parallel_log_probs_and_gradients_equal_one_process(two_ranks, kv_heads, packed):
    failures = two_ranks[f"log-probs and gradients, {kv_heads} K/V heads, packed {packed}"]
    assert not failures, "\n".join(failures)


def test_tensor_parallel_value_model_equals_one_process(two_ranks):
    failures = two_ranks["values"]
    assert not failures, "\n".join(failures)


def test_models_tensor_parallelism_cannot_split_are_refused_by_name(tiny_model_dir):
    from hyflow.models.lora import apply_lora
    from hyflow.parallel.fsdp import decoder_layers
    from hyflow.specs import LoraSettings

    model = _model(str(tiny_model_dir), 1)
    assert tp.tp_problem(model, decoder_layers(model), 2) == (
        "tensor_parallel_size=2 must divide the model's 1 key-value heads")
    assert "must divide the model's 4 attention heads" in tp.tp_problem(model, decoder_layers(model), 3)
    assert tp.tp_problem(_model(str(tiny_model_dir), 2), decoder_layers(model), 2) is None
    lora = apply_lora(_model(str(tiny_model_dir), 2), LoraSettings(rank=4, alpha=8),
                      task="causal_lm")
    problem = tp.tp_problem(lora, decoder_layers(lora), 2)
    assert "needs a plain nn.Linear at self_attn.q_proj" in problem and "without LoRA" in problem


BENCHMARKS = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
BENCH_SCRIPT = BENCHMARKS.parent / "benchmarks" / "bench_train.py"


@pytest.mark.slow
def test_parameters_and_gradients_per_rank_weigh_what_benchmarks_md_states(tmp_path, capsys):
    """BENCHMARKS.md's "Parameters + gradients per rank: 0.52x (15,744,000 -> 8,138,752 bytes each)" for the small
    preset at tp=2, recomputed by the benchmark's own code (`benchmarks/bench_train.py --tp 2`: the bytes of each
    parameter's and gradient's local part after a packed step) on a short row: the bytes do not depend on the
    row, so they are exact, and the ratio is the one the document prints."""
    stated = re.search(r"Parameters \+ gradients per rank: ([0-9.]+)x\*\* \(([0-9,]+) -> ([0-9,]+) bytes each",
                       BENCHMARKS.read_text())
    assert stated, "BENCHMARKS.md no longer states the tp=2 parameter + gradient bytes"
    ratio, one, two = stated.group(1), *(int(n.replace(",", "")) for n in stated.group(2, 3))
    spec = importlib.util.spec_from_file_location("bench_train", BENCH_SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = bench  # the spawned ranks unpickle their function from it by name
    spec.loader.exec_module(bench)
    report = bench.main(["--tp", "2", "--preset", "small", "--batch-size", "1", "--min-len", "24", "--max-len", "24",
                         "--prompt-max", "8", "--rounds", "1", "--steps", "1", "--warmup", "0",
                         "--workdir", str(tmp_path / "work")])
    capsys.readouterr()
    paths = report["results"]["paths"]
    for name, want in (("tp=1", one), ("tp=2", two)):
        for kind in ("parameter", "gradient"):
            assert paths[name][f"{kind}_mb_per_rank"] * 2**20 == want, (name, kind)
    assert f"{report['results']['ratio_parameters_and_gradients']:.2f}" == ratio
