"""Vision-language models: the tiny VL presets, the processor without torchvision, M-RoPE positions against
transformers' own, and hyflow's log-prob forward on image prompts against the model's plain forward."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from hyflow.models.forward import compute_position_ids, response_logprobs
from hyflow.models.tiny import make_tiny_model, train_bpe_tokenizer
from hyflow.models.vision import (
    MultiModalError,
    VisionProcessor,
    VisionTokens,
    concat_multi_modal_inputs,
    continue_positions,
    image_token_counts,
    position_ids_4d,
)

PRESETS = ("tiny-vl", "tiny-vl-2.5")


@pytest.fixture(scope="module", params=PRESETS)
def vl_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", preset=request.param, seed=0)


@pytest.fixture(scope="module")
def vl(vl_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    return model, VisionProcessor.from_pretrained(vl_dir)


def _image(w: int, h: int, colour=(200, 30, 30), seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(h, w, 3, generator=g) * 60).to(torch.uint8)
    base = torch.tensor(colour, dtype=torch.uint8).expand(h, w, 3)
    return Image.fromarray((base // 2 + noise).numpy())


def _prompt(processor: VisionProcessor, question: str, n_images: int) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    return processor.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                   add_generation_prompt=True, tokenize=False)


def test_the_tiny_vl_directory_loads_with_plain_transformers(vl_dir):
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(vl_dir)
    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    assert type(AutoModelForImageTextToText.from_pretrained(vl_dir)).__name__.startswith("Qwen2")
    assert AutoImageProcessor.from_pretrained(vl_dir).merge_size == config.vision_config.spatial_merge_size
    # the vision tokens are single special tokens, the text tokenises as the text presets' tokenizer does
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    text = "What colour is the shape? Answer: 12 + 30 = 42"
    assert tokenizer(text)["input_ids"] == train_bpe_tokenizer()(text)["input_ids"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    # a plain string content renders as the text template does
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                          tokenize=False)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_the_processor_expands_each_image_to_its_merged_patches(vl):
    _, processor = vl
    images = [_image(56, 56), _image(112, 84, seed=1)]
    out = processor(_prompt(processor, "Which is red?", 2), images)
    grid = out["multi_modal_inputs"]["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4], [1, 6, 8]]  # 84x112 resized to multiples of 28
    counts = image_token_counts(grid, 2)
    assert counts == [4, 12]
    pad = processor.tokens.image_token_id
    assert out["input_ids"].count(pad) == 16
    assert out["multi_modal_inputs"]["pixel_values"].shape[0] == 16 + 48  # one row per patch
    assert out["position_ids"].shape == (4, len(out["input_ids"]))
    # the second image's block starts after the first one's vision_end
    first = out["input_ids"].index(pad)
    assert out["input_ids"][first:first + 4] == [pad] * 4 and out["input_ids"][first + 4] != pad


def test_placeholders_and_images_must_match(vl):
    _, processor = vl
    with pytest.raises(MultiModalError, match=r"1 image placeholder\(s\) but the row has 2 image"):
        processor(_prompt(processor, "Which?", 1), [_image(56, 56), _image(56, 56)])
    with pytest.raises(MultiModalError, match=r"2 image placeholder\(s\) but the row has 1 image"):
        processor(_prompt(processor, "Which?", 2), [_image(56, 56)])


def test_mrope_positions_equal_transformers_own(vl):
    """hyflow's positions ([4, L] per unpadded row) equal the model's get_rope_index on a left-padded batch."""
    model, processor = vl
    rows = [processor(_prompt(processor, "Which is red?", 2), [_image(56, 56), _image(112, 84, seed=1)]),
            processor(_prompt(processor, "A longer question about the one picture here?", 1), [_image(84, 56)])]
    width = max(len(r["input_ids"]) for r in rows)
    pad_id = processor.tokenizer.pad_token_id
    input_ids = torch.full((2, width), pad_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    ours = torch.zeros(2, 4, width, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[b, width - n:] = torch.tensor(r["input_ids"])
        mask[b, width - n:] = 1
        ours[b, :, width - n:] = r["position_ids"]
    grid = concat_multi_modal_inputs([r["multi_modal_inputs"] for r in rows])["image_grid_thw"]
    mm_types = (input_ids == processor.tokens.image_token_id).int()
    theirs, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm_types, image_grid_thw=grid,
                                           attention_mask=mask)
    real = mask.bool()
    assert torch.equal(ours[:, 1:].transpose(0, 1)[:, real], theirs[:, real])
    assert torch.equal(ours[:, 0], compute_position_ids(mask) * mask)


def test_response_logprobs_on_image_prompts_equal_the_models_forward(vl):
    """hyflow's backbone + lm_head log-probs with [B, 4, L] positions equal log_softmax of the model's own logits,
    which it computes from its own positions (mm_token_type_ids), on a left-padded batch with two images."""
    model, processor = vl
    rows = [processor(_prompt(processor, "Which is red?", 1), [_image(56, 56)]),
            processor(_prompt(processor, "Is the blue one bigger than this?", 1), [_image(112, 84, (20, 20, 220))])]
    responses = [[40, 41, 42, 43], [50, 51, 52, 53]]
    width = max(len(r["input_ids"]) for r in rows) + 4
    ids = torch.full((2, width), processor.tokenizer.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    pos = torch.zeros(2, 4, width, dtype=torch.long)
    for b, (r, resp) in enumerate(zip(rows, responses)):
        seq = r["input_ids"] + resp
        ids[b, width - len(seq):] = torch.tensor(seq)
        mask[b, width - len(seq):] = 1
        pos[b, :, width - len(seq):] = torch.cat([r["position_ids"], continue_positions(r["position_ids"], 4)], 1)
    mm = concat_multi_modal_inputs([r["multi_modal_inputs"] for r in rows])
    with torch.no_grad():
        ours, _ = response_logprobs(model, ids, mask, pos, 4, **mm)
        logits = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=(
            ids == processor.tokens.image_token_id).int(), **mm).logits
    theirs = torch.log_softmax(logits[:, -5:-1].float(), -1).gather(-1, ids[:, -4:, None])[..., 0]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    # the image matters: another image changes the response's log-probs
    other = processor(_prompt(processor, "Which is red?", 1), [_image(56, 56, (10, 200, 10), seed=5)])
    mm2 = concat_multi_modal_inputs([other["multi_modal_inputs"], rows[1]["multi_modal_inputs"]])
    with torch.no_grad():
        changed, _ = response_logprobs(model, ids, mask, pos, 4, **mm2)
    assert (changed[0] - ours[0]).abs().max() > 1e-4
    assert torch.allclose(changed[1], ours[1], atol=1e-6)


def test_positions_of_text_only_sequences_are_plain(vl):
    _, processor = vl
    ids = processor.tokenizer("just text", add_special_tokens=False)["input_ids"]
    pos = position_ids_4d(processor.tokens, ids)
    assert torch.equal(pos, torch.arange(len(ids)).expand(4, -1))
    assert continue_positions(pos, 3).tolist() == [[len(ids), len(ids) + 1, len(ids) + 2]] * 4


def test_a_text_model_is_not_a_vision_model(tiny_model_dir):
    from transformers import AutoConfig

    with pytest.raises(MultiModalError, match="not a vision-language model"):
        VisionTokens.from_config(AutoConfig.from_pretrained(tiny_model_dir))


def test_packed_log_probs_and_gradients_of_image_sequences_equal_the_padded_forward(vl):
    """Sequence packing of a vision-language batch (M-RoPE positions packed as they are, the images in row order,
    the vision tower attending unpacked): the padded forward's log-probs and gradients, a generated pad included."""
    from hyflow.models.packing import packed_response_logprobs
    from hyflow.models.vision import image_placeholders, placeholder_mask

    model, processor = vl
    pad = processor.tokens.image_token_id
    rows = [processor(_prompt(processor, "Which is red?", 1), [_image(56, 56)]),
            processor(_prompt(processor, "Two pictures, which one is blue?", 2),
                      [_image(112, 84, (20, 20, 220)), _image(56, 84, seed=3)]),
            processor(_prompt(processor, "Only text here.", 0), [])]
    responses = [[40, pad, 42, 43], [50, 51], [60, 61, 62]]
    R = 4
    width = max(len(r["input_ids"]) for r in rows) + 2 + R
    ids = torch.full((3, width), processor.tokenizer.pad_token_id)
    mask = torch.zeros(3, width, dtype=torch.long)
    pos = torch.zeros(3, 4, width, dtype=torch.long)
    for b, (r, resp) in enumerate(zip(rows, responses)):  # left-padded prompts, right-padded responses
        P = len(r["input_ids"])
        start = width - R - P
        ids[b, start:start + P] = torch.tensor(r["input_ids"])
        ids[b, width - R:width - R + len(resp)] = torch.tensor(resp)
        mask[b, start:width - R + len(resp)] = 1
        pos[b, :, start:start + P] = r["position_ids"]
        pos[b, :, width - R:width - R + len(resp)] = continue_positions(r["position_ids"], len(resp))
    mm_rows = [r["multi_modal_inputs"] for r in rows]
    images = concat_multi_modal_inputs(mm_rows)
    image_mask = placeholder_mask(ids, mm_rows, processor.tokens)
    model.train(False)

    def grads(fn):
        model.zero_grad()
        logp = fn()
        (logp * mask[:, -R:]).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with image_placeholders(model, image_mask):
        padded, padded_grads = grads(lambda: response_logprobs(model, ids, mask, pos, R, **images)[0])
    packed, packed_grads = grads(lambda: packed_response_logprobs(model, ids, mask, R, position_ids=pos,
                                                                  images=images, image_mask=image_mask)[0])
    real = mask[:, -R:].bool()
    assert torch.allclose(packed[real], padded[real], atol=1e-5, rtol=0)
    assert any(name.startswith("model.visual.") for name in packed_grads)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_nested_packed_attention_leaves_the_vision_tower_unpacked(vl):
    from hyflow.models.packing import PACKED_ATTENTION, packed_attention
    from hyflow.models.vision import vision_tower

    model, _ = vl
    tower = vision_tower(model).config
    before = tower._attn_implementation
    with packed_attention(model):
        with packed_attention(model):
            assert model.config.get_text_config()._attn_implementation == PACKED_ATTENTION
            assert tower._attn_implementation == before
        assert tower._attn_implementation == before  # a nested exit restores the parent, which passes it on
    assert tower._attn_implementation == before
