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


# --- the chat template with tools ----------------------------------------------------------------------------

# The template before tool calling, kept verbatim: conversations without tools and tool_calls must render the same.
OLD_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
     {"role": "assistant", "content": "2 + 3 = 5\n#### 5"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "  spaces \n\n and {{ braces }} 'quotes' \"x\""},
     {"role": "user", "content": "ünïcödé 🙂"}, {"role": "assistant", "content": "ok"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "tool", "content": "42"},
     {"role": "assistant", "content": "#### 42", "tool_calls": None}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": []}],
]

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {"name": "search", "parameters": {"properties": {"query": {}, "top_k": {}, "lang": {}}}},
}


def _render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("messages", PLAIN_CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_plain_conversations_render_byte_identical_to_the_old_template(tokenizer, messages, generation_prompt):
    new = _render(tokenizer, messages, add_generation_prompt=generation_prompt)
    old_messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    old = _render(tokenizer, old_messages, add_generation_prompt=generation_prompt, chat_template=OLD_CHATML_TEMPLATE)
    assert new == old


def test_tools_open_with_a_compact_system_block(tokenizer):
    user = [{"role": "user", "content": "What is 4817 + 2958?"}]
    assert _render(tokenizer, user, tools=[CALC_TOOL]) == (
        f"{IM_START}system\nTools: calculator(expression){IM_END}\n{IM_START}user\nWhat is 4817 + 2958?{IM_END}\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *user]
    assert _render(tokenizer, with_system, tools=[CALC_TOOL, SEARCH_TOOL], add_generation_prompt=True) == (
        f"{IM_START}system\nBe brief.\n\nTools: calculator(expression), search(query, top_k, lang){IM_END}\n"
        f"{IM_START}user\nWhat is 4817 + 2958?{IM_END}\n{IM_START}assistant\n"
    )
    # an empty tool list is no tools
    assert _render(tokenizer, with_system, tools=[]) == _render(tokenizer, with_system)


@pytest.mark.parametrize(
    "arguments",
    [
        {"expression": "4817 + 2958"},
        {"b": 2, "a": [1, "x"], "nested": {"z": None, "y": True, "f": 1.5}},  # key order kept, not sorted
        {"text": "café \"quoted\" <b>&'\\ \n"},  # non-ASCII, quotes, HTML characters, backslash, newline
        {},
    ],
)
def test_tool_calls_render_exactly_as_json_dumps(tokenizer, arguments):
    expected = "<tool_call>" + json.dumps({"name": "calculator", "arguments": arguments}) + "</tool_call>"
    for call in (
        {"type": "function", "function": {"name": "calculator", "arguments": arguments}},
        {"name": "calculator", "arguments": arguments},  # without the `function` wrapper
        {"type": "function", "function": {"name": "calculator", "arguments": json.dumps(arguments)}},  # a string
    ):
        for content in ("", None):
            message = {"role": "assistant", "content": content, "tool_calls": [call]}
            assert _render(tokenizer, [message]) == f"{IM_START}assistant\n{expected}{IM_END}\n"
        rendered = _render(tokenizer, [{"role": "assistant", "tool_calls": [call]}])  # no content key at all
        assert rendered == f"{IM_START}assistant\n{expected}{IM_END}\n"
        assert json.loads(expected[len("<tool_call>"):-len("</tool_call>")]) == {
            "name": "calculator", "arguments": arguments,
        }


def test_content_then_several_calls_are_separated_by_newlines(tokenizer):
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 2"}}},
        {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}},
    ]
    message = {"role": "assistant", "content": "Let me compute.", "tool_calls": calls}
    assert _render(tokenizer, [message]) == (
        f"{IM_START}assistant\nLet me compute.\n"
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>\n'
        f'<tool_call>{{"name": "search", "arguments": {{"query": "x"}}}}</tool_call>{IM_END}\n'
    )


def test_none_content_and_tool_messages(tokenizer):
    messages = [{"role": "user", "content": None}, {"role": "tool", "content": "7775"}]
    assert _render(tokenizer, messages) == f"{IM_START}user\n{IM_END}\n{IM_START}tool\n7775{IM_END}\n"


TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 4817 + 2958?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "4817 + 2958"}}},
    ]},
    {"role": "tool", "content": "7775"},
    {"role": "assistant", "content": "#### 7775", "tool_calls": None},
]


def test_tool_conversation_renders_in_full(tokenizer):
    assert _render(tokenizer, TOOL_CONVERSATION, tools=[CALC_TOOL]) == (
        f"{IM_START}system\nBe brief.\n\nTools: calculator(expression){IM_END}\n"
        f"{IM_START}user\nWhat is 4817 + 2958?{IM_END}\n"
        f'{IM_START}assistant\n<tool_call>{{"name": "calculator", "arguments": {{"expression": "4817 + 2958"}}}}'
        f"</tool_call>{IM_END}\n"
        f"{IM_START}tool\n7775{IM_END}\n"
        f"{IM_START}assistant\n#### 7775{IM_END}\n"
    )


@pytest.mark.parametrize("tools", [None, [CALC_TOOL]])
@pytest.mark.parametrize("start", [0, 1])  # with and without the system message
def test_a_prefix_renders_as_a_prefix_of_the_whole(tokenizer, tools, start):
    conversation = TOOL_CONVERSATION[start:]
    whole = _render(tokenizer, conversation, tools=tools)
    for i in range(1, len(conversation) + 1):
        prefix = _render(tokenizer, conversation[:i], tools=tools)
        assert whole.startswith(prefix), i
        if i < len(conversation) and conversation[i]["role"] == "assistant":
            assert whole.startswith(_render(tokenizer, conversation[:i], tools=tools, add_generation_prompt=True))
