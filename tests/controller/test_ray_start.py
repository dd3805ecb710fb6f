"""Ray start and attach that fail fast and clean up (hyflow.controller.resources, hyflow.controller.ray_reaper).

- Attaching to an address where no Ray GCS listens fails in seconds (ray.init alone retries about ten minutes),
  naming the address, what answered there and how to start Ray: nothing listening, a server that says nothing,
  one that hangs up, one that answers HTTP/1 garbage, a gRPC server that is not a GCS.
- A local start that times out is ended (its processes, which ray.init recorded nowhere) and tried once more;
  a second timeout fails with the machine's load and cores.
- The processes of a local cluster end within seconds when its driver is killed with SIGKILL (Ray leaves the
  raylet's two agents running for a minute), and a normal `shutdown_ray` leaves nothing running either.

The fast tests start no Ray cluster; the slow ones start one each (in a subprocess driver, or in this process
after the attempt that is made to fail), and end only processes they started, by pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from pathlib import Path

import pytest

from hyflow.controller import ensure_ray, ray_reaper, resources, shutdown_ray

REPO = Path(__file__).resolve().parents[2]
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
ATTACH_LIMIT_S = 60
START_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed "
                 "to startup or the GCS has become overloaded.")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


@pytest.fixture
def ray_module():
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized(), "a test before this one left Ray initialised in the test process"
    return ray


@pytest.fixture
def tcp_server():
    """`start(handle)`: a loopback TCP server calling handle(conn) per connection; returns "127.0.0.1:port"."""
    servers, conns = [], []

    def start(handle) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)

        def accept():
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                conns.append(conn)
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"127.0.0.1:{server.getsockname()[1]}"

    yield start
    for sock in servers + conns:
        sock.close()


def _read_then(reply: bytes | None):
    def handle(conn):
        try:
            conn.recv(4096)
            if reply is None:
                conn.close()
            else:
                conn.sendall(reply)
        except OSError:
            pass
    return handle


def _attach_error(address: str) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ensure_ray(address=address)
    took = time.monotonic() - start
    message = str(info.value)
    assert f"Ray could not connect to the cluster at '{address}'" in message, message
    assert "ray start --head" in message and "leave the address unset to start a local cluster" in message, message
    assert took < ATTACH_LIMIT_S, f"took {took:.0f} s: {message}"
    return message, took


def test_attach_where_nothing_listens(ray_module):
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    message, _ = _attach_error(f"127.0.0.1:{port}")
    assert "nothing listens there (connection refused)" in message


def test_attach_to_a_server_answering_http_garbage(ray_module, tcp_server):
    address = tcp_server(_read_then(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"))
    message, took = _attach_error(address)
    assert "answered a gRPC (HTTP/2) greeting with b'HTTP/1.1 400 Bad Request" in message, message
    assert "an HTTP/1 server, such as Ray's dashboard" in message and "it is not a Ray GCS" in message
    assert took < 10


def test_attach_to_a_server_that_hangs_up(ray_module, tcp_server):
    message, took = _attach_error(tcp_server(_read_then(None)))
    assert "accepts TCP connections there but closed the connection at a gRPC (HTTP/2) greeting" in message
    assert took < 10


def test_attach_to_a_grpc_server_that_is_not_a_gcs(ray_module):
    grpc = pytest.importorskip("grpc")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        message, took = _attach_error(f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    assert "a gRPC server answers there, but not Ray's GCS" in message, message
    assert took < 20


@pytest.mark.slow
def test_attach_to_a_silent_server_fails_within_a_minute(ray_module, tcp_server):
    """The issue's case: something accepts the connection and says nothing; ray.init retried for 11.6 minutes."""
    message, took = _attach_error(tcp_server(lambda conn: None))
    assert (f"something accepts TCP connections there but sent nothing back within "
            f"{resources.ATTACH_REPLY_TIMEOUT_S:g} s at a gRPC (HTTP/2) greeting: it is not a Ray GCS") in message
    print(f"silent server: failed after {took:.1f} s")


