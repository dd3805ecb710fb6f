"""`hyflow serve --workers N`: the base model and every client's adapter replicated on N Ray workers (data
parallel), one `ModelHost` per worker, behind the same routes.

- A `forward_backward` call's data are cut into N contiguous shards, one per worker; each worker adds its shard's
  gradients; `optim_step` sums the LoRA gradients over the workers (`all_reduce`, gloo on CPU, nccl on GPUs) and
  every replica takes the same AdamW step, so the replicas stay equal and equal one process (tested).
- Sample calls are shared out by samples (each call's samples stay together, in order).
- The checks of a request (loss inputs, token ids, context length, run ownership) run here on the driver before
  anything is sent, and a call that fails on one worker is rolled back on all of them (their gradients as before).
- Rank 0 writes the checkpoints; every worker reads them. The store must be one directory every worker sees
  (a local cluster: this machine; several nodes: a shared file system).

Not FSDP: every worker holds the whole base model (it must fit one device).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hyflow.controller import Dispatch, RayResourcePool, Worker, ensure_ray, make_worker_group, register
from hyflow.rollout.base import SamplingParams
from hyflow.serve.host import (
    Datum,
    HostBase,
    LoraSpec,
    ModelHost,
    SampleAsk,
    ServeError,
    check_adam,
    checked_loss_settings,
)


def _guarded(call):
    """A worker's answer: ("ok", result) or ("error", message, status) for a request the client must fix."""
    try:
        return ("ok", call())
    except ServeError as exc:
        return ("error", str(exc), exc.status)


