"""Claiming a run directory before any model loads: one process at a time, and never over another run.

`claim_run_directory(run_dir, resume_mode, resume_from_path)` is the first thing a trainer does with its run
directory (`trainer.default_local_dir`):

1. Lock. An exclusive `fcntl.flock` on `<run_dir>/.hyflow.lock`, held for the life of the trainer (the kernel drops
   it when the process ends, however it ends). The file records the holder's PID and host; a second process on
   the same directory fails at once with `RunDirectoryError` naming them, instead of both runs writing
   checkpoints and metrics into it.
2. Decide what to resume, with the checkpoint manager's verified choice (sizes and sha256). With
   `trainer.resume_mode=auto`, a directory whose tracker (`latest_checkpointed_iteration.txt`) or `global_step_*`
   directories show a previous run, but in which no complete, intact checkpoint remains, is an error naming the
   directory and the choices: never a silent start from step 0 that overwrites the step directories and
   truncates `metrics.jsonl`. A directory with another run's `metrics.jsonl` and nothing to resume is an error
   too. `resume_mode=disable` is the explicit choice to start over in such a directory.
"""

from __future__ import annotations

import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from hyflow.trainer.checkpoint import TRACKER_FILE, CheckpointManager

LOCK_FILE = ".hyflow.lock"
METRICS_FILE = "metrics.jsonl"


class RunDirectoryError(ValueError):
    """The run directory is in use, or holds a previous run that this configuration would destroy."""


@dataclass
class RunDirectoryClaim:
    """The held lock (release with `release()`, or let the process end) and the checkpoint to resume (or None)."""

    run_dir: Path
    resume_path: Path | None
    _fd: int | None = None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def lock_run_directory(run_dir: Path) -> int:
    """Take the exclusive lock of `run_dir` (created if missing); returns the descriptor that holds it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirectoryError(f"trainer.default_local_dir={str(run_dir)!r} is a file, not a directory; "
                                "choose another trainer.default_local_dir") from None
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirectoryError(
            f"run directory {run_dir} is in use by another hyflow process ({holder}); wait for it to finish, "
            "stop it, or choose another trainer.default_local_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return fd


def _previous_run(run_dir: Path) -> list[str]:
    """What in `run_dir` shows that a run already used it."""
    signs = []
    if (run_dir / TRACKER_FILE).is_file():
        signs.append(f"{TRACKER_FILE} (step {(run_dir / TRACKER_FILE).read_text().strip() or '?'})")
    steps = sorted(p.name for p in run_dir.glob("global_step_*") if p.is_dir())
    if steps:
        signs.append(", ".join(steps))
    metrics = run_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        rows = sum(1 for line in metrics.read_text().splitlines() if line.strip())
        signs.append(f"{METRICS_FILE} ({rows} rows)")
    return signs


def claim_run_directory(run_dir: str | os.PathLike, resume_mode: str, resume_from_path: str | None,
                        manager: CheckpointManager | None = None) -> RunDirectoryClaim:
    """Lock `run_dir` and choose the checkpoint to resume (see the module docstring); `RunDirectoryError` when
    the directory is in use or holds a previous run that `resume_mode` would start over without being asked."""
    run_dir = Path(run_dir).expanduser()
    fd = lock_run_directory(run_dir)
    try:
        manager = manager or CheckpointManager(run_dir)
        resume = manager.resolve_resume(resume_mode, resume_from_path)
        signs = _previous_run(run_dir)
        if resume is None and resume_mode == "auto" and signs:
            raise RunDirectoryError(
                f"trainer.resume_mode=auto found no complete, intact checkpoint to resume in {run_dir}, which holds "
                f"a previous run ({'; '.join(signs)}); hyflow will not start over it silently. Choose: "
                f"trainer.resume_mode=resume_path trainer.resume_from_path=<a global_step_N you trust>, a new "
                f"trainer.default_local_dir, or trainer.resume_mode=disable to start from step 0 here (its "
                f"{METRICS_FILE} and step directories are then overwritten)")
        if resume is None and resume_mode == "disable" and signs:
            print(f"hyflow: trainer.resume_mode=disable: starting from step 0 in {run_dir}, which holds a previous "
                  f"run ({'; '.join(signs)}); its {METRICS_FILE} restarts and its step directories are replaced "
                  "as this run saves")
    except BaseException:
        os.close(fd)
        raise
    return RunDirectoryClaim(run_dir, resume, fd)
