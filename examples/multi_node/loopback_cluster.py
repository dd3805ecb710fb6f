"""A Ray cluster of several nodes on this one machine, every socket on 127.0.0.1: for trying and testing multi-node
runs without a second machine.

    python examples/multi_node/loopback_cluster.py --dir DIR [--nodes 2] [--num-cpus 1] [--num-gpus 0]

starts a head node and `--nodes - 1` worker nodes, each a raylet of its own with its own `--num-cpus` CPUs (and
`--num-gpus` GPUs), writes `DIR/cluster.json` once every node is alive (`address`: the head's GCS address to give
`RAY_ADDRESS` / `ray_kwargs.address`; `nodes`: each node's id, raylet pid and resources; `pid`: this process) and
then `DIR/address` (the address alone), then waits. SIGTERM or SIGINT (Ctrl-C) stops every process it started, and nothing else: the Ray sessions live under
DIR (never /tmp/ray), no `ray_current_cluster` file is written, so `address="auto"` of another Ray user on this
machine never finds this cluster and `ray stop` is never needed.

On a real cluster the same thing is two commands (examples/multi_node/clusters.md):

    ray start --head --node-ip-address=HEAD_IP --port=6379 --num-cpus=C      # on the head node
    ray start --address=HEAD_IP:6379 --node-ip-address=NODE_IP --num-cpus=C  # on every other node

Why not those commands on loopback: Ray 2.x refuses `ray start --address` (a worker node) while
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps Ray off the machine's external interface; with the variable at 1 it
rewrites 127.0.0.1 (both --address and --node-ip-address) to the machine's external IP, where the head, listening on
127.0.0.1, cannot be reached. Another loopback IP (127.0.0.2) is kept as given, but a node whose IP is not 127.0.0.1
listens on every interface. So the worker nodes are started here the way `ray start --address --block` starts one
(`ray._private.node.Node(..., head=False)`, as Ray's own `ray.cluster_utils.Cluster` does), without that check.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before `import ray`: every node process inherits it
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_enable_metrics_collection", "0")  # no dashboard here; see hyflow.controller.resources
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway loopback cluster: no token for nodes and drivers


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def start_node(temp_dir: Path, num_cpus: int, num_gpus: int, gcs_address: str | None):
    """One Ray node on 127.0.0.1: the head (GCS included) when `gcs_address` is None, else a node joining it."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(node_ip_address=LOOPBACK, num_cpus=num_cpus, num_gpus=num_gpus, temp_dir=str(temp_dir),
                       object_store_memory=200 * 1024 * 1024, include_dashboard=False, node_manager_port=0,
                       dashboard_agent_listen_port=free_port(), min_worker_port=0, max_worker_port=0)
    if gcs_address is None:
        params.gcs_server_port = free_port()
    else:
        params.gcs_address = gcs_address
        params.include_log_monitor = False  # one log monitor per machine: the head's
    return Node(params, head=gcs_address is None, shutdown_at_exit=True, spawn_reaper=True)


def alive_nodes(gcs_address: str) -> list[dict]:
    """The cluster's live nodes as the GCS lists them."""
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions

    state = GlobalState()
    state._initialize_global_state(GcsClientOptions.create(gcs_address, None, allow_cluster_id_nil=True,
                                                           fetch_cluster_id_if_nil=False))
    try:
        return [node for node in state.node_table() if node["Alive"]]
    finally:
        state.disconnect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="the cluster's directory: Ray sessions, cluster.json")
    parser.add_argument("--nodes", type=int, default=2, help="nodes, the head included (default 2)")
    parser.add_argument("--num-cpus", type=int, default=1, help="logical CPUs of each node (default 1)")
    parser.add_argument("--num-gpus", type=int, default=0, help="GPUs of each node (default 0)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for every node to come up")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.num_cpus < 0 or args.num_gpus < 0:
        parser.error("--nodes must be >= 1, --num-cpus and --num-gpus >= 0")
    args.dir.mkdir(parents=True, exist_ok=True)
    temp_dir = args.dir.resolve() / "ray"
    if len(str(temp_dir)) > 60:  # Unix socket paths (temp_dir/session_.../sockets/...) must stay < 108 bytes
        parser.error(f"--dir {args.dir} is too long a path for Ray's sockets; use a short one (e.g. under /tmp)")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    nodes = []
    try:
        nodes.append(start_node(temp_dir, args.num_cpus, args.num_gpus, None))
        address = nodes[0].gcs_address
        for _ in range(args.nodes - 1):
            nodes.append(start_node(temp_dir, args.num_cpus, args.num_gpus, address))
        deadline = time.monotonic() + args.timeout
        while len(live := alive_nodes(address)) < args.nodes:
            if time.monotonic() > deadline or stop:
                raise RuntimeError(f"only {len(live)} of {args.nodes} nodes came up within {args.timeout:g} s")
            time.sleep(0.2)
        raylets = {node.node_id: node.all_processes["raylet"][0].process.pid for node in nodes}
        info = {"address": address, "pid": os.getpid(), "temp_dir": str(temp_dir),
                "nodes": [{"node_id": n["NodeID"], "node_ip": n["NodeManagerAddress"],
                           "raylet_pid": raylets.get(n["NodeID"]), "resources": n["Resources"]} for n in live]}
        for name, text in (("cluster.json", json.dumps(info, indent=1)), ("address", address + "\n")):
            tmp = args.dir / f"{name}.tmp"
            tmp.write_text(text)
            tmp.replace(args.dir / name)  # atomic: a reader sees all of it or nothing
        print(f"{args.nodes} Ray node(s) of {args.num_cpus} CPU(s) on {LOOPBACK}: RAY_ADDRESS={address} "
              f"(stop: kill -TERM {os.getpid()})", flush=True)
        while not stop:
            time.sleep(0.5)
            dead = [i for i, node in enumerate(nodes) if node.dead_processes()]
            if dead:
                print(f"loopback_cluster: processes of node(s) {dead} died; stopping the cluster", file=sys.stderr)
                return 1
        return 0
    finally:
        for node in reversed(nodes):  # worker nodes first, the head (GCS) last
            node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


if __name__ == "__main__":
    sys.exit(main())
