"""`hyflow serve`: a Tinker-compatible training and sampling service on one base model, a LoRA adapter per client.

A user's loop written against the `tinker` SDK runs here unchanged but for the base URL and the model name:

    hyflow serve --model PATH                      # prints the URL and a generated API key
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python my_tinker_loop.py

`hyflow.serve.host` holds the model, the runs and their files; `hyflow.serve.app` the REST routes; `wire` the
protobuf bodies. docs/serve.md says what is supported and what is refused.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from pathlib import Path


def new_api_key() -> str:
    return "tml-hyflow-" + secrets.token_urlsafe(24)


def start(model: str, *, name: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          api_keys: list[str] | None = None, store: str | None = None, device: str = "cpu", dtype: str = "float32",
          max_runs: int = 64, workers: int = 1, cpus_per_worker: float = 1.0, **limits):
    """Load the model and start serving in a background thread; returns (service, url, keys, stop()).
    For tests and notebooks; `serve()` is the blocking CLI form."""
    import threading

    from aiohttp import web

    from hyflow.serve.app import TinkerService
    from hyflow.serve.host import ModelHost

    keys = list(api_keys or [new_api_key()])
    store = store or Path("~/.cache/hyflow/serve").expanduser()
    if workers > 1:  # replicas on Ray workers (hyflow.serve.replicas)
        from hyflow.serve.replicas import ReplicatedHost

        model_host = ReplicatedHost(model, name=name or model, store=store, workers=workers, device=device,
                                    dtype=dtype, max_runs=max_runs, cpus_per_worker=cpus_per_worker)
    else:
        model_host = ModelHost(model, name=name or model, store=store, device=device, dtype=dtype, max_runs=max_runs)
    service = TinkerService(model_host, keys, **limits)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(service.app(), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, host, port)
    loop.run_until_complete(site.start())
    bound = site._server.sockets[0].getsockname()[1]  # port 0: the OS picked one
    thread = threading.Thread(target=loop.run_forever, name="hyflow-serve-http", daemon=True)
    thread.start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        service.close()
        if hasattr(model_host, "close"):
            model_host.close()

    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{bound}"
    return service, url, keys, stop


def serve(args) -> int:
    """The CLI command (`hyflow serve`): serve until Ctrl-C / SIGTERM."""
    import threading

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.allow_remote:
        raise ValueError(f"--host {args.host} would accept connections from other machines; pass --allow-remote too "
                         "if that is what you want (the API key is then all that guards the service)")
    keys = list(args.api_key or [])
    generated = not keys
    service, url, keys, stop = start(args.model, name=args.name, host=args.host, port=args.port, api_keys=keys,
                                     store=args.store, device=args.device, dtype=args.dtype,
                                     max_pending=args.max_pending, max_body_bytes=args.max_body_mb << 20,
                                     max_batch_samples=args.max_batch_samples, max_runs=args.max_runs,
                                     session_ttl_s=args.session_ttl_s, workers=args.workers,
                                     cpus_per_worker=args.cpus_per_worker)
    where = f"{args.workers} Ray workers" if args.workers > 1 else args.device
    print(f"hyflow serve: {service.host.name!r} ({service.host.arch}, {where}) on {url}; checkpoints in "
          f"{service.host.store}", flush=True)
    print(f"  export TINKER_BASE_URL={url}", flush=True)
    print(f"  export TINKER_API_KEY={keys[0]}" + ("   # generated for this start" if generated else ""), flush=True)
    print(f"  base_model={service.host.name!r} in create_lora_training_client / create_sampling_client", flush=True)
    try:
        threading.Event().wait()
    finally:
        print(f"hyflow serve: stopping after {service.calls_done} calls", file=sys.stderr, flush=True)
        stop()
    return 0
