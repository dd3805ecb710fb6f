"""`hyflow train` on a Ray cluster of two nodes (two raylets on this machine, 1 CPU each, every socket on 127.0.0.1),
attached from outside the way a real cluster is used: examples/multi_node/run_qwen2_5_7b_multinode.sh --cpu with
RAY_ADDRESS set, in a working directory the cluster was not started in.

Per layout of the example (LAYOUT): the workers land one per node, as the run prints it ("Ray placement") and as
Ray's own actor table records it (pid -> node id); the run's numbers (every metric but wall-clock and memory) equal
the same config on a one-node cluster (2 CPUs) where the arithmetic is the same: the actor's 2 ranks on two nodes
vs on one node; the rollout pool, or the critic's own pool, on the other node vs beside the trainer. The spread
layout also writes a sharded checkpoint into a relative run directory: every rank's shard lands in the driver's
directory. Each cluster is a process group of this test's own (loopback_cluster.py under a temp dir of its own),
stopped by SIGTERM to that process; no `ray stop`, which would stop every Ray instance on the machine.
About 2.5-3 minutes on the 2-core test machine (-m slow; 139 s and 176 s measured), half a minute of it making
the warm-started tiny model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import run_cache

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multi_node"
SCRIPT = EXAMPLE / "run_qwen2_5_7b_multinode.sh"
LAUNCHER = EXAMPLE / "loopback_cluster.py"
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
# wall-clock and memory: the only metrics that may differ between the layouts
NOT_NUMBERS = re.compile(r"^timing_s/|^perf/(throughput|time_per_step|.*memory)|_s$|idle_ratio$|overlap_share$")
PLACED = re.compile(r"rank (\d+) -> node ([0-9a-f]+) \(([^)]*)\) pid (\d+)")

# LAYOUT -> (extra arguments of both runs, what the one-node run changes, worker processes per group)
LAYOUTS = {
    "spread": (["trainer.save_freq=2", "trainer.checkpoint_format=sharded"],
               ["trainer.nnodes=1", "trainer.n_gpus_per_node=2"], {"HybridWorker": 2}),
    "rollout": ([], [], {"HybridWorker": 1, "RolloutHost": 1}),
    "critic": ([], [], {"HybridWorker": 1, "CriticWorkerHost": 1}),
}


def _alive(pid: int, marker: str) -> bool:
    """Whether process `pid` runs and its command line holds `marker` (so a reused pid is never taken for ours)."""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@contextlib.contextmanager
def loopback_cluster(nodes: int, num_cpus: int):
    """examples/multi_node/loopback_cluster.py in a session of its own: yields its cluster.json; then SIGTERM to it
    (it stops its nodes), SIGKILL to its process group only if it did not, and a check that its raylets are gone."""
    cluster_dir = tempfile.mkdtemp(prefix="hyflow-mn-", dir="/tmp")  # short: Ray's socket paths live under it
    started = time.perf_counter()
    with open(Path(cluster_dir) / "launcher.log", "w") as log:  # the launcher keeps its own copy of the file
        proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--dir", cluster_dir, "--nodes", str(nodes),
                                 "--num-cpus", str(num_cpus)], cwd=cluster_dir, env={**os.environ, **RAY_ENV},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    info = None
    try:
        deadline = time.monotonic() + 240
        while not (Path(cluster_dir) / "cluster.json").is_file():
            assert proc.poll() is None, (Path(cluster_dir) / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the loopback cluster did not come up in 240 s"
            time.sleep(0.3)
        info = json.loads((Path(cluster_dir) / "cluster.json").read_text())
        info["cwd"] = cluster_dir
        print(f"{nodes}-node loopback cluster at {info['address']} up in {time.perf_counter() - started:.1f} s")
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        left = [n["raylet_pid"] for n in (info or {}).get("nodes", []) if _alive(n["raylet_pid"], cluster_dir)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(cluster_dir, ignore_errors=True)
        assert not left, f"raylets {left} outlived their launcher"


@pytest.fixture(scope="module")
def two_nodes():
    with loopback_cluster(nodes=2, num_cpus=1) as info:
        yield info


@pytest.fixture(scope="module")
def one_node():
    with loopback_cluster(nodes=1, num_cpus=2) as info:
        yield info


@pytest.fixture(scope="module")
def examples_cache(tmp_path_factory):
    """One cache (tiny model, warm-started model, task data) for the examples' CPU runs of the whole test run."""
    return run_cache.examples_cache(tmp_path_factory)


def run(args: list[str], cwd: Path, env: dict, what: str) -> str:
    started = time.perf_counter()
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=800)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} failed (rc {proc.returncode}):\n{output[-6000:]}"
    print(f"{what}: {time.perf_counter() - started:.1f} s")
    return proc.stdout


