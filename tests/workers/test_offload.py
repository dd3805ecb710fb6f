"""Offload that is real (verl's fsdp_config.param_offload / optimizer_offload / offload_policy; issue 26, part 3).

With param_offload a role's parameters (with optimizer_offload its optimizer state) live in host memory between
uses: `TrainEngine.on_device` brings them to the engine's device for a forward, update, weight sync or checkpoint
and sends them back after, and the actor's stay on the host while the rollout generates (verl's hybrid engine).
On these CPU-only machines host and device are the same memory, so a move would be a no-op; the tests set
`TrainEngine.offload_copies`, which makes every move copy into new storage as a move between host and accelerator
does, so the real path runs: `nn.Module._apply` re-pointing plain parameters, FSDP2 swapping its DTensor shards and
re-registering them, the optimizer state moved out and back by parameter. The tests check

- the state machine: where each engine's parameters and optimizer state are at every stage of a trainer-driven
  step, and that the moves happen in verl's order (old log-prob, ref, values, critic update, actor update, weight
  sync), none while the rollout generates;
- numerics: a few RL steps with offload equal the same steps without (copies change memory addresses, which may
  change the rounding of a kernel: compared to tolerances), one process and 2 FSDP2 ranks, FSDP2's
  CPUOffloadPolicy and DDP too;
- checkpoints saved and loaded while offloaded (full and sharded), and a resumed run that continues exactly.

The CUDA path is the same code with the engine's device `cuda:<local rank>`; it has not run here.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks
from test_fsdp_workers import (
    actor_worker,
    add_training_columns,
    critic_worker,
    make_batch,
    make_config,
    share,
)

from hyflow.batch import Batch
from hyflow.controller.worker import free_port
from hyflow.workers.fsdp import model_bytes, move_model, optimizer_state_back, optimizer_state_to_host
from hyflow.workers.train_engine import TrainEngine

ACTOR = "actor_rollout_ref.actor.fsdp_config"
OFFLOAD = (f"{ACTOR}.param_offload=true", f"{ACTOR}.optimizer_offload=true",
           "actor_rollout_ref.ref.fsdp_config.param_offload=true", "critic.model.fsdp_config.param_offload=true",
           "critic.model.fsdp_config.optimizer_offload=true")
ATOL = 1e-6  # updated weights; the copies' rounding differences are ~1e-9


@pytest.fixture
def copies(monkeypatch):
    """Every offload move copies into new storage (what a host <-> accelerator move does)."""
    monkeypatch.setattr(TrainEngine, "offload_copies", True)


def storage(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


# ------------------------------------------------------------------------------------------------ the moves


def test_moves_copy_every_tensor_and_keep_parameters_and_optimizer_state_attached():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    model.register_buffer("scale", torch.tensor([2.0]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    before = {name: t.clone() for name, t in model.state_dict().items()}
    pointers = [storage(p) for p in params]
    moments = {id(p): optimizer.state[p]["exp_avg"].clone() for p in params}

    assert move_model(model, "cpu") == 0  # already there: nothing moves
    moved = move_model(model, "cpu", copy=True)
    assert moved == model_bytes(model) == sum(p.numel() * 4 for p in params) * 2 + 4  # params, grads, buffer
    assert list(model.parameters()) == params  # the same Parameter objects (the optimizer's keys) ...
    assert all(storage(p) != ptr for p, ptr in zip(params, pointers))  # ... with new storage
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    steps = {id(p): optimizer.state[p]["step"] for p in params}
    devices, nbytes = optimizer_state_to_host(optimizer, copy=True)
    assert nbytes == sum(p.numel() * 4 * 2 + 4 for p in params)  # exp_avg, exp_avg_sq, step
    assert set(devices.values()) == {torch.device("cpu")} and len(devices) == 3 * len(params)
    assert all(optimizer.state[p]["step"] is not steps[id(p)] for p in params)
    assert optimizer_state_back(optimizer, devices, copy=True) == nbytes
    assert all(torch.equal(optimizer.state[p]["exp_avg"], moments[id(p)]) for p in params)
    optimizer.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # steps with the moved state


def tiny_engine(model_dir, *, param_offload=True, optimizer_offload=True) -> TrainEngine:
    from hyflow.models.loading import load_causal_lm
    from hyflow.parallel import ParallelDims
    from hyflow.specs import FsdpSettings, OptimizerSpec, TrainEngineSpec

    spec = TrainEngineSpec(name="actor", head="lm", strategy="fsdp", compute_dtype="fp32", optim=OptimizerSpec(lr=1e-3),
                           fsdp=FsdpSettings(param_offload=param_offload, optimizer_offload=optimizer_offload))
    return TrainEngine(load_causal_lm(model_dir), spec, ParallelDims().build_mesh("cpu"), device=torch.device("cpu"))


def test_the_engine_state_machine(tiny_model_dir, copies):
    engine = tiny_engine(tiny_model_dir)
    assert engine.location() == {"params": "host", "optimizer": "host"}  # offloaded from the start (verl's init)
    assert [(m.part, m.to) for m in engine.offload_log] == [("params", "host"), ("optimizer", "host")]
    with engine.on_device():
        assert engine.location() == {"params": "device", "optimizer": "host"}
        with engine.on_device(optimizer=True):  # nested: the parameters are not loaded twice
            assert engine.location() == {"params": "device", "optimizer": "device"}
        assert engine.location() == {"params": "device", "optimizer": "host"}
    assert engine.location() == {"params": "host", "optimizer": "host"}
    with pytest.raises(RuntimeError, match="boom"), engine.on_device(optimizer=True):
        raise RuntimeError("boom")
    assert engine.location() == {"params": "host", "optimizer": "host"}  # back on the host after a failure too
    assert dict(engine.offload_counts) == {"params_to_host": 3, "params_to_device": 2, "optimizer_to_host": 3,
                                           "optimizer_to_device": 2}
    assert [m.seq for m in engine.offload_log] == sorted(m.seq for m in engine.offload_log)
    assert engine.offload_log[0].nbytes == model_bytes(engine.model) > 0
    assert engine.offload_log[1].nbytes == 0  # the optimizer has not stepped: no state yet
    assert "parameters and optimizer state in host memory between uses" in engine.describe_parameters()

    plain = tiny_engine(tiny_model_dir, param_offload=False, optimizer_offload=False)
    with plain.on_device(optimizer=True):
        pass
    assert plain.location() == {"params": "device", "optimizer": "device"} and not plain.offload_log
    assert "offload" not in plain.describe_parameters()


def _optimizer_storages(engine: TrainEngine) -> dict[tuple[int, str], int]:
    """Where each tensor of the engine's optimizer state lives: its storage's address, by (parameter, key)."""
    return {(id(p), key): storage(value) for p, state in engine.optimizer.state.items()
            for key, value in state.items() if isinstance(value, torch.Tensor)}


def test_the_optimizer_state_comes_back_for_the_update_and_the_step_uses_it(tiny_model_dir, copies):
    """Host and device are one memory here, so "on the device" is what a move changes: with `offload_copies` each
    move copies into new storage (as a host <-> accelerator copy does). The optimizer state brought back for an
    update is a new copy of the host one, equal to it, and is what the step updates; a parameters-only scope leaves
    it on the host; leaving the scope moves it out again."""
    engine = tiny_engine(tiny_model_dir)
    ids = torch.tensor([[5, 17, 42, 9, 33, 8]])

    def step() -> None:
        engine.model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)

    with engine.on_device(optimizer=True):
        step()  # the optimizer's first state
    host = _optimizer_storages(engine)
    values = {(id(p), k): v.clone() for p, state in engine.optimizer.state.items() for k, v in state.items()}
    assert len(host) == 3 * len(list(engine.model.parameters())) > 0  # exp_avg, exp_avg_sq, step
    with engine.on_device():
        assert _optimizer_storages(engine) == host  # the parameters' pass: the optimizer state stays on the host
    with engine.on_device(optimizer=True):
        assert engine.location() == {"params": "device", "optimizer": "device"}
        device = _optimizer_storages(engine)
        assert device.keys() == host.keys()
        left = sorted(key for key in host if device[key] == host[key])
        assert not left, f"{len(left)} of {len(host)} optimizer state tensors were left on the host"
        for p, state in engine.optimizer.state.items():
            for key, value in state.items():
                torch.testing.assert_close(value, values[(id(p), key)], atol=0, rtol=0)
        step()
        assert _optimizer_storages(engine) == device  # the step updated the state that came back, in place
        moments = {(id(p), k): v.clone() for p, state in engine.optimizer.state.items() for k, v in state.items()}
    back = engine.offload_log[-1]
    assert (back.part, back.to) == ("optimizer", "host")
    after = _optimizer_storages(engine)
    assert all(after[key] != device[key] for key in device)  # offloaded again after the update
    assert any(not torch.equal(moments[key], values[key]) for key in moments)  # and it holds the step's update
    for p, state in engine.optimizer.state.items():
        for key, value in state.items():
            torch.testing.assert_close(value, moments[(id(p), key)], atol=0, rtol=0)


def test_the_keys_reach_the_role_specs_and_are_not_called_performance_only():
    from hyflow.config import load_config, support, validate_config
    from hyflow.config.roles import reward_model_spec, role_specs

    cfg = load_config([*OFFLOAD, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                       "reward_model.enable=true",
                       "reward_model.model.path=/rm", "reward_model.model.fsdp_config.param_offload=true"])
    validate_config(cfg)
    specs = role_specs(cfg)
    assert (specs.actor.engine.fsdp.param_offload, specs.actor.engine.fsdp.optimizer_offload) == (True, True)
    assert specs.actor.ref.fsdp.param_offload and not specs.actor.ref.fsdp.optimizer_offload
    assert (specs.critic.engine.fsdp.param_offload, specs.critic.engine.fsdp.optimizer_offload) == (True, True)
    assert not reward_model_spec(cfg).engine.fsdp.param_offload  # its worker never loads: it must not offload
    line = support.performance_only_warning(cfg)
    named = [part.split("=")[0].strip() for part in line[len(support.WARNING_PREFIX):].split("; ")]
    assert named == ["reward_model.model.fsdp_config.param_offload"]  # the trained roles' keys are read


@pytest.mark.parametrize("extra, refused", [
    (["trainer.n_gpus_per_node=2", f"{ACTOR}.offload_policy=true", "data.train_batch_size=4",
      "actor_rollout_ref.actor.ppo_mini_batch_size=2"], None),
    ([f"{ACTOR}.offload_policy=true"], f"{ACTOR}.offload_policy"),  # one device: no FSDP2 wrapper
    (["trainer.n_gpus_per_node=2", "critic.strategy=ddp", "critic.model.fsdp_config.offload_policy=true",
      "algorithm.adv_estimator=gae", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
      "critic.ppo_mini_batch_size=2"], "critic.model.fsdp_config.offload_policy"),
    (["trainer.n_gpus_per_node=2", "reward_model.model.fsdp_config.offload_policy=true", "data.train_batch_size=4",
      "actor_rollout_ref.actor.ppo_mini_batch_size=2"], "reward_model.model.fsdp_config.offload_policy"),
])
def test_offload_policy_is_refused_by_name_where_no_fsdp2_wrapper_runs(extra, refused):
    from hyflow.config import ConfigError, load_config, validate_config

    cfg = load_config(extra)
    if refused is None:
        validate_config(cfg)
        return
    with pytest.raises(ConfigError, match=rf"{refused} is not supported by this hyflow version yet \(got true\): "
                                          "FSDP2's CPUOffloadPolicy is an option of the FSDP2 wrapper"):
        validate_config(cfg)


# ------------------------------------------------------------------------------------------------ one process


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The built-in arithmetic task: 16 training prompts of one-digit numbers."""
    from hyflow.data.tasks import make_task

    out = tmp_path_factory.mktemp("arith")
    make_task("arithmetic", out, n_train=16, n_test=4, seed=0, digits=1)
    return out


