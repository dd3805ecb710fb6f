"""Rewrite the figure blocks of README.md and docs/*.md from the artefacts that real runs wrote.

    make figures                           # = python tools/gen_figures.py --collect
    python tools/gen_figures.py --check    # the blocks say what the committed artefacts say (a test runs this)

A figure block is the text between `<!-- figures:NAME -->` and `<!-- /figures -->` (on lines of their own, or
inline in a table cell). Each NAME is rendered by one function below from the artefacts it reads, JSON files
committed in `benchmarks/results/`; every one was written by a run, never typed in:

| artefact | written by |
|---|---|
| `quickstart.json` | `make demo` (`examples/quickstart/run.py`: `runs/quickstart/summary.json`) |
| `multimodal.json` | `make demo-vl` (`examples/multimodal/run.py`: `runs/multimodal/summary.json`) |
| `tools.json` | `make demo-tools` (`examples/tools/run.py`: `runs/tools/summary.json`) |
| `openai_agent.json` | `make demo-openai` (`examples/openai_agent/run.py`: `runs/openai_agent/summary.json`) |
| `packing_wide.json` | `benchmarks/bench_train.py --warmup 2 --json runs/bench/packing_wide.json` |
| `packing_grpo.json` | `benchmarks/bench_train.py --warmup 2 --preset tiny --batch-size 64 --min-len 40 --max-len 88 --prompt-max 24 --json runs/bench/packing_grpo.json` |
| `async_seed<N>.json` | `benchmarks/bench_async.py --seed N --json runs/bench/async_seed<N>.json` (one file per seed) |
| `distillation.json` | `examples/on_policy_distillation_trainer/compare.py` (`runs/distillation/summary.json`; its figure: `--figure docs/figures/distillation_vs_grpo.png`) |

`--collect` first copies the newest of these from `runs/` (the paths above) into `benchmarks/results/`; then
every block whose artefacts exist is rewritten. A block whose artefact is missing is never written: the script
names the command that makes it and leaves the block's text as it is (its figures then come from BENCHMARKS.md,
which records command and machine for each). `--check` rewrites nothing and exits 1 when a block differs from
what its artefacts render.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks/results")
DOCS = ("README.md", "docs/quickstart.md", "docs/multi-turn.md", "docs/async.md", "docs/multimodal.md",
        "docs/distillation.md")
WIDTH = 115  # the docs' line width
BLOCK = re.compile(r"(<!-- figures:(?P<name>[a-z0-9_-]+) -->)(?P<body>.*?)(<!-- /figures -->)", re.S)

# artefact -> (where a run leaves it under the repository, the command that makes it)
SOURCES = {
    "quickstart.json": ("runs/quickstart/summary.json", "make demo"),
    "multimodal.json": ("runs/multimodal/summary.json", "make demo-vl"),
    "tools.json": ("runs/tools/summary.json", "make demo-tools"),
    "openai_agent.json": ("runs/openai_agent/summary.json", "make demo-openai"),
    "packing_wide.json": ("runs/bench/packing_wide.json",
                          "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_train.py --warmup 2 "
                          "--json runs/bench/packing_wide.json"),
    "packing_grpo.json": ("runs/bench/packing_grpo.json",
                          "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_train.py --warmup 2 --preset tiny "
                          "--batch-size 64 --min-len 40 --max-len 88 --prompt-max 24 "
                          "--json runs/bench/packing_grpo.json"),
    "async_seed*.json": ("runs/bench/async_seed*.json",
                         "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async.py --seed N "
                         "--json runs/bench/async_seedN.json"),
    "distillation.json": ("runs/distillation/summary.json",
                          "OMP_NUM_THREADS=1 .venv/bin/python examples/on_policy_distillation_trainer/compare.py "
                          "--figure docs/figures/distillation_vs_grpo.png"),
}


class MissingArtefact(Exception):
    """A block's artefact is not in the results folder: the block is not written."""


# ------------------------------------------------------------------------------------------------ reading


def load(results: Path, name: str) -> dict:
    path = results / name
    if not path.exists():
        raise MissingArtefact(f"{path} (made by: {SOURCES[name][1]})")
    return json.loads(path.read_text())


def load_all(results: Path, pattern: str) -> list[tuple[str, dict]]:
    paths = sorted(results.glob(pattern))
    if not paths:
        raise MissingArtefact(f"{results / pattern} (made by: {SOURCES[pattern][1]})")
    return [(p.name, json.loads(p.read_text())) for p in paths]


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def machine_words(machine: dict) -> str:
    """'a 2-core "AMD EPYC" CPU machine, 1 torch thread' from benchmarks/machine.py's record."""
    if not machine:
        return "an unrecorded machine"
    threads = machine.get("torch_threads")
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ", no GPU"
    return (f"a {machine.get('cores')}-core \"{machine.get('cpu')}\" machine{gpu} "
            f"({threads} torch thread{'s' if threads != 1 else ''}, torch {machine.get('torch')})")


