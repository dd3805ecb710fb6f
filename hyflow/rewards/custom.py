"""User reward functions from a Python file (verl's ``custom_reward_function.{path,name,reward_kwargs}``).

`load_custom_reward_function(path, name, reward_kwargs)` imports the file as a module (hyflow's one loader of
user code, `hyflow.user_code.load_object`) and returns its function `name`, with `reward_kwargs` bound by
`functools.partial`. The function has verl's signature

    fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | {"score": float, ...}

(async functions are returned as they are; the caller awaits them). Each file gets a module name derived
from its resolved path, so two files both called ``reward.py`` do not replace each other in `sys.modules`; a
relative path is taken from the current directory. Mistakes fail at load time, not at the first scored sample:
a missing file, a missing or non-callable function, a file that raises on import, and `reward_kwargs` keys the
function cannot accept each raise an error that names the config key to fix.

`normalize_score(result)` turns what a reward function returned into ``(score, extras)``: a number (bool,
int, float, numpy scalar) gives ``(float(result), {})``; a dict gives ``(float(result["score"]), the other
keys)`` — extras become metrics and validation columns. Anything else, or a non-finite score, is an error
naming the returned value.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from pathlib import Path

from hyflow.user_code import accepted_keywords, load_object


def _check_kwargs(fn: Callable, reward_kwargs: dict, name: str, path: str) -> None:
    """Fail now if `fn` cannot accept a key of `reward_kwargs` (it would fail on every sample otherwise)."""
    accepted = accepted_keywords(fn)
    if accepted is None:
        return
    unknown = sorted(set(reward_kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"custom_reward_function.reward_kwargs has {unknown} but {name}() in {path} accepts only "
            f"{sorted(accepted)}; remove those keys or add them (or **kwargs) to the function's parameters"
        )


def load_custom_reward_function(
    path: str | Path, name: str = "compute_score", reward_kwargs: dict | None = None
) -> Callable:
    """Import `path` and return ``functools.partial(module.<name>, **reward_kwargs)`` (or the bare function).

    Loaded by `hyflow.user_code.load_object` (the pair form); its errors are FileNotFoundError (no such file),
    ImportError (the file raised while importing; the original exception is chained), AttributeError (no
    `name` in the file; lists the callables it defines), TypeError (`name` is not callable); a TypeError here
    when `reward_kwargs` has keys the function does not accept.
    """
    fn = load_object((path, name), what="reward function", config_key="custom_reward_function")
    if not reward_kwargs:
        return fn
    reward_kwargs = dict(reward_kwargs)
    _check_kwargs(fn, reward_kwargs, name, str(Path(path).expanduser().resolve()))
    return functools.partial(fn, **reward_kwargs)


def _as_score(value, result) -> float:
    """`value` as a finite float; errors name the full `result` the reward function returned."""
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward function returned {result!r:.200}; expected a number or a dict with a numeric 'score' "
            f"(e.g. {{'score': 1.0, 'acc': True}}), got score of type {type(value).__name__}"
        )
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(
            f"reward function returned a non-finite score ({score}) in {result!r:.200}; "
            "return a finite float (check for 0/0 or log(0) in the reward code)"
        )
    return score


def normalize_score(result) -> tuple[float, dict]:
    """``(score, extras)`` from a reward function's return value.

    number -> ``(float(number), {})``; ``{"score": s, **rest}`` -> ``(float(s), rest)``.
    TypeError for any other value or a dict without "score"; ValueError for a NaN or infinite score.
    """
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(
                f"reward function returned a dict without a 'score' key: {result!r:.200}; "
                "add 'score' (the reward) — other keys become metrics"
            )
        extras = {key: value for key, value in result.items() if key != "score"}
        return _as_score(result["score"], result), extras
    return _as_score(result, result), {}


class WeightedRewards:
    """Several reward functions as one (TRL's `reward_funcs` + `reward_weights`): the score is the weighted sum of
    the functions' scores; each function's own score is an extra (`<name>`, so `reward/<name>/mean` is logged),
    and the extra keys of a function that returns a dict are kept as `<name>/<key>`. Every function has verl's
    signature and gets the same arguments. Picklable when the functions are (reward_model.num_workers > 0)."""

    def __init__(self, functions: list[Callable], weights: list[float] | None = None) -> None:
        if not functions:
            raise ValueError("reward_fn=[] holds no reward function; give at least one")
        for fn in functions:
            if not callable(fn):
                raise TypeError(f"reward_fn entries must be callables, got {type(fn).__name__} {fn!r:.80}")
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        if len(weights) != len(functions):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(functions)} reward functions; give "
                             "one weight per function")
        if any(not math.isfinite(w) for w in weights):
            raise ValueError(f"reward_weights must be finite numbers, got {weights}")
        self.functions, self.weights = list(functions), weights
        names = [getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__) for fn in functions]
        self.names = [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]
        self.__name__ = "+".join(f"{w:g}*{n}" for w, n in zip(self.weights, self.names))

    def __call__(self, *args, **kwargs) -> dict:
        total, extras = 0.0, {}
        for fn, weight, name in zip(self.functions, self.weights, self.names):
            score, extra = normalize_score(fn(*args, **kwargs))
            total += weight * score
            extras[name] = score
            extras.update({f"{name}/{key}": value for key, value in extra.items()})
        return {"score": total, **extras}


def combine_reward_functions(functions, weights=None) -> WeightedRewards:
    """`WeightedRewards(list(functions), weights)`: one reward function from several (see there)."""
    return WeightedRewards(list(functions), None if weights is None else list(weights))
