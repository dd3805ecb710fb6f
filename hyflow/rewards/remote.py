"""A remote reward endpoint: samples are scored by an HTTP service that runs elsewhere (a verifier farm, a sandbox
cluster, a judge behind an API), over a JSON POST per sample or per batch of samples.

Request: POST `url`, ``Content-Type: application/json``, body one sample object (`batch_size = 1`) or a JSON array
of them (`batch_size > 1`, in the batch's order). A sample object holds the keyword arguments of verl's reward
function, ``compute_score(data_source, solution_str, ground_truth, extra_info)``, plus `prompt_str` (the
question the policy answered: `extra_info["question"]`, the last user message of `raw_prompt`, or the decoded
prompt tokens, as a judge sees it) and any `reward_kwargs`:

    {"data_source": "openai/gsm8k", "solution_str": "... #### 72", "ground_truth": "72",
     "extra_info": {"index": 3}, "prompt_str": "Natalia sold clips ..."}

Response (2xx): per sample, what a verl reward function returns: a number, or an object with a numeric "score"
and any extra keys (they become columns and `reward/<key>/mean` metrics); for a batched request, a JSON array of
those, one per sample. numpy values in a sample are sent as plain numbers and lists.

verl has no HTTP reward format to follow: its reward manager `remote` (verl/experimental/reward_loop/
reward_manager/remote.py) runs the user's `compute_score` in separate Ray worker processes, which hyflow's `naive`
manager already does in forked processes (`reward_model.num_workers`). This module's format is verl's reward-
function call turned into JSON. Its manager is registered as `http` (not `remote`, whose meaning in verl differs).

Failure handling, per request (a batched request succeeds or fails as a whole):
- `timeout_s` bounds each attempt from connect to the last byte of the body: a watchdog closes the socket at the
  deadline, so a server that trickles bytes (each read inside a socket timeout) is still cut off;
- connection errors (refused, reset, DNS), timeouts and 5xx statuses are retried up to `max_retries` times,
  waiting ``min(max_backoff_s, backoff_s * 2**attempt)`` between attempts; 4xx statuses, bodies that are not
  JSON and results that are not scores are not retried;
- a sample that still fails is a failed `Outcome` whose error names the URL, the HTTP status or the error and
  the number of attempts; it scores 0 and counts toward `reward_model.max_error_fraction` like any reward failure.
At most `max_concurrency` requests of one client are in flight at once, across all its calls.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hyflow.batch import Batch
from hyflow.rewards.custom import normalize_score
from hyflow.rewards.judge import sample_questions
from hyflow.rewards.managers import RewardResult, _BaseManager, register_reward_manager
from hyflow.rewards.pool import Outcome


class RemoteRewardError(RuntimeError):
    """The endpoint did not give a score for a sample; the message names the URL and the status or error."""


class _Retryable(Exception):
    """An attempt that may succeed when tried again (connection error, timeout, 5xx)."""


def _jsonable(value):
    """`json.dumps`'s fallback: numpy scalars and arrays (anything with `tolist`) as plain values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} cannot be sent as JSON: {value!r:.80}")