def placement(stdout: str) -> dict[str, list[tuple[int, str, int]]]:
    """The run's "Ray placement" lines: group -> [(rank, node id prefix, pid)]."""
    assert "Ray placement:" in stdout, stdout[-3000:]
    groups = {}
    for name, entries in re.findall(r"^  (\w+): (rank .*)$", stdout, flags=re.M):
        groups[name] = [(int(r), node, int(pid)) for r, node, _, pid in PLACED.findall(entries)]
    return groups


def ray_actor_nodes(address: str) -> dict[int, tuple[str, str]]:
    """pid -> (node id, job id) of every worker-host actor the cluster ever ran, from Ray's own actor table."""
    probe = ("import json, sys, ray\n"
             "ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR')\n"
             "print(json.dumps([(a['Pid'], a['Address']['NodeID'], a['JobID'])\n"
             "                  for a in ray._private.state.actors().values() if a['ActorClassName'] == '_WorkerHost']))")
    out = subprocess.run([sys.executable, "-c", probe, address], env={**os.environ, **RAY_ENV}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return {pid: (node, job) for pid, node, job in json.loads(out.stdout.strip().splitlines()[-1])}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_ray_address_is_the_cluster_to_attach_to(monkeypatch):
    """No ray_kwargs.address: RAY_ADDRESS (as ray.init and `ray job submit` use it) names the cluster."""
    from hyflow.controller import ensure_ray

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ValueError, match=r"cannot be set when attaching to the cluster at '10.0.0.1:6379' "
                                         r"\(RAY_ADDRESS\); drop them, or unset RAY_ADDRESS"):
        ensure_ray(num_cpus=2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_nodes(layout, two_nodes, one_node, examples_cache, tmp_path):
    extra, one_node_layout, expected = LAYOUTS[layout]
    env = {**os.environ, **RAY_ENV, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "HYFLOW_EXAMPLES_CACHE": str(examples_cache), "STEPS": "2", "LAYOUT": layout, "OUT": "run",
           "RAY_ADDRESS": two_nodes["address"]}
    env.pop("HYFLOW", None)
    stdout = run(["bash", str(SCRIPT), "--cpu", *extra], tmp_path, env, f"LAYOUT={layout} on two nodes")

    # one worker process per node, as the run says and as Ray recorded it
    placed = placement(stdout)
    assert {name: len(ranks) for name, ranks in placed.items()} == expected, placed
    cluster_nodes = {node["node_id"] for node in two_nodes["nodes"]}
    ray_said = ray_actor_nodes(two_nodes["address"])
    seen = []
    for name, ranks in placed.items():
        assert [rank for rank, _, _ in ranks] == list(range(len(ranks))), ranks
        for rank, prefix, pid in ranks:
            node, job = ray_said[pid]
            assert node.startswith(prefix) and node in cluster_nodes, (name, rank, prefix, node)
            seen.append((node, job))
    assert len({node for node, _ in seen}) == len(seen) == 2, f"not one worker per node: {placed}"
    (job,) = {job for _, job in seen}
    assert sorted(pid for pid, (_, j) in ray_said.items() if j == job) == sorted(p for r in placed.values()
                                                                                 for _, _, p in r)
    print(f"LAYOUT={layout}: " + "; ".join(f"{name} rank {rank} on node {prefix} (pid {pid})"
                                           for name, ranks in placed.items() for rank, prefix, pid in ranks))

    # the same config on one node, attached by ray_kwargs.address: the same numbers
    (command,) = [line[2:] for line in stdout.splitlines() if line.startswith("+ ")]
    args = shlex.split(command)
    reference = tmp_path / "one_node"
    ref_env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
    ref_stdout = run([*args, f"trainer.default_local_dir={reference}", f"ray_kwargs.address={one_node['address']}",
                      *one_node_layout], tmp_path, ref_env, f"LAYOUT={layout} on one node")
    assert "Ray placement:" not in ref_stdout  # said only when the ranks span several nodes
    got, want = metrics(tmp_path / "run"), metrics(reference)
    assert [row["step"] for row in got] == [row["step"] for row in want] == [1, 2]
    for row, ref in zip(got, want):
        numbers = sorted(key for key in ref if not NOT_NUMBERS.search(key))
        assert {"actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"} <= set(numbers)
        assert sorted(key for key in row if not NOT_NUMBERS.search(key)) == numbers
        apart = {key: (row[key], ref[key]) for key in numbers
                 if not math.isclose(row[key], ref[key], rel_tol=1e-6, abs_tol=1e-9)}
        assert not apart, f"step {row['step']}: two nodes vs one node: {apart}"
    if layout == "critic":
        assert "critic/vf_loss" in got[-1]

    if layout == "spread":  # each rank's shards, written on its own node, are in the driver's relative run directory
        shards = sorted(p.name for p in (tmp_path / "run" / "global_step_2" / "actor").glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
        assert not (Path(two_nodes["cwd"]) / "run").exists()
