"""The tiny-model factory: exact tokenizer round trip after reload, ChatML template, configs of the presets."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2ForCausalLM

from hyflow.models.tiny import (
    CHATML_TEMPLATE,
    DEFAULT_VOCAB_SIZE,
    IM_END,
    IM_START,
    default_corpus,
    make_tiny_model,
    preset_config,
    train_bpe_tokenizer,
)

ROUND_TRIP_TEXTS = [
    "What is 123 + 4567?",
    "  two leading spaces, two  inner, trailing  ",
    "line one\nline two\n\n\nthree newlines\r\nand a CRLF\tand a tab",
    "#### 42",
    "-17 * (3 / 4) % 5 = 0.75",
    f"{IM_START}user\nCompute 2+2.{IM_END}\n{IM_START}assistant\n2 + 2 = 4\n#### 4{IM_END}\n",
    "ünïcödé, 你好, emoji 🙂 and café (NFC)",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_reloaded_tokenizer_round_trips_exactly(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_reloaded_tokenizer_matches_the_trained_one(tokenizer):
    trained = train_bpe_tokenizer()
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.encode(text) == trained.encode(text)


def test_digits_are_single_tokens_and_markers_are_special(tokenizer):
    ids = tokenizer.encode("9876543210", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == list("9876543210")
    for marker in (IM_START, IM_END, "<|endoftext|>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    # common prompt words of the built-in corpus are single tokens
    for word in ("What", " is", " answer", "assistant", "user", "####"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word


def test_special_tokens_and_vocab_size(tiny_model_dir, tokenizer):
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == "<|endoftext|>"
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == DEFAULT_VOCAB_SIZE
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids(IM_END)
    assert config["pad_token_id"] == tokenizer.pad_token_id


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    expected = f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nWhat is 2+3?{IM_END}\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == expected + f"{IM_START}assistant\n"
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert tokenizer.decode(ids) == with_prompt
    assert tokenizer.chat_template == CHATML_TEMPLATE


def test_model_reloads_forwards_and_generation_config(tiny_model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.tie_word_embeddings
    assert 300_000 < sum(p.numel() for p in model.parameters()) < 700_000
    ids = tokenizer("What is 1 + 2?", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    assert gen.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert gen.pad_token_id == tokenizer.pad_token_id
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 4


def test_seed_fixes_weights(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "b", seed=3))
    c = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "c", seed=4))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_custom_corpus_and_vocab_size(tmp_path):
    out = make_tiny_model(tmp_path / "m", vocab_size=300, corpus=["abc abc abc 1 2 3\n"] * 50)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) <= 300
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(tokenizer)
    text = "abc xyz 12\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_default_corpus_is_deterministic_and_covers_arithmetic():
    corpus = default_corpus()
    assert corpus == default_corpus()
    joined = "\n".join(corpus)
    for needle in ("####", " + ", " * ", " / ", "What is", IM_START, "assistant"):
        assert needle in joined


def test_small_preset_config():
    config = preset_config("small", 512, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 4, 8)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (2, 1024, 512)


def test_qwen_shape_preset_is_qwen25_05b_on_meta_device():
    config = preset_config("qwen2.5-0.5b-shape", 512, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    assert config.vocab_size == 151936
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (896, 24, 4864)
    assert (config.num_attention_heads, config.num_key_value_heads) == (14, 2)
    assert config.max_position_embeddings == 32768
    assert config.rope_parameters["rope_theta"] == 1e6
    assert config.tie_word_embeddings
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B's published count


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown tiny-model preset 'huge'; choose one of"):
        make_tiny_model("/nonexistent/never-written", preset="huge")


def test_vocab_too_small():
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small.*>= 259"):
        train_bpe_tokenizer(vocab_size=100)


def test_padded_vocab_smaller_than_tokenizer():
    with pytest.raises(ValueError, match=r"pads the vocab to 151936 but the tokenizer has 200000 tokens"):
        preset_config("qwen2.5-0.5b-shape", 200_000, bos_token_id=0, eos_token_id=2, pad_token_id=0)
