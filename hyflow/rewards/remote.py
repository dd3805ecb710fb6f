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
- `timeout_s` bounds each attempt from the name lookup and connect to the last byte of the body: the attempt runs
  on a thread the caller leaves at the deadline (shutting its socket), so a server that never answers or trickles
  bytes (each read inside a socket timeout) is still cut off; `total_timeout_s` (unset: no bound beyond the
  attempts') bounds all attempts of a request with the waits between them;
- an answer is read in pieces up to `max_response_bytes` (default 4 MiB): a larger one (announced or sent) fails
  its samples without being read further, so a huge answer costs no more memory than the limit;
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
from hyflow.rewards.managers import BaseRewardManager, RewardResult, register_reward_manager
from hyflow.rewards.pool import Outcome

DEFAULT_MAX_RESPONSE_BYTES = 4 * 2**20  # an answer is a few numbers per sample; 4 MiB leaves room for a batch


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

    `timeout_s`: seconds per attempt, name lookup and connect to last byte; `total_timeout_s`: seconds for all
    attempts of a request with the waits between them (None: no bound beyond the attempts'); `max_retries`: extra
    attempts after a connection error, timeout or 5xx; `backoff_s` / `max_backoff_s`: the exponential wait between
    attempts; `max_concurrency`: requests in flight at once; `batch_size`: samples per request (1 = one request
    per sample); `max_response_bytes`: the largest answer read (default 4 MiB; a larger one fails its samples,
    read no further than the limit); `headers`: sent with every request (e.g.
    ``{"Authorization": "Bearer ..."}``)."""

    endpoint: str
    timeout_s: float = 30.0
    max_retries: int = 2
    max_concurrency: int = 8
    batch_size: int = 1
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    headers: dict = field(default_factory=dict)
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    total_timeout_s: float | None = None

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
        if self.total_timeout_s is not None and not (math.isfinite(float(self.total_timeout_s))
                                                     and self.total_timeout_s > 0):
            raise ValueError(f"remote reward total_timeout_s must be a finite number of seconds > 0 (or unset), got "
                             f"{self.total_timeout_s}")
        for name in ("max_concurrency", "batch_size", "max_response_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"remote reward {name} must be >= 1, got {getattr(self, name)}")
        if int(self.max_retries) < 0:
            raise ValueError(f"remote reward max_retries must be >= 0, got {self.max_retries}")
        self._parts = parts
        self.__qualname__ = f"RemoteRewardClient(url={self.endpoint!r})"  # how the reward manager's errors name it
        self._in_flight = threading.BoundedSemaphore(int(self.max_concurrency))

    # ------------------------------------------------------------------ one attempt
    def _attempt(self, body: bytes, deadline: float, sockets: list, result: dict) -> None:
        """One POST on this thread, every socket operation bounded by the time left until `deadline`; puts the
        parsed JSON of a 2xx answer, or the exception, in `result`. `sockets` gets the connection's socket (for
        the caller to shut at the deadline)."""
        parts = self._parts

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            return remaining

        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        path = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        try:
            conn = connection_class(parts.hostname, parts.port, timeout=left())
            try:
                conn.connect()
                sock = conn.sock  # http.client drops `conn.sock` once the response owns it
                sockets.append(sock)
                sock.settimeout(left())  # sendall's timeout bounds the whole send
                conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                               "Accept": "application/json", **self.headers})
                sock.settimeout(left())
                response = conn.getresponse()
                ok = 200 <= response.status < 300
                data = self._read_body(response, sock, left, self.max_response_bytes if ok else 1024)
            finally:
                conn.close()
        except TimeoutError:
            result["error"] = TimeoutError()
            return
        except (RemoteRewardError, _Retryable) as exc:
            result["error"] = exc
            return
        except (OSError, http.client.HTTPException) as exc:
            result["error"] = _Retryable(f"{type(exc).__name__}: {exc}")
            return
        except Exception as exc:  # e.g. a header value http.client refuses: trying again would not help
            result["error"] = RemoteRewardError(f"{type(exc).__name__}: {exc}")
            return
        if response.status >= 500:
            result["error"] = _Retryable(f"HTTP {response.status} {response.reason}: "
                                         f"{data[:200].decode(errors='replace')!r}")
        elif not ok:
            result["error"] = RemoteRewardError(f"HTTP {response.status} {response.reason}: "
                                                f"{data[:200].decode(errors='replace')!r}")
        else:
            try:
                result["value"] = json.loads(data)
            except (ValueError, RecursionError):
                result["error"] = RemoteRewardError(f"HTTP {response.status} with a body that is not JSON: "
                                                    f"{data[:200].decode(errors='replace')!r}")

    def _read_body(self, response, sock, left: Callable[[], float], limit: int) -> bytes:
        """The answer's body, read in pieces with the socket's timeout set to the time left before each; a 2xx body
        over `limit` bytes is a RemoteRewardError as soon as it is seen (memory stays ~ `limit`), an error body is
        cut at `limit`; a connection closed before the announced length is `_Retryable`."""
        declared = response.getheader("Content-Length")
        declared = int(declared) if declared and declared.strip().isdigit() else None
        too_large = (f"the answer is larger than max_response_bytes={self.max_response_bytes} bytes "
                     f"({{}}); raise reward_kwargs.max_response_bytes if the endpoint's answers really are this large")
        if declared is not None and declared > limit and limit == self.max_response_bytes:
            raise RemoteRewardError(too_large.format(f"Content-Length: {declared}"))
        data = bytearray()
        while True:
            sock.settimeout(left())
            piece = response.read1(65536)
            if not piece:
                break
            data += piece
            if len(data) > limit:
                if limit == self.max_response_bytes:
                    raise RemoteRewardError(too_large.format(f"more than {limit} bytes read, still sending"))
                return bytes(data[:limit])
        if declared is not None and len(data) < declared:
            raise _Retryable(f"the connection closed after {len(data)} of the answer's {declared} bytes")
        return bytes(data)

    def _post_once(self, body: bytes, deadline: float, limit: str) -> object:
        """One POST that returns or fails by `deadline` (time.monotonic): the parsed JSON body of a 2xx answer.
        `_Retryable` for what may pass when tried again (a timeout says "timed out `limit`"), RemoteRewardError for
        what will not.

        The attempt runs on a thread of its own and this one waits for it until the deadline, then shuts its socket
        and gives up: no phase (name lookup, connect, TLS handshake, send, a server that drips one byte at a time)
        can hold the caller past it. Each socket operation of the attempt is bounded by the time left, so an
        abandoned attempt ends soon after too."""
        sockets: list[socket.socket] = []
        result: dict = {}
        attempt = threading.Thread(target=self._attempt, args=(body, deadline, sockets, result), daemon=True,
                                   name="remote-reward-attempt")
        seconds = max(0.0, deadline - time.monotonic())
        attempt.start()
        attempt.join(seconds)
        if attempt.is_alive() or isinstance(result.get("error"), TimeoutError):
            for sock in sockets:  # unblocks a read or write in the abandoned attempt
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            raise _Retryable(f"timed out {limit}")
        if "error" in result:
            raise result["error"]
        return result["value"]

    def post(self, payload) -> object:
        """POST `payload` (JSON-serialisable) with retries; the parsed answer, or RemoteRewardError naming the
        URL, the last status or error and the number of attempts. Each attempt ends by `timeout_s`, and all of
        them with their waits by `total_timeout_s` (when set)."""
        try:
            body = json.dumps(payload, default=_jsonable).encode()
        except (TypeError, ValueError) as exc:
            raise RemoteRewardError(f"POST {self.endpoint}: the sample cannot be sent as JSON: {exc}") from None
        end = time.monotonic() + float(self.total_timeout_s) if self.total_timeout_s else math.inf
        attempts, tried = int(self.max_retries) + 1, 0
        last: Exception | None = None
        for attempt in range(attempts):
            if not self._in_flight.acquire(timeout=None if end == math.inf else max(0.0, end - time.monotonic())):
                last = _Retryable(f"no request slot of max_concurrency={self.max_concurrency} came free in time")
                break
            now = time.monotonic()
            deadline, limit = ((now + float(self.timeout_s), f"after {self.timeout_s:g} s (timeout_s)")
                               if now + float(self.timeout_s) <= end
                               else (end, f"at the end of total_timeout_s={self.total_timeout_s:g} s"))
            tried += 1
            try:
                return self._post_once(body, deadline, limit)
            except RemoteRewardError as exc:
                raise RemoteRewardError(f"POST {self.endpoint} failed (not retried): {exc}") from None
            except _Retryable as exc:
                last = exc
            finally:
                self._in_flight.release()
            if attempt + 1 < attempts:
                wait_s = min(float(self.max_backoff_s), float(self.backoff_s) * 2**attempt)
                if time.monotonic() + wait_s >= end:
                    break
                time.sleep(wait_s)
        within = f" within total_timeout_s={self.total_timeout_s:g} s" if self.total_timeout_s and tried < attempts \
            else ""
        raise RemoteRewardError(f"POST {self.endpoint} failed after {tried} attempt(s) (1 + max_retries="
                                f"{self.max_retries}){within}: {last}")

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


CLIENT_KEYS = ("url", "max_retries", "max_concurrency", "batch_size", "backoff_s", "max_backoff_s", "headers",
               "max_response_bytes", "total_timeout_s")


@register_reward_manager("http")
class RemoteRewardManager(BaseRewardManager):
    """Reward manager `http`: every sample is scored by a `RemoteRewardClient` (no local reward function).

    Configured through `reward_model.reward_kwargs` (its keys `url`, `max_retries`, `max_concurrency`,
    `batch_size`, `backoff_s`, `max_backoff_s`, `headers`, `max_response_bytes`, `total_timeout_s` go to the client;
    the others are sent with every sample) and `reward_model.timeout_s` (per attempt). `client=` gives a built client instead. Failed samples
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
