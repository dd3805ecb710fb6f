"""One command for a lent GPU (`make gpu-check`): what the device is, the CUDA tests, hyflow vs TRL's GRPO step at the
0.5B shape with a profile of one step, the rollout engine's tokens/s, and the trainer's thread choice; one JSON and
one summary, inside a time budget.

GPU time here is rare and short (a lent machine, minutes, its own torch, no package registry), so this script
installs nothing: it runs with the interpreter it is started with, finds what is importable, and says what it
skipped and why. Each part runs in a subprocess of its own with a timeout taken from what is left of `--budget-s`;
a part that does not fit is skipped (said so), a part that fails or runs out of time is recorded with its output's
tail, and the JSON is rewritten after every part, so a run cut short still leaves what it measured.

    python benchmarks/gpu_check.py --out gpu-check-out           # on a CUDA machine: every part
    python benchmarks/gpu_check.py --device cpu --smoke --out d  # the same parts, tiny sizes, on CPU (its test)

Parts (`--parts`, in this order):
    device   torch / CUDA / driver / devices / versions of the libraries it uses, the CPU and its cores
    tests    the CUDA tests (and those of hyflow's CLI, whose console script gets a launcher on PATH when the
             source tree is not installed); with two devices or more also the 2-rank FSDP2 tests
    grpo     benchmarks/bench_grpo.py at the 0.5B shape, hyflow vs TRL, `--grpo-rounds` x `--grpo-steps` (+1 warm-up
             step per run), 4 torch threads, one more step per library under torch.profiler in the last round
             (tables beside the JSON); hyflow alone when TRL is not importable. On one H200 3 rounds x 5 steps did
             not finish in 470 s (2026-12-04), hence 2 x 4 by default
    rollout  benchmarks/bench_rollout.py: the hf engine vs transformers' generate, 64 prompts x 8 samples x 128 tokens
    threads  the GRPO step of hyflow alone with the trainer's own thread rule (`--threads auto`) beside the grpo
             part's 4 threads: the rollout's and the update's seconds of each
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also when loaded by path
from machine import cpu_model, load_average, run_command

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("device", "tests", "grpo", "rollout", "threads")
LIBRARIES = ("torch", "transformers", "trl", "datasets", "accelerate", "peft", "tensordict", "omegaconf", "hydra-core",
             "safetensors", "tokenizers", "numpy", "pyarrow", "ray", "vllm", "pytest", "pytest-xdist")
# tests that need CUDA, or failed on the first lent GPU, or start hyflow's console script
CUDA_TESTS = (
    "tests/test_batch.py::test_cuda_round_trip_and_indexing",
    "tests/rollout/test_hf_engine.py::test_sleep_frees_the_device_and_an_update_while_asleep_lands_on_the_device",
    "tests/trainer/test_checkpoint.py::test_cuda_rng_and_map_location",
    "tests/models/test_packing.py::test_cuda_varlen_kernel_adds_no_error_beyond_bf16_itself",
    "tests/models/test_compile.py",
    "tests/trainer/test_rl_trainer_e2e.py::test_verl_style_command_line",
    "tests/trainer/test_rl_trainer_e2e.py::test_export_loads_with_transformers",
    "tests/trainer/test_rl_trainer_e2e.py::test_sharded_checkpoint_exports_the_weights_a_resume_loads",
)
TWO_DEVICE_TESTS = ("tests/workers/test_fsdp_workers.py", "tests/models/test_forward.py")
SMOKE_TESTS = ("tests/test_batch.py::test_cuda_round_trip_and_indexing", "tests/test_batch.py::test_construct_and_basic_accessors")
TAIL = 4000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-check-out", help="folder of gpu_check.json, gpu_check.txt and the profiles")
    p.add_argument("--budget-s", type=float, default=560.0,
                   help="seconds for all parts together; a part that no longer fits is skipped")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (default): refuse to run without a CUDA device; cpu: the --smoke check of the script")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes everywhere (tiny model, 1 step, 1 round): checks the script, measures nothing")
    p.add_argument("--grpo-rounds", type=int, default=2, help="rounds of the grpo part (each: hyflow and TRL)")
    p.add_argument("--grpo-steps", type=int, default=4, help="measured steps per run of the grpo part")
    p.add_argument("--commit", default=os.environ.get("HYFLOW_COMMIT"),
                   help="hyflow's commit, for the record (default: $HYFLOW_COMMIT, else git's HEAD where .git exists)")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if args.grpo_rounds < 1 or args.grpo_steps < 1:
        p.error("--grpo-rounds and --grpo-steps must be >= 1")
    return args


# ------------------------------------------------------------------------------------------------- plan
class Plan:
    """The time budget: each part's expected seconds (measured on an H200) decide whether it still fits; its
    timeout is what is left less the expected seconds of the parts after it (a part that overruns cannot eat
    their time), and never under its own expected seconds times 1.2."""

    RESERVE_S = 5.0

    def __init__(self, budget_s: float, expected: dict[str, float], order: list[str]) -> None:
        self.budget_s, self.start = budget_s, time.monotonic()
        self.expected, self.order = expected, order
        self.current: str | None = None

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def fits(self, name: str) -> bool:
        return self.left() - self.RESERVE_S >= self.expected[name]

    def timeout(self) -> float:
        after = self.order[self.order.index(self.current) + 1:] if self.current in self.order else []
        keep = sum(self.expected[n] for n in after)
        own = self.expected.get(self.current, 0.0) * 1.2
        return max(1.0, min(self.left() - self.RESERVE_S, max(own, self.left() - self.RESERVE_S - keep)))


def run_part(cmd: list[str], timeout_s: float, env: dict | None = None, cwd: Path = ROOT) -> dict:
    """Run one part's command; its outcome (ok / failed rc / timed out), seconds and the tails of its output."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the part's own process group: its children (TRL, test workers) too
        out, err = proc.communicate()
        status = f"timed out after {timeout_s:.0f} s"
    return {"status": status, "seconds": round(time.monotonic() - start, 1), "command": cmd,
            "stdout_tail": (out or "")[-TAIL:], "stderr_tail": (err or "")[-TAIL:]}