# GAE with a KL loss: every role of a step runs (rollout, old log-probs, reference, values, both updates). Adam's
# eps 1e-4 keeps an update proportional to its gradient near zero, so rounding-sized gradient differences (the
# copies' memory addresses) stay rounding-sized in the weights.
RUN = {"algorithm.adv_estimator": "gae", "actor_rollout_ref.rollout.n": 2, "data.train_batch_size": 4,
       "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "critic.ppo_mini_batch_size": 2,
       "data.max_prompt_length": 48, "data.max_response_length": 8, "actor_rollout_ref.actor.use_kl_loss": "true",
       "actor_rollout_ref.actor.optim.lr": 1e-3, "critic.optim.lr": 1e-3, "reward_model.num_workers": 0,
       "+actor_rollout_ref.actor.optim.override_optimizer_config.eps": 1e-4,
       "+critic.optim.override_optimizer_config.eps": 1e-4, "trainer.logger": "[file]", "trainer.device": "cpu",
       "trainer.val_before_train": "false", "trainer.test_freq": 0, "data.seed": 3, "trainer.save_freq": 2}


def overrides(model_dir, task_dir, run_dir, *extra):
    paths = {"actor_rollout_ref.model.path": model_dir, "data.train_files": f"{task_dir}/train.parquet",
             "trainer.default_local_dir": run_dir}
    return [f"{key}={value}" for key, value in {**paths, **RUN}.items()] + list(extra)