@dataclass
class RemoteRewardClient:
    """POSTs samples to `endpoint` (the URL) and returns their scores as Outcomes (see the module docstring for the
    format).

    `timeout_s`: seconds per attempt, connect to last byte; `max_retries`: extra attempts after a connection
    error, timeout or 5xx; `backoff_s` / `max_backoff_s`: the exponential wait between attempts; `max_concurrency`:
    requests in flight at once; `batch_size`: samples per request (1 = one request per sample); `headers`: sent
    with every request (e.g. ``{"Authorization": "Bearer ..."}``)."""

    endpoint: str
    timeout_s: float = 30.0
    max_retries: int = 2
    max_concurrency: int = 8
    batch_size: int = 1
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    headers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote reward url {self.endpoint!r} must be http://HOST[:PORT]/PATH or https://...")
        if not (math.isfinite(float(self.timeout_s)) and self.timeout_s > 0):
            raise ValueError(f"remote reward timeout_s must be a finite number of seconds > 0, got {self.timeout_s}")
        for name in ("backoff_s", "max_backoff_s"):
            if not (math.isfinite(float(getattr(self, name))) and getattr(self, name) >= 0):
                raise ValueError(f"remote reward {name} must be a finite number of seconds >= 0, got "
                                 f"{getattr(self, name)}")
        for name in ("max_concurrency", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"remote reward {name} must be >= 1, got {getattr(self, name)}")
        if int(self.max_retries) < 0:
            raise ValueError(f"remote reward max_retries must be >= 0, got {self.max_retries}")
        self._parts = parts
        self.__qualname__ = f"RemoteRewardClient(url={self.endpoint!r})"  # how the reward manager's errors name it
        self._in_flight = threading.BoundedSemaphore(int(self.max_concurrency))

    # ------------------------------------------------------------------ one attempt
    def _post_once(self, body: bytes) -> object:
        """One POST; the parsed JSON body of a 2xx answer. `_Retryable` for what may pass when tried again,
        RemoteRewardError for what will not."""
        parts = self._parts
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = connection_class(parts.hostname, parts.port, timeout=self.timeout_s)
        expired = threading.Event()
        opened: list[socket.socket] = []  # the connection's socket (http.client drops `conn.sock` once it has
        # handed the socket to the response, so the watchdog keeps its own reference)

        def cut_off() -> None:  # the deadline: shut the socket under a blocked read or write
            expired.set()
            for sock in opened:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(self.timeout_s, cut_off)
        watchdog.daemon = True
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        try:
            watchdog.start()
            conn.connect()  # bounded by the socket timeout (= timeout_s)
            opened.append(conn.sock)
            if expired.is_set():
                raise TimeoutError
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                           "Accept": "application/json", **self.headers})
            response = conn.getresponse()
            data = response.read()
            if expired.is_set():
                raise TimeoutError
        except TimeoutError:
            raise _Retryable(f"timed out after {self.timeout_s:g} s (timeout_s)") from None
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set():
                raise _Retryable(f"timed out after {self.timeout_s:g} s (timeout_s)") from None
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        finally:
            watchdog.cancel()
            conn.close()
        if response.status >= 500:
            raise _Retryable(f"HTTP {response.status} {response.reason}: {data[:200].decode(errors='replace')!r}")
        if not 200 <= response.status < 300:
            raise RemoteRewardError(f"HTTP {response.status} {response.reason}: "
                                    f"{data[:200].decode(errors='replace')!r}")
        try:
            return json.loads(data)
        except ValueError:
            raise RemoteRewardError(f"HTTP {response.status} with a body that is not JSON: "
                                    f"{data[:200].decode(errors='replace')!r}") from None

    def post(self, payload) -> object:
        """POST `payload` (JSON-serialisable) with retries; the parsed answer, or RemoteRewardError naming the
        URL, the last status or error and the number of attempts."""
        try:
            body = json.dumps(payload, default=_jsonable).encode()
        except (TypeError, ValueError) as exc:
            raise RemoteRewardError(f"POST {self.endpoint}: the sample cannot be sent as JSON: {exc}") from None
        attempts = int(self.max_retries) + 1
        for attempt in range(attempts):
            try:
                with self._in_flight:
                    return self._post_once(body)
            except RemoteRewardError as exc:
                raise RemoteRewardError(f"POST {self.endpoint} failed (not retried): {exc}") from None
            except _Retryable as exc:
                last = exc
            if attempt + 1 < attempts:
                time.sleep(min(float(self.max_backoff_s), float(self.backoff_s) * 2**attempt))
        raise RemoteRewardError(f"POST {self.endpoint} failed after {attempts} attempt(s) (1 + max_retries="
                                f"{self.max_retries}): {last}")

    # ------------------------------------------------------------------ many samples
    def _checked(self, result) -> Outcome:
        try:
            normalize_score(result)
        except (TypeError, ValueError) as exc:
            return Outcome(error=f"POST {self.endpoint} answered something that is not a score: {exc}")
        return Outcome(value=result)

    def _score_chunk(self, chunk: Sequence[dict]) -> list[Outcome]:
        payload = dict(chunk[0]) if self.batch_size == 1 else [dict(s) for s in chunk]
        try:
            answer = self.post(payload)
        except RemoteRewardError as exc:
            return [Outcome(error=str(exc))] * len(chunk)
        if self.batch_size == 1:
            return [self._checked(answer)]
        if not isinstance(answer, list) or len(answer) != len(chunk):
            got = f"a list of {len(answer)}" if isinstance(answer, list) else type(answer).__name__
            return [Outcome(error=f"POST {self.endpoint} with {len(chunk)} samples (batch_size={self.batch_size}) must "
                                  f"answer a JSON array of {len(chunk)} scores, got {got}")] * len(chunk)
        return [self._checked(result) for result in answer]

    def score(self, samples: Sequence[dict]) -> list[Outcome]:
        """One Outcome per sample (a dict of the request's keys), in order; requests run `max_concurrency` at
        a time."""
        chunks = [samples[i: i + self.batch_size] for i in range(0, len(samples), self.batch_size)]
        if not chunks:
            return []
        with ThreadPoolExecutor(max_workers=min(int(self.max_concurrency), len(chunks)),
                                thread_name_prefix="remote-reward") as pool:
            parts = list(pool.map(self._score_chunk, chunks))
        return [outcome for part in parts for outcome in part]

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        """verl's reward-function signature, one request: the endpoint's score (a number or a dict), or
        RemoteRewardError. For mixing an endpoint with other reward functions (`combine_reward_functions`)."""
        sample = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                  "extra_info": extra_info, **kwargs}
        (outcome,) = self.score([sample])
        if not outcome.ok:
            raise RemoteRewardError(outcome.error)
        return outcome.value


