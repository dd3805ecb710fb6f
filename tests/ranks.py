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
