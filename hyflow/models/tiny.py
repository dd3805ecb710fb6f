"""Tiny random-weight Qwen2 models with a locally trained byte-level BPE tokenizer (no downloads).

`make_tiny_model(out_dir, preset)` writes a directory that `AutoTokenizer` / `AutoModelForCausalLM` load
exactly like a hub checkpoint: `config.json`, `model.safetensors`, `generation_config.json`, the tokenizer
files and a ChatML chat template.

Tokenizer. transformers 5.x loads every checkpoint whose `model_type` is `qwen2` with `Qwen2Tokenizer`,
which ignores `tokenizer_class` and rebuilds a byte-level BPE from the saved vocab and merges with Qwen2's
own pipeline. A tokenizer built any other way silently changes on reload (a character-level `WordLevel`
loses spaces and newlines). So the tokenizer is trained with exactly that pipeline:

    normalizer     NFC
    pre-tokenizer  Split(Qwen2 regex, "isolated") -> ByteLevel(add_prefix_space=False, use_regex=False)
    model          BPE trained by BpeTrainer, initial alphabet = the 256 ByteLevel symbols
    decoder        ByteLevel
    special        <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos)

Vocabulary size. Qwen2's regex splits every digit into its own pre-token, so numbers always tokenise into
single digits whatever the vocabulary; the vocabulary size only decides how many pieces a word takes.
The default, 512 = 256 byte symbols + 3 special tokens + 253 merges, keeps the embedding small (the demo
trains the model from scratch on arithmetic) while the common prompt words of the built-in corpus become one
or two tokens.

Presets:

    tiny                 hidden 128, 2 layers, 4 heads, 2 KV heads, MLP 512, tied embeddings, rope_theta 1e4;
                         558 k parameters at the default vocab of 512 (65 k of them the embedding)
    small                hidden 256, 4 layers, 8 heads, 2 KV heads, MLP 1024, tied embeddings, rope_theta 1e4
    qwen2.5-0.5b-shape   the public shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads,
                         MLP 4864, vocab 151936, tied, 32768 positions, rope_theta 1e6) for GPU benchmarks; the
                         embedding rows beyond the small tokenizer are never used (Qwen pads its vocab the same
                         way). About 494 M parameters: saved in bfloat16 by default; never built in CPU tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hyflow.models.vision import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_SPECIAL_TOKENS, VISION_START

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2's pre-tokenizer regex: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newline runs, whitespace.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5-style ChatML without the default system prompt, plus hermes-style tool calling:
#
# - `tools` given (OpenAI schemas): a system block first,
#   `<|im_start|>system\n{system}\n\nTools: {list}<|im_end|>\n` when messages[0] is a system message (which is
#   then not rendered again), else
#   `<|im_start|>system\nTools: {list}<|im_end|>\n`. `{list}` is compact for a tiny model: `name(arg, ...)` per
#   tool (argument names in the order of `parameters.properties`), joined by ", ".
# - an assistant message with `tool_calls` (`{"type": "function", "function": {"name", "arguments"}}` or
#   `{"name", "arguments"}`) renders its content, then each call as
#   `<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>` (calls separated by "\n", and a "\n" between
#   non-empty content and the first call). The JSON is exactly `json.dumps({"name": n, "arguments": a})`:
#   transformers' `tojson` keeps key order and json's default separators, and `ensure_ascii=true` escapes
#   non-ASCII as `json.dumps` does. ARGS given as a string (already JSON) is used as is.
# - a None content renders as empty; a `tool` message renders like any other role.
#
# A conversation without `tools` and without `tool_calls` renders byte for byte as the plain ChatML template
# (`<|im_start|>{role}\n{content}<|im_end|>\n` per message, `<|im_start|>assistant\n` as generation prompt),
# and the rendering of a prefix of a conversation is a prefix of the rendering of the whole (the SFT loss mask
# and the agent loop rely on both).
CHATML_TEMPLATE = (
    "{%- set ns = namespace(first=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is not none %}{{- messages[0]['content'] }}{%- endif %}"
    "{{- '\\n\\n' }}"
    "{%- set ns.first = 1 %}"
    "{%- endif %}"
    "{{- 'Tools: ' }}"
    "{%- for tool in tools %}"
    "{%- set fn = tool['function'] if tool['function'] is mapping else tool %}"
    "{%- set params = fn['parameters'] if fn['parameters'] is mapping else {} %}"
    "{%- set props = params['properties'] if params['properties'] is mapping else {} %}"
    "{{- fn['name'] + '(' }}"
    "{%- for arg, spec in props.items() if spec is not none %}"
    "{{- arg }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{%- set content = message['content'] if (message['content'] is defined and message['content'] is not none)"
    " else '' %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is mapping else tool_call %}"
    "{%- set args = call['arguments'] %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": ' + (call['name'] | tojson(ensure_ascii=true)) + ', \"arguments\": ' }}"
    "{{- (args if args is string else (args | tojson(ensure_ascii=true))) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The vision-language presets' template: as CHATML_TEMPLATE, and a message whose content is a list of typed parts
# (`{"type": "text", "text": ...}`, `{"type": "image"}`, `{"type": "video"}`, as transformers' processors and verl
# pass them) renders its parts in order, each image as `<|vision_start|><|image_pad|><|vision_end|>` (Qwen2-VL's
# rendering, one pad token per image: the processor expands it to the image's tokens).
_CONTENT_LINE = (
    "{%- set content = message['content'] if (message['content'] is defined and message['content'] is not none)"
    " else '' %}"
)
CHATML_VL_TEMPLATE = CHATML_TEMPLATE.replace(
    _CONTENT_LINE,
    _CONTENT_LINE
    + "{%- if content is not string %}{%- set parts = namespace(text='') %}"
    "{%- for part in content %}"
    "{%- if part['type'] == 'image' %}{%- set parts.text = parts.text + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{%- elif part['type'] == 'video' %}"
    "{%- set parts.text = parts.text + '<|vision_start|><|video_pad|><|vision_end|>' %}"
    "{%- elif part['type'] == 'text' %}{%- set parts.text = parts.text + part['text'] %}{%- endif %}"
    "{%- endfor %}{%- set content = parts.text %}{%- endif %}",
)
assert CHATML_VL_TEMPLATE != CHATML_TEMPLATE

DEFAULT_VOCAB_SIZE = 512

def _preset(
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    intermediate_size: int,
    *,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 4096,
    rope_theta: float = 1e4,
    padded_vocab_size: int | None = None,
    dtype: str = "float32",
) -> dict:
    """A preset's shape: its arguments as a dict (the defaults are the tiny presets' common values)."""
    return {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta,
        "padded_vocab_size": padded_vocab_size,
        "dtype": dtype,
    }


# Vision-language presets (`make_tiny_vl_model`): the text model of "tiny" under a 2-block vision tower (patch 14,
# 2x2 merge, so a 56x56 image is 16 patches and 4 tokens), Qwen2-VL's or Qwen2.5-VL's architecture.
VL_PRESETS: dict[str, dict] = {
    "tiny-vl": {"model_type": "qwen2_vl", "text": "tiny", "vision_depth": 2, "vision_dim": 64, "vision_heads": 4},
    "tiny-vl-2.5": {"model_type": "qwen2_5_vl", "text": "tiny", "vision_depth": 2, "vision_dim": 64,
                    "vision_heads": 4},
}
# the image processor of the presets: images are resized to between 2x2 and 8x8 merged tokens
VL_MIN_PIXELS, VL_MAX_PIXELS = 56 * 56, 224 * 224

PRESETS: dict[str, dict] = {
    "tiny": _preset(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512),
    "small": _preset(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1024),
    "qwen2.5-0.5b-shape": _preset(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864,
        max_position_embeddings=32768, rope_theta=1e6, padded_vocab_size=151936, dtype="bfloat16",
    ),
}

# Mixture-of-experts presets (`make_tiny_model` with a family's own config class; the tokenizer is the tiny
# presets'): hidden 128, 2 layers, 4 heads, 2 KV heads, 4 routed experts of which each token takes 2. Each is the
# smallest model with its family's routing: Qwen3-MoE (softmax top-k, renormalised; every layer sparse), Mixtral
# (softmax over the top-k logits; untied embeddings), DeepSeek-V3 (multi-head latent attention, sigmoid scores
# with a correction bias, grouped top-k, one shared expert, the first layer dense).
MOE_PRESETS: dict[str, dict] = {
    "tiny-qwen3-moe": {"model_type": "qwen3_moe", "hidden_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
                       "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
                       "decoder_sparse_step": 1, "norm_topk_prob": True, "tie_word_embeddings": True},
    "tiny-mixtral": {"model_type": "mixtral", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "tiny-deepseek-v3": {"model_type": "deepseek_v3", "hidden_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
                         "moe_intermediate_size": 64, "n_routed_experts": 4, "n_shared_experts": 1,
                         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                         "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                         "v_head_dim": 32, "tie_word_embeddings": False},
}

_ENGLISH_TEXT = """\
You are a helpful assistant. Solve the following problem step by step and put the final answer after ####.
Question: What is the value of the expression? Compute the sum, the difference, the product and the quotient.
Answer: Let's think step by step. First we add the numbers, then we multiply the result. The answer is
Using the numbers given, create an equation that equals the target. You can use each number once.
Think about the problem, then give your answer. Show your work in <think> </think> tags and return the final
answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>. The final answer is \\boxed{42}.
Put the final answer after '####'. Put the expression after '####'. Put the sorted list after '####'.
Using the numbers 3 5 7 9, make 24. Use each number exactly once, with + - * / and parentheses.
Sort these numbers in ascending order: 5 3 9 1. Sort these numbers in descending order.
Count the letters in the word. Sort the list of numbers in increasing order. Reverse the sequence.
Is the number even or odd? Which number is larger? How many are there in total? Please respond with a number.
The user asks a question and the assistant answers it. system user assistant tool
Input: Output: Result: Target: Numbers: Solution: Problem: Therefore, so, because, and, or, not, the, of, to,
in, is, it, that, for, with, as, on, we, this, be, are, by, at, from, each, than, then, if, equals, plus,
minus, times, divided, remainder, total, left, right, first, second, third, last, next, one, two, three.
ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz
"""


def default_corpus(num_arithmetic_lines: int = 3000, seed: int = 0) -> list[str]:
    """The built-in tokenizer training corpus: English prompt words, ChatML turns and arithmetic lines.

    Arithmetic lines look like "12 + 7 * 3 = 33", "What is 48 - 19?\\n#### 29" so digits, operators,
    "####" and the words around them are all covered. Deterministic for a given `seed`.
    """
    rng = random.Random(seed)
    ops = ["+", "-", "*", "/", "%"]
    lines = [_ENGLISH_TEXT] * 20
    for _ in range(num_arithmetic_lines):
        a, b, c = rng.randint(0, 999), rng.randint(0, 99), rng.randint(1, 9)
        op1, op2 = rng.choice(ops), rng.choice(ops)
        expr = f"{a} {op1} {b} {op2} {c}"
        style = rng.randrange(4)
        if style == 0:
            lines.append(f"{expr} = {rng.randint(-999, 9999)}")
        elif style == 1:
            lines.append(f"What is {expr}?\n#### {rng.randint(0, 9999)}")
        elif style == 2:
            lines.append(
                f"{IM_START}user\nCompute {a}{op1}{b}.{IM_END}\n{IM_START}assistant\n"
                f"{a} {op1} {b} = {rng.randint(0, 999)}\n#### {rng.randint(0, 999)}{IM_END}\n"
            )
        else:
            lines.append(
                f"Numbers: {a}, {b}, {c}. Target: {rng.randint(0, 99)}. Answer: ({a}{op1}{b}){op2}{c}"
            )
    return lines


def _split_out_special_tokens(texts: Iterable[str]) -> Iterator[str]:
    """Yield the text between special tokens; BPE training must not learn merges for the markers' bytes."""
    for text in texts:
        pieces = [text]
        for special in SPECIAL_TOKENS:
            pieces = [part for piece in pieces for part in piece.split(special)]
        yield from (piece for piece in pieces if piece)