def commit_words(machine: dict) -> str:
    commit = machine.get("hyflow_commit")
    if not commit:
        return "an unrecorded commit"
    return f"commit {commit}" + (" plus uncommitted work in the tree" if machine.get("hyflow_tree_dirty") else "")


def load_words(before, after) -> str:
    if not before:
        return "load not recorded"
    return f"1-min load average {before[0]:g} before, {after[0]:g} after" if after else f"load {before[0]:g}"


# ------------------------------------------------------------------------------------------------ blocks


def quickstart(results: Path) -> str:
    s = load(results, "quickstart.json")
    m = s.get("machine", {})
    sft = f"{s['sft_steps']} steps"
    return (
        f"Measured by `{s.get('command', 'make demo')}` on {s.get('date', 'an unrecorded date')}, on "
        f"{machine_words(m)} at {commit_words(m)}, {load_words(s.get('load_average_before'), s.get('load_average_after'))} "
        f"(artefact: `benchmarks/results/quickstart.json`): greedy accuracy on the 200 held-out prompts "
        f"**{pct(s['accuracy_after_sft'])} after SFT ({sft}) -> {pct(s['accuracy_after_rl'])} after "
        f"GRPO ({s['rl_steps']} steps)**; the `#### answer` line written {pct(s['answer_line_rate_after_sft'])} -> "
        f"{pct(s['answer_line_rate_after_rl'])}; wall time {minutes(s['wall_time_s'])}. What varies by machine: the "
        "exact accuracies (the CPU's vector kernels round differently, greedy decoding turns last-bit differences "
        "into other tokens and training amplifies them; the run repeats exactly on one machine) and the wall time "
        "(the CPU, its thread count and whatever else runs on it). What holds on every machine is the shape: SFT "
        "leaves the answer line to chance, GRPO makes it nearly always written, lifting accuracy by tens of points."
    )


def multimodal(results: Path) -> str:
    s = load(results, "multimodal.json")
    m = s.get("machine", {})
    return (
        f"Measured by `{s.get('command', 'make demo-vl')}` on {s.get('date', 'an unrecorded date')}, on "
        f"{machine_words(m)} at {commit_words(m)}, {load_words(s.get('load_average_before'), s.get('load_average_after'))} "
        f"(artefact: `benchmarks/results/multimodal.json`): greedy accuracy on the 100 held-out pictures "
        f"**{pct(s['accuracy_after_sft'])} after SFT ({s['sft_steps']} steps) -> {pct(s['accuracy_after_rl'])} after "
        f"GRPO ({s['rl_steps']} steps)**; the `#### answer` line written {pct(s['answer_line_rate_after_sft'])} -> "
        f"{pct(s['answer_line_rate_after_rl'])}; wall time {minutes(s['wall_time_s'])}. What varies by machine: the "
        "exact accuracies (other vector kernels round differently and training amplifies it) and the wall time. "
        "What holds: SFT learns the colours but writes the answer line only as often as its greedy choice between "
        "the two demonstrated formats happens to fall on it (0 % here, 26 % in another run), and GRPO, rewarded by "
        "the checker alone, makes the line the answer, lifting accuracy by tens of points."
    )


def tools(results: Path) -> str:
    s = load(results, "tools.json")
    m = s.get("machine", {})
    sft = f"{s['sft_steps']} steps" if s.get("sft_steps") else f"the warm start {s.get('sft_model')}, reused"
    return (
        f"Measured by `{s.get('command', 'make demo-tools')}` on {s.get('date', 'an unrecorded date')}, on "
        f"{machine_words(m)} at {commit_words(m)}, {load_words(s.get('load_average_before'), s.get('load_average_after'))} "
        f"(artefact: `benchmarks/results/tools.json`): greedy accuracy on 200 held-out prompts "
        f"**{pct(s['accuracy_after_sft'])} after SFT ({sft}) -> {pct(s['accuracy_after_rl'])} after "
        f"GRPO ({s['rl_steps']} steps)**; answers that called the tool {pct(s['tool_use_after_sft'])} -> "
        f"{pct(s['tool_use_after_rl'])}; well-formed calls {pct(s['well_formed_calls_after_sft'])} -> "
        f"{pct(s['well_formed_calls_after_rl'])} (n/a: no call to judge); wall time {minutes(s['wall_time_s'])}. "
        "What varies by machine: the exact figures (the CPU's rounding decides greedy ties and when the SFT run "
        "learns to copy numbers; after SFT the model samples a call for about half of the prompts, while its greedy "
        "answer may go either way) and the wall time; the shape holds: SFT teaches the call format, GRPO makes the "
        "policy call the tool and copy its result."
    )


