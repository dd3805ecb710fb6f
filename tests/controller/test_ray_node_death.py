"""A killed raylet (the Ray node of the driver dies) ends the run with one hyflow line naming it, not with a silent
exit (Ray terminates a driver that touches a dead node's object store, status 1, nothing printed) or a misleading
"worker died, often out of memory". Each case runs in a subprocess with a Ray instance of its own, whose raylet
(found through that instance's own process table) is the only process the test kills. The driver then ends with
os._exit: within a bounded time no process of its cluster (GCS, agents, workers, hyflow's ray_reaper) runs."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, threading, time
    import torch
    from hyflow.batch import Batch
    from hyflow.cli import _user_error
    from hyflow.controller import Dispatch, RayWorkerGroup, Worker, ensure_ray, register

    class Doubler(Worker):
        @register(Dispatch.DP_SPLIT)
        def forward(self, batch):
            return Batch({"y": batch["x"] * 2})

        @register(Dispatch.REPLICATE)
        def nap(self, seconds):
            time.sleep(seconds)
            return seconds

    ensure_ray(num_cpus=2, ray_init={"log_to_driver": False})
    import ray
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid  # this instance's own
    group = RayWorkerGroup(Doubler, world_size=1)
    import psutil
    print("TREE", json.dumps([(p.pid, p.create_time(), p.name()) for p in psutil.Process().children(recursive=True)]),
          flush=True)
    print("before:", group.forward(Batch({"x": torch.arange(4.0)}))["y"].tolist(), flush=True)
    try:
        if sys.argv[1] == "during":
            threading.Timer(1.0, os.kill, (raylet, signal.SIGKILL)).start()
            group.nap(30)
        else:
            os.kill(raylet, signal.SIGKILL)
            time.sleep(2)
            group.forward(Batch({"x": torch.arange(100_000.0)}))  # a batch for the (dead) object store
        print("no error", flush=True)
    except Exception as exc:
        print(f"ERROR {type(exc).__name__}: {_user_error(exc)}", flush=True)
    os._exit(0)  # the Ray node is gone: nothing to shut down cleanly
''')


@pytest.mark.parametrize("when", ["between", "during"])
def test_a_killed_raylet_is_one_named_error(when, tmp_path):
    script = tmp_path / "raylet_death.py"
    script.write_text(SCRIPT)
    env_fix = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), when], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env_fix})
    tree = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("TREE ")]
    left = _still_running(tree[0] if tree else [], within_s=40)
    for pid, _, _ in left:  # only what this test's driver started, by pid
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "before: [0.0, 2.0, 4.0, 6.0]" in proc.stdout, proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("ERROR RayNodeDiedError: the Ray node of this driver died during Doubler."), lines[0]
    assert "raylet (pid " in lines[0] and "Start the run again" in lines[0], lines[0]
    assert tree and len(tree[0]) >= 5, proc.stdout
    assert not left, f"40 s after the driver's os._exit its cluster's processes still run: {left}"


def _still_running(tree: list, within_s: float) -> list:
    """The (pid, create time, name) of `tree` still running (zombies count as ended) after up to `within_s`."""
    psutil = pytest.importorskip("psutil")

    def running(pid, created):
        try:
            proc = psutil.Process(pid)
            return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within_s
    while True:
        left = [entry for entry in tree if running(entry[0], entry[1])]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
