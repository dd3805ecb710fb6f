"""What a benchmark records about the machine it ran on (shared by the scripts in this folder)."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path


def run_command(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    for line in run_command(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def ram_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def load_average() -> list[float] | None:
    with contextlib.suppress(OSError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def machine_info() -> dict:
    import torch
    import transformers

    root = Path(__file__).resolve().parents[1]
    info = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "ram_gib": ram_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "hyflow_commit": run_command(["git", "-C", str(root), "rev-parse", "--short", "HEAD"]) or None,
        "hyflow_tree_dirty": bool(run_command(["git", "-C", str(root), "status", "--porcelain"])),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_provenance(load_before: list[float] | None) -> dict:
    """What a demo's summary records beside its figures (tools/gen_figures.py quotes it): the command, when, the
    load average before and after the run, and the machine (`machine_info`)."""
    import sys
    import time

    return {"command": " ".join(["python", *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_before": load_before, "load_average_after": load_average(), "machine": machine_info()}