CLIENT_KEYS = ("url", "max_retries", "max_concurrency", "batch_size", "backoff_s", "max_backoff_s", "headers")


@register_reward_manager("http")
class RemoteRewardManager(_BaseManager):
    """Reward manager `http`: every sample is scored by a `RemoteRewardClient` (no local reward function).

    Configured through `reward_model.reward_kwargs` (its keys `url`, `max_retries`, `max_concurrency`,
    `batch_size`, `backoff_s`, `max_backoff_s`, `headers` go to the client; the others are sent with every
    sample) and `reward_model.timeout_s` (per attempt). `client=` gives a built client instead. Failed samples
    score 0 and count toward `reward_model.max_error_fraction`."""

    streams = False  # requests carry the decoded prompt, which the sample-by-sample path does not give

    def __init__(self, tokenizer, compute_score: Callable | None = None, *, client: RemoteRewardClient | None = None,
                 **kwargs) -> None:
        super().__init__(tokenizer, compute_score, **kwargs)
        settings = {key: self.reward_kwargs.pop(key) for key in CLIENT_KEYS if key in self.reward_kwargs}
        if client is None:
            if "url" not in settings:
                raise ValueError("reward_model.reward_manager=http needs the endpoint's address: "
                                 "+reward_model.reward_kwargs.url=http://HOST:PORT/PATH")
            client = RemoteRewardClient(settings.pop("url"), timeout_s=self.timeout_s, **settings)
        elif settings:
            raise ValueError(f"RemoteRewardManager got a client and client settings {sorted(settings)}; give one")
        self.client = client
        self.compute_score = client  # what the manager's error messages name

    def __call__(self, batch: Batch) -> RewardResult:
        texts, lengths = self.decode_responses(batch)
        prompts = sample_questions(batch, self.tokenizer)
        samples = [
            {"data_source": ds, "solution_str": text, "ground_truth": gt, "extra_info": info, "prompt_str": prompt,
             **self.reward_kwargs}
            for ds, text, gt, info, prompt in zip(self._column(batch, "data_source"), texts,
                                                  self._ground_truths(batch), self._column(batch, "extra_info", {}),
                                                  prompts)
        ]
        return self._finish(batch, self.client.score(samples), samples, lengths)
