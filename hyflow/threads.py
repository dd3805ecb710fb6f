"""How many CPU threads torch uses in each hyflow process, and how its idle threads wait.

Generic (it knows no RL): the trainers call `configure_threads` at start, and the `ray` executor's worker
processes call it before they build their worker.

Why. torch's CPU wheels run their intra-op parallel regions on GNU OpenMP (libgomp), with one thread per core of
the machine by default, and libgomp lets a thread that waits at the end of a region spin (up to 300,000 polls,
`GOMP_SPINCOUNT`) before it sleeps. Two things then go wrong on a shared machine:

- several processes each take every core (Ray workers on one node, a user's second job): N processes x C threads
  on C cores;
- another process holds a core: every parallel region waits for the thread whose core is taken, while the
  waiting threads spin and take the CPU time that thread needs.

Measured on a 2-core VM with another process busy on one core (BENCHMARKS.md, "The GRPO step under contention"):
torch's default of 2 spinning threads made a GRPO step of the tiny model 14x slower than one thread and
29-55x slower than 2 threads that sleep when idle.

The rule (`choose_threads`), per process:

    threads = HYFLOW_NUM_THREADS, else OMP_NUM_THREADS, when set        (the user's choice wins)
            = torch's count, when the program called torch.set_num_threads before hyflow started
            = max(1, usable cores // hyflow workers on this node)      otherwise

where usable cores = the CPUs this process may run on (`os.sched_getaffinity`), capped by the cgroup's CPU quota
(cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`) rounded down, at least 1. `workers` is 1 for
the in-process executor; for Ray it is the number of hyflow worker processes the executor places on the node.
In a Ray worker, OMP_NUM_THREADS is Ray's own guess from the actor's `num_cpus`, not the user's, so it is not
read there: the executor passes the driver's HYFLOW_NUM_THREADS or OMP_NUM_THREADS on as HYFLOW_NUM_THREADS.

Idle threads sleep: `quiet_openmp_waits()` (run when `hyflow` is imported) sets `OMP_WAIT_POLICY=PASSIVE` unless
the variable is set. libgomp reads it once, when it is loaded (at `import torch`), so it only takes effect if
hyflow is imported first, or the variable is set in the environment; the start line says which. The Ray
executor puts it into every worker's environment. (Intel's OpenMP, in other torch builds, reads the same
variable.)
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PASSIVE = "PASSIVE"
THREADS_ENV = "HYFLOW_NUM_THREADS"
WORKERS_ENV = "HYFLOW_WORKERS_PER_NODE"

# What quiet_openmp_waits found: None until it ran; else why OpenMP threads sleep or spin in this process.
_wait_note: str | None = None
# The count configure_threads last applied in this process (None: never): any other count is the program's own.
_applied: int | None = None


def quiet_openmp_waits(environ: dict | None = None) -> str:
    """Set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep) unless it is set; say what applies to this process.

    Effective only before torch is imported (libgomp reads the variable when it loads)."""
    global _wait_note
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env:
        note = f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}"
    elif "torch" in sys.modules:
        note = ("idle threads spin: torch was imported before hyflow with OMP_WAIT_POLICY unset; set "
                "OMP_WAIT_POLICY=PASSIVE")
    else:
        env["OMP_WAIT_POLICY"] = PASSIVE
        note = f"idle threads sleep: OMP_WAIT_POLICY={PASSIVE}"
    if environ is None and _wait_note is None:
        _wait_note = note
    return note


def openmp_wait_note() -> str:
    """How idle OpenMP threads wait in this process, as the start line says it."""
    return _wait_note or quiet_openmp_waits({**os.environ})


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup's CPU quota in cores (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us / cpu.cfs_period_us`),
    or None where there is none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores(limit: float | None = None) -> int:
    """CPUs this process may run on (its affinity), capped by the CPU quota `limit` (cores; default: the cgroup's),
    rounded down; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit() if limit is None else limit
    if limit is not None:
        cores = min(cores, max(1, math.floor(limit)))
    return max(1, cores)


@dataclass(frozen=True)
class ThreadChoice:
    """The torch thread count of one process and the reason, as the start line says it."""

    threads: int
    reason: str

    def line(self, wait_note: str | None = None) -> str:
        """`torch threads: 1 (2 cores, 2 workers on this node; OMP_NUM_THREADS unset; idle threads sleep: ...)`."""
        return f"torch threads: {self.threads} ({self.reason}" + (f"; {wait_note}" if wait_note else "") + ")"


def _positive_int(name: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}={value!r}: set a whole number of threads >= 1, or unset it")
    return n


def _set_by_program() -> int | None:
    """torch's thread count if the program set it itself (torch.set_num_threads, not hyflow): a count other than
    torch's default (OMP_NUM_THREADS as the process started, else one per CPU of the affinity mask) and other than
    what hyflow applied last."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        default = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0] or len(os.sched_getaffinity(0)))
    except (AttributeError, ValueError):
        return None
    current = torch.get_num_threads()
    return current if current not in (default, _applied) else None


def choose_threads(workers_per_node: int = 1, *, environ: dict | None = None, cores: int | None = None,
                   read_omp_num_threads: bool = True) -> ThreadChoice:
    """The thread count of the rule in the module docstring. `read_omp_num_threads=False` in a Ray worker, where
    OMP_NUM_THREADS is Ray's guess; `cores` defaults to `usable_cores()`."""
    env = os.environ if environ is None else environ
    if env.get(THREADS_ENV):
        return ThreadChoice(_positive_int(THREADS_ENV, env[THREADS_ENV]), f"{THREADS_ENV}={env[THREADS_ENV]}")
    if read_omp_num_threads and env.get("OMP_NUM_THREADS"):
        value = env["OMP_NUM_THREADS"].split(",")[0]  # libgomp's nested list: the outer level
        return ThreadChoice(_positive_int("OMP_NUM_THREADS", value), f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    if (own := _set_by_program()) is not None:
        return ThreadChoice(own, "torch.set_num_threads before hyflow started")
    workers = max(1, int(workers_per_node))
    cores = usable_cores() if cores is None else cores
    unset = "OMP_NUM_THREADS unset" if read_omp_num_threads else f"{THREADS_ENV} unset on the driver"
    return ThreadChoice(max(1, cores // workers),
                        f"{cores} core{'s' * (cores != 1)}, {workers} worker{'s' * (workers != 1)} on this node; "
                        f"{unset}")


def apply_threads(threads: int) -> None:
    """torch.set_num_threads(threads), and the inter-op pool to the same size while torch still allows it (only
    before any inter-op work; a later call keeps the pool it has)."""
    import torch

    global _applied
    torch.set_num_threads(threads)
    _applied = threads
    if torch.get_num_interop_threads() != threads:
        # raises once the pool has started (or was sized before): it then stays as it is
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)


def configure_threads(workers_per_node: int = 1, *, read_omp_num_threads: bool = True,
                      prefix: str = "") -> ThreadChoice:
    """Choose (`choose_threads`), apply (`apply_threads`) and print the start line; returns the choice."""
    choice = choose_threads(workers_per_node, read_omp_num_threads=read_omp_num_threads)
    apply_threads(choice.threads)
    print(prefix + choice.line(openmp_wait_note()), flush=True)
    return choice


def configure_worker_threads() -> ThreadChoice:
    """`configure_threads` in a worker process of the Ray executor (environment from `worker_thread_env`)."""
    workers = int(os.environ.get(WORKERS_ENV) or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return configure_threads(workers, read_omp_num_threads=False, prefix=f"rank {os.environ.get('RANK', '?')}: ")


def worker_thread_env(workers_per_node: int, environ: dict | None = None) -> dict[str, str]:
    """Environment variables for a worker process the executor starts: how many hyflow workers share its node,
    the driver's own thread setting (HYFLOW_NUM_THREADS, else OMP_NUM_THREADS, as HYFLOW_NUM_THREADS), and
    OMP_WAIT_POLICY (the driver's, else PASSIVE) so that it is in place before the worker imports torch."""
    env = os.environ if environ is None else environ
    out = {WORKERS_ENV: str(max(1, int(workers_per_node))), "OMP_WAIT_POLICY": env.get("OMP_WAIT_POLICY", PASSIVE)}
    setting = env.get(THREADS_ENV) or env.get("OMP_NUM_THREADS")
    if setting:
        out[THREADS_ENV] = setting.split(",")[0]
    return out
