"""The remote reward endpoint (hyflow.rewards.remote) against a real HTTP server on 127.0.0.1: scores, retries on
5xx only, a total deadline per attempt that a slow or trickling server cannot stretch, connection refused, the
concurrency bound measured in the server, batched requests, and the `http` reward manager."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_judge import rollout_batch

from hyflow.rewards.custom import combine_reward_functions
from hyflow.rewards.managers import RewardFunctionError, make_reward_manager
from hyflow.rewards.remote import RemoteRewardClient, RemoteRewardError, RemoteRewardManager


class Endpoint:
    """A threaded HTTP server whose paths behave as the tests need; it records what it was sent."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, object]] = []
        self.hits: Counter = Counter()
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def reply(self, status, body):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    endpoint.requests.append((self.path, payload))
                    endpoint.hits[self.path] += 1
                    hits = endpoint.hits[self.path]
                with contextlib.suppress(OSError):  # the client hung up (its deadline)
                    endpoint.serve(self, self.path, payload, hits)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    @staticmethod
    def exact(sample: dict) -> dict:
        right = sample["solution_str"].strip() == sample["ground_truth"]
        return {"score": float(right), "acc": right}

    def serve(self, handler, path: str, payload, hits: int) -> None:
        if path == "/score":
            handler.reply(200, self.exact(payload))
        elif path == "/batch":
            handler.reply(200, [self.exact(s) for s in payload])
        elif path == "/flaky":  # the first request fails with a 500, the next one succeeds
            handler.reply(500, {"error": "warming up"}) if hits == 1 else handler.reply(200, 0.75)
        elif path == "/down":
            handler.reply(503, {"error": "overloaded"})
        elif path == "/bad":
            handler.reply(400, {"error": "missing field"})
        elif path == "/text":
            handler.reply(200, b"all good")
        elif path == "/not-a-score":
            handler.reply(200, {"verdict": "high"})
        elif path == "/wrong-length":
            handler.reply(200, [1.0])
        elif path == "/sleep":  # blocks in the handler, far past the client's timeout
            time.sleep(5)
            handler.reply(200, 1.0)
        elif path == "/trickle":  # a byte every 50 ms: each read finishes well inside any socket timeout
            handler.send_response(200)
            handler.send_header("Content-Length", "100")
            handler.end_headers()
            for _ in range(100):
                handler.wfile.write(b" ")
                handler.wfile.flush()
                time.sleep(0.05)
        elif path == "/hold":  # counts requests in flight at once
            with self.lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            time.sleep(0.15)
            with self.lock:
                self.in_flight -= 1
            handler.reply(200, 1.0)
        else:
            handler.reply(404, {"error": path})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    server = Endpoint()
    yield server
    server.close()


def sample(solution="4", truth="4", **extra):
    return {"data_source": "src", "solution_str": solution, "ground_truth": truth, "extra_info": extra}


def test_scores_come_back_in_order_with_verls_call_as_json(endpoint):
    import numpy as np

    client = RemoteRewardClient(endpoint.url("/score"), timeout_s=5)
    outcomes = client.score([sample("4"), sample("5"), sample(" 4 ", index=np.int64(3))])
    assert [o.value for o in outcomes] == [{"score": 1.0, "acc": True}, {"score": 0.0, "acc": False},
                                           {"score": 1.0, "acc": True}]
    sent = sorted((p for _, p in endpoint.requests), key=lambda p: p["solution_str"])
    assert sent[0] == {"data_source": "src", "solution_str": " 4 ", "ground_truth": "4", "extra_info": {"index": 3}}


def test_5xx_is_retried_and_then_succeeds(endpoint):
    client = RemoteRewardClient(endpoint.url("/flaky"), timeout_s=5, max_retries=2, backoff_s=0.01)
    (outcome,) = client.score([sample()])
    assert outcome.ok and outcome.value == 0.75 and endpoint.hits["/flaky"] == 2


def test_persistent_5xx_fails_naming_url_status_and_attempts(endpoint):
    client = RemoteRewardClient(endpoint.url("/down"), timeout_s=5, max_retries=2, backoff_s=0.01)
    (outcome,) = client.score([sample()])
    assert not outcome.ok and endpoint.hits["/down"] == 3
    assert endpoint.url("/down") in outcome.error and "HTTP 503" in outcome.error and "3 attempt(s)" in outcome.error


@pytest.mark.parametrize(("path", "words"), [("/bad", "HTTP 400"), ("/text", "not JSON"),
                                             ("/not-a-score", "not a score")])
def test_client_errors_and_bad_answers_are_not_retried(endpoint, path, words):
    client = RemoteRewardClient(endpoint.url(path), timeout_s=5, max_retries=3, backoff_s=0.01)
    (outcome,) = client.score([sample()])
    assert not outcome.ok and words in outcome.error and endpoint.url(path) in outcome.error
    assert endpoint.hits[path] == 1


