"""The agent loop's engine seat: one `TurnServer` between the trajectories' generation requests and a token stream.

Every trajectory's request (`generate`: prompt ids, a budget) goes to the one server, which speaks only the
token-level protocol (`submit(TokenRequest) -> Future`, `abort`, `close`; `hyflow.rollout.base`) to a stream it
opens: the engine's own (`engine.open_stream`), or, for an engine that decodes fixed batches (`decode_batch`),
the one adapter `hyflow.rollout.batch_stream.BatchTokenStream`, which pads inside itself and decodes what was
submitted at each `flush`. The policy (`rollout.agent.batching`) says when requests go to the stream:

- `barrier` (default): when no trajectory can make progress without the engine (every live one waits), all the
  waiting requests in trajectory order, each with its own budget, as one call: the batches are as large as they
  can be and the samples a function of the seed alone (call k of a rollout samples with seed + k * SEED_STRIDE:
  a batch decoder the whole call, a stream request i of the call with that + i). The first call holds every
  trajectory's first turn; the n samples of a prompt share their prompt, so a single-turn rollout is exactly the
  engine call it replaced. A tool that takes long holds back the next call
  (every tool call has a timeout: `rollout.multi_turn.tool_timeout`).
- `eager`: as soon as the engine is free, every request waiting then, the call on a thread of its own, so the
  event loop keeps running tools and interactions meanwhile: a slow tool or a long answer holds back only its own
  trajectory, at the price of smaller calls and samples that depend on the timing (which requests share call k).
- `continuous` (engines with a token stream: vllm, hf): each request goes to the engine's stream the moment its
  trajectory asks, with its whole budget, joins the running batch at the next engine step and comes back the moment
  it finishes. Call k of trajectory i is seeded with seed + i + k * SEED_STRIDE: its first call gets the seed the
  barrier policy gives that row's first turn under vLLM (which seeds sample j of prompt p with seed + p * n + j);
  later turns depend on the seed and the trajectory alone, up to the rounding of the batch they shared.

Segments (`RolloutStream`, hyflow.rollout.stream). Under barrier and eager a request is decoded `chunk` tokens at a
time: a request that neither stopped nor used its budget goes back to the queue with its tokens so far appended to
its prompt; under continuous, `pause` aborts the running requests (each keeps its tokens) and closes the stream so
the engine is idle for a weight push, and `resume` resubmits them with what is left of their budgets. Every token
keeps the policy version that sampled it (`token_versions`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hyflow.batch import Batch
from hyflow.rollout.base import SamplingParams, TokenOutput, TokenRequest
from hyflow.rollout.batch_stream import BatchTokenStream

SEED_STRIDE = 1_000_033  # engine call k of one rollout samples with seed + k * SEED_STRIDE
SEGMENT_STRIDE = 7_919  # continuous: segment s of a resumed request samples with its turn's seed + s * SEGMENT_STRIDE
POLICIES = ("barrier", "eager", "continuous")


@dataclass
class TurnRequest:
    """A trajectory's generation request in the server: its segments so far."""

    index: int  # trajectory index (order of the output rows)
    group: tuple  # requests with equal group keys in one call share their prompt (the n samples of turn 1)
    prompt_ids: list[int]
    budget: int  # new tokens this request may still generate
    future: asyncio.Future
    media: dict | None = None  # a vision-language prompt's images: {"multi_modal_inputs", "multi_modal_data"}
    seed: int | None = None  # continuous: the turn's seed
    name: str = ""  # continuous: the request id's stem (t<index>.<turn>)
    segment: int = 0
    segment_version: int = 0
    submitted: bool = False  # continuous: its current segment went to the engine
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def append(self, out: TokenOutput, version: int) -> int:
        """Add a segment's output (its tokens, their log-probs and the policy version that sampled them) and take
        them from the budget; returns how many tokens it added."""
        count = len(out.token_ids)
        self.tokens += out.token_ids
        self.log_probs += out.log_probs if out.log_probs is not None else [0.0] * count
        self.versions += [version] * count
        self.budget -= count
        return count


