"""hyflow.threads: the torch thread count of a process (the user's setting, else usable cores / workers on the
node), the cgroup quota, the environment handed to Ray workers, and OMP_WAIT_POLICY set before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hyflow import threads
from hyflow.controller import (
    Dispatch,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    ensure_ray,
    register,
    shutdown_ray,
)


def test_the_users_setting_wins():
    assert threads.choose_threads(4, environ={"OMP_NUM_THREADS": "3"}, cores=16).threads == 3
    choice = threads.choose_threads(4, environ={"HYFLOW_NUM_THREADS": "2", "OMP_NUM_THREADS": "3"}, cores=16)
    assert (choice.threads, choice.reason) == (2, "HYFLOW_NUM_THREADS=2")
    assert threads.choose_threads(1, environ={"OMP_NUM_THREADS": "4,2"}, cores=16).threads == 4  # nested: outer


def test_usable_cores_shared_by_the_workers_on_the_node():
    choice = threads.choose_threads(2, environ={}, cores=2)
    assert choice.threads == 1
    assert choice.line("x") == "torch threads: 1 (2 cores, 2 workers on this node; OMP_NUM_THREADS unset; x)"
    assert threads.choose_threads(1, environ={}, cores=2).threads == 2
    assert threads.choose_threads(3, environ={}, cores=2).threads == 1  # at least one
    assert threads.choose_threads(4, environ={}, cores=16).threads == 4


def test_a_ray_worker_ignores_rays_own_omp_num_threads():
    env = {"OMP_NUM_THREADS": "1"}  # what Ray puts into an actor with num_cpus=1
    choice = threads.choose_threads(1, environ=env, cores=8, read_omp_num_threads=False)
    assert choice.threads == 8 and "HYFLOW_NUM_THREADS unset on the driver" in choice.reason


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS='zero': set a whole number of threads >= 1"):
        threads.choose_threads(1, environ={"OMP_NUM_THREADS": "zero"}, cores=2)
    with pytest.raises(ValueError, match=r"HYFLOW_NUM_THREADS='0'"):
        threads.choose_threads(1, environ={"HYFLOW_NUM_THREADS": "0"}, cores=2)


def test_cgroup_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 1.5
    assert threads.usable_cores(limit=1.5) == 1
    assert threads.usable_cores(limit=0.2) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(v1) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpu_limit(v1) is None
    assert threads.cgroup_cpu_limit(tmp_path / "none") is None
    assert 1 <= threads.usable_cores() <= (os.cpu_count() or 1)


def test_worker_environment_carries_the_drivers_setting():
    assert threads.worker_thread_env(2, environ={}) == {"HYFLOW_WORKERS_PER_NODE": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    env = threads.worker_thread_env(2, environ={"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"})
    assert env == {"HYFLOW_WORKERS_PER_NODE": "2", "OMP_WAIT_POLICY": "ACTIVE", "HYFLOW_NUM_THREADS": "3"}


def test_configure_applies_and_prints_and_keeps_a_programs_own_count(monkeypatch, capsys):
    before = torch.get_num_threads()
    monkeypatch.delenv("HYFLOW_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        assert threads.configure_threads(8).threads == 1 and torch.get_num_threads() == 1
        assert capsys.readouterr().out.startswith("torch threads: 1 (OMP_NUM_THREADS=1; ")
        monkeypatch.delenv("OMP_NUM_THREADS")
        cores = threads.usable_cores()
        assert threads.configure_threads(1).threads == cores  # hyflow's own earlier count is not the program's
        if len(os.sched_getaffinity(0)) > 1:
            torch.set_num_threads(len(os.sched_getaffinity(0)) - 1)  # the program's own choice
            choice = threads.configure_threads(1)
            assert choice.reason == "torch.set_num_threads before hyflow started"
            assert choice.threads == torch.get_num_threads() == len(os.sched_getaffinity(0)) - 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("first", "policy", "note"), [
    ("hyflow", None, "idle threads sleep: OMP_WAIT_POLICY=PASSIVE"),
    ("torch", None, "idle threads spin: torch was imported before hyflow"),
    ("torch", "ACTIVE", "OMP_WAIT_POLICY=ACTIVE"),
])
def test_wait_policy_is_set_before_torch_loads(first, policy, note):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    imports = "import hyflow, torch" if first == "hyflow" else "import torch, hyflow"
    code = f"{imports}; import os; from hyflow import threads; print(os.environ.get('OMP_WAIT_POLICY')); " \
           "print(threads.openmp_wait_note())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.splitlines()
    assert out[0] == (policy or ("PASSIVE" if first == "hyflow" else "None"))
    assert out[1].startswith(note)


class ThreadProbe(Worker):
    """Reports the torch threads and the OpenMP wait policy its Ray worker process got."""

    @register(Dispatch.REPLICATE)
    def threads(self) -> dict:
        return {"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                **{k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "HYFLOW_WORKERS_PER_NODE", "OMP_NUM_THREADS")}}


@pytest.mark.slow
def test_ray_workers_share_the_nodes_cores():
    """1 and 2 workers on one node of this machine: each takes usable cores // workers threads, whatever Ray's
    OMP_NUM_THREADS (1 for these 0.25-CPU actors) says, and its idle OpenMP threads sleep."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = ensure_ray(num_cpus=4, ray_init={"log_to_driver": False})
    got = {}
    try:
        for workers in (1, 2):
            pool = RayResourcePool(1, workers, use_gpu=False, cpus_per_worker=0.25)
            try:
                group = RayWorkerGroup(ThreadProbe, pool=pool)
                try:
                    got[workers] = group.threads()
                finally:
                    group.shutdown()
            finally:
                pool.remove()
    finally:
        if started:
            shutdown_ray()
    for workers, ranks in got.items():
        for rank in ranks:
            assert rank["OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
            assert rank["HYFLOW_WORKERS_PER_NODE"] == str(workers)
            if not {"HYFLOW_NUM_THREADS", "OMP_NUM_THREADS"} & set(os.environ):
                assert rank["OMP_NUM_THREADS"] == "1"  # Ray's, not read
                want = max(1, threads.usable_cores() // workers)
                assert rank["threads"] == rank["interop"] == want, (workers, rank)
