"""Rank processes for the tests that form a real gloo group on CPU (torch.multiprocessing, spawn).

`torch.multiprocessing.spawn(..., join=True)` has two ways to burn a CI run: a rank that blocks in a collective
waits out gloo's default 30-minute timeout, and when pytest-timeout fails the test meanwhile, the ranks it leaves
behind are non-daemonic children that Python joins at exit, so pytest prints its summary and then never ends
(CI stop 32: a DDP test hung 900 s, then the run sat until the CI limit). `spawn_ranks` bounds both:

- each rank runs with gloo's sockets on loopback (GLOO_SOCKET_IFNAME=lo: no traffic to another address, and no
  dependence on what the host name resolves to), one intra-op thread (two ranks on two cores), and a watchdog
  that dumps every thread's stack to stderr and ends the rank `timeout_s` after it started;
- the parent waits at most `timeout_s` + a grace and, however it leaves (a failure, pytest-timeout's signal), kills
  every rank still alive, so nothing outlives the test.

`init_gloo(rank, world_size, init_file)` joins the group through a file store with a collective timeout of
`COLLECTIVE_TIMEOUT_S`, so a collective that a peer never enters fails the test with gloo's error, not a hang.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import time
from datetime import timedelta

import torch

COLLECTIVE_TIMEOUT_S = 120.0
JOIN_GRACE_S = 30.0


def _rank_entry(rank: int, fn, timeout_s: float, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
    try:
        fn(rank, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def spawn_ranks(fn, args: tuple = (), nprocs: int = 2, timeout_s: float = 600.0, grace_s: float = JOIN_GRACE_S) -> None:
    """Run `fn(rank, *args)` in `nprocs` spawned processes and wait for all of them; a rank's exception is raised
    here (torch's ProcessRaisedException, with its traceback), a rank that runs past `timeout_s` prints its stacks
    and fails the call, and no rank outlives it."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_rank_entry, args=(fn, timeout_s, args), nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s + grace_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                raise TimeoutError(f"ranks {alive} of {nprocs} still run {timeout_s + grace_s:.0f} s after "
                                   "they started (their watchdog should have dumped their stacks to stderr)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join(10)


def init_gloo(rank: int, world_size: int, init_file: str) -> None:
    """Join the default gloo group through `init_file` (a file store: no listening socket)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


# -------------------------------------------------------------------------- several checks, one spawn of ranks

class Checks:
    """The failed checks of one case on one rank. `with checks.check("what"):` records an AssertionError raised
    inside it (with `what`) and lets the rank go on, so that every rank still enters every collective of the case
    and of the cases after it, in the same order."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    @contextlib.contextmanager
    def check(self, what: str):
        try:
            yield
        except AssertionError as err:
            self.failures.append(f"{what}: {err}".rstrip())


def _run_cases(rank: int, init_file: str, out_dir: str, world_size: int, cases: list) -> None:
    """A rank of `spawn_cases`: joins the gloo group, runs `fn(rank, checks, *args)` for each (name, fn, args) in
    turn (an exception ends that case only, recorded with its traceback), writes {name: failures} to
    `out_dir`/rank<rank>.json."""
    import json
    import traceback

    import torch.distributed as dist

    init_gloo(rank, world_size, init_file)
    failures = {}
    for name, fn, args in cases:
        checks = Checks()
        try:
            fn(rank, checks, *args)
        except Exception:  # recorded: the test of this case fails with it
            checks.failures.append(traceback.format_exc())
        failures[name] = checks.failures
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(failures, f)
    dist.destroy_process_group()


def spawn_cases(cases: list[tuple[str, object, tuple]], out_dir, nprocs: int = 2,
                timeout_s: float = 600.0) -> dict[str, list[str]]:
    """Run several cases, each (name, fn, args) with `fn(rank, checks, *args)` (module-level, checks with
    `checks.check`), one after another in ONE spawn of `nprocs` gloo ranks (a spawn costs each rank its imports,
    ~5 CPU-s, where a small model's case takes well under one); returns {name: its failures, each prefixed with
    the rank}: a test per case asserts its own list is empty. A rank that dies or hangs fails the call
    (spawn_ranks), and so every case's test."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_run_cases, args=(str(out / "init"), str(out), nprocs, list(cases)), nprocs=nprocs,
                timeout_s=timeout_s)
    by_rank = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nprocs)]
    return {name: [f"rank {rank}: {failure}" for rank, got in enumerate(by_rank) for failure in got[name]]
            for name, _, _ in cases}
