"""RewardModelWorker: rm_scores at the last valid response token, re-tokenisation for a foreign tokenizer,
micro-batch invariance, DP dispatch, the one micro-batch rule of its spec, the engine's "score" head against a
direct forward, and its errors. A tiny Qwen2ForSequenceClassification is built here."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

from hyflow.batch import Batch
from hyflow.config import ConfigError, load_config
from hyflow.config.roles import reward_model_spec
from hyflow.controller import LocalWorkerGroup
from hyflow.models.loading import load_tokenizer
from hyflow.models.tiny import train_bpe_tokenizer
from hyflow.workers.reward_model import (
    RewardModelWorker,
    same_tokenizer,
    scores_at_last_response_token,
)

P, R = 6, 5


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tiny_tokenizer):
    out = tmp_path_factory.mktemp("tiny_rm")
    config = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tiny_tokenizer.pad_token_id, eos_token_id=tiny_tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # scores of order 1, so mismatches are visible
    model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference_rm(rm_dir):
    return AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def other_tokenizer():
    """A policy tokenizer that differs from the reward model's (smaller BPE vocabulary)."""
    return train_bpe_tokenizer(vocab_size=300)


def direct_score(model, ids: list[int]) -> float:
    """The HF model's own score of one unpadded sequence (pooled at its last token)."""
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def make_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, *, width_P: int = P,
               width_R: int = R, **non_tensors) -> Batch:
    """Left-padded prompts [N, P] + right-padded responses [N, R], as the rollout returns them."""
    n = len(prompt_ids)
    prompts = torch.full((n, width_P), pad_id)
    responses = torch.full((n, width_R), pad_id)
    prompt_mask = torch.zeros(n, width_P, dtype=torch.long)
    response_mask = torch.zeros(n, width_R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        prompts[i, width_P - len(p):] = torch.tensor(p)
        prompt_mask[i, width_P - len(p):] = 1
        responses[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
    }, non_tensors)


def spec_of(*overrides: str, n_devices: int = 1):
    """The reward model's spec of a config given as overrides."""
    return reward_model_spec(load_config(["trainer.device=cpu", *overrides]), n_devices=n_devices)


def make_worker(rm_dir, tokenizer, *overrides: str) -> RewardModelWorker:
    worker = RewardModelWorker(spec_of(f"reward_model.model.path={rm_dir}", "reward_model.enable=True", *overrides),
                               tokenizer=tokenizer)
    worker.init_model()
    return worker


# Token ids 0-2 are the special tokens (pad/eos); samples use ordinary tokens so HF's pad-based pooling and
# the attention-mask pooling agree.
PROMPTS = [[5, 17, 42, 9], [100, 7], [33, 44, 55, 66, 77, 88], [12, 13, 14]]
RESPONSES = [[8, 9, 10], [200, 201, 202, 203, 204], [], [71]]


def test_rm_scores_equal_the_model_at_the_last_response_token(rm_dir, tiny_tokenizer, reference_rm):
    worker = make_worker(rm_dir, tiny_tokenizer)
    assert not worker.retokenize
    batch = make_batch(PROMPTS, RESPONSES, tiny_tokenizer.pad_token_id)
    rm_scores = worker.compute_rm_score(batch)["rm_scores"]

    assert rm_scores.shape == (4, R) and rm_scores.dtype == torch.float32
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        expected = torch.zeros(R)
        if r:  # an empty response gets a zero row
            expected[len(r) - 1] = direct_score(reference_rm, p + r)
        torch.testing.assert_close(rm_scores[i], expected, atol=1e-5, rtol=1e-5)
    assert rm_scores[[0, 1, 3]].ne(0).sum() == 3


def test_micro_batching_and_dynamic_batching_give_the_same_scores(rm_dir, tiny_tokenizer):
    batch = make_batch(PROMPTS, RESPONSES, tiny_tokenizer.pad_token_id)
    whole = make_worker(rm_dir, tiny_tokenizer).compute_rm_score(batch)["rm_scores"]
    for overrides in (["reward_model.micro_batch_size_per_gpu=1"], ["reward_model.micro_batch_size_per_gpu=3"],
                      ["reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=12"]):
        split = make_worker(rm_dir, tiny_tokenizer, *overrides).compute_rm_score(batch)["rm_scores"]
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_two_ranks_with_dp_padding_match_one_rank(rm_dir, tiny_tokenizer):
    batch = make_batch([*PROMPTS, [3, 4]], [*RESPONSES, [6, 6]], tiny_tokenizer.pad_token_id)  # 5 rows, 2 ranks
    spec = spec_of(f"reward_model.model.path={rm_dir}", n_devices=2)
    group = LocalWorkerGroup(RewardModelWorker, spec, tokenizer=tiny_tokenizer, world_size=2)
    group.init_model()
    out = group.compute_rm_score(batch)
    one_rank = make_worker(rm_dir, tiny_tokenizer).compute_rm_score(batch)
    assert len(out) == 5
    torch.testing.assert_close(out["rm_scores"], one_rank["rm_scores"], atol=1e-5, rtol=1e-5)


