"""The ray executor on one local 4-logical-CPU Ray cluster (127.0.0.1 only): dispatch results equal the local
executor's, ranks see their placement and form a gloo group, failures (exception, killed process, timeout,
constructor error) surface promptly as WorkerError naming the rank, pools fail fast when the cluster is too
small, and a driver attaches to a separately started cluster."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from hyflow.batch import Batch
from hyflow.controller import (
    Collect,
    Dispatch,
    LocalWorkerGroup,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
    ensure_ray,
    free_port,
    make_worker_group,
    register,
    shutdown_ray,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CPUS_PER_WORKER = 0.25


class Probe(Worker):
    """A worker whose methods expose what the executor did: row-wise math, placement, collectives, failures."""

    def __init__(self, scale: float = 2.0, fail_init: bool = False):
        super().__init__()
        if fail_init:
            raise RuntimeError(f"cannot build rank {self.rank}")
        self.scale = scale

    @register(Dispatch.DP_SPLIT)
    def forward(self, batch: Batch) -> Batch:
        return Batch({"y": batch["x"] * self.scale}, {"uid": batch["uid"]},
                     meta={"metrics": {"rows": len(batch), "rank": self.rank}})

    @register(Dispatch.REPLICATE)
    def rows_seen(self, batch: Batch, tag: str) -> tuple:
        return (tag, self.rank, self.world_size, len(batch), float(batch["x"].sum()))

    @register(Dispatch.RANK_ZERO)
    def save(self, path: str) -> str:
        return f"{path}@{self.rank}"

    @register(Dispatch.DIRECT, Collect.CONCAT)
    def offsets(self, start: int) -> list:
        return [start + self.rank]

    @register(Dispatch.REPLICATE)
    def environment(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HYFLOW_TEST_ENV",
                "CUDA_VISIBLE_DEVICES")
        return {"pid": os.getpid(), "rank": self.rank, "world_size": self.world_size,
                **{k: os.environ.get(k) for k in keys}}

    @register(Dispatch.REPLICATE)
    def all_reduce_rank(self) -> tuple:
        import torch.distributed as dist

        self.init_process_group("gloo", timeout_s=60)
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total)
        return dist.get_rank(), dist.get_world_size(), total.item()

    @register(Dispatch.REPLICATE)
    def explode(self) -> int:
        if self.rank == 1:
            raise ValueError(f"rank {self.rank} refuses")
        return self.rank

    @register(Dispatch.REPLICATE)
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def make_batch(n: int) -> Batch:
    return Batch({"x": torch.arange(n, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(n)]})


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module: 4 logical CPUs so fractional-CPU actors fit on 2 cores, and 2
    logical GPUs (Ray schedules them without any hardware) to exercise GPU pools on a CPU machine.

    pytest imports this file from a directory Ray does not put on its workers' path, so `Probe` travels by
    value (a worker class in an installed package or the driver script's directory needs nothing)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = ensure_ray(num_cpus=4, ray_init={"num_gpus": 2, "log_to_driver": False})
    yield
    if started:
        shutdown_ray()


@pytest.fixture(scope="module")
def group(cluster):
    """A 2-rank group shared by the read-only tests."""
    pool = RayResourcePool(1, 2, use_gpu=False, cpus_per_worker=CPUS_PER_WORKER)
    group = RayWorkerGroup(Probe, pool=pool, env={"HYFLOW_TEST_ENV": "yes"}, scale=3.0)
    yield group
    group.shutdown()
    pool.remove()


def test_dispatch_results_equal_local_executor(group):
    local = LocalWorkerGroup(Probe, world_size=2, scale=3.0)
    batch = make_batch(5)  # 5 rows on 2 ranks: one padding row, dropped on collect
    remote_out, local_out = group.forward(batch), local.forward(batch)
    assert torch.equal(remote_out["y"], local_out["y"])
    assert torch.equal(remote_out["y"], batch["x"] * 3.0)
    assert list(remote_out.non_tensors["uid"]) == [f"u{i}" for i in range(5)]
    assert remote_out.meta["metrics"] == local_out.meta["metrics"]
    assert group.rows_seen(batch, "t") == local.rows_seen(batch, "t") == [("t", 0, 2, 5, 10.0),
                                                                           ("t", 1, 2, 5, 10.0)]
    assert group.save("ckpt") == local.save("ckpt") == "ckpt@0"
    assert group.offsets([10, 20]) == local.offsets([10, 20]) == [10, 21]


def test_each_rank_runs_in_its_own_process_with_its_placement_in_the_environment(group):
    envs = group.environment()
    pids = group.worker_pids()
    assert [e["pid"] for e in envs] == pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for rank, env in enumerate(envs):
        assert (env["rank"], env["world_size"]) == (rank, 2)
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == str(group.master_port)
        assert env["HYFLOW_TEST_ENV"] == "yes"


def test_cluster_listens_on_loopback_only(group):
    """Every process of the cluster (GCS, raylet, agents, workers) listens on 127.0.0.1. Runs before the
    gloo test: torch's TCPStore server (rank 0, MASTER_PORT) listens on all interfaces unless
    Worker.init_process_group hands it a loopback socket (master_listen_fd)."""
    psutil = pytest.importorskip("psutil")
    listening = []
    for proc in psutil.Process().children(recursive=True):
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(proc.name(), c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening, "expected the cluster's processes to listen somewhere"
    off_loopback = [(name, ip) for name, ip in listening if ip not in ("127.0.0.1", "::ffff:127.0.0.1")]
    assert not off_loopback


def test_ranks_form_a_gloo_group_and_all_reduce(group):
    assert group.all_reduce_rank() == [(0, 2, 3.0), (1, 2, 3.0)]


def test_exception_on_one_rank_names_rank_method_and_remote_traceback(group):
    with pytest.raises(WorkerError, match=r"rank 1 \(Probe\.explode\) raised ValueError: rank 1 refuses") as info:
        group.explode()
    assert info.value.rank == 1 and info.value.method == "explode"
    assert "Traceback" in info.value.detail and "test_ray_group.py" in info.value.detail
    assert isinstance(info.value.__cause__, ValueError)
    assert group.save("still-usable") == "still-usable@0"


def test_gpu_pool_gives_each_rank_one_device(cluster):
    with RayResourcePool(1, 2, use_gpu=True, cpus_per_worker=CPUS_PER_WORKER) as pool, \
            RayWorkerGroup(Probe, pool=pool) as group:
        assert pool.bundle == {"CPU": CPUS_PER_WORKER, "GPU": 1.0}
        envs = group.environment()
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
        assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0", "1"]
    with pytest.raises(RuntimeError, match="the group was shut down; create a new one"):
        group.save("x")


def test_killed_worker_process_raises_promptly_naming_the_rank(cluster):
    with RayResourcePool(1, 2, use_gpu=False, cpus_per_worker=CPUS_PER_WORKER) as pool, \
            RayWorkerGroup(Probe, pool=pool) as group:
        victim = group.worker_pids()[1]
        killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
        start = time.monotonic()
        killer.start()
        try:
            with pytest.raises(WorkerDiedError, match=rf"rank 1 \(Probe\.nap\): the worker process \(pid "
                                                      rf"{victim}, node 127.0.0.1\) died"):
                group.nap(45)
        finally:
            killer.cancel()
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="rank 1's worker process died; shut the group down"):
            group.save("x")


def test_call_past_timeout_raises_and_the_group_refuses_further_calls(cluster):
    with RayResourcePool(1, 1, use_gpu=False, cpus_per_worker=CPUS_PER_WORKER) as pool, \
            RayWorkerGroup(Probe, pool=pool, timeout_s=120) as group:
        group.timeout_s = 1.0
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=r"rank 0 \(Probe\.nap\) did not finish within "
                                                     r"timeout_s=1 s \(ranks still running: \[0\]\)"):
            group.nap(30)
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="timed out on ranks"):
            group.save("x")


def test_constructor_error_is_a_worker_error_and_releases_the_pool(cluster):
    with RayResourcePool(1, 1, use_gpu=False, cpus_per_worker=CPUS_PER_WORKER) as pool:
        with pytest.raises(WorkerError, match=r"rank 0 \(Probe\.__init__\) raised RuntimeError: cannot "
                                              r"build rank 0"):
            make_worker_group("ray", Probe, world_size=1, pool=pool, fail_init=True)
        pool.acquire("next group")  # the failed group let go of it


def test_insufficient_resources_fail_fast_with_the_missing_resources(cluster):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the cluster has 4 CPUs/2 GPUs on 1 node\(s\).*the worker groups "
                                           r"need 1.5 CPUs, 3 GPUs on each of 1 node\(s\).*lower "
                                           r"trainer.n_gpus_per_node"):
        RayResourcePool(1, 3, use_gpu=True, cpus_per_worker=0.5)
    with pytest.raises(RuntimeError, match=r"need 0.5 CPUs on each of 2 node\(s\).*only 1 node\(s\) can hold"):
        RayResourcePool(2, 2, use_gpu=False, cpus_per_worker=CPUS_PER_WORKER)
    assert time.monotonic() - start < 5
    with RayResourcePool(1, 1, use_gpu=False, cpus_per_worker=2.5, ready_timeout_s=30), \
            pytest.raises(RuntimeError, match=r"only 0 of 1 placement groups were placed within 1 s: the "
                                              r"worker groups need 2 CPUs.*Shut those down"):
        RayResourcePool(1, 1, use_gpu=False, cpus_per_worker=2.0, ready_timeout_s=1)


def test_argument_errors(cluster):
    with pytest.raises(ValueError, match="needs world_size=N, or a RayResourcePool"):
        RayWorkerGroup(Probe)
    with pytest.raises(ValueError, match=r"env sets \['RANK'\], which the ray executor sets"):
        make_worker_group("ray", Probe, world_size=1, env={"RANK": "3"})
    with pytest.raises(TypeError, match=r"env must map str to str .*fix 'OMP_NUM_THREADS'"):
        RayWorkerGroup(Probe, world_size=1, env={"OMP_NUM_THREADS": 2})
    with pytest.raises(ValueError, match=r"\['pool', 'env'\] are options of the ray executor"):
        make_worker_group("local", Probe, world_size=1, pool=object(), env={})
    with pytest.raises(ValueError, match=r"unknown executor 'mpi'; valid: \['local', 'ray'\]"):
        make_worker_group("mpi", Probe, world_size=1)
    with pytest.raises(ValueError, match="size a local cluster and cannot be set when attaching"):
        ensure_ray(address="127.0.0.1:1", num_cpus=2)
    assert isinstance(make_worker_group("local", Probe, world_size=2), LocalWorkerGroup)
    assert ensure_ray(num_cpus=4) is False  # already connected: nothing started


def test_the_attach_check_takes_this_clusters_gcs_for_one(cluster):
    """ensure_ray(address=...) checks the address before ray.init (tests/controller/test_ray_start.py: what is not
    a GCS); the GCS of a real cluster (token authentication as Ray's default sets it) passes, in well under its
    limits."""
    import ray

    from hyflow.controller import resources

    start = time.monotonic()
    resources._check_gcs(ray._private.worker.global_worker.node.gcs_address)
    assert time.monotonic() - start < resources.ATTACH_RPC_TIMEOUT_S


ATTACH_DRIVER = textwrap.dedent("""
    import sys, torch
    from hyflow.batch import Batch
    from hyflow.controller import (Dispatch, RayResourcePool, Worker, ensure_ray, free_port, make_worker_group,
                                   register)

    def expect_error(call, message):
        try:
            call()
        except RuntimeError as err:
            assert message in str(err), err
        else:
            raise AssertionError(f"expected an error saying {message!r}")

    expect_error(lambda: RayResourcePool(1, 1, use_gpu=False), "call hyflow.controller.ensure_ray()")
    expect_error(lambda: ensure_ray(ray_init={"bogus": 1}), "Ray could not start a local cluster: RuntimeError")
    expect_error(lambda: ensure_ray(address=f"127.0.0.1:{free_port()}"),
                 "Ray could not connect to the cluster at '127.0.0.1:")

    class Doubler(Worker):
        @register(Dispatch.DP_SPLIT)
        def double(self, batch):
            return Batch({"y": batch["x"] * 2})

    assert ensure_ray(address=sys.argv[1]) is False
    import glob, os, ray
    # a loopback cluster: the driver's metrics collection is off (Ray 2.60's OpenTelemetry reader thread crashed a
    # run with SIGSEGV); the core worker says so in its log
    assert os.environ["RAY_enable_metrics_collection"] == "0"
    logs = glob.glob(f"{ray._private.worker.global_worker.node.get_logs_dir_path()}/python-core-driver-*_{os.getpid()}.log")
    assert logs and any("Disabled stats." in open(f).read() for f in logs), logs
    pool = RayResourcePool(1, 2, use_gpu=False, cpus_per_worker=0.5)
    group = make_worker_group("ray", Doubler, world_size=2, pool=pool)
    out = group.double(Batch({"x": torch.arange(4.0)}))
    group.shutdown()
    pool.remove()
    print("RESULT", out["y"].tolist())
""")


def _wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"`ray start` exited with {process.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the Ray head did not listen on port {port} within {timeout_s} s")


def test_attach_to_a_separately_started_cluster(tmp_path):
    """`ray start --head --block` in its own session; stopped by SIGTERM to that process alone (not `ray stop`,
    which would stop every Ray cluster of this user), so the module's cluster is untouched."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled"}  # a throwaway loopback cluster: no token auth for head or driver
    env.pop("RAY_enable_metrics_collection", None)  # hyflow's driver turns it off itself (tests/conftest.py sets it)
    port = free_port()
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_port(port, head)
        driver = subprocess.run([sys.executable, "-c", ATTACH_DRIVER, f"127.0.0.1:{port}"], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert driver.returncode == 0, driver.stderr[-3000:]
        assert "RESULT [0.0, 2.0, 4.0, 6.0]" in driver.stdout
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
