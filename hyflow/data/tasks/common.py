"""What every built-in task shares: drawing distinct problems, building schema rows, writing the splits.

A task draws `n_test + n_train` *distinct* problems (distinct by a task-defined key) from one
`random.Random(seed)`; the first `n_test` form the test split and the rest the train split, so the splits
are disjoint by construction and the test split stays the same when only `n_train` changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import TypeVar

from hyflow.data.io import write_rows

P = TypeVar("P")
FORMATS = ("parquet", "jsonl", "json")


def check_sizes(n_train: int, n_test: int) -> None:
    """Both split sizes must be non-negative integers and at least one positive."""
    for name, n in (("n_train", n_train), ("n_test", n_test)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {n!r}")
    if n_train + n_test == 0:
        raise ValueError("n_train + n_test is 0: ask for at least one problem")


def draw_distinct(
    rng: Random,
    draw: Callable[[Random], P],
    key: Callable[[P], Hashable],
    n: int,
    *,
    capacity: int | None = None,
    fix: str = "",
) -> list[P]:
    """Draw `n` problems with pairwise different `key(problem)`, in draw order.

    `capacity` (the number of distinct keys, when known) turns an impossible request into an immediate error;
    otherwise the search gives up after 50 n + 10,000 draws. Either error says how to enlarge the space (`fix`).
    """
    if capacity is not None and n > capacity:
        raise ValueError(f"asked for {n} distinct problems but only {capacity} exist with these options; {fix}")
    seen: set[Hashable] = set()
    problems: list[P] = []
    for _ in range(50 * n + 10_000):
        if len(problems) == n:
            break
        problem = draw(rng)
        k = key(problem)
        if k not in seen:
            seen.add(k)
            problems.append(problem)
    if len(problems) < n:
        raise ValueError(f"found only {len(problems)} distinct problems of the {n} asked for; {fix}")
    return problems


def make_row(
    data_source: str,
    content: str,
    *,
    ability: str,
    ground_truth: str,
    split: str,
    index: int,
    extra: dict,
    system_prompt: str | None = None,
    images: list[bytes] | None = None,
) -> dict:
    """One verl-schema row: the user message (after an optional system message) and its ground truth.

    `images` (encoded PNG/JPEG files) make a multimodal row in verl's layout: an `images` column after the prompt,
    ``[{"bytes": ...}, ...]`` (what Hugging Face's Image feature stores), one ``<image>`` placeholder per image in
    `content`, in order.
    """
    prompt = [{"role": "system", "content": system_prompt}] if system_prompt else []
    prompt.append({"role": "user", "content": content})
    media = {} if images is None else {"images": [{"bytes": image} for image in images]}
    return {
        "data_source": data_source,
        "prompt": prompt,
        **media,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def split_problems(problems: list[P], n_train: int, n_test: int) -> dict[str, list[P]]:
    """The first `n_test` problems are the test split, the next `n_train` the train split."""
    return {"train": problems[n_test : n_test + n_train], "test": problems[:n_test]}


def write_splits(splits: dict[str, list[dict]], out_dir: str | Path, fmt: str = "parquet") -> dict[str, Path]:
    """Write each split to `out_dir/<split>.<fmt>`; return {split: path}."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out_dir = Path(out_dir)
    return {split: write_rows(rows, out_dir / f"{split}.{fmt}") for split, rows in splits.items()}


def parse_operators(operators: str | list[str] | tuple[str, ...], allowed: str) -> tuple[str, ...]:
    """Operators given as a string ("+-*") or a list (["+", "*"]): a non-empty, duplicate-free subset of `allowed`."""
    ops = tuple(operators.replace(" ", "").replace(",", "")) if isinstance(operators, str) else tuple(operators)
    bad = [op for op in ops if op not in allowed]
    if not ops or bad or len(set(ops)) != len(ops):
        raise ValueError(
            f"operators must be distinct characters from {allowed!r} (e.g. {allowed!r}), got {operators!r}"
        )
    return ops


@dataclass(frozen=True)
class Request:
    """The options every task's `generate` takes, handed to the task as one value (see `task_generator`)."""

    n_train: int
    n_test: int
    seed: int
    instruction: str
    system_prompt: str | None

    def draw(self, draw: Callable[[Random], P], key: Callable[[P], Hashable], **limits) -> list[P]:
        """`n_test + n_train` distinct problems drawn from `Random(seed)` (`draw_distinct`; `limits`: capacity,
        fix)."""
        return draw_distinct(Random(self.seed), draw, key, self.n_train + self.n_test, **limits)

    def rows(self, problems: list[P], row: Callable[[P, str, int], dict]) -> dict[str, list[dict]]:
        """{"train": [...], "test": [...]}: `row(problem, split, index)` of each problem of each split, train first."""
        return {
            split: [row(problem, split, i) for i, problem in enumerate(chosen)]
            for split, chosen in split_problems(problems, self.n_train, self.n_test).items()
        }


def task_generator(instruction: str) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    """Decorator making a task's public `generate` from `fn(request, **options)`.

    The options every task shares are declared here once: `generate` takes n_train (2000), n_test (200) and
    seed (0), then `fn`'s own keyword-only options, then instruction (default `instruction`) and system_prompt
    (None), all keyword-only, and calls `fn` with the shared ones as one `Request`. Its signature lists every
    option in that order with its default, so `inspect.signature` and `task_options` see them all; it has
    `fn`'s name, docstring and module.
    """

    def decorate(fn: Callable[..., dict]) -> Callable[..., dict]:
        def generate(
            *, n_train: int = 2000, n_test: int = 200, seed: int = 0, instruction: str = instruction,
            system_prompt: str | None = None, **options,
        ) -> dict[str, list[dict]]:
            return fn(Request(n_train, n_test, seed, instruction, system_prompt), **options)

        shared = inspect.signature(generate).parameters
        own = [p for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        generate.__signature__ = inspect.Signature(
            [*(shared[name] for name in ("n_train", "n_test", "seed")), *own,
             shared["instruction"], shared["system_prompt"]],
            return_annotation=inspect.signature(generate).return_annotation,
        )
        generate.__name__, generate.__qualname__ = fn.__name__, fn.__qualname__
        generate.__doc__, generate.__module__ = fn.__doc__, fn.__module__
        return generate

    return decorate