def child_env(extra_path: Path | None = None) -> dict:
    """The environment of every part: hyflow importable from this tree, offline, unbuffered output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    if extra_path is not None:
        env["PATH"] = os.pathsep.join((str(extra_path), env.get("PATH", "")))
    return env


# ------------------------------------------------------------------------------------------------- parts
def device_part(args: argparse.Namespace) -> dict:
    import torch

    info = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
            "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "cpu": cpu_model(), "cores": os.cpu_count(), "load_avg": load_average(),
            "commit": args.commit or git_commit(), "versions": {}}
    for name in LIBRARIES:
        try:
            info["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info["versions"][name] = None
    if info["cuda_available"]:
        info["devices"] = []
        for i in range(info["device_count"]):
            props = torch.cuda.get_device_properties(i)
            info["devices"].append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                                    "multiprocessors": props.multi_processor_count,
                                    "capability": f"{props.major}.{props.minor}"})
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    smi = shutil.which("nvidia-smi")
    if smi:
        proc = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = proc.stdout.strip() or proc.stderr.strip()
    return {"status": "ok", **info}


def grpo_cmd(args: argparse.Namespace, out: Path, *, threads: str, skip_trl: bool, profile: bool,
             rounds: int, steps: int, json_name: str = "bench_grpo.json") -> list[str]:
    if args.smoke:
        size = ["--preset", "tiny", "--prompts", "2", "--group", "2", "--max-new-tokens", "4", "--steps", "1",
                "--warmup", "1", "--rounds", "1"]
    else:
        size = ["--preset", "qwen2.5-0.5b-shape", "--prompts", "8", "--group", "8", "--max-new-tokens", "128",
                "--steps", str(steps), "--warmup", "1", "--rounds", str(rounds)]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_grpo.py"), *size, "--device", args.device,
           "--threads", threads, "--json", str(out / json_name)]
    if skip_trl:
        cmd.append("--skip-trl")
    if profile:
        cmd += ["--profile", str(out / "profile")]
    return cmd


def importable(module: str) -> str | None:
    """None when `module` imports in a fresh interpreter of this machine, else the error's last line."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120,
                          env=child_env())
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["(no message)"])[-1]


def grpo_part(args: argparse.Namespace, out: Path, plan: Plan) -> dict:
    trl_error = importable("trl")
    result = run_part(grpo_cmd(args, out, threads="4", skip_trl=trl_error is not None, profile=True,
                               rounds=args.grpo_rounds, steps=args.grpo_steps), plan.timeout(), env=child_env())
    if trl_error is not None:
        result["skipped"] = f"TRL not importable here ({trl_error}): hyflow alone, no ratio"
    report = read_json(out / "bench_grpo.json")
    if report is not None:  # complete, or what the runs that finished measured ("partial")
        result["partial"] = report.get("partial", False)
        result["run_wall_s"] = {lib: [round(r["fit_wall_s"], 1) for r in runs] for lib, runs in report["raw"].items()}
        result["summaries"] = report["summaries"]
        result["ratio_steps_per_s"] = report.get("ratio_steps_per_s")
        result["per_round_ratio"] = report.get("per_round_ratio")
        result["machine"] = report.get("machine")
        result["profile"] = report.get("profile")
    return result


