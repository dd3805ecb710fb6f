"""`hyflow serve` driven by the real `tinker` SDK (0.38, the lock's pin) on loopback: every route the SDK calls for
training, sampling and checkpoints; the built-in losses against Tinker's documented formulas; learning against a
frozen (lr=0) control; two clients at once equal to each alone; one key cannot reach another's runs; malformed
and hostile requests cost the request, never the service."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")

KEY = "tml-test-key-owner-a"
OTHER_KEY = "tml-test-key-owner-b"


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    from hyflow.serve import start

    svc, url, _, stop = start(str(tiny_model_dir), name="tiny", port=0, api_keys=[KEY, OTHER_KEY],
                                 store=tmp_path_factory.mktemp("serve_store"), max_body_bytes=4 << 20,
                                 max_runs=256)  # the module makes ~55 runs; the default 64 is a per-service bound
    yield svc, url
    stop()


@pytest.fixture(scope="module")
def client(service):
    client = tinker.ServiceClient(base_url=service[1], api_key=KEY)
    yield client
    client.close("success").result(timeout=60)  # ends the session (and its heartbeats) while the service runs


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def sft_datum(tokenizer, text: str, prompt_tokens: int = 2) -> types.Datum:
    ids = tokenizer.encode(text)
    weights = [0.0] * (prompt_tokens - 1) + [1.0] * (len(ids) - prompt_tokens)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


def rl_datum(tokens: list[int], sampler_logprobs: list[float], advantages: list[float]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "logprobs": types.TensorData(data=sampler_logprobs, dtype="float32"),
                                       "advantages": types.TensorData(data=advantages, dtype="float32")})


def train(tc, data, steps: int, lr: float, loss_fn: str = "cross_entropy") -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, loss_fn)
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def forward_logprobs(tc, data) -> list[np.ndarray]:
    out = tc.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float64) for o in out.loss_fn_outputs]


# ------------------------------------------------------------------------------------------------ the routes
def test_capabilities_info_and_tokenizer(service, client, tiny_model_dir, tokenizer):
    rest = tinker.RestClient(base_url=service[1], api_key=KEY)
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny"]
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    info = tc.get_info()
    assert info.lora_rank == 4 and info.model_data.tokenizer_id == str(tiny_model_dir)
    assert tc.get_tokenizer().encode("a cat") == tokenizer.encode("a cat")
    run = rest.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id and run.lora_rank == 4 and run.base_model == "tiny"


def test_unknown_base_model_is_refused_by_name(client):
    with pytest.raises(Exception, match="is not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()


def test_sft_loss_falls_where_a_frozen_control_stays(client, tokenizer):
    """Noise: the service is deterministic on CPU (seeded adapters, no dropout): the lr=0 control's loss is the same
    number at every step (checked to 1e-6), so any fall of the trained run is learning; it falls by > 60 % in 8
    steps at lr 1e-2 (measured 64 -> ~6 on this data), so the bar of 30 % leaves room for other kernels."""
    data = [sft_datum(tokenizer, "the cat sat on the mat"), sft_datum(tokenizer, "a dog ran in the park")]
    trained = client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    frozen = client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    rise = train(trained, data, 8, 1e-2)
    control = train(frozen, data, 8, 0.0)
    assert max(control) - min(control) < 1e-6 * control[0]
    assert control[0] == pytest.approx(rise[0], rel=1e-6)  # same seed, same start
    assert rise[-1] < 0.7 * control[-1], (rise, control)


def test_forward_backward_accumulates_until_optim_step(client, tokenizer):
    """Two forward_backward calls then one optim_step = one call with both data (gradients add up)."""
    a, b = sft_datum(tokenizer, "the cat sat"), sft_datum(tokenizer, "on the warm mat")
    split = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    whole = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    split.forward_backward([a], "cross_entropy")
    split.forward_backward([b], "cross_entropy")
    split.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    whole.forward_backward([a, b], "cross_entropy")
    whole.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    for x, y in zip(forward_logprobs(split, [a, b]), forward_logprobs(whole, [a, b]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    before = forward_logprobs(client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result(), [a])[0]
    assert np.abs(forward_logprobs(whole, [a])[0] - before).max() > 1e-3  # the step moved the adapter


def test_forward_only_changes_nothing(client, tokenizer):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    data = [sft_datum(tokenizer, "the cat sat on the mat")]
    first = forward_logprobs(tc, data)[0]
    tc.forward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-1)).result()  # no gradients: nothing to apply
    np.testing.assert_array_equal(first, forward_logprobs(tc, data)[0])


@pytest.mark.parametrize("loss_fn,config", [("cross_entropy", None), ("importance_sampling", None),
                                            ("ppo", None), ("ppo", {"clip_low_threshold": 0.9,
                                                                    "clip_high_threshold": 1.05}),
                                            ("cispo", None), ("dro", {"beta": 0.05})])
def test_loss_sum_is_the_documented_formula(client, tokenizer, loss_fn, config):
    """loss:sum against Tinker's documented formula, computed here from the returned target log-probs."""
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    ids = tokenizer.encode("the cat sat on the mat and the dog ran")
    n = len(ids) - 1
    rng = np.random.default_rng(0)
    sampler = (forward_logprobs(tc, [sft_datum(tokenizer, "the cat sat on the mat and the dog ran")])[0]
               + rng.normal(0, 0.3, n)).tolist()
    advantages = rng.normal(0, 1, n).tolist()
    weights = rng.uniform(0, 1, n).tolist()
    if loss_fn == "cross_entropy":
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})
    else:
        datum = rl_datum(ids, sampler, advantages)
    out = tc.forward_backward([datum], loss_fn, loss_fn_config=config).result()
    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)
    q, adv = np.asarray(sampler), np.asarray(advantages)
    ratio = np.exp(lp - q)
    low, high = (config or {}).get("clip_low_threshold", 0.8), (config or {}).get("clip_high_threshold", 1.2)
    expected = {
        "cross_entropy": lambda: -(lp * np.asarray(weights)).sum(),
        "importance_sampling": lambda: -(ratio * adv).sum(),
        "ppo": lambda: -np.minimum(ratio * adv, np.clip(ratio, low, high) * adv).sum(),
        "cispo": lambda: -(np.clip(ratio, low, high) * lp * adv).sum(),
        "dro": lambda: -(lp * adv - 0.5 * 0.05 * (lp - q) ** 2).sum(),
    }[loss_fn]()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_custom_loss_runs_through_forward_backward_custom(client, tokenizer):
    """The SDK's client-side custom loss: a forward for the log-probs, then a linear surrogate through the
    service; a custom loss equal to cross-entropy takes the same step as the built-in one."""
    import torch

    data = [sft_datum(tokenizer, "the cat sat on the mat")]
    custom = client.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    builtin = client.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()

    def nll(batch, logprobs_list):
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum()
                   for d, lp in zip(batch, logprobs_list, strict=True))
        return loss, {"nll": float(loss)}

    custom.forward_backward_custom(data, nll).result()
    custom.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    builtin.forward_backward(data, "cross_entropy").result()
    builtin.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_allclose(forward_logprobs(custom, data)[0], forward_logprobs(builtin, data)[0], atol=1e-5)


