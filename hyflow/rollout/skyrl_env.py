"""SkyRL-Gym's environments in hyflow's environment seat (`env_class: skyrl`).

SkyRL-Gym (`pip install skyrl-gym`, `hyflow[envs]`) ships text environments with the Gymnasium API: `gsm8k`,
`aime`, `search`, `sql`, `lcb`, ... A row runs one with::

    {"agent_name": "env_agent", "env_class": "skyrl", "env_kwargs": {"env": "gsm8k"},
     "prompt": [...], "reward_model": {"ground_truth": "72"}}

`env_kwargs`: `env` (the SkyRL-Gym id), `env_config` (its config, given to the environment as an OmegaConf
DictConfig, as SkyRL passes it) and any other keys as SkyRL's `extras`. The extras always hold SkyRL's
`reward_spec` (`{"method": "rule", "ground_truth": <the row's ground truth>}`) unless the row gives its own.

Mapping (SkyRL-train's own loop does the same): `reset(sample)` makes the environment with
`skyrl_gym.make(env, env_config=..., extras=...)` and calls its `init(prompt)`; an environment that rewrites the
prompt is refused (hyflow has already tokenised it: give the row the rewritten prompt). `step(action)` returns
the text of SkyRL's observation messages (joined; none ends the episode), its reward, `done`, and the numbers of its
metadata as `info`. `close()` closes it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hyflow.rollout.env_loop import register_env

with contextlib.suppress(ModuleNotFoundError):  # imported once, here: each episode's process inherits them
    import omegaconf  # noqa: F401
    import skyrl_gym  # noqa: F401


@register_env("skyrl")
class SkyRLEnv:
    """One SkyRL-Gym environment episode (see the module docstring)."""

    def __init__(self, env: str | None = None, env_config: dict | None = None, **extras: Any) -> None:
        if not env:
            raise ValueError("env_class skyrl needs the SkyRL-Gym environment id in env_kwargs.env (e.g. gsm8k)")
        try:
            import skyrl_gym
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError("env_class skyrl needs SkyRL-Gym: pip install 'hyflow[envs]' (or skyrl-gym)"
                                      ) from err
        if env not in skyrl_gym.registry:
            known = ", ".join(sorted(skyrl_gym.registry))
            raise ValueError(f"env_kwargs.env={env!r} is not a SkyRL-Gym environment (registered: {known})")
        self.name, self.env_config, self.extras = env, dict(env_config or {}), extras
        self.env = None

    def reset(self, sample: dict) -> None:
        import skyrl_gym
        from omegaconf import OmegaConf

        extras = dict(self.extras)
        extras.setdefault("reward_spec", {"method": "rule", "ground_truth": sample.get("ground_truth")})
        self.env = skyrl_gym.make(self.name, env_config=OmegaConf.create(self.env_config), extras=extras)
        prompt = [dict(m) for m in sample["raw_prompt"]]
        first, _ = self.env.init([dict(m) for m in prompt])
        if [dict(m) for m in first] != prompt:
            raise ValueError(f"the SkyRL-Gym environment {self.name!r} rewrites the prompt in init(); hyflow has "
                             "already tokenised the row's prompt: put the rewritten prompt in the dataset")

    def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        out = self.env.step(action)
        text = "\n".join(str(m.get("content", "")) for m in out.get("observations") or [])
        info = {k: v for k, v in (out.get("metadata") or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return text or None, float(out.get("reward") or 0.0), bool(out.get("done")), info

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
