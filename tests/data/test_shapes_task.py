"""The shapes task (a visual question whose answer is only in the image): determinism, disjoint splits, verl's
multimodal row layout, the answer recovered from the decoded pixels, its options and errors, and its scorer."""

from __future__ import annotations

import io
from collections import deque

import pytest
from PIL import Image

from hyflow.cli import main
from hyflow.data.io import check_rows, read_rows
from hyflow.data.tasks import get_task, make_task
from hyflow.data.tasks.shapes import BACKGROUND, COLOURS, DATA_SOURCE, INSTRUCTION
from hyflow.rewards.registry import default_compute_score, get_scorer
from hyflow.rewards.scorers import shapes as shapes_scorer

SMALL = {"n_train": 40, "n_test": 10}


def _generate(**options):
    return get_task("shapes").generate(**{**SMALL, "seed": 0, **options})


def _decode(row: dict) -> Image.Image:
    (image,) = row["images"]
    decoded = Image.open(io.BytesIO(image["bytes"]))
    assert decoded.format == "PNG"
    return decoded.convert("RGB")


def _regions(image: Image.Image) -> tuple[set[tuple[int, int, int]], int]:
    """The colours of the image other than the background, and its number of connected non-background regions
    (8-neighbourhood): what a perfect reader of the picture would answer."""
    width, height = image.size
    pixels = image.load()
    colours = {pixels[x, y] for x in range(width) for y in range(height)} - {BACKGROUND}
    seen, regions = set(), 0
    for start in ((x, y) for x in range(width) for y in range(height)):
        if start in seen or pixels[start] == BACKGROUND:
            continue
        regions += 1
        queue = deque([start])
        seen.add(start)
        while queue:
            x, y = queue.popleft()
            for nx in (x - 1, x, x + 1):
                for ny in (y - 1, y, y + 1):
                    if 0 <= nx < width and 0 <= ny < height and (nx, ny) not in seen and pixels[nx, ny] != BACKGROUND:
                        seen.add((nx, ny))
                        queue.append((nx, ny))
    return colours, regions


def test_same_seed_same_images_other_seed_other_images():
    assert _generate(seed=3) == _generate(seed=3)
    first, other = _generate(seed=3)["train"], _generate(seed=4)["train"]
    assert [r["images"] for r in first] != [r["images"] for r in other]


def test_splits_are_disjoint_by_image_and_the_test_split_does_not_depend_on_n_train():
    rows = get_task("shapes").generate(seed=0, n_train=400, n_test=100)
    train = {r["images"][0]["bytes"] for r in rows["train"]}
    test = {r["images"][0]["bytes"] for r in rows["test"]}
    assert (len(train), len(test)) == (400, 100)
    assert not train & test
    assert _generate(n_train=5)["test"] == _generate(n_train=50)["test"]


def test_rows_are_in_verls_multimodal_layout():
    rows = _generate(system_prompt="Look closely.")
    for split, split_rows in rows.items():
        check_rows(split_rows, f"shapes/{split}")
        for index, row in enumerate(split_rows):
            assert list(row) == ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]
            assert row["data_source"] == DATA_SOURCE == "hyflow/shapes" and row["ability"] == "vision"
            assert row["prompt"][0] == {"role": "system", "content": "Look closely."}
            content = row["prompt"][1]["content"]
            assert content.startswith("<image>") and content.count("<image>") == len(row["images"]) == 1
            assert content.endswith(INSTRUCTION)
            assert set(row["images"][0]) == {"bytes"} and isinstance(row["images"][0]["bytes"], bytes)
            assert row["reward_model"] == {"style": "rule", "ground_truth": row["reward_model"]["ground_truth"]}
            info = row["extra_info"]
            assert (info["split"], info["index"], info["question"]) == (split, index, content)
            assert info["answer"] == f"#### {row['reward_model']['ground_truth']}"
            assert len(info["kinds"]) == info["count"] and set(info["kinds"]) <= {"circle", "square", "triangle"}