def digit_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))} for row in rows]


def hosted(trainer, role: str):
    return trainer.workers.workers[0].roles[role]


class Stages:
    """Records, for each worker call of a trainer step, the offload moves it made (in order) and where every
    engine was while the rollout generated."""

    def __init__(self, trainer) -> None:
        self.actor, self.critic = hosted(trainer, "actor"), hosted(trainer, "critic")
        self.engines = [self.actor.engine, self.actor.ref, self.critic.engine]
        self.calls: list[tuple[str, list[tuple[str, str, str]]]] = []
        self.during_generation: list[dict] = []
        for worker, names in ((self.actor, ("generate_sequences", "compute_log_prob", "compute_ref_log_prob",
                                            "update_actor", "sync_rollout_weights")),
                              (self.critic, ("compute_values", "update_critic"))):
            for name in names:
                setattr(worker, name, self._recorded(name, getattr(worker, name)))
        generate = self.actor.agent_loops.generate

        def watched(*args, **kwargs):
            self.during_generation.append({e.name: e.location() for e in self.engines})
            return generate(*args, **kwargs)

        self.actor.agent_loops.generate = watched

    def _log(self) -> list:
        return sorted((m for e in self.engines for m in e.offload_log), key=lambda m: m.seq)

    def _recorded(self, name, method):
        def call(*args, **kwargs):
            before = len(self._log())
            out = method(*args, **kwargs)
            self.calls.append((name, [(m.engine, m.part, m.to) for m in self._log()[before:]]))
            return out
        return call


