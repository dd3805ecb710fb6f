"""Response log-probs / entropy / values from one backbone pass equal the naive full-logits computation."""

from __future__ import annotations

import pytest
import torch
from ranks import init_gloo, spawn_ranks

from hyflow.models.forward import (
    FULL_LOGITS_MAX_ELEMENTS,
    compute_position_ids,
    lm_head_logprobs,
    response_logprobs,
    reward_scores,
    token_values,
    unwrap_model,
    values_from_model,
)
from hyflow.models.loading import load_causal_lm, load_reward_model, load_value_model

RESPONSE_LEN = 5


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return load_causal_lm(tiny_model_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def batch(model):
    """3 samples of length 12: left-padded prompts (pad 0, 2, 4) + 5 response tokens."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab, (3, 12), generator=gen)
    attention_mask = torch.ones(3, 12, dtype=torch.long)
    for row, pad in enumerate([0, 2, 4]):
        attention_mask[row, :pad] = 0
        input_ids[row, :pad] = 0
    return input_ids, attention_mask, compute_position_ids(attention_mask)


def naive_logprobs(model, input_ids, attention_mask, position_ids, temperature):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, -RESPONSE_LEN - 1 : -1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, -RESPONSE_LEN:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_compute_position_ids_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert compute_position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
@pytest.mark.parametrize("full_max", [0, FULL_LOGITS_MAX_ELEMENTS], ids=["chunked", "full"])
def test_logprobs_and_entropy_match_naive(model, batch, temperature, chunk_size, full_max):
    with torch.no_grad():
        logp, entropy = response_logprobs(
            model,
            *batch,
            RESPONSE_LEN,
            temperature=temperature,
            calculate_entropy=True,
            chunk_size=chunk_size,
            full_logits_max_elements=full_max,
        )
        ref_logp, ref_entropy = naive_logprobs(model, *batch, temperature)
    assert logp.shape == entropy.shape == (3, RESPONSE_LEN)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=0)


def rows_through_head(model, batch, grad: bool, full_logits_max_elements: int) -> list[int]:
    """Rows of each lm_head call of one response_logprobs (and its backward when `grad`), chunks of 4 rows."""
    rows_seen = []
    handle = model.lm_head.register_forward_hook(
        lambda _m, args, _out: rows_seen.append(args[0].shape[:-1].numel())
    )
    try:
        with torch.set_grad_enabled(grad):
            logp, _ = response_logprobs(model, *batch, RESPONSE_LEN, chunk_size=4,
                                        full_logits_max_elements=full_logits_max_elements)
            if grad:
                logp.sum().backward()
                model.zero_grad()
    finally:
        handle.remove()
    return rows_seen


@pytest.mark.parametrize("grad", [False, True])
def test_lm_head_never_sees_more_than_chunk_size_rows(model, batch, grad):
    """Above `full_logits_max_elements` the head runs in chunks: once per chunk, once more per chunk in backward."""
    rows_seen = rows_through_head(model, batch, grad, 3 * RESPONSE_LEN * model.config.vocab_size - 1)
    assert max(rows_seen) == 4
    # the root forward asks for logits at no position; checkpointed chunks run again in backward
    assert sum(rows_seen) == 3 * RESPONSE_LEN * (2 if grad else 1)


@pytest.mark.parametrize("grad", [False, True])
def test_small_logits_are_built_at_once_and_never_recomputed(model, batch, grad):
    """At or below `full_logits_max_elements` (N·V) the head runs once on all N rows, also in backward."""
    rows_seen = rows_through_head(model, batch, grad, 3 * RESPONSE_LEN * model.config.vocab_size)
    assert rows_seen == [0, 3 * RESPONSE_LEN]  # the root forward (no position), then all rows once


def test_full_and_chunked_heads_give_identical_values_and_close_gradients():
    """The two ways differ in memory and recompute only: same values and gradients to float rounding (values bit
    for bit on CPU, where the head's matmul rounds a row alike whatever the row count)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=False)
    hidden = torch.randn(50, 32)
    labels = torch.randint(0, 300, (50,))
    weights = torch.randn(50)
    results = []
    for full_max in (0, FULL_LOGITS_MAX_ELEMENTS):
        h = hidden.clone().requires_grad_(True)
        logp, entropy = lm_head_logprobs(
            h, labels, head, temperature=0.9, calculate_entropy=True, chunk_size=7, full_logits_max_elements=full_max
        )
        ((logp * weights).sum() + 0.2 * entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), h.grad, head.weight.grad.clone()))
        head.weight.grad = None
    (lp_c, ent_c, gh_c, gw_c), (lp_f, ent_f, gh_f, gw_f) = results
    torch.testing.assert_close(lp_f, lp_c, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_f, ent_c, atol=1e-6, rtol=0)
    torch.testing.assert_close(gh_f, gh_c, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw_f, gw_c, atol=1e-6, rtol=1e-5)