def launcher_dir(tmp: Path) -> Path | None:
    """A folder with a `hyflow` launcher for the CLI tests, where no console script is installed (a machine whose
    own Python runs this source tree on PYTHONPATH); None where one is."""
    if (Path(sys.executable).parent / "hyflow").exists() or shutil.which("hyflow"):
        return None
    launcher = tmp / "hyflow"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hyflow.cli "$@"\n')
    launcher.chmod(0o755)
    return tmp


def tests_part(args: argparse.Namespace, out: Path, plan: Plan, device_count: int, tmp: Path) -> dict:
    tests = list(SMOKE_TESTS if args.smoke else CUDA_TESTS)
    skipped = []
    if device_count >= 2:
        tests += TWO_DEVICE_TESTS
    elif not args.smoke:
        skipped.append(f"the 2-rank tests ({', '.join(TWO_DEVICE_TESTS)}): {device_count} CUDA device(s)")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--timeout", "240",
           "--junitxml", str(out / "tests.xml"), *tests]
    if importable("xdist") is None and not args.smoke:
        cmd[3:3] = ["-n", "4"]
    result = run_part(cmd, plan.timeout(), env=child_env(launcher_dir(tmp)))
    result.update(junit_summary(out / "tests.xml"))
    if skipped:
        result["skipped"] = "; ".join(skipped)
    return result


def junit_summary(path: Path) -> dict:
    """Counts and the failed tests (name, message's first lines) of a pytest junit XML file."""
    if not path.exists():
        return {"counts": None}
    root = ET.parse(path).getroot()
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                counts["failures" if kind == "failure" else kind + ("" if kind == "skipped" else "s")] += 1
                if kind != "skipped":
                    text = (node.get("message") or "") + "\n" + (node.text or "")
                    failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                                   "message": text.strip()[-1500:]})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"counts": counts, "failed": failed}


