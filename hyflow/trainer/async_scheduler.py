"""Asynchronous training: the rollout generates the next samples while the trainer trains on the current ones.

`async_training.mode` picks the schedule; both run through this one scheduler, with the synchronous trainer's
step semantics (a step trains on `data.train_batch_size` prompts x `rollout.n` samples, the same losses):

- `one_step_off`: while step k trains, the rollout generates step k+1's prompts whole, with the weights from
  before update k; the new weights reach the rollout when it is done. Every sample is exactly one version old
  (none at step 1).
- `fully_async`: the rollout keeps up to ceil((1 + staleness_threshold) x train_batch_size) prompts admitted and
  not yet trained (in flight, or finished and waiting in the buffer); the trainer takes a batch as soon as one is
  complete. Weights are pushed every `trigger_parameter_sync_step` updates; with `partial_rollout` a push reaches
  the trajectories in flight between two segments of `partial_rollout_chunk` tokens (they continue under the new
  weights), without it a push waits until nothing is in flight and no prompt is admitted meanwhile.

Versions. The trainer's version v counts actor updates. Every model token carries the version of the weights that
sampled it (`rollout_versions`), and its log-prob under them (`rollout_log_probs`); a sample's staleness at
training time is v - its oldest token's version. The trainer takes complete prompts oldest first. The bound
`max_staleness` S holds by `stale_policy`: `wait` holds the update v -> v+1 while a prompt in flight was
admitted before version v+1-S (the rollout keeps working meanwhile: the trainer waits for it) and admits at most
(S + 1) x train_batch_size prompts beyond the trained ones; `drop` trains as soon as a batch is ready and drops
prompts past the bound (`async/dropped_stale`). Either way a sample past the bound is never trained.

The order of everything is fixed by the driver, never by timing: take a batch (running the rollout alone while
none is ready: the trainer waits), admit prompts, start the rollout's next `advance` (`group.submit`), train,
collect the rollout's result, push weights when due. With the `ray` executor and a rollout pool of its own
(`rollout.n_gpus_per_node` > 0) the rollout's `advance` runs in its processes while the trainer trains; with
the rollout in the trainer's process (`local`), `submit` runs it first, then training: the same samples in the
same order, one process, breakpoints anywhere.

Inputs. The scheduler sees no trainer: it gets the prompt loader (`next_ids`, `collate_ids`), the rollout's group
view (the stream methods), the `async_training` settings, the few numbers of the run it needs (prompts per step,
samples per prompt, response and prompt lengths, critic warm-up steps, seed), a callable giving the sampling
params for a seed, and, for a rollout pool of its own, a callable exporting the actor's weights.

Checkpoints. The trainer's state holds the version and the ids of the prompts admitted but not trained yet;
on resume they are admitted again first (their partial or finished samples are not saved: they are generated
again, with the resumed weights). No prompt is lost or trained twice across a resume; the samples of those
prompts differ from an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.controller import WorkerError
from hyflow.rollout.base import SamplingParams


class AsyncRolloutError(RuntimeError):
    """The rollout side of an asynchronous run failed (a worker raised or died); the message says which and
    what to do."""


@dataclass
class _Live:
    """An admitted prompt: its loader id, when it was admitted, and its samples once finished."""

    tag: int
    prompt_id: tuple[int, int]
    admitted_version: int
    samples: Batch | None = None


class AsyncScheduler:
    """The driver side of asynchronous training (see the module docstring).

    `rollout`: the rollout's group view (stream_start, stream_submit, stream_advance, stream_load_weights or
    stream_sync_weights, stream_close); `loader`: the prompt loader; `settings`: the `async_training` section;
    `separate`: the rollout runs on a pool of its own (its weights then come from `export_weights()`, the actor's
    weight buckets); `batch_prompts`, `n`: prompts per training step and samples per prompt; `response_length`,
    `prompt_length`: the rollout's; `critic_warmup`: steps that train without an actor update; `seed`: the run's
    seed; `sampling_params(seed=...)`: the rollout's sampling params for a seed.
    """

    def __init__(self, rollout, loader, settings, *, separate: bool, batch_prompts: int, n: int,
                 response_length: int, prompt_length: int, critic_warmup: int, seed: int,
                 sampling_params: Callable[..., SamplingParams], export_weights: Callable[[], list | None]) -> None:
        at = settings
        self.rollout, self.loader, self.separate = rollout, loader, separate
        self.sampling_params, self.export_weights = sampling_params, export_weights
        self.seed, self.prompt_length = seed, prompt_length
        self.batch_prompts = batch_prompts
        self.n = n
        one_step = at.mode == "one_step_off"
        self.capacity = self.batch_prompts if one_step else math.ceil((1 + at.staleness_threshold) * self.batch_prompts)
        self.partial = False if one_step else at.partial_rollout
        self.chunk = response_length if one_step else (at.partial_rollout_chunk or max(1, math.ceil(response_length / 4)))
        self.trigger = 1 if one_step else at.trigger_parameter_sync_step
        self.max_staleness, self.policy = at.max_staleness, at.stale_policy
        self.warmup_steps = max(0, critic_warmup)  # steps that train without changing the version
        self.version = 0  # actor updates so far
        self.rollout_version = 0  # the weights the rollout holds
        self.next_tag = 0
        self.admitted = 0  # prompts admitted so far (a resumed run: the ones trained before, then its own)
        self.queue: deque[tuple[int, int]] = deque()  # prompt ids drawn from the loader, not admitted yet
        self.live: dict[int, _Live] = {}  # admitted, not trained (in flight or finished)
        self.stale_trained = 0  # samples trained with staleness > 0 (verl's count)

    # ------------------------------------------------------------------ start, state
    def start(self) -> None:
        """Start the rollout's stream and give it the trainer's current weights (after a resume: the resumed ones)."""
        params = self.sampling_params(seed=self.seed * 1_000_003 + self.version)
        self._rollout_call("starting", self.rollout.stream_start, params, self.chunk, self.prompt_length)
        self._push_weights({})

    def state_dict(self) -> dict:
        """Plain data: the version, and the ids of the prompts admitted but not trained, then the queued ones."""
        pending = [list(live.prompt_id) for _, live in sorted(self.live.items())] + [list(i) for i in self.queue]
        return {"version": self.version, "pending": pending, "stale_trained": self.stale_trained}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Resume at training step `step` from `state_dict()`'s data: the pending prompts are queued first."""
        self.version = self.rollout_version = int(state["version"])
        self.admitted = step * self.batch_prompts  # the pending ones are admitted again
        self.queue = deque(tuple(i) for i in state["pending"])
        self.stale_trained = int(state.get("stale_trained", 0))

    # ------------------------------------------------------------------ one training step
    def next_batch(self, metrics: dict) -> Batch:
        """The next training batch (train_batch_size prompts, oldest first), running the rollout alone while
        none can be taken; the time spent so is `async/trainer_wait_s`."""
        waited = 0.0
        dropped = 0
        while True:
            dropped += self._drop_stale()
            batch = self._take()
            if batch is not None:
                break
            start = time.perf_counter()
            pending = self.launch()
            if pending is None:
                raise RuntimeError(
                    f"asynchronous training stalled: {self._buffered()} of {self.batch_prompts} prompts finished, "
                    f"nothing in flight and no prompt may be admitted ({len(self.live)} admitted of a capacity of "
                    f"{self.capacity}); this is a bug in the scheduler: report it with the config")
            self.land(pending, metrics)
            waited += time.perf_counter() - start
        metrics["async/trainer_wait_s"] = waited
        metrics["async/dropped_stale"] = float(dropped)
        return batch

    def launch(self):
        """Admit prompts, then start the rollout's next advance; returns what `land` waits for (None when the
        rollout has nothing to do)."""
        self._admit()
        in_flight = [tag for tag, live in self.live.items() if live.samples is None]
        if not in_flight:
            return None
        need = max(1, self.batch_prompts - self._buffered())
        if self._push_due() and not self.partial:
            need = len(in_flight)  # drain: the push waits for every trajectory in flight
        return self._rollout_call("generating", self.rollout.submit, "stream_advance", need), time.perf_counter()

    def land(self, pending, metrics: dict) -> None:
        """Wait for the rollout's advance and put its finished prompts in the buffer."""
        if pending is None:
            return
        call, started = pending
        results = self._rollout_call("generating", call.result)
        self._rollout_metrics(results, time.perf_counter() - started, metrics)
        for batch, _busy_s in results:
            if batch is None:
                continue
            tags = batch["async_tag"].tolist()
            for tag in dict.fromkeys(tags):
                rows = [i for i, t in enumerate(tags) if t == tag]
                self.live[tag].samples = batch[rows]
        if self._push_due() and not self.partial and not self._in_flight():
            self._push_weights(metrics)  # a drained rollout takes the waiting weights at once

    def updated(self, actor_updated: bool, metrics: dict) -> None:
        """After the step's update: count the version, push the weights when due (and allowed)."""
        if actor_updated:
            self.version += 1
        metrics["async/version"] = float(self.version)
        if self._push_due() and (self.partial or not self._in_flight()):
            self._push_weights(metrics)
        metrics["async/rollout_version"] = float(self.rollout_version)
        metrics["async/buffer_fill"] = self._buffered() / self.capacity
        metrics["async/in_flight"] = float(sum(live.samples is None for live in self.live.values()))

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # a dead rollout worker has nothing left to close
            self.rollout.stream_close()

    # ------------------------------------------------------------------ internals
    def _rollout_call(self, doing: str, fn, *args):
        """`fn(*args)` on the rollout side; a failed or dead rollout worker stops the run with a named error."""
        try:
            return fn(*args)
        except WorkerError as err:
            where = "the rollout pool's worker" if self.separate else "the rollout in the trainer's worker"
            raise AsyncRolloutError(f"asynchronous training stopped: {where} failed while {doing} ({err}). "
                                    "Resume from the last checkpoint (trainer.resume_mode=auto; trainer.save_freq > 0 "
                                    "writes them)") from err

    def _in_flight(self) -> bool:
        return any(live.samples is None for live in self.live.values())

    def _buffered(self) -> int:
        return sum(live.samples is not None for live in self.live.values())

    def _push_due(self) -> bool:
        return self.version - self.rollout_version >= self.trigger

    def _admit(self) -> None:
        """Top the admitted prompts up to the capacity (none while a push waits for the rollout to drain)."""
        if self._push_due() and not self.partial:
            return
        room = self.capacity - len(self.live)
        if self.policy == "wait":
            # AReaL's admission bound: a prompt admitted at rollout version w is trained at a trainer version of at
            # most w + S, and the batches up to that version hold (w + S + 1) x batch prompts (plus the critic
            # warm-up's, which do not change the version); admitting more would leave one to go past the bound.
            slots = (self.rollout_version + self.max_staleness + 1 + self.warmup_steps) * self.batch_prompts
            room = min(room, slots - self.admitted)
        if room <= 0:
            return
        while len(self.queue) < room:
            self.queue.extend(self.loader.next_ids())
        ids = [self.queue.popleft() for _ in range(room)]
        tags = list(range(self.next_tag, self.next_tag + room))
        self.next_tag += room
        self.admitted += room
        prompts = self.loader.collate_ids(ids)
        for tag, prompt_id in zip(tags, ids):
            self.live[tag] = _Live(tag, prompt_id, self.rollout_version)
        self._rollout_call("admitting prompts", self.rollout.stream_submit, prompts, tags)

    def _staleness(self, live: _Live) -> int:
        versions = live.samples["rollout_versions"]
        model = versions[versions >= 0]
        oldest = int(model.min()) if model.numel() else live.admitted_version
        return self.version - oldest

    def _drop_stale(self) -> int:
        """Drop finished prompts past the bound (only ever reached with stale_policy=drop); returns how many."""
        stale = [tag for tag, live in self.live.items()
                 if live.samples is not None and self._staleness(live) > self.max_staleness]
        for tag in stale:
            del self.live[tag]
        return len(stale)

    def _take(self) -> Batch | None:
        """train_batch_size finished prompts, oldest first (oldest token version, then admission), or None when
        there are too few or (stale_policy=wait) training now would push a prompt in flight past the bound."""
        finished = sorted((live for live in self.live.values() if live.samples is not None),
                          key=lambda live: (-self._staleness(live), live.tag))
        if len(finished) < self.batch_prompts:
            return None
        if self.policy == "wait":
            oldest_allowed = self.version + 1 - self.max_staleness
            if any(live.samples is None and live.admitted_version < oldest_allowed for live in self.live.values()):
                return None
        chosen = sorted(finished[: self.batch_prompts], key=lambda live: live.tag)
        batch = _concat_rollouts([live.samples for live in chosen])
        for live in chosen:
            del self.live[live.tag]
        batch["uid"] = [f"async-{tag}" for tag in batch["async_tag"].tolist()]
        return batch

    def batch_metrics(self, batch: Batch) -> dict[str, float]:
        """Staleness and partial-rollout metrics of a training batch (hyflow's names, then verl's)."""
        versions = batch["rollout_versions"]
        model = versions >= 0
        big = torch.iinfo(torch.long).max
        oldest = torch.where(model, versions, big).min(-1).values
        newest = torch.where(model, versions, -1).max(-1).values
        has_tokens = model.any(-1)
        staleness = (self.version - oldest)[has_tokens].double()
        span = (newest - oldest)[has_tokens].double()
        stale = int((staleness > 0).sum())
        self.stale_trained += stale
        partial = float((span > 0).double().mean()) if span.numel() else 0.0
        return {"async/staleness/mean": float(staleness.mean()) if staleness.numel() else 0.0,
                "async/staleness/max": float(staleness.max()) if staleness.numel() else 0.0,
                "async/partial_share": partial,
                "fully_async/partial/partial_ratio": partial,
                "fully_async/partial/total_partial_num": float((span > 0).sum()),
                "fully_async/partial/max_partial_span": float(span.max()) if span.numel() else 0.0,
                "fully_async/count/stale_samples_processed": float(self.stale_trained)}

    def _rollout_metrics(self, results: list, seconds: float, metrics: dict) -> None:
        busy = max(busy_s for _, busy_s in results)
        parts = [batch.meta.get("metrics", {}) for batch, _ in results if batch is not None]
        for key in ("async/rollout_tokens", "async/continued_segments"):
            values = [p[key] for p in parts if key in p]
            if values:
                metrics[key] = metrics.get(key, 0.0) + float(np.sum(values))
        metrics["async/rollout_busy_s"] = metrics.get("async/rollout_busy_s", 0.0) + busy
        metrics["async/rollout_call_s"] = metrics.get("async/rollout_call_s", 0.0) + seconds

    def _push_weights(self, metrics: dict) -> None:
        """The trainer's current weights into the rollout's engine(s), tagged with the current version."""
        start = time.perf_counter()
        if self.separate:
            buckets = self.export_weights()
            if not buckets:
                raise RuntimeError("the actor exported no weights for the rollout pool")
            self._rollout_call("loading weights", self.rollout.stream_load_weights, buckets, self.version)
        else:
            self._rollout_call("loading weights", self.rollout.stream_sync_weights, self.version)
        self.rollout_version = self.version
        metrics["async/weight_sync_s"] = metrics.get("async/weight_sync_s", 0.0) + time.perf_counter() - start


def _concat_rollouts(parts: list[Batch]) -> Batch:
    """Concatenate rollout batches whose prompts were padded to the same width (the stream pads every prompt
    to the rollout's prompt width); `meta["metrics"]` of the parts is dropped (it was reported when they landed)."""
    stripped = []
    for part in parts:
        part = part[:]  # a view with its own meta
        part.meta = {k: v for k, v in part.meta.items() if k != "metrics"}
        stripped.append(part)
    return Batch.concat(stripped)
