"""Ray clusters and resource pools for the `ray` executor.

`ensure_ray()` attaches to a running Ray cluster (`address="auto"` or `"host:port"`, or with no address the
`RAY_ADDRESS` environment variable, as `ray.init()` and `ray job submit` use it) or starts a local one whose every
socket listens on 127.0.0.1. Ray picks its node address when `ray` is *imported*
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`, read into `ray._private.ray_constants.ENABLE_RAY_CLUSTER`): with the
variable unset it binds the machine's external interface even when told `_node_ip_address="127.0.0.1"`.
So the variable is exported before the cluster starts (its processes inherit it) and the constant is
pinned in this process too, in case `ray` was imported earlier.

Attaching checks the address first, in seconds, because `ray.init` does not: against a port where something
listens that is not a Ray GCS it retries for about ten minutes (Ray 2.60: `RAY_NUM_REDIS_GET_RETRIES`=20 attempts
of up to `py_gcs_connect_timeout_s`=30 s each) and says nothing. The check connects (nothing listening), sends a
gRPC (HTTP/2) greeting (a silent server, or one that answers something else, such as an HTTP/1 server), then asks
the GCS for its cluster id (another gRPC server). Each failure names the address, what answered there, and how
to start Ray or which address to pass.

A local start that times out (Ray waits a fixed 30 s for the raylet to register with the GCS, which it does only
once its Python agents have started: on an overloaded machine it can take longer) is cleaned up and tried once
more: `ray.init` does not record the processes of a start that raised, so `ray.shutdown()` cannot end them, and
`ensure_ray` ends the ones this process started itself. The GCS port wait, the one start timeout Ray lets the
environment set (`RAY_gcs_server_port_wait_time_s`, Ray's default 30 s), is raised to 120 s unless set. A second
timeout fails with the machine's load average and core count.

A started cluster is watched by `hyflow.controller.ray_reaper`: if this process dies without shutting it down
(SIGKILL, `os._exit`), the processes Ray does not tie to the driver (the raylet's dashboard and runtime-env agents,
which otherwise linger for 60 s, and its workers) are ended within seconds.

`RayResourcePool(nnodes, devices_per_node)` reserves the devices of a training job the way HybridFlow
(arXiv 2409.19256, verl's `RayResourcePool`) does: one Ray placement group per node, one bundle per
device (`{"GPU": 1, "CPU": cpus_per_worker}`, or `{"CPU": cpus_per_worker}` on a CPU pool), packed onto
one node (`STRICT_PACK`). The groups are sorted by (node IP, node ID), so global rank
r = node_index * devices_per_node + local_rank is the same on every start of the same cluster (sharded
checkpoints resume onto the same ranks). Unlike a bare `placement_group(...).ready()`, a pool that the
cluster can never hold fails at once, and one that it cannot hold *now* fails after `ready_timeout_s`,
both naming the missing resources, instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyflow.controller.ray_reaper import children, descendants, end_processes, start_reaper, start_time

LOOPBACK = "127.0.0.1"
_STARTED_LOCAL = False
_REAPER: tuple[Any, int] | None = None  # (reaper process, write end of its stdin) of the cluster started here
START_ATTEMPTS = 2
GCS_PORT_WAIT_S = 120
_GCS_PORT_WAIT_VAR = "RAY_gcs_server_port_wait_time_s"
# Ray's startup timeouts: node.py's raylet registration, the GCS port file, the GCS connection
_START_TIMEOUT = re.compile(r"timed out|timeout|failed to (start|connect to) gcs|may not have started", re.I)
ATTACH_CONNECT_TIMEOUT_S = 5.0
ATTACH_REPLY_TIMEOUT_S = 10.0
ATTACH_RPC_TIMEOUT_S = 15.0
# the client connection preface of HTTP/2 (RFC 9113, 3.4) and an empty SETTINGS frame
_HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_HTTP2_SETTINGS = 4
_ATTACH_FIX = ("start Ray there first (on that machine: ray start --head --node-ip-address=<its address> "
               "--port=6379) and pass the GCS address `ray start --head` prints (host:6379 by default; not the "
               "dashboard's port 8265, nor the Ray Client's ray://host:10001) as ray_kwargs.address or RAY_ADDRESS")
_FIX_HINT = ("lower trainer.n_gpus_per_node or trainer.nnodes (or the pool's cpus_per_worker), or give Ray "
             "more resources (ray_kwargs.ray_init.num_cpus / num_gpus, or more nodes)")


def import_ray():
    """The `ray` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("the ray executor needs Ray: pip install 'ray[default]>=2.40' (or use the local "
                          "executor)") from err
    return ray


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolve_auto(address: str) -> str:
    """"auto" -> the address Ray would use (RAY_ADDRESS or the last cluster started here), else unchanged."""
    if address != "auto":
        return address
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment("auto", None) or address
    except Exception:
        return address


