"""Sorting task: sort a short list of small integers ascending.

    Sort these numbers in ascending order: 5 3 9 1. Put the sorted list after '####'.

The worked answer (`extra_info.answer`) is `#### 1 3 5 9`; ground truth is the sorted list as space-separated
integers, `"1 3 5 9"`. Lists have `min_len`..`max_len` values drawn uniformly from [`min_value`, `max_value`]
(repeats allowed). Problems are distinct by the list as shown, so train and test never share a prompt.
"""

from __future__ import annotations

from random import Random

from hyflow.data.tasks.common import Request, check_sizes, make_row, task_generator

NAME = "sorting"
DATA_SOURCE = "hyflow/sorting"
INSTRUCTION = "Put the sorted list after '####'."


@task_generator(INSTRUCTION)
def generate(
    request: Request, *, min_len: int = 3, max_len: int = 6, min_value: int = 0, max_value: int = 9
) -> dict[str, list[dict]]:
    """Rows of both splits in memory: {"train": [...], "test": [...]} (see the module docstring)."""
    check_sizes(request.n_train, request.n_test)
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len} and {max_len}")
    if min_value > max_value:
        raise ValueError(f"need min_value <= max_value, got {min_value} and {max_value}")

    def draw(rng: Random) -> tuple[int, ...]:
        return tuple(rng.randint(min_value, max_value) for _ in range(rng.randint(min_len, max_len)))

    n_values = max_value - min_value + 1
    capacity = sum(n_values**length for length in range(min_len, max_len + 1))
    problems = request.draw(
        draw, key=lambda p: p, capacity=capacity, fix="raise max_len or the value range, or lower n_train/n_test"
    )
    return request.rows(problems, lambda values, split, i: _row(
        values, split, i, request.instruction, request.system_prompt,
    ))


def _row(values, split, index, instruction, system_prompt) -> dict:
    answer = " ".join(map(str, sorted(values)))
    content = f"Sort these numbers in ascending order: {' '.join(map(str, values))}. {instruction}".strip()
    return make_row(
        DATA_SOURCE, content, ability="sorting", ground_truth=answer, split=split, index=index,
        extra={"question": content, "answer": f"#### {answer}", "numbers": list(values)},
        system_prompt=system_prompt,
    )