# ------------------------------------------------------------------------------------------- local start retry


@pytest.fixture
def fake_start(ray_module, monkeypatch):
    """ray.init replaced by `outcomes` (an exception to raise, or None to succeed), in order; records each call
    and each cleanup of a failed attempt."""
    calls = []
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    monkeypatch.setattr(resources, "_watch_cluster", lambda ray: calls.append("reaper"))
    real_cleanup = resources._end_failed_start
    monkeypatch.setattr(resources, "_end_failed_start",
                        lambda ray, before: (calls.append("cleanup"), real_cleanup(ray, before)))

    def install(*outcomes):
        pending = list(outcomes)

        def init(**kwargs):
            assert kwargs["address"] == "local" and kwargs["_node_ip_address"] == "127.0.0.1"
            calls.append(("init", os.environ.get(resources._GCS_PORT_WAIT_VAR)))
            outcome = pending.pop(0)
            if outcome is not None:
                raise outcome

        monkeypatch.setattr(ray_module, "init", init)
        return calls

    yield install
    resources._STARTED_LOCAL = False


def test_a_start_that_times_out_is_cleaned_up_and_tried_once_more(fake_start, monkeypatch):
    calls = fake_start(Exception(START_TIMEOUT), None)
    with pytest.warns(RuntimeWarning, match=r"did not start within \d+ s \(Exception: The current node timed out "
                                            r"during startup.*its processes are stopped, starting it once more"):
        assert ensure_ray(num_cpus=1) is True
    assert calls == [("init", "120"), "cleanup", ("init", "120"), "reaper"]
    assert "RAY_gcs_server_port_wait_time_s" not in os.environ  # raised for the start only


@pytest.mark.parametrize("load, verdict", [
    (11.3, "This machine is overloaded (load average 11.3 over the last minute on 2 cores): Ray's Python agents "
           "did not start in time. Wait for the load to drop or stop other jobs on this machine"),
    (0.4, "The machine does not look overloaded (load average 0.4 over the last minute on 2 cores); Ray's logs "
          "say why"),
])
def test_a_second_start_timeout_names_the_load_and_cores(fake_start, monkeypatch, load, verdict):
    calls = fake_start(Exception(START_TIMEOUT), TimeoutError("Timed out waiting for file gcs_server_port"))
    monkeypatch.setattr(resources, "_machine_load", lambda: (load, 2))
    with pytest.warns(RuntimeWarning, match="starting it once more"), pytest.raises(RuntimeError) as info:
        ensure_ray(num_cpus=1)
    message = str(info.value)
    assert message.startswith("Ray could not start a local cluster on 127.0.0.1 (2 attempts, the last after "), message
    assert "each attempt's processes were stopped): TimeoutError: Timed out waiting for file" in message, message
    assert verdict in message, message
    assert "ray start --head --node-ip-address=127.0.0.1 --port=6379" in message
    assert calls == [("init", "120"), "cleanup", ("init", "120"), "cleanup"]
    assert not resources._STARTED_LOCAL


def test_a_start_error_that_is_no_timeout_is_not_retried(fake_start, monkeypatch):
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "45")  # the user's own value wins
    calls = fake_start(RuntimeError("Unknown keyword argument(s): bogus"))
    with pytest.raises(RuntimeError, match=r"^Ray could not start a local cluster: RuntimeError: Unknown keyword "
                                           r"argument\(s\): bogus; free CPUs"):
        ensure_ray(ray_init={"bogus": 1})
    assert calls == [("init", "45"), "cleanup"]


# ------------------------------------------------------------------------------------------------ the reaper


