"""openai_agent against agents and requests written to defeat its protections (issue 37).

Each test runs one rollout of two prompts, n=2: the first prompt's two trajectories (rows 0 and 1) run a
well-behaved agent (it asks once and returns 1.0), the second prompt's two (rows 2 and 3) a hostile one. The hostile samples must fail by name (score 0,
`extra_info.agent_error`, counted in `openai/errors/mean`), the well-behaved ones must come out exactly as in a
rollout of their own, and the rollout must end within a generous bound (the agents' `timeout_s` is 4 s; what is
being defeated costs an hour or the trainer)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from test_agent_loop import (
    AGENT_LOOPS,
    ScriptedEngine,
    make_prompts,
    manager,
    params,
    rollout_config,
    segments,
)

from hyflow.rollout.agent_loop import AGENT_LOOP_KWARGS

TIMEOUT_S = 4  # the hung agents' timeout_s; the others get a minute (what they test is not the deadline)
BEHAVED_TIMEOUT_S = 120
BEHAVED = "What is 2 + 3 * 4?"
HOSTILE = r'''
import asyncio
import gc
import json
import os
import pickle
import socket
import stat
import struct
import sys
import time
import types

import httpx
import openai


async def ask(client, sample):
    await client.chat.completions.create(model="policy", messages=sample["raw_prompt"])


HTTP = httpx.Client(timeout=30)


def raw(client, path, content):
    """POST `content` (bytes) to this trajectory's `path`: (status, the error message or the body)."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {client.api_key}"}
    reply = HTTP.post(str(client.base_url).rstrip("/") + path, content=content, headers=headers)
    try:
        return reply.status_code, reply.json()["error"]["message"]
    except Exception:
        return reply.status_code, reply.text


def pipe_fd():
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISFIFO(os.fstat(int(name)).st_mode) and int(name) > 2:
                return int(name)
        except OSError:
            pass
    raise RuntimeError("no pipe")


def stall_in_a_grandchild(client, requests):
    """A process outside the agent's process group holds half-sent requests open for an hour (its pid is left in
    $HOSTILE_PIDS for the test to end it)."""
    port = client.base_url.port
    if os.fork() == 0:
        os.setsid()
        leave_pid(os.getpid())
        socks = []
        for request in requests:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(request)
            socks.append(sock)
        time.sleep(3600)
        os._exit(0)
    time.sleep(1.0)  # let the grandchild's requests reach the endpoint


def half_requests(client):
    path = client.base_url.path.rstrip("/") + "/chat/completions"
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return [(head + f"Authorization: Bearer {client.api_key}\r\nContent-Length: 1000\r\n\r\n").encode() + b'{"mess',
            (head + "Content-Length: 1000\r\n\r\n").encode() + b'{"mess',  # no key
            head.encode()]  # the headers themselves unfinished


def leave_pid(pid):
    with open(os.path.join(os.environ["HOSTILE_PIDS"], str(pid)), "w"):
        pass


def helper_process():
    """A process the agent starts (in its process group) that would outlive it by an hour."""
    if os.fork() == 0:
        leave_pid(os.getpid())
        time.sleep(3600)
        os._exit(0)
    leave_pid(os.getpid())


