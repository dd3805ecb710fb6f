"""The local executor: Worker placement, LocalWorkerGroup dispatch for every mode at world_size 1 and 3,
error wrapping, unregistered methods, colocated roles, and torch.distributed set-up."""

import os
import pickle
import subprocess
import sys
import textwrap
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from hyflow.algos import reduce_metrics
from hyflow.batch import Batch
from hyflow.controller import (
    Collect,
    Dispatch,
    LocalWorkerGroup,
    Placement,
    Worker,
    WorkerError,
    make_colocated_class,
    register,
    use_placement,
)
from hyflow.controller.dispatch import DataLayout


class Scaler(Worker):
    """A row-wise worker: y = scale * x; records which ranks ran what."""

    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.scale = scale
        self.calls: list[str] = []
        self.seed = None

    @register(Dispatch.DP_SPLIT)
    def forward(self, batch: Batch) -> Batch:
        """Scale x."""
        self.calls.append("forward")
        return Batch({"y": batch["x"] * self.scale}, {"uid": batch["uid"]},
                     meta={"metrics": {"rows": len(batch), "rank": self.rank}})

    @register(Dispatch.DP_SPLIT, pad=False)
    def update(self, batch: Batch) -> Batch:
        self.calls.append("update")
        return Batch(meta={"metrics": {"actor/loss": float(batch["x"].sum())}})

    @register(Dispatch.REPLICATE)
    def whoami(self, tag: str) -> tuple:
        return (tag, self.rank, self.world_size)

    @register(Dispatch.REPLICATE, Collect.FIRST)
    def set_scale(self, scale: float) -> float:
        self.scale = scale
        return scale

    @register(Dispatch.RANK_ZERO)
    def save(self, path: str) -> str:
        self.calls.append("save")
        return f"{path}@{self.rank}"

    @register(Dispatch.DIRECT)
    def set_seed(self, seed: int) -> int:
        self.seed = seed
        return seed * 2

    @register(Dispatch.DP_SPLIT)
    def explode(self, batch: Batch) -> Batch:
        if self.rank == self.world_size - 1:
            raise ValueError(f"bad row count {len(batch)}")
        return batch

    def helper(self) -> int:
        return 1


def make_batch(n: int) -> Batch:
    return Batch({"x": torch.arange(n, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(n)]})


# ---- Worker placement ----------------------------------------------------------------------------


def test_worker_defaults_to_single_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    w = Scaler()
    assert (w.rank, w.world_size, w.local_rank) == (0, 1, 0)
    assert w.device == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))


def test_worker_reads_env_and_arguments_override(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    w = Worker()
    assert (w.rank, w.world_size, w.local_rank) == (2, 4, 1)
    assert (w.placement.master_addr, w.placement.master_port) == ("127.0.0.1", 29555)
    assert Worker(rank=3).rank == 3
    with use_placement(Placement(rank=1, world_size=2, local_rank=0)):
        assert (Worker().rank, Worker().world_size) == (1, 2)  # executor placement beats env


def test_worker_rank_errors(monkeypatch):
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match=r"environment variable RANK='x' must be an integer"):
        Worker()
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match=r"Worker: rank 3 is not in \[0, world_size=2\)"):
        Worker(rank=3, world_size=2)