# ------------------------------------------------------------------------------------------------ sampling
def test_sampling_is_seeded_and_its_logprobs_are_the_trainers(client, tokenizer):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    data = [sft_datum(tokenizer, "the cat sat on the mat")]
    train(tc, data, 3, 1e-2)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("the cat")
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    first = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result()
    again = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert len({tuple(s.tokens) for s in first.sequences}) > 1  # sample i is seeded seed + i
    for seq in first.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        full = prompt + list(seq.tokens)
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
        trainer = forward_logprobs(tc, [datum])[0][len(prompt) - 1:]
        np.testing.assert_allclose(np.asarray(seq.logprobs), trainer, atol=1e-4)


def test_a_sampler_checkpoint_samples_its_own_weights_not_the_runs_newer_ones(service, client, tokenizer):
    """A sampling client keeps the weights it was saved with while its run trains on, and sampling from it leaves
    the run's current weights as they were."""
    data = [sft_datum(tokenizer, "the cat sat on the mat")]
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=16).result()
    train(tc, data, 2, 1e-2)
    old_sampler = tc.save_weights_and_get_sampling_client().result()
    old_state = tc.save_state("old").result().path
    train(tc, data, 3, 5e-2)
    newest = forward_logprobs(tc, data)[0]
    prompt = tokenizer.encode("the cat")
    seq = old_sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=6, seed=2)).result().sequences[0]
    np.testing.assert_array_equal(forward_logprobs(tc, data)[0], newest)  # the run's weights are back
    full = prompt + list(seq.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
    at_save = client.create_training_client_from_state(old_state).result()
    np.testing.assert_allclose(np.asarray(seq.logprobs), forward_logprobs(at_save, [datum])[0][len(prompt) - 1:],
                               atol=1e-4)
    assert np.abs(np.asarray(seq.logprobs) - forward_logprobs(tc, [datum])[0][len(prompt) - 1:]).max() > 1e-3


def test_a_sampler_checkpoint_outlives_its_unloaded_run(service, client, tokenizer):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=18).result()
    train(tc, [sft_datum(tokenizer, "the cat sat on the mat")], 2, 5e-2)
    path = tc.save_weights_for_sampler("keep").result().path
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    params = types.SamplingParams(max_tokens=5, seed=4)
    live = client.create_sampling_client(model_path=path).result()
    before = live.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    status, body = _post(service[1], "/api/v1/unload_model", json.dumps({"model_id": tc.model_id}).encode())
    assert status == 200, body
    assert tinker.RestClient(base_url=service[1], api_key=KEY).get_weights_info_by_tinker_path(path).result()
    after = client.create_sampling_client(model_path=path).result().sample(
        prompt=prompt, num_samples=2, sampling_params=params).result()
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    np.testing.assert_allclose([s.logprobs for s in after.sequences], [s.logprobs for s in before.sequences],
                               atol=1e-5)
    with pytest.raises(Exception, match="no training run"):
        tc.forward_backward([sft_datum(tokenizer, "the cat")], "cross_entropy").result()


