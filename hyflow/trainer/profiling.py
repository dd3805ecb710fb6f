"""verl's profiler keys driving `torch.profiler`: which steps, which roles and ranks, what to record, where to write.

verl's keys and what hyflow does with them (`global_profiler.tool=torch`; verl's `docs/perf/torch_profiling.md`):

    global_profiler.tool                      torch: profile with torch.profiler (a role's own `profiler.tool`,
                                              when set, overrides it for that role). Other tools (nsys, npu,
                                              torch_memory, precision_debugger) are not run by hyflow: the start
                                              line says so and nothing is profiled for them.
    global_profiler.steps                     the RL steps to profile (1 = the first training step)
    global_profiler.save_path                 the folder of the traces (a role's own `profiler.save_path` wins)
    global_profiler.profile_continuous_steps  consecutive profiled steps share one trace per process
    <role>.profiler.enable                    profile the processes that host the role (actor, ref, rollout, critic)
    <role>.profiler.all_ranks / ranks         which ranks of the role's worker group; neither: rank 0
    <role>.profiler.tool_config.torch.contents  cuda (device kernels; also when the list is empty, on a machine with
                                              CUDA), memory (profile_memory), shapes (record_shapes), stack
                                              (with_stack); CPU activity is always on

Each profiled process writes one Chrome trace per profiled step (or run of continuous steps),
`<save_path>/<roles>_step<N>_rank<r>-of-<n>_pid<pid>_<time>.json.gz`, which opens in Perfetto or chrome://tracing; the
trainer's stages are the ranges `hyflow/gen`, `hyflow/old_log_prob`, `hyflow/update_actor`, ... (the timers of
`hyflow.trainer.metrics.timer`). One process hosts several roles (actor, rollout and reference are one worker, as in
verl's hybrid engine), so one trace covers all of them: a role's `enable` selects the process, not a part of it.
In one process (`trainer.executor=local`) that is one trace per step for everything. Not done (accepted as
performance-only keys, named on that start line): `tool_config.torch.discrete` (one trace per stage),
`profile_token_start/end`, the update-loop `schedule`, `relocate_results` and the finish hooks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hyflow.config.checks.profiler import profiler_sections

ARR = "actor_rollout_ref"
# the config sections with a profiler, and the worker-group roles (`hyflow.trainer.role_registry`) that host them
SECTIONS = {f"{ARR}.actor": ("actor",), f"{ARR}.ref": ("actor",), f"{ARR}.rollout": ("actor", "rollout"),
            "critic": ("critic",)}


@dataclass(frozen=True)
class RoleProfile:
    """One config section's profiler settings, resolved (verl's interpolations from global_profiler applied)."""

    section: str
    enable: bool
    tool: str | None
    all_ranks: bool
    ranks: tuple[int, ...]
    save_path: str
    contents: tuple[str, ...]

    def rank_selection(self) -> tuple[int, ...] | None:
        """None = every rank; else the ranks to profile (rank 0 when neither all_ranks nor ranks is set)."""
        return None if self.all_ranks else (self.ranks or (0,))


@dataclass(frozen=True)
class ProfilePlan:
    """What a run profiles: the steps, whether consecutive ones share a trace, each section's settings."""

    steps: tuple[int, ...] = ()
    continuous: bool = False
    roles: tuple[RoleProfile, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.steps) and any(r.enable and r.tool == "torch" for r in self.roles)

    def profiled(self, step: int) -> bool:
        return self.active and step in self.steps

    def group_spec(self, group_roles: Iterable[str], step: int) -> dict[str, Any] | None:
        """What `Worker.start_profile` receives for a worker group hosting `group_roles`, or None when none of its
        sections is profiled with torch: the union of their rank selections and contents, the first save_path."""
        hosted = [r for r in self.roles if r.enable and r.tool == "torch"
                  and set(SECTIONS[r.section]) & set(group_roles)]
        if not hosted:
            return None
        selections = [r.rank_selection() for r in hosted]
        ranks = None if any(s is None for s in selections) else sorted({x for s in selections for x in s})
        return {"ranks": ranks, "save_path": hosted[0].save_path, "step": step,
                "contents": sorted({c for r in hosted for c in r.contents}),
                "prefix": "-".join(sorted(set(group_roles)))}

    def start_line(self) -> str | None:
        """The line the trainer prints at start when any profiler key asks for something (None otherwise)."""
        asked = [r for r in self.roles if r.enable]
        if not asked and not self.steps:
            return None
        other = sorted({f"{r.section}.profiler.tool={r.tool}" for r in asked if r.tool not in ("torch", None)})
        notes = ([f"not run by hyflow: {', '.join(other)} (only torch is; nothing is profiled for them)"]
                 if other else [])
        if not self.active:
            why = ("global_profiler.steps is empty" if not self.steps else
                   "no role has profiler.enable=true with tool torch" if not any(r.enable for r in self.roles) else
                   "no enabled role's tool is torch (set global_profiler.tool=torch)")
            return "Profiler: nothing is profiled (" + why + ")" + "".join(f"; {n}" for n in notes) + "."
        torch_roles = [r for r in asked if r.tool == "torch"]
        who = ", ".join(f"{r.section} (ranks {'all' if r.all_ranks else list(r.rank_selection())})"
                        for r in torch_roles)
        paths = sorted({r.save_path for r in torch_roles})
        return (f"Profiler: torch.profiler on steps {list(self.steps)}"
                + (" (consecutive steps in one trace)" if self.continuous else "")
                + f" for {who}; one Chrome trace (.json.gz) per profiled process and step in {', '.join(paths)}"
                + "".join(f"; {n}" for n in notes) + ".")


