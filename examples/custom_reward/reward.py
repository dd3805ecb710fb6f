"""A custom reward function for hyflow (and verl): GSM8K-style `#### answer` scoring with partial format credit.

    hyflow train custom_reward_function.path=examples/custom_reward/reward.py \
        custom_reward_function.name=compute_score +custom_reward_function.reward_kwargs.format_score=0.1 ...

The function has verl's signature, so the same file works with `python3 -m verl.trainer.main_ppo`:

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

- `data_source`: the row's data_source column ("openai/gsm8k" for `hyflow data gsm8k`, "hyflow/arithmetic" for
  the built-in task); a function can route on it. This one scores every source the same way.
- `solution_str`: the decoded response (prompt excluded, special tokens removed).
- `ground_truth`: the row's reward_model.ground_truth ("72").
- `extra_info`: the row's extra_info dict (question, answer, index, ...; in multi-turn runs also num_turns,
  tool_rewards, ...).
- `**kwargs`: custom_reward_function.reward_kwargs (here `format_score`); hyflow checks at start that the
  function accepts every key.

A dict return carries "score" (the reward) and any other keys: each becomes a per-sample column and a metric
(`reward/acc/mean`, `reward/has_answer_line/mean` in training, `val-core/<data_source>/acc/mean@1` in
validation), so keep them numbers or booleans. An exception or a non-finite score counts as a failed sample
(score 0, `reward/errors`); more than reward_model.max_error_fraction of a batch stops the run.
"""

from __future__ import annotations

import re

# the last "#### <number>" of the response; thousands separators and a trailing period are tolerated
ANSWER_LINE = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, **kwargs):
    """1 for the right number after the last `####`, `format_score` for an answer line with a wrong number,
    0 without an answer line."""
    matches = ANSWER_LINE.findall(solution_str)
    if not matches:
        return {"score": 0.0, "acc": False, "has_answer_line": False}
    predicted, truth = _number(matches[-1]), _number(str(ground_truth))
    correct = predicted is not None and truth is not None and abs(predicted - truth) < 1e-6
    return {"score": 1.0 if correct else float(format_score), "acc": correct, "has_answer_line": True}
