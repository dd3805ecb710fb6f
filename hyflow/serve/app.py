"""`hyflow serve`'s HTTP side: the REST routes the `tinker` SDK (0.38) speaks, over aiohttp, in front of one
`ModelHost` (hyflow.serve.host) driven by one worker thread.

The SDK's calls are futures: a training or sampling call returns `{"request_id": ...}` at once and the client
polls `/api/v1/retrieve_future`, which waits up to `POLL_WAIT_S` for the result and otherwise answers
`{"type": "try_again"}`. Work runs in arrival order (the SDK sends one training client's calls in its own order),
one call at a time, so a client's adapter, gradients and optimizer are never touched by another's call.

Safe by default: every route but `/api/v1/healthz` needs an `X-API-Key` the service was started with (a key owns
the runs and checkpoints it made: another key gets 404 for them); bodies are bounded (`max_body_bytes`), queued
work is bounded (`max_pending`: 429 past it) and kept results too (`max_results`, `result_ttl_s`); a malformed
request gets a 4xx with the reason (`{"detail": ...}`), an error inside a call fails that call's future
(`{"error": ..., "category": "user"|"server"}`), never the service.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from aiohttp import web

from hyflow.rollout.base import SamplingParams
from hyflow.serve.host import LoraSpec, ModelHost, Run, SampleAsk, ServeError
from hyflow.serve.wire import forward_backward_output, parse_forward_backward, sample_output

POLL_WAIT_S = 20.0  # a retrieve_future call waits this long for its result before answering try_again
# a sample call waits for more sample calls to decode with it while they keep coming: up to BATCH_GAP_S after the
# last one arrived, BATCH_MAX_WAIT_S in all (a lone call pays BATCH_GAP_S; an SDK's burst of calls arrives over tens
# of milliseconds, one HTTP request at a time)
BATCH_GAP_S = 0.02
RETRIEVED_GRACE_S = 60.0  # a fetched result is kept this long (a client's retried poll finds it)
KEEP_SNAPSHOTS = 8  # unnamed sampler snapshots (save_weights_and_get_sampling_client) kept per run
MAX_SESSIONS = 4096  # sessions per service (a ServiceClient opens one)
MAX_SAMPLERS = 16384  # sampling sessions kept (the oldest go first)
BATCH_MAX_WAIT_S = 0.1


@dataclass
class _Call:
    request_id: str
    owner: str
    kind: str
    done: threading.Event = field(default_factory=threading.Event)
    ready: asyncio.Event | None = None  # made by the first poll; set on the event loop when `done` is
    content_type: str = "application/json"
    body: bytes = b""
    finished: float = 0.0
    loop: asyncio.AbstractEventLoop | None = None
    retrieved: float = 0.0  # when a client first fetched the result


@dataclass(frozen=True)
class _Sampling:
    """A queued sample call: calls with equal `key` (the same weights and sampling settings) decode as one batch."""

    owner: str
    path: str | None
    params: SamplingParams
    ask: SampleAsk

    @property
    def key(self) -> tuple:
        # the base model is everyone's: calls of different API keys on it decode together; a checkpoint is its
        # owner's (resolved with that key)
        return (self.owner if self.path is not None else None, self.path, self.params)


class TinkerService:
    """The routes (module docstring) and the worker thread; `app()` is the aiohttp application."""

    def __init__(self, host: ModelHost, api_keys: list[str], *, max_pending: int = 256,
                 max_body_bytes: int = 64 << 20, max_results: int = 4096, result_ttl_s: float = 3600.0,
                 max_samples: int = 128, max_new_tokens: int = 4096, max_batch_samples: int = 256,
                 session_ttl_s: float = 300.0) -> None:
        if not api_keys:
            raise ValueError("hyflow serve needs at least one API key")
        if max_batch_samples < 1:
            raise ValueError(f"--max-batch-samples must be >= 1 (1: no batching), got {max_batch_samples}")
        bad = [k for k in api_keys if not k.startswith("tml-") or len(k) < 12]
        if bad:
            raise ValueError("an API key must start with 'tml-' (the tinker SDK refuses others) and be at least 12 "
                             "characters long")
        self.host = host
        # a key's owner id is a digest of the key: the same key owns its checkpoints after a restart too
        self._keys = {hashlib.sha256(k.encode()).hexdigest(): "owner-" + hashlib.sha256(b"hyflow-serve:" + k.encode())
                      .hexdigest()[:16] for k in api_keys}
        self.max_pending = max_pending
        self.max_body_bytes = max_body_bytes
        self.max_results = max_results
        self.result_ttl_s = result_ttl_s
        self.max_samples = max_samples
        self.max_new_tokens = max_new_tokens
        self.max_batch_samples = max_batch_samples
        self.samples_batched = 0  # decoding batches that held more than one sample call
        self._calls: OrderedDict[str, _Call] = OrderedDict()
        self._lock = threading.Lock()
        self._jobs: collections.deque = collections.deque()  # (call, work) in arrival order
        self._wake = threading.Condition(self._lock)
        self._pending = 0
        self._sessions: dict[str, str] = {}  # session id -> owner
        self._metadata: dict[str, dict] = {}  # run id -> the user_metadata its client created it with
        self._seen: dict[str, float] = {}  # session id -> time of its last heartbeat (monotonic)
        self._ended: dict[str, str] = {}  # expired session id -> owner (a late heartbeat gets 410)
        self.session_ttl_s = session_ttl_s
        self._samplers: dict[str, tuple[str, str | None]] = {}  # sampling session id -> (owner, tinker path)
        self._ids = itertools.count(1)
        self.calls_done = 0
        self._worker = threading.Thread(target=self._work, name="hyflow-serve-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ application
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard])
        post = {
            "client/config": self._client_config, "client/dynamic_config": self._dynamic_config,
            "create_session": self._create_session, "session_heartbeat": self._heartbeat,
            "telemetry": self._telemetry, "create_model": self._create_model, "get_info": self._get_info,
            "forward_backward": self._forward_backward, "optim_step": self._optim_step,
            "save_weights": self._save_weights, "save_weights_for_sampler": self._save_for_sampler,
            "load_weights": self._load_weights, "create_sampling_session": self._create_sampling_session,
            "asample": self._sample, "retrieve_future": self._retrieve, "cancel_future": self._cancel,
            "weights_info": self._weights_info, "unload_model": self._unload,
        }
        for path, handler in post.items():
            app.router.add_post(f"/api/v1/{path}", handler)
        app.router.add_get("/api/v1/healthz", self._health)
        app.router.add_get("/api/v1/get_server_capabilities", self._capabilities)
        app.router.add_get("/api/v1/training_runs/{run_id}", self._training_run)
        app.router.add_get("/api/v1/training_runs/{run_id}/checkpoints", self._list_checkpoints)
        app.router.add_delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}", self._delete_checkpoint)
        app.router.add_get("/api/v1/samplers/{sampler_id}", self._get_sampler)
        app.router.add_post("/api/v1/sessions/{session_id}/finish", self._finish_session)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable):
        if request.path != "/api/v1/healthz":
            # keys are compared by their SHA-256 digests: the lookup's timing says nothing about a key's bytes
            owner = self._keys.get(hashlib.sha256(request.headers.get("X-API-Key", "").encode()).hexdigest())
            if owner is None:
                return _detail(401, "missing or unknown API key: pass the key `hyflow serve` printed (or was given "
                                    "with --api-key) as TINKER_API_KEY or ServiceClient(api_key=...)")
            request["owner"] = owner
        try:
            return await handler(request)
        except ServeError as exc:
            return _detail(exc.status, str(exc))
        except web.HTTPRequestEntityTooLarge:
            return _detail(413, f"the request body is larger than this service takes ({self.max_body_bytes >> 20} MiB, "
                                "hyflow serve --max-body-mb); send fewer data per call")
        except web.HTTPException:
            raise
        except Exception as exc:  # a bug in a route must not take the service down: the client gets a 500
            traceback.print_exc()
            return _detail(500, f"{type(exc).__name__}: {exc} (a bug in hyflow serve; the service goes on)")

    # ------------------------------------------------------------------ worker
    def _submit(self, owner: str, kind: str, work: Callable[[], tuple[str, bytes]], **extra) -> web.Response:
        with self._lock:
            if self._pending >= self.max_pending:
                raise ServeError(f"{self._pending} calls are queued already (--max-pending {self.max_pending}); "
                                 "retry later", 429)
            self._prune()
            call = _Call(f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", owner, kind)
            self._calls[call.request_id] = call
            self._pending += 1
            self._jobs.append((call, work))
            self._wake.notify()
        return web.json_response({"request_id": call.request_id, **extra})

    def _prune(self) -> None:
        """Drop kept results: those fetched over RETRIEVED_GRACE_S ago (a client may poll twice), any older than
        `result_ttl_s`, and past `max_results` the oldest fetched ones first; a result nobody fetched yet goes only
        by age or when there are still too many."""
        now = time.time()
        for request_id in list(self._calls):
            call = self._calls[request_id]
            if call.done.is_set() and (now - call.finished > self.result_ttl_s or
                                       (call.retrieved and now - call.retrieved > RETRIEVED_GRACE_S)):
                del self._calls[request_id]
        for fetched_first in (True, False):
            for request_id in list(self._calls):
                if len(self._calls) <= self.max_results:
                    return
                call = self._calls[request_id]
                if call.done.is_set() and (bool(call.retrieved) or not fetched_first):
                    del self._calls[request_id]

    def _next_jobs(self) -> list[tuple[_Call, Callable | _Sampling]]:
        """The next job, and with a sample call every sample call queued right behind it on the same weights and
        sampling settings (one decoding batch, `max_batch_samples` samples at most), waiting for more while they keep
        arriving (BATCH_GAP_S, BATCH_MAX_WAIT_S: an SDK sends a loop's calls one HTTP request at a time). Order
        is kept: a merge stops at the first other call, so no call ever overtakes a training call."""
        with self._wake:
            while not self._jobs:
                self._wake.wait()
            group = [self._jobs.popleft()]
            work = group[0][1]
            if not isinstance(work, _Sampling):
                return group
            total, start = work.ask.num_samples, time.monotonic()
            deadline = start + BATCH_GAP_S
            while total < self.max_batch_samples:
                if not self._jobs:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._wake.wait(left):
                        break
                    continue
                following = self._jobs[0][1]
                if not isinstance(following, _Sampling) or following.key != work.key or \
                        total + following.ask.num_samples > self.max_batch_samples:
                    break
                total += following.ask.num_samples
                group.append(self._jobs.popleft())
                deadline = min(start + BATCH_MAX_WAIT_S, time.monotonic() + BATCH_GAP_S)
            return group

    def _work(self) -> None:
        while True:
            group = self._next_jobs()
            if group[0][0] is None:
                return
            try:
                if isinstance(group[0][1], _Sampling):
                    self._run_sampling(group)
                else:
                    call, work = group[0]
                    self._finish(call, *work())
            except Exception as exc:  # never lose the worker: every call of the group not yet answered fails
                for call, _ in group:
                    if not call.done.is_set():
                        self._fail(call, exc)

    def _run_sampling(self, group: list) -> None:
        first = group[0][1]
        adapter = self.host.sampler_weights(first.path, first.owner) if first.path is not None else None
        params = dataclasses.replace(first.params, max_new_tokens=max(w.ask.max_tokens for _, w in group))
        results = self.host.sample([w.ask for _, w in group], params, adapter)
        self.samples_batched += len(group) > 1
        for (call, _), samples in zip(group, results, strict=True):
            self._finish(call, "application/x-protobuf", sample_output(samples))

    def _fail(self, call: _Call, exc: Exception) -> None:
        if isinstance(exc, ServeError):
            body = {"error": str(exc), "category": "user"}
        else:
            traceback.print_exc()
            body = {"error": f"{type(exc).__name__}: {exc}", "category": "server"}
        self._finish(call, "application/json", json.dumps(body).encode())

    def _finish(self, call: _Call, content_type: str, body: bytes) -> None:
        call.content_type, call.body = content_type, body
        call.finished = time.time()
        with self._lock:
            self._pending -= 1
            self.calls_done += 1
        call.done.set()
        with self._lock:  # a poll that registered before `done` was set is woken; one after it sees `done`
            loop, ready = call.loop, call.ready
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the service is stopping
                loop.call_soon_threadsafe(ready.set)

    def close(self) -> None:
        with self._wake:
            self._jobs.appendleft((None, None))
            self._wake.notify()
        self._worker.join(timeout=30)

    async def _retrieve(self, request: web.Request) -> web.Response:
        body = await _json(request)
        request_id = str(body.get("request_id", ""))
        with self._lock:
            call = self._calls.get(request_id)
        if call is None or call.owner != request["owner"]:
            return _detail(404, f"no pending or kept result {request_id!r} (results are kept {self.result_ttl_s:.0f} s)")
        with self._lock:
            if call.ready is None:
                call.ready, call.loop = asyncio.Event(), asyncio.get_running_loop()
        try:
            if not call.done.is_set():
                await asyncio.wait_for(call.ready.wait(), POLL_WAIT_S)
        except asyncio.TimeoutError:
            return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        call.retrieved = call.retrieved or time.time()
        return web.Response(body=call.body, content_type=call.content_type)

    async def _cancel(self, request: web.Request) -> web.Response:
        await _json(request)
        return web.json_response({})

    # ------------------------------------------------------------------ session routes
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _capabilities(self, request: web.Request) -> web.Response:
        config = self.host.config
        return web.json_response({"supported_models": [{
            "model_name": self.host.name, "trainable": True, "sampleable": True,
            "max_context_length": getattr(config, "max_position_embeddings", None)}]})

    async def _client_config(self, request: web.Request) -> web.Response:
        await _json(request)
        # plain httpx transport (loopback HTTP), uncompressed protobuf bodies, custom losses on the client
        return web.json_response({"pjwt_auth_enabled": False, "use_pyqwest_transport": False,
                                  "proto_compress_fwdbwd": False, "custom_loss_server_side": False,
                                  "sample_use_retrieve_futures": False, "sample_join_sampling_session": False,
                                  "fwdbwd_max_chunk_bytes_count": self.max_body_bytes // 2})

    async def _dynamic_config(self, request: web.Request) -> web.Response:
        await _json(request)
        return web.json_response({})

    async def _create_session(self, request: web.Request) -> web.Response:
        await _json(request)
        self.expire_sessions()
        if len(self._sessions) >= MAX_SESSIONS:
            raise ServeError(f"this service holds {MAX_SESSIONS} live sessions; retry when some have ended "
                             f"(a session ends {self.session_ttl_s:.0f} s after its client's last heartbeat)", 429)
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        self._sessions[session_id] = request["owner"]
        self._seen[session_id] = time.monotonic()
        return web.json_response({"type": "create_session", "session_id": session_id})

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await _json(request)
        session_id = body.get("session_id")
        if session_id in self._ended and self._ended[session_id] == request["owner"]:
            return _detail(410, f"session {session_id!r} ended: no heartbeat for {self.session_ttl_s:.0f} s; its "
                                "training runs were unloaded (their checkpoints stay)")
        if self._sessions.get(session_id) != request["owner"]:
            return _detail(404, f"no session {session_id!r} for this API key")
        self._seen[session_id] = time.monotonic()
        self.expire_sessions()
        return web.json_response({"type": "session_heartbeat"})

    async def _finish_session(self, request: web.Request) -> web.Response:
        """`ServiceClient.close(status)`: the session ends now, as an expired one does (its runs unloaded,
        checkpoints kept); closing it again changes nothing."""
        await _json(request)
        session_id = request.match_info["session_id"]
        if self._ended.get(session_id) == request["owner"]:
            return web.json_response({})
        if self._sessions.get(session_id) != request["owner"]:
            return _detail(404, f"no session {session_id!r} for this API key")
        self._end_session(session_id)
        return web.json_response({})

    def _end_session(self, session_id: str) -> None:
        owner = self._sessions.pop(session_id)
        self._seen.pop(session_id, None)
        self._ended[session_id] = owner
        while len(self._ended) > MAX_SESSIONS:
            del self._ended[next(iter(self._ended))]
        for run_id in [r for r in list(self.host.runs) if r.startswith(f"{session_id}:train:")]:
            run = self.host.runs[run_id]
            run.closing = True
            self._submit(owner, "unload_model", lambda run=run: (self.host.unload(run), _ok({}))[1])

    def expire_sessions(self) -> list[str]:
        """End the sessions whose client has sent no heartbeat for `session_ttl_s` (the SDK sends one every 10 s
        while its ServiceClient lives): their training runs are unloaded through the work queue (checkpoints
        stay), and a late heartbeat gets 410, which stops the SDK's heartbeat loop. The ended session ids."""
        now = time.monotonic()
        ended = [s for s, seen in self._seen.items() if now - seen > self.session_ttl_s]
        for session_id in ended:
            self._end_session(session_id)
        return ended

    async def _telemetry(self, request: web.Request) -> web.Response:
        await request.read()  # the SDK's own telemetry: read and dropped, nothing leaves this machine
        return web.json_response({"status": "accepted"})

    # ------------------------------------------------------------------ training routes
    async def _create_model(self, request: web.Request) -> web.Response:
        from tinker import types

        body = _validated(types.CreateModelRequest, await _json(request))
        owner = request["owner"]
        self._check_session(body.session_id, owner)
        if body.lora_config is None:
            raise ServeError("hyflow serve trains LoRA adapters only: create the client with "
                             "create_lora_training_client(base_model, rank=...)")
        _check_optimizer_config(body.optimizer_config)
        lora = LoraSpec(rank=body.lora_config.rank, seed=body.lora_config.seed,
                        train_attn=body.lora_config.train_attn, train_mlp=body.lora_config.train_mlp,
                        train_unembed=body.lora_config.train_unembed)

        run_id = f"{body.session_id}:train:{body.model_seq_id}"  # the id the SDK derives too

        def work():
            run = self.host.create_run(owner, run_id, body.base_model, lora)
            self.host.record_owner(run)
            self._metadata[run.run_id] = dict(body.user_metadata or {})
            return _ok({"type": "create_model", "model_id": run.run_id})

        return self._submit(owner, "create_model", work)

    async def _get_info(self, request: web.Request) -> web.Response:
        body = await _json(request)
        run = self.host.run_of(str(body.get("model_id")), request["owner"])
        return web.json_response({
            "type": "get_info", "model_id": run.run_id, "is_lora": True, "lora_rank": run.lora.rank,
            "model_name": self.host.name,
            "model_data": {"arch": self.host.arch, "model_name": self.host.name,
                           "tokenizer_id": self.host.model_path}})

    async def _forward_backward(self, request: web.Request) -> web.Response:
        if request.headers.get("Content-Encoding"):
            raise ServeError(f"Content-Encoding {request.headers['Content-Encoding']!r} is not accepted (this "
                             "service asks the SDK for uncompressed bodies)", 415)
        model_id, _, loss_fn, config, forward_only, data = parse_forward_backward(await request.read())
        owner = request["owner"]
        run = self.host.run_of(model_id, owner)

        def work():
            outputs, metrics = self.host.forward_backward(run, data, loss_fn, config, forward_only=forward_only)
            return "application/x-protobuf", forward_backward_output(outputs, metrics)

        return self._submit(owner, "forward_backward", work)

    async def _optim_step(self, request: web.Request) -> web.Response:
        from tinker import types

        body = _validated(types.OptimStepRequest, await _json(request))
        owner = request["owner"]
        run = self.host.run_of(body.model_id, owner)
        params = body.optim_params
        if not isinstance(params, types.AdamParams):
            raise ServeError(f"optim_step: {type(params).__name__} is not supported; hyflow serve runs AdamW "
                             "(AdamParams)")

        def work():
            metrics = self.host.optim_step(run, learning_rate=params.learning_rate, beta1=params.beta1,
                                           beta2=params.beta2, eps=params.eps, weight_decay=params.weight_decay,
                                           grad_clip_norm=params.grad_clip_norm)
            return _ok({"metrics": metrics})

        return self._submit(owner, "optim_step", work)

    async def _save_weights(self, request: web.Request) -> web.Response:
        from tinker import types

        body = _validated(types.SaveWeightsRequest, await _json(request))
        _refuse_ttl(body.ttl_seconds)
        owner = request["owner"]
        run = self.host.run_of(body.model_id, owner)
        name = body.path or f"step-{run.steps:06d}"

        def work():
            path = self.host.save(run, name, kind="weights", optimizer=True, overwrite=body.overwrite,
                                  user_metadata=body.user_metadata)
            return _ok({"type": "save_weights", "path": path})

        return self._submit(owner, "save_weights", work)

    async def _save_for_sampler(self, request: web.Request) -> web.Response:
        from tinker import types

        body = _validated(types.SaveWeightsForSamplerRequest, await _json(request))
        _refuse_ttl(body.ttl_seconds)
        if body.kind != "snapshot":
            raise ServeError(f"save_weights_for_sampler kind={body.kind!r} is not supported by hyflow serve (only "
                             "'snapshot': the weights as they are now)")
        owner = request["owner"]
        run = self.host.run_of(body.model_id, owner)
        named = body.path is not None

        def work():
            name = body.path if named else f"ephemeral-{next(self._ids):09d}-{uuid.uuid4().hex[:8]}"
            path = self.host.save(run, name, kind="sampler_weights", optimizer=False, overwrite=True,
                                  user_metadata=body.user_metadata)
            reply = {"type": "save_weights_for_sampler", "path": path}
            if not named:  # save_weights_and_get_sampling_client: a sampling session on the snapshot
                reply["sampling_session_id"] = self._add_sampler(owner, path)
                self._drop_old_snapshots(run, owner)
            return _ok(reply)

        return self._submit(owner, "save_weights_for_sampler", work)

    def _drop_old_snapshots(self, run: Run, owner: str) -> None:
        """An RL loop makes an unnamed sampler snapshot every iteration: a run keeps its newest
        `KEEP_SNAPSHOTS` (older sampling clients of the run then get 404); named ones stay until deleted."""
        found = sorted(c["checkpoint_id"] for c in self.host.checkpoints(run.run_id, owner)
                       if c["checkpoint_id"].startswith("sampler_weights/ephemeral-"))
        for checkpoint_id in found[:-KEEP_SNAPSHOTS]:
            self.host.delete_checkpoint(run.run_id, checkpoint_id, owner)
            gone = f"tinker://{run.run_id}/{checkpoint_id}"
            with self._lock:
                for session in [s for s, (_, path) in self._samplers.items() if path == gone]:
                    del self._samplers[session]

    def _add_sampler(self, owner: str, path: str | None) -> str:
        """A new sampling session on `path` (None: the base model); the oldest beyond MAX_SAMPLERS are dropped."""
        session = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._samplers[session] = (owner, path)
            while len(self._samplers) > MAX_SAMPLERS:
                del self._samplers[next(iter(self._samplers))]
        return session

    async def _load_weights(self, request: web.Request) -> web.Response:
        from tinker import types

        body = _validated(types.LoadWeightsRequest, await _json(request))
        if body.weights_access_token is not None:
            raise ServeError("weights_access_token is not supported by hyflow serve: a key reads only its own "
                             "checkpoints (start the service with that key, --api-key)")
        if body.optimizer_config is not None:
            _check_optimizer_config(body.optimizer_config)
        owner = request["owner"]
        _, directory, state = self.host.resolve(body.path, owner)
        if body.model_id is not None:
            target: Run | None = self.host.run_of(body.model_id, owner)
        else:  # create_training_client_from_state: a new run shaped like the checkpoint's
            self._check_session(body.session_id, owner)
            target = None

        def work():
            if target is not None:
                self.host.load(target, directory, state, optimizer=body.optimizer, tinker_path=body.path)
                return _ok({"type": "load_weights", "path": body.path, "model_id": target.run_id})
            try:
                lora = LoraSpec(**state["lora"])
            except (KeyError, TypeError) as exc:
                raise ServeError(f"checkpoint {body.path!r} is corrupt: its state.json has no LoRA shape", 422) from exc
            run = self.host.create_run(owner, f"{body.session_id}:train:{body.model_seq_id}",
                                       body.base_model or state["base_model"], lora)
            try:
                self.host.load(run, directory, state, optimizer=body.optimizer, tinker_path=body.path)
            except BaseException:
                self.host.unload(run)  # a client that failed to start leaves no run behind
                raise
            self.host.record_owner(run)
            self._metadata[run.run_id] = dict(body.user_metadata or {})
            return _ok({"type": "load_weights", "path": body.path, "model_id": run.run_id})

        return self._submit(owner, "load_weights", work)

    async def _unload(self, request: web.Request) -> web.Response:
        body = await _json(request)
        owner = request["owner"]
        run = self.host.run_of(str(body.get("model_id")), owner)

        def work():
            self.host.unload(run)
            return _ok({"type": "unload_model", "model_id": run.run_id})

        return self._submit(owner, "unload_model", work)

    async def _weights_info(self, request: web.Request) -> web.Response:
        body = await _json(request)
        _, _, state = self.host.resolve(str(body.get("tinker_path")), request["owner"])
        lora = state.get("lora", {})
        return web.json_response({"base_model": state.get("base_model"), "is_lora": True,
                                  "lora_rank": lora.get("rank"), "train_attn": lora.get("train_attn"),
                                  "train_mlp": lora.get("train_mlp"), "train_unembed": lora.get("train_unembed")})

    # ------------------------------------------------------------------ checkpoints
    async def _training_run(self, request: web.Request) -> web.Response:
        run_id = request.match_info["run_id"]
        owner = request["owner"]
        run = self.host.run_of(run_id, owner)
        return web.json_response(self._run_json(run))

    def _run_json(self, run: Run) -> dict:
        return {"training_run_id": run.run_id, "base_model": self.host.name, "model_owner": run.owner,
                "is_lora": True, "lora_rank": run.lora.rank, "last_request_time": _iso(run.last_request),
                "user_metadata": self._metadata.get(run.run_id) or None}

    async def _list_checkpoints(self, request: web.Request) -> web.Response:
        found = self.host.checkpoints(request.match_info["run_id"], request["owner"])
        for item in found:
            item["time"] = _iso(item["time"])
        return web.json_response({"checkpoints": found})

    async def _delete_checkpoint(self, request: web.Request) -> web.Response:
        info = request.match_info
        self.host.delete_checkpoint(info["run_id"], f"{info['kind']}/{info['name']}", request["owner"])
        return web.json_response({})

    # ------------------------------------------------------------------ sampling
    async def _create_sampling_session(self, request: web.Request) -> web.Response:
        from tinker import types

        body = _validated(types.CreateSamplingSessionRequest, await _json(request))
        owner = request["owner"]
        self._check_session(body.session_id, owner)
        if body.model_path is not None:
            self.host.resolve(body.model_path, owner)  # 404 now for a path this key cannot read
        elif body.base_model != self.host.name:
            raise ServeError(f"base_model {body.base_model!r} is not served here; this service serves "
                             f"{self.host.name!r}", 400)
        session = self._add_sampler(owner, body.model_path)
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": session})

    async def _get_sampler(self, request: web.Request) -> web.Response:
        sampler_id = request.match_info["sampler_id"]
        owner, path = self._samplers.get(sampler_id, (None, None))
        if owner != request["owner"]:
            return _detail(404, f"no sampling session {sampler_id!r} for this API key")
        return web.json_response({"sampler_id": sampler_id, "base_model": self.host.name, "model_path": path})

    async def _sample(self, request: web.Request) -> web.Response:
        from tinker import types

        body = _validated(types.SampleRequest, await _json(request))
        owner = request["owner"]
        if body.sampling_session_id is not None:
            session_owner, path = self._samplers.get(body.sampling_session_id, (None, None))
            if session_owner != owner:
                return _detail(404, f"no sampling session {body.sampling_session_id!r} for this API key")
        else:
            path = body.model_path
            if path is None and body.base_model != self.host.name:
                raise ServeError(f"sample: name a sampling session, a model_path or base_model={self.host.name!r}")
        unsupported = [name for name, on in (("prompt_logprobs", body.prompt_logprobs),
                                             ("topk_prompt_logprobs", body.topk_prompt_logprobs),
                                             ("topk_sample_logprobs", body.topk_sample_logprobs),
                                             ("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
                                             ("target_prompt_logprobs", body.target_prompt_logprobs is not None),
                                             ("prompt_logprobs_last_n", body.prompt_logprobs_last_n is not None),
                                             ("record_stability_info", body.record_stability_info))
                       if on]
        if unsupported:
            raise ServeError(f"sample: {unsupported} are not supported by hyflow serve yet (only the sampled "
                             "tokens' log-probs come back)")
        if not 1 <= body.num_samples <= self.max_samples:
            raise ServeError(f"num_samples must be in [1, {self.max_samples}] (--max-samples), got {body.num_samples}")
        prompt = _prompt_tokens(body.prompt)
        params, seed, max_tokens = self._sampling_params(body.sampling_params)
        self.host.check_prompt(prompt, max_tokens)
        job = _Sampling(owner, path, params, SampleAsk(prompt, body.num_samples, max_tokens, seed))
        # one id per sample, fixed at submission (the SDK stamps them on the returned sequences)
        return self._submit(owner, "sample", job,
                            sample_sequence_ids=[f"seq-{uuid.uuid4().hex[:12]}" for _ in range(body.num_samples)])

    def _sampling_params(self, given) -> tuple[SamplingParams, int | None, int]:
        max_tokens = given.max_tokens if given.max_tokens is not None else 256
        if not 1 <= max_tokens <= self.max_new_tokens:
            raise ServeError(f"sampling_params.max_tokens must be in [1, {self.max_new_tokens}] (--max-new-tokens), "
                             f"got {max_tokens}")
        stop_ids: list[int] = []
        stops = given.stop if given.stop is not None else []
        for stop in [stops] if isinstance(stops, (str, int)) else list(stops):
            if isinstance(stop, int):
                stop_ids.append(stop)
                continue
            ids = self.host.tokenizer.encode(stop, add_special_tokens=False)
            if len(ids) != 1:
                raise ServeError(f"stop string {stop!r} is {len(ids)} tokens of this tokenizer; hyflow serve stops on "
                                 "single tokens (pass token ids, or strings that are one token)")
            stop_ids.append(ids[0])
        try:
            params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=float(given.temperature),
                                    top_p=float(given.top_p), top_k=int(given.top_k),
                                    stop_token_ids=tuple(stop_ids), calculate_log_probs=True)
        except ValueError as exc:
            raise ServeError(f"sampling_params: {exc}") from exc
        return params, given.seed, max_tokens

    def _check_session(self, session_id: str | None, owner: str) -> None:
        if self._sessions.get(session_id) != owner:
            raise ServeError(f"no session {session_id!r} for this API key", 404)


def _refuse_ttl(ttl_seconds) -> None:
    if ttl_seconds is not None:
        raise ServeError("ttl_seconds is not supported by hyflow serve: checkpoints stay until deleted "
                         "(RestClient.delete_checkpoint); leave it unset")


def _check_optimizer_config(config) -> None:
    if getattr(config, "type", None) != "adamw":
        raise ServeError(f"optimizer_config {config!r} is not supported by hyflow serve: it runs AdamW "
                         "(AdamOptimizerConfig) with the AdamParams of each optim_step")


def _prompt_tokens(model_input) -> list[int]:
    tokens: list[int] = []
    for chunk in model_input.chunks:
        if getattr(chunk, "type", None) != "encoded_text":
            raise ServeError(f"a {getattr(chunk, 'type', type(chunk).__name__)!r} prompt chunk: hyflow serve samples "
                             "text models only (token chunks)")
        tokens += list(chunk.tokens)
    return tokens


def _ok(payload: dict) -> tuple[str, bytes]:
    return "application/json", json.dumps(payload).encode()


def _detail(status: int, message: str) -> web.Response:
    return web.json_response({"detail": message}, status=status)


def _iso(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, tz=timezone.utc).isoformat()


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ServeError(f"the body is not JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise ServeError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _validated(model, body: dict):
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
        raise ServeError(f"{model.__name__}: {problems}") from exc