def _sleeper(ignore_term: bool = False, opens: tuple[str, str] | None = None) -> subprocess.Popen:
    code = ("import signal, sys, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + (f"held = open({opens[0]!r}, {opens[1]!r})\n" if opens else "")
            + "print('ready', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def sleepers():
    started = []

    def start(**kwargs) -> subprocess.Popen:
        started.append(_sleeper(**kwargs))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@linux_only
def test_end_processes_escalates_to_sigkill_and_spares_a_reused_pid(sleepers):
    stubborn = sleepers(ignore_term=True)  # written to survive the polite signal
    bystander = sleepers()
    started = ray_reaper.start_time(stubborn.pid)
    # the bystander's pid with another start time: what a recycled pid looks like
    ended = ray_reaper.end_processes([(stubborn.pid, started),
                                      (bystander.pid, ray_reaper.start_time(bystander.pid) - 1)], grace_s=1.0)
    assert ended == [stubborn.pid]
    assert stubborn.wait(10) == -signal.SIGKILL
    assert bystander.poll() is None


@linux_only
def test_the_cluster_is_the_writers_of_its_raylet_log(sleepers, tmp_path):
    """The raylet's agents and workers inherit its log open for writing; a reader of the log (tail -f), a writer
    of another file and the excluded driver are not the cluster."""
    logs = tmp_path / "session_x" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text("")
    (logs / "raylet.err").write_text("")
    agent = sleepers(opens=(str(logs / "raylet.out"), "a"))
    worker = sleepers(opens=(str(logs / "raylet.err"), "w"))
    reader = sleepers(opens=(str(logs / "raylet.out"), "r"))
    other = sleepers(opens=(str(logs / "dashboard_agent.log"), "a"))
    driver = sleepers(opens=(str(logs / "raylet.out"), "a"))
    found = ray_reaper.raylet_log_writers(str(logs), exclude=(driver.pid,))
    assert sorted(found) == sorted((proc.pid, ray_reaper.start_time(proc.pid)) for proc in (agent, worker))
    assert reader.poll() is None and other.poll() is None


@linux_only
def test_a_forked_child_does_not_hold_the_reapers_pipe_open(monkeypatch):
    """A child forked from the driver (multiprocessing's fork, a DataLoader worker) closes its copy of the pipe's
    write end: the reaper sees the driver let go even while the child lives."""
    import select

    read_end, write_end = os.pipe()
    monkeypatch.setattr(resources, "_REAPER", (None, write_end))
    resources._register_fork_handler()
    child = os.fork()
    if child == 0:  # the child outlives the driver's close by 30 s
        time.sleep(30)
        os._exit(0)
    try:
        resources._REAPER = None
        os.close(write_end)
        ready, _, _ = select.select([read_end], [], [], 10)
        assert ready and os.read(read_end, 1) == b"", "the forked child still holds the write end"
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(read_end)


# --------------------------------------------------------------------------------------- with a real cluster

KILLED_DRIVER = textwrap.dedent("""
    import json, os, time
    import psutil
    import ray
    from hyflow.controller import ensure_ray

    assert ensure_ray(num_cpus=2, ray_init={"log_to_driver": False}) is True

    @ray.remote(num_cpus=0.5)
    class Napper:
        def pid(self):
            return os.getpid()

        def nap(self):
            time.sleep(600)

    napper = Napper.remote()
    actor_pid = ray.get(napper.pid.remote())
    napper.nap.remote()
    node = ray._private.worker._global_node
    tree = [{"pid": p.pid, "ppid": p.ppid(), "start": p.create_time(), "name": p.name(),
             "cmd": " ".join(p.cmdline())[:200]} for p in psutil.Process().children(recursive=True)]
    print(json.dumps({"session": node.get_session_dir_path(), "actor": actor_pid, "tree": tree}), flush=True)
    time.sleep(600)
""")


def _running(entry: dict) -> bool:
    psutil = pytest.importorskip("psutil")
    try:
        proc = psutil.Process(entry["pid"])
        return proc.create_time() == entry["start"] and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@linux_only
def test_a_killed_driver_leaves_no_process_of_its_cluster(tmp_path):
    """SIGKILL to a driver that started a local cluster (and runs an actor): within a bounded time no process it
    started remains (without hyflow's reaper the raylet's DashboardAgent and RuntimeEnvAgent live 60 s more)."""
    psutil = pytest.importorskip("psutil")
    with open(tmp_path / "driver.err", "w") as err:  # the driver keeps its own copy of the file
        driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER], cwd=REPO, env={**os.environ, **RAY_ENV},
                                  stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    tree = []
    try:
        line = driver.stdout.readline()
        assert line, (tmp_path / "driver.err").read_text()[-3000:]
        info = json.loads(line)
        tree = info["tree"]
        names = " ".join(entry["name"] + " " + entry["cmd"] for entry in tree)
        for part in ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray_reaper.py"):
            assert part in names, (part, tree)
        assert info["actor"] in [entry["pid"] for entry in tree]
        killed_at = time.monotonic()
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(30)
        deadline = killed_at + 40
        while time.monotonic() < deadline and any(_running(entry) for entry in tree):
            time.sleep(0.5)
        left = [(entry["pid"], entry["cmd"] or entry["name"]) for entry in tree if _running(entry)]
        assert not left, f"{len(left)} processes of the killed driver's cluster still run 40 s later: {left}"
        in_session = [proc.pid for proc in psutil.process_iter(["cmdline"])
                      if info["session"] in " ".join(proc.info["cmdline"] or [])]
        assert not in_session, in_session
        print(f"cluster of {len(tree)} processes gone {time.monotonic() - killed_at:.1f} s after SIGKILL")
        log = Path(info["session"]) / "logs" / "hyflow_reaper.log"
        assert f"hyflow ray_reaper: the driver (pid {driver.pid}) let go of the cluster" in log.read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        for entry in tree:  # only what this test's driver started, by pid
            if _running(entry):
                os.kill(entry["pid"], signal.SIGKILL)


