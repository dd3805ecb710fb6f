"""Environments written to defeat the env_agent loop's protections: each costs its own episode (an error named in
`extra_info["env_error"]`, score 0, counted in env/errors or env/timeouts), never the rollout or the process.

One rollout runs every hostile environment beside two well-behaved episodes (module fixture), so all of them
share the rollout they try to break; each test reads its row."""

from __future__ import annotations

import asyncio
import contextlib
import os
import posix
import signal
import subprocess
import sys
import time

import pytest
from test_agent_loop import RT, ScriptedEngine, make_prompts, manager, params, rollout_config, segments
from test_env_loop import GUESS_ENV, guesser

from hyflow.rollout.env_loop import ENVS, register_env

TIMEOUT = 5  # multi_turn.tool_timeout of the rollout: the hanging environments are killed at it
OBSERVATION_CAP = 120  # multi_turn.max_env_observation_length of the rollout


class Base:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def step(self, action):
        return None, 1.0, True, {}


class ExitsInStep(Base):
    def step(self, action):
        os._exit(5)


class PosixExitsInStep(Base):
    def step(self, action):
        posix._exit(7)


class KillsItself(Base):
    def step(self, action):
        os.kill(os.getpid(), signal.SIGKILL)


class AsyncExits(Base):
    async def step(self, action):
        await asyncio.sleep(0)
        os._exit(6)


class SysExits(Base):
    def step(self, action):
        sys.exit(3)


class Sleeps(Base):
    def step(self, action):
        time.sleep(600)


class SpinsIgnoringSignals(Base):
    def step(self, action):
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            pass


class SpawnsAndHangs(Base):
    """Starts a process of its own, writes its pid where the test finds it, and hangs."""

    def reset(self, sample):
        child = subprocess.Popen(["sleep", "600"])
        with open(self.kwargs["pid_file"], "w") as f:
            f.write(str(child.pid))
        time.sleep(600)


class ConstructorRaises(Base):
    def __init__(self, **kwargs):
        raise ValueError("no such maze")


class ConstructorExits(Base):
    def __init__(self, **kwargs):
        os._exit(9)


class ConstructorHangs(Base):
    def __init__(self, **kwargs):
        time.sleep(600)


class ResetHangs(Base):
    async def reset(self, sample):
        await asyncio.sleep(600)


class NanReward(Base):
    def step(self, action):
        return None, float("nan"), True, {}


class InfReward(Base):
    def step(self, action):
        return None, float("-inf"), True, {}


class TextReward(Base):
    def step(self, action):
        return None, "abc", True, {}


class ListInfo(Base):
    def step(self, action):
        return None, 1.0, True, [1, 2]


class OverflowingReturn(Base):
    def step(self, action):
        return "again", 1e308, False, {}


class DoneRaises(Base):
    class Done:
        def __bool__(self):
            raise RuntimeError("undecided")

    def step(self, action):
        return "x", 1.0, self.Done(), {}


class StrHangs(Base):
    class Observation:
        def __str__(self):
            time.sleep(600)
            return "never"

    def step(self, action):
        return self.Observation(), 1.0, False, {}


class HugeError(Base):
    def step(self, action):
        raise ValueError("x" * 20_000_000)


class HugeObservation(Base):
    """4 MB observation (the issue's probe took 53 s and 1.7 GB on it), then the episode ends with reward 1."""

    def step(self, action):
        if self.kwargs.get("done"):
            return None, 1.0, True, {}
        self.kwargs["done"] = True
        return "A" * 2_000_000 + "B" * 2_000_000, 0.0, False, {"size": 4e6}