@pytest.mark.parametrize("path", ["/sleep", "/trickle"])
def test_timeout_bounds_each_attempt_even_against_a_trickling_server(endpoint, path):
    client = RemoteRewardClient(endpoint.url(path), timeout_s=0.3, max_retries=1, backoff_s=0.01)
    start = time.monotonic()
    (outcome,) = client.score([sample()])
    elapsed = time.monotonic() - start
    assert not outcome.ok and "timed out after 0.3 s" in outcome.error and "2 attempt(s)" in outcome.error
    assert endpoint.url(path) in outcome.error and endpoint.hits[path] == 2
    assert 0.6 <= elapsed < 3.0  # two attempts of 0.3 s; the server would take 5 s each


def test_connection_refused_is_retried_with_backoff_then_fails():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    client = RemoteRewardClient(url, timeout_s=2, max_retries=2, backoff_s=0.1)
    start = time.monotonic()
    (outcome,) = client.score([sample()])
    assert time.monotonic() - start >= 0.1 + 0.2  # backoff 0.1 s, then 0.2 s
    assert not outcome.ok and url in outcome.error and "ConnectionRefusedError" in outcome.error
    assert "3 attempt(s)" in outcome.error


def test_max_concurrency_bounds_requests_in_flight_across_calls(endpoint):
    client = RemoteRewardClient(endpoint.url("/hold"), timeout_s=5, max_concurrency=3)
    results = []
    callers = [threading.Thread(target=lambda: results.extend(client.score([sample()] * 8))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(results) == 16 and all(o.ok for o in results)
    assert endpoint.max_in_flight == 3  # never more, and the bound is reached (requests do overlap)


def test_batched_requests_send_arrays_and_check_the_answer_length(endpoint):
    client = RemoteRewardClient(endpoint.url("/batch"), timeout_s=5, batch_size=2)
    outcomes = client.score([sample("4"), sample("x"), sample("4")])
    assert [o.value["score"] for o in outcomes] == [1.0, 0.0, 1.0]
    assert sorted(len(p) for _, p in endpoint.requests) == [1, 2]
    client = RemoteRewardClient(endpoint.url("/wrong-length"), timeout_s=5, batch_size=2)
    assert all("JSON array of 2 scores, got a list of 1" in o.error for o in client.score([sample(), sample()]))


def test_client_as_a_reward_function_mixes_with_rule_scorers(endpoint):
    client = RemoteRewardClient(endpoint.url("/score"), timeout_s=5)

    def length_penalty(data_source, solution_str, ground_truth, extra_info=None):
        return -0.1 * len(solution_str)

    mixed = combine_reward_functions([client, length_penalty], [2.0, 1.0])
    result = mixed("src", "4", "4", {})
    assert result["score"] == pytest.approx(2.0 - 0.1)
    with pytest.raises(RemoteRewardError, match="HTTP 400"):
        RemoteRewardClient(endpoint.url("/bad"), timeout_s=5)("src", "4", "4")


def test_http_reward_manager_scores_a_batch_and_stops_on_too_many_failures(endpoint, tiny_tokenizer):
    batch = rollout_batch(tiny_tokenizer, ["2+2=", "1+3="], ["4", "5"])
    manager = make_reward_manager("http", tiny_tokenizer, timeout_s=5,
                                  reward_kwargs={"url": endpoint.url("/score"), "max_retries": 0, "tag": "run1"})
    assert isinstance(manager, RemoteRewardManager) and manager.client.max_retries == 0
    result = manager(batch)
    assert result.scores == [1.0, 0.0] and result.extra["acc"] == [True, False]
    assert result.metrics["reward/acc/mean"] == 0.5
    sent = sorted((p for _, p in endpoint.requests), key=lambda p: p["solution_str"])
    assert [p["prompt_str"] for p in sent] == ["2+2=", "1+3="] and all(p["tag"] == "run1" for p in sent)
    failing = make_reward_manager("http", tiny_tokenizer, timeout_s=5, max_error_fraction=0.5,
                                  reward_kwargs={"url": endpoint.url("/bad")})
    with pytest.raises(RewardFunctionError, match=r"RemoteRewardClient\(url='http://127\.0\.0\.1:\d+/bad'\) failed "
                                                  r"on 2 of 2 samples.*HTTP 400"):
        failing(batch)
    with pytest.raises(ValueError, match=r"reward_kwargs\.url"):
        make_reward_manager("http", tiny_tokenizer)
    with pytest.raises(ValueError, match="must be http"):
        RemoteRewardClient("ftp://host/x")