def test_init_process_group_single_rank_gloo(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    w = Worker()
    w.init_process_group("gloo")
    try:
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert dist.get_world_size() == 1 and t.item() == 3.0
        w.init_process_group("gloo")  # already joined: no-op
        with pytest.raises(RuntimeError, match=r"already initialised as rank 0 of 1, but this worker is "
                                               r"rank 1 of 2"):
            Worker(rank=1, world_size=2).init_process_group()
    finally:
        dist.destroy_process_group()


def test_multi_rank_group_needs_port_and_separate_processes(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match=r"MASTER_PORT is not set for a 2-rank group"):
        Worker(rank=0, world_size=2).init_process_group()
    group = LocalWorkerGroup(Scaler, world_size=2)
    with pytest.raises(RuntimeError, match=r"live in one process \(local executor\).*ray executor"):
        group.workers[1].init_process_group()


@pytest.mark.slow
def test_two_processes_all_reduce_over_gloo(tmp_path):
    """Two OS processes with RANK/WORLD_SIZE/MASTER_PORT set, as the Ray executor will set them."""
    from hyflow.controller import free_port

    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from hyflow.controller import Worker
        w = Worker()
        w.init_process_group()
        t = torch.tensor([float(w.rank + 1)])
        dist.all_reduce(t)
        print(int(t.item()))
        dist.destroy_process_group()
    """))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_PORT": port,
                                   "MASTER_ADDR": "127.0.0.1"})
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == ["3", "3"]


# ---- dispatch through LocalWorkerGroup -----------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("rows", [0, 1, 7, 9])
def test_dp_split_equals_direct_call(world_size, rows):
    group = LocalWorkerGroup(Scaler, scale=3.0, world_size=world_size)
    batch = make_batch(rows)
    out = group.forward(batch)
    direct = Scaler(scale=3.0).forward(batch)
    assert torch.equal(out["y"], direct["y"]) and list(out["uid"]) == list(direct["uid"])
    per_rank = -(-rows // world_size)
    assert out.meta["metrics"] == {"rows": [per_rank] * world_size, "rank": list(range(world_size))}
    assert [w.rank for w in group.workers] == list(range(world_size))


def test_dp_split_metrics_only_update_and_pad_false():
    group = LocalWorkerGroup(Scaler, world_size=3)
    out = group.update(batch=make_batch(6))
    assert out.meta["metrics"] == {"actor/loss": [1.0, 5.0, 9.0]}
    assert reduce_metrics(out.meta["metrics"]) == {"actor/loss": 5.0}
    with pytest.raises(ValueError, match=r"Scaler.update: a Batch of 7 rows cannot be split evenly across DP "
                                         r"size 3"):
        group.update(make_batch(7))


class MiniBatchWalker(Worker):
    """Walks its rows in local mini-batches of `mini_batch_rows / world_size` rows, as an update does."""

    @register(Dispatch.DP_MINI_BATCHES, pad=False)
    def update(self, batch: Batch) -> Batch:
        per_rank = batch.meta.get("mini_batch_rows", len(batch)) // self.world_size
        return Batch(meta={"metrics": {"mini_batches": [part["x"].tolist() for part in batch.split(per_rank)]}})


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mini_batch_major_ranks_walk_the_one_process_mini_batches(world_size):
    from hyflow.controller.dispatch import with_mini_batch_rows

    group = LocalWorkerGroup(MiniBatchWalker, world_size=world_size)
    out = group.update(with_mini_batch_rows(make_batch(16), 8)).meta["metrics"]["mini_batches"]
    local = [out[rank * 2:(rank + 1) * 2] for rank in range(world_size)]  # every rank walks 2 mini-batches
    for k in range(2):
        assert [x for r in range(world_size) for x in local[r][k]] == list(range(8 * k, 8 * (k + 1)))


class PairedEngine:
    """Stands in for a TrainEngine on a mesh of sequence-parallel pairs: ranks 2d, 2d+1 are data-parallel rank d."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def data_layout(self) -> DataLayout:
        return DataLayout(dp_rank=self.rank // 2, dp_size=self.world_size // 2, collects=self.rank % 2 == 0)


class PairedWorker(Worker):
    """A worker whose `forward` runs on its engine's mesh (`mesh="pairs"`) and whose `decode` runs per rank."""

    MESHES: ClassVar[dict[str, str]] = {"pairs": "engine"}

    def __init__(self):
        super().__init__()
        self.engine = None
        self.layout_queries = 0

    @register(Dispatch.REPLICATE)
    def init_model(self) -> None:
        self.engine = PairedEngine(self.rank, self.world_size)

    @register(Dispatch.REPLICATE)
    def data_layouts(self) -> dict:
        self.layout_queries += 1
        return super().data_layouts()

    @register(Dispatch.DP_SPLIT, mesh="pairs")
    def forward(self, batch: Batch) -> Batch:
        return Batch({"y": batch["x"] * 10}, meta={"metrics": {"rank": self.rank, "rows": len(batch)}})

    @register(Dispatch.DP_SPLIT)
    def decode(self, batch: Batch) -> Batch:
        return Batch({"y": batch["x"]}, meta={"metrics": {"rank": self.rank}})


def test_mesh_methods_split_once_per_data_parallel_rank_and_collect_one_rank_each():
    group = LocalWorkerGroup(PairedWorker, world_size=4)
    assert group.layout("pairs") is None and group.data_parallel_size("pairs") == 4  # before the engines exist
    group.init_model()
    for _ in range(2):
        out = group.forward(make_batch(6))
        assert out["y"].tolist() == [10.0 * i for i in range(6)]
        assert out.meta["metrics"] == {"rank": [0, 2], "rows": [3, 3]}  # the pairs' first ranks, 3 rows each
    assert [w.layout_queries for w in group.workers] == [3, 3, 3, 3]  # 2 before init_model, then once: cached
    assert group.data_parallel_size("pairs") == 2 and group.data_parallel_size() == 4
    assert group.decode(make_batch(4)).meta["metrics"] == {"rank": [0, 1, 2, 3]}  # no mesh: every rank a share


def test_colocated_roles_report_their_meshes_under_the_role_name():
    cls = make_colocated_class({"actor": PairedWorker, "rollout": Rollout})
    assert cls.actor_forward.__hyflow_dispatch__.mesh == "actor.pairs"
    group = LocalWorkerGroup(cls, world_size=4)
    group.actor_init_model()
    assert [str(p.dp_rank) for p in group.layout("actor.pairs")] == ["0", "0", "1", "1"]
    assert group.role("actor").forward(make_batch(4)).meta["metrics"]["rank"] == [0, 2]


def test_replicate_rank_zero_and_direct():
    group = LocalWorkerGroup(Scaler, world_size=3)
    assert group.whoami("t") == [("t", 0, 3), ("t", 1, 3), ("t", 2, 3)]
    assert group.set_scale(5.0) == 5.0 and [w.scale for w in group.workers] == [5.0] * 3
    assert group.save("/ckpt") == "/ckpt@0"
    assert [w.calls for w in group.workers] == [["save"], [], []]
    assert group.set_seed([10, 11, 12]) == [20, 22, 24]
    assert [w.seed for w in group.workers] == [10, 11, 12]


def test_single_worker_group_returns_same_shapes():
    group = LocalWorkerGroup(Scaler)
    assert group.world_size == 1 and len(group.workers) == 1
    assert group.whoami("t") == [("t", 0, 1)]
    assert group.set_seed(seed=[4]) == [8]


def test_group_methods_keep_names_and_docs():
    group = LocalWorkerGroup(Scaler)
    assert group.forward.__name__ == "forward" and group.forward.__doc__ == "Scale x."
    # data_layouts, start_profile, stop_profile: every Worker's (the meshes its methods split by,
    # hyflow.controller.dispatch; this process's torch.profiler, hyflow.trainer.profiling)
    assert set(group.methods) == {"forward", "update", "whoami", "set_scale", "save", "set_seed", "explode",
                                  "data_layouts", "start_profile", "stop_profile"}


def test_worker_error_names_rank_class_and_method():
    group = LocalWorkerGroup(Scaler, world_size=3)
    with pytest.raises(WorkerError, match=r"worker rank 2 \(Scaler.explode\) raised ValueError: "
                                          r"bad row count 2") as info:
        group.explode(make_batch(5))
    assert isinstance(info.value.__cause__, ValueError)
    assert (info.value.rank, info.value.worker_class, info.value.method) == (2, "Scaler", "explode")
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)  # crosses process boundaries


def test_constructor_errors_are_wrapped():
    class Broken(Worker):
        def __init__(self):
            super().__init__()
            raise OSError("no model at /nowhere")

    with pytest.raises(WorkerError, match=r"worker rank 0 \(Broken.__init__\) raised OSError: no model"):
        LocalWorkerGroup(Broken)


def test_worker_must_call_base_init():
    class Forgetful(Worker):
        def __init__(self):
            self.x = 1

    with pytest.raises(TypeError, match=r"Forgetful.__init__ did not run Worker.__init__; call "
                                        r"super\(\).__init__\(\)"):
        LocalWorkerGroup(Forgetful)


def test_group_needs_a_worker_class():
    with pytest.raises(TypeError, match=r"needs a subclass of hyflow.controller.Worker, got <class 'int'>"):
        LocalWorkerGroup(int)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 0"):
        LocalWorkerGroup(Scaler, world_size=0)


def test_unregistered_and_unknown_methods():
    group = LocalWorkerGroup(Scaler)
    with pytest.raises(AttributeError, match=r"Scaler.helper is not registered for dispatch.*@register.*"
                                             r"Registered methods: \['data_layouts', 'explode', 'forward'"):
        group.helper()
    with pytest.raises(AttributeError, match=r"LocalWorkerGroup of Scaler has no method 'nope'; registered"):
        group.nope()
    assert not hasattr(group, "helper")


def test_method_colliding_with_group_attribute():
    class Clash(Worker):
        @register(Dispatch.REPLICATE)
        def shutdown(self):
            return None

    with pytest.raises(ValueError, match=r"Clash.shutdown collides with the LocalWorkerGroup attribute"):
        LocalWorkerGroup(Clash)


def test_shutdown_drops_workers():
    group = LocalWorkerGroup(Scaler)
    group.shutdown()
    assert group.workers == []
    with pytest.raises(RuntimeError, match=r"was shut down; create a new group to call whoami"):
        group.whoami("t")


# ---- colocation ----------------------------------------------------------------------------------


class Actor(Worker):
    def __init__(self, lr: float = 0.0):
        super().__init__()
        self.lr = lr
        self.weights = torch.zeros(1)

    @register(Dispatch.DP_SPLIT)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Actor log-probs."""
        return Batch({"old_log_probs": batch["x"] + self.weights})

    @register(Dispatch.REPLICATE, Collect.FIRST)
    def sync_weights(self, value: float) -> float:
        self.weights.fill_(value)
        self.peers["rollout"].load_weights(self.weights)
        return value


class Rollout(Worker):
    @register(Dispatch.REPLICATE)
    def load_weights(self, weights: torch.Tensor) -> None:
        self.weights = weights.clone()


class Ref(Worker):
    @register(Dispatch.DP_SPLIT)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return Batch({"ref_log_prob": batch["x"] - 1})


@pytest.mark.parametrize("world_size", [1, 2])
def test_colocated_roles_share_one_process_per_rank(world_size):
    cls = make_colocated_class({"actor": Actor, "rollout": Rollout, "ref": Ref})
    group = LocalWorkerGroup(cls, world_size=world_size, actor={"lr": 0.1})
    assert cls.__name__ == "ColocatedActorRolloutRef" and group.roles == ("actor", "rollout", "ref")
    # the process-wide methods once, not per role (actor_start_profile would start a second profiler)
    assert set(group.methods) == {"actor_compute_log_prob", "actor_sync_weights", "rollout_load_weights",
                                  "ref_compute_log_prob", "data_layouts", "start_profile", "stop_profile"}
    batch = make_batch(5)
    assert group.role("actor").sync_weights(2.0) == 2.0
    assert group.role("actor").compute_log_prob(batch)["old_log_probs"].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert group.ref_compute_log_prob(batch)["ref_log_prob"].tolist() == [-1.0, 0.0, 1.0, 2.0, 3.0]
    assert group.role("actor").compute_log_prob.__doc__ == "Actor log-probs."
    for rank, host in enumerate(group.workers):
        assert [r.rank for r in host.roles.values()] == [rank] * 3
        assert all(r.world_size == world_size for r in host.roles.values())
        assert host.roles["actor"].lr == 0.1
        assert host.roles["rollout"].weights.item() == 2.0  # the actor pushed weights in-process
        assert host.roles["actor"].peers["ref"] is host.roles["ref"]


def test_role_view_errors():
    group = LocalWorkerGroup(make_colocated_class({"actor": Actor, "ref": Ref}))
    with pytest.raises(ValueError, match=r"has no role 'critic': no registered method starts with 'critic_'; "
                                         r"roles: \['actor', 'ref'\]"):
        group.role("critic")
    with pytest.raises(AttributeError, match=r"role 'ref' has no registered method 'sync_weights'; its "
                                             r"methods: \['compute_log_prob'\]"):
        group.role("ref").sync_weights(1.0)


def test_colocated_class_errors():
    with pytest.raises(ValueError, match=r"needs at least one role"):
        make_colocated_class({})
    with pytest.raises(TypeError, match=r"role 'actor': expected a Worker subclass"):
        make_colocated_class({"actor": object})
    with pytest.raises(ValueError, match=r"role name 'my-actor' must be a Python identifier"):
        make_colocated_class({"my-actor": Actor})
    cls = make_colocated_class({"actor": Actor})
    with pytest.raises(WorkerError, match=r"unknown roles \['critic'\]; roles: \['actor'\]"):
        LocalWorkerGroup(cls, critic={})
    with pytest.raises(WorkerError, match=r"role 'actor': pass its constructor arguments as a dict, "
                                          r"actor=dict\(...\), got float"):
        LocalWorkerGroup(cls, actor=0.1)


def test_hand_written_role_prefixes_get_views():
    class ActorRef(Worker):
        @register(Dispatch.REPLICATE, Collect.FIRST)
        def actor_step(self) -> str:
            return "actor"

        @register(Dispatch.REPLICATE, Collect.FIRST)
        def ref_step(self) -> str:
            return "ref"

    group = LocalWorkerGroup(ActorRef)
    assert group.role("actor").step() == "actor" and group.role("ref").step() == "ref"
