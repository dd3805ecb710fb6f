"""`hyflow serve`'s overhead: forward_backward + optim_step through the Tinker SDK and the service, against the same
work in process, and N concurrent clients against one.

The work: a LoRA adapter (rank `--rank`) on a random-weight model (`hyflow.models.tiny`, `--preset`, default small),
`--batch` data of `--tokens` tokens (random ids), cross-entropy on every token, `--steps` steps of one
forward_backward and one optim_step (AdamW, lr 1e-4), after one warm-up step.
- in process: `hyflow.serve.host.ModelHost` called directly (the service's own code path, no HTTP, no SDK);
- service: `hyflow serve` in its own process (as a user starts it), driven by the tinker SDK from this one;
- N clients: N training clients (threads here), each doing the same steps at once; aggregate tokens/s.
- sampling: `--sample-prompts` sample calls (`--sample-n` samples of at most `--sample-tokens` tokens each, the base
  model) submitted at once, as an RL loop does: generated tokens/s with the service batching calls queued together
  (the default), with a second service that takes one call at a time (`--max-batch-samples 1`), and in process
  (ModelHost.sample of all prompts as one batch).
The modes alternate for `--rounds` rounds; the medians are reported, and the ratio service / in process of the
time per step (the overhead: 1.10 = 10 % slower through the service). Nothing here is a pass/fail.

Run:  python benchmarks/bench_serve.py                       (small preset, batch 8 x 128 tokens, 5 steps, 3 rounds)
      python benchmarks/bench_serve.py --preset tiny --steps 2 --rounds 1 --clients 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import load_average, machine_info


def _data(tokens: int, batch: int, vocab: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, tokens + 1).tolist() for _ in range(batch)]


def in_process(host, rows, steps: int, rank: int) -> float:
    """Seconds per step, ModelHost called directly."""
    import torch

    from hyflow.serve.host import Datum, LoraSpec

    run = host.create_run("bench", f"session-{'0' * 12}:train:{len(host.runs)}", host.name, LoraSpec(rank=rank, seed=0))
    data = [Datum(r[:-1], {"target_tokens": torch.tensor(r[1:]), "weights": torch.ones(len(r) - 1)}) for r in rows]

    def step():
        host.forward_backward(run, data, "cross_entropy", None, forward_only=False)
        host.optim_step(run, learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0,
                        grad_clip_norm=0.0)

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - start) / steps
    host.unload(run)
    return elapsed


def through_service(url: str, key: str, rows, steps: int, rank: int, clients: int) -> float:
    """Seconds per step of each client (all clients step at once; the wall time of the slowest)."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=key)
    data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)}) for r in rows]
    trainers = [service.create_lora_training_client(base_model="bench", rank=rank, seed=0).result()
                for _ in range(clients)]

    def work(trainer, n):
        for _ in range(n):
            backward = trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            backward.result()

    for trainer in trainers:
        work(trainer, 1)  # warm-up
    threads = [threading.Thread(target=work, args=(t, steps)) for t in trainers]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = (time.perf_counter() - start) / steps
    service.close("success").result()
    return elapsed