def test_same_tokenizer_ignores_the_path_but_not_the_vocabulary(rm_dir, tiny_tokenizer, other_tokenizer):
    reloaded = load_tokenizer(rm_dir)
    assert same_tokenizer(tiny_tokenizer, reloaded)
    assert not same_tokenizer(tiny_tokenizer, other_tokenizer)


QUESTIONS = ["What is 2 + 3?", "Sort these numbers: 5 3 9", "Count the letters"]
ANSWERS = ["The answer is 5", "3 5 9", ""]


def rendered(question: str, answer: str) -> str:
    """The reward model's ChatML rendering of a user turn and the assistant's reply."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def foreign_policy_batch(policy_tok, *, with_raw_prompt: bool) -> Batch:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompt_ids = [policy_tok(policy_tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)["input_ids"] for c in chats]
    response_ids = [policy_tok(a, add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id]
                    for a in ANSWERS]
    extra = {"raw_prompt": chats} if with_raw_prompt else {}
    return make_batch(prompt_ids, response_ids, policy_tok.pad_token_id, width_P=max(map(len, prompt_ids)),
                      width_R=max(map(len, response_ids)) + 1, **extra)


@pytest.mark.parametrize("with_raw_prompt", [True, False])
def test_foreign_policy_tokenizer_rescores_the_rerendered_chat(rm_dir, tiny_tokenizer, other_tokenizer,
                                                               reference_rm, with_raw_prompt):
    worker = make_worker(rm_dir, other_tokenizer)
    assert worker.retokenize
    batch = foreign_policy_batch(other_tokenizer, with_raw_prompt=with_raw_prompt)
    rm_scores = worker.compute_rm_score(batch)["rm_scores"]

    lengths = batch["attention_mask"][:, -batch["responses"].shape[1]:].sum(-1)
    for i, (question, answer) in enumerate(zip(QUESTIONS, ANSWERS)):
        # without raw_prompt the user turn is the decoded policy prompt (its ChatML markers dropped)
        user = question if with_raw_prompt else f"user\n{question}\nassistant\n"
        ids = tiny_tokenizer(rendered(user, answer), add_special_tokens=False)["input_ids"]
        expected = torch.zeros(batch["responses"].shape[1])
        expected[int(lengths[i]) - 1] = direct_score(reference_rm, ids)
        torch.testing.assert_close(rm_scores[i], expected, atol=1e-5, rtol=1e-5)


def test_max_length_cuts_the_rerendered_text_on_the_right(rm_dir, tiny_tokenizer, other_tokenizer, reference_rm):
    worker = make_worker(rm_dir, other_tokenizer, "reward_model.max_length=7",
                         "reward_model.micro_batch_size_per_gpu=2")
    batch = foreign_policy_batch(other_tokenizer, with_raw_prompt=True)
    rm_scores = worker.compute_rm_score(batch)["rm_scores"]
    for i, (question, answer) in enumerate(zip(QUESTIONS, ANSWERS)):
        ids = tiny_tokenizer(rendered(question, answer), add_special_tokens=False)["input_ids"][:7]
        torch.testing.assert_close(rm_scores[i].sum(), torch.tensor(direct_score(reference_rm, ids)),
                                   atol=1e-5, rtol=1e-5)


def test_scores_at_last_response_token_layout():
    out = scores_at_last_response_token(torch.tensor([1.5, -2.0, 7.0]), torch.tensor([3, 0, 1]), 4)
    torch.testing.assert_close(out, torch.tensor([[0, 0, 1.5, 0], [0, 0, 0, 0], [7.0, 0, 0, 0]]))


def test_missing_reward_model_path_names_the_key(tiny_tokenizer):
    worker = RewardModelWorker(spec_of(), tokenizer=tiny_tokenizer)
    with pytest.raises(ValueError, match=r"reward_model\.model\.path is not set"):
        worker.init_model()


def test_missing_policy_tokenizer_names_the_keys(rm_dir):
    worker = RewardModelWorker(spec_of(f"reward_model.model.path={rm_dir}"))
    with pytest.raises(ValueError, match=r"policy's tokenizer.*reward_model\.model\.input_tokenizer"):
        worker.init_model()


def test_input_tokenizer_is_the_policy_tokenizer(rm_dir, tiny_model_dir):
    worker = RewardModelWorker(spec_of(f"reward_model.model.path={rm_dir}",
                                       f"reward_model.model.input_tokenizer={tiny_model_dir}"))
    worker.init_model()
    assert not worker.retokenize


def test_reward_model_tokenizer_without_chat_template_is_refused(rm_dir, other_tokenizer):
    worker = make_worker(rm_dir, other_tokenizer)
    worker.rm_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        worker.compute_rm_score(foreign_policy_batch(other_tokenizer, with_raw_prompt=True))


def test_dynamic_batching_refuses_inputs_over_the_token_budget(rm_dir, tiny_tokenizer):
    worker = make_worker(rm_dir, tiny_tokenizer, "reward_model.use_dynamic_bsz=True",
                         "reward_model.forward_max_token_len_per_gpu=4")
    with pytest.raises(ValueError, match=r"reward_model\.forward_max_token_len_per_gpu=4"):
        worker.compute_rm_score(make_batch(PROMPTS, RESPONSES, tiny_tokenizer.pad_token_id))


def test_deprecated_global_micro_batch_size_is_divided_over_ranks(rm_dir, tiny_tokenizer):
    worker = make_worker(rm_dir, tiny_tokenizer, "reward_model.micro_batch_size=3")
    assert worker.spec.micro_batch_size_per_device == 3
    batch = make_batch(PROMPTS, RESPONSES, tiny_tokenizer.pad_token_id)
    whole = make_worker(rm_dir, tiny_tokenizer).compute_rm_score(batch)["rm_scores"]
    torch.testing.assert_close(worker.compute_rm_score(batch)["rm_scores"], whole, atol=1e-5, rtol=1e-5)
    assert spec_of("reward_model.micro_batch_size=4", n_devices=2).micro_batch_size_per_device == 2
    assert spec_of("reward_model.micro_batch_size_per_gpu=3", n_devices=2).micro_batch_size_per_device == 3


@pytest.mark.parametrize(("overrides", "n_devices", "message"), [
    (["reward_model.micro_batch_size=3"], 2,
     r"reward_model\.micro_batch_size=3 \(deprecated, global\) does not split evenly over the reward model's 2 "
     r"devices; set reward_model\.micro_batch_size_per_gpu instead \(e\.g\. 1\)"),
    (["reward_model.micro_batch_size=1"], 4, r"micro_batch_size=1 \(deprecated, global\) does not split evenly"),
    (["reward_model.micro_batch_size=4", "reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=3"],
     2, r"over the reward model's 3 devices"),
    (["reward_model.micro_batch_size_per_gpu=0"], 1,
     r"reward_model\.micro_batch_size_per_gpu=0 must be at least 1 sample per device"),
])
def test_micro_batch_size_that_does_not_split_over_the_devices_is_a_config_error(overrides, n_devices, message):
    """The one micro-batch rule: never a silent floor (the old worker ran max(3 // 2, 1) = 1 sample per forward)."""
    with pytest.raises(ConfigError, match=message):
        spec_of(*overrides, n_devices=n_devices)


def test_score_head_of_the_engine_equals_a_direct_forward(rm_dir, tiny_tokenizer, reference_rm):
    """The engine's "score" head, micro-batched (fixed and by token budget), gives the model's own pooled score of
    each sequence alone, whatever the padding of the batch it runs in."""
    from hyflow.workers.engine import SEQUENCE_KEYS
    from hyflow.workers.train_engine import TrainEngine

    sequences = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    batch = make_batch(PROMPTS, RESPONSES, tiny_tokenizer.pad_token_id).select(*SEQUENCE_KEYS)
    expected = torch.tensor([direct_score(reference_rm, ids) for ids in sequences])
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    engine = TrainEngine.from_spec(model, spec_of().engine, device=torch.device("cpu"))
    assert not any(p.requires_grad for p in engine.model.parameters())
    for overrides in ([], ["reward_model.micro_batch_size_per_gpu=3"],
                      ["reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=9"]):
        scores = engine.infer(batch, spec_of(*overrides))["scores"]
        assert scores.shape == (4,) and scores.dtype == torch.float32
        torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
