"""Multimodal SFT rows: verl's images + <image> placeholders in the conversation, the expanded tokens never
trained on, [B, 4, L] positions, and each bad row's error."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from hyflow.data.rl_dataset import DataError
from hyflow.data.sft_dataset import SFTDataset


def _png(colour=(200, 30, 30), size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from hyflow.models.tiny import make_tiny_model
    from hyflow.models.vision import VisionProcessor

    return VisionProcessor.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("vl") / "m", preset="tiny-vl"))


def _row(prompt="<image>What colour is it?", answer="#### red", images=None):
    return {"prompt": [{"role": "user", "content": prompt}], "extra_info": {"answer": answer},
            "images": [{"bytes": _png()}] if images is None else images}


def test_image_conversations_train_on_the_answer_only(processor):
    rows = [_row(), _row("Compare <image> and <image>.", "#### same", [{"bytes": _png()}, {"bytes": _png(size=(112, 56))}]),
            _row("No image: 2+2?", "#### 4", [])]
    data = SFTDataset(rows, processor.tokenizer, response_key="extra_info.answer", processor=processor, max_length=96)
    items = [data[i] for i in range(3)]
    pad = processor.tokens.image_token_id
    assert [int((item["input_ids"] == pad).sum()) for item in items] == [4, 4 + 8, 0]
    for item in items:
        trained = processor.tokenizer.decode(item["input_ids"][item["loss_mask"].bool()])
        assert trained.startswith("####") and trained.endswith("<|im_end|>")
        assert not item["loss_mask"][item["input_ids"] == pad].any()
        assert item["position_ids"].shape == (4, len(item["input_ids"]))
    assert torch.equal(items[0]["position_ids"], processor.positions(items[0]["input_ids"].tolist(),
                                                                     items[0]["multi_modal_inputs"]["image_grid_thw"]))
    batch = data.collate(items)
    width = batch["input_ids"].shape[1]
    assert batch["position_ids"].shape == (3, 4, width) and batch["loss_mask"].shape == (3, width)
    n = len(items[2]["input_ids"])
    assert not batch["position_ids"][2, :, n:].any() and not batch["attention_mask"][2, n:].any()
    assert len(batch["multi_modal_inputs"]) == 3 and batch["multi_modal_inputs"][2] == {}


def test_bad_image_conversations_name_their_row(processor, tiny_tokenizer):
    with pytest.raises(DataError, match=r"row 0: column 'images' holds images, but the model is a text-only"):
        SFTDataset([_row()], tiny_tokenizer, response_key="extra_info.answer")
    with pytest.raises(DataError, match=r"row 1: the conversation has 2 <image> placeholder\(s\) but column "
                                        r"'images' holds 1 image"):
        SFTDataset([_row(), _row("<image><image>?")], processor.tokenizer, response_key="extra_info.answer",
                   processor=processor)
    data = SFTDataset([_row(images=[{"bytes": b"broken"}])], processor.tokenizer, response_key="extra_info.answer",
                      processor=processor)
    with pytest.raises(DataError, match=r"row 0, image 0: the image cannot be decoded"):
        data[0]
    long = SFTDataset([_row(images=[{"bytes": _png(size=(224, 224))}])], processor.tokenizer,
                      response_key="extra_info.answer", processor=processor, max_length=40, truncation="left")
    with pytest.raises(DataError, match=r"row 0: the conversation has \d+ tokens with its images expanded, more than "
                                        r"max_length=40; raise data.max_length \(a conversation with images is not "
                                        r"truncated"):
        long[0]
