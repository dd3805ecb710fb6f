"""Geometry3K preprocessing (`hyflow data geo3k`, `preprocess_geo3k`) on a tiny copy in Hugging Face's parquet
layout made here with PIL: the rows verl's geo3k.py writes, the folder and file inputs, and every named error."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from hyflow.cli import main
from hyflow.data.io import check_rows, read_rows
from hyflow.data.preprocess import GEO3K_INSTRUCTION, geo3k_files, preprocess_geo3k
from hyflow.rewards.registry import default_compute_score

HYFLOW = str(Path(sys.executable).parent / "hyflow")
# the schema the `datasets` library writes for hiyouga/geometry3k: an Image-feature list, two strings
HF_SCHEMA = pa.schema([
    ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ("problem", pa.string()),
    ("answer", pa.string()),
])


def _png(colour=(20, 20, 20), size=(24, 16), fmt="PNG") -> bytes:
    image = Image.new("RGB", size, (255, 255, 255))
    image.paste(colour, (2, 2, size[0] - 2, 4))  # a line of the figure
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _record(problem: str, answer: str, *images: bytes, path: str | None = None) -> dict:
    return {"images": [{"bytes": image, "path": path} for image in images], "problem": problem, "answer": answer}


TRAIN = [
    _record("<image>Find x.", "3", _png()),
    _record("<image>Find the measure of \\angle 2.", "60", _png((200, 0, 0)), path="12.png"),
]
TEST = [_record("<image>Find the area of the figure. Round to the nearest tenth.", "2\\sqrt{3}", _png(fmt="JPEG"))]


def _parquet(path: Path, records: list[dict], schema: pa.Schema | None = HF_SCHEMA) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    return path


@pytest.fixture
def hf_copy(tmp_path) -> Path:
    """A Geometry3K folder as `huggingface-cli download hiyouga/geometry3k --repo-type dataset` leaves it."""
    root = tmp_path / "geometry3k"
    _parquet(root / "data" / "train-00000-of-00001.parquet", TRAIN)
    _parquet(root / "data" / "validation-00000-of-00001.parquet", [_record("<image>Find y.", "5", _png())])
    _parquet(root / "data" / "test-00000-of-00001.parquet", TEST)
    (root / "README.md").write_text("---\ndataset_info: ...\n---\n")
    return root


def _expected(record: dict, split: str, index: int) -> dict:
    """The row verl's examples/data_preprocess/geo3k.py writes for `record` (images: the bytes only)."""
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": record["problem"] + " " + GEO3K_INSTRUCTION}],
        "images": [{"bytes": image["bytes"]} for image in record["images"]],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": record["answer"]},
        "extra_info": {"split": split, "index": index, "answer": record["answer"], "question": record["problem"]},
    }


def test_instruction_is_verls():
    assert GEO3K_INSTRUCTION == (
        "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
        "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in "
        r"\boxed{}."
    )


def test_folder_in_hf_layout_converts_train_and_test_as_verl_does(hf_copy, tmp_path):
    written = preprocess_geo3k(hf_copy, tmp_path / "out")
    assert written == {"train": tmp_path / "out" / "train.parquet", "test": tmp_path / "out" / "test.parquet"}
    for split, records in (("train", TRAIN), ("test", TEST)):
        rows = read_rows(written[split])
        check_rows(rows, split)
        assert rows == [_expected(record, split, i) for i, record in enumerate(records)]
    # the image bytes are kept as stored (no re-encoding): the JPEG stays a JPEG
    assert Image.open(io.BytesIO(read_rows(written["test"])[0]["images"][0]["bytes"])).format == "JPEG"
    schema = pq.read_schema(written["train"])
    assert schema.field("images").type == pa.list_(pa.struct([("bytes", pa.binary())]))


def test_converted_rows_score_with_the_geo3k_scorer(hf_copy, tmp_path):
    row = read_rows(preprocess_geo3k(hf_copy, tmp_path / "out")["test"])[0]
    truth = row["reward_model"]["ground_truth"]
    response = "<think>The height is \\sqrt{3} and the base 2.</think> The area is \\boxed{2\\sqrt{3}}."
    assert default_compute_score(row["data_source"], response, truth)["score"] == 1.0
    assert default_compute_score(row["data_source"], "\\boxed{2}", truth)["score"] == 0.0