# name -> (class, expected error prefix, counter)
HOSTILE = {
    "os_exit": (ExitsInStep, "environment step ended its process (exit code 5", "errors"),
    "posix_exit": (PosixExitsInStep, "environment step ended its process (exit code 7", "errors"),
    "sigkill_self": (KillsItself, "environment step ended its process (killed by signal SIGKILL", "errors"),
    "async_os_exit": (AsyncExits, "environment step ended its process (exit code 6", "errors"),
    "sys_exit": (SysExits, "environment step raised SystemExit: 3", "errors"),
    "sleeps": (Sleeps, f"environment step timed out after {float(TIMEOUT)} s (multi_turn.tool_timeout)", "timeouts"),
    "spins": (SpinsIgnoringSignals, "environment step timed out after", "timeouts"),
    "spawns_and_hangs": (SpawnsAndHangs, "environment reset timed out after", "timeouts"),
    "constructor_raises": (ConstructorRaises, "environment constructor raised ValueError: no such maze", "errors"),
    "constructor_exits": (ConstructorExits, "environment constructor ended its process (exit code 9", "errors"),
    "constructor_hangs": (ConstructorHangs, "environment constructor timed out after", "timeouts"),
    "reset_hangs": (ResetHangs, "environment reset timed out after", "timeouts"),
    "nan_reward": (NanReward, "environment step returned the reward nan, not a finite number", "errors"),
    "inf_reward": (InfReward, "environment step returned the reward -inf, not a finite number", "errors"),
    "text_reward": (TextReward, "environment step returned the reward 'abc' (str), not a number", "errors"),
    "list_info": (ListInfo, "environment step returned the info [1, 2] (list), not a dict", "errors"),
    "overflow": (OverflowingReturn, "environment step returned the reward 1e+308, which takes the episode's "
                                    "return 1e+308 past a float's range", "errors"),
    "done_raises": (DoneRaises, "environment step raised RuntimeError: undecided", "errors"),
    "str_hangs": (StrHangs, "environment step timed out after", "timeouts"),
    "huge_error": (HugeError, "environment step raised ValueError: xxxx", "errors"),
}


@pytest.fixture(scope="module")
def hostile_rollout(tmp_path_factory, tiny_tokenizer):
    """One rollout: the two guess episodes (targets 7 and 5), every HOSTILE environment, the huge observation."""
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "guess_env.py").write_text(GUESS_ENV)
    names = ["guess", "guess", *HOSTILE, "huge_observation"]
    classes = {name: cls for name, (cls, _, _) in HOSTILE.items()} | {"huge_observation": HugeObservation}
    for name, cls in classes.items():
        register_env(f"hostile_{name}")(cls)
    pid_file = tmp / "grandchild.pid"
    tok = tiny_tokenizer
    try:
        prompts = make_prompts(tok, ["Guess my number."] * len(names), agent="env_agent",
                               env_class=[f"{tmp}/guess_env.py:Guess" if n == "guess" else f"hostile_{n}"
                                          for n in names],
                               env_kwargs=[{"pid_file": str(pid_file)} if n == "spawns_and_hangs" else {}
                                           for n in names],
                               extra_info=[{"target": 7}, {"target": 5}] + [{}] * (len(names) - 2))
        config = rollout_config(tmp, f"{RT}.multi_turn.tool_timeout={TIMEOUT}",
                                f"{RT}.multi_turn.max_env_observation_length={OBSERVATION_CAP}", tools=False)
        import psutil

        before = {p.pid for p in psutil.Process().children(recursive=True)}  # earlier tests' (a Ray watchdog, ...)
        started = time.monotonic()
        out = manager(ScriptedEngine(tok, guesser), tok, config).generate(prompts, params())
        elapsed = time.monotonic() - started
    finally:
        for name in classes:
            ENVS._entries.pop(f"hostile_{name}", None)
    return {"out": out, "names": names, "elapsed": elapsed, "pid_file": pid_file, "tok": tok, "before": before}


def test_the_well_behaved_episodes_play_out_beside_the_hostile_ones(hostile_rollout):
    out, tok = hostile_rollout["out"], hostile_rollout["tok"]
    assert segments(tok, out, 0) == [(1, "#### 5<|im_end|>"),
                                     (0, "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"),
                                     (1, "#### 7<|im_end|>")]
    assert list(out["agent_reward"][:2]) == [pytest.approx(0.9), 1.0]
    assert all("env_error" not in info for info in out["extra_info"][:2])
    # every hanging environment was killed at its deadline, all of them at once (not one timeout after another)
    assert hostile_rollout["elapsed"] < 6 * TIMEOUT, hostile_rollout["elapsed"]


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_environment_costs_its_own_episode(name, hostile_rollout):
    out, names = hostile_rollout["out"], hostile_rollout["names"]
    row = names.index(name)
    error = out["extra_info"][row].get("env_error")
    assert error is not None and error.startswith(HOSTILE[name][1]), error
    assert len(error) < 2500  # a 20 MB exception message is cut
    assert out["agent_reward"][row] == 0.0
    assert int(out["response_mask"][row].sum()) > 0  # the row is a trajectory: the model's first turn


def test_failures_are_counted_by_kind(hostile_rollout):
    metrics, names = hostile_rollout["out"].meta["metrics"], hostile_rollout["names"]
    for counter in ("errors", "timeouts"):
        expected = sum(1 for _, _, kind in HOSTILE.values() if kind == counter)
        assert metrics[f"env/{counter}/mean"] == pytest.approx(expected / len(names)), counter