def test_a_run_keeps_its_newest_unnamed_snapshots_only(service, client, tokenizer, monkeypatch):
    import hyflow.serve.app as app

    monkeypatch.setattr(app, "KEEP_SNAPSHOTS", 2)
    tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=20).result()
    samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(4)]
    tc.save_weights_for_sampler("named").result()
    rest = tinker.RestClient(base_url=service[1], api_key=KEY)
    kept = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert len([k for k in kept if "ephemeral-" in k]) == 2 and "sampler_weights/named" in kept
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    params = types.SamplingParams(max_tokens=2, seed=0)
    assert samplers[-1].sample(prompt=prompt, num_samples=1, sampling_params=params).result(timeout=60).sequences
    with pytest.raises(Exception, match="no sampling session"):
        samplers[0].sample(prompt=prompt, num_samples=1, sampling_params=params).result(timeout=60)


def test_a_session_without_heartbeats_ends_and_its_runs_are_unloaded(service, tokenizer):
    svc, url = service
    own = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = own.create_lora_training_client(base_model="tiny", rank=2, seed=23).result()
    path = tc.save_state("before-expiry").result().path
    session = tc.model_id.split(":train:")[0]
    svc._seen[session] -= 10 * svc.session_ttl_s  # as if its client had gone silent
    assert session in svc.expire_sessions()  # (other silent sessions of this module may end too)
    with pytest.raises(Exception, match="no training run"):
        tc.forward_backward([sft_datum(tokenizer, "the cat")], "cross_entropy").result(timeout=60)
    status, body = _post(url, "/api/v1/session_heartbeat", json.dumps({"session_id": session}).encode())
    assert status == 410 and "ended" in body["detail"]
    deadline = time.monotonic() + 30
    while tc.model_id in svc.host.runs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tc.model_id not in svc.host.runs  # the adapter is gone; its checkpoint stays
    assert tinker.RestClient(base_url=url, api_key=KEY).get_weights_info_by_tinker_path(path).result().lora_rank == 2
    own.close("success").result(timeout=60)  # an ended session closes quietly (its heartbeat loop stops)


def test_closing_a_service_client_ends_its_session(service, tokenizer):
    svc, url = service
    own = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = own.create_lora_training_client(base_model="tiny", rank=2, seed=25).result()
    session = tc.model_id.split(":train:")[0]
    own.close("success", detail="done").result(timeout=60)
    assert session in svc._ended and session not in svc._sessions
    deadline = time.monotonic() + 30
    while tc.model_id in svc.host.runs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tc.model_id not in svc.host.runs
    status, _ = _post(url, f"/api/v1/sessions/{session}/finish", b"{}")
    assert status == 200  # closing again changes nothing
    status, _ = _post(url, f"/api/v1/sessions/{session}/finish", b"{}", key=OTHER_KEY)
    assert status == 404