def stream_opener(engine, params: SamplingParams, policy: str, *, pad_token_id: int, stop_ids: Sequence[int],
                  prompts: Batch | None = None) -> Callable[[], Any]:
    """How the server opens its token stream: the engine's own under `continuous` (and for an engine that has no
    batch decoder), else the batch adapter over `engine.decode_batch` (or `generate`; padded inside it)."""
    if policy == "continuous" or not (hasattr(engine, "decode_batch") or hasattr(engine, "generate")):
        if not hasattr(engine, "open_stream"):
            raise ValueError(f"actor_rollout_ref.rollout.agent.batching=continuous needs an engine with a token "
                             f"stream (`open_stream`: vllm, hf); the {type(engine).__name__} decodes fixed batches "
                             "only: use batching=eager (the engine called whenever it is free) or barrier")
        return lambda: engine.open_stream(params)
    return lambda: BatchTokenStream(engine, params, pad_token_id, stop_ids, prompts)

class TurnServer:
    """The agent loop's one engine seat (see the module docstring). `open_stream()` opens the token stream it
    speaks to (`stream_opener`); `params`: one turn's sampling params (n = 1); `policy`: barrier, eager or
    continuous; `chunk`: the segment length under barrier and eager (None: a request's whole budget). Counters the
    metrics read, over every stream it opened: `calls` (engine calls, or steps of a stream that schedules itself),
    `batch_sizes` (requests in each), `seconds` (time inside them); and `tokens` (generated), `continued`
    (segments that went back to the queue, or requests resumed), `token_versions` (trajectory index -> the policy
    version of each of its model tokens)."""

    def __init__(self, open_stream: Callable[[], Any], params: SamplingParams, eos_token_ids: Sequence[int], *,
                 policy: str = "barrier", chunk: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"actor_rollout_ref.rollout.agent.batching={policy}: use one of {', '.join(POLICIES)}")
        self._open_stream, self.params, self.policy = open_stream, params, policy
        self.eager, self.continuous = policy == "eager", policy == "continuous"
        self.stop_ids = set(eos_token_ids) | set(params.stop_token_ids)
        self.chunk = params.max_new_tokens if chunk is None else max(1, int(chunk))
        self.live = 0
        self.tokens = 0
        self.version = 0
        self.continued = 0
        self.token_versions: dict[int, list[int]] = {}
        self.waiting: list[TurnRequest] = []  # barrier / eager: the requests of the next call
        self._calls_made = 0  # barrier / eager: calls so far (call k samples with seed + k * SEED_STRIDE)
        self._running: dict[str, TurnRequest] = {}  # continuous: the requests in the engine, by request id
        self._paused: list[TurnRequest] = []
        self._pausing = False
        self._turns: dict[int, int] = {}
        self._stream = None
        self._closed_counts: tuple[int, float, list[int]] = (0, 0.0, [])  # of the streams closed so far
        self._ready: asyncio.Event | None = None  # the driver's wake-up (RolloutStream sets it)
        self._progress = asyncio.Event()  # continuous: a request landed or a trajectory finished
        self._engine_thread: ThreadPoolExecutor | None = None  # eager: where the engine runs

    @classmethod
    def over(cls, engine, params: SamplingParams, eos_token_ids: Sequence[int], *, policy: str, pad_token_id: int,
             prompts: Batch | None = None, chunk: int | None = None) -> TurnServer:
        """The server over `engine`'s token stream (`stream_opener`)."""
        stop_ids = sorted(set(eos_token_ids) | set(params.stop_token_ids))
        opener = stream_opener(engine, params, policy, pad_token_id=pad_token_id, stop_ids=stop_ids, prompts=prompts)
        return cls(opener, params, eos_token_ids, policy=policy, chunk=chunk)

    # ------------------------------------------------------------------ counters
    @property
    def calls(self) -> int:
        return self._closed_counts[0] + (getattr(self._stream, "step_count", 0) if self._stream is not None else 0)

    @property
    def seconds(self) -> float:
        return self._closed_counts[1] + (getattr(self._stream, "seconds", 0.0) if self._stream is not None else 0.0)

    @property
    def batch_sizes(self) -> list[int]:
        own = list(getattr(self._stream, "step_sizes", [])) if self._stream is not None else []
        return self._closed_counts[2] + own

    # ------------------------------------------------------------------ the trajectories' side
    async def generate(self, index: int, prompt_ids: list[int], budget: int, group: tuple | None = None,
                       media: dict | None = None) -> TokenOutput:
        budget = max(1, min(int(budget), self.params.max_new_tokens))
        request = TurnRequest(index, group if group is not None else ("own", index), list(prompt_ids), budget,
                              asyncio.get_running_loop().create_future(), media=media)
        if self.continuous:
            turn = self._turns.get(index, 0)
            self._turns[index] = turn + 1
            request.seed = None if self.params.seed is None else self.params.seed + index + turn * SEED_STRIDE
            request.name = f"t{index}.{turn}"
            self._submit(request)
        else:
            self.waiting.append(request)
            self._check()
        return await request.future

    def finished_one(self) -> None:
        self.live -= 1
        self._progress.set()
        self._check()

    def quiescent(self) -> bool:
        """True when no trajectory can move without the engine: every live one waits for it, or none is live.
        Eager and continuous never wait for that (`step` waits for a request or for progress instead)."""
        return self.continuous or self.eager or self.live <= 0 or len(self.waiting) >= self.live

    def _due(self) -> bool:
        """Whether the waiting requests go to the engine now: all live trajectories wait (barrier), or any (eager)."""
        return bool(self.waiting) and (self.eager or len(self.waiting) >= self.live)

    def _check(self) -> None:
        """Wake the driver (`RolloutStream`'s advance) when the waiting requests are due, or no trajectory is left."""
        if not self.continuous and self._ready is not None and (self.live <= 0 or self._due()):
            self._ready.set()

    # ------------------------------------------------------------------ the driver's side
    async def step(self) -> None:
        """Barrier: one engine call over every waiting request. Eager: wait for a request, then one call on the
        engine's thread. Continuous: wait until a request lands or a trajectory finishes."""
        if self.continuous:
            await self._progress.wait()
            self._progress.clear()
            return
        if self.eager and not self.waiting:  # wait for a request (or for the last trajectory to finish)
            self._ready.clear()
            self._check()
            await self._ready.wait()
        if self.waiting:
            await self._call()

    def resume(self) -> None:
        """Continuous: resubmit the requests `pause` aborted, in trajectory order, each as its next segment.
        Barrier and eager: nothing (unfinished segments wait in the queue for the next call)."""
        paused, self._paused = sorted(self._paused, key=lambda r: r.index), []
        for run in paused:
            if run.submitted:
                run.segment += 1
                self.continued += 1
            self._submit(run)

    async def pause(self) -> None:
        """Continuous: abort the running requests (each keeps its tokens so far) and close the stream, so the engine
        is idle. Barrier and eager: nothing runs between two calls."""
        if not self.continuous or self._stream is None:
            return
        self._pausing = True
        try:
            running = list(self._running)
            if running:
                self._stream.abort(running)
                while self._running:
                    await self.step()
        finally:
            self._pausing = False
        self._close_stream()  # nothing runs in it now: its thread ends at once

    def shutdown(self) -> None:
        """Drop everything (the stream's `reset`/`close`): close the stream, which aborts what runs."""
        self.waiting = []
        self._running.clear()
        self._paused = []
        if self._engine_thread is not None:
            self._engine_thread.shutdown(wait=True)
            self._engine_thread = None
        self._close_stream()

    # ------------------------------------------------------------------ barrier / eager: calls
    async def _call(self) -> None:
        """One engine call over every waiting request, in trajectory order, at most `chunk` new tokens each; request
        i of call k is seeded with seed + k * SEED_STRIDE + i (a batch decoder samples the whole call with its first
        request's seed); on the engine's thread under eager."""
        segments: list[TurnRequest] = sorted(self.waiting, key=lambda r: r.index)
        self.waiting = []
        stream = self._open()
        seed = None if self.params.seed is None else self.params.seed + self._calls_made * SEED_STRIDE
        self._calls_made += 1
        futures = [stream.submit(TokenRequest(f"t{seg.index}", seg.prompt_ids + seg.tokens, min(seg.budget, self.chunk),
                                              None if seed is None else seed + i,
                                              group=seg.group if not seg.tokens else ("own", seg.index),
                                              **(seg.media or {})))
                   for i, seg in enumerate(segments)]
        try:
            if not hasattr(stream, "flush"):  # a stream that schedules itself: the call is its requests' lifetimes
                outputs = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
            elif self.eager:
                if self._engine_thread is None:
                    self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyflow-engine")
                await asyncio.get_running_loop().run_in_executor(self._engine_thread, stream.flush)
                outputs = [f.result() for f in futures]
            else:
                stream.flush()
                outputs = [f.result() for f in futures]
        except BaseException as err:
            for seg in segments:  # futures are set on the event loop's thread
                if not seg.future.done():
                    seg.future.set_exception(err)
            raise
        self._land(segments, outputs)

    def _land(self, segments: list[TurnRequest], outputs: list[TokenOutput]) -> None:
        for seg, out in zip(segments, outputs):
            if seg.future.done():  # cancelled meanwhile
                continue
            self.tokens += seg.append(out, self.version)
            if out.stop_reason == "stop" or seg.budget <= 0:
                self._finish(seg, out.stop_reason)
            else:
                self.continued += 1
                self.waiting.append(seg)
        self._check()

    def _finish(self, request: TurnRequest, stop_reason: str) -> None:
        """Resolve a request with all its segments' tokens, recording their versions for the batch."""
        self.token_versions.setdefault(request.index, []).extend(request.versions)
        request.future.set_result(TokenOutput(request.tokens, request.log_probs if self.params.calculate_log_probs
                                              else None, "stop" if stop_reason == "stop" else "length"))

    # ------------------------------------------------------------------ continuous: requests in the stream
    def _submit(self, run: TurnRequest) -> None:
        if self._pausing:  # asked while `pause` drains the engine: it starts at the next `resume`
            self._paused.append(run)
            return
        stream = self._open()
        run.submitted = True
        seed = None if run.seed is None else run.seed + run.segment * SEGMENT_STRIDE
        run.segment_version = self.version
        request_id = f"{run.name}.{run.segment}"
        self._running[request_id] = run
        future = asyncio.wrap_future(stream.submit(TokenRequest(request_id, run.prompt_ids + run.tokens, run.budget,
                                                                seed, **(run.media or {}))))
        future.add_done_callback(lambda done: self._landed(request_id, done))

    def _landed(self, request_id: str, done: asyncio.Future) -> None:
        run = self._running.pop(request_id, None)
        self._progress.set()
        if run is None or done.cancelled() or run.future.done():
            return
        if done.exception() is not None:
            run.future.set_exception(done.exception())
            return
        out: TokenOutput = done.result()
        self.tokens += run.append(out, run.segment_version)
        if out.stop_reason == "abort" and run.budget > 0:
            self._paused.append(run)  # `pause` aborted it: resumed by the next `resume`
            return
        self._finish(run, out.stop_reason)

    def _open(self):
        if self._stream is None:
            self._stream = self._open_stream()
        return self._stream

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        stream.close()
        steps, seconds, sizes = self._closed_counts
        self._closed_counts = (steps + getattr(stream, "step_count", 0), seconds + getattr(stream, "seconds", 0.0),
                               sizes + list(getattr(stream, "step_sizes", [])))


