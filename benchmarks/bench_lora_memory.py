"""Peak memory of one policy-update step: LoRA vs full fine-tuning, through hyflow's TrainEngine.

Each mode runs in a fresh Python process (so one mode's allocations cannot hide the other's peak), on the
same random-weight model from `hyflow.models.tiny` (`--preset`, default small) and the same synthetic batch:
B samples of P prompt + R response tokens (random ids, every token real), GRPO-style advantages (random),
the PPO-clip token-mean loss of `hyflow.algos` (`vanilla`), one mini-batch, micro-batches of `--micro`
samples, one AdamW step (lr 1e-4) — the path `ActorRolloutRefWorker.update_actor` takes. `--steps` updates
are made and the peak is over all of them (AdamW allocates its state at the first step).

Reported per mode:
    trainable / total parameters
    parameter, gradient and optimizer-state bytes, counted from the tensors after the last step (exact)
    CPU: the peak of live CPU tensor bytes allocated during the steps (torch.profiler's memory events: the
         activations kept for backward, gradients, optimizer state; what the mode itself costs), and, for
         reference, the peak resident set size of the process (`ru_maxrss`) and its rise over the RSS right
         after the model loaded (adds allocator caching and the Python heap: noisy at this size)
    CUDA (`--device cuda`): `torch.cuda.max_memory_allocated` over the steps, and its rise over the memory
         allocated after loading
and the ratio LoRA / full of the peak rise. RSS figures depend on the allocator and the machine; the tensor
byte counts do not.

Run:  python benchmarks/bench_lora_memory.py                          (small preset, rank 8, B=16, P=32, R=128)
      python benchmarks/bench_lora_memory.py --preset tiny --batch 4 --response 16 --json out.json
      python benchmarks/bench_lora_memory.py --device cuda --preset qwen2.5-0.5b-shape --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODES = ("full", "lora")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process: load, build the engine, `args.steps` updates; the measurements as a dict."""
    import peft  # noqa: F401  (imported in both modes before the baseline RSS; the LoRA mode needs it)
    import torch

    from hyflow.algos import get_policy_loss
    from hyflow.batch import Batch
    from hyflow.models.loading import load_causal_lm
    from hyflow.models.lora import parameter_counts
    from hyflow.specs import ForwardBatches, FsdpSettings, LoraSettings, OptimizerSpec, TrainEngineSpec
    from hyflow.workers.train_engine import TrainEngine, UpdatePlan

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = load_causal_lm(args.model_dir, dtype="float32", device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    base_rss = _rss_bytes()
    # the actor's engine as the trainer builds it (TrainEngine.from_spec), AdamW at a constant lr
    lora = LoraSettings(rank=args.rank, alpha=2 * args.rank) if args.mode == "lora" else None  # all linear layers
    spec = TrainEngineSpec(name="actor", head="lm", strategy="fsdp", fsdp=FsdpSettings(dtype=args.dtype),
                           compute_dtype=args.dtype, device=args.device, grad_clip=1.0, lora=lora,
                           optim=OptimizerSpec(lr=1e-4, weight_decay=0.01, lr_warmup_steps=0))
    engine = TrainEngine.from_spec(model, spec, device=device)
    B, P, R = args.batch, args.prompt, args.response
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab - 1, (B, P + R), generator=generator)
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones(B, P + R, dtype=torch.long),
                   "position_ids": torch.arange(P + R).expand(B, -1).clone(), "responses": ids[:, P:],
                   "response_mask": torch.ones(B, R), "advantages": torch.randn(B, R, generator=generator)})
    policy_loss = get_policy_loss("vanilla")

    def loss_fn(out, cols, ctx):
        mask = cols["response_mask"].float()
        loss, _ = policy_loss(old_log_prob=out["log_probs"].detach(), log_prob=out["log_probs"],
                              advantages=cols["advantages"], response_mask=mask, loss_agg_mode="token-mean",
                              clip_ratio=0.2, **ctx.norms)
        return loss, {"loss": float(loss.detach())}

    sizes = ForwardBatches(B, False, args.micro, B // args.micro, None)
    plan = UpdatePlan(mini_batch_size=B, epochs=1, shuffle=False, seed=0, sizes=sizes,
                      loss_agg_mode="token-mean", metric_prefix="actor")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(args.steps):
            engine.update(batch, plan, loss_fn, columns=("response_mask", "advantages"))
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    # "Total Allocated" of the profiler's memory events: bytes of live CPU tensors allocated since it started
    cpu_live = [e["args"].get("Total Allocated", 0) for e in events
                if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    trainable, total = parameter_counts(engine.model)
    params = list(engine.model.parameters())
    optimizer_state = [v for state in engine.optimizer.state.values() for v in state.values()
                       if isinstance(v, torch.Tensor)]
    out = {"mode": args.mode, "trainable_params": trainable, "total_params": total,
           "param_bytes": _tensor_bytes(params),
           "grad_bytes_at_peak": _tensor_bytes([p for p in params if p.requires_grad]),
           "optimizer_state_bytes": _tensor_bytes(optimizer_state),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "rss_after_load_bytes": base_rss}
    out["peak_rss_rise_bytes"] = out["peak_rss_bytes"] - base_rss
    out["peak_tensor_rise_bytes"] = max(cpu_live, default=0)
    if device.type == "cuda":
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        out["cuda_peak_rise_bytes"] = out["cuda_peak_bytes"] - base
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", help="autocast dtype on CUDA (bf16, fp32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)  # internal: one mode
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch % args.micro:
        parser.error(f"--batch {args.batch} must be a multiple of --micro {args.micro}")
    if args.mode is not None:  # a child: measure one mode, print one JSON line
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return {}

    from hyflow.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / args.preset, args.preset)
        results = {}
        for mode in MODES:
            cmd = [sys.executable, __file__, "--mode", mode, "--model-dir", str(model_dir)]
            for key in ("preset", "rank", "batch", "prompt", "response", "micro", "steps", "device", "dtype",
                        "threads"):
                cmd += [f"--{key}", str(getattr(args, key))]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"the {mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[mode] = json.loads(lines[-1][len("RESULT "):])
    peak_key = "cuda_peak_rise_bytes" if args.device.startswith("cuda") else "peak_tensor_rise_bytes"
    ratio = results["lora"][peak_key] / max(results["full"][peak_key], 1)
    print(f"# LoRA vs full fine-tuning: one update step, preset {args.preset}, rank {args.rank}, "
          f"{args.batch} samples x ({args.prompt} + {args.response}) tokens, micro-batch {args.micro}, "
          f"{args.steps} step(s), {args.device}, {platform.processor() or platform.machine()}")
    cuda = peak_key.startswith("cuda")
    print("| mode | trainable / total params | params MiB | grads MiB | optimizer state MiB | "
          + ("peak CUDA alloc MiB | rise over load MiB |" if cuda
             else "peak tensor MiB during the steps | peak RSS MiB | RSS rise over load MiB |"))
    print("|---|---|---|---|---|---|" + ("---|" if cuda else "---|---|"))
    for mode in MODES:
        r = results[mode]
        tail = (f"{_mib(r['cuda_peak_bytes'])} | {_mib(r[peak_key])} |" if cuda else
                f"{_mib(r[peak_key])} | {_mib(r['peak_rss_bytes'])} | {_mib(r['peak_rss_rise_bytes'])} |")
        print(f"| {mode} | {r['trainable_params']:,} / {r['total_params']:,} | {_mib(r['param_bytes'])} | "
              f"{_mib(r['grad_bytes_at_peak'])} | {_mib(r['optimizer_state_bytes'])} | {tail}")
    print(f"LoRA / full peak {'CUDA allocation' if cuda else 'tensor memory'} during the steps: {ratio:.2f}x")
    summary = {"args": {k: v for k, v in vars(args).items() if k not in ("mode", "model_dir")},
               "results": results, "lora_over_full_peak_rise": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
