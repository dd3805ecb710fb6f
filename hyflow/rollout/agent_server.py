"""The agent loop's engine seat: trajectories' generation requests batched into engine calls.

Batching. The trajectories' generation requests go to one `BatchingServer`, which decodes every request that is
waiting in one engine call as soon as no trajectory can make progress without it (all live trajectories are
waiting for the engine): requests in trajectory order, each with its own budget (the engines' per-prompt
`max_new_tokens` column). This makes the batches as large as they can be and the samples a function of the seed
alone: call k of a rollout uses seed + k * 1_000_033. The first call holds every trajectory's first turn; the n
samples of a prompt go to the engine as one prompt with n samples, so a single-turn rollout is exactly the engine
call it replaced (same samples for the same seed). A tool that takes long holds back the next batch (every tool
call has a timeout: `rollout.multi_turn.tool_timeout`). With `rollout.agent.batching=eager` the server instead
calls the engine as soon as it is free with every request waiting then, on a thread of its own, so the event loop
keeps running tools and interactions meanwhile: a slow tool or a long answer holds back only its own trajectory,
at the price of smaller calls and samples that depend on the timing (which requests share call k). With
`rollout.agent.batching=continuous` (`ContinuousServer`, engines with a token stream: vllm, hf) every request goes
to the engine on its own and joins the running batch at the next engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hyflow.batch import Batch
from hyflow.rollout.base import SamplingParams, TokenOutput, TokenRequest
from hyflow.rollout.output import left_pad

SEED_STRIDE = 1_000_033  # engine call k of one rollout samples with seed + k * SEED_STRIDE


# ---------------------------------------------------------------------------------------------- the server
@dataclass
class TurnRequest:
    index: int  # trajectory index (order of the output rows)
    group: tuple  # requests with equal group keys in one call share their prompt (the n samples of turn 1)
    prompt_ids: list[int]
    budget: int
    future: asyncio.Future
    media: dict | None = None  # a vision-language prompt's images: {"multi_modal_inputs", "multi_modal_data"}


class BatchingServer:
    """Decodes the waiting requests of many trajectories together (see the module docstring).

    `live` trajectories are running; when every one of them waits for the engine, the waiting requests are
    decoded in one engine call (seeded with seed + k * SEED_STRIDE for the k-th call).
    """

    _request_type: type = TurnRequest  # what `generate` queues (a subclass may queue its own kind)

    def __init__(self, engine, params: SamplingParams, pad_token_id: int, eos_token_ids: Sequence[int],
                 prompts: Batch | None = None, *, eager: bool = False) -> None:
        self.engine, self.params, self.pad_token_id = engine, params, pad_token_id
        self.eager = eager  # call the engine whenever it is free (rollout.agent.batching=eager)
        self.stop_ids = set(eos_token_ids) | set(params.stop_token_ids)
        self.prompts = prompts  # the original prompt batch: turn-1 calls reuse its padded rows unchanged
        self.live = 0
        self.waiting: list[TurnRequest] = []
        self.calls = 0
        self.batch_sizes: list[int] = []
        self.seconds = 0.0
        self.tokens = 0  # generated so far (the progress callback reports it)
        self._ready: asyncio.Event | None = None

    def _due(self) -> bool:
        """Whether the waiting requests go to the engine now: all live trajectories wait (barrier), or any (eager)."""
        return bool(self.waiting) and (self.eager or len(self.waiting) >= self.live)

    def _check(self) -> None:
        """Wake the driver (`RolloutStream`'s advance) when the waiting requests are due, or no trajectory is left."""
        if self._ready is not None and (self.live <= 0 or self._due()):
            self._ready.set()

    def finished_one(self) -> None:
        self.live -= 1
        self._check()

    async def generate(self, index: int, prompt_ids: list[int], budget: int, group: tuple | None = None,
                       media: dict | None = None) -> TokenOutput:
        budget = max(1, min(int(budget), self.params.max_new_tokens))
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(self._request_type(index, group if group is not None else ("own", index),
                                               list(prompt_ids), budget, future, media=media))
        self._check()
        return await future

    def _decode_or_fail(self, requests: list[TurnRequest]) -> list[TokenOutput]:
        """`_decode`; when it raises, every request not yet done gets the error (its trajectory stops with it)."""
        try:
            return self._decode(requests)
        except BaseException as err:
            self._fail(requests, err)
            raise

    @staticmethod
    def _fail(requests: list[TurnRequest], err: BaseException) -> None:
        for request in requests:
            if not request.future.done():
                request.future.set_exception(err)

    def _decode(self, requests: list[TurnRequest]) -> list[TokenOutput]:
        # runs of requests sharing a group key (a prompt's n first turns) go in as one prompt with n samples
        runs: list[list[TurnRequest]] = []
        for request in requests:
            if (runs and runs[-1][0].group == request.group and runs[-1][0].budget == request.budget
                    and runs[-1][0].prompt_ids == request.prompt_ids):
                runs[-1].append(request)
            else:
                runs.append([request])
        n = len(runs[0])
        if any(len(run) != n for run in runs):
            runs, n = [[r] for r in requests], 1
        heads = [run[0] for run in runs]
        batch = self._prompt_batch(heads)
        seed = None if self.params.seed is None else self.params.seed + self.calls * SEED_STRIDE
        params = dataclasses.replace(self.params, n=n, seed=seed)
        start = time.perf_counter()
        out = self.engine.generate(batch, params)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.batch_sizes.append(len(requests))
        lengths = out["response_mask"].sum(-1).tolist()
        self.tokens += int(sum(lengths))
        logprobs = out["rollout_log_probs"] if "rollout_log_probs" in out else None  # noqa: SIM401 (Batch)
        outputs = []
        for row, length in enumerate(lengths):
            ids = out["responses"][row, :length].tolist()
            budget = heads[row // n].budget
            stopped = bool(ids) and ids[-1] in self.stop_ids
            outputs.append(TokenOutput(ids, None if logprobs is None else logprobs[row, :length].tolist(),
                                       "stop" if stopped or length < budget else "length"))
        return outputs

    def _is_original(self, request: TurnRequest) -> bool:
        """Whether a first turn asks for its row's own prompt (a loop that renders its own, openai_agent, may not:
        then the engine gets the request's ids, never the row's)."""
        row = request.group[1]
        ids = self.prompts["input_ids"][row][self.prompts["attention_mask"][row].bool()]
        return ids.tolist() == list(request.prompt_ids)

    def _prompt_batch(self, heads: list[TurnRequest]) -> Batch:
        original = self.prompts
        if original is not None and all(r.group[0] == "prompt" and self._is_original(r) for r in heads):
            rows = [r.group[1] for r in heads]  # first turns: the original padded rows, as the engine saw them
            batch = Batch({"input_ids": original["input_ids"][rows], "attention_mask": original["attention_mask"][rows]})
        else:
            input_ids, mask = left_pad((r.prompt_ids for r in heads), self.pad_token_id)
            batch = Batch({"input_ids": input_ids, "attention_mask": mask})
        budgets = torch.tensor([r.budget for r in heads], dtype=torch.long)
        if bool((budgets != self.params.max_new_tokens).any()):
            batch["max_new_tokens"] = budgets
        if any(r.media for r in heads):  # the engine computes the positions from the ids and the image grids
            batch["multi_modal_inputs"] = [(r.media or {}).get("multi_modal_inputs") for r in heads]
            batch["multi_modal_data"] = [(r.media or {}).get("multi_modal_data") for r in heads]  # vLLM's images
        return batch


class ContinuousServer:
    """The engine seat with `rollout.agent.batching=continuous`: each request goes to the engine's token stream
    (`engine.open_stream`) the moment its trajectory asks, joins the running batch at the engine's next step and
    comes back the moment it finishes (continuous batching, as verl's and the async peers' server engines do), so
    a slow tool or a long answer holds back only its own trajectory and the engine is never idle while work waits.

    Samples: call k of trajectory i is seeded with seed + i + k * SEED_STRIDE. Trajectory i's first call gets
    the seed the barrier server gives that row's first turn (vLLM seeds sample j of prompt p with seed + p * n +
    j = seed + i), so the first turns are the same samples as there; later turns depend on the seed and the
    trajectory alone, never on which other requests were running (up to the rounding of the batch they shared).
    Same interface and counters as `BatchingServer` (`calls` counts engine steps, `batch_sizes` the requests
    running in each)."""

    def __init__(self, engine, params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
        if not hasattr(engine, "open_stream"):
            raise ValueError(f"actor_rollout_ref.rollout.agent.batching=continuous needs an engine with a token "
                             f"stream (`open_stream`: vllm, hf); the {type(engine).__name__} decodes fixed batches "
                             "only: use batching=eager (the engine called whenever it is free) or barrier")
        self.engine, self.params = engine, params
        self.stop_ids = set(eos_token_ids) | set(params.stop_token_ids)
        self.live = 0
        self.tokens = 0
        self._stream = None
        self._turns: dict[int, int] = {}

    # the counters the agent loop's metrics read (BatchingServer's names)
    @property
    def calls(self) -> int:
        return self._stream.step_count if self._stream is not None else 0

    @property
    def batch_sizes(self) -> list[int]:
        return self._stream.step_sizes if self._stream is not None else []

    @property
    def seconds(self) -> float:
        return self._stream.seconds if self._stream is not None else 0.0

    def finished_one(self) -> None:
        self.live -= 1

    async def generate(self, index: int, prompt_ids: list[int], budget: int, group: tuple | None = None,
                       media: dict | None = None) -> TokenOutput:
        if self._stream is None:
            self._open()
        turn = self._turns.get(index, 0)
        self._turns[index] = turn + 1
        seed = None if self.params.seed is None else self.params.seed + index + turn * SEED_STRIDE
        budget = max(1, min(int(budget), self.params.max_new_tokens))
        future = self._stream.submit(TokenRequest(f"t{index}.{turn}", list(prompt_ids), budget, seed,
                                                  **(media or {})))
        output = await asyncio.wrap_future(future)
        self.tokens += len(output.token_ids)
        return output

    def _open(self) -> None:
        self._stream = self.engine.open_stream(self.params)


class ServerHandle:
    """What an agent loop sees (verl's `server_manager`): `await generate(request_id, prompt_ids=...,
    sampling_params=...)` -> TokenOutput. `sampling_params["max_tokens"]` caps the new tokens of this call
    (default: what is left of the trajectory's response budget, as verl's server computes it)."""

    def __init__(self, server: BatchingServer, index: int, prompt_row: int | None, response_length: int,
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