@pytest.mark.parametrize("image_size", [56, 16, 33])
def test_the_colour_answer_is_the_one_colour_in_the_pixels(image_size):
    rows = _generate(image_size=image_size, n_train=60)["train"]
    for row in rows:
        image = _decode(row)
        assert image.size == (image_size, image_size)
        colours, regions = _regions(image)
        (rgb,) = colours  # one flat colour, no anti-aliased edge pixels
        truth = row["reward_model"]["ground_truth"]
        assert COLOURS[truth] == rgb and row["extra_info"]["colour"] == truth
        assert regions == row["extra_info"]["count"]
        expected = "What colour is the shape?" if regions == 1 else "What colour are the shapes?"
        assert row["prompt"][-1]["content"] == f"<image>{expected} {INSTRUCTION}"
    assert {r["reward_model"]["ground_truth"] for r in rows} == set(COLOURS)  # every colour occurs
    assert {r["extra_info"]["count"] for r in rows} == {1, 2, 3, 4}


def test_the_count_answer_is_the_number_of_shapes_in_the_pixels():
    rows = _generate(question="count", n_train=60)["train"]
    for row in rows:
        colours, regions = _regions(_decode(row))
        assert len(colours) == 1 and row["reward_model"]["ground_truth"] == str(regions)
        assert row["prompt"][-1]["content"] == f"<image>How many shapes are there? {INSTRUCTION}"
    assert {r["reward_model"]["ground_truth"] for r in rows} == {"1", "2", "3", "4"}


def test_mixed_questions_and_the_shape_range():
    rows = _generate(question="mixed", n_train=60)["train"]
    questions = {r["prompt"][-1]["content"].split("?")[0] for r in rows}
    assert questions == {"<image>How many shapes are there", "<image>What colour is the shape",
                         "<image>What colour are the shapes"}
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert truth == (str(row["extra_info"]["count"]) if "How many" in row["prompt"][-1]["content"]
                         else row["extra_info"]["colour"])
    assert {r["extra_info"]["count"] for r in _generate(min_shapes=2, max_shapes=3)["train"]} == {2, 3}
    assert _generate(question="color") == _generate(question="colour")  # the American spelling is the same option


def test_make_task_writes_parquet_that_reads_back_and_refuses_json(tmp_path):
    paths = make_task("shapes", tmp_path / "data", seed=2, n_train=6, n_test=3, question="count", image_size="32")
    expected = get_task("shapes").generate(seed=2, n_train=6, n_test=3, question="count", image_size=32)
    for split, path in paths.items():
        assert read_rows(path) == expected[split]
    with pytest.raises(ValueError, match=r"train\.jsonl: the rows hold raw bytes .*write \.parquet instead"):
        make_task("shapes", tmp_path / "json", n_train=2, n_test=1, fmt="jsonl")


def test_data_make_command(tmp_path, capsys):
    assert main(["data", "make", "shapes", "--out", str(tmp_path), "--n-train", "4", "--n-test", "2",
                 "--option", "question=count"]) == 0
    assert capsys.readouterr().out.split() == ["train:", str(tmp_path / "train.parquet"), "test:",
                                               str(tmp_path / "test.parquet")]
    rows = read_rows(tmp_path / "train.parquet")
    assert len(rows) == 4 and all(r["prompt"][-1]["content"].startswith("<image>How many") for r in rows)
    assert main(["data", "make", "shapes", "--out", str(tmp_path), "--option", "question=size"]) == 2
    assert "question must be one of colour, count, mixed, got 'size'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"question": "shape"}, r"question must be one of colour, count, mixed, got 'shape'"),
        ({"image_size": 12}, r"image_size must be an integer from 16 to 1024 \(pixels\), got 12"),
        ({"max_shapes": 5}, r"need 1 <= min_shapes <= max_shapes <= 4 .*got 1 and 5"),
        ({"min_shapes": 3, "max_shapes": 2}, r"got 3 and 2"),
        ({"image_size": 16, "max_shapes": 1, "n_train": 100}, r"only 48 exist with these options; raise image_size"),
    ],
)
def test_option_errors_name_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        _generate(**options)