class ServerHandle:
    """What an agent loop sees (verl's `server_manager`): `await generate(request_id, prompt_ids=...,
    sampling_params=...)` -> TokenOutput. `sampling_params["max_tokens"]` caps the new tokens of this call
    (default: what is left of the trajectory's response budget, as verl's server computes it)."""

    def __init__(self, server: TurnServer, index: int, prompt_row: int | None, response_length: int,
                 media: dict | None = None) -> None:
        self._server, self.index, self._prompt_row = server, index, prompt_row
        self.response_length = response_length
        self._calls = 0
        # the prompt row's images (`multi_modal_inputs`, `multi_modal_data`): every call of the trajectory continues
        # the prompt, so its token ids hold those images' tokens
        self._media = media or None

    @property
    def media(self) -> dict:
        """The prompt row's images: {"multi_modal_inputs": ..., "multi_modal_data": ...}, {} for a text prompt."""
        return dict(self._media or {})

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids at which the engine ends a turn (EOS ids and the sampling params' stop ids)."""
        return frozenset(self._server.stop_ids)

    async def generate(self, request_id: str | None = None, *, prompt_ids: list[int],
                       sampling_params: dict | None = None, media: dict | None = None, **_: Any) -> TokenOutput:
        """`media`: the images `prompt_ids` hold when the trajectory added some after the prompt (a tool's image;
        `multi_modal_inputs` with `image_pad_starts`, and `multi_modal_data`); default the prompt row's."""
        budget = (sampling_params or {}).get("max_tokens") or self.response_length
        first = self._calls == 0 and self._prompt_row is not None
        self._calls += 1
        group = ("prompt", self._prompt_row) if first else None
        return await self._server.generate(self.index, prompt_ids, budget, group,
                                           media=self._media if media is None else media)


