"""Shared fixtures: a tiny random model with a locally trained tokenizer, built once per session (no downloads)."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import re
import signal
import sys
import threading

import pytest

# A suite started as a background job of a non-interactive shell (`cmd &`, nohup, some CI runners) inherits SIGINT
# ignored (POSIX), and so would every process it starts: the Ctrl-C tests (tests/test_cli_interrupt.py,
# tests/rewards/test_reward_failures.py) would then test nothing but the launch. Give this process Python's own
# handler, so the processes it starts see SIGINT at its default, as under a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_enable_metrics_collection", "0")  # as hyflow's loopback clusters (controller.resources)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads that wait for work sleep instead of spinning (read once, when torch loads its OpenMP runtime: before
# any test imports torch). The suite runs Ray workers, spawned ranks and subprocesses beside the driver on 2 cores,
# where spinning threads take the core a peer needs: a frozen-policy learning run took 349 s with the default and
# 41 s with PASSIVE on a loaded machine. Results do not change (the policy decides how threads wait, not what they
# compute); inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A directory holding a random-weight tiny Qwen2 model and its byte-level BPE tokenizer."""
    from hyflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def moe_model_dirs(tmp_path_factory):
    """{preset: directory} of the tiny mixture-of-experts models (`hyflow.models.tiny.MOE_PRESETS`: Qwen3-MoE,
    Mixtral, DeepSeek-V3), each with the tiny byte-level BPE tokenizer."""
    from hyflow.models.tiny import MOE_PRESETS, make_tiny_model

    root = tmp_path_factory.mktemp("moe_models")
    return {preset: make_tiny_model(root / preset, preset=preset, seed=0) for preset in MOE_PRESETS}


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` need the real engine: skipped where vLLM is not installed (the main venv), an error
    where it must be (HYFLOW_REQUIRE_VLLM=1, as `make test` runs them in .venv-vllm) so they never pass by skipping."""
    if importlib.util.find_spec("vllm") is not None:
        return
    marked = [item for item in items if item.get_closest_marker("vllm")]
    if marked and os.environ.get("HYFLOW_REQUIRE_VLLM"):
        raise pytest.UsageError(f"HYFLOW_REQUIRE_VLLM is set but vllm is not importable in {os.sys.executable}; "
                                "run `make venv-vllm` and use .venv-vllm/bin/python")
    skip = pytest.mark.skip(reason="vLLM is not installed here; `make test` runs these in .venv-vllm")
    for item in marked:
        item.add_marker(skip)


# ------------------------------------------------------------------------------------ hangs and skips in CI

HARD_TIMEOUT_GRACE_S = 60


def _hard_timeout(item, nodeid: str, seconds: float) -> None:
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # the test's output is being captured into a file that os._exit would lose
        capture.suspend_global_capture(in_=True)
    sys.stderr.write(f"\n+++ {nodeid} still runs {seconds:.0f} s after it started: stuck where pytest-timeout's "
                     "signal cannot reach it (in C code); stacks of every thread, then the run ends +++\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest-timeout (pyproject: `timeout`, method signal) fails a test that hangs in Python with its name and the
    run goes on; a hang inside C code (a gloo rendezvous waiting for a peer) never lets its signal through. This
    backstop names the test, dumps every thread's stack and ends the run HARD_TIMEOUT_GRACE_S after the limit."""
    marker = item.get_closest_marker("timeout")
    try:  # the first of the marker, --timeout, the ini's timeout that is set; 0 turns the limit off (pytest-timeout's rule)
        given = [marker.args[0] if marker and marker.args else None, item.config.getoption("timeout", None),
                 item.config.getini("timeout")]
        limit = float(next((value for value in given if value not in (None, "")), 0))
    except ValueError:  # pytest-timeout is not installed
        limit = 0.0
    timer = None
    if limit > 0:
        timer = threading.Timer(limit + HARD_TIMEOUT_GRACE_S, _hard_timeout,
                                args=(item, item.nodeid, limit + HARD_TIMEOUT_GRACE_S))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


# ------------------------------------------------------------------------ one local Ray cluster, kept between tests

# A local Ray start costs ~10 CPU-s (its GCS, raylet, dashboard, agents and monitors; measured on the 2-core Xeon)
# and ~5-10 s: the main suite started ~50 of them in its own processes. A test that uses the `shared_ray` fixture
# (a module: `pytestmark = pytest.mark.usefixtures("shared_ray")`) finds one started for it, with SHARED_RAY_CPUS
# logical CPUs; hyflow's trainers attach to a Ray this process already runs and leave it running
# (hyflow.controller.resources.ensure_ray). It stays up while the next test on this worker uses it too, and is
# stopped before any other test (those start their own or none) and after a test that left an actor alive or a
# placement group in place (the next test must not wait on what a failed one held).
SHARED_RAY_CPUS = 4
_SHARED_RAY: dict = {}


def _uses_shared_ray(item) -> bool:
    """HYFLOW_TEST_SHARED_RAY=0: every test starts its own, as a user's run would."""
    return item is not None and "shared_ray" in getattr(item, "fixturenames", ()) and \
        item.get_closest_marker("own_ray_cluster") is None and os.environ.get("HYFLOW_TEST_SHARED_RAY", "1") != "0"


def _ray_leftovers() -> list[str]:
    import ray
    from ray._private.state import actors
    from ray.util import placement_group_table

    if not ray.is_initialized():  # a test ended it
        return []
    held = [f"placement group {info.get('name') or pg_id}" for pg_id, info in placement_group_table().items()
            if info.get("state") != "REMOVED"]
    return held + [f"actor {info.get('ActorClassName')} ({info.get('State')})" for info in actors().values()
                   if info.get("State") != "DEAD"]


def _stop_shared_ray() -> None:
    if _SHARED_RAY.pop("started", False):
        from hyflow.controller.resources import shutdown_ray

        shutdown_ray()


@pytest.fixture
def shared_ray(request):
    import ray

    if not _uses_shared_ray(request.node):  # marked own_ray_cluster: a Ray of its own (or none), as without it
        _stop_shared_ray()
        yield
        return
    if not ray.is_initialized():
        from hyflow.controller.resources import ensure_ray

        ensure_ray(num_cpus=SHARED_RAY_CPUS)
        _SHARED_RAY["started"] = True
    yield
    if _SHARED_RAY and _ray_leftovers():
        _stop_shared_ray()


@pytest.hookimpl(trylast=True)  # after the fixtures' own teardown
def pytest_runtest_teardown(item, nextitem):
    if _SHARED_RAY and not _uses_shared_ray(nextitem):
        _stop_shared_ray()


_PREBUILD: dict = {}


def pytest_sessionstart(session):
    """`HYFLOW_TEST_PREBUILD="warm tool_warm ..."` (make test sets it) with a run cache (`HYFLOW_TEST_CACHE`): build
    those warm starts beside the suite, in one background process at niceness `HYFLOW_TEST_PREBUILD_NICE` (make test:
    its PREBUILD_NICE, 0; unset: +10, taking the CPU one pytest process leaves idle; tests/warm_starts.py); its
    output goes to prebuild.log in the cache, printed at the end if it failed."""
    import subprocess

    names, root = os.environ.get("HYFLOW_TEST_PREBUILD", "").split(), os.environ.get("HYFLOW_TEST_CACHE")
    if not names or not root or os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist: the controller's one build
        return
    os.makedirs(root, exist_ok=True)
    log_path = os.path.join(root, "prebuild.log")
    with open(log_path, "ab") as log:
        _PREBUILD["process"] = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "warm_starts.py"), "--root", root,
             "--nice", os.environ.get("HYFLOW_TEST_PREBUILD_NICE", "10"), *names],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _PREBUILD["log"] = log_path


def _end_prebuild(session) -> None:
    """Kill the background build if it still runs (the suite no longer needs it); name a failed one."""
    process = _PREBUILD.pop("process", None)
    if process is None:
        return
    if process.poll() is None:  # its session: the build and whatever it started (a reward pool, a validation run)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    elif process.returncode != 0:
        with open(_PREBUILD["log"], "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        message = (f"hyflow tests: the background warm-start build (tests/warm_starts.py) failed with exit code "
                   f"{process.returncode}; the fixtures built what they needed themselves. Its log ends:\n{tail}")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(message)
        else:
            sys.stderr.write(message + "\n")


def pytest_sessionfinish(session, exitstatus):
    """A child process a test left running (a rank of a spawned gloo group failed by pytest-timeout) is
    non-daemonic: Python would join it at exit, and pytest would print its summary and never end. Name and kill
    every such child of this process first (and the background warm-start build, if any)."""
    import multiprocessing

    _end_prebuild(session)
    _stop_shared_ray()

    leftover = multiprocessing.active_children()
    for child in leftover:
        sys.stderr.write(f"\nhyflow tests: killing {child.name} (pid {child.pid}), a child process a test left "
                         "running\n")
        child.kill()
    for child in leftover:
        child.join(10)


# In CI (CI=true, as .ci/run has it) or with HYFLOW_CI_STRICT_SKIPS=1 a skip is a failure unless its reason is a
# missing CUDA device / GPU: every other test must run there. `-ra` prints each skip's reason.
CUDA_REASON = re.compile(r"\bCUDA\b|\bGPUs?\b", re.IGNORECASE)
# Skips CI still allows that are not about CUDA, each with why and what would make it run (keep this empty).
ALLOWED_SKIPS = {
    "tests/test_cli.py::test_read_only_run_directory":
        "CI runs as root, which writes into read-only directories (to make it real: a non-root subprocess)",
}


def strict_skips() -> bool:
    return os.environ.get("HYFLOW_CI_STRICT_SKIPS", "") not in ("", "0") or os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not strict_skips():
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if CUDA_REASON.search(reason) or item.nodeid in ALLOWED_SKIPS:
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI ({reason}); CI skips only tests that need CUDA: install what the test needs "
                       "(Makefile, pyproject extras, the lock) or make it run here (HYFLOW_CI_STRICT_SKIPS / CI=true)")