def openai_agent(results: Path) -> str:
    s = load(results, "openai_agent.json")
    m = s.get("machine", {})

    def calls(requests: float | None) -> str:  # each calculator call adds a request to the episode's first
        return "n/a" if requests is None else f"{requests - 1:.2f}"

    warm = (f"its own SFT warm start ({s['sft_steps']} steps)" if s.get("sft_steps")
            else f"the SFT warm start {s.get('sft_model')}")
    return (
        f"Measured by `{s.get('command', 'make demo-openai')}` on {s.get('date', 'an unrecorded date')}, on "
        f"{machine_words(m)} at {commit_words(m)}, {load_words(s.get('load_average_before'), s.get('load_average_after'))} "
        f"(artefact: `benchmarks/results/openai_agent.json`), from {warm}: the OpenAI-client agent's greedy accuracy "
        f"on 200 held-out questions **{pct(s['accuracy_after_sft'])} after SFT -> {pct(s['accuracy_after_rl'])} after "
        f"GRPO ({s['rl_steps']} steps)**; calculator calls per episode {calls(s['requests_per_episode_after_sft'])} "
        f"-> {calls(s['requests_per_episode_after_rl'])}; wall time {minutes(s['wall_time_s'])}. What varies by "
        "machine: the exact figures (as in the tool demo, whose SFT warm start this is) and the wall time."
    )


def _packing(r: dict) -> tuple[float, list[float], float, float, str]:
    """(packed/padded tokens/s, per-round ratios, padded fraction of the computed positions, tokens/step, words)."""
    res = r["results"]
    ratio = res["ratio_packed_over_padded"]
    padded = res["paths"]["padded"]
    waste = 1 - padded["tokens_per_step"] / padded["computed_positions_per_step"]
    a = r["args"]
    words = (f"{a['batch_size']} sequences of {a['min_len']}-{a['max_len']} tokens per micro-batch, "
             f"`{a['preset']}` model")
    return ratio, res["per_round_ratios"], waste, padded["tokens_per_step"], words


def _rounds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def packing(results: Path) -> str:
    wide, short = load(results, "packing_wide.json"), load(results, "packing_grpo.json")
    (w_ratio, w_rounds, w_waste, _, w_words), (s_ratio, s_rounds, s_waste, _, s_words) = (_packing(wide),
                                                                                        _packing(short))
    m = wide.get("machine", {})
    return (
        f"**Packing pays in proportion to the padding it removes.** Training tokens/s, packed over padded "
        f"(`benchmarks/bench_train.py`: forward + backward on the same batches, the paths alternating; "
        f"{machine_words(m)}, {commit_words(m)}, "
        f"{load_words(m.get('load_average_before'), m.get('load_average_after'))}; "
        f"artefacts `benchmarks/results/packing_*.json`): **{w_ratio:.2f}x** with {w_words} "
        f"({100 * w_waste:.0f} % of the padded batch's positions are pads; per round {_rounds(w_rounds)}) and "
        f"**{s_ratio:.2f}x** with {s_words} ({100 * s_waste:.0f} % pads; per round {_rounds(s_rounds)}). What "
        "varies by machine: the absolute tokens/s (2-3x between runs on shared CPUs) and, with more threads or on a "
        "GPU, the weight of the packed attention's per-sequence work; the ratio follows the workload's padding."
    )


def packing_status(results: Path) -> str:
    wide, short = load(results, "packing_wide.json"), load(results, "packing_grpo.json")

    def span(r: dict) -> str:
        return f"{r['args']['min_len']}-{r['args']['max_len']}"

    return (f"done on CPU (SDPA per sequence; {_packing(wide)[0]:.2f}x the padded tokens/s on sequences of "
            f"{span(wide)} tokens, {_packing(short)[0]:.2f}x on {span(short)}; level where all lengths are equal, "
            "as in the GRPO benchmark: see *LoRA and sequence packing*)")


def async_speed(results: Path) -> str:
    runs = load_all(results, "async_seed*.json")
    per_seed = []
    for name, r in runs:
        by = {s["mode"]: s for s in r["summaries"]}
        sync = by.get("sync")
        parts = []
        for mode in ("one_step_off", "fully_async"):
            if mode not in by or sync is None:
                continue
            s = by[mode]
            speed = s["samples_per_s"] / sync["samples_per_s"]
            if s["time_to_target_s"] is None or sync["time_to_target_s"] is None:
                target = "target not reached by one of them"
            else:
                change = s["time_to_target_s"] / sync["time_to_target_s"] - 1
                target = (f"target {s['time_to_target_s']:.1f} s vs {sync['time_to_target_s']:.1f} s "
                          f"({'sooner' if change < 0 else 'later'} by {abs(100 * change):.0f} %)")
            parts.append(f"{mode} {speed:.2f}x samples/s, {target}")
        per_seed.append(f"seed {r['args']['seed']} ({r['args']['rounds']} round(s), `{name}`): " + "; ".join(parts))
    m = runs[0][1].get("machine", {})
    return (
        f"`benchmarks/bench_async.py` on {machine_words(m)} ({commit_words(m)}), every seed run, against the "
        "synchronous trainer on the same two worker processes: " + " | ".join(per_seed) + ". What varies by "
        "machine: the seconds (1.6x between loaded and quiet runs here) and with them the ratios; the steps to the "
        "target vary with the samples each mode draws, so one seed says little about 'sooner'."
    )