def test_unwrap_model_through_wrappers(model):
    class Peft(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.base_model = inner

        def get_base_model(self):
            return self.base_model

    class Ddp(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    assert unwrap_model(Ddp(Peft(model))) is model
    assert unwrap_model(model) is model


def test_temperature_changes_logprobs(model, batch):
    with torch.no_grad():
        logp_1, _ = response_logprobs(model, *batch, RESPONSE_LEN, temperature=1.0)
        logp_half, _ = response_logprobs(model, *batch, RESPONSE_LEN, temperature=0.5)
    assert not torch.allclose(logp_1, logp_half, atol=1e-3)


def test_entropy_is_none_unless_requested(model, batch):
    with torch.no_grad():
        _, entropy = response_logprobs(model, *batch, RESPONSE_LEN)
    assert entropy is None


@pytest.mark.parametrize("full_max", [0, FULL_LOGITS_MAX_ELEMENTS], ids=["chunked", "full"])
def test_gradients_match_naive(model, batch, full_max):
    """d(sum of logp + 0.3 entropy)/d(params), through checkpointed chunks or the full logits, equals the naive
    gradient."""
    weights = torch.linspace(-1, 1, 3 * RESPONSE_LEN).view(3, RESPONSE_LEN)

    def grads(fn):
        model.zero_grad()
        logp, entropy = fn()
        ((logp * weights).sum() + 0.3 * entropy.sum()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    got = grads(
        lambda: response_logprobs(
            model, *batch, RESPONSE_LEN, temperature=0.8, calculate_entropy=True, chunk_size=4,
            full_logits_max_elements=full_max,
        )
    )
    want = grads(lambda: naive_logprobs(model, *batch, 0.8))
    model.zero_grad()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def _saved_bytes_for_backward(fn) -> int:
    """Bytes autograd keeps for backward (outside checkpointed regions), counted once per storage."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_chunked_head_keeps_no_logits_for_backward():
    """With checkpointing the saved memory is the hidden rows, not the [N, V] logits; below the size threshold
    (no checkpointing) it is the logits once."""
    torch.manual_seed(0)
    n_rows, hidden, vocab = 64, 16, 4096
    head = torch.nn.Linear(hidden, vocab, bias=False)
    hidden_NH = torch.randn(n_rows, hidden, requires_grad=True)
    labels_N = torch.randint(0, vocab, (n_rows,))
    logits_bytes = n_rows * vocab * 4

    chunked = _saved_bytes_for_backward(
        lambda: lm_head_logprobs(
            hidden_NH, labels_N, head, calculate_entropy=True, chunk_size=16, full_logits_max_elements=0
        )
    )
    full = _saved_bytes_for_backward(
        lambda: lm_head_logprobs(hidden_NH, labels_N, head, calculate_entropy=True, chunk_size=16)
    )
    naive = _saved_bytes_for_backward(lambda: torch.log_softmax(head(hidden_NH), -1))
    assert naive >= logits_bytes
    assert chunked < logits_bytes / 10
    assert logits_bytes <= full < 2 * logits_bytes  # below the threshold: the logits, once, in their own dtype


def test_values_from_model_match_full_forward(tiny_model_dir, batch):
    torch.manual_seed(0)
    critic = load_value_model(tiny_model_dir)
    with torch.no_grad():
        values = values_from_model(critic, *batch, RESPONSE_LEN)
        full = critic(input_ids=batch[0], attention_mask=batch[1], position_ids=batch[2]).logits[..., 0]
    assert values.shape == (3, RESPONSE_LEN) and values.dtype == torch.float32
    torch.testing.assert_close(values, full[:, -RESPONSE_LEN - 1 : -1])
    assert token_values(critic, *batch).shape == (3, 12)


def test_reward_scores_read_last_attended_token(tiny_model_dir):
    torch.manual_seed(0)
    rm = load_reward_model(tiny_model_dir, allow_fresh_head=True)
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 7, 8]])
    right_padded = torch.tensor([[7, 8, 0, 0]])
    mask = (ids != 0).long()
    right_mask = torch.tensor([[1, 1, 0, 0]])
    with torch.no_grad():
        scores = reward_scores(rm, ids, mask, compute_position_ids(mask))
        right = reward_scores(rm, right_padded, right_mask, compute_position_ids(right_mask))
        alone = reward_scores(rm, ids[1:, 2:], mask[1:, 2:], compute_position_ids(mask[1:, 2:]))
    assert scores.shape == (2,)
    torch.testing.assert_close(scores[1:], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad_length", [0, 12])
def test_response_length_out_of_range(model, batch, bad_length):
    with pytest.raises(ValueError, match=r"response_length=.* must be in \[1, 11\]"):
        response_logprobs(model, *batch, bad_length)


def test_bad_chunk_size(model, batch):
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        response_logprobs(model, *batch, RESPONSE_LEN, chunk_size=0)


DIST_MODES = ["ddp", "fsdp2"]


def _distributed_grads(rank: int, model_dir: str, init_file: str, out_dir: str) -> None:
    """Each mode of DIST_MODES in turn on this rank's half of the batch; rank 0 saves the summed gradients."""
    import torch.distributed as dist

    init_gloo(rank, 2, init_file)
    for mode in DIST_MODES:
        model = load_causal_lm(model_dir)
        ids, mask, pos = (t[2 * rank : 2 * rank + 2] for t in _dist_batch())
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            _dist_loss(wrapped, ids, mask, pos).backward()
            grads = {name: p.grad * 2 for name, p in model.named_parameters()}  # DDP averages over 2 ranks
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            _dist_loss(model, ids, mask, pos).backward()
            grads = {name: p.grad.full_tensor() * 2 for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, f"{out_dir}/grads_{mode}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _dist_batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (4, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[3, :5] = 0
    return ids, mask, compute_position_ids(mask)


def _dist_loss(model, ids, mask, pos):
    logp, entropy = response_logprobs(
        model, ids, mask, pos, RESPONSE_LEN, calculate_entropy=True, chunk_size=3
    )
    return logp.sum() + 0.1 * entropy.sum()


@pytest.fixture(scope="module")
def distributed_grads(tiny_model_dir, tmp_path_factory):
    """{mode: the summed gradients} of DDP and FSDP2 on 2 gloo ranks (half the batch each), both from one spawn of
    the ranks (a spawn costs each rank its imports, ~5 CPU-s; a mode's step well under one)."""
    out = tmp_path_factory.mktemp("distributed_grads")
    spawn_ranks(_distributed_grads, args=(str(tiny_model_dir), str(out / "init"), str(out)))
    return {mode: torch.load(out / f"grads_{mode}.pt") for mode in DIST_MODES}


@pytest.mark.slow
@pytest.mark.parametrize("mode", DIST_MODES)
def test_wrapped_models_give_single_process_gradients(tiny_model_dir, distributed_grads, mode):
    """Through DDP / FSDP2 (2 gloo ranks, half the batch each) the summed gradient equals one process's."""
    reference = load_causal_lm(tiny_model_dir)
    _dist_loss(reference, *_dist_batch()).backward()
    got = distributed_grads[mode]
    for name, param in reference.named_parameters():
        torch.testing.assert_close(got[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
