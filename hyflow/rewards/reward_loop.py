"""The reward loop (verl's `reward_model.use_reward_loop`): score each trajectory the moment it finishes, while the
rest of the rollout is still generating, so a step's scoring time overlaps generation.

How it runs. The driver pads the prompts to the data-parallel size itself (as the dispatch would, so every rank
draws the same samples as without the loop) and tags each prompt with its row (`ROW_COLUMN`; padding rows -1).
`group.generate_sequences(prompts, params, reward_channel=channel)` runs on a thread of the driver; on every rank the
rollout stream calls the channel's callback as each trajectory ends, which puts (rollout row, response token ids up
to the valid length, the row's extra_info, whether the agent loop scored it) into a queue: `queue.Queue` in one
process, a `ray.util.queue.Queue` (an actor) when the workers are Ray actors. The driver's thread (the main thread,
so in-process scoring keeps its SIGALRM timeout) takes whatever has arrived, decodes it and gives it to the reward
manager's own `score_calls` (its process pool, timeouts and failures, `hyflow.rewards.pool`), and repeats until
generation has ended and the queue is empty.

Identical to the batch path. When the rollout Batch is back, the manager builds every row's call from the Batch
exactly as its batch path does (`sample_calls`); a row whose call is not the one the loop scored (it never arrived,
or its text or extra_info differ) is scored again now (`reward/loop_rescored` counts them; 0 in a normal run), and
the RewardResult is assembled by the manager's `finish` (the same failure accounting, `max_error_fraction`, DAPO's
overlong penalty on the final lengths) through `score_with_agent_rewards` (rows an agent loop scored keep that).

Metrics: `timing_s/reward`, seconds spent scoring (the batch path reports the same key); `reward/overlap_share`, the
share of those seconds that ran while generation was still running; `reward/loop_rescored`.

Not served (the trainer falls back to the batch path and says so once): a manager that scores whole batches only
(`streams = False`: `batch`, the judge's and the `http` managers), a reward model without a rule function (nothing
to score per sample), and the asynchronous training modes (their scheduler scores). ReMax's greedy baselines (a
second rollout) and validation are scored after their rollout as before.

Overlap needs trajectories that finish at different times: multi-turn loops, `rollout.agent.batching=continuous`
or `eager`, several engine batches (`rollout.max_num_seqs`), several ranks. A single-turn rollout with the default
`barrier` batching comes back from one engine call, every sample at once: the loop then scores exactly what the
batch path would, at about the same time.
"""

from __future__ import annotations

import queue as queue_module
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hyflow.batch import Batch
from hyflow.rewards.managers import RewardResult, score_with_agent_rewards
from hyflow.rewards.pool import Outcome

ROW_COLUMN = "reward_loop_row"  # a prompt's row in the driver's prompt batch; -1 on padding rows


@dataclass
class FinishedSample:
    """One finished trajectory, as a worker sends it: its row of the rollout Batch and what scoring needs."""

    row: int
    response_ids: list[int]
    extra_info: Any
    agent_scored: bool


class RewardChannel:
    """Where the workers put finished trajectories: a `queue.Queue` in one process, a `ray.util.queue.Queue` across
    Ray actors (this object is pickled to them with it)."""

    def __init__(self, queue) -> None:
        self.queue = queue

    def on_finished(self, prompts: Batch, params, extra_info_of: Callable) -> Callable:
        """The stream's per-trajectory callback on a worker holding `prompts` (its rows tagged with ROW_COLUMN):
        trajectory (tag, sample) is row `ROW_COLUMN[tag] * n + sample` of the driver's rollout Batch."""
        rows = [int(r) for r in prompts[ROW_COLUMN]]
        infos = list(prompts["extra_info"]) if "extra_info" in prompts else [{}] * len(prompts)
        n, width = int(params.n), int(params.max_new_tokens)

        def on_finished(tag: int, sample: int, output) -> None:
            if rows[tag] < 0:  # a padding row: its samples are dropped from the Batch
                return
            self.queue.put(FinishedSample(rows[tag] * n + sample, list(output.response_ids[:width]),
                                          extra_info_of(infos[tag], output), output.reward_score is not None))

        return on_finished


def _drain(channel_queue, wait_s: float) -> list[FinishedSample]:
    """Everything in the queue now, waiting up to `wait_s` for the first item."""
    if hasattr(channel_queue, "get_nowait_batch"):  # ray.util.queue.Queue: two calls to its actor, no exceptions
        size = channel_queue.qsize()
        if not size:
            time.sleep(wait_s)
            size = channel_queue.qsize()
        return channel_queue.get_nowait_batch(size) if size else []
    items = []
    try:
        items.append(channel_queue.get(timeout=wait_s) if wait_s else channel_queue.get_nowait())
        while True:
            items.append(channel_queue.get_nowait())
    except queue_module.Empty:
        pass
    return items


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values whose == is not a bool (numpy arrays inside a dict)
        return a is b