def _pin_loopback() -> None:
    """Keep Ray on 127.0.0.1 in this process and in every process it starts (see the module docstring).

    Also turns Ray's metrics collection off for a loopback cluster unless `RAY_enable_metrics_collection` is set:
    a cluster on 127.0.0.1 has no dashboard to show them (hyflow starts its own without one), and Ray 2.60's
    OpenTelemetry reader thread crashed a CPU example's driver with SIGSEGV (`TemporalMetricStorage::buildMetrics`,
    once in CI). Export RAY_enable_metrics_collection=1 to keep them.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def ensure_ray(address: str | None = None, *, num_cpus: float | None = None,
               ray_init: dict | None = None) -> bool:
    """Connect this process to Ray; True when it started a new local cluster (stop it with `shutdown_ray`).

    address: "auto" or "host:port" attaches to a running cluster; None attaches to `RAY_ADDRESS` when that
    environment variable is set (as `ray.init()` does: `ray job submit` sets it for its entrypoint, and a driver
    on a node of a `ray start` cluster can export it), else starts a local cluster on 127.0.0.1 (no dashboard,
    usage stats off) with `num_cpus` logical CPUs (Ray's default: the machine's cores; ask for more than the
    cores to fit several fractional-CPU workers); `RAY_ADDRESS=local` also starts one. `ray_init` holds extra
    `ray.init` keyword arguments (verl's `ray_kwargs.ray_init`); an explicit `num_cpus` wins over
    `ray_init["num_cpus"]`. Does nothing and returns False when Ray is already initialised.
    """
    from_env = address is None and os.environ.get("RAY_ADDRESS", "local") not in ("", "local")
    if from_env:
        address = os.environ["RAY_ADDRESS"]
    local_instead = "unset RAY_ADDRESS" if from_env else "leave the address unset"
    options = dict(ray_init or {})
    runtime_env = _runtime_env(options.pop("runtime_env", None))
    if runtime_env:
        options["runtime_env"] = runtime_env
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    sized = sorted(k for k in ("num_cpus", "num_gpus", "resources") if k in options)
    if address is not None and sized:
        raise ValueError(f"{sized} size a local cluster and cannot be set when attaching to the cluster at "
                         f"{address!r}{' (RAY_ADDRESS)' if from_env else ''}; drop them, or {local_instead} to "
                         "start a local cluster")
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address is not None:
        _connect(ray, address, options, local_instead)
        return False
    _start_local(ray, options)
    return True


def starts_local_cluster(address: str | None = None) -> bool:
    """Whether `ensure_ray(address)` would start a local cluster: no address given or in RAY_ADDRESS ("local"
    counts as none), and this process not connected to Ray yet."""
    if address is not None or os.environ.get("RAY_ADDRESS", "local") not in ("", "local"):
        return False
    return not import_ray().is_initialized()


def local_cluster_capacity(ray_init: Mapping[str, Any]) -> tuple[float, float, str, str]:
    """(CPUs, GPUs, where each figure comes from) of the local cluster `ensure_ray(ray_init=ray_init)` would start:
    ray_init's num_cpus / num_gpus, else Ray's own count of this machine's CPUs and torch's of its CUDA devices."""
    cpus, gpus = ray_init.get("num_cpus"), ray_init.get("num_gpus")
    cpu_source, gpu_source = "ray_kwargs.ray_init.num_cpus", "ray_kwargs.ray_init.num_gpus"
    if cpus is None:
        from ray._private.utils import get_num_cpus

        cpus, cpu_source = get_num_cpus(), "this machine's cores, as Ray counts them"
    if gpus is None:
        import torch

        gpus, gpu_source = torch.cuda.device_count(), "CUDA devices"
    return cpus, gpus, cpu_source, gpu_source


def _runtime_env(runtime_env: dict | None) -> dict:
    """verl's `ray_kwargs.ray_init.runtime_env` for ray.init, without its null entries (verl's scripts pass
    `runtime_env.py_executable=null` to mean "this Python"): what remains applies to every worker of the job."""
    if runtime_env is None:
        return {}
    if not isinstance(runtime_env, dict):
        raise ValueError(f"ray_kwargs.ray_init.runtime_env must be a mapping (py_executable, env_vars, "
                         f"working_dir, ...), got {runtime_env!r}")
    return {key: value for key, value in runtime_env.items() if value is not None}


def _connect(ray, address: str, options: dict, local_instead: str) -> None:
    resolved = _resolve_auto(address)
    if _is_loopback(resolved):
        _pin_loopback()
    where = f"{address!r}" if resolved == address else f"{address!r} ({resolved})"
    try:
        _check_gcs(resolved)
    except _NotAGcs as err:
        raise RuntimeError(f"Ray could not connect to the cluster at {where}: {err}. Fix: {_ATTACH_FIX}, or "
                           f"{local_instead} to start a local cluster") from None
    try:
        ray.init(address=address, **options)
    except Exception as err:
        raise RuntimeError(f"Ray could not connect to the cluster at {where}: {type(err).__name__}: "
                           f"{err}; start it first (ray start --head --node-ip-address=127.0.0.1 "
                           f"--port=6379) or {local_instead} to start a local cluster") from err


class _NotAGcs(Exception):
    """What was found at an attach address instead of a Ray GCS."""


def _check_gcs(address: str) -> None:
    """Raise _NotAGcs, within ATTACH_CONNECT_TIMEOUT_S + ATTACH_REPLY_TIMEOUT_S + ATTACH_RPC_TIMEOUT_S seconds,
    saying what answers at "host:port" when it is not a Ray GCS; return when it is one (or the address is not
    "host:port": ray.init judges those). With RAY_USE_TLS the plaintext greeting is skipped."""
    if "://" in address or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    if not port.isdigit():
        return
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=ATTACH_CONNECT_TIMEOUT_S)
    except socket.gaierror as err:
        raise _NotAGcs(f"the host name {host!r} does not resolve ({err})") from None
    except ConnectionRefusedError:
        raise _NotAGcs("nothing listens there (connection refused)") from None
    except TimeoutError:
        raise _NotAGcs(f"no answer to a TCP connection within {ATTACH_CONNECT_TIMEOUT_S:g} s (the host is down, "
                       "or a firewall drops the connection)") from None
    except OSError as err:
        raise _NotAGcs(f"a TCP connection failed: {err}") from None
    with sock:
        if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
            _check_http2(sock)
    _check_gcs_rpc(address)


def _check_http2(sock: socket.socket) -> None:
    """Send the HTTP/2 greeting every gRPC client sends; a gRPC server (Ray's GCS) answers with a SETTINGS frame."""
    sock.settimeout(ATTACH_REPLY_TIMEOUT_S)
    deadline = time.monotonic() + ATTACH_REPLY_TIMEOUT_S
    reply = b""
    try:
        sock.sendall(_HTTP2_GREETING)
        while len(reply) < 9 and time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(256)
            if not chunk:
                break
            reply += chunk
    except TimeoutError:
        pass
    except OSError as err:
        raise _NotAGcs(f"something accepted a TCP connection there, then failed at a gRPC (HTTP/2) greeting "
                       f"({err}): it is not a Ray GCS") from None
    if len(reply) >= 9 and reply[3] == _HTTP2_SETTINGS:
        return
    if not reply:
        ended = "closed the connection" if time.monotonic() < deadline else \
            f"sent nothing back within {ATTACH_REPLY_TIMEOUT_S:g} s"
        raise _NotAGcs(f"something accepts TCP connections there but {ended} at a gRPC (HTTP/2) greeting: it is "
                       "not a Ray GCS")
    hint = " (an HTTP/1 server, such as Ray's dashboard)" if reply.startswith(b"HTTP/") else ""
    raise _NotAGcs(f"something there answered a gRPC (HTTP/2) greeting with {reply[:60]!r}{hint}: it is not a "
                   "Ray GCS")


def _check_gcs_rpc(address: str) -> None:
    """Ask the gRPC server at `address` for the GCS's cluster id (Ray's own channel: TLS and token as ray.init)."""
    try:
        import grpc
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # another Ray layout: ray.init judges the address
        return
    channel = init_grpc_channel(address)
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
            gcs_service_pb2.GetClusterIdRequest(), timeout=ATTACH_RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        code = err.code()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return  # a GCS that wants a token: ray.init brings it, or says it is missing
        if code == grpc.StatusCode.UNIMPLEMENTED:
            raise _NotAGcs("a gRPC server answers there, but not Ray's GCS (it does not serve "
                           "NodeInfoGcsService.GetClusterId)") from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise _NotAGcs(f"a gRPC server answers there but did not answer Ray's GCS request (GetClusterId) within "
                           f"{ATTACH_RPC_TIMEOUT_S:g} s: not a Ray GCS, or one too overloaded to serve") from None
        raise _NotAGcs(f"a gRPC server there failed Ray's GCS request (GetClusterId): {code.name}: "
                       f"{err.details()}") from None
    finally:
        channel.close()


def _load_words() -> tuple[str, bool]:
    """("load average L over the last minute on N cores", whether L >= N)."""
    load, cores = _machine_load()
    if load is None:
        return f"{cores} cores, load average unknown", False
    return f"load average {load:.1f} over the last minute on {cores} cores", load >= cores


def _machine_load() -> tuple[float | None, int]:
    """(1-minute load average or None where unknown, cores this process may use)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        return os.getloadavg()[0], cores
    except (AttributeError, OSError):
        return None, cores


@contextlib.contextmanager
def _env_default(name: str, value: str):
    """Set environment variable `name` to `value` inside the block unless it is set already."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _own_ray_processes() -> set[tuple[int, int]]:
    """(pid, start time) of this process's running children (empty where /proc is missing)."""
    if not os.path.isdir("/proc"):
        return set()
    return {(pid, started) for pid, started, _ in children(os.getpid())}


def _end_failed_start(ray, before: set[tuple[int, int]]) -> None:
    """End what a local start that raised left running: `ray.shutdown()` ends a recorded node; the processes of
    a start that raised inside `ray.init` are recorded nowhere, so the children this process gained since `before`
    that run Ray's programs are ended, with everything their raylet started."""
    if ray.is_initialized():
        ray.shutdown()
    if not os.path.isdir("/proc"):
        return
    ray_dir = os.path.dirname(os.path.abspath(ray.__file__))
    started = [(pid, start) for pid, start, command in children(os.getpid())
               if (pid, start) not in before and ray_dir in command]
    leftovers = list(started)
    for pid, _ in started:
        leftovers += descendants(pid)  # the raylet's agents and workers, listed before it is ended
    end_processes(list(dict.fromkeys(leftovers)))


def _start_failure(err: Exception, attempts: int, timed_out: bool, took_s: float) -> str:
    reason = f"{type(err).__name__}: {err}".rstrip()
    if not timed_out:
        return f"Ray could not start a local cluster: {reason}; free CPUs or set ray_kwargs.ray_init.num_cpus"
    said, overloaded = _load_words()
    if overloaded:
        verdict = (f"This machine is overloaded ({said}): Ray's Python agents did not start in time. Wait for the "
                   "load to drop or stop other jobs on this machine and start the run again")
    else:
        verdict = (f"The machine does not look overloaded ({said}); Ray's logs say why (/tmp/ray/session_latest/"
                   "logs: raylet.out, gcs_server.out, dashboard_agent.log)")
    return (f"Ray could not start a local cluster on {LOOPBACK} ({attempts} attempts, the last after "
            f"{took_s:.0f} s; each attempt's processes were stopped): {reason}. {verdict}; or start Ray yourself "
            f"(ray start --head --node-ip-address={LOOPBACK} --port=6379) and attach with "
            f"ray_kwargs.address={LOOPBACK}:6379")


def _start_local(ray, options: dict) -> None:
    """Start a local cluster on 127.0.0.1; a start that times out is ended and tried once more (START_ATTEMPTS)."""
    global _STARTED_LOCAL
    _pin_loopback()
    _stop_reaper()  # one left by a cluster this process ended with ray.shutdown() instead of shutdown_ray()
    options = {"include_dashboard": False, **options}
    for attempt in range(1, START_ATTEMPTS + 1):
        before = _own_ray_processes()
        began = time.monotonic()
        try:
            with _env_default(_GCS_PORT_WAIT_VAR, str(GCS_PORT_WAIT_S)):
                ray.init(address="local", _node_ip_address=LOOPBACK, **options)
            break
        except Exception as err:
            took_s = time.monotonic() - began
            _end_failed_start(ray, before)
            timed_out = isinstance(err, TimeoutError) or bool(_START_TIMEOUT.search(str(err)))
            if not timed_out or attempt == START_ATTEMPTS:
                raise RuntimeError(_start_failure(err, attempt, timed_out, took_s)) from err
            warnings.warn(f"Ray's local cluster did not start within {took_s:.0f} s ({type(err).__name__}: "
                          f"{str(err).strip()}; {_load_words()[0]}); its processes are stopped, starting it once "
                          "more", RuntimeWarning, stacklevel=3)
    _STARTED_LOCAL = True
    _watch_cluster(ray)


def _watch_cluster(ray) -> None:
    """Have hyflow.controller.ray_reaper end this cluster's leftovers when this process lets go of it."""
    global _REAPER
    if not sys.platform.startswith("linux"):
        return
    try:
        node = ray._private.worker._global_node
        pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
        logs = node.get_logs_dir_path()
    except (AttributeError, TypeError) as err:
        warnings.warn(f"hyflow cannot find the processes of the local cluster ({type(err).__name__}: {err}): if "
                      "this process is killed, the raylet's agents may outlive it by a minute", RuntimeWarning,
                      stacklevel=4)
        return
    starts = {pid: start_time(pid) for pid in pids}
    cluster = {"logs": logs, "driver": os.getpid(),
               "processes": [[pid, start] for pid, start in starts.items() if start is not None]}
    _REAPER = start_reaper(cluster, os.path.join(logs, "hyflow_reaper.log"))
    _register_fork_handler()


def _stop_reaper(wait_s: float = 30.0) -> None:
    """Close the reaper's pipe (it ends what of the cluster still runs, then exits) and wait for it."""
    global _REAPER
    if _REAPER is None:
        return
    proc, write_end = _REAPER
    _REAPER = None
    os.close(write_end)
    with contextlib.suppress(Exception):
        proc.wait(timeout=wait_s)


_FORK_HANDLER = False


def _register_fork_handler() -> None:
    """A forked child must not hold the reaper's pipe open: the reaper would wait for the child too."""
    global _FORK_HANDLER
    if _FORK_HANDLER:
        return

    def close_in_child() -> None:
        global _REAPER
        if _REAPER is not None:
            with contextlib.suppress(OSError):
                os.close(_REAPER[1])
            _REAPER = None

    os.register_at_fork(after_in_child=close_in_child)
    _FORK_HANDLER = True


def shutdown_ray() -> bool:
    """Stop the local cluster `ensure_ray` started (True), or do nothing (False): attached clusters live on."""
    global _STARTED_LOCAL
    if not _STARTED_LOCAL:
        return False
    _STARTED_LOCAL = False
    try:
        import_ray().shutdown()
    finally:
        _stop_reaper()
    return True


def require_ray():
    """The `ray` module, if this process is connected to a cluster; else a RuntimeError saying what to call."""
    ray = import_ray()
    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised in this process; call hyflow.controller.ensure_ray() "
                           "(local cluster on 127.0.0.1) or ensure_ray(address=...) first")
    return ray