def test_optim_step_clears_the_gradients(service, client, tokenizer):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=17).result()
    tc.forward_backward([sft_datum(tokenizer, "the cat sat")], "cross_entropy").result()
    run = service[0].host.runs[tc.model_id]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in run.params.values())
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert all(p.grad is None for p in run.params.values())


def test_base_model_sampling_ignores_every_adapter(service, client, tokenizer):
    base = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    params = types.SamplingParams(max_tokens=5, seed=3)
    before = base.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()
    train(tc, [sft_datum(tokenizer, "the cat sat on the mat")], 3, 5e-2)
    after = base.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    assert [s.logprobs for s in before.sequences] == [s.logprobs for s in after.sequences]


def test_sample_calls_queued_together_decode_as_one_batch_with_the_same_results(service, client, tokenizer):
    """Sample calls waiting behind one another on the same weights decode as one batch (an RL loop's prompts);
    each call gets what it gets alone: its own samples, seeds and budgets."""
    svc = service[0]
    base = client.create_sampling_client(base_model="tiny").result()
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=19).result()
    train(tc, [sft_datum(tokenizer, "the cat sat on the mat")], 2, 5e-2)
    trained = tc.save_weights_and_get_sampling_client().result()
    asks = [(tokenizer.encode(text), n, max_tokens, seed, sampler) for text, n, max_tokens, seed, sampler in
            [("the cat", 3, 6, 1, base), ("a dog ran in the park", 2, 4, 2, base), ("the cat", 3, 6, 1, trained),
             ("the", 4, 8, 3, base), ("snow is", 1, 5, 4, base)]]

    def submit(ask):
        prompt, n, max_tokens, seed, sampler = ask
        return sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=n,
                           sampling_params=types.SamplingParams(max_tokens=max_tokens, seed=seed))

    alone = [submit(ask).result() for ask in asks]
    gate = threading.Event()
    svc._submit("owner-x", "test", lambda: (gate.wait(60), ("application/json", b"{}"))[1])
    batched_before = svc.samples_batched
    futures = [submit(ask) for ask in asks]
    deadline = time.monotonic() + 60
    while len(svc._jobs) < len(asks) and time.monotonic() < deadline:
        time.sleep(0.05)
    gate.set()
    together = [f.result() for f in futures]
    assert svc.samples_batched == batched_before + 2  # base x2, then the trained snapshot alone, then base x2
    for (_, n, max_tokens, _, _), a, b in zip(asks, alone, together, strict=True):
        assert len(b.sequences) == n and all(len(s.tokens) <= max_tokens for s in b.sequences)
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)


def test_base_model_sample_calls_of_two_api_keys_decode_together(service, tokenizer):
    svc, url = service
    clients = [tinker.ServiceClient(base_url=url, api_key=key) for key in (KEY, OTHER_KEY)]
    mine, theirs = (c.create_sampling_client(base_model="tiny").result() for c in clients)
    params = types.SamplingParams(max_tokens=4, seed=9)
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    alone = mine.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    gate = threading.Event()
    svc._submit("owner-x", "test", lambda: (gate.wait(60), ("application/json", b"{}"))[1])
    batched_before = svc.samples_batched
    futures = [c.sample(prompt=prompt, num_samples=2, sampling_params=params) for c in (mine, theirs)]
    deadline = time.monotonic() + 60
    while len(svc._jobs) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    gate.set()
    results = [f.result(timeout=60) for f in futures]
    assert svc.samples_batched == batched_before + 1
    for result in results:
        assert [s.tokens for s in result.sequences] == [s.tokens for s in alone.sequences]
    for c in clients:
        c.close("success").result(timeout=60)