@pytest.mark.slow
@linux_only
def test_a_timed_out_start_is_ended_before_the_retry_and_shutdown_leaves_nothing(ray_module, monkeypatch):
    """The first attempt really starts the GCS, raylet and the rest, then raises Ray's startup timeout (as
    node.py does after 30 s): ray.init records none of them, ensure_ray ends them, and the second attempt
    starts the cluster. shutdown_ray then leaves no process of the second cluster either."""
    from ray._private import node as ray_node

    first: dict = {}
    real_start = ray_node.Node.start_ray_processes

    def start_then_time_out(self):
        real_start(self)
        if not first:
            time.sleep(1.0)  # let the raylet start its agents
            first.update({pid: ray_reaper.start_time(pid) for infos in self.all_processes.values()
                          for pid in (info.process.pid for info in infos)})
            raylet = self.all_processes["raylet"][0].process.pid
            first.update(dict(ray_reaper.descendants(raylet)))  # its agents
            raise Exception(START_TIMEOUT)

    monkeypatch.setattr(ray_node.Node, "start_ray_processes", start_then_time_out)
    with pytest.warns(RuntimeWarning, match="starting it once more"):
        started = ensure_ray(num_cpus=1, ray_init={"log_to_driver": False})
    second: dict = {}
    try:
        assert started is True and ray_module.is_initialized()
        assert len(first) >= 4, first
        left = {pid for pid, start in first.items() if ray_reaper.start_time(pid) == start}
        assert not left, f"the failed attempt's processes {sorted(left)} still run"
        assert ray_module.get(ray_module.put(7)) == 7
        infos = ray_module._private.worker._global_node.all_processes
        second = {info.process.pid: ray_reaper.start_time(info.process.pid) for group in infos.values()
                  for info in group}
        second.update(dict(ray_reaper.descendants(infos["raylet"][0].process.pid)))
    finally:
        assert shutdown_ray()
    left = {pid for pid, start in second.items() if ray_reaper.start_time(pid) == start}
    assert not left, f"shutdown_ray left {sorted(left)} running"