def train_bpe_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a Qwen2-pipeline byte-level BPE tokenizer on `corpus` and wrap it with the ChatML template.

    `vocab_size` counts the 256 byte symbols and the 3 special tokens, so it must be at least 259; BPE may
    stop below it when the corpus has no more pairs to merge.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte symbols plus "
            f"{len(SPECIAL_TOKENS)} special tokens; use vocab_size >= {256 + len(SPECIAL_TOKENS)}"
        )
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = default_corpus() if corpus is None else corpus
    tok.train_from_iterator(_split_out_special_tokens(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def preset_config(
    preset: str, vocab_size: int, *, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> Qwen2Config:
    """The `Qwen2Config` of `preset` for a tokenizer of `vocab_size` tokens.

    The model's vocab is `vocab_size`, or the preset's padded size (151936 for the Qwen2.5-0.5B shape) when
    it has one.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    padded = spec["padded_vocab_size"]
    if padded is not None and padded < vocab_size:
        raise ValueError(
            f"preset {preset!r} pads the vocab to {padded} but the tokenizer has {vocab_size} tokens; "
            f"use a vocab_size <= {padded}"
        )
    return Qwen2Config(
        vocab_size=padded or vocab_size,
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=spec["dtype"],
    )


def moe_preset_config(preset: str, vocab_size: int, *, bos_token_id: int, eos_token_id: int, pad_token_id: int):
    """The config of mixture-of-experts preset `preset` (`MOE_PRESETS`; its family's own config class) for a
    tokenizer of `vocab_size` tokens."""
    if preset not in MOE_PRESETS:
        raise ValueError(f"unknown mixture-of-experts preset {preset!r}; choose one of {sorted(MOE_PRESETS)}")
    spec = dict(MOE_PRESETS[preset])
    return AutoConfig.for_model(
        spec.pop("model_type"), vocab_size=vocab_size, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rms_norm_eps=1e-6, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, **spec)


def make_tiny_model(
    out_dir: str | Path,
    preset: str = "tiny",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    corpus: Iterable[str] | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Path:
    """Write a random-weight Qwen2ForCausalLM (or the MoE family of a `MOE_PRESETS` preset) + trained BPE tokenizer
    + ChatML template to `out_dir`.

    `vocab_size` is the tokenizer's target size (default 512); `corpus` replaces the built-in tokenizer
    corpus (`default_corpus()`); `seed` fixes the weights (HF init: normal(0, 0.02) linears/embeddings);
    `dtype` defaults to the preset's (float32, bfloat16 for the 0.5B shape); `device` builds the weights
    there (a GPU makes the 0.5B shape fast). Returns `out_dir` as a Path.
    """
    if preset in VL_PRESETS:
        return make_tiny_vl_model(out_dir, preset, seed=seed, vocab_size=vocab_size, corpus=corpus, dtype=dtype,
                                  device=device)
    if preset not in PRESETS and preset not in MOE_PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; choose one of "
                         f"{sorted(PRESETS) + sorted(MOE_PRESETS) + sorted(VL_PRESETS)}")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(corpus, DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    token_ids = {"bos_token_id": ids[ENDOFTEXT], "eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT]}
    if preset in MOE_PRESETS:
        config = moe_preset_config(preset, len(tokenizer), **token_ids)
        torch_dtype = _as_dtype(dtype if dtype is not None else "float32")
    else:
        config = preset_config(preset, len(tokenizer), **token_ids)
        torch_dtype = _as_dtype(dtype if dtype is not None else PRESETS[preset]["dtype"])
    config.dtype = torch_dtype
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config) if preset in MOE_PRESETS else Qwen2ForCausalLM(config)
    model.to(dtype=torch_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT]
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "hyflow_tiny_model.json").write_text(
        json.dumps({"preset": preset, "seed": seed, "tokenizer_vocab_size": len(tokenizer)}, indent=2) + "\n"
    )
    return out


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)} or a torch.dtype")
    return table[dtype]


def make_tiny_vl_model(
    out_dir: str | Path,
    preset: str = "tiny-vl",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    corpus: Iterable[str] | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Path:
    """Write a random-weight Qwen2-VL (`tiny-vl`) or Qwen2.5-VL (`tiny-vl-2.5`) model, its tokenizer (trained
    locally, with Qwen2-VL's vision tokens) and its image processor (`preprocessor_config.json`) to `out_dir`.

    The directory loads with `AutoModelForImageTextToText`, `AutoTokenizer` and `AutoImageProcessor` (and with
    `AutoProcessor` where torchvision is installed), nothing downloaded. The text model is the `tiny` preset's shape;
    the vision tower is VL_PRESETS[preset]; the chat template is CHATML_VL_TEMPLATE.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if preset not in VL_PRESETS:
        raise ValueError(f"unknown vision-language preset {preset!r}; choose one of {sorted(VL_PRESETS)}")
    spec = VL_PRESETS[preset]
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(corpus, DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *VISION_SPECIAL_TOKENS]})
    tokenizer.chat_template = CHATML_VL_TEMPLATE
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (*SPECIAL_TOKENS, *VISION_SPECIAL_TOKENS)}
    text = PRESETS[spec["text"]]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # M-RoPE splits the rotary half-dimension into temporal / height / width sections in Qwen's 1 : 1.5 : 1.5
    half = head_dim // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    text_config = {
        "hidden_size": text["hidden_size"], "num_hidden_layers": text["num_hidden_layers"],
        "num_attention_heads": text["num_attention_heads"], "num_key_value_heads": text["num_key_value_heads"],
        "intermediate_size": text["intermediate_size"], "max_position_embeddings": text["max_position_embeddings"],
        "vocab_size": len(tokenizer), "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": text["rope_theta"], "mrope_section": section},
        "bos_token_id": ids[ENDOFTEXT], "eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT],
    }
    if spec["model_type"] == "qwen2_vl":
        vision_config = {"depth": spec["vision_depth"], "embed_dim": spec["vision_dim"],
                         "hidden_size": text["hidden_size"], "num_heads": spec["vision_heads"], "mlp_ratio": 2,
                         "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}
    else:
        vision_config = {"depth": spec["vision_depth"], "hidden_size": spec["vision_dim"],
                         "intermediate_size": 2 * spec["vision_dim"], "num_heads": spec["vision_heads"],
                         "out_hidden_size": text["hidden_size"], "patch_size": 14, "spatial_merge_size": 2,
                         "temporal_patch_size": 2, "in_channels": 3, "window_size": 56,
                         "fullatt_block_indexes": [spec["vision_depth"] - 1], "tokens_per_second": 2}
    config = AutoConfig.for_model(
        spec["model_type"], text_config=text_config, vision_config=vision_config,
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True, bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT],
    )
    torch_dtype = _as_dtype(dtype if dtype is not None else "float32")
    config.dtype = torch_dtype
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForImageTextToText.from_config(config)
    model.to(dtype=torch_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT]
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS, patch_size=14,
                             temporal_patch_size=2, merge_size=2).save_pretrained(out)
    (out / "hyflow_tiny_model.json").write_text(
        json.dumps({"preset": preset, "seed": seed, "tokenizer_vocab_size": len(tokenizer)}, indent=2) + "\n"
    )
    return out