IN_OUT = {"actor": [("actor", "params", "device"), ("actor", "params", "host")],
          "ref": [("ref", "params", "device"), ("ref", "params", "host")],
          "critic": [("critic", "params", "device"), ("critic", "params", "host")]}


def update_moves(name: str) -> list[tuple[str, str, str]]:
    return [(name, "params", "device"), (name, "optimizer", "device"), (name, "params", "host"),
            (name, "optimizer", "host")]


# One step, in verl's order: the rollout generates with the actor on the host (no moves), then each pass loads its
# engine and offloads it after. In one CPU process the rollout shares the actor's module: the sync moves nothing.
STEP_MOVES = [("generate_sequences", []), ("compute_log_prob", IN_OUT["actor"]),
              ("compute_ref_log_prob", IN_OUT["ref"]), ("compute_values", IN_OUT["critic"]),
              ("update_critic", update_moves("critic")), ("update_actor", update_moves("actor")),
              ("sync_rollout_weights", [])]
ALL_ON_HOST = {"actor": {"params": "host", "optimizer": "host"}, "ref": {"params": "host", "optimizer": None},
               "critic": {"params": "host", "optimizer": "host"}}


def after_setup(trainer, fn) -> None:
    """Call `fn(trainer)` once `fit` has set the trainer up (its workers exist), before the first step."""
    setup = trainer.setup

    def set_up() -> None:
        setup()
        fn(trainer)

    trainer.setup = set_up


