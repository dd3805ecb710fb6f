"""hyflow.serve.host.ModelHost without HTTP: runs come and go on the one base model."""

from __future__ import annotations

import pytest
import torch

from hyflow.rollout.base import SamplingParams
from hyflow.serve.host import Datum, LoraSpec, ModelHost, SampleAsk, ServeError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def host(tiny_model_dir, tmp_path_factory):
    return ModelHost(tiny_model_dir, name="tiny", store=tmp_path_factory.mktemp("host_store"))


def run_id(n: int) -> str:
    return f"session-{'0' * 12}:train:{n}"


DATA = [Datum([5, 6, 7], {"target_tokens": torch.tensor([6, 7, 8]), "weights": torch.ones(3)})]


def test_runs_come_and_go_and_the_base_model_is_the_same_after(host):
    params = SamplingParams(max_new_tokens=4)
    base = host.sample([SampleAsk([5, 6], 2, 4, 0)], params, None)[0]
    first = None
    for n in range(3):  # the last adapter's unload takes the peft wrapper away; the next run brings it back
        run = host.create_run("owner", run_id(n), "tiny", LoraSpec(rank=2, seed=0))
        loss = host.forward_backward(run, DATA, "cross_entropy", None, forward_only=False)[1]["loss:sum"]
        first = loss if first is None else first
        assert loss == pytest.approx(first, rel=1e-6)  # same seed, same fresh adapter each time
        host.unload(run)
        assert host.runs == {} and host.peft is None
    again = host.sample([SampleAsk([5, 6], 2, 4, 0)], params, None)[0]
    assert [s.tokens for s in again] == [s.tokens for s in base]
    assert [s.log_probs for s in again] == [s.log_probs for s in base]


def test_unloading_one_run_leaves_the_others_working(host):
    a = host.create_run("owner", run_id(10), "tiny", LoraSpec(rank=2, seed=1))
    b = host.create_run("owner", run_id(11), "tiny", LoraSpec(rank=4, seed=2))
    before = host.forward_backward(b, DATA, "cross_entropy", None, forward_only=True)[1]
    host.unload(a)
    assert host.forward_backward(b, DATA, "cross_entropy", None, forward_only=True)[1] == before
    host.unload(b)


def test_run_ids_and_checkpoint_names_cannot_leave_the_store(host):
    with pytest.raises(ServeError, match="not of the form"):
        host.create_run("owner", "../../etc", "tiny", LoraSpec(rank=2))
    run = host.create_run("owner", run_id(20), "tiny", LoraSpec(rank=2))
    with pytest.raises(ServeError, match="letters, digits"):
        host.save(run, "../escape", kind="weights", optimizer=False)
    with pytest.raises(ServeError, match="not a checkpoint path"):
        host.resolve("tinker://x/../../weights/y", "owner")
    host.unload(run)


def _grads(run) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in run.params.items()}


def test_micro_batches_by_token_budget_give_the_same_loss_and_gradients(host):
    run = host.create_run("owner", run_id(30), "tiny", LoraSpec(rank=2, seed=3))
    data = [Datum(list(range(5, 5 + n)), {"target_tokens": torch.arange(6, 6 + n), "weights": torch.rand(n)})
            for n in (3, 9, 4, 7, 2)]
    saved = host.max_forward_tokens
    try:
        host.max_forward_tokens = 10**6
        whole = host.forward_backward(run, data, "cross_entropy", None, forward_only=False)
        whole_grads = _grads(run)
        run.optimizer.zero_grad(set_to_none=True)
        host.max_forward_tokens = 12  # 5 data -> 4 micro-batches
        split = host.forward_backward(run, data, "cross_entropy", None, forward_only=False)
    finally:
        host.max_forward_tokens = saved
    assert split[1]["loss:sum"] == pytest.approx(whole[1]["loss:sum"], rel=1e-5)
    for a, b in zip(split[0], whole[0], strict=True):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
    for n, g in _grads(run).items():
        torch.testing.assert_close(g, whole_grads[n], atol=1e-4, rtol=1e-3)  # padding widths differ: rounding
    host.unload(run)


def test_a_call_that_fails_part_way_leaves_the_gradients_as_they_were(host):
    run = host.create_run("owner", run_id(31), "tiny", LoraSpec(rank=2, seed=4))
    good = Datum([5, 6, 7], {"target_tokens": torch.tensor([6, 7, 8]), "logprobs": torch.full((3,), -2.0),
                             "advantages": torch.ones(3)})
    bad = Datum([5, 6, 7, 8], {"target_tokens": torch.tensor([6, 7, 8, 9]), "logprobs": torch.full((4,), -2.0),
                               "advantages": torch.tensor([1.0, float("nan"), 1.0, 1.0])})
    host.forward_backward(run, [good], "importance_sampling", None, forward_only=False)
    before = _grads(run)
    saved = host.max_forward_tokens
    host.max_forward_tokens = 4  # good first (its backward runs), then bad
    try:
        with pytest.raises(ServeError, match="not finite"):
            host.forward_backward(run, [good, bad], "importance_sampling", None, forward_only=False)
    finally:
        host.max_forward_tokens = saved
    for n, g in _grads(run).items():
        torch.testing.assert_close(g, before[n], atol=0, rtol=0)
    host.unload(run)


def test_inputs_longer_than_the_models_context_are_refused_by_name(host):
    run = host.create_run("owner", run_id(32), "tiny", LoraSpec(rank=2))
    n = host.context_length + 1
    long = Datum([5] * n, {"target_tokens": torch.full((n,), 6), "weights": torch.ones(n)})
    with pytest.raises(ServeError, match="max_position_embeddings"):
        host.forward_backward(run, [long], "cross_entropy", None, forward_only=True)
    with pytest.raises(ServeError, match="exceed the model's context"):
        host.sample([SampleAsk([5] * (host.context_length - 2), 1, 4, 0)], SamplingParams(max_new_tokens=4), None)
    host.unload(run)


def test_a_call_that_runs_after_its_run_was_unloaded_is_refused(host):
    run = host.create_run("owner", run_id(33), "tiny", LoraSpec(rank=2))
    keep = host.create_run("owner", run_id(34), "tiny", LoraSpec(rank=2))
    host.unload(run)  # e.g. its session ended while this call waited in the queue
    for call in (lambda: host.forward_backward(run, DATA, "cross_entropy", None, forward_only=False),
                 lambda: host.optim_step(run, learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                                         grad_clip_norm=0.0),
                 lambda: host.save(run, "late", kind="weights", optimizer=True)):
        with pytest.raises(ServeError, match="unloaded before this call ran") as caught:
            call()
        assert caught.value.status == 404
    assert not (host.store / "runs" / run.run_id / "weights" / "late").exists()
    host.unload(keep)


def test_runs_are_bounded_and_the_error_names_the_flag(host):
    saved = host.max_runs
    host.max_runs = len(host.runs) + 1
    try:
        run = host.create_run("owner", run_id(40), "tiny", LoraSpec(rank=2))
        with pytest.raises(ServeError, match="--max-runs") as caught:
            host.create_run("owner", run_id(41), "tiny", LoraSpec(rank=2))
        assert caught.value.status == 429
        assert host.create_run("owner", run_id(40), "tiny", LoraSpec(rank=2)) is run  # a retried create: same run
    finally:
        host.max_runs = saved
    host.unload(run)