def test_the_whole_small_image_space_can_be_drawn():
    # 16 px: each quarter holds one 4 px shape at one place, so one shape: 4 colours x 4 quarters x 3 kinds
    rows = get_task("shapes").generate(n_train=40, n_test=8, image_size=16, max_shapes=1)
    assert len({r["images"][0]["bytes"] for r in rows["train"] + rows["test"]}) == 48


# --- scorer ----------------------------------------------------------------------------------------------------


def test_scorer_is_registered_and_scores_every_worked_answer_one():
    assert get_scorer("hyflow/shapes") is shapes_scorer.compute_score
    for row in _generate(question="mixed")["train"]:
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(DATA_SOURCE, row["extra_info"]["answer"], truth) == {
            "score": 1.0, "acc": True, "pred": truth}
        assert default_compute_score(DATA_SOURCE, row["prompt"][-1]["content"], truth)["score"] == 0.0


@pytest.mark.parametrize(
    ("response", "truth", "score", "pred"),
    [
        ("#### red", "red", 1.0, "red"),
        ("It is red.\n#### Red.", "red", 1.0, "red"),
        ("####blue", "blue", 1.0, "blue"),
        ("#### green\n#### blue", "blue", 1.0, "blue"),  # the last answer line counts
        ("#### blue\nbecause it is", "blue", 1.0, "blue"),
        ("#### green", "red", 0.1, "green"),  # well-formed but wrong: format_score
        ("#### 3", "3", 1.0, "3"),
        ("#### 03", "3", 1.0, "3"),
        ("#### 2", "3", 0.1, "2"),
        ("#### red circle", "red", 0.0, None),  # not one word
        ("#### 3 shapes", "3", 0.0, None),
        ("#### -3", "3", 0.0, None),
        ("the shape is red", "red", 0.0, None),  # no answer line
        ("####", "red", 0.0, None),
        ("", "red", 0.0, None),
    ],
)
def test_scorer_reads_one_word_or_number_after_the_last_mark(response, truth, score, pred):
    assert shapes_scorer.compute_score(DATA_SOURCE, response, truth, format_score=0.1) == {
        "score": score, "acc": score == 1.0, "pred": pred}


def test_scorer_gives_zero_to_a_wrong_answer_by_default():
    assert shapes_scorer.compute_score(DATA_SOURCE, "#### blue", "red") == {"score": 0.0, "acc": False,
                                                                             "pred": "blue"}
    assert shapes_scorer.compute_score(DATA_SOURCE, "#### 4", 4)["acc"] is True  # an int ground truth
    assert shapes_scorer.compute_score(DATA_SOURCE, "#### red", "Red ")["acc"] is True


def test_answer_line_rate_makes_imperfect_demonstrations_of_the_train_split_only():
    from hyflow.data.tasks import shapes

    rows = shapes.generate(n_train=200, n_test=20, seed=3, answer_line_rate=0.5)
    train = [row["extra_info"]["answer"] for row in rows["train"]]
    with_line = sum(answer.startswith("####") for answer in train)
    assert 70 < with_line < 130
    for row, answer in zip(rows["train"], train):  # the other half says the answer in a sentence
        truth = row["reward_model"]["ground_truth"]
        assert answer in (f"#### {truth}", f"It is {truth}.")
    assert all(row["extra_info"]["answer"].startswith("####") for row in rows["test"])
    same = shapes.generate(n_train=200, n_test=20, seed=3)
    assert [r["reward_model"] for r in same["train"]] == [r["reward_model"] for r in rows["train"]]
    assert [r["images"] for r in same["test"]] == [r["images"] for r in rows["test"]]
    with pytest.raises(ValueError, match=r"answer_line_rate must be in \[0, 1\]"):
        shapes.generate(n_train=2, n_test=2, seed=0, answer_line_rate=1.5)