def test_shards_are_joined_in_order_and_split_picks_one(tmp_path):
    root = tmp_path / "geo"
    _parquet(root / "data" / "train-00001-of-00002.parquet", TRAIN[1:])
    _parquet(root / "data" / "train-00000-of-00002.parquet", TRAIN[:1])
    _parquet(root / "data" / "test-00000-of-00001.parquet", TEST)
    assert geo3k_files(root) == {"train": sorted((root / "data").glob("train-*")),
                                 "test": [root / "data" / "test-00000-of-00001.parquet"]}
    written = preprocess_geo3k(root, tmp_path / "out", split="train")
    assert list(written) == ["train"] and not (tmp_path / "out" / "test.parquet").exists()
    rows = read_rows(written["train"])
    assert rows == [_expected(record, "train", i) for i, record in enumerate(TRAIN)]


def test_one_file_and_a_plain_folder(tmp_path):
    src = _parquet(tmp_path / "in" / "test.parquet", TEST, schema=None)  # inferred schema, no `path` type
    assert preprocess_geo3k(src, tmp_path / "a") == {"test": tmp_path / "a" / "test.parquet"}
    assert read_rows(tmp_path / "a" / "test.parquet") == [_expected(TEST[0], "test", 0)]
    other = _parquet(tmp_path / "in" / "geo_dev_copy.parquet", TRAIN)
    assert read_rows(preprocess_geo3k(other, tmp_path / "b", split="train")["train"]) == [
        _expected(record, "train", i) for i, record in enumerate(TRAIN)]
    _parquet(tmp_path / "plain" / "train.parquet", TRAIN)  # DIR/train.parquet also counts as the layout
    assert list(preprocess_geo3k(tmp_path / "plain", tmp_path / "c")) == ["train"]


