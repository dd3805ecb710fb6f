"""Image rows (verl's multimodal format) through RLDataset with a vision-language model's processor: decoding,
placeholders, the expanded prompt, [B, 4, W] positions, and each bad row's error."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from hyflow.data.rl_dataset import DataError, RLDataset
from hyflow.images import ImageError, load_image


def _png(colour=(200, 30, 30), size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _image(w: int, h: int) -> Image.Image:
    return Image.new("RGB", (w, h), (200, 30, 30))


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from hyflow.models.tiny import make_tiny_model
    from hyflow.models.vision import VisionProcessor

    return VisionProcessor.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("vl") / "m", preset="tiny-vl"))


def _row(content="<image>What colour is the shape?", images=None, **extra):
    return {"prompt": [{"role": "user", "content": content}], "data_source": "shapes",
            "reward_model": {"style": "rule", "ground_truth": "red"},
            "images": [{"bytes": _png()}] if images is None else images, **extra}


def test_image_rows_become_expanded_prompts_with_mrope_positions(processor):
    rows = [_row(), _row("Compare <image> with <image>: which is bigger?",
                         [{"bytes": _png(size=(56, 56))}, {"bytes": _png((0, 0, 255), size=(112, 112))}]),
            _row("No picture here, what is 2+2?", images=[])]
    dataset = RLDataset(rows, processor.tokenizer, processor=processor, max_prompt_length=128)
    items = [dataset[i] for i in range(3)]
    pad = processor.tokens.image_token_id
    assert [item["raw_prompt_ids"].count(pad) for item in items] == [4, 4 + 16, 0]
    assert items[0]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert len(items[1]["multi_modal_data"]["image"]) == 2 and items[2]["multi_modal_data"] == {}
    text = processor.tokenizer.decode(items[1]["raw_prompt_ids"])
    assert text.startswith("<|im_start|>user\nCompare <|vision_start|><|image_pad|>")
    batch = dataset.collate(items)
    width = batch.tensors["input_ids"].shape[1]
    assert batch.tensors["position_ids"].shape == (3, 4, width)
    for b, item in enumerate(items):  # left-padded: each row's positions end the row, zeros before
        n = len(item["raw_prompt_ids"])
        assert torch.equal(batch.tensors["position_ids"][b, :, width - n:], item["mrope_position_ids"])
        assert not batch.tensors["position_ids"][b, :, :width - n].any()
    # text row: four equal rows; image row: the M-RoPE rows differ from the text positions
    assert torch.equal(items[2]["mrope_position_ids"], torch.arange(len(items[2]["raw_prompt_ids"])).expand(4, -1))
    assert not torch.equal(items[0]["mrope_position_ids"][0], items[0]["mrope_position_ids"][2])
    assert "mrope_position_ids" not in batch.non_tensors and "multi_modal_inputs" in batch.non_tensors


def test_an_image_row_without_a_vision_model_is_refused(tiny_tokenizer):
    with pytest.raises(DataError, match=r"row 0: column 'images' holds images, but the model is a text-only"):
        RLDataset([_row()], tiny_tokenizer)


def test_placeholders_must_match_the_images(processor):
    with pytest.raises(DataError, match=r"row 1: the prompt has 2 <image> placeholder\(s\) but column 'images' "
                                        r"holds 1 image"):
        RLDataset([_row(), _row("<image> and <image>?")], processor.tokenizer, processor=processor)
    with pytest.raises(DataError, match=r"row 0: the prompt has 0 <image> placeholder"):
        RLDataset([_row("no placeholder")], processor.tokenizer, processor=processor)


def test_an_undecodable_image_names_its_row(processor):
    with pytest.raises(DataError, match=r"row 1, image 0: the image cannot be decoded"):  # its header, at start-up
        RLDataset([_row(), _row(images=[{"bytes": b"\x89PNG broken"}])], processor.tokenizer, processor=processor)
    good_header = _png()[:60]  # the header and part of the pixels: found when the pixels are decoded
    dataset = RLDataset([_row(), _row(images=[{"bytes": good_header}])], processor.tokenizer, processor=processor)
    dataset[0]
    with pytest.raises(DataError, match=r"row 1, image 0: the image cannot be decoded"):
        dataset[1]


def test_videos_are_refused_by_name(processor):
    with pytest.raises(DataError, match="column 'videos' holds videos, which hyflow does not train on yet"):
        RLDataset([_row(videos=[{"bytes": b"x"}])], processor.tokenizer, processor=processor)


def test_an_image_prompt_too_long_after_expansion_is_an_error_or_filtered(processor, capsys):
    big = [{"bytes": _png(size=(224, 224))}]  # 64 image tokens
    rows = [_row(), _row(images=big)]
    with pytest.raises(DataError, match=r"1 of 2 prompts are longer than data.max_prompt_length=60 tokens \(the given "
                                        r"list of 2 rows row 1: \d+ tokens\); found at start-up"):
        RLDataset(rows, processor.tokenizer, processor=processor, max_prompt_length=60, truncation="left")
    filtered = RLDataset(rows, processor.tokenizer, processor=processor, max_prompt_length=60,
                         filter_overlong_prompts=True)
    assert len(filtered) == 1 and filtered.num_filtered == 1
    assert "dropped 1 of 2 prompts" in capsys.readouterr().out


def test_images_load_from_the_row_formats_verl_writes(tmp_path):
    image = _image(30, 20)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    path = tmp_path / "a.png"
    path.write_bytes(buffer.getvalue())
    for value in ({"bytes": buffer.getvalue()}, {"bytes": buffer.getvalue(), "path": "ignored.png"},
                  {"image": str(path)}, {"path": str(path)}, {"image": f"file://{path}"}, str(path),
                  buffer.getvalue(), image):
        loaded = load_image(value, "row 3")
        assert loaded.size == (30, 20) and loaded.mode == "RGB"
    with pytest.raises(ImageError, match="row 3: the image cannot be decoded"):
        load_image({"bytes": b"not an image"}, "row 3")
    with pytest.raises(ImageError, match="does not exist"):
        load_image({"image": str(tmp_path / "missing.png")}, "row 3")
    with pytest.raises(ImageError, match="needs 'bytes', 'image' or 'path'"):
        load_image({"url": "x"}, "row 3")


def test_image_rows_read_from_parquet_as_hf_datasets_writes_them(processor, tmp_path):
    """HF datasets' Image feature in parquet: a list of {"bytes", "path"} structs per row."""
    import pandas as pd

    rows = [_row(images=[{"bytes": _png(), "path": "a.png"}]), _row(images=[{"bytes": _png((0, 0, 255)), "path": None}])]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    dataset = RLDataset(str(tmp_path / "train.parquet"), processor.tokenizer, processor=processor)
    items = [dataset[0], dataset[1]]
    assert [item["multi_modal_inputs"]["image_grid_thw"].tolist() for item in items] == [[[1, 4, 4]]] * 2
    red, blue = (item["multi_modal_data"]["image"][0].getpixel((0, 0)) for item in items)
    assert red == (200, 30, 30) and blue == (0, 0, 255)


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, with next to no pixel data: a decompression bomb."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_prompt_lengths_come_from_the_image_headers_without_decoding(processor, monkeypatch):
    """The start-up length check reads each image's size from its header; its count equals the processor's."""
    import hyflow.data.rl_dataset as rl_dataset

    sizes = [(56, 56), (112, 112), (100, 60), (31, 250)]
    rows = [_row(images=[{"bytes": _png(size=size)}]) for size in sizes] + [_row("text only", images=[])]
    real_decode = rl_dataset.decode_images
    monkeypatch.setattr(rl_dataset, "decode_images", lambda *a: pytest.fail("decoded an image at start-up"))
    dataset = RLDataset(rows, processor.tokenizer, processor=processor, max_prompt_length=512)
    measured = dataset._prompt_lengths()
    monkeypatch.setattr(rl_dataset, "decode_images", real_decode)
    exact = [len(dataset[i]["raw_prompt_ids"]) for i in range(len(rows))]
    assert measured == exact
    # a count from the header that says "too long" is checked on the decoded image before it is believed
    monkeypatch.setattr(processor.image_processor, "get_number_of_image_patches", lambda h, w, kw: 10**6,
                        raising=False)
    assert RLDataset(rows, processor.tokenizer, processor=processor, max_prompt_length=512)._prompt_lengths() == exact


