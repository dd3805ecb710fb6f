"""On-policy distillation's plumbing: the teacher engine's scores, the student's log-probs at the teacher's top-k
ids (padded and packed paths), routing between teachers, and the config's and the tokenizer check's errors."""

import pytest
import torch

from hyflow.batch import Batch
from hyflow.config import load_config, validate_config
from hyflow.config.keys import ConfigError
from hyflow.config.roles import teacher_spec
from hyflow.models.forward import compute_position_ids, response_logprobs
from hyflow.models.loading import load_causal_lm, load_tokenizer
from hyflow.models.packing import packed_response_logprobs
from hyflow.workers.teacher import TeacherWorker, check_teacher_tokenizers


def _batch(V, seed=0, B=3, P=4, R=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[0, :2] = 0  # left-padded prompt
    mask[1, -2:] = 0  # right-padded response
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask),
                  "responses": ids[:, P:]}), R


def test_hf_engine_scores_sampled_tokens_and_topk(tiny_model_dir):
    from hyflow.rollout.base import EngineSpec, make_engine

    model = load_causal_lm(tiny_model_dir).eval()
    batch, R = _batch(model.config.vocab_size)
    engine = make_engine("hf", EngineSpec(module=model, share_module=True, eos_token_ids=[1], pad_token_id=0,
                                          rollout=type("R", (), {"max_num_seqs": 2})()))
    out = engine.prompt_log_probs(batch, R, topk=4)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -R - 1 : -1]
    full = torch.log_softmax(logits.float(), -1)
    valid = batch["attention_mask"][:, -R:].bool()
    expected = full.gather(-1, batch["input_ids"][:, -R:, None]).squeeze(-1)
    torch.testing.assert_close(out["log_probs"][valid], expected[valid], rtol=1e-4, atol=1e-5)
    top = full.topk(4, dim=-1)
    torch.testing.assert_close(out["topk_log_probs"][valid], top.values[valid], rtol=1e-4, atol=1e-5)
    assert out["topk_ids"].shape == (3, R, 4)


@pytest.mark.parametrize("packed", [False, True])
def test_student_log_probs_at_teacher_ids_are_its_log_softmax(tiny_model_dir, packed):
    model = load_causal_lm(tiny_model_dir)
    batch, R = _batch(model.config.vocab_size, seed=1)
    teacher_ids = torch.randint(0, model.config.vocab_size, (3, R, 3), generator=torch.Generator().manual_seed(4))
    if packed:
        logp, _, gathered, own = packed_response_logprobs(model, batch["input_ids"], batch["attention_mask"], R,
                                                          topk_ids=teacher_ids)
    else:
        logp, _, gathered, own = response_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                                   batch["position_ids"], R, topk_ids=teacher_ids)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, -R - 1 : -1]
    full = torch.log_softmax(logits.float(), -1)
    valid = batch["attention_mask"][:, -R:].bool()
    torch.testing.assert_close(gathered[valid], full.gather(-1, teacher_ids)[valid], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(own[valid], full.topk(3, dim=-1).indices[valid])
    labels = batch["input_ids"][:, -R:, None]
    torch.testing.assert_close(logp[valid], full.gather(-1, labels).squeeze(-1)[valid], rtol=1e-4, atol=1e-5)
    gathered[valid].sum().backward()  # differentiable: the loss reaches the weights through the gathered log-probs
    assert model.lm_head.weight.grad is not None or model.model.embed_tokens.weight.grad is not None


def _config(tmp_path, model_dir, *extra):
    return load_config([f"actor_rollout_ref.model.path={model_dir}", "distillation.enabled=true",
                        f"trainer.default_local_dir={tmp_path}", *extra])


def test_routing_by_data_source_and_an_unrouted_sample(tiny_model_dir, tmp_path):
    cfg = _config(tmp_path, tiny_model_dir, f"+distillation.teacher_models.math.model_path={tiny_model_dir}",
                  "+distillation.teacher_models.math.key=gsm8k",
                  f"+distillation.teacher_models.geo.model_path={tiny_model_dir}",
                  "+distillation.teacher_models.geo.key=geo3k", "distillation.distillation_loss.loss_mode=k1")
    validate_config(cfg)
    spec = teacher_spec(cfg)
    assert [t.name for t in spec.teachers] == ["math", "geo"]  # the unused default entry is dropped (verl's rule)
    worker = TeacherWorker(spec)
    worker.init_model()
    batch, R = _batch(64, seed=2)
    batch["data_source"] = ["geo3k", "gsm8k", "geo3k"]
    assert {k: v.tolist() for k, v in worker.route(batch).items()} == {"geo": [0, 2], "math": [1]}
    out = worker.compute_teacher_log_probs(batch)
    assert out["teacher_log_probs"].shape == (3, R) and (out["teacher_log_probs"][1, -2:] == 0).all()
    batch["data_source"] = ["geo3k", "aime", "geo3k"]
    with pytest.raises(ValueError, match="'aime', which no teacher's key names"):
        worker.compute_teacher_log_probs(batch)


@pytest.mark.parametrize(("extra", "message"), [
    ([], "needs a teacher: set distillation.teacher_models.teacher_model.model_path"),
    (["+distillation.teacher_models.teacher_model.mode_path=x", "distillation.teacher_models.teacher_model.model_path=y"],
     r"unknown key\(s\) \['mode_path'\]"),
    (["distillation.teacher_models.teacher_model.model_path=y", "+distillation.teacher_models.teacher_model.inference.gpu_mem=1"],
     r"inference has unknown key\(s\) \['gpu_mem'\]"),
    (["distillation.teacher_models.teacher_model.model_path=y", "+distillation.teacher_models.b.model_path=z"],
     "each needs its own `key`"),
    (["distillation.teacher_models.teacher_model.model_path=y", "distillation.distillation_loss.loss_mode=forward_kl_topk",
      "distillation.distillation_loss.topk=0"], "needs the teacher's top k >= 1"),
    (["distillation.teacher_models.teacher_model.model_path=y", "distillation.nnodes=1", "trainer.executor=local"],
     "trainer.executor=local cannot do"),
])
def test_config_errors_name_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_config(tmp_path, "m", *extra))


def test_a_teacher_with_another_tokenizer_is_refused_at_start(tiny_model_dir, tmp_path):
    from hyflow.models.tiny import make_tiny_model

    other = make_tiny_model(tmp_path / "other", preset="tiny", seed=0, vocab_size=300)
    cfg = _config(tmp_path, tiny_model_dir, f"distillation.teacher_models.teacher_model.model_path={other}")
    with pytest.raises(ValueError, match="must share one tokenizer"):
        check_teacher_tokenizers(teacher_spec(cfg), load_tokenizer(tiny_model_dir))
    same = _config(tmp_path, tiny_model_dir, f"distillation.teacher_models.teacher_model.model_path={tiny_model_dir}")
    check_teacher_tokenizers(teacher_spec(same), load_tokenizer(tiny_model_dir))
