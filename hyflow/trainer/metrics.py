"""Per-step metrics with verl's names, computed on the driver from the step's Batch (and the process's memory)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hyflow.algos import masked_mean
from hyflow.batch import Batch


@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the block's wall time to `timing[name]` (seconds). Under torch.profiler the block shows as the range
    `hyflow/<name>` (`benchmarks/bench_grpo.py --profile`)."""
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(f"hyflow/{name}"):
            yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def compute_data_metrics(batch: Batch, *, max_response_length: int, max_prompt_length: int) -> dict[str, float]:
    """critic/score, critic/rewards, critic/advantages, critic/returns, critic/values, response_length and
    prompt_length statistics (verl's `compute_data_metrics`)."""
    mask = batch["response_mask"].bool()
    valid = mask.any(-1)
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    for key, name in (("advantages", "advantages"), ("returns", "returns"), ("values", "values")):
        if key in batch:
            metrics.update(_stats(f"critic/{name}", batch[key][mask]))
    if "values" in batch:
        returns, values = batch["returns"][mask], batch["values"][mask]
        metrics["critic/vf_explained_var"] = float(1 - (returns - values).var() / (returns.var() + 1e-5))
    response_length = mask.sum(-1).float()
    prompt_length = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float()
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = float((response_length >= max_response_length).float().mean())
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = float((prompt_length >= max_prompt_length).float().mean())
    metrics["response/aborted_ratio"] = float((~valid).float().mean())
    if "entropys" in batch:
        metrics["actor/entropy"] = float(masked_mean(batch["entropys"], batch["response_mask"]))
    return metrics


def compute_throughput_metrics(batch: Batch, step_seconds: float, n_devices: int) -> dict[str, float]:
    """perf/total_num_tokens, perf/time_per_step, perf/throughput (tokens per second per device)."""
    tokens = int(batch["attention_mask"].sum())
    return {"perf/total_num_tokens": float(tokens), "perf/time_per_step": step_seconds,
            "perf/throughput": tokens / max(step_seconds, 1e-9) / max(n_devices, 1)}


def memory_metrics() -> dict[str, float]:
    """verl's memory metrics (verl/workers/engine_workers.py, after each actor update), in GiB:

    - `perf/max_memory_allocated_gb`, `perf/max_memory_reserved_gb`: torch's peak CUDA memory of this process
      (`torch.cuda.max_memory_allocated()` / `max_memory_reserved()` / 2**30), only when this process has
      initialised CUDA: the local executor on a GPU. With `trainer.executor=ray` the models live in the worker
      processes and the driver reports no GPU memory rather than its own zero.
    - `perf/cpu_memory_used_gb`: as verl, the machine's used memory, `psutil.virtual_memory().used` (= total -
      available), not this process's RSS; without psutil the same from /proc/meminfo (MemTotal - MemAvailable);
      absent where neither exists.
    Cheap: no device synchronisation (the CUDA caching allocator's counters are host-side)."""
    metrics: dict[str, float] = {}
    if torch.cuda.is_initialized():
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    used = _cpu_memory_used_bytes()
    if used is not None:
        metrics["perf/cpu_memory_used_gb"] = used / 2**30
    return metrics


def _cpu_memory_used_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().used)
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) * 1024  # kB
    except (OSError, KeyError, ValueError):
        return None