@pytest.mark.parametrize("size, claim", [((100_000, 100_000), r"10,000,000,000 pixels"),
                                         ((10_000, 10_000), r"10000x10000 = 100,000,000 pixels")],
                         ids=["past-pil-error", "past-pil-warning"])
def test_a_decompression_bomb_is_refused_by_row_size_and_limit(processor, size, claim):
    bomb = _bomb_png(*size)
    expected = (rf"row 1, image 0: the image is {claim} by its header, more than the limit of 89,478,485 pixels "
                r"\(PIL.Image.MAX_IMAGE_PIXELS")
    with pytest.raises(DataError, match=expected):
        RLDataset([_row(), _row(images=[{"bytes": bomb}])], processor.tokenizer, processor=processor)
    with pytest.raises(ImageError, match=rf"tool 'draw''s image 0: the image is {claim}"):  # what a tool returns
        load_image(bomb, "tool 'draw''s image 0")
    if size == (10_000, 10_000):  # a lazily opened PIL image handed over as is (a tool's return value)
        with Image.open(io.BytesIO(bomb)) as lazy, pytest.raises(ImageError, match=claim):
            load_image(lazy, "tool 'draw''s image 0")


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png", "s3://bucket/cat.png"])
def test_an_image_url_is_refused_with_how_to_supply_the_image(tmp_path, url):
    for value in (url, {"image": url}, {"path": url}):
        with pytest.raises(ImageError, match=r"row 2, image 0: the image is a URL .*hyflow never downloads images. "
                                             r"Download it first and give the local path"):
            load_image(value, "row 2, image 0")