def test_command_line(hf_copy, tmp_path):
    out = subprocess.run([HYFLOW, "data", "geo3k", "--input", str(hf_copy), "--out", str(tmp_path / "geo3k")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"train: {tmp_path / 'geo3k' / 'train.parquet'}",
                                       f"test: {tmp_path / 'geo3k' / 'test.parquet'}"]
    assert read_rows(tmp_path / "geo3k" / "train.parquet")[1] == _expected(TRAIN[1], "train", 1)


def test_command_line_in_process_with_split(hf_copy, tmp_path, capsys):
    assert main(["data", "geo3k", "--input", str(hf_copy), "--out", str(tmp_path / "o"), "--split", "test"]) == 0
    assert capsys.readouterr().out == f"test: {tmp_path / 'o' / 'test.parquet'}\n"


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("hyflow data: error: ")
    return err


TRUNCATED_PNG = _png()[:40]


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, with next to no pixel data: a decompression bomb."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"problem": "<image>Find x.", "answer": "3"}],
         "train.parquet row 1: missing column 'images' (expected columns: images, problem, answer)"),
        ([{"images": [{"bytes": _png()}], "answer": "3"}],
         "train.parquet row 1: missing column 'problem' (expected columns: images, problem, answer)"),
        ([TRAIN[0], {"images": [{"bytes": _png()}], "answer": "3"}],  # parquet: a null in row 2
         "train.parquet row 2: column 'problem' must be a non-empty string, got None"),
        ([{"images": [{"bytes": _png()}], "problem": "<image>Find x."}], "train.parquet row 1: missing column 'answer'"),
        ([{"images": [{"bytes": _png()}], "problem": "<image>Find x.", "answer": ""}],
         "train.parquet row 1: column 'answer' must be a non-empty string"),
        ([TRAIN[0], TRAIN[1], _record("<image>Find x.", "3", b"GIF89a not really")],
         "train.parquet row 3: image 1 of column 'images' is not a decodable image (UnidentifiedImageError"),
        ([_record("<image>Find x.", "3", TRUNCATED_PNG)],
         "train.parquet row 1: image 1 of column 'images' is not a decodable image"),
        ([_record("<image>Find x.", "3", _bomb_png(10_000, 10_000))],  # past PIL's limit: refused undecoded
         "train.parquet row 1: image 1 of column 'images': the image is 10000x10000 = 100,000,000 pixels by its "
         "header, more than the limit of 89,478,485 pixels (PIL.Image.MAX_IMAGE_PIXELS"),
        ([{"images": [{"bytes": None, "path": "geo/12.png"}], "problem": "<image>Find x.", "answer": "3"}],
         "train.parquet row 1: image 1 of column 'images' holds no image bytes (got ['bytes', 'path'])"),
        ([_record("Find x.", "3", _png())],
         "train.parquet row 1: column 'problem' has 0 '<image>' placeholder(s) but column 'images' holds 1 "
         "image(s); each image needs one placeholder"),
        ([_record("<image>Compare with <image>.", "3", _png())],
         "column 'problem' has 2 '<image>' placeholder(s) but column 'images' holds 1 image(s)"),
        ([_record("<image>Find x.", "3")], "has 1 '<image>' placeholder(s) but column 'images' holds 0 image(s)"),
    ],
)
def test_bad_rows_are_named_by_file_row_and_column(tmp_path, capsys, records, message):
    src = _parquet(tmp_path / "train.parquet", records, schema=None)
    with pytest.raises(ValueError) as raised:
        preprocess_geo3k(src, tmp_path / "out")
    assert message in str(raised.value)
    assert message in _one_line_error(capsys, ["data", "geo3k", "--input", str(src), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_two_images_with_two_placeholders_are_kept_in_order(tmp_path):
    first, second = _png((255, 0, 0)), _png((0, 0, 255))
    src = _parquet(tmp_path / "test.parquet", [_record("<image> and <image>: which is longer?", "A", first, second)])
    (row,) = read_rows(preprocess_geo3k(src, tmp_path / "out")["test"])
    assert row["images"] == [{"bytes": first}, {"bytes": second}]


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"data/validation-00000-of-00001.parquet": TRAIN},
         "no train or test parquet files in this folder or its data/ folder (expected Hugging Face's layout"),
        ({"data/train-00000-of-00001.parquet": TRAIN, "data/extra.parquet": TRAIN},
         "extra.parquet: cannot tell the split of this file from its name (train or test"),
        ({}, "no train or test parquet files"),
    ],
)
def test_folder_errors_name_the_fix(tmp_path, capsys, layout, message):
    root = tmp_path / "geo"
    root.mkdir()
    for name, records in layout.items():
        _parquet(root / name, records)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        preprocess_geo3k(root, tmp_path / "out")
    assert message in _one_line_error(capsys, ["data", "geo3k", "--input", str(root), "--out", str(tmp_path / "o")])


def test_file_errors_name_the_fix(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"no test parquet files"):
        preprocess_geo3k(_parquet(tmp_path / "geo" / "train.parquet", TRAIN).parent, tmp_path / "o", split="test")
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("{}\n")
    with pytest.raises(ValueError, match=r"Geometry3K is read from parquet .*got '.jsonl'"):
        preprocess_geo3k(jsonl, tmp_path / "o")
    with pytest.raises(ValueError, match=r"cannot tell the split of 'geometry.parquet' from its name; pass split="):
        preprocess_geo3k(_parquet(tmp_path / "geometry.parquet", TRAIN), tmp_path / "o")
    with pytest.raises(ValueError, match=r"split must be one of train, test, got 'validation'"):
        preprocess_geo3k(tmp_path / "geometry.parquet", tmp_path / "o", split="validation")
    err = _one_line_error(capsys, ["data", "geo3k", "--input", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
    assert "nowhere: no such file or folder; point --input at the dataset's folder" in err
    empty = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist([], schema=HF_SCHEMA), empty)
    with pytest.raises(ValueError, match=r"test.parquet: the file has no rows"):
        preprocess_geo3k(empty, tmp_path / "o")
