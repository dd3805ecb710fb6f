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