def test_stop_token_ends_a_sample(client, tokenizer):
    base = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    free = base.sample(prompt=prompt, num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=8, seed=5)).result().sequences[0]
    stop_at = free.tokens[2]
    cut = base.sample(prompt=prompt, num_samples=1,
                      sampling_params=types.SamplingParams(max_tokens=8, seed=5, stop=[stop_at])).result().sequences[0]
    first = free.tokens.index(stop_at)
    assert cut.tokens == free.tokens[: first + 1] and cut.stop_reason == "stop"
    assert free.stop_reason in ("length", "stop")


# ------------------------------------------------------------------------------------------------ checkpoints
def test_state_with_optimizer_resumes_exactly(service, client, tokenizer):
    data = [sft_datum(tokenizer, "the cat sat on the mat"), sft_datum(tokenizer, "a dog ran")]
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
    train(tc, data, 2, 1e-2)
    path = tc.save_state("mid").result().path
    straight = train(tc, data, 2, 1e-2)
    resumed_client = client.create_training_client_from_state_with_optimizer(path).result()
    resumed = train(resumed_client, data, 2, 1e-2)
    assert resumed == pytest.approx(straight, rel=1e-6)
    weights_only = client.create_training_client_from_state(path).result()
    fresh_moments = train(weights_only, data, 2, 1e-2)
    assert fresh_moments[0] == pytest.approx(straight[0], rel=1e-6)  # same weights
    assert fresh_moments[1] != pytest.approx(straight[1], rel=1e-4)  # but Adam's moments started again
    tc.load_state_with_optimizer(path).result()  # back into the live run
    assert train(tc, data, 2, 1e-2) == pytest.approx(straight, rel=1e-6)


def test_checkpoints_are_listed_and_deleted(service, client, tokenizer):
    rest = tinker.RestClient(base_url=service[1], api_key=KEY)
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=10).result()
    tc.save_state("one").result()
    sampler_path = tc.save_weights_for_sampler("for-sampling").result().path
    found = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert set(found) == {"weights/one", "sampler_weights/for-sampling"}
    assert found["weights/one"].checkpoint_type == "training" and found["weights/one"].size_bytes > 0
    info = rest.get_weights_info_by_tinker_path(sampler_path).result()
    assert info.lora_rank == 4 and info.base_model == "tiny"
    rest.delete_checkpoint(tc.model_id, "weights/one").result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [
        "sampler_weights/for-sampling"]


def test_checkpoint_options_are_honoured_or_refused_by_name(service, client, tokenizer):
    svc = service[0]
    rest = tinker.RestClient(base_url=service[1], api_key=KEY)
    tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=24).result()
    data = [sft_datum(tokenizer, "the cat sat")]
    tc.save_state("once", user_metadata={"step": "0"}).result()
    with pytest.raises(Exception, match="exists already"):
        tc.save_state("once").result(timeout=60)
    train(tc, data, 1, 1e-2)
    assert tc.save_state("once", overwrite=True).result().path.endswith("/weights/once")
    with pytest.raises(Exception, match="ttl_seconds"):
        tc.save_state("ttl", ttl_seconds=7200).result(timeout=60)
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed["weights/once"].user_metadata is None  # the overwrite carried none
    tc.save_state("meta", user_metadata={"note": "kept"}).result()
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed["weights/meta"].user_metadata == {"note": "kept"}
    # a load that cannot succeed changes nothing: no optimizer state in a sampler checkpoint
    sampler_path = tc.save_weights_for_sampler("no-moments").result().path
    train(tc, data, 1, 5e-2)
    before = forward_logprobs(tc, data)[0]
    with pytest.raises(Exception, match="without optimizer state"):
        tc.load_state_with_optimizer(sampler_path).result(timeout=60)
    np.testing.assert_array_equal(forward_logprobs(tc, data)[0], before)
    # a client that fails to start from a checkpoint leaves no run behind
    broken = tc.save_state("broken-start").result().path
    (svc.host.store / "runs" / tc.model_id / "weights" / "broken-start" / "adapter.safetensors").write_bytes(b"x")
    runs_before = set(svc.host.runs)
    with pytest.raises(Exception, match="corrupt"):
        client.create_training_client_from_state(broken).result(timeout=60)
    assert set(svc.host.runs) == runs_before