def profile_plan(cfg: Any) -> ProfilePlan:
    """The run's `ProfilePlan` from its `global_profiler` and role `profiler` sections (their names are checked by
    `hyflow.config.checks.profiler`)."""
    g = cfg.global_profiler
    roles = []
    for section, p in profiler_sections(cfg).items():
        contents = tuple(str(c) for c in p.tool_config.torch.contents)
        roles.append(RoleProfile(section=section, enable=p.enable, tool=p.tool or g.tool, all_ranks=p.all_ranks,
                                 ranks=tuple(int(r) for r in p.ranks), save_path=str(p.save_path or g.save_path),
                                 contents=contents))
    return ProfilePlan(steps=tuple(sorted({int(s) for s in g.steps or ()})), continuous=g.profile_continuous_steps,
                       roles=tuple(roles))


class StepProfiling:
    """Starts and stops the profiler of each worker group around the profiled steps (verl's `_start_profiling` /
    `_stop_profiling`): with continuous steps a trace starts at the first of a run of profiled steps and ends after
    its last."""

    def __init__(self, plan: ProfilePlan, groups: list) -> None:
        self.plan, self.groups = plan, groups
        self.started: list = []  # the groups whose profilers run now
        self.traces: list[str] = []

    def before_step(self, step: int) -> None:
        if not self.plan.profiled(step) or self.started:
            return
        for group in self.groups:
            spec = self.plan.group_spec(getattr(group, "roles", ()), step)
            if spec is not None:
                group.start_profile(spec)
                self.started.append(group)

    def after_step(self, step: int) -> None:
        if self.started and not (self.plan.continuous and self.plan.profiled(step + 1)):
            self.stop()

    def stop(self) -> None:
        """Stop the started groups' profilers (each writes its trace); the paths written go to `traces`."""
        started, self.started = self.started, []
        for group in started:
            self.traces += [p for p in group.stop_profile() if p]
        if started and self.traces:
            print(f"Profiler: {len(self.traces)} trace(s) so far, the last {os.path.basename(self.traces[-1])}",
                  flush=True)