async def agent(client, sample):
    text = sample["raw_prompt"][-1]["content"]
    if not text.startswith("HOSTILE:"):
        await ask(client, sample)
        return {"score": 1.0, "behaved": True}
    if text.startswith("SLOW_POLICY"):  # the engine takes POLICY_DELAY_S to answer this one
        await ask(client, sample)
        return {"score": 1.0}
    mode = text.split(":", 1)[1]
    if mode == "prints":  # not hostile: print and log as agents do, wherever the trainer sent its own output
        print("agent: asking the policy", flush=True)
        print("agent: on stderr", file=sys.stderr, flush=True)
        await ask(client, sample)
        return {"score": 1.0}
    if mode == "spin":
        await ask(client, sample)
        helper_process()
        while True:
            pass
    if mode == "sleep":
        helper_process()
        time.sleep(3600)
    if mode == "never":
        helper_process()
        await asyncio.Event().wait()
    if mode == "sysexit":
        await ask(client, sample)
        raise SystemExit(3)
    if mode == "os_exit":
        await ask(client, sample)
        os._exit(5)
    if mode == "posix_exit":
        await ask(client, sample)
        import posix
        posix._exit(5)
    if mode == "kill_self":
        await ask(client, sample)
        os.kill(os.getpid(), 9)
    if mode == "nan":
        await ask(client, sample)
        return float("nan")
    if mode == "inf":
        await ask(client, sample)
        return {"score": float("inf"), "detail": "x"}
    if mode == "not_a_number":
        await ask(client, sample)
        return {"score": "high"}
    if mode == "huge_return":
        await ask(client, sample)
        return {"score": 1.0, "blob": "x" * (64 << 20)}
    if mode == "object_return":
        await ask(client, sample)
        return {"score": 1.0, "thing": object()}
    if mode == "pipe_bomb":  # claims a 2 GB answer on the pipe, then stalls
        await ask(client, sample)
        os.write(pipe_fd(), struct.pack("<Q", 2 << 30) + b"x" * 100)
        time.sleep(3600)
    if mode == "pickle_bomb":  # a pickle that would run code in the trainer
        await ask(client, sample)
        payload = pickle.dumps(("value", {"score": 1.0, "x": os.system}))
        os.write(pipe_fd(), struct.pack("<Q", len(payload)) + payload)
        os._exit(0)
    if mode == "big_body":
        start = time.monotonic()
        try:
            await client.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": "y" * (8 << 20)}])
            status = 200
        except openai.APIStatusError as err:
            status = err.status_code
        seconds = time.monotonic() - start
        await ask(client, sample)
        return {"score": 1.0, "status": status, "seconds": seconds}
    if mode == "long_prompt":
        answers = []
        for words in (100_000, 1_000):  # 500 kB (refused unread), 5 kB (tokenised: about 1,000 tokens)
            try:
                await client.chat.completions.create(model="policy", messages=[
                    {"role": "user", "content": "word " * words}])
                answers.append((200, ""))
            except openai.APIStatusError as err:
                answers.append((err.status_code, err.message))
        await ask(client, sample)
        return {"score": 1.0, "answers": answers}
    if mode == "malformed":
        answers = [raw(client, "/chat/completions", body) for body in (
            b"not json", b"\xff\xfe", b"[1, 2]", b'"text"', b'{"messages": "hi"}', b'{"messages": []}',
            b'{"messages": [1]}', b'{"messages": [{"content": "hi"}]}',
            b'{"messages": [{"role": "user", "content": 5}]}',
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            b'{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": 3}]}]}',
            b'{"messages": [{"role": "user", "content": "hi"}], "tools": "calculator"}',
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
            b'{"messages": [{"role": "user", "content": "hi"}], "n": 2.5}',
        )]
        answers.append(raw(client, "/completions", b'{"prompt": 5}'))
        answers.append(raw(client, "/completions", b'{"prompt": "x", "top_p": null, "max_tokens": true}'))
        await ask(client, sample)
        return {"score": 1.0, "answers": answers}
    if mode == "other_trajectory":
        gc.unfreeze()  # whatever the trainer's memory holds that this process inherited
        endpoints, candidates = [], {None, client.api_key}
        for o in gc.get_objects():  # the endpoint, and every string a suspended coroutine or frame holds
            if type(o).__name__ == "OpenAIEndpoint":
                endpoints.append(o)
            frame = o.cr_frame if isinstance(o, types.CoroutineType) else o if isinstance(o, types.FrameType) else None
            if frame is not None:
                candidates.update(v for v in frame.f_locals.values() if isinstance(v, str) and len(v) == 43)
        mine = str(client.base_url).split("/t/")[1].split("/")[0]
        others = [key for e in endpoints for key in e.trajectories if key != mine]
        listening = 0  # the endpoint's listening socket, inherited: accept() would take other agents' requests
        for name in os.listdir("/proc/self/fd"):
            try:
                sock = socket.socket(fileno=os.dup(int(name)))
            except OSError:
                continue
            with sock:
                try:
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        listening += sock.getsockname()[1] == client.base_url.port
                except OSError:
                    pass
        statuses = []
        body = json.dumps({"messages": [{"role": "user", "content": "steal"}]}).encode()
        for other in others:
            for key in candidates:
                headers = {"Content-Type": "application/json"}
                if key is not None:
                    headers["Authorization"] = f"Bearer {key}"
                url = str(client.base_url).replace(mine, other) + "chat/completions"
                statuses.append(HTTP.post(url, content=body, headers=headers).status_code)
        await ask(client, sample)
        return {"score": 1.0, "statuses": statuses, "candidates": len(candidates), "listening": listening}
    if mode == "half_request":
        stall_in_a_grandchild(client, half_requests(client))
        await ask(client, sample)
        return {"score": 1.0}
    raise AssertionError(mode)