def test_a_corrupt_checkpoint_is_refused_by_name(service, client, tokenizer):
    svc = service[0]
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=12).result()
    path = tc.save_state("broken").result().path
    adapter = svc.host.store / "runs" / tc.model_id / "weights" / "broken" / "adapter.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    with pytest.raises(Exception, match="corrupt"):
        tc.load_state(path).result()
    data = [sft_datum(tokenizer, "the cat")]
    assert math.isfinite(train(tc, data, 1, 1e-2)[0])  # the run itself is untouched


# ------------------------------------------------------------------------------------------------ many clients
def test_two_clients_at_once_train_as_each_alone(client, tokenizer):
    data_a = [sft_datum(tokenizer, "the cat sat on the mat")]
    data_b = [sft_datum(tokenizer, "a dog ran in the park today")]
    alone_a = client.create_lora_training_client(base_model="tiny", rank=4, seed=21).result()
    alone_b = client.create_lora_training_client(base_model="tiny", rank=8, seed=22, train_mlp=False).result()
    train(alone_a, data_a, 4, 1e-2)
    train(alone_b, data_b, 4, 2e-2)
    both_a = client.create_lora_training_client(base_model="tiny", rank=4, seed=21).result()
    both_b = client.create_lora_training_client(base_model="tiny", rank=8, seed=22, train_mlp=False).result()
    threads = [threading.Thread(target=train, args=(both_a, data_a, 4, 1e-2)),
               threading.Thread(target=train, args=(both_b, data_b, 4, 2e-2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    probe = data_a + data_b
    # each client has its own adapter: the two runs (other seeds, data, shapes) answer differently
    assert np.abs(forward_logprobs(both_a, probe)[1] - forward_logprobs(both_b, probe)[1]).max() > 1e-3
    for alone, both in ((alone_a, both_a), (alone_b, both_b)):
        for x, y in zip(forward_logprobs(alone, probe), forward_logprobs(both, probe), strict=True):
            np.testing.assert_allclose(x, y, atol=1e-6)


# ------------------------------------------------------------------------------------------------ safety
def _post(url: str, path: str, body: bytes, key: str | None = KEY, content_type: str = "application/json"):
    headers = {"Content-Type": content_type}
    if key is not None:
        headers["X-API-Key"] = key
    request = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_requests_without_a_known_key_are_refused(service):
    url = service[1]
    assert _post(url, "/api/v1/create_session", b"{}", key=None)[0] == 401
    status, body = _post(url, "/api/v1/create_session", b"{}", key="tml-not-a-key-of-this-service")
    assert status == 401 and "API key" in body["detail"]
    with urllib.request.urlopen(url + "/api/v1/healthz", timeout=10) as response:  # liveness needs no key
        assert json.loads(response.read()) == {"status": "ok"}


def test_one_key_cannot_reach_another_keys_runs(service, client, tokenizer):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=13).result()
    sampler_path = tc.save_weights_for_sampler("mine").result().path
    state_path = tc.save_state("mine").result().path
    other = tinker.ServiceClient(base_url=service[1], api_key=OTHER_KEY)
    other_rest = tinker.RestClient(base_url=service[1], api_key=OTHER_KEY)
    with pytest.raises(Exception, match="404|no "):
        other_rest.list_checkpoints(tc.model_id).result()
    with pytest.raises(Exception, match="404|no "):
        other.create_sampling_client(model_path=sampler_path).result()
    with pytest.raises(Exception, match="404|no "):
        other.create_training_client_from_state(state_path).result()
    status, body = _post(service[1], "/api/v1/get_info", json.dumps({"model_id": tc.model_id}).encode(),
                         key=OTHER_KEY)
    assert status == 404 and "no training run" in body["detail"]
    other.close("success").result(timeout=60)


def test_malformed_requests_get_a_4xx_with_the_reason(service, client, tokenizer):
    url = service[1]
    status, body = _post(url, "/api/v1/asample", b"{not json")
    assert status == 400 and "not JSON" in body["detail"]
    status, body = _post(url, "/api/v1/asample", b"[1, 2]")
    assert status == 400 and "JSON object" in body["detail"]
    status, body = _post(url, "/api/v1/optim_step", json.dumps({"model_id": "x"}).encode())
    assert status == 400 and "optim_params" in body["detail"]
    status, body = _post(url, "/api/v1/forward_backward", b"\xff\x00garbage", content_type="application/x-protobuf")
    assert status == 400 and "protobuf" in body["detail"]
    status, _ = _post(url, "/api/v1/asample", b"{" + b" " * (5 << 20) + b"}")
    assert status == 413  # bounded bodies (this service: 4 MiB)
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=14).result()
    assert math.isfinite(train(tc, [sft_datum(tokenizer, "the cat")], 1, 1e-2)[0])  # still serving


@pytest.mark.parametrize("case,match", [
    ("token_out_of_vocabulary", "outside the model's vocabulary"),
    ("missing_input", "needs loss_fn_inputs"),
    ("wrong_length", "one value per input token"),
    ("unknown_loss", "unknown loss_fn"),
    ("unknown_config_key", "not read by"),
    ("dro_without_beta", "needs loss_fn_config"),
    ("nan_advantages", "not finite"),
])
def test_a_bad_call_fails_its_own_future_and_nothing_else(client, tokenizer, case, match):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=15).result()
    ids = tokenizer.encode("the cat sat")
    n = len(ids) - 1
    good = rl_datum(ids, [-1.0] * n, [1.0] * n)
    loss_fn, config, datum = "importance_sampling", None, good
    if case == "token_out_of_vocabulary":
        datum = rl_datum([*ids[:-1], 10**6], [-1.0] * n, [1.0] * n)
    elif case == "missing_input":
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:]})
    elif case == "wrong_length":
        datum = rl_datum(ids, [-1.0] * (n + 2), [1.0] * n)
    elif case == "unknown_loss":
        loss_fn = "grpo_magic"
    elif case == "unknown_config_key":
        loss_fn, config = "ppo", {"clip_eps": 0.2}
    elif case == "dro_without_beta":
        loss_fn = "dro"
    elif case == "nan_advantages":
        datum = rl_datum(ids, [-1.0] * n, [float("nan")] * n)
    with pytest.raises(Exception, match=match):
        tc.forward_backward([datum], loss_fn, loss_fn_config=config).result()
    assert math.isfinite(tc.forward_backward([good], "importance_sampling").result().metrics["loss:sum"])