class ServeWorker(Worker):
    """One replica: a `ModelHost` on this worker's device."""

    def __init__(self, model_path: str, name: str, store: str, dtype: str, max_runs: int, max_forward_tokens: int,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self._settings = dict(model_path=model_path, name=name, store=store, dtype=dtype, max_runs=max_runs,
                              max_forward_tokens=max_forward_tokens)
        self.host: ModelHost | None = None
        self._before: dict[str, dict] = {}

    @register(Dispatch.REPLICATE)
    def init_model(self) -> int:
        if self.world_size > 1:
            self.init_process_group()
        settings = self._settings
        self.host = ModelHost(settings["model_path"], name=settings["name"], store=settings["store"],
                              device=str(self.device), dtype=settings["dtype"], max_runs=settings["max_runs"],
                              max_forward_tokens=settings["max_forward_tokens"])
        return self.host.vocab_size

    @register(Dispatch.REPLICATE)
    def create_run(self, owner: str, run_id: str, base_model: str, lora: LoraSpec):
        return _guarded(lambda: self.host.create_run(owner, run_id, base_model, lora).run_id)

    @register(Dispatch.DIRECT)
    def forward_backward(self, run_id: str, data: list[Datum], loss_fn: str, config: dict | None,
                         forward_only: bool):
        run = self.host.runs[run_id]
        if not forward_only:
            self._before[run_id] = {n: None if p.grad is None else p.grad.clone() for n, p in run.params.items()}
        if not data:
            return ("ok", ([], 0.0))

        def call():
            outputs, metrics = self.host.forward_backward(run, data, loss_fn, config, forward_only=forward_only)
            return outputs, metrics["loss:sum"]

        return _guarded(call)

    @register(Dispatch.REPLICATE)
    def rollback(self, run_id: str) -> None:
        """Gradients as before the last forward_backward (another worker's shard of it failed)."""
        before = self._before.pop(run_id, None)
        if before is not None and run_id in self.host.runs:
            for n, p in self.host.runs[run_id].params.items():
                p.grad = before[n]

    @register(Dispatch.REPLICATE)
    def optim_step(self, run_id: str, hyper: dict):
        run = self.host.runs[run_id]
        self._before.pop(run_id, None)
        if self.world_size > 1:
            import torch.distributed as dist

            names = sorted(run.params)
            params = [run.params[n] for n in names]
            # a parameter no rank has a gradient for stays without one (AdamW skips it, as in one process)
            present = torch.tensor([float(p.grad is not None) for p in params],
                                   device=params[0].device if params else "cpu")  # nccl reduces device tensors
            dist.all_reduce(present)
            for p, anywhere in zip(params, present.tolist(), strict=True):
                if anywhere:
                    grad = p.grad if p.grad is not None else torch.zeros_like(p)
                    dist.all_reduce(grad)
                    p.grad = grad
        return _guarded(lambda: self.host.optim_step(run, **hyper))

    @register(Dispatch.RANK_ZERO)
    def save(self, run_id: str, name: str, kind: str, optimizer: bool, overwrite: bool, user_metadata: dict | None):
        return _guarded(lambda: self.host.save(self.host.runs[run_id], name, kind=kind, optimizer=optimizer,
                                               overwrite=overwrite, user_metadata=user_metadata))

    @register(Dispatch.REPLICATE)
    def load(self, run_id: str, directory: str, state: dict, optimizer: bool, tinker_path: str):
        return _guarded(lambda: self.host.load(self.host.runs[run_id], Path(directory), state, optimizer=optimizer,
                                               tinker_path=tinker_path))

    @register(Dispatch.REPLICATE)
    def unload(self, run_id: str) -> None:
        run = self.host.runs.get(run_id)
        if run is not None:
            self.host.unload(run)

    @register(Dispatch.DIRECT)
    def sample(self, asks: list[SampleAsk], params: SamplingParams, path: str | None, owner: str):
        if not asks:
            return ("ok", [])

        def call():
            adapter = self.host.sampler_weights(path, owner) if path is not None else None
            return self.host.sample(asks, params, adapter)

        return _guarded(call)


@dataclass
class RemoteRun:
    """The driver's record of a run whose adapter lives on every worker."""

    run_id: str
    owner: str
    lora: LoraSpec
    last_request: float = field(default_factory=time.time)
    steps: int = 0
    closing: bool = False


class ReplicatedHost(HostBase):
    """The ModelHost interface over N replicas on Ray workers (module docstring)."""

    def __init__(self, model_path: str | Path, *, name: str, store: str | Path, workers: int, device: str = "cpu",
                 dtype: str = "float32", max_runs: int = 64, max_forward_tokens: int = 16384,
                 cpus_per_worker: float = 1.0) -> None:
        from transformers import AutoConfig

        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        super().__init__(model_path, name=name, store=store, max_runs=max_runs, max_forward_tokens=max_forward_tokens)
        self.config = AutoConfig.from_pretrained(self.model_path)
        self.arch = (getattr(self.config, "architectures", None) or [type(self.config).__name__])[0]
        self.context_length = getattr(self.config, "max_position_embeddings", None)
        self.workers = workers
        self._started_ray = ensure_ray()
        use_gpu = device.startswith("cuda")
        self.pool = RayResourcePool(1, workers, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker,
                                    name="hyflow-serve")
        self.group = make_worker_group("ray", ServeWorker, self.model_path, name, str(self.store), dtype, max_runs,
                                       max_forward_tokens, world_size=workers, pool=self.pool)
        self.vocab_size = self.group.init_model()[0]

    def close(self) -> None:
        from hyflow.controller.resources import shutdown_ray

        self.group.shutdown()
        self.pool.remove()
        if self._started_ray:
            shutdown_ray()

    # ------------------------------------------------------------------ runs
    def _live(self, run: RemoteRun) -> None:
        if self.runs.get(run.run_id) is not run:
            raise ServeError(f"no training run {run.run_id!r}: it was unloaded before this call ran", 404)

    def create_run(self, owner: str, run_id: str, base_model: str, lora: LoraSpec) -> RemoteRun:
        existing = self._check_new_run(owner, run_id, base_model, lora)
        if existing is not None:
            return existing
        seeded = lora if lora.seed is not None else dataclasses.replace(lora, seed=random.getrandbits(31))
        _all_ok(self.group.create_run(owner, run_id, base_model, seeded))  # one seed: equal replicas
        run = RemoteRun(run_id, owner, lora)
        self.runs[run_id] = run
        return run

    def unload(self, run: RemoteRun) -> None:
        if self.runs.get(run.run_id) is not run:
            return
        del self.runs[run.run_id]
        self.group.unload(run.run_id)

    # ------------------------------------------------------------------ training
    def forward_backward(self, run: RemoteRun, data, loss_fn: str, loss_fn_config: dict | None, *,
                         forward_only: bool):
        self._live(run)
        checked_loss_settings(loss_fn, loss_fn_config)
        checked = [self._check_datum(i, d, loss_fn) for i, d in enumerate(data)]
        if not checked:
            raise ServeError("forward_backward got no data")
        shards = _split(checked, [1] * len(checked), self.workers)
        n = self.workers
        answers = self.group.forward_backward([run.run_id] * n, shards, [loss_fn] * n, [loss_fn_config] * n,
                                              [forward_only] * n)
        failed = [a for a in answers if a[0] == "error"]
        if failed:
            if not forward_only:
                self.group.rollback(run.run_id)
            raise ServeError(failed[0][1], failed[0][2])
        return [o for a in answers for o in a[1][0]], {"loss:sum": sum(a[1][1] for a in answers)}

    def optim_step(self, run: RemoteRun, **hyper) -> dict[str, float]:
        self._live(run)
        check_adam(**hyper)  # before any all-reduce: a refused step must leave the gradients as they are
        metrics = _all_ok(self.group.optim_step(run.run_id, hyper))[0]
        run.steps += 1
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self, run: RemoteRun, name: str, *, kind: str, optimizer: bool, overwrite: bool = True,
             user_metadata: dict | None = None) -> str:
        self._live(run)
        self._dir(run, kind, name)  # the name's check
        return _all_ok([self.group.save(run.run_id, name, kind, optimizer, overwrite, user_metadata)])[0]

    def load(self, run: RemoteRun, directory: Path, state: dict, *, optimizer: bool, tinker_path: str) -> None:
        self._live(run)
        _all_ok(self.group.load(run.run_id, str(directory), state, optimizer, tinker_path))
        run.steps = int(state.get("steps", 0))

    # ------------------------------------------------------------------ sampling
    def sampler_weights(self, tinker_path: str, owner: str) -> tuple[str, str]:
        self.resolve(tinker_path, owner)  # 404 here for a path this key cannot read
        return tinker_path, owner

    def sample(self, asks: list[SampleAsk], params: SamplingParams, adapter: tuple[str, str] | None):
        for ask in asks:
            self.check_prompt(ask.prompt, ask.max_tokens)
        path, owner = adapter if adapter is not None else (None, "")
        shards = _split(asks, [a.num_samples for a in asks], self.workers)
        n = self.workers
        answers = _all_ok(self.group.sample(shards, [params] * n, [path] * n, [owner] * n))
        return [samples for answer in answers for samples in answer]


def _split(items: list, weights: list[int], parts: int) -> list[list]:
    """`items` in order, cut into `parts` contiguous shards of about equal total weight (some may be empty)."""
    total = sum(weights)
    shards: list[list] = [[] for _ in range(parts)]
    done = 0
    for item, weight in zip(items, weights, strict=True):
        shard = min(parts - 1, done * parts // max(total, 1))
        shards[shard].append(item)
        done += weight
    return shards


def _all_ok(answers: list) -> list:
    failed = [a for a in answers if a[0] == "error"]
    if failed:
        raise ServeError(failed[0][1], failed[0][2])
    return [a[1] for a in answers]
