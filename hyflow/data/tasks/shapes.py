"""Shapes task: a visual question whose answer is only in the image, small enough for a tiny VLM on a CPU.

Each image (`image_size` x `image_size` pixels, white background, PNG) holds `min_shapes`..`max_shapes` filled
shapes (circle, square or triangle) of ONE colour out of four (red, green, blue, yellow), one shape in each
chosen quarter of the image, at least 4 pixels apart, drawn without anti-aliasing: every pixel is either the
background or the shapes' colour, and the shapes are the connected regions of the image. The rows are in verl's
multimodal layout (as verl's geo3k data): the user message starts with one ``<image>`` placeholder and the
`images` column holds ``[{"bytes": <png>}]``:

    <image>What colour is the shape? Put the final answer after '####'.      -> ground truth "red"
    <image>How many shapes are there? Put the final answer after '####'.     -> ground truth "3"

`question` picks the question: "colour" (the default and the easier one: the answer is the one non-white colour
of the image), "count" (the number of shapes) or "mixed" (either, drawn per row). The worked answer stored for
SFT (`extra_info.answer`) is the answer line alone, ``#### red``; the scorer (`hyflow.rewards.scorers.shapes`,
data_source "hyflow/shapes") reads the word or number after the last ``####``. Problems are distinct by image,
so train and test never share one (the prompt text alone repeats, by design).
"""

from __future__ import annotations

import io
from math import comb
from random import Random

from hyflow.data.tasks.common import Request, check_sizes, make_row, task_generator

NAME = "shapes"
DATA_SOURCE = "hyflow/shapes"
INSTRUCTION = "Put the final answer after '####'."
BACKGROUND = (255, 255, 255)
COLOURS = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 220), "yellow": (240, 200, 20)}
KINDS = ("circle", "square", "triangle")
QUESTIONS = ("colour", "count", "mixed")
CELLS = 4  # the image's quarters, one shape at most in each
MARGIN = 2  # pixels between a shape and the border of its quarter: shapes in neighbouring quarters stay apart
MIN_IMAGE_SIZE = 16

# A shape: (quarter 0..3, kind, x, y, size); a problem: (question, colour, shapes sorted by quarter).
Shape = tuple[int, str, int, int, int]
Problem = tuple[str, str, tuple[Shape, ...]]


def _size_range(image_size: int) -> tuple[int, int]:
    """The smallest and largest side of a shape in an image of `image_size` pixels."""
    largest = image_size // 2 - 2 * MARGIN
    return max(4, largest // 2), largest


def draw_image(colour: str, shapes: tuple[Shape, ...], image_size: int) -> bytes:
    """The PNG file of `shapes` (quarter, kind, x, y, size) filled with `colour` on the white background."""
    try:
        from PIL import Image, ImageDraw
    except ModuleNotFoundError as err:  # pillow comes with matplotlib, a hyflow dependency
        raise ModuleNotFoundError("the shapes task draws its images with Pillow: pip install pillow") from err
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    for _, kind, x, y, size in shapes:
        box = (x, y, x + size - 1, y + size - 1)
        if kind == "circle":
            pen.ellipse(box, fill=fill)
        elif kind == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(x, y + size - 1), (x + size - 1, y + size - 1), (x + (size - 1) // 2, y)], fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def question_text(question: str, count: int) -> str:
    """The question of a row: its colour ("What colour is the shape?"/"... are the shapes?") or its count."""
    if question == "count":
        return "How many shapes are there?"
    return "What colour is the shape?" if count == 1 else "What colour are the shapes?"


@task_generator(INSTRUCTION)
def generate(
    request: Request,
    *,
    question: str = "colour",
    image_size: int = 56,
    min_shapes: int = 1,
    max_shapes: int = 4,
    answer_line_rate: float = 1.0,
) -> dict[str, list[dict]]:
    """Rows of both splits in memory: {"train": [...], "test": [...]} (see the module docstring).

    `answer_line_rate` < 1 makes the SFT demonstrations of the train split imperfect, as the arithmetic task's:
    that fraction of them (chosen with the seed) is the `#### answer` line the scorer reads, the rest say the answer
    in a sentence without the line ("It is red." / "There are 3."). Prompts, images and ground truths are
    unchanged, and the test split always has the line.

    Each row is a verl row plus an `images` column ``[{"bytes": <png>}]``; `extra_info` also holds the drawn
    `colour`, `count` and `kinds` (the shapes' kinds in quarter order).
    """
    check_sizes(request.n_train, request.n_test)
    if not 0.0 <= answer_line_rate <= 1.0:
        raise ValueError(f"answer_line_rate must be in [0, 1], got {answer_line_rate}")
    line_rng = Random(request.seed + 1)
    question = "colour" if question == "color" else question
    if question not in QUESTIONS:
        raise ValueError(f"question must be one of {', '.join(QUESTIONS)}, got {question!r}")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or not MIN_IMAGE_SIZE <= image_size <= 1024:
        raise ValueError(f"image_size must be an integer from {MIN_IMAGE_SIZE} to 1024 (pixels), got {image_size!r}")
    if not 1 <= min_shapes <= max_shapes <= CELLS:
        raise ValueError(f"need 1 <= min_shapes <= max_shapes <= {CELLS} (one shape per quarter of the image), got "
                         f"{min_shapes} and {max_shapes}")
    half = image_size // 2
    low, high = _size_range(image_size)

    def draw(rng: Random) -> Problem:
        asked = rng.choice(("colour", "count")) if question == "mixed" else question
        colour = rng.choice(list(COLOURS))
        shapes = []
        for cell in sorted(rng.sample(range(CELLS), rng.randint(min_shapes, max_shapes))):
            kind, size = rng.choice(KINDS), rng.randint(low, high)
            left, top = (cell % 2) * half, (cell // 2) * half
            x = left + rng.randint(MARGIN, half - MARGIN - size)
            y = top + rng.randint(MARGIN, half - MARGIN - size)
            shapes.append((cell, kind, x, y, size))
        return asked, colour, tuple(shapes)

    # distinct by image: (colour, shapes); each quarter's shape has kinds x sum over sizes of (x, y) positions
    per_shape = len(KINDS) * sum((half - 2 * MARGIN - size + 1) ** 2 for size in range(low, high + 1))
    capacity = len(COLOURS) * sum(comb(CELLS, k) * per_shape**k for k in range(min_shapes, max_shapes + 1))
    problems = request.draw(
        draw, key=lambda p: p[1:], capacity=capacity,
        fix="raise image_size or the range min_shapes..max_shapes, or lower n_train/n_test",
    )
    return request.rows(problems, lambda problem, split, i: _row(
        problem, split, i, image_size, request.instruction, request.system_prompt,
        answer_line=split != "train" or line_rng.random() < answer_line_rate,
    ))


def _row(problem: Problem, split: str, index: int, image_size: int, instruction: str, system_prompt,
         answer_line: bool = True) -> dict:
    asked, colour, shapes = problem
    answer = colour if asked == "colour" else str(len(shapes))
    content = f"<image>{question_text(asked, len(shapes))} {instruction}".strip()
    worked = f"#### {answer}" if answer_line else (f"It is {answer}." if asked == "colour" else f"There are {answer}.")
    return make_row(
        DATA_SOURCE, content, ability="vision", ground_truth=answer, split=split, index=index,
        extra={"question": content, "answer": worked, "colour": colour, "count": len(shapes),
               "kinds": [kind for _, kind, *_ in shapes]},
        system_prompt=system_prompt, images=[draw_image(colour, shapes, image_size)],
    )
