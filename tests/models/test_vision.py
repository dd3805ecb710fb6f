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
    add_images,
    concat_multi_modal_inputs,
    continue_positions,
    image_token_counts,
    placeholder_mask,
    position_ids_4d,
    row_position_ids,
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


def test_an_image_after_sampled_pad_tokens_sits_where_image_pad_starts_say(vl):
    """A tool's picture after tokens the model sampled, one of them a pad token: the row's `image_pad_starts` put
    the second block after the sampled pad, which stays text. Positions equal transformers' get_rope_index told
    the same slots (its mm_token_type_ids); the default starts would misplace the block."""
    model, processor = vl
    first = processor(_prompt(processor, "Which is red?", 1), [_image(56, 56)])
    pad = processor.tokens.image_token_id
    new = processor.images([_image(84, 56, seed=2)])
    before = sum(1 for t in first["input_ids"] if t == pad)
    ids = [*first["input_ids"], 40, pad, 41, pad, 42, *processor.expand([pad], new["image_grid_thw"]), 43, pad]
    row = add_images(first["multi_modal_inputs"], new, [before + 2], processor.tokens.spatial_merge_size)
    assert row["image_pad_starts"].tolist() == [0, before + 2]
    slots = placeholder_mask(torch.tensor([ids]), [row], processor.tokens)[0]
    counts = processor.token_counts(row["image_grid_thw"])
    assert int(slots.sum()) == sum(counts) and int((torch.tensor(ids) == pad).sum()) == sum(counts) + 3
    sampled = [i for i, t in enumerate(ids) if t == pad and not slots[i]]
    assert len(sampled) == 3 and ids[sampled[0] - 1] == 40 and ids[sampled[1] - 1] == 41 and sampled[2] == len(ids) - 1
    ours = row_position_ids(processor.tokens, ids, row)
    theirs, _ = model.model.get_rope_index(torch.tensor([ids]), mm_token_type_ids=slots.int()[None],
                                           image_grid_thw=row["image_grid_thw"],
                                           attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert torch.equal(ours[1:], theirs[:, 0])
    with pytest.raises(MultiModalError, match="shorter run"):  # the default: the second block at the sampled pad
        position_ids_4d(processor.tokens, ids, row["image_grid_thw"])
    with pytest.raises(MultiModalError, match="overlap"):
        add_images(first["multi_modal_inputs"], new, [before - 1], processor.tokens.spatial_merge_size)


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


def _grads(model, mask, R, fn):
    """(log-probs, parameter gradients) of fn()'s log-probs summed over the response mask."""
    model.zero_grad()
    logp = fn()
    (logp * mask[:, -R:]).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _padded_grads(model, ids, mask, pos, R, images, image_mask):
    from hyflow.models.vision import image_placeholders

    with image_placeholders(model, image_mask):
        return _grads(model, mask, R, lambda: response_logprobs(model, ids, mask, pos, R, **images)[0])


def test_packed_log_probs_and_gradients_of_image_sequences_equal_the_padded_forward(vl):
    """Sequence packing of a vision-language batch (M-RoPE positions packed as they are, the images in row order,
    the vision tower attending unpacked): the padded forward's log-probs and gradients, a generated pad included."""
    from hyflow.models.packing import packed_response_logprobs

    model, processor = vl
    ids, mask, pos, R, images, image_mask = image_batch(processor)
    model.train(False)

    padded, padded_grads = _padded_grads(model, ids, mask, pos, R, images, image_mask)
    packed, packed_grads = _grads(model, mask, R, lambda: packed_response_logprobs(
        model, ids, mask, R, position_ids=pos, images=images, image_mask=image_mask)[0])
    real = mask[:, -R:].bool()
    assert torch.allclose(packed[real], padded[real], atol=1e-5, rtol=0)
    assert any(name.startswith("model.visual.") for name in packed_grads)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def image_batch(processor: VisionProcessor):
    """(ids, mask, positions [B, 4, L], R, images, image_mask) of three rows (one picture, two pictures, text
    only), left-padded prompts and right-padded responses, a generated pad token among the first response."""
    from hyflow.models.vision import placeholder_mask

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
    return ids, mask, pos, R, concat_multi_modal_inputs(mm_rows), placeholder_mask(ids, mm_rows, processor.tokens)


def test_shared_prompts_of_image_sequences_equal_the_padded_forward(vl):
    """Prompt sharing (use_prefix_grouper) on a vision-language batch: the samples of a prompt run its tokens and
    its pictures once; a prompt with the same token ids but another picture is not shared; a tool's picture in one
    response runs with that response. Log-probs and gradients equal the padded forward's."""
    from hyflow.models.packing import pack_sequences, packed_response_logprobs
    from hyflow.models.vision import (
        placeholder_mask,
        prompt_image_keys,
        split_prompt_images,
    )

    model, processor = vl
    pad = processor.tokens.image_token_id
    merge = processor.tokens.spatial_merge_size
    red = processor(_prompt(processor, "Which is red?", 1), [_image(56, 56)])
    blue = processor(_prompt(processor, "Which is red?", 1), [_image(56, 56, (20, 20, 220))])  # same ids
    two = processor(_prompt(processor, "Two pictures, which one is blue?", 2),
                    [_image(112, 84, (20, 20, 220)), _image(56, 84, seed=3)])
    tool = processor.images([_image(56, 84, (0, 200, 0), seed=4)])
    block = processor.expand([pad], tool["image_grid_thw"])
    prompts = [red, red, red, blue, two, two]
    responses = [[40, 41], [40, pad, 42, *block, 43], [45], [40, 41], [50, 51, 52], [53]]
    R = max(len(r) for r in responses)
    width = max(len(r["input_ids"]) for r in prompts) + 1 + R
    B = len(prompts)
    ids = torch.full((B, width), processor.tokenizer.pad_token_id)
    mask = torch.zeros(B, width, dtype=torch.long)
    pos = torch.zeros(B, 4, width, dtype=torch.long)
    rows = []
    for b, (r, resp) in enumerate(zip(prompts, responses)):
        P = len(r["input_ids"])
        start = width - R - P
        ids[b, start:start + P] = torch.tensor(r["input_ids"])
        ids[b, width - R:width - R + len(resp)] = torch.tensor(resp)
        mask[b, start:width - R + len(resp)] = 1
        row = r["multi_modal_inputs"]
        if b == 1:  # the tool's picture after a sampled pad token
            row = add_images(row, tool, [sum(processor.token_counts(row["image_grid_thw"])) + 1], merge)
        rows.append(row)
        real = mask[b].bool()
        pos[b, :, real] = row_position_ids(processor.tokens, ids[b][real], row)
    image_mask = placeholder_mask(ids, rows, processor.tokens)
    images = concat_multi_modal_inputs(rows)
    parts = split_prompt_images(rows, image_mask[:, : width - R].sum(-1).tolist(), merge)
    assert [len(p[1].get("image_grid_thw", [])) for p in parts] == [0, 1, 0, 0, 0, 0]
    keys = prompt_image_keys(parts)
    assert keys[0] == keys[1] == keys[2] != keys[3] and keys[4] == keys[5]
    packed = pack_sequences(ids, mask, pos, share_prefix_width=width - R, prompt_keys=keys)
    assert packed.leaders.tolist() == [0, 0, 0, 3, 4, 4]  # the blue picture has a prompt of its own
    model.train(False)

    padded, padded_grads = _padded_grads(model, ids, mask, pos, R, images, image_mask)
    shared, shared_grads = _grads(model, mask, R, lambda: packed_response_logprobs(
        model, ids, mask, R, position_ids=pos, image_mask=image_mask, image_parts=parts, share_prompts=True)[0])
    real = mask[:, -R:].bool()
    assert torch.allclose(shared[real], padded[real], atol=1e-5, rtol=0)
    assert any(name.startswith("model.visual.") for name in shared_grads)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # the same ids shared regardless of the pictures would score the blue row under the red picture
    wrong = pack_sequences(ids, mask, pos, share_prefix_width=width - R)
    assert wrong.leaders.tolist()[3] == 0


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