def distillation(results: Path) -> str:
    s = load(results, "distillation.json")
    grpo, dist = s["runs"]["grpo"]["val_acc"], s["runs"]["distillation"]["val_acc"]
    best_step, best = max(dist, key=lambda point: point[1])
    return (
        f"Measured by `{s.get('command', 'compare.py')}` on {machine_words(s.get('machine', {}))} "
        f"({commit_words(s.get('machine', {}))}; seed {s['seed']}, wall time {minutes(s['wall_time_s'])}, "
        f"{load_words(s.get('load_average_before'), s.get('load_average_after'))}; artefact: "
        "`benchmarks/results/distillation.json`, figure `docs/figures/distillation_vs_grpo.png`): from a student that "
        "adds but never writes the `#### value` line (greedy accuracy on the 200 held-out prompts "
        f"{pct(grpo[0][1])}), **GRPO alone ends at {pct(grpo[-1][1])} after {grpo[-1][0]} steps, on-policy "
        f"distillation at {pct(dist[-1][1])}** (teacher: {pct(s['teacher_val_acc'])}, the SFT warm start after "
        f"{s['teacher_steps']} GRPO steps; distillation's best: {pct(best)} at step {best_step}). GRPO's groups all "
        "score 0 (no advantage to learn from); the teacher's per-token signal needs no reward."
    )


RENDERERS: dict[str, Callable[[Path], str]] = {
    "quickstart": quickstart,
    "multimodal": multimodal,
    "tools": tools,
    "openai-agent": openai_agent,
    "packing": packing,
    "packing-status": packing_status,
    "async": async_speed,
    "distillation": distillation,
}


# ------------------------------------------------------------------------------------------------ rewriting


def render_block(name: str, body: str, results: Path) -> str:
    """The block's new text: inline blocks stay inline, others get their own lines."""
    text = RENDERERS[name](results)
    if "\n" not in body:
        return text
    return "\n" + textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False) + "\n"


def rewrite(text: str, results: Path, missing: list[str], unknown: list[str]) -> str:
    def one(match: re.Match) -> str:
        name = match["name"]
        if name not in RENDERERS:
            unknown.append(name)
            return match[0]
        try:
            body = render_block(name, match["body"], results)
        except MissingArtefact as err:
            missing.append(f"{name}: {err}")
            return match[0]
        return f"{match[1]}{body}{match[4]}"

    return BLOCK.sub(one, text)


def collect(root: Path, results: Path) -> list[str]:
    """Copy what the runs left under runs/ into the results folder; returns the artefacts copied."""
    copied = []
    (root / results).mkdir(parents=True, exist_ok=True)
    for name, (source, _) in SOURCES.items():
        for path in sorted(root.glob(source)):
            target = root / results / (path.name if "*" in name else name)
            shutil.copyfile(path, target)
            copied.append(f"{path.relative_to(root)} -> {target.relative_to(root)}")
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a block is out of date")
    parser.add_argument("--collect", action="store_true", help="first copy the runs' artefacts from runs/")
    parser.add_argument("--root", default=str(ROOT), help="repository root (tests point it elsewhere)")
    parser.add_argument("--results", default=str(RESULTS), help="artefact folder, relative to the root")
    args = parser.parse_args(argv)
    root, results = Path(args.root), Path(args.results)
    if args.collect and not args.check:
        for line in collect(root, results):
            print(f"collected {line}")
    stale, missing, unknown = [], [], []
    for doc in DOCS:
        path = root / doc
        if not path.exists():
            continue
        text = path.read_text()
        new = rewrite(text, root / results, missing, unknown)
        if new != text:
            stale.append(doc)
            if not args.check:
                path.write_text(new)
    for line in dict.fromkeys(missing):  # a block in several pages: named once
        print(f"not written (artefact missing): {line}", file=sys.stderr)
    for name in unknown:
        print(f"unknown figure block {name!r}; known: {', '.join(RENDERERS)}", file=sys.stderr)
    if args.check:
        for doc in stale:
            print(f"{doc}: figure blocks out of date with {results}/ (run: make figures)", file=sys.stderr)
        return 1 if stale or unknown else 0
    for doc in stale:
        print(f"rewrote the figure blocks of {doc}")
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main())
