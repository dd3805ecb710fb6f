"""Built-in scorers; importing this package registers them with `hyflow.rewards.registry`."""

from hyflow.rewards.scorers import arithmetic, code, countdown, gsm8k, math, sorting

__all__ = ["arithmetic", "code", "countdown", "gsm8k", "math", "sorting"]