def sampling(url: str, key: str, prompts, n: int, tokens: int) -> float:
    """Generated tokens per second of all prompts' sample calls submitted at once (an RL loop's sampling)."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=url, api_key=key)
    sampler = client.create_sampling_client(base_model="bench").result()
    params = types.SamplingParams(max_tokens=tokens, seed=0, temperature=1.0)
    sampler.sample(prompt=types.ModelInput.from_ints(prompts[0]), num_samples=1, sampling_params=params).result()
    start = time.perf_counter()
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=n, sampling_params=params)
               for p in prompts]
    generated = sum(len(s.tokens) for f in futures for s in f.result().sequences)
    rate = generated / (time.perf_counter() - start)
    client.close("success").result()
    return rate


def sampling_in_process(host, prompts, n: int, tokens: int) -> float:
    from hyflow.rollout.base import SamplingParams
    from hyflow.serve.host import SampleAsk

    asks = [SampleAsk(p, n, tokens, 0) for p in prompts]
    start = time.perf_counter()
    results = host.sample(asks, SamplingParams(max_new_tokens=tokens), None)
    return sum(len(s.tokens) for r in results for s in r) / (time.perf_counter() - start)


def start_service(model_dir: Path, store: Path, *extra: str) -> tuple[subprocess.Popen, str, str]:
    key = "tml-bench-" + os.urandom(8).hex()
    proc = subprocess.Popen([sys.executable, "-m", "hyflow", "serve", "--model", str(model_dir), "--name", "bench",
                             "--port", "0", "--api-key", key, "--store", str(store), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        found = re.search(r"export TINKER_BASE_URL=(\S+)", line)
        if found:
            return proc, found.group(1), key
    proc.kill()
    raise RuntimeError("hyflow serve did not print its URL within 300 s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample-prompts", type=int, default=16, help="sampling: prompts submitted at once")
    parser.add_argument("--sample-n", type=int, default=4, help="sampling: samples per prompt")
    parser.add_argument("--sample-tokens", type=int, default=32, help="sampling: max_tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    load_before = load_average()

    from hyflow.models.tiny import make_tiny_model
    from hyflow.serve.host import ModelHost

    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    model_dir = make_tiny_model(work / "model", preset=args.preset, seed=0)
    host = ModelHost(model_dir, name="bench", store=work / "store_in_process")
    rows = _data(args.tokens, args.batch, host.vocab_size, seed=0)
    proc, url, key = start_service(model_dir, work / "store_service")
    single, single_url, single_key = start_service(model_dir, work / "store_single", "--max-batch-samples", "1")
    prompts = [r[:8] for r in _data(7, args.sample_prompts, host.vocab_size, seed=1)]
    tokens = args.batch * args.tokens
    times: dict[str, list[float]] = {"in_process": [], "service": [], "clients": []}
    rates: dict[str, list[float]] = {"in_process": [], "service_batched": [], "service_one_call_at_a_time": []}
    try:
        for round_ in range(args.rounds):
            times["in_process"].append(in_process(host, rows, args.steps, args.rank))
            times["service"].append(through_service(url, key, rows, args.steps, args.rank, 1))
            times["clients"].append(through_service(url, key, rows, args.steps, args.rank, args.clients))
            shape = (args.sample_n, args.sample_tokens)
            rates["in_process"].append(sampling_in_process(host, prompts, *shape))
            rates["service_batched"].append(sampling(url, key, prompts, *shape))
            rates["service_one_call_at_a_time"].append(sampling(single_url, single_key, prompts, *shape))
            print(f"round {round_ + 1}/{args.rounds}: in process {times['in_process'][-1]:.3f} s/step, service "
                  f"{times['service'][-1]:.3f} s/step, {args.clients} clients {times['clients'][-1]:.3f} s/step each; "
                  f"sampling {rates['in_process'][-1]:,.0f} / {rates['service_batched'][-1]:,.0f} / "
                  f"{rates['service_one_call_at_a_time'][-1]:,.0f} tokens/s (in process / batched / one at a time)",
                  flush=True)
    finally:
        for p in (proc, single):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: statistics.median(v) for k, v in rates.items()}
    report = {
        "settings": vars(args), "tokens_per_step": tokens,
        "seconds_per_step": med, "rounds": times,
        "tokens_per_s": {"in_process": tokens / med["in_process"], "service": tokens / med["service"],
                         f"{args.clients}_clients_aggregate": args.clients * tokens / med["clients"]},
        "service_over_in_process": med["service"] / med["in_process"],
        "clients_aggregate_over_one": (args.clients * tokens / med["clients"]) / (tokens / med["service"]),
        "sampling_tokens_per_s": rate, "sampling_rounds": rates,
        "sampling_batched_over_one_at_a_time": rate["service_batched"] / rate["service_one_call_at_a_time"],
        "load_average_before": load_before, "load_average_after": load_average(), "machine": machine_info(),
        "command": " ".join(["python", *sys.argv]),
    }
    print(f"\n| mode | s/step (median of {args.rounds}) | tokens/s |\n|---|---|---|")
    print(f"| in process (ModelHost) | {med['in_process']:.3f} | {report['tokens_per_s']['in_process']:,.0f} |")
    print(f"| service (tinker SDK, 1 client) | {med['service']:.3f} | {report['tokens_per_s']['service']:,.0f} |")
    print(f"| service, {args.clients} clients at once | {med['clients']:.3f} per client | "
          f"{report['tokens_per_s'][f'{args.clients}_clients_aggregate']:,.0f} (aggregate) |")
    print(f"\nservice / in process (time per step): {report['service_over_in_process']:.3f}; "
          f"{args.clients} clients' aggregate / one client's throughput: {report['clients_aggregate_over_one']:.2f}")
    print(f"\nsampling {args.sample_prompts} prompts x {args.sample_n} samples x <= {args.sample_tokens} tokens, all "
          f"submitted at once (generated tokens/s): in process (one batch) {rate['in_process']:,.0f}; service, calls "
          f"batched {rate['service_batched']:,.0f}; service, one call at a time (--max-batch-samples 1) "
          f"{rate['service_one_call_at_a_time']:,.0f}; batched / one at a time "
          f"{report['sampling_batched_over_one_at_a_time']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