def test_a_huge_observation_is_cut_before_it_is_tokenised(hostile_rollout):
    out, names, tok = hostile_rollout["out"], hostile_rollout["names"], hostile_rollout["tok"]
    row = names.index("huge_observation")
    runs = segments(tok, out, row)
    assert [m for m, _ in runs] == [1, 0, 1], runs
    observation = runs[1][1]
    assert len(observation) < OBSERVATION_CAP + 100
    assert "A" * (OBSERVATION_CAP // 2) + "...(truncated)..." + "B" * (OBSERVATION_CAP // 2) in observation
    assert out["agent_reward"][row] == 1.0 and "env_error" not in out["extra_info"][row]
    assert out.meta["metrics"]["env/size/mean"] == 4e6


def test_no_environment_process_outlives_the_rollout(hostile_rollout):
    """Every child is killed and reaped, and what an environment started dies with its process group."""
    import psutil

    assert [p for p in psutil.Process().children(recursive=True)
            if p.pid not in hostile_rollout["before"] and p.cmdline()[:1] != ["sleep"]] == []
    grandchild = int(hostile_rollout["pid_file"].read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the environment's own process survived its episode"
        time.sleep(0.05)


def test_a_step_costs_a_pipe_round_trip(tmp_path, tiny_tokenizer):
    """The overhead of the child process, measured: an episode of many steps is not dominated by it."""
    from hyflow.rollout.env_host import EnvHost

    async def episode():
        host = await EnvHost.start(OverflowingReturn, {}, {}, timeout=30, max_observation_chars=100)
        try:
            started = time.perf_counter()
            for _ in range(200):
                assert (await host.call("step", "a", timeout=30))[0] == "again"
            return (time.perf_counter() - started) / 200
        finally:
            host.close()

    per_step = asyncio.run(episode())
    assert per_step < 0.05, per_step  # generous: about 0.1 ms on an idle machine


class HoldsTqdmLock(Base):
    """Takes tqdm's write lock (as a progress bar does while it prints) and hangs: killed while holding it."""

    def step(self, action):
        import tqdm

        tqdm.tqdm.get_lock().acquire()
        time.sleep(600)


def test_a_killed_environment_leaves_no_lock_of_the_parent_taken():
    """tqdm's lock is a semaphore that a fork shares: the child's own lock is what a killed child leaves taken, so
    the trainer's progress bars still print."""
    import tqdm

    from hyflow.rollout.env_host import EnvCallFailed, EnvHost

    tqdm.tqdm.get_lock()  # the parent's locks exist before the fork, as in a trainer with a progress bar

    async def episode():
        host = await EnvHost.start(HoldsTqdmLock, {}, {}, timeout=30, max_observation_chars=100)
        try:
            with pytest.raises(EnvCallFailed, match="timed out"):
                await host.call("step", "a", timeout=2)
        finally:
            host.close()

    asyncio.run(episode())
    shared = tqdm.std.TqdmDefaultWriteLock.mp_lock
    assert shared.acquire(timeout=10), "a killed environment left tqdm's lock taken"
    shared.release()


class ReadsItsOomScore(Base):
    def step(self, action):
        with open("/proc/self/oom_score_adj") as f:
            return f.read().strip(), 0.0, True, {}


@pytest.mark.skipif(not os.path.exists("/proc/self/oom_score_adj"), reason="Linux's /proc")
def test_out_of_memory_the_kernel_kills_the_environment_first():
    from hyflow.rollout.env_host import EnvHost

    async def episode():
        host = await EnvHost.start(ReadsItsOomScore, {}, {}, timeout=30, max_observation_chars=100)
        try:
            return (await host.call("step", "a", timeout=30))[0]
        finally:
            host.close()

    assert asyncio.run(episode()) == "1000"


class WritesIntoThePipe(Base):
    """Writes a message of its own into every socket it inherited (the pipe to the parent among them)."""

    def step(self, action):
        import socket
        import struct

        for fd in range(3, 256):
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            with contextlib.suppress(OSError):
                sock.send(struct.pack("!i", 5) + b"junk!")
            sock.detach()
        time.sleep(600)


def test_an_answer_the_environment_forged_is_an_error():
    from hyflow.rollout.env_host import EnvCallFailed, EnvHost

    async def episode():
        host = await EnvHost.start(WritesIntoThePipe, {}, {}, timeout=30, max_observation_chars=100)
        try:
            with pytest.raises(EnvCallFailed, match="sent an answer that cannot be read"):
                await host.call("step", "a", timeout=30)
        finally:
            host.close()

    asyncio.run(episode())