def rollout_part(args: argparse.Namespace, out: Path, plan: Plan) -> dict:
    if args.smoke:
        size = ["--presets", "tiny", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4", "--rounds", "1"]
    else:
        size = ["--presets", "qwen2.5-0.5b-shape", "--prompts", "64", "--samples", "8", "--max-new-tokens", "128",
                "--rounds", "2"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_rollout.py"), *size, "--device", args.device,
           "--json", str(out / "bench_rollout.json")]
    result = run_part(cmd, plan.timeout(), env=child_env())
    report = read_json(out / "bench_rollout.json")
    if report is not None:
        result["report"] = {k: v for k, v in report.items() if k != "raw"}
    return result


def threads_part(args: argparse.Namespace, out: Path, plan: Plan) -> dict:
    cmd = grpo_cmd(args, out, threads="auto", skip_trl=True, profile=False, rounds=1, steps=3,
                   json_name="bench_grpo_threads_auto.json")
    result = run_part(cmd, plan.timeout(), env=child_env())
    auto = read_json(out / "bench_grpo_threads_auto.json")
    four = read_json(out / "bench_grpo.json")
    if auto is not None:
        result["auto"] = {"threads_line": auto["machine"]["threads_line"], **stage_medians(auto)}
    if four is not None:
        result["four"] = {"threads_line": four["machine"]["threads_line"], **stage_medians(four)}
    return result


def stage_medians(report: dict) -> dict:
    s = report["summaries"]["hyflow"]
    return {"step_s_median": s["step_s_median"], **{k.split("/", 1)[1] + "_s": v for k, v in s.items()
                                                     if k.startswith("stage_s_median/")}}


# ------------------------------------------------------------------------------------------------- report
def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def git_commit() -> str | None:
    """HEAD's short hash (with a note when tracked files changed), or None where there is no git checkout."""
    commit = run_command(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = run_command(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return (commit + (" + uncommitted changes" if dirty else "")) if commit else None


def summary_text(report: dict) -> str:
    """The run in a screenful: what ran, what it found, what was skipped."""
    lines = [f"hyflow gpu-check ({'smoke, ' if report['smoke'] else ''}device {report['device_arg']}), "
             f"{report['finished_s']:.0f} s of a {report['budget_s']:.0f} s budget"]
    dev = report["parts"].get("device")
    if dev:
        gpus = ", ".join(f"{d['name']} {d['memory_gib']} GiB" for d in dev.get("devices", [])) or "no CUDA device"
        lines.append(f"device: {gpus}; {dev['cpu']}, {dev['cores']} cores; python {dev['python']}, torch "
                     f"{dev['torch']} (CUDA {dev['cuda_build']}); commit {dev['commit']}")
        missing = [k for k, v in dev["versions"].items() if v is None]
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in dev["versions"].items() if v)
                     + (f"; not installed: {', '.join(missing)}" if missing else ""))
        if dev.get("nvidia_smi"):
            lines.append(f"nvidia-smi: {dev['nvidia_smi']}")
    for name in PARTS[1:]:
        part = report["parts"].get(name)
        if part is None:
            continue
        lines.append(f"{name}: {part['status']}" + (f" in {part['seconds']} s" if "seconds" in part else ""))
        if part.get("skipped"):
            lines.append(f"  skipped: {part['skipped']}")
        if name == "grpo" and part.get("summaries"):
            for lib, s in part["summaries"].items():
                stages = ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in s.items()
                                   if k.startswith("stage_s_median/"))
                lines.append(f"  {lib}: median step {s['step_s_median']:.3f} s ({s['steps_per_s']:.3f} steps/s, "
                             f"{s['measured_steps']} steps), stages {stages}"
                             + (f", peak GPU {s['peak_gpu_gib']:.1f} GiB" if "peak_gpu_gib" in s else ""))
            if part.get("ratio_steps_per_s"):
                rounds = ", ".join(f"{r:.2f}x" for r in part.get("per_round_ratio") or [])
                lines.append(f"  ratio hyflow/TRL steps/s {part['ratio_steps_per_s']:.2f}x (per round {rounds})")
            for lib, prof in (part.get("profile") or {}).items():
                top = "; ".join(f"{op['name'][:40]} {op['share']:.0%}" for op in prof["top_ops"][:5])
                lines.append(f"  profile {lib} ({prof['time_kind']}, {prof['total_self_s']:.3f} s): {top}")
        if name == "tests" and part.get("counts"):
            c = part["counts"]
            lines.append(f"  {c['passed']} passed, {c['failures']} failed, {c['errors']} errors, "
                         f"{c['skipped']} skipped of {c['tests']}")
            for f in part.get("failed", []):
                lines.append(f"  FAILED {f['test']}: {f['message'].splitlines()[0][:200] if f['message'] else ''}")
        if name == "rollout" and part["status"] == "ok":  # bench_rollout's own table
            lines.extend(f"  {x}" for x in part["stdout_tail"].strip().splitlines()[-8:])
        if name == "threads" and part.get("auto"):
            lines.append(f"  auto: {part['auto']}")
            if part.get("four"):
                lines.append(f"  4 threads: {part['four']}")
        if part["status"] != "ok" and part["status"] != "skipped":
            tail = (part.get("stderr_tail") or part.get("stdout_tail") or "").strip().splitlines()[-8:]
            lines.extend(f"  | {x[:200]}" for x in tail)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # expected seconds of each part: measured on one H200 (2026-12-04: tests 115 s, rollout 62 s; grpo per library
    # run ~75 s with 6 steps, from a 3 x 5 run that did not finish in 470 s); smoke sizes on CPU
    if args.smoke:
        expected = {"tests": 30, "grpo": 30, "rollout": 20, "threads": 20}
    else:
        expected = {"tests": 120, "grpo": 2 * args.grpo_rounds * (25 + 9 * (args.grpo_steps + 1)) + 30,
                    "rollout": 65, "threads": 25 + 9 * 4}
    plan = Plan(args.budget_s, expected, [p for p in PARTS if p in args.parts and p != "device"])
    report = {"smoke": args.smoke, "device_arg": args.device, "budget_s": args.budget_s, "parts": {},
              "finished_s": 0.0}

    def save() -> None:
        report["finished_s"] = round(time.monotonic() - plan.start, 1)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "gpu_check.txt").write_text(summary_text(report))

    device = device_part(args)
    report["parts"]["device"] = device
    if args.device == "cuda" and not device["cuda_available"]:
        save()
        print(summary_text(report), end="")
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False); nothing to check. "
              "Run `python benchmarks/gpu_check.py --device cpu --smoke` to check the script itself.", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hyflow-gpu-check-") as tmp:
        for name in plan.order:
            plan.current = name
            if not plan.fits(name):
                report["parts"][name] = {"status": "skipped",
                                         "skipped": f"{plan.left():.0f} s left of the budget, the part needs "
                                                    f"~{plan.expected[name]:.0f} s (raise --budget-s)"}
                save()
                continue
            print(f"gpu-check: {name} ({plan.left():.0f} s left) ...", file=sys.stderr, flush=True)
            if name == "grpo":
                report["parts"][name] = grpo_part(args, out, plan)
            elif name == "tests":
                report["parts"][name] = tests_part(args, out, plan, device["device_count"], Path(tmp))
            elif name == "rollout":
                report["parts"][name] = rollout_part(args, out, plan)
            else:
                report["parts"][name] = threads_part(args, out, plan)
            save()
    save()
    print(summary_text(report), end="")
    failed = [n for n, p in report["parts"].items() if p["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
