"""Mixture-of-experts models (hyflow.models.tiny.MOE_PRESETS) through hyflow: the tokenizer round trip, packed and
padded log-probs, generation, and the router diagnostics (`hyflow.models.moe`) against transformers' own formula."""

from __future__ import annotations

import pytest
import torch

from hyflow.models.moe import RouterStats, router_stats, routers


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3"])
def moe_dir(request, moe_model_dirs):
    return moe_model_dirs[request.param]


def test_tiny_moe_models_round_trip_their_tokenizer_and_generate(moe_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    text = "Question: 12 + 7 = ?\nAnswer: 19"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert routers(model)  # a MoE model: its routers are found
    out = model.generate(torch.tensor([tokenizer(text)["input_ids"]]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == len(tokenizer(text)["input_ids"]) + 4


def test_packed_and_padded_log_probs_agree_and_the_update_reports_router_metrics(moe_dir):
    import types

    from engine_case import infer_and_update, rows_batch

    from hyflow.models.loading import load_causal_lm
    from hyflow.specs import FsdpSettings, OptimizerSpec, TrainEngineSpec
    from hyflow.workers.train_engine import TrainEngine

    sizes = types.SimpleNamespace(micro_batch_size_per_device=4, max_token_len_per_device=None, use_dynamic_bsz=False)
    got = {}
    for packed in (False, True):
        spec = TrainEngineSpec(name="actor", head="lm", strategy="fsdp2", compute_dtype="fp32", fsdp=FsdpSettings(),
                               optim=OptimizerSpec(optimizer="SGD", lr=0.1, weight_decay=0.0), use_remove_padding=packed)
        engine = TrainEngine.from_spec(load_causal_lm(moe_dir), spec, device=torch.device("cpu"))
        got[packed] = infer_and_update(engine, rows_batch(engine.module.config.vocab_size), sizes)
    torch.testing.assert_close(got[True][0], got[False][0], atol=1e-5, rtol=0)
    metrics = got[True][1]
    experts = engine.module.config.num_experts if hasattr(engine.module.config, "num_experts") else None
    balance, z, top = (metrics[f"actor/moe/{k}"][0] for k in ("load_balancing_loss", "z_loss", "max_expert_load"))
    assert 0.5 < balance < 4 and z > 0 and 1 <= top <= (experts or 4)


def test_a_dense_model_has_no_router_metrics(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    stats = RouterStats(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert not stats and stats.take() == {}


def test_router_stats_match_transformers_load_balancing_loss(moe_model_dirs):
    """Per MoE layer, load_balancing_loss = Hugging Face's `load_balancing_loss_func` of that layer / k (Megatron
    normalises by the top-k), the z-loss is mean logsumexp^2, the load is E x the busiest expert's share."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = AutoModelForCausalLM.from_pretrained(moe_model_dirs["tiny-qwen3-moe"])
    config = model.config
    ids = torch.randint(5, config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    stats = RouterStats(model)
    with torch.no_grad(), stats:
        out = model(input_ids=ids, output_router_logits=True)
    got = stats.take()
    layers = out.router_logits
    assert len(layers) == 2 and stats.take() == {}  # taken once
    want_balance = sum(float(load_balancing_loss_func((logits,), config.num_experts, config.num_experts_per_tok))
                       for logits in layers) / len(layers) / config.num_experts_per_tok
    want_z = sum(float(torch.logsumexp(logits, -1).square().mean()) for logits in layers) / len(layers)
    assert got["load_balancing_loss"] == pytest.approx(want_balance, rel=1e-5)
    assert got["z_loss"] == pytest.approx(want_z, rel=1e-5)
    # a router that sends every choice to expert 0 with uniform logits: balance 1, load E
    logits, chosen = torch.zeros(6, 4), torch.zeros(6, 2, dtype=torch.long)
    assert router_stats(logits, chosen) == pytest.approx({"load_balancing_loss": 1.0, "z_loss": float(
        torch.log(torch.tensor(4.0)) ** 2), "max_expert_load": 4.0})


def test_the_trainers_fused_experts_go_back_to_the_checkpoints_names_for_vllm(moe_model_dirs):
    """transformers 5 fuses each layer's experts in memory; `checkpoint_layout` reverts the trainer's tensors to the
    checkpoint's names and values (what vLLM loads), and is None for a dense model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from hyflow.rollout.vllm_host import checkpoint_layout

    for preset in ("tiny-qwen3-moe", "tiny-mixtral"):
        path = moe_model_dirs[preset]
        model = AutoModelForCausalLM.from_pretrained(path)
        assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()  # fused in memory
        layout = checkpoint_layout(AutoConfig.from_pretrained(path))
        back = revert_weight_conversion(layout, dict(model.state_dict()))
        disk = load_file(str(path / "model.safetensors"))
        assert set(disk) <= set(back)
        assert all(torch.equal(back[name], tensor) for name, tensor in disk.items()), preset


def test_a_dense_model_needs_no_layout(tiny_model_dir):
    from transformers import AutoConfig

    from hyflow.rollout.vllm_host import checkpoint_layout

    assert checkpoint_layout(AutoConfig.from_pretrained(tiny_model_dir)) is None
