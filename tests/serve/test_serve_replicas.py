"""`hyflow serve --workers 2`: the model and every adapter replicated on 2 Ray workers (gloo), each call's data
split over them, the LoRA gradients summed before every step; the same results as one process, through the real
tinker SDK."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

KEY = "tml-test-key-replicas"


@pytest.fixture
def services(tiny_model_dir, tmp_path, shared_ray):
    """One service in process and one on 2 Ray replicas (the suite's shared Ray: conftest owns its lifetime)."""
    from hyflow.serve import start

    one = start(str(tiny_model_dir), name="tiny", port=0, api_keys=[KEY], store=tmp_path / "one")
    try:
        two = start(str(tiny_model_dir), name="tiny", port=0, api_keys=[KEY], store=tmp_path / "two", workers=2)
    except BaseException:
        one[3]()
        raise
    yield {"one": one, "two": two}
    two[3]()
    one[3]()


def datum(tokenizer, text, advantages=None):
    ids = tokenizer.encode(text)
    n = len(ids) - 1
    if advantages is None:
        return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                           loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n})
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:],
                                       "logprobs": types.TensorData(data=[-2.0] * n, dtype="float32"),
                                       "advantages": types.TensorData(data=[advantages] * n, dtype="float32")})


def session(services, which):
    return tinker.ServiceClient(base_url=services[which][1], api_key=KEY)


def test_two_replicas_train_and_sample_as_one_process(services, tiny_tokenizer):
    data = [datum(tiny_tokenizer, t) for t in ("the cat sat on the mat", "a dog ran", "snow is white today")]
    bad = [datum(tiny_tokenizer, "the cat sat", advantages=1.0), datum(tiny_tokenizer, "the cat", advantages=float("nan"))]
    results = {}
    for which in ("one", "two"):
        client = session(services, which)
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        losses = []
        for step in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)).result()
            losses.append(fb.result().metrics["loss:sum"])
            if step == 0:  # a call failing on the second shard only: rolled back everywhere
                with pytest.raises(Exception, match="not finite"):
                    tc.forward_backward(bad, "importance_sampling").result(timeout=120)
        lp = [np.asarray(o["logprobs"].tolist()) for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
        sampler = tc.save_weights_and_get_sampling_client().result()
        # one call at a time: the same decoding batches in both services (calls queued together would batch by timing)
        samples = [[(s.tokens, s.logprobs) for s in sampler.sample(
            prompt=types.ModelInput.from_ints(tiny_tokenizer.encode(p)), num_samples=n,
            sampling_params=types.SamplingParams(max_tokens=5, seed=3)).result().sequences]
            for p, n in (("the cat", 2), ("a dog", 3), ("snow", 1))]
        state = tc.save_state("replicated").result().path
        resumed = client.create_training_client_from_state_with_optimizer(state).result()
        resumed_lp = [np.asarray(o["logprobs"].tolist())
                      for o in resumed.forward(data, "cross_entropy").result().loss_fn_outputs]
        results[which] = (losses, lp, samples, resumed_lp)
        if which == "one":
            client.close("success").result(timeout=60)
    (l1, lp1, s1, r1), (l2, lp2, s2, r2) = results["one"], results["two"]
    assert l2 == pytest.approx(l1, rel=1e-5)
    for a, b in zip(lp1 + r1, lp2 + r2, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(s1, s2, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        np.testing.assert_allclose([x for _, x in a], [x for _, x in b], atol=1e-4)
    assert lp2[0].shape[0] > 0 and np.abs(lp2[0] - r2[0]).max() < 1e-5  # the checkpoint holds the weights
    # what one process refuses, the replicas refuse (checked on the driver before anything is sent)
    tc = client.create_lora_training_client(base_model="tiny", rank=2, seed=1).result()  # the "two" service
    with pytest.raises(Exception, match="outside the model's vocabulary"):
        tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([5, 10**6]),
                                         loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]})],
                            "cross_entropy").result(timeout=120)
    with pytest.raises(Exception, match="learning_rate"):
        tc.optim_step(types.AdamParams(learning_rate=float("nan"))).result(timeout=120)
    client.close("success").result(timeout=60)