@pytest.fixture(scope="module")
def plain_metrics(tiny_model_dir, task_dir, tmp_path_factory):
    """The metrics of 3 steps without offload."""
    from hyflow.trainer.rl_trainer import RLTrainer
    from hyflow.trainer.tracking import read_metrics

    plain = tmp_path_factory.mktemp("plain")
    RLTrainer(overrides(tiny_model_dir, task_dir, plain, "trainer.total_training_steps=3"),
              reward_fn=digit_reward).fit()
    return comparable(read_metrics(plain))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_offloaded_steps_move_in_verls_order_equal_plain_ones_and_resume(tiny_model_dir, task_dir, tmp_path, copies,
                                                                           plain_metrics, fmt):
    from hyflow.trainer.rl_trainer import RLTrainer
    from hyflow.trainer.tracking import read_metrics

    run = tmp_path / "offload"
    trainer = RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=2",
                                  f"trainer.checkpoint_format={fmt}", *OFFLOAD), reward_fn=digit_reward)
    seen = {}
    after_setup(trainer, lambda t: seen.update(stages=Stages(t)))
    trainer.fit()
    stages = seen["stages"]
    assert stages.calls == STEP_MOVES * 2
    assert stages.during_generation == [ALL_ON_HOST] * 2
    # per step: old log-probs and the update; at the end the checkpoint (saved from the device, offloaded again)
    assert stages.actor.offload_status() == {
        "actor": ALL_ON_HOST["actor"] | {"counts": {"params_to_host": 6, "params_to_device": 5, "optimizer_to_host": 4,
                                                    "optimizer_to_device": 3}},
        "ref": ALL_ON_HOST["ref"] | {"counts": {"params_to_host": 3, "params_to_device": 2}}}
    to_host = [m for m in stages._log() if m.engine == "actor" and m.part == "optimizer" and m.to == "host"]
    assert to_host[0].nbytes == 0 and to_host[-1].nbytes > 0  # no state before Adam's first step, then its moments
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    resumed = RLTrainer(overrides(tiny_model_dir, task_dir, run, "trainer.total_training_steps=3",
                                  f"trainer.checkpoint_format={fmt}", *OFFLOAD), reward_fn=digit_reward)
    loaded = {}
    after_setup(resumed, lambda t: loaded.update(step=t.global_step, actor=hosted(t, "actor").offload_status(),
                                                  critic=hosted(t, "critic").offload_status()))
    resumed.fit()
    assert loaded["step"] == 2
    assert loaded["actor"]["actor"]["counts"]["optimizer_to_device"] == 1  # loaded into on the device, then offloaded
    assert {name: {k: v for k, v in status.items() if k != "counts"}
            for name, status in {**loaded["actor"], **loaded["critic"]}.items()} == ALL_ON_HOST
    want, got = plain_metrics, comparable(read_metrics(run))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


# ------------------------------------------------------------------------------------------------ 2 FSDP2 ranks


VARIANTS = {  # name: (config overrides, what offloads)
    "plain": (),
    "offload": OFFLOAD,
    "policy": (f"{ACTOR}.offload_policy=true", "actor_rollout_ref.ref.fsdp_config.offload_policy=true",
               "critic.model.fsdp_config.offload_policy=true"),
    "ddp": ("actor_rollout_ref.actor.strategy=ddp", f"{ACTOR}.param_offload=true", f"{ACTOR}.optimizer_offload=true"),
    "ddp_plain": ("actor_rollout_ref.actor.strategy=ddp",),
}