def test_an_unexpected_error_inside_a_call_fails_that_call_and_the_worker_goes_on(service, client, tokenizer,
                                                                               monkeypatch):
    svc = service[0]
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    params = types.SamplingParams(max_tokens=3, seed=0)
    real = svc.host.sample
    monkeypatch.setattr(svc.host, "sample", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("engine exploded")))
    with pytest.raises(Exception, match="RuntimeError: engine exploded"):
        sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result(timeout=60)
    monkeypatch.setattr(svc.host, "sample", real)
    assert len(sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result(timeout=60).sequences) == 2


def test_kept_results_go_once_fetched_and_unfetched_ones_stay_while_there_is_room(service):
    from hyflow.serve.app import RETRIEVED_GRACE_S, _Call

    svc = service[0]
    saved_calls, saved_max = svc._calls, svc.max_results
    now = time.time()

    def done(request_id, retrieved):
        call = _Call(request_id, "owner-x", "test", finished=now, retrieved=retrieved)
        call.done.set()
        return call

    try:
        svc._calls = {c.request_id: c for c in [done("fetched-long-ago", now - RETRIEVED_GRACE_S - 1),
                                                done("fetched-now", now), done("unfetched-1", 0.0),
                                                done("unfetched-2", 0.0)]}
        svc.max_results = 3
        svc._prune()
        assert list(svc._calls) == ["fetched-now", "unfetched-1", "unfetched-2"]
        svc.max_results = 2  # too many: the fetched one goes before any unfetched one
        svc._prune()
        assert list(svc._calls) == ["unfetched-1", "unfetched-2"]
    finally:
        svc._calls, svc.max_results = saved_calls, saved_max


def test_queued_calls_are_bounded(service):
    from hyflow.serve.host import ServeError

    svc = service[0]
    gate = threading.Event()
    saved = svc.max_pending
    svc.max_pending = 1
    try:
        svc._submit("owner-x", "test", lambda: (gate.wait(30), ("application/json", b"{}"))[1])
        with pytest.raises(ServeError, match="queued already") as caught:
            svc._submit("owner-x", "test", lambda: ("application/json", b"{}"))
        assert caught.value.status == 429
    finally:
        gate.set()
        svc.max_pending = saved
