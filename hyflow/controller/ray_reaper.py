"""End the processes of a local Ray cluster that outlive the driver which started it (Linux).

Ray ties the processes a driver starts itself (GCS, raylet, log monitor, dashboard, autoscaler monitor) to that
driver with `PR_SET_PDEATHSIG` (`ray._private.utils.set_kill_on_parent_death_linux`): when the driver is killed
(SIGKILL, the OOM killer, `os._exit`), the kernel SIGKILLs them. The processes the *raylet* starts are not tied
that way. Its workers notice the raylet's death and exit within seconds; its two agents (`ray::DashboardAgent`
and `ray::RuntimeEnvAgent`) notice it at once (a pipe from the raylet closes), but then report the "unexpected"
raylet death to the GCS, which died with the driver, and that report waits out its 60 s timeout
(`ray._private.process_watcher.report_raylet_error_logs`, `publish_error(..., 60)`, Ray 2.60) before they exit.
Ray's other answer, its reaper process, is used only where the kernel cannot fate-share, and it makes the driver
a process group leader (which takes it out of the terminal's Ctrl-C group).

So the driver starts this module as a small process of its own (plain Python, no imports beyond the standard
library, in a session of its own so a signal to the driver's process group does not reach it) and holds the write
end of a pipe into its stdin. The driver writes one line: the cluster's logs directory, its own pid, and the pids
and start times of the processes Ray started for the cluster. When the pipe closes (the driver ended the cluster,
exited, or was killed) this process ends whatever of that cluster still runs: the recorded processes, and every
process that holds the raylet's own log (`raylet.out` / `raylet.err` of that logs directory) open for writing,
which the raylet passes on to everything it starts (its agents and workers; their command lines and environment
are overwritten by their process titles, so nothing else names them once the raylet is gone). The session
directory's name is unique to the cluster, a reader of the log (`tail -f`) holds it read-only, and the driver is
never counted. SIGTERM first, SIGKILL after `grace_s`. What it ended goes to its log, `hyflow_reaper.log` in the
same logs directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

GRACE_S = 3.0
RAYLET_LOGS = ("raylet.out", "raylet.err")


def start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot, /proc/<pid>/stat), or None when it is gone or a
    zombie (its exit is done; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _alive(pid: int, started: int) -> bool:
    return start_time(pid) == started


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def children(pid: int) -> list[tuple[int, int, str]]:
    """(pid, start time, command line) of each running child of process `pid`."""
    found = []
    for child in _pids():
        try:
            with open(f"/proc/{child}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] in (b"Z", b"X"):
                continue
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        found.append((child, int(fields[19]), command))
    return found


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of each running process below process `pid` (children, their children, ...)."""
    found, parents = [], [pid]
    while parents:
        below = [(child, started) for parent in parents for child, started, _ in children(parent)]
        found += below
        parents = [child for child, _ in below]
    return found


def _writes_to(pid: int, paths: set[str]) -> bool:
    """Whether process `pid` holds one of `paths` open for writing (read from /proc/<pid>/fd and fdinfo)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") not in paths:
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                flags = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        if flags & (os.O_WRONLY | os.O_RDWR):
            return True
    return False


def raylet_log_writers(logs_dir: str, exclude: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """(pid, start time) of every running process holding the raylet's log in `logs_dir` open for writing: the
    raylet and everything it started. `exclude` (and this process) never count."""
    paths = {os.path.join(os.path.realpath(logs_dir), name) for name in RAYLET_LOGS}
    found = []
    for pid in _pids():
        if pid == os.getpid() or pid in exclude or not _writes_to(pid, paths):
            continue
        started = start_time(pid)
        if started is not None:
            found.append((pid, started))
    return found


def end_processes(processes: list[tuple[int, int]], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each (pid, start time) that still runs, SIGKILL those still running `grace_s` later, and wait
    (up to `grace_s` more) until they are gone. A pid whose start time differs is another process: spared.
    Returns the pids that were still running."""
    running = [(pid, started) for pid, started in processes if _alive(pid, started)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, started in running:
            if _alive(pid, started):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(pid, started) for pid, started in running):
            time.sleep(0.05)
        if not any(_alive(pid, started) for pid, started in running):
            break
    return [pid for pid, _ in running]


def reap(cluster: dict, grace_s: float = GRACE_S) -> list[int]:
    """End what still runs of `cluster` ({"logs": dir, "driver": pid, "processes": [[pid, start], ...]}): the
    recorded processes and every writer of its raylet's log. Returns the pids it found running."""
    recorded = [tuple(entry) for entry in cluster.get("processes", [])]
    driver = cluster.get("driver")
    writers = raylet_log_writers(cluster["logs"], exclude=(driver,) if driver else ()) if cluster.get("logs") else []
    return end_processes(list(dict.fromkeys(recorded + writers)), grace_s)


def start_reaper(cluster: dict, log_path: str | None) -> tuple[subprocess.Popen, int]:
    """Start the reaper for `cluster` (see `reap`); returns its process and the pipe's write end, which the caller
    keeps open as long as the cluster should live and closes (or dies) to have the leftovers ended."""
    read_end, write_end = os.pipe()
    try:
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the child keeps it)
    except OSError:
        log = subprocess.DEVNULL
    try:
        proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=read_end,
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
        if log is not subprocess.DEVNULL:
            log.close()
    os.write(write_end, (json.dumps(cluster) + "\n").encode())
    return proc, write_end


def main() -> None:
    """Read the cluster's line, wait for the end of stdin, end the leftovers, report them on stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.readline()
    while sys.stdin.read(65536):
        pass
    if not line.strip():
        return
    cluster = json.loads(line)
    ended = reap(cluster)
    said = f"ended pids {ended}, which still ran" if ended else "nothing of it still ran"
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} hyflow ray_reaper: the driver (pid {cluster.get('driver')}) let "
          f"go of the cluster logging to {cluster.get('logs')}; {said}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
