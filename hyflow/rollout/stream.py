"""Trajectories that outlive one call: the driver of every rollout, synchronous or asynchronous.

A synchronous rollout (`AgentLoopManager.generate`) is the degenerate case of the stream: submit every prompt,
advance until all are finished, close (whole requests, the batch assembled on the prompts as they came); the
asynchronous modes (`async_training.mode`) keep the stream open between the trainer's calls.

`RolloutStream` keeps the agent loop's trajectories alive between calls. The trainer's scheduler `submit`s
prompts (each with a group tag, the prompt's admission number) and calls `advance(need)`, which decodes until
`need` more prompts have all their `rollout.n` samples finished, or nothing is in flight, and returns those
groups as verl's rollout Batch. Between two calls the trainer may push new weights (`set_version` after the
engine's `update_weights`): trajectories in flight then continue under the new weights (a partial rollout).

Segments. A generation request of a trajectory is decoded `chunk_tokens` at a time: each engine call gives every
waiting request at most that many new tokens; a request that neither stopped nor used its budget goes back to
the queue with its tokens so far appended to its prompt, transparently to the agent loop (verl's server resumes
an interrupted request the same way). So weights can change inside one assistant turn, and every token keeps
the policy version and the log-prob it was sampled with: the batch's `rollout_versions` [N, R] holds the
version of each model token (-1 elsewhere), `rollout_log_probs` the sampling log-probs, which the trainer's
off-policy correction compares with its own.

Deterministic. Under the barrier policy (`TurnServer`, hyflow.rollout.agent_server) the stream decodes only when
every live trajectory waits for the engine, requests in trajectory order, engine call k seeded with seed + k * SEED_STRIDE; so the samples depend on the
seed, the submitted prompts and when the weights changed, never on timing. It runs on an event loop of its own,
driven only inside `advance` (a breakpoint in an agent loop or tool stops the whole process, as usual).

Abort and resume (`rollout.agent.batching=continuous`, engines with a token stream: vllm, hf). Every request goes to
the engine's stream the moment its trajectory asks and runs with its whole budget, joining the running batch at
the next engine step (`TurnServer`'s continuous policy). When `advance` has its prompts, the requests still running are
aborted: each keeps the tokens (and log-probs) it produced, and the stream closes, so the engine is idle while the
trainer pushes weights. The next `advance` resubmits each with its tokens appended to its prompt and what is left
of its budget (verl's fully-async rollouter pauses and resumes its server the same way). A weight update thus
lands wherever each request was, never waiting for a segment boundary, and no engine call is cut short of work;
the price is determinism: where a request was aborted depends on timing, so the samples do too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from hyflow.batch import Batch
from hyflow.rollout.agent_loop import (
    AGENT_LOOPS,
    AgentLoopOutput,
    prompt_rows,
    sampling_dict,
)
from hyflow.rollout.agent_server import SEGMENT_STRIDE, ServerHandle, TurnServer  # noqa: F401 (SEGMENT_STRIDE: tests)
from hyflow.rollout.base import SamplingParams
from hyflow.rollout.output import position_ids_from_mask
from hyflow.tools.runner import DaemonExecutor

# what the stream adds to an agent loop's Batch (a synchronous rollout drops them)
ASYNC_COLUMNS = ("rollout_versions", "async_tag", "async_admitted_version")
ASYNC_METRICS = ("async/rollout_tokens", "async/continued_segments")


@dataclass
class _Group:
    """One admitted prompt and its n trajectories."""

    tag: int
    prompt: Batch  # the prompt's row, left-padded to the stream's prompt width
    name: str
    first_index: int
    admitted_version: int
    outputs: list[AgentLoopOutput | None]


class RolloutStream:
    """The agent loop's trajectories, kept alive across calls (see the module docstring); also the driver of a
    synchronous rollout (`AgentLoopManager.generate`: submit every prompt, advance until all are finished).

    chunk_tokens: the segment length of the barrier server (None: whole requests, no segments).
    prompts: the whole prompt batch of a synchronous rollout (its tags are its row numbers): first turns reuse its
    padded rows and the rollout Batch is assembled on it. response_length: a trajectory's token budget (default
    `params.max_new_tokens`). progress(stage, done, total, unit, detail): called as trajectories finish.
    on_finished(tag, sample, output): called with each trajectory's AgentLoopOutput the moment it ends, inside the
    stream's event loop (the reward loop, `hyflow.rewards.reward_loop`, scores it while the others still run); it
    must return quickly and change nothing."""

    def __init__(self, manager, params: SamplingParams, *, chunk_tokens: int | None = None,
                 prompt_width: int, prompts: Batch | None = None, response_length: int | None = None,
                 progress: Callable[..., None] | None = None,
                 on_finished: Callable[[int, int, AgentLoopOutput], None] | None = None) -> None:
        self.manager, self.params = manager, params
        self._on_finished = on_finished  # (prompt tag, sample, output) as each trajectory ends (the reward loop)
        self.prompt_width = int(prompt_width)
        self.response_length = int(params.max_new_tokens if response_length is None else response_length)
        self.loop = asyncio.new_event_loop()
        # asyncio.to_thread in an agent loop or tool: daemon threads, never joined, so a call left blocked neither
        # holds `close` nor the interpreter's exit
        self._executor = DaemonExecutor("hyflow-agent-thread")
        self.loop.set_default_executor(self._executor)
        turn_params = manager.turn_params(params)
        batching = manager.config.agent.batching
        if batching == "eager" and prompts is None:
            raise ValueError(f"actor_rollout_ref.rollout.agent.batching={batching} has no asynchronous rollout stream: "
                             "use barrier (deterministic segments) or continuous (abort/resume)")
        self.server = TurnServer.over(manager.engine, turn_params, manager.eos_token_ids, policy=batching,
                                      pad_token_id=manager.pad_token_id, prompts=prompts,
                                      chunk=None if batching == "continuous" else chunk_tokens)
        self.server._ready = asyncio.Event()
        self._prompts = prompts
        self._progress = progress
        self._finished = 0
        self.groups: dict[int, _Group] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.next_index = 0
        self._loop_kwargs: dict = {}  # loop class -> what its start_rollout gave (openai_agent: its endpoint)
        self._loop_starting: dict = {}
        self._counted = (0, 0, 0.0, 0, 0)  # the server's counters at the end of the last advance (`_counters`)

    # ------------------------------------------------------------------ the trainer's calls
    @property
    def version(self) -> int:
        return self.server.version

    def set_version(self, version: int) -> None:
        """The engine now holds the weights of policy version `version` (after its update_weights)."""
        self.server.version = int(version)

    def in_flight(self) -> list[int]:
        """Tags of the admitted prompts that are not finished yet, in admission order."""
        return sorted(self.groups)

    def submit(self, prompts: Batch, tags: Sequence[int]) -> None:
        """Admit `prompts` (one tag each): their n trajectories start at the next `advance`."""
        if len(tags) != len(prompts):
            raise ValueError(f"submit got {len(prompts)} prompts but {len(tags)} tags")
        names = self.manager.agent_names(prompts)  # an unknown loop name fails here, before anything runs
        rows = prompt_rows(prompts)
        padded = left_pad_prompts(prompts, self.prompt_width, self.manager.pad_token_id)
        n = self.params.n
        sampling = sampling_dict(self.params)
        for i, tag in enumerate(tags):
            tag = int(tag)
            if tag in self.groups:
                raise ValueError(f"prompt tag {tag} is already in flight")
            group = _Group(tag, padded[i : i + 1], names[i], self.next_index, self.version, [None] * n)
            self.groups[tag] = group
            for sample in range(n):
                index = self.next_index
                self.next_index += 1
                self.server.live += 1
                self.tasks[index] = self.loop.create_task(self._trajectory(group, sample, index, rows[i], sampling))

    def advance(self, need: int, max_calls: int | None = None) -> Batch | None:
        """Decode until `need` more prompts are finished (all n samples), nothing is in flight, or `max_calls`
        engine calls were made; return the finished groups as one rollout Batch (admission order), or None when
        none finished. Columns beyond an engine's: `rollout_versions` [N, R], `async_tag` [N] (the prompt's tag),
        `async_admitted_version` [N]."""
        return self._run(self._advance(max(1, int(need)), max_calls))

    def reset(self) -> list[int]:
        """Cancel every trajectory in flight; returns the tags dropped (their prompts must be submitted again)."""
        dropped = self.in_flight()
        for task in self.tasks.values():
            task.cancel()
        if self.tasks:
            self._run(asyncio.gather(*self.tasks.values(), return_exceptions=True))
        self.tasks.clear()
        self.groups.clear()
        self.server.shutdown()
        self.server.live = 0
        return dropped

    def close(self) -> None:
        self.reset()
        for loop_class, kwargs in self._loop_kwargs.items():
            with contextlib.suppress(Exception):  # an endpoint that fails to stop must not hide the close
                self._run(loop_class.end_rollout(kwargs))
        self._loop_kwargs = {}
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.loop.close()

    # ------------------------------------------------------------------ inside the loop
    def _run(self, coroutine):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self.loop.run_until_complete(coroutine)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyflow-stream") as pool:  # inside Jupyter
            return pool.submit(self.loop.run_until_complete, coroutine).result()

    async def _trajectory(self, group: _Group, sample: int, index: int, row: dict, sampling: dict) -> None:
        try:
            media = {key: row[key] for key in ("multi_modal_inputs", "multi_modal_data") if row.get(key)}
            handle = ServerHandle(self.server, index, group.tag, self.response_length, media)
            agent = self.manager.make_agent(group.name, handle, await self._started_loop_kwargs(group.name))
            group.outputs[sample] = await agent.run(sampling, **row)
            if self._on_finished is not None:
                self._on_finished(group.tag, sample, group.outputs[sample])
        finally:
            self.server.finished_one()
            self._finished += 1
            if self._progress is not None:
                self._progress("rollout", self._finished, self.next_index, "trajectories",
                               f"{self.server.tokens} tokens")

    async def _started_loop_kwargs(self, name: str) -> dict:
        """The loops' per-rollout kwargs; a loop class with `start_rollout` (openai_agent) is started once, on its
        first trajectory in this stream, and ended by `close`."""
        loop_class = AGENT_LOOPS.get(name)
        if hasattr(loop_class, "start_rollout") and loop_class not in self._loop_kwargs:
            if loop_class not in self._loop_starting:
                self._loop_starting[loop_class] = asyncio.ensure_future(loop_class.start_rollout(self.manager,
                                                                                                 self.params))
            # shielded: a trajectory cancelled while it waits must not cancel the start the others wait for
            self._loop_kwargs[loop_class] = await asyncio.shield(self._loop_starting[loop_class])
        return self._loop_kwargs

    async def _settle(self) -> None:
        """Let every runnable trajectory run until each waits for the engine or has finished."""
        ready = self.server._ready
        while not self.server.quiescent():
            ready.clear()
            self.server._check()
            await ready.wait()

    def _failed(self) -> None:
        for task in self.tasks.values():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()

    def _counters(self) -> tuple:
        server = self.server
        return server.calls, len(server.batch_sizes), server.seconds, server.tokens, server.continued

    async def _advance(self, need: int, max_calls: int | None) -> Batch | None:
        # counted from the end of the previous advance: trajectories started by `submit` run (and a streaming
        # engine answers them) as soon as the loop runs, before this coroutine's first line
        calls, sizes, seconds, tokens, continued = self._counted
        done: list[_Group] = []
        self.server.resume()
        try:
            while True:
                await self._settle()
                self._failed()
                for tag in sorted(self.groups):
                    group = self.groups[tag]
                    if all(out is not None for out in group.outputs):
                        done.append(self.groups.pop(tag))
                        for index in range(group.first_index, group.first_index + len(group.outputs)):
                            self.tasks.pop(index, None)
                if len(done) >= need or self.server.live <= 0 or (max_calls is not None
                                                                    and self.server.calls - calls >= max_calls):
                    break
                await self.server.step()
        finally:
            await self.server.pause()  # continuous: the engine idle (and its stream closed) until the next advance
        self._counted = self._counters()
        if not done:
            return None
        stats = SimpleNamespace(calls=self.server.calls - calls, batch_sizes=self.server.batch_sizes[sizes:],
                                seconds=self.server.seconds - seconds)
        batch = self._assemble(done, stats)
        batch.meta["metrics"].update({"async/rollout_tokens": float(self.server.tokens - tokens),
                                      "async/continued_segments": float(self.server.continued - continued)})
        return batch

    def _assemble(self, groups: list[_Group], stats) -> Batch:
        n = self.params.n
        whole = self._prompts
        if whole is not None and sorted(g.tag for g in groups) == list(range(len(whole))):
            groups = sorted(groups, key=lambda g: g.tag)  # a synchronous rollout: its batch as it came, in its order
            prompts = whole
        else:
            prompts = Batch.concat([g.prompt for g in groups])
        outputs = [out for g in groups for out in g.outputs]
        names = [g.name for g in groups]
        # the manager's assembly reads names per prompt row
        batch = self.manager.assemble(prompts, self.params, outputs, names, stats)
        versions = torch.full(batch["responses"].shape, -1, dtype=torch.long)
        mask = batch["response_mask"].bool()
        for row, (group, sample) in enumerate((g, s) for g in groups for s in range(n)):
            positions = mask[row].nonzero().flatten()
            recorded = self.server.token_versions.pop(group.first_index + sample, [])
            count = min(len(recorded), len(positions))
            if count:
                versions[row, positions[:count]] = torch.tensor(recorded[:count], dtype=torch.long)
            if count < len(positions):  # tokens the recorder did not see (a custom loop's): the newest version
                versions[row, positions[count:]] = recorded[-1] if recorded else self.version
        batch["rollout_versions"] = versions
        batch["async_tag"] = torch.tensor([g.tag for g in groups for _ in range(n)], dtype=torch.long)
        batch["async_admitted_version"] = torch.tensor([g.admitted_version for g in groups for _ in range(n)],
                                                       dtype=torch.long)
        return batch


def left_pad_prompts(prompts: Batch, width: int, pad_token_id: int) -> Batch:
    """`prompts` with `input_ids` / `attention_mask` / `position_ids` left-padded to `width` columns (so prompts
    admitted at different times concatenate); an error when a prompt is wider."""
    current = prompts["input_ids"].shape[1]
    if current > width:
        raise ValueError(f"a prompt batch is {current} tokens wide, more than the rollout's prompt width {width} "
                         "(actor_rollout_ref.rollout.prompt_length = data.max_prompt_length); raise it")
    out = prompts.clone()
    if current == width:
        return out
    extra = width - current
    ids = torch.full((len(prompts), extra), pad_token_id, dtype=prompts["input_ids"].dtype)
    zeros = torch.zeros((len(prompts), extra), dtype=prompts["attention_mask"].dtype)
    out["input_ids"] = torch.cat([ids, prompts["input_ids"]], dim=-1)
    out["attention_mask"] = torch.cat([zeros, prompts["attention_mask"]], dim=-1)
    if prompts["position_ids"].dim() == 3:  # a vision-language model's [B, 4, P]: padding positions are 0
        pad = torch.zeros((len(prompts), prompts["position_ids"].shape[1], extra), dtype=torch.long)
        out["position_ids"] = torch.cat([pad, prompts["position_ids"]], dim=-1)
    else:
        out["position_ids"] = position_ids_from_mask(out["attention_mask"])
    return out
