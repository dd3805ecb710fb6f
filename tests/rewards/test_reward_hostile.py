"""Rewards that cannot hurt the run (issue 37): scores from agent loops that are NaN, inf or no number fail their
sample, never the run, and no non-finite score reaches training; a judge output that is no finite score in range
fails one sample; the rate limiter refuses limits that cannot work and its wait counts toward the sample's timeout;
the http client survives servers written to defeat it (a 2 GiB answer, one that drips a byte a second, one that
never answers, one that closes mid-body) with its memory bounded by max_response_bytes and its time by its
deadlines. Servers are raw sockets on 127.0.0.1; timing assertions are generous bounds only."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch
from test_judge import ScriptedJudge, rollout_batch
from test_reward_managers_more import FakeClock, make_batch

from hyflow.rewards.judge import GenerativeJudge, JudgeRewardManager
from hyflow.rewards.managers import (
    ERROR_COLUMN,
    NonFiniteScoreError,
    RewardFunctionError,
    RewardResult,
    agent_score,
    make_reward_manager,
    require_finite_scores,
    score_with_agent_rewards,
)
from hyflow.rewards.remote import DEFAULT_MAX_RESPONSE_BYTES, RemoteRewardClient


def first_char(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5


# ------------------------------------------------------------------ agent-provided scores
def test_non_finite_agent_scores_fail_their_sample_by_name_and_the_rest_scores(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["a", "b", "c", "d", "e"],
                       agent_reward=[float("nan"), 0.75, None, float("-inf"), 1.0])
    manager = make_reward_manager("naive", tiny_tokenizer, compute_score=first_char, num_workers=0,
                                  max_error_fraction=0.5)
    result = score_with_agent_rewards(manager, batch)
    assert result.scores == [0.0, 0.75, 0.5, 0.0, 1.0]
    assert bool(torch.isfinite(result.token_level_scores).all())
    assert result.token_level_scores.sum(-1).tolist() == [0.0, 0.75, 0.5, 0.0, 1.0]
    assert result.metrics["reward/errors"] == 2
    errors = result.extra[ERROR_COLUMN]
    assert "reward_score nan is not a finite number" in errors[0]
    assert "reward_score -inf is not a finite number" in errors[3]
    assert errors[1] == errors[2] == errors[4] == ""


def test_too_many_bad_agent_scores_stop_the_run_naming_the_agent_loop(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["a", "b", "c", "d"], agent_reward=[1.0, float("inf"), float("nan"), 2.0])
    manager = make_reward_manager("naive", tiny_tokenizer, compute_score=first_char, num_workers=0,
                                  max_error_fraction=0.25)
    with pytest.raises(RewardFunctionError, match=r"2 of 4 samples .*2 of them scored by their agent loop.*"
                                                  r"max_error_fraction=0\.25.*sample 1: the agent loop's reward_score "
                                                  r"inf"):
        score_with_agent_rewards(manager, batch)


@pytest.mark.parametrize("value, words", [
    ("1.0", "is a str, not a number"),
    ({"score": 1.0}, "is a dict, not a number"),
    (np.float32("nan"), "not a finite number"),
    (torch.tensor(float("inf")), "not a finite number"),
    (10**400, "not a finite number"),
    ("x" * 10_000, "is a str"),
])
def test_agent_score_refuses_what_is_not_a_finite_number(value, words):
    with pytest.raises(ValueError, match=words) as info:
        agent_score(value)
    assert len(str(info.value)) < 400  # the value is quoted, cut short
    assert agent_score(np.float64(2.5)) == 2.5 and agent_score(torch.tensor(1.5)) == 1.5 and agent_score(3) == 3.0


def test_a_manager_that_returns_nan_scores_stops_the_run_naming_column_rows_and_source(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["a", "b", "c"])

    def leaky_manager(rows_batch):  # a registered manager of the user's that forgot a check
        scores = torch.zeros(rows_batch["responses"].shape)
        scores[0, 1] = float("inf")
        scores[-1, 0] = float("nan")
        return RewardResult(scores, [0.0] * len(rows_batch))

    with pytest.raises(NonFiniteScoreError, match=r"token_level_scores holds non-finite values in 2 of 3 rows "
                                                  r"\(row 0: inf; row 2: nan\), from the reward manager "
                                                  r"\S*leaky_manager"):
        score_with_agent_rewards(leaky_manager, batch)
    batch["agent_reward"] = [1.0, None, None]  # the mixed path checks too, naming the rows of the whole batch
    with pytest.raises(NonFiniteScoreError, match=r"in 2 of 3 rows \(row 1: inf; row 2: nan\), from the agent "
                                                  r"loops' reward_score"):
        score_with_agent_rewards(leaky_manager, batch)


def test_require_finite_scores_passes_finite_and_names_the_source():
    require_finite_scores(torch.zeros(3, 4), source="x")
    scores = torch.zeros(20, 4)
    scores[5:15, 2] = float("nan")
    with pytest.raises(NonFiniteScoreError, match=r"rm_scores holds non-finite values in 10 of 20 rows \(row 5: "
                                                  r"nan;.* and 2 more\), from the reward model"):
        require_finite_scores(scores, source="the reward model", column="rm_scores")


def test_every_manager_result_carries_the_error_column(tiny_tokenizer):
    def fails_on_b(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "b":
            raise KeyError("no answer")
        return 1.0

    manager = make_reward_manager("naive", tiny_tokenizer, compute_score=fails_on_b, num_workers=0)
    result = manager(make_batch(tiny_tokenizer, ["a", "b", "c"]))
    assert result.scores == [1.0, 0.0, 1.0]
    assert result.extra[ERROR_COLUMN] == ["", "KeyError: 'no answer'", ""]
    assert not any(key.startswith(f"reward/{ERROR_COLUMN}") for key in result.metrics)  # text: no metric


# ------------------------------------------------------------------ the judge
@pytest.mark.parametrize("output, pattern, words", [
    ("Fine.\n\n" + "9" * 400, None, "too large for a float"),
    ("abc", None, "'abc' is not an integer"),
    ("1e999", None, "'1e999' is not an integer"),
    ("", None, "'' is not an integer"),
    ("Score: 1e999", r"Score: (\S+)", "not finite"),
    ("Score: " + "9" * 400, r"Score: (\S+)", "not finite"),
    ("Score: abc", r"Score: (\S+)", "matched 'abc', not a number"),
    ("Score: 11", r"Score: (\S+)", "outside score_range"),
])
def test_a_judge_output_that_is_no_finite_score_in_range_fails_its_sample_only(tiny_tokenizer, output, pattern,
                                                                                words):
    good = "\n\n7" if pattern is None else "Score: 7"
    fake = ScriptedJudge(tiny_tokenizer, [good, output, good])
    judge = GenerativeJudge(tiny_tokenizer, fake, score_pattern=pattern, score_range=(0, 10),
                            use_chat_template=False)
    sample = {"data_source": "src", "solution_str": "4", "ground_truth": "4", "prompt_str": "2+2?", "extra_info": {}}
    before, bad, after = judge.score([sample] * 3)
    assert before.value["score"] == after.value["score"] == 7.0
    assert not bad.ok and words in bad.error
    assert len(bad.error) < 1000  # the output is quoted, cut short


def test_undecodable_ids_or_a_custom_parse_that_raises_fail_their_sample_only(tiny_tokenizer):
    class IntJudge(GenerativeJudge):  # a user's own parse, without the care verl's rule now takes
        def parse(self, output: str) -> float:
            return float(int(output))

    def generate(prompts, sampling):  # sample 1: an id no tokenizer has; sample 2: a 400-digit integer
        return [tiny_tokenizer("7")["input_ids"], [-1], tiny_tokenizer("9" * 400)["input_ids"]]

    sample = {"data_source": "src", "solution_str": "4", "ground_truth": "4", "prompt_str": "2+2?", "extra_info": {}}
    ok, undecodable, overflow = IntJudge(tiny_tokenizer, generate, use_chat_template=False).score([sample] * 3)
    assert ok.value["score"] == 7.0
    assert not undecodable.ok and "the judge's output cannot be decoded: OverflowError" in undecodable.error
    assert not overflow.ok and "no score (OverflowError: int too large to convert to float)" in overflow.error
    assert len(overflow.error) < 1000


def test_one_overflowing_judge_output_costs_one_sample_of_the_batch(tiny_tokenizer):
    batch = rollout_batch(tiny_tokenizer, ["a", "b", "c", "d"], ["4", "4", "4", "4"])
    fake = ScriptedJudge(tiny_tokenizer, ["\n\n3", "\n\n" + "9" * 400, "\n\n5", "\n\n9"])
    judge = GenerativeJudge(tiny_tokenizer, fake, use_chat_template=False)
    result = JudgeRewardManager(tiny_tokenizer, judge=judge, max_error_fraction=0.5)(batch)
    assert result.scores == [3.0, 0.0, 5.0, 9.0] and result.metrics["reward/errors"] == 1
    assert "too large for a float" in result.extra[ERROR_COLUMN][1]


# ------------------------------------------------------------------ rate limits
@pytest.mark.parametrize("key, value, words", [
    ("max_rpm", -5, "max_rpm must be a number > 0, got -5"),
    ("max_rpm", 0, "max_rpm must be a number > 0, got 0"),
    ("max_rpm", "60", "max_rpm must be a number > 0, got '60'"),
    ("max_rpm", float("nan"), "max_rpm must be a number > 0"),
    ("max_rpm", True, "max_rpm must be a number > 0"),
    ("max_tpm", -1000, "max_tpm must be a number > 0"),
    ("max_tpm", float("inf"), "max_tpm must be a number > 0"),
    ("max_concurrent", 0, "max_concurrent must be a whole number >= 1"),
    ("max_concurrent", 1.5, "max_concurrent must be a whole number >= 1"),
    ("estimated_tokens_per_request", -3, "estimated_tokens_per_request must be a number > 0"),
    ("estimated_tokens_per_request", "many", "estimated_tokens_per_request must be a number > 0"),
])
def test_rate_limits_that_cannot_work_are_errors_naming_the_key(tiny_tokenizer, key, value, words):
    with pytest.raises(ValueError, match=rf"reward_model\.reward_kwargs\.{words}") as info:
        make_reward_manager("rate_limited", tiny_tokenizer, compute_score=first_char, reward_kwargs={key: value})
    assert "leave it unset" in str(info.value)


def test_a_request_larger_than_a_minutes_tokens_is_an_error_naming_both_numbers(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"estimated_tokens_per_request=2000 is more than max_tpm=100 tokens a "
                                         r"minute: every request would wait 1200 s.*Raise max_tpm.*or lower "
                                         r"estimated_tokens_per_request"):
        make_reward_manager("rate_limited", tiny_tokenizer, compute_score=first_char, reward_kwargs={"max_tpm": 100})
    make_reward_manager("rate_limited", tiny_tokenizer, compute_score=first_char,
                        reward_kwargs={"max_tpm": 2000})  # a request that fits a minute is accepted


def test_a_sample_that_cannot_get_its_tokens_before_its_deadline_times_out_alone(tiny_tokenizer):
    clock = FakeClock()  # 120 requests a minute: a burst of 2, then one every 0.5 s, longer than timeout_s
    manager = make_reward_manager("rate_limited", tiny_tokenizer, compute_score=first_char, timeout_s=0.3,
                                  max_error_fraction=1.0, reward_kwargs={"max_rpm": 120}, clock=clock,
                                  sleep=clock.sleep)
    result = manager(make_batch(tiny_tokenizer, ["a", "b", "c", "d"]))
    assert result.scores == [0.5, 0.5, 0.0, 0.0]
    assert result.metrics["reward/timeouts"] == 2 and result.metrics["reward/errors"] == 2
    assert "timed out waiting for the rate limiter (max_rpm=120.0)" in result.extra[ERROR_COLUMN][2]
    assert clock() < 0.3  # nobody slept out a wait that could not end in time
    strict = make_reward_manager("rate_limited", tiny_tokenizer, compute_score=first_char, timeout_s=0.3,
                                 max_error_fraction=0.25, reward_kwargs={"max_tpm": 6000,
                                                                         "estimated_tokens_per_request": 100},
                                 clock=clock, sleep=clock.sleep)
    with pytest.raises(RewardFunctionError, match=r"failed on 3 of 4 .*timed out waiting for the rate limiter "
                                                  r"\(max_tpm=6000.0 at estimated_tokens_per_request=100\)"):
        strict(make_batch(tiny_tokenizer, ["a", "b", "c", "d"]))


def test_the_rate_limiter_wait_counts_toward_the_samples_timeout(tiny_tokenizer):
    def slow(data_source, solution_str, ground_truth, extra_info=None):
        threading.Event().wait(0.6)
        return 1.0

    # 60 requests a minute: the second sample waits ~1 s for its token, then its 0.6 s call would end at ~1.6 s,
    # past timeout_s=1.5; the first sample's call alone fits
    manager = make_reward_manager("rate_limited", tiny_tokenizer, compute_score=slow, timeout_s=1.5,
                                  max_error_fraction=1.0, reward_kwargs={"max_rpm": 60, "max_concurrent": 2})
    result = manager(make_batch(tiny_tokenizer, ["a", "b"]))
    assert result.scores == [1.0, 0.0] and result.metrics["reward/timeouts"] == 1


# ------------------------------------------------------------------ the http client against hostile servers
class RawServer:
    """A TCP server on 127.0.0.1 whose every connection runs `behave(conn)` on a thread; counts connections and
    the bytes it sent."""

    def __init__(self, behave) -> None:
        self.behave, self.connections, self.sent = behave, 0, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        with conn, contextlib.suppress(OSError):
            self.behave(self, conn)

    def send(self, conn, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/score"

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def read_request(conn) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += conn.recv(65536)


def two_gib_of_zeros(announce: bool):
    def behave(server, conn) -> None:
        read_request(conn)
        length = f"Content-Length: {2 * 2**30}\r\n" if announce else "Connection: close\r\n"
        server.send(conn, f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n".encode())
        zeros = bytes(2**16)
        for _ in range(2 * 2**30 // len(zeros)):  # until the client hangs up
            server.send(conn, zeros)
    return behave


@pytest.fixture
def serve():
    servers = []

    def start(behave) -> RawServer:
        servers.append(RawServer(behave))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def sample():
    return {"data_source": "src", "solution_str": "4", "ground_truth": "4", "extra_info": {}}


@pytest.mark.parametrize("announce", [True, False], ids=["content-length", "until-close"])
def test_a_2gib_answer_costs_no_more_memory_than_max_response_bytes(serve, announce):
    server = serve(two_gib_of_zeros(announce))
    cap = 2**20
    client = RemoteRewardClient(server.url, timeout_s=60, max_retries=2, max_response_bytes=cap)
    tracemalloc.start()
    try:
        (outcome,) = client.score([sample()])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not outcome.ok and "larger than max_response_bytes=1048576" in outcome.error
    assert "not retried" in outcome.error and server.connections == 1  # the same answer would come again
    assert peak < 4 * cap  # the answer was read in pieces up to the limit, not whole
    time.sleep(0.2)
    assert server.sent < 64 * 2**20  # the client hung up; the server got nowhere near 2 GiB out
    assert RemoteRewardClient(server.url).max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES == 4 * 2**20


def drip(where: str):
    def behave(server, conn) -> None:
        read_request(conn)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        if where == "body":
            server.send(conn, head)
        for byte in (b" " * 100 if where == "body" else head):
            server.send(conn, bytes([byte]))
            time.sleep(1.0)
    return behave


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_server_that_drips_one_byte_a_second_cannot_stretch_an_attempt(serve, where):
    server = serve(drip(where))
    client = RemoteRewardClient(server.url, timeout_s=1.5, max_retries=1, backoff_s=0.01)
    start = time.monotonic()
    (outcome,) = client.score([sample()])
    elapsed = time.monotonic() - start
    assert not outcome.ok and "timed out after 1.5 s (timeout_s)" in outcome.error
    assert "2 attempt(s)" in outcome.error and server.connections == 2
    assert elapsed < 2 * 1.5 + 2.0  # two attempts of 1.5 s; the server would take 100 s each


def never_answer(server, conn) -> None:
    read_request(conn)
    server.stop.wait(60)


def test_a_server_that_never_answers_times_out_and_the_total_deadline_covers_retries(serve):
    server = serve(never_answer)
    client = RemoteRewardClient(server.url, timeout_s=0.5, max_retries=1, backoff_s=0.01)
    (outcome,) = client.score([sample()])
    assert not outcome.ok and "timed out after 0.5 s (timeout_s)" in outcome.error and server.connections == 2
    client = RemoteRewardClient(server.url, timeout_s=0.5, max_retries=100, backoff_s=0.01, max_backoff_s=0.01,
                                total_timeout_s=1.2)
    start = time.monotonic()
    (outcome,) = client.score([sample()])
    elapsed = time.monotonic() - start
    assert not outcome.ok and "within total_timeout_s=1.2 s" in outcome.error
    assert "timed out at the end of total_timeout_s=1.2 s" in outcome.error  # the last attempt was cut to fit
    assert elapsed < 1.2 + 2.0  # not 101 attempts of 0.5 s
    with pytest.raises(ValueError, match="total_timeout_s must be a finite number"):
        RemoteRewardClient(server.url, total_timeout_s=-1)
    with pytest.raises(ValueError, match="max_response_bytes must be >= 1"):
        RemoteRewardClient(server.url, max_response_bytes=0)


def test_a_server_that_closes_mid_body_is_retried_then_named(serve):
    def behave(server, conn) -> None:
        read_request(conn)
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                          b'{"score": 1')

    server = serve(behave)
    client = RemoteRewardClient(server.url, timeout_s=5, max_retries=2, backoff_s=0.01)
    (outcome,) = client.score([sample()])
    assert not outcome.ok and "the connection closed after 11 of the answer's 100 bytes" in outcome.error
    assert "3 attempt(s)" in outcome.error and server.connections == 3


def test_the_http_manager_takes_the_new_limits_from_reward_kwargs(serve, tiny_tokenizer):
    server = serve(two_gib_of_zeros(announce=True))
    manager = make_reward_manager("http", tiny_tokenizer, timeout_s=5, max_error_fraction=1.0,
                                  reward_kwargs={"url": server.url, "max_response_bytes": 1000,
                                                 "total_timeout_s": 30})
    assert manager.client.max_response_bytes == 1000 and manager.client.total_timeout_s == 30
    result = manager(rollout_batch(tiny_tokenizer, ["2+2="], ["4"]))
    assert result.scores == [0.0] and "larger than max_response_bytes=1000" in result.extra[ERROR_COLUMN][0]
    assert math.isfinite(result.token_level_scores.sum())
