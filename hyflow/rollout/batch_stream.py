"""The one adapter that turns a batch decoder into a token stream: requests in, padded here, one engine call out.

A batch decoder is an engine with `decode_batch(prompts: Batch, params, budgets) -> list[TokenOutput]` (left-padded
prompt rows in, one output per sample out, interleaved; its `generate(Batch)` is
`hyflow.rollout.output.generate_rollout` over it; an engine with only `generate(prompts: Batch, params) -> Batch` is
one too: its rollout rows are read back). `BatchTokenStream` gives it the token-level protocol the agent loop's
`TurnServer` speaks (`submit(TokenRequest) -> Future`, `abort`, `close`) plus `flush()`: every request submitted
since the last flush is decoded in one engine call, padded inside this adapter, and each future gets its
`TokenOutput`. The call samples with the seed of its first request (the server's call seed: a batch decoder
samples a call with one generator, as the hf engine's barrier samples always were); runs of adjacent
requests sharing a group key, prompt and budget (a prompt's n first turns) go in as one prompt with n samples, so
a single-turn rollout is exactly the engine call it replaced. First turns whose group is `("prompt", row)` reuse
row `row` of the rollout's padded prompt batch unchanged, as the engine saw them before the agent loop existed.

Counters, as every token stream keeps them for the agent loop's metrics: `step_count` (engine calls), `seconds`
(time inside them), `step_sizes` (requests per call).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Sequence

import torch

from hyflow.batch import Batch
from hyflow.rollout.base import SamplingParams, TokenOutput, TokenRequest
from hyflow.rollout.output import left_pad, padded_outputs, prompt_budgets, turn_end


class BatchTokenStream:
    """See the module docstring. `engine`: a batch decoder; `params`: every request's sampling params (n = 1);
    `stop_ids`: the ids that end a turn (a response ending in one stopped, not ran out); `prompts`: the rollout's
    padded prompt batch, for first turns (None: always pad the requests' own ids)."""

    def __init__(self, engine, params: SamplingParams, pad_token_id: int, stop_ids: Sequence[int],
                 prompts: Batch | None = None) -> None:
        self.engine, self.params, self.pad_token_id = engine, params, int(pad_token_id)
        self.stop_ids = set(stop_ids)
        self.prompts = prompts
        self.queued: list[tuple[TokenRequest, concurrent.futures.Future]] = []
        self.step_count, self.seconds, self.step_sizes = 0, 0.0, []

    def submit(self, request: TokenRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.queued.append((request, future))
        return future

    def abort(self, request_ids) -> None:
        """Requests still queued end without tokens (a batch call is never cut short)."""
        ids = set(request_ids)
        for _, future in [item for item in self.queued if item[0].request_id in ids]:
            future.set_result(TokenOutput([], [] if self.params.calculate_log_probs else None, "abort"))
        self.queued = [item for item in self.queued if item[0].request_id not in ids]

    def close(self) -> None:
        self.abort([request.request_id for request, _ in self.queued])

    def flush(self) -> None:
        """Decode every queued request in one engine call; each future gets its output, or the call's error (which
        is raised here too)."""
        items, self.queued = self.queued, []
        if not items:
            return
        try:
            outputs = self._decode([request for request, _ in items])
        except BaseException as err:
            for _, future in items:
                future.set_exception(err)
            raise
        for (_, future), output in zip(items, outputs):
            future.set_result(output)

    def _decode(self, requests: list[TokenRequest]) -> list[TokenOutput]:
        runs: list[list[TokenRequest]] = []  # a prompt's n first turns: one prompt with n samples
        for request in requests:
            if (runs and runs[-1][0].group == request.group and runs[-1][0].max_tokens == request.max_tokens
                    and runs[-1][0].prompt_ids == request.prompt_ids):
                runs[-1].append(request)
            else:
                runs.append([request])
        n = len(runs[0])
        if any(len(run) != n for run in runs):
            runs, n = [[r] for r in requests], 1
        heads = [run[0] for run in runs]
        params = dataclasses.replace(self.params, n=n, seed=heads[0].seed)
        batch = self._prompt_batch(heads)
        start = time.perf_counter()
        if hasattr(self.engine, "decode_batch"):
            outputs = self.engine.decode_batch(batch, params, prompt_budgets(batch, params))
        else:  # an engine with only generate(Batch): its rollout rows read back
            out = self.engine.generate(batch, params)
            logprobs = out["rollout_log_probs"] if "rollout_log_probs" in out else None  # noqa: SIM401 (Batch)
            outputs = padded_outputs(out["responses"], logprobs, out["response_mask"].sum(-1),
                                     [r.max_tokens for r in heads for _ in range(n)], self.stop_ids)
        self.seconds += time.perf_counter() - start
        self.step_count += 1
        self.step_sizes.append(len(requests))
        return [TokenOutput(o.token_ids, o.log_probs, turn_end(o.token_ids, heads[row // n].max_tokens, self.stop_ids))
                for row, o in enumerate(outputs)]

    def _is_original(self, request: TokenRequest) -> bool:
        """Whether a first turn asks for its row's own prompt (a loop that renders its own, openai_agent, may not:
        then the engine gets the request's ids, never the row's)."""
        row = request.group[1]
        ids = self.prompts["input_ids"][row][self.prompts["attention_mask"][row].bool()]
        return ids.tolist() == list(request.prompt_ids)

    def _prompt_batch(self, heads: list[TokenRequest]) -> Batch:
        original = self.prompts
        if original is not None and all(r.group is not None and r.group[0] == "prompt" and self._is_original(r)
                                        for r in heads):
            rows = [r.group[1] for r in heads]  # first turns: the original padded rows, as the engine saw them
            batch = Batch({"input_ids": original["input_ids"][rows], "attention_mask": original["attention_mask"][rows]})
        else:
            input_ids, mask = left_pad((r.prompt_ids for r in heads), self.pad_token_id)
            batch = Batch({"input_ids": input_ids, "attention_mask": mask})
        budgets = torch.tensor([r.max_tokens for r in heads], dtype=torch.long)
        if bool((budgets != self.params.max_new_tokens).any()):
            batch["max_new_tokens"] = budgets
        if any(r.multi_modal_inputs is not None or r.multi_modal_data is not None for r in heads):
            batch["multi_modal_inputs"] = [r.multi_modal_inputs for r in heads]  # the engine computes the positions
            batch["multi_modal_data"] = [r.multi_modal_data for r in heads]  # vLLM's images
        return batch