@dataclass
class LoopScores:
    """What the loop scored during one rollout, and when; `result(batch)` turns it into the batch's RewardResult."""

    manager: Any
    calls: dict[int, dict] = field(default_factory=dict)  # rollout row -> the call the loop scored
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    intervals: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each scoring round
    generation_end: float = float("inf")

    def result(self, batch: Batch) -> RewardResult:
        """The RewardResult the batch path gives for `batch`, from the loop's outcomes (rows it missed, or scored
        from another call than the Batch's, are scored now)."""
        manager = self.manager
        texts, lengths = manager.decode_responses(batch)
        calls = manager.sample_calls(batch, texts)
        agent = list(batch["agent_reward"]) if "agent_reward" in batch else [None] * len(batch)
        missing = [i for i, call in enumerate(calls) if agent[i] is None and not self._matches(i, call)]
        start = time.perf_counter()
        if missing:
            for i, outcome in zip(missing, manager.score_calls([calls[i] for i in missing])):
                self.calls[i], self.outcomes[i] = calls[i], outcome

        def score(rows_batch: Batch, rows: np.ndarray) -> RewardResult:
            return manager.finish(rows_batch, [self.outcomes[int(i)] for i in rows], [calls[int(i)] for i in rows],
                                  lengths[torch.as_tensor(rows)])

        result = score_with_agent_rewards(manager, batch, score=score)
        self.intervals.append((start, time.perf_counter()))
        total = sum(end - begin for begin, end in self.intervals)
        overlapped = sum(max(0.0, min(end, self.generation_end) - begin) for begin, end in self.intervals)
        result.metrics.update({"timing_s/reward": total, "reward/overlap_share": overlapped / total if total else 0.0,
                               "reward/loop_rescored": float(len(missing))})
        return result

    def _matches(self, row: int, call: dict) -> bool:
        scored = self.calls.get(row)
        return scored is not None and scored.keys() == call.keys() and all(_same(scored[k], call[k]) for k in call)


def reward_loop_unsupported(manager, *, rule_scores: bool = True, async_mode: bool = False) -> str | None:
    """Why the reward loop cannot score this run's rollouts (the trainer then uses the batch path), or None.
    `rule_scores`: whether a reward function scores the samples (False: a reward model alone scores them)."""
    if async_mode:
        return ("the asynchronous training modes (async_training.mode) score the batches their scheduler hands over; "
                "the reward loop serves the synchronous rollout")
    if not rule_scores:
        return "the reward model alone scores the samples (reward_model.enable without a reward function)"
    if not getattr(manager, "streams", False):
        return (f"the reward manager {type(manager).__name__} scores a whole batch at once (its `streams` is False: "
                "`batch` calls its function once per batch, a judge makes one engine call), so a sample cannot be "
                "scored alone")
    return None


def _make_queue(executor: str):
    if executor == "ray":
        from ray.util.queue import Queue

        return Queue(actor_options={"num_cpus": 0})
    return queue_module.Queue()


def generate_and_score(manager, group, prompts: Batch, params, *, executor: str = "local",
                       poll_s: float = 0.02) -> tuple[Batch, LoopScores]:
    """`group.generate_sequences(prompts, params)` with every trajectory scored by `manager` as it finishes; returns
    the rollout Batch (the same rows as without the loop) and the LoopScores whose `result(batch)` is the batch's
    RewardResult. `group`: the actor's worker group (or its role view); `executor`: "local" or "ray"."""
    size = len(prompts)
    padded, pad_count = prompts.pad_to_multiple(getattr(group, "world_size", 1))
    padded = padded[:]
    padded[ROW_COLUMN] = torch.cat([torch.arange(size), torch.full((pad_count,), -1)]).long()
    channel_queue = _make_queue(executor)
    channel = RewardChannel(channel_queue)
    n = int(params.n)
    data_sources = manager._column(prompts, "data_source")
    ground_truths = manager._ground_truths(prompts)
    scores = LoopScores(manager)
    done: dict = {}

    def generate() -> None:
        try:
            done["batch"] = group.generate_sequences(padded, params, reward_channel=channel)
        except BaseException as exc:  # raised again on the driver's thread
            done["error"] = exc
        finally:
            scores.generation_end = time.perf_counter()

    thread = threading.Thread(target=generate, name="hyflow-reward-loop-generate", daemon=True)
    thread.start()
    try:
        while True:
            finished = not thread.is_alive()  # read before draining: nothing arrives after the thread ends
            items = _drain(channel_queue, 0.0 if finished else poll_s)
            rows, calls = [], []
            for item in items:
                if item.agent_scored:
                    continue
                text = manager.tokenizer.decode(item.response_ids, skip_special_tokens=True)
                prompt = item.row // n
                rows.append(item.row)
                calls.append(manager.sample_call(data_sources[prompt], text, ground_truths[prompt], item.extra_info))
            if calls:
                start = time.perf_counter()
                for row, call, outcome in zip(rows, calls, manager.score_calls(calls)):
                    scores.calls[row], scores.outcomes[row] = call, outcome
                scores.intervals.append((start, time.perf_counter()))
            elif finished and not items:
                break
    finally:
        if executor == "ray":
            channel_queue.shutdown()
    thread.join()
    if "error" in done:
        raise done["error"]
    batch = done["batch"]
    if pad_count:
        batch = batch[: size * n]
    if ROW_COLUMN in batch:
        batch.pop(ROW_COLUMN)
    return batch, scores