'''


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    (tmp_path / "hostile_agents.py").write_text(HOSTILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("HOSTILE_PIDS", str(pids))
    import sys

    sys.modules.pop("hostile_agents", None)
    yield pids
    for entry in pids.iterdir():  # what the agents left alive (a grandchild out of their process group): end it
        if _alive(int(entry.name)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def _alive(pid: int, cmdline: bytes | None = None) -> bool:
    """Whether `pid` runs (not a zombie) and is a fork of this test process (its command line, or `cmdline`), not
    a pid reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f, open("/proc/self/cmdline", "rb") as ours:
            return state != "Z" and f.read() == (ours.read() if cmdline is None else cmdline)
    except OSError:
        return False


def run_rollout(tmp_path, tok, mode, *overrides, timeout_s=60):
    """The two-prompt rollout (rows 0, 1 well-behaved, rows 2, 3 hostile): (its Batch, its wall seconds)."""
    entry = "- name: {}\n  _target_: hyflow.rollout.openai_agent.OpenAIAgentLoop\n  run: hostile_agents.agent\n  timeout_s: {}\n"
    # the well-behaved rows have a loop entry of their own with a generous deadline: what they check is that the
    # hostile rows leave them alone, and their own start (a fork, a client) took over 4 s on a loaded CI machine
    (tmp_path / "loops.yaml").write_text(entry.format("hostile", timeout_s) + entry.format("behaved", BEHAVED_TIMEOUT_S))
    config = rollout_config(tmp_path, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/loops.yaml",
                            *overrides, tools=False)
    engine = ScriptedEngine(tok, lambda text: "#### 1")
    start = time.monotonic()
    try:
        out = manager(engine, tok, config).generate(make_prompts(tok, [BEHAVED, f"HOSTILE:{mode}"],
                                                                      agent_name=["behaved", "hostile"]),
                                                    params(n=2))
    finally:
        for name in ("hostile", "behaved"):
            AGENT_LOOPS.pop(name, None)
            AGENT_LOOP_KWARGS.pop(name, None)
    return out, time.monotonic() - start


def check_behaved_rows(tok, out):
    """The well-behaved trajectories (rows 0 and 1) came out as in a rollout of their own."""
    for row in (0, 1):
        assert segments(tok, out, row) == [(1, "#### 1<|im_end|>")]
        info = out["extra_info"][row]
        assert info["behaved"] is True and "agent_error" not in info
        prompt = tok.decode(out["prompts"][row][out["attention_mask"][row, : out["prompts"].shape[1]].bool()])
        assert prompt.endswith(f"{BEHAVED}<|im_end|>\n<|im_start|>assistant\n")
    assert list(out["agent_reward"])[:2] == [1.0, 1.0]


def hostile_errors(out) -> list[str]:
    assert list(out["agent_reward"])[2:] == [0.0, 0.0]
    assert out.meta["metrics"]["openai/errors/mean"] == 0.5
    return [out["extra_info"][row]["agent_error"] for row in (2, 3)]


@pytest.mark.parametrize(("mode", "error", "asked"), [
    ("spin", "did not return within 4 s (timeout_s", True),
    ("sleep", "did not return within 4 s (timeout_s", False),
    ("never", "did not return within 4 s (timeout_s", False),
])
def test_an_agent_that_never_returns_costs_its_sample_at_its_timeout(tmp_path, tiny_tokenizer, hostile, mode, error,
                                                                     asked):
    """`while True: pass`, `time.sleep(3600)` (which blocked the trainer's event loop when agents ran in it) and an
    await that never ends: killed at timeout_s with the process each started; the others finish. An agent killed before its first request has an
    empty response (mask 0)."""
    out, seconds = run_rollout(tmp_path, tiny_tokenizer, mode, timeout_s=TIMEOUT_S)
    assert seconds < 60, seconds
    check_behaved_rows(tiny_tokenizer, out)
    assert all(error in e for e in hostile_errors(out))
    pids = [int(entry.name) for entry in hostile.iterdir()]
    assert len(pids) == 4 and not [pid for pid in pids if _alive(pid)]  # the agents and what they started: ended
    behaved, lengths = out["response_mask"][:2].sum(-1).tolist(), out["response_mask"][2:].sum(-1).tolist()
    assert lengths == (behaved if asked else [0, 0]), lengths


@pytest.mark.parametrize(("mode", "error"), [
    ("sysexit", "SystemExit: 3 (the agent function called sys.exit(3)"),
    ("os_exit", "ended before the agent function returned (exit code 5)"),
    ("posix_exit", "ended before the agent function returned (exit code 5)"),
    ("kill_self", "ended before the agent function returned (killed by signal 9 (SIGKILL))"),
])
def test_an_agent_that_exits_costs_its_sample(tmp_path, tiny_tokenizer, hostile, mode, error):
    """SystemExit ended the trainer (rc 3) and os._exit would have: now the agent's process ends, its sample keeps
    the tokens it generated, scores 0 and names how it ended."""
    out, seconds = run_rollout(tmp_path, tiny_tokenizer, mode, timeout_s=TIMEOUT_S)
    assert seconds < 60, seconds
    check_behaved_rows(tiny_tokenizer, out)
    assert all(error in e for e in hostile_errors(out)), hostile_errors(out)
    assert out["response_mask"][2:].sum(-1).tolist() == out["response_mask"][:2].sum(-1).tolist()


@pytest.mark.parametrize(("mode", "error"), [
    ("nan", "returned the score nan: a score must be a finite number"),
    ("inf", "returned the score inf: a score must be a finite number"),
    ("not_a_number", "must return a number or a dict with 'score', got a score of type str"),
    ("huge_return", "over the limit of 16,777,216: return a score and small extras"),
    ("object_return", "the return value['thing'] is a builtins.object; an agent returns plain data"),
    ("pipe_bomb", "the agent's process sent 2,147,483,648 bytes, over the limit"),
    ("pickle_bomb", "not plain data"),
])
def test_a_bad_return_fails_its_sample_by_name(tmp_path, tiny_tokenizer, hostile, mode, error):
    """A NaN or inf score trained silently (score and loss NaN): now it is the sample's agent error, scored 0 and
    counted, never a NaN into training. A return too large or not plain data, a forged 2 GB length on the pipe and
    a pickle that would call a function in the trainer fail the same way, without the deadline (a bomb stalls)."""
    out, seconds = run_rollout(tmp_path, tiny_tokenizer, mode, timeout_s=300)
    assert seconds < 60, seconds  # not the deadline
    check_behaved_rows(tiny_tokenizer, out)
    assert all(error in e for e in hostile_errors(out)), hostile_errors(out)
    assert all(s == s for s in out["agent_reward"])  # no NaN
    assert "detail" not in out["extra_info"][2]  # a refused return brings no extras either


def test_an_agent_prints_wherever_the_trainer_sent_its_output(tmp_path, tiny_tokenizer, hostile):
    """The trainer's sys.stdout / sys.stderr may write to descriptors other than 1 and 2 (here pytest's capture;
    a log file elsewhere), which the agent's process closes with the rest it inherited: its prints still work (they
    failed with EBADF, and verifiers environments could not be built), going to the process's own 1 and 2."""
    out, _ = run_rollout(tmp_path, tiny_tokenizer, "prints", timeout_s=TIMEOUT_S)
    check_behaved_rows(tiny_tokenizer, out)
    assert [info.get("agent_error") for info in out["extra_info"][2:]] == [None, None]
    assert list(out["agent_reward"]) == [1.0] * 4


def test_request_bodies_are_bounded(tmp_path, tiny_tokenizer, hostile):
    """An 8 MB message took 85 s on the shared event loop and 4 GB: now a 413 before the body is read."""
    out, seconds = run_rollout(tmp_path, tiny_tokenizer, "big_body")
    assert seconds < 60, seconds
    check_behaved_rows_of_a_scored_agent(tiny_tokenizer, out)
    assert [out["extra_info"][row]["status"] for row in (2, 3)] == [413, 413]
    assert all(out["extra_info"][row]["seconds"] < 20 for row in (2, 3))


def test_a_prompt_over_the_prompt_length_is_refused_by_name(tmp_path, tiny_tokenizer, hostile):
    """500 kB of text fits the body limit but not data.max_prompt_length: refused unread (tokenising it took seconds
    of the shared event loop), and 1,000 tokens of it after tokenising; the engine sees neither."""
    out, seconds = run_rollout(tmp_path, tiny_tokenizer, "long_prompt", timeout_s=TIMEOUT_S)
    assert seconds < 60, seconds
    check_behaved_rows_of_a_scored_agent(tiny_tokenizer, out)
    for row in (2, 3):
        (unread, unread_why), (read, read_why) = out["extra_info"][row]["answers"]
        assert unread == read == 400
        assert "the prompt is 500,0" in unread_why and "characters, far over the rollout's limit of 512" in unread_why
        assert "tokens, over the rollout's limit of 512 (data.max_prompt_length)" in read_why


def check_behaved_rows_of_a_scored_agent(tok, out):
    """Rows 2 and 3 sent hostile requests, then asked normally and returned 1.0; rows 0 and 1 behaved."""
    check_behaved_rows(tok, out)
    assert [out["extra_info"][row].get("agent_error") for row in (2, 3)] == [None, None]
    assert list(out["agent_reward"])[2:] == [1.0, 1.0]
    assert segments(tok, out, 2) == [(1, "#### 1<|im_end|>")]


def test_malformed_requests_get_a_400_with_a_one_line_reason(tmp_path, tiny_tokenizer, hostile):
    """Malformed JSON and fields of the wrong type got 500s with tracebacks: now 400 naming the problem."""
    out, _ = run_rollout(tmp_path, tiny_tokenizer, "malformed")
    check_behaved_rows_of_a_scored_agent(tiny_tokenizer, out)
    answers = out["extra_info"][2]["answers"]
    assert len(answers) == 18
    for status, message in answers:
        assert status == 400, (status, message)
        assert message and "\n" not in message and "Traceback" not in message
    reasons = [message for _, message in answers]
    for expected in ("not JSON", "must be a JSON object, got a JSON array", "messages must be a non-empty array",
                     "messages[0] must be an object", "messages[0].role must be a string",
                     "messages[0].content must be a string", "only text parts", "tool_calls must be an array",
                     "tools must be an array", "temperature must be a finite number", "max_tokens must be an integer",
                     "max_tokens=-3", "n must be an integer", "prompt must be one string"):
        assert any(expected in reason for reason in reasons), expected
    assert out.meta["metrics"]["openai/refused/mean"] == 9.0  # 18 refusals over 2 of the 4 trajectories


def test_a_trajectory_key_binds_requests_to_their_trajectory(tmp_path, tiny_tokenizer, hostile):
    """A request to another trajectory's URL was accepted and replaced that trajectory's sample. The agent below
    finds the trajectories opened before it in the memory its process inherited (the well-behaved ones, waiting for
    their answer), and tries its own key, no key and every 43-character string a suspended coroutine or frame of
    the trainer holds: every request is refused (401) and the other samples are unchanged. Nor does its process
    hold the endpoint's listening socket (accepting on it would hand it the other agents' requests and keys)."""
    out, _ = run_rollout(tmp_path, tiny_tokenizer, "other_trajectory")
    check_behaved_rows_of_a_scored_agent(tiny_tokenizer, out)
    for row in (2, 3):
        statuses = out["extra_info"][row]["statuses"]
        assert len(statuses) >= 2 * 2, statuses  # rows 0 and 1 (at least), with its own key and none
        assert set(statuses) <= {401, 404}, statuses
        assert out["extra_info"][row]["listening"] == 0
    assert out.meta["metrics"]["openai/requests/mean"] == 1.0  # nobody's conversation gained a request


def test_half_sent_requests_do_not_delay_the_end_of_the_rollout(tmp_path, tiny_tokenizer, hostile):
    """Half-sent requests (a body cut short on the trajectory's own URL with its key, one without a key, headers
    cut short) held open by a process that left the agent's process group delayed the end of every rollout by 60 s
    (10 s without a key): the rollout now ends with its trajectories."""
    out, seconds = run_rollout(tmp_path, tiny_tokenizer, "half_request")
    check_behaved_rows_of_a_scored_agent(tiny_tokenizer, out)
    assert seconds < 30, seconds


POLICY_DELAY_S, SLOW_TIMEOUT_S = 15, 10


def test_waits_for_the_policy_do_not_count_against_the_timeout(tmp_path, tiny_tokenizer, hostile):
    """A slow engine (or a batch another trajectory holds back) is not the agent's fault: an agent whose one request
    takes 15 s to answer finishes under timeout_s=10 (with the wait counted it would be killed at 10 s)."""
    (tmp_path / "loops.yaml").write_text("- name: slow\n  _target_: hyflow.rollout.openai_agent.OpenAIAgentLoop\n"
                                         f"  run: hostile_agents.agent\n  timeout_s: {SLOW_TIMEOUT_S}\n")
    config = rollout_config(tmp_path, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/loops.yaml",
                            tools=False)

    def reply(text):
        time.sleep(POLICY_DELAY_S)
        return "#### 1"

    start = time.monotonic()
    try:
        out = manager(ScriptedEngine(tiny_tokenizer, reply), tiny_tokenizer, config).generate(
            make_prompts(tiny_tokenizer, ["SLOW_POLICY"], agent="slow"), params(n=1))
    finally:
        AGENT_LOOPS.pop("slow", None)
        AGENT_LOOP_KWARGS.pop("slow", None)
    assert time.monotonic() - start >= POLICY_DELAY_S
    assert "agent_error" not in out["extra_info"][0], out["extra_info"][0]
    assert list(out["agent_reward"]) == [1.0]
    assert segments(tiny_tokenizer, out, 0) == [(1, "#### 1<|im_end|>")]


def test_the_timeout_is_validated_by_name(tmp_path, tiny_tokenizer):
    from hyflow.rollout.openai_agent import OpenAIAgentLoop

    with pytest.raises(ValueError, match="timeout_s=-1; give the seconds one trajectory's agent may run"):
        OpenAIAgentLoop(run=lambda client, sample: 1.0, timeout_s=-1, server_manager=None, tokenizer=tiny_tokenizer,
                        rollout_config=rollout_config(tmp_path, tools=False))


TRAINER = """
import asyncio, os, signal, sys, time
from hyflow.rollout.agent_process import run_agent_process

async def agent(client, sample):
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)

async def main():
    running = asyncio.ensure_future(run_agent_process(agent, {}, base_url="http://127.0.0.1:9/v1",
                                                      make_key=lambda: "key", timeout_s=3600))
    while not (os.path.exists(sys.argv[1]) and open(sys.argv[1]).read()):
        await asyncio.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)  # the trainer ends outright: no finally, no cleanup
    await running

asyncio.run(main())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_an_agent_dies_with_a_trainer_killed_outright(tmp_path):
    """A trainer killed with SIGKILL runs no cleanup: its agents' processes (here one asleep for an hour) end
    with it instead of living on."""
    import subprocess
    import sys

    (tmp_path / "trainer.py").write_text(TRAINER)
    pid_file = tmp_path / "agent.pid"
    args = [sys.executable, str(tmp_path / "trainer.py"), str(pid_file)]
    with open(tmp_path / "stderr", "w") as stderr:  # a file, not a pipe: the agent holds it while it lives
        proc = subprocess.run(args, cwd=os.getcwd(), stdout=subprocess.DEVNULL, stderr=stderr, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    agent = int(pid_file.read_text())
    try:
        deadline = time.monotonic() + 20
        while _alive(agent, b"\0".join(a.encode() for a in args) + b"\0") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(agent, b"\0".join(a.encode() for a in args) + b"\0")
    finally:
        if _alive(agent, b"\0".join(a.encode() for a in args) + b"\0"):
            os.kill(agent, signal.SIGKILL)
