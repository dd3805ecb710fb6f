"""The hf engine behind the token-level protocol (`HFRolloutEngine.open_stream`): requests in, each output back as
it finishes, `abort` and `close` — the protocol vLLM's token stream speaks (`hyflow.rollout.vllm.VLLMTokenStream`),
so `rollout.agent.batching=continuous` and the abort/resume partial rollouts of `async_training.mode=fully_async`
run on the hf engine too.

A thread of its own decodes every request waiting when it is free as one batch, padded inside the engine
(`HFRolloutEngine.generate_requests`), and resolves each request the step it finishes; requests that arrive
while a batch decodes go into the next one. The hf engine's KV cache belongs to one batch, so a request cannot
join a batch mid-decode as in vLLM's continuous batching: what the stream gives the hf engine is the protocol,
not vLLM's scheduling. Each request samples with
its own seed (a generator per request), so its tokens do not depend on which requests shared its batch, up to
that batch's rounding. `abort` ends requests at the engine's next decode step; each returns the tokens it has.
Counters for the agent loop's metrics: `step_count` (engine calls: batches), `seconds` (time inside them),
`step_sizes` (requests per batch).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

import torch

from hyflow.rollout.base import SamplingParams, TokenOutput, TokenRequest


class HFTokenStream:
    """See the module docstring. `engine`: an HFRolloutEngine; `params`: the sampling params of every request
    (their `max_new_tokens` caps each request's `max_tokens`; `n` must be 1: a request is one sample)."""

    def __init__(self, engine, params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError(f"a token stream decodes one sample per request; got n={params.n} (submit n requests)")
        self._engine, self._params = engine, params
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._aborted: set[str] = set()  # ids of requests to end at the next decode step
        self._running: list[str] = []  # ids of the batch decoding now
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self.step_count, self.seconds, self.step_sizes = 0, 0.0, []
        self._threads = torch.get_num_threads()  # a new thread starts with the process default, not this count
        self._thread = threading.Thread(target=self._run, name="hyflow-hf-stream", daemon=True)
        self._thread.start()

    def submit(self, request: TokenRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed or self._error is not None:
            future.set_exception(self._error or RuntimeError("the hf token stream is closed"))
            return future
        self._inbox.put((request, future))
        return future

    def abort(self, request_ids) -> None:
        """End these requests now: their futures get the tokens produced so far, stop reason "abort"."""
        with self._lock:
            self._aborted.update(request_ids)

    def close(self) -> None:
        """Abort what is still running or queued and stop the thread (waits for it)."""
        if not self._closed:
            self._closed = True
            with self._lock:
                self._aborted.update(self._running)  # the batch decoding now ends at its next step
            self._inbox.put(None)
        self._thread.join()

    def _empty(self) -> TokenOutput:
        """The output of a request aborted before it started."""
        return TokenOutput([], [] if self._params.calculate_log_probs else None, "abort")

    # ------------------------------------------------------------------ the engine thread
    def _take(self, block: bool) -> tuple[list, bool]:
        """The queued (request, future) pairs, at most one batch's worth; and whether `close` was asked."""
        items, closing = [], False
        limit = max(1, int(self._engine.max_batch_size))
        while len(items) < limit:
            try:
                item = self._inbox.get() if block and not items else self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                closing = True
                break
            items.append(item)
        return items, closing

    def _cut(self, request_ids: list[str]) -> list[bool]:
        """Which of these requests were aborted (forgotten once seen)."""
        with self._lock:
            cut = [request_id in self._aborted for request_id in request_ids]
            self._aborted.difference_update(i for i, c in zip(request_ids, cut) if c)
        return cut

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        items: list = []
        try:
            while True:
                items, closing = self._take(block=True)
                if closing:
                    self._close_out(items)
                    return
                self._decode(items)
                items = []
        except BaseException as err:  # the engine failed: every waiting request gets the error
            self._error = err
            self._close_out(items, err)

    def _decode(self, items: list) -> None:
        ids = [request.request_id for request, _ in items]
        # requests aborted before their batch started end at once, empty-handed
        early = self._cut(ids)
        for (_, future), cut in zip(items, early):
            if cut:
                future.set_result(self._empty())
        items = [item for item, cut in zip(items, early) if not cut]
        if not items:
            return
        ids = [request.request_id for request, _ in items]
        with self._lock:
            self._running = ids
            if self._closed:  # close() came while this batch was being taken
                self._aborted.update(ids)
        start = time.perf_counter()

        def landed(index: int, output: TokenOutput) -> None:  # the moment a request finishes, mid-batch
            future = items[index][1]
            if not future.done():
                future.set_result(output)

        try:
            self._engine.generate_requests([request for request, _ in items], self._params,
                                           aborted=lambda: self._cut(ids), on_output=landed)
        finally:
            with self._lock:
                self._running = []
            self.seconds += time.perf_counter() - start
            self.step_count += 1
            self.step_sizes.append(len(items))

    def _close_out(self, items: list, err: BaseException | None = None) -> None:
        """End the given and every still-queued request: with `err`, or aborted empty-handed."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                items.append(item)
        for _, future in items:
            if future.done():
                continue
            if err is not None:
                future.set_exception(err)
            else:
                future.set_result(self._empty())
