"""verl's profiler keys: a tool and contents verl knows (hyflow runs torch.profiler; docs/profiling.md)."""

from __future__ import annotations

from hyflow.config.checks import check
from hyflow.config.schema import HyflowConfig
from hyflow.config.schema.common import PROFILER_CONTENTS, PROFILER_TOOLS

ARR = "actor_rollout_ref"


def profiler_sections(cfg: HyflowConfig) -> dict:
    """{config key of a role's section: its ProfilerConfig (the section's `.profiler`)}, for every role that has one
    (`hyflow.trainer.profiling` reads the same)."""
    arr = cfg.actor_rollout_ref
    return {f"{ARR}.actor": arr.actor.profiler, f"{ARR}.ref": arr.ref.profiler, f"{ARR}.rollout": arr.rollout.profiler,
            "critic": cfg.critic.profiler}


@check(905)
def profiler_names(cfg: HyflowConfig) -> list[str]:
    problems = []
    tools = {"global_profiler.tool": cfg.global_profiler.tool,
             **{f"{key}.profiler.tool": p.tool for key, p in profiler_sections(cfg).items()}}
    for key, tool in tools.items():
        if tool is not None and tool not in PROFILER_TOOLS:
            problems.append(f"{key}={tool!r} is not one of verl's profilers {list(PROFILER_TOOLS)}; hyflow runs torch "
                            "(torch.profiler): set it to torch, or null for no profiling")
    for key, p in profiler_sections(cfg).items():
        unknown = [c for c in p.tool_config.torch.contents if c not in PROFILER_CONTENTS]
        if unknown:
            problems.append(f"{key}.profiler.tool_config.torch.contents has {unknown}: verl's torch profiler records "
                            f"{list(PROFILER_CONTENTS)}; remove the others")
    if any(s < 1 for s in cfg.global_profiler.steps or ()):
        problems.append(f"global_profiler.steps={cfg.global_profiler.steps}: steps count from 1 (the first training "
                        "step); remove the others")
    return problems