def _rank_main(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    """Every variant on this rank's share: old/ref log-probs, values, two critic and two actor updates, the
    rollout sync, full and sharded checkpoints saved and loaded while offloaded."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    TrainEngine.offload_copies = True
    out = Path(out)
    columns = torch.load(out / "batch.pt")
    batch = share(columns, rank)
    results = {}
    for name, extra in VARIANTS.items():
        cfg = make_config(model_dir, *extra)
        actor = actor_worker(cfg, rank=rank, world_size=world_size)
        if not results:
            actor.init_process_group("gloo", timeout_s=120.0)
        actor.init_model()
        r = {"init": actor.offload_status()}
        r["old"] = actor.compute_log_prob(batch)["old_log_probs"]
        r["after_old"] = actor.offload_status()
        r["ref"] = actor.compute_ref_log_prob(batch)["ref_log_prob"]
        r["actor_metrics"] = [actor.update_actor(batch).meta["metrics"] for _ in range(2)]
        r["after_update"] = actor.offload_status()
        actor.sync_rollout_weights()
        r["rollout"] = {k: v.clone() for k, v in actor.rollout.model.state_dict().items()}
        r["actor_state"] = copy.deepcopy(actor.state_dict())  # a loaded state's tensors may become live ones
        actor.save_sharded_checkpoint(str(out / f"dcp_{name}"))
        r["after_save"] = actor.offload_status()
        if not name.startswith("ddp"):
            critic = critic_worker(cfg, rank=rank, world_size=world_size)
            critic.init_model()
            r["values"] = critic.compute_values(batch)["values"]
            r["critic_metrics"] = [critic.update_critic(batch).meta["metrics"] for _ in range(2)]
            r["critic_state"] = copy.deepcopy(critic.state_dict())
            r["critic_status"] = critic.offload_status()
        fresh = actor_worker(cfg, rank=rank, world_size=world_size)
        fresh.init_model()
        fresh.load_sharded_checkpoint(str(out / f"dcp_{name}"))
        r["loaded_status"] = fresh.offload_status()
        r["loaded_state"] = copy.deepcopy(fresh.state_dict())
        r["loaded_metrics"] = fresh.update_actor(batch).meta["metrics"]
        full = actor_worker(cfg, rank=rank, world_size=world_size)
        full.init_model()
        whole = [copy.deepcopy(r["actor_state"])]
        torch.distributed.broadcast_object_list(whole, src=0)  # rank 0's full state, which every rank loads
        full.load_state_dict(whole[0])
        r["full_loaded_metrics"] = full.update_actor(batch).meta["metrics"]
        results[name] = r
    torch.save(results, out / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("offload_ranks")
    cfg = make_config(str(tiny_model_dir))
    columns = make_batch(len(tiny_tokenizer))
    actor, critic = actor_worker(cfg), critic_worker(cfg)
    actor.init_model()
    critic.init_model()
    columns = add_training_columns(columns, actor.compute_log_prob(Batch(columns))["old_log_probs"],
                                   critic.compute_values(Batch(columns))["values"])
    torch.save(columns, out / "batch.pt")
    spawn_ranks(_rank_main, args=(2, free_port(), str(tiny_model_dir), str(out)))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_close_dicts(got: dict, want: dict, atol: float = ATOL) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, dict):
            assert_close_dicts(got[key], value, atol)
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
        elif isinstance(value, float) or (isinstance(value, list) and all(isinstance(v, float) for v in value)):
            assert got[key] == pytest.approx(value, rel=1e-5, abs=atol), key  # a metric, per mini-batch
        else:  # step counts, hyperparameters, parameter names
            assert got[key] == value, key


def metrics(runs: list[dict]) -> list[dict]:
    keep = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
    return [{k: v for k, v in m.items() if k in keep} for m in runs]


HOST_ACTOR = {"actor": {"params": "host", "optimizer": "host"}, "ref": {"params": "host", "optimizer": None}}


@pytest.mark.slow
@pytest.mark.parametrize("variant, baseline", [("offload", "plain"), ("policy", "plain"), ("ddp", "ddp_plain")])
def test_offloaded_ranks_train_like_plain_ones(ranks, variant, baseline):
    for rank in ranks:
        got, want = rank[variant], rank[baseline]
        for key in ("old", "ref", "values", "rollout", "actor_state", "loaded_state", "critic_state"):
            if key in want:
                assert_close_dicts({key: got[key]}, {key: want[key]})
        for key in ("actor_metrics", "critic_metrics", "loaded_metrics", "full_loaded_metrics"):
            if key in want:
                for g, w in zip(metrics(got[key] if isinstance(got[key], list) else [got[key]]),
                                metrics(want[key] if isinstance(want[key], list) else [want[key]]), strict=True):
                    assert_close_dicts(g, w)


@pytest.mark.slow
def test_offloaded_ranks_keep_their_shards_on_the_host_between_uses(ranks):
    for rank in ranks:
        r = rank["offload"]
        for stage in ("init", "after_old", "after_update", "after_save", "loaded_status"):
            status = r[stage]
            assert {k: {p: w for p, w in v.items() if p != "counts"} for k, v in status.items()} == HOST_ACTOR, stage
        counts = r["after_save"]["actor"]["counts"]
        # init + sync at init, old log-probs, 2 updates, sync, state_dict, save_sharded: 7 round trips of the params
        assert counts == {"params_to_host": 8, "params_to_device": 7, "optimizer_to_host": 5, "optimizer_to_device": 4}
        assert r["critic_status"]["critic"]["params"] == "host"
        policy = rank["policy"]["after_update"]
        assert policy["actor"]["params"] == "host" and not policy["actor"]["counts"]  # FSDP2 keeps them there
        assert rank["ddp"]["after_update"]["actor"]["params"] == "host"


# ------------------------------------------------------------------------------------------------ 2 Ray workers


@pytest.mark.slow
def test_two_ray_workers_keep_actor_ref_and_critic_on_the_host_between_uses(tiny_model_dir, task_dir, tmp_path):
    """The keys reach the Ray workers (FSDP2 over 2 gloo ranks): after set-up and after a whole trainer step every
    rank's engines are on the host, each pass having loaded and offloaded them; the step trains."""
    from hyflow.trainer.rl_trainer import RLTrainer
    from hyflow.trainer.tracking import read_metrics

    trainer = RLTrainer(overrides(tiny_model_dir, task_dir, tmp_path / "ray", "trainer.total_training_steps=1",
                                  "trainer.save_freq=0", "trainer.executor=ray", "trainer.n_gpus_per_node=2",
                                  *OFFLOAD), reward_fn=digit_reward)
    statuses = []

    def record(t) -> None:
        statuses.append([{**a, **c} for a, c in zip(t.actor.offload_status(), t.critic.offload_status(), strict=True)])

    train_on = trainer.train_on

    def trained(*args, **kwargs):
        out = train_on(*args, **kwargs)
        record(trainer)
        return out

    trainer.train_on = trained
    after_setup(trainer, record)
    trainer.fit()
    set_up, stepped = statuses
    for ranks, counts in ((set_up, (2, 1, 1, 0)), (stepped, (5, 4, 2, 1))):
        assert len(ranks) == 2
        for status in ranks:
            assert {name: {k: v for k, v in s.items() if k != "counts"} for name, s in status.items()} == ALL_ON_HOST
            # actor: offloaded at init, then each of: the weight sync at init (a separate rollout copy under FSDP2),
            # old log-probs, the update, the weight sync after it
            names = ("params_to_host", "params_to_device", "optimizer_to_host", "optimizer_to_device")
            assert status["actor"]["counts"] == {name: n for name, n in zip(names, counts, strict=True) if n}
    (row,) = read_metrics(tmp_path / "ray")
    assert row["step"] == 1 and torch.isfinite(torch.tensor(row["actor/pg_loss"]))