@dataclass(frozen=True)
class Slot:
    """Where one rank of a pool runs: its placement group bundle, node and local rank."""

    rank: int
    local_rank: int
    node_index: int
    node_id: str
    node_ip: str
    placement_group: Any
    bundle_index: int


def _ip_key(ip: str) -> tuple:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def _fmt(value: float) -> str:
    return f"{value:g}"


class RayResourcePool:
    """`nnodes` x `devices_per_node` reserved device slots: one STRICT_PACK placement group per node."""

    def __init__(self, nnodes: int = 1, devices_per_node: int = 1, *, use_gpu: bool,
                 cpus_per_worker: float = 1.0, ready_timeout_s: float = 60.0, name: str = "hyflow"):
        """Reserve the bundles and wait until every placement group is placed.

        Raises RuntimeError at once when the cluster's nodes can never hold the pool (too few nodes, or
        no node with `devices_per_node` GPUs / `devices_per_node * cpus_per_worker` CPUs), and after
        `ready_timeout_s` when the resources exist but are held by others; in both cases the error names
        what is missing, and nothing stays reserved.
        """
        if not isinstance(nnodes, int) or nnodes < 1:
            raise ValueError(f"nnodes must be an int >= 1, got {nnodes!r}")
        if not isinstance(devices_per_node, int) or devices_per_node < 1:
            raise ValueError(f"devices_per_node must be an int >= 1, got {devices_per_node!r}")
        if cpus_per_worker < 0 or (cpus_per_worker == 0 and not use_gpu):
            raise ValueError(f"cpus_per_worker must be > 0 on a CPU pool (>= 0 with GPUs), got "
                             f"{cpus_per_worker!r}")
        self.nnodes, self.devices_per_node = nnodes, devices_per_node
        self.use_gpu, self.cpus_per_worker = bool(use_gpu), float(cpus_per_worker)
        self.name = name
        self._owner: object | None = None
        self._ray = require_ray()
        self._check_cluster()
        self._slots: list[Slot] = self._reserve(ready_timeout_s)

    @property
    def world_size(self) -> int:
        """Number of slots (ranks): nnodes * devices_per_node."""
        return self.nnodes * self.devices_per_node

    @property
    def bundle(self) -> dict[str, float]:
        """The resources of one slot."""
        bundle = {"CPU": self.cpus_per_worker} if self.cpus_per_worker else {}
        return {**bundle, "GPU": 1.0} if self.use_gpu else bundle

    @property
    def slots(self) -> list[Slot]:
        """One Slot per rank, in rank order (nodes sorted by IP, then ID); empty after `remove()`."""
        return list(self._slots)

    @property
    def placement_groups(self) -> list:
        """The per-node placement groups, in rank order."""
        return [s.placement_group for s in self._slots if s.local_rank == 0]

    def _need_per_node(self) -> dict[str, float]:
        return {res: amount * self.devices_per_node for res, amount in self.bundle.items()}

    def _describe_need(self) -> str:
        per_node = ", ".join(f"{_fmt(v)} {k}s" for k, v in self._need_per_node().items())
        return (f"{per_node} on each of {self.nnodes} node(s) ({self.nnodes} x {self.devices_per_node} "
                f"workers of {self.bundle})")

    def _check_cluster(self) -> None:
        nodes = [n for n in self._ray.nodes() if n.get("Alive")]
        need = self._need_per_node()
        fitting = [n for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())]
        if len(fitting) >= self.nnodes:
            return
        totals = {k: sum(n["Resources"].get(k, 0.0) for n in nodes) for k in ("CPU", "GPU")}
        largest = {k: max((n["Resources"].get(k, 0.0) for n in nodes), default=0.0) for k in ("CPU", "GPU")}
        raise RuntimeError(
            f"the cluster has {_fmt(totals['CPU'])} CPUs/{_fmt(totals['GPU'])} GPUs on {len(nodes)} node(s) "
            f"(largest node: {_fmt(largest['CPU'])} CPUs/{_fmt(largest['GPU'])} GPUs), the worker groups "
            f"need {self._describe_need()}, and only {len(fitting)} node(s) can hold that: {_FIX_HINT}")

    def _reserve(self, ready_timeout_s: float) -> list[Slot]:
        from ray.util import placement_group, remove_placement_group

        groups = [placement_group([self.bundle] * self.devices_per_node, strategy="STRICT_PACK",
                                  name=f"{self.name}_pg{i}_{os.getpid()}_{id(self):x}")
                  for i in range(self.nnodes)]
        ready, _ = self._ray.wait([g.ready() for g in groups], num_returns=len(groups),
                                  timeout=ready_timeout_s)
        if len(ready) < len(groups):
            available = self._ray.available_resources()
            for group in groups:
                remove_placement_group(group)
            have = ", ".join(f"{_fmt(available.get(k, 0.0))} {k}s" for k in ("CPU", "GPU"))
            raise RuntimeError(
                f"only {len(ready)} of {len(groups)} placement groups were placed within {ready_timeout_s:g} "
                f"s: the worker groups need {self._describe_need()}, the cluster has {have} free now "
                f"(others hold the rest: other worker groups or jobs). Shut those down, raise "
                f"ready_timeout_s to wait for them, or {_FIX_HINT}")
        return self._assign_ranks(groups)

    def _assign_ranks(self, groups: list) -> list[Slot]:
        from ray.util import placement_group_table

        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in self._ray.nodes()}
        located = []
        for group in groups:
            node_id = placement_group_table(group)["bundles_to_node_id"][0]
            located.append((_ip_key(node_ips.get(node_id, "")), node_id, node_ips.get(node_id, ""), group))
        located.sort(key=lambda item: item[:2])
        return [Slot(rank=node_index * self.devices_per_node + local_rank, local_rank=local_rank,
                     node_index=node_index, node_id=node_id, node_ip=node_ip, placement_group=group,
                     bundle_index=local_rank)
                for node_index, (_, node_id, node_ip, group) in enumerate(located)
                for local_rank in range(self.devices_per_node)]

    def acquire(self, owner: object) -> None:
        """Mark the pool as used by `owner` (a worker group): each slot hosts one worker process."""
        if not self._slots:
            raise RuntimeError(f"{self!r} was removed; create a new pool")
        if self._owner is not None and self._owner is not owner:
            raise RuntimeError(f"{self!r} already hosts {self._owner!r}: each slot holds one worker process. "
                               "Put several roles in one process (make_colocated_class) or give the second "
                               "group its own pool")
        self._owner = owner

    def release(self, owner: object) -> None:
        """Free the pool for another group (called by the owner's shutdown)."""
        if self._owner is owner:
            self._owner = None

    def remove(self) -> None:
        """Remove the placement groups (the resources return to the cluster). Idempotent."""
        if not self._slots:
            return
        from ray.util import remove_placement_group

        groups, self._slots, self._owner = self.placement_groups, [], None
        if self._ray.is_initialized():
            for group in groups:
                remove_placement_group(group)

    def __enter__(self) -> RayResourcePool:
        """`with RayResourcePool(...) as pool:` removes the pool on exit."""
        return self

    def __exit__(self, *exc) -> None:
        """Remove the placement groups."""
        self.remove()

    def __repr__(self) -> str:
        """`RayResourcePool(nnodes=.., devices_per_node=.., bundle={...})`."""
        return (f"RayResourcePool(nnodes={self.nnodes}, devices_per_node={self.devices_per_node}, "
                f"bundle={self.bundle})")
