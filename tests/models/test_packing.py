"""Packed forwards (`hyflow.models.packing`) equal the padded ones of `hyflow.models.forward` / the SFT trainer, and
attention never crosses a packed sequence's boundary."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hyflow.batch import Batch
from hyflow.models.forward import compute_position_ids, response_logprobs, values_from_model
from hyflow.models.loading import load_causal_lm, load_value_model
from hyflow.models.packing import (
    PACKED_ATTENTION,
    pack_sequences,
    packed_attention,
    packed_hidden_states,
    packed_response_logprobs,
    packed_token_nll_sum,
    packed_values,
    unpack,
)
from hyflow.trainer.sft_trainer import token_nll_sum

PROMPT_WIDTH, RESPONSE_LEN = 20, 40
# (prompt tokens, response tokens) per row: 3 to 60 real tokens, a 1-token response, an empty response
ROWS = [(3, 1), (20, 40), (2, 5), (12, 27), (6, 0), (1, 13)]


def rl_batch(rows=ROWS, seed: int = 1, vocab: int = 400):
    """Left-padded prompts ++ right-padded responses: input_ids, attention_mask [B, PROMPT_WIDTH + RESPONSE_LEN]."""
    gen = torch.Generator().manual_seed(seed)
    width = PROMPT_WIDTH + RESPONSE_LEN
    ids = torch.randint(3, vocab, (len(rows), width), generator=gen)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        mask[b, PROMPT_WIDTH - p : PROMPT_WIDTH + r] = 1
    return ids * mask, mask


@pytest.fixture(autouse=True, params=["per_sequence", "batched"])
def cpu_attention_path(request, monkeypatch):
    """Every test runs with both CPU attention paths: one SDPA call per sequence, and all sequences in one
    masked call (`BATCHED_ATTENTION_MAX_WASTE` 0 = never batched, inf = always when there are 2+ sequences)."""
    import hyflow.models.varlen_attention as varlen_attention  # the packed attention's home (hyflow.models.packing)

    monkeypatch.setattr(varlen_attention, "BATCHED_ATTENTION_MAX_WASTE",
                        0.0 if request.param == "per_sequence" else math.inf)
    return request.param


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_model_dir):
    return load_causal_lm(tiny_model_dir, attn_implementation=request.param).eval()


@pytest.fixture(scope="module")
def critic(tiny_model_dir):
    torch.manual_seed(0)
    return load_value_model(tiny_model_dir).eval()


def padded_logprobs(model, ids, mask, **kwargs):
    return response_logprobs(model, ids, mask, compute_position_ids(mask), RESPONSE_LEN, **kwargs)


def test_pack_unpack_round_trip():
    ids, mask = rl_batch([(3, 1), (0, 0), (20, 40), (1, 0)])
    packed = pack_sequences(ids, mask)
    assert packed.input_ids.shape == (1, 3 + 1 + 60 + 1)
    assert packed.cu_seqlens.tolist() == [0, 4, 4, 64, 65] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 60 and packed.seq_lengths == (4, 0, 60, 1)
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, *range(60), 0]
    torch.testing.assert_close(unpack(packed.input_ids, packed), ids, rtol=0, atol=0)
    torch.testing.assert_close(unpack(packed.position_ids[0], packed), compute_position_ids(mask) * mask,
                               rtol=0, atol=0)
    values = torch.randn(packed.num_tokens, 3)
    assert unpack(values, packed).shape == (4, 60, 3)
    assert unpack(values, packed)[mask.bool()].equal(values)
    assert packed.attention_kwargs()["cu_seq_lens_q"].tolist() == [0, 4, 64, 65]  # empty rows dropped


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_padded(model, temperature):
    ids, mask = rl_batch()
    with torch.no_grad():
        want, want_entropy = padded_logprobs(model, ids, mask, temperature=temperature, calculate_entropy=True)
        got, got_entropy = packed_response_logprobs(model, ids, mask, RESPONSE_LEN, temperature=temperature,
                                                    calculate_entropy=True, chunk_size=16)
    response_mask = mask[:, -RESPONSE_LEN:].bool()
    assert got.shape == got_entropy.shape == (len(ROWS), RESPONSE_LEN) and got.dtype == torch.float32
    torch.testing.assert_close(got[response_mask], want[response_mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_entropy[response_mask], want_entropy[response_mask], atol=1e-5, rtol=0)
    assert not got[~response_mask].any() and not got_entropy[~response_mask].any()
    assert packed_response_logprobs(model, ids, mask, RESPONSE_LEN)[1] is None


def test_original_attention_is_restored(model):
    before = model.config._attn_implementation
    ids, mask = rl_batch()
    with torch.no_grad():
        packed_response_logprobs(model, ids, mask, RESPONSE_LEN)
    assert model.config._attn_implementation == before
    with pytest.raises(ZeroDivisionError), packed_attention(model):
        assert model.config._attn_implementation == PACKED_ATTENTION
        1 / 0  # noqa: B018
    assert model.config._attn_implementation == before


def test_matches_transformers_packed_reference(model):
    """transformers' own packed path (attention_mask=None, restarting position ids, no cache: it builds a dense
    [T, T] block-diagonal mask for sdpa/eager) gives the same hidden states."""
    ids, mask = rl_batch()
    packed = pack_sequences(ids, mask)
    with torch.no_grad():
        got = packed_hidden_states(model, packed)
        want = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                           use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_cross_sequence_leakage(model):
    """New tokens in row 1 (same length) leave the packed outputs of every other row bit for bit unchanged."""
    ids, mask = rl_batch()
    changed = ids.clone()
    changed[1] = torch.where(mask[1].bool(), (ids[1] + 7) % 397 + 3, ids[1])
    with torch.no_grad():
        a, a_entropy = packed_response_logprobs(model, ids, mask, RESPONSE_LEN, calculate_entropy=True)
        b, b_entropy = packed_response_logprobs(model, changed, mask, RESPONSE_LEN, calculate_entropy=True)
    others = [row for row in range(len(ROWS)) if row != 1]
    assert torch.equal(a[others], b[others]) and torch.equal(a_entropy[others], b_entropy[others])
    assert not torch.equal(a[1], b[1])


def test_values_match_padded(critic):
    ids, mask = rl_batch()
    with torch.no_grad():
        want = values_from_model(critic, ids, mask, compute_position_ids(mask), RESPONSE_LEN)
        got = packed_values(critic, ids, mask, RESPONSE_LEN)
    response_mask = mask[:, -RESPONSE_LEN:].bool()
    assert got.shape == (len(ROWS), RESPONSE_LEN) and got.dtype == torch.float32
    torch.testing.assert_close(got[response_mask], want[response_mask], atol=1e-5, rtol=0)
    assert not got[~response_mask].any()


def test_sft_nll_matches_token_nll_sum(model):
    """Right-padded SFT rows (3 to 60 tokens) with a loss mask over the answer part."""
    lengths, answer_from = [60, 3, 17, 41], [30, 1, 9, 5]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 400, (4, 64), generator=gen)
    mask = torch.zeros(4, 64, dtype=torch.long)
    loss_mask = torch.zeros(4, 64, dtype=torch.long)
    for b, (n, a) in enumerate(zip(lengths, answer_from)):
        mask[b, :n] = 1
        loss_mask[b, a:n] = 1
    ids = ids * mask
    position_ids = torch.arange(64).expand(4, 64).clone()
    micro = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids, "loss_mask": loss_mask})
    with torch.no_grad():
        want = token_nll_sum(model, micro)
        got = packed_token_nll_sum(model, ids, mask, position_ids, loss_mask)
    torch.testing.assert_close(got, want, atol=1e-5 * float(loss_mask.sum()), rtol=1e-6)


def _grads(model, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_close(got, want):
    assert got.keys() == want.keys() and want
    for name in want:
        scale = float(want[name].abs().max())
        diff = float((got[name] - want[name]).abs().max())
        assert diff <= 1e-4 * scale + 1e-7, f"{name}: max |diff| {diff:.3g} vs max |grad| {scale:.3g}"


def _rl_loss(logp_entropy, mask):
    logp, entropy = logp_entropy
    response_mask = mask[:, -RESPONSE_LEN:].float()
    return -((logp + 0.1 * entropy) * response_mask).sum() / response_mask.sum()


def test_gradients_match_padded(model):
    ids, mask = rl_batch()
    model.train()
    try:
        want = _grads(model, lambda: _rl_loss(padded_logprobs(model, ids, mask, calculate_entropy=True), mask))
        got = _grads(model, lambda: _rl_loss(
            packed_response_logprobs(model, ids, mask, RESPONSE_LEN, calculate_entropy=True, chunk_size=32), mask))
    finally:
        model.eval()
    _assert_grads_close(got, want)


def test_value_gradients_match_padded(critic):
    ids, mask = rl_batch()
    response_mask = mask[:, -RESPONSE_LEN:].float()

    def loss(values):
        return ((values - 0.5) ** 2 * response_mask).sum() / response_mask.sum()

    want = _grads(critic, lambda: loss(values_from_model(critic, ids, mask, compute_position_ids(mask), RESPONSE_LEN)))
    got = _grads(critic, lambda: loss(packed_values(critic, ids, mask, RESPONSE_LEN)))
    _assert_grads_close(got, want)


@pytest.mark.parametrize("kind", ["transformers", "fsdp2_composable"])
def test_gradient_checkpointing_needs_the_enclosing_context(tiny_model_dir, kind):
    """The backward recomputes each layer and looks attention up again: outside `packed_attention` that would be
    the sequence-crossing original, so the packed call refuses; inside, gradients equal the padded ones.
    Both kinds of recompute: transformers' `gradient_checkpointing_enable` and the composable `checkpoint` that
    `hyflow.parallel.fsdp.apply_activation_checkpointing` applies per layer."""
    model = load_causal_lm(tiny_model_dir, attn_implementation="sdpa",
                           enable_gradient_checkpointing=kind == "transformers")
    if kind == "fsdp2_composable":
        from torch.distributed._composable import checkpoint

        for layer in model.model.layers:
            checkpoint(layer)
    model.train()
    ids, mask = rl_batch()
    with pytest.raises(RuntimeError, match=r"gradient checkpointing.*packed_attention\(model\)"):
        packed_response_logprobs(model, ids, mask, RESPONSE_LEN)
    want = _grads(model, lambda: _rl_loss(padded_logprobs(model, ids, mask, calculate_entropy=True), mask))

    def packed_loss():
        return _rl_loss(packed_response_logprobs(model, ids, mask, RESPONSE_LEN, calculate_entropy=True), mask)

    with packed_attention(model):
        got = _grads(model, packed_loss)
    _assert_grads_close(got, want)
    with torch.no_grad():  # no backward, no recompute: no context needed
        packed_response_logprobs(model, ids, mask, RESPONSE_LEN)


def test_peft_wrapped_model_matches_padded(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = load_causal_lm(tiny_model_dir, attn_implementation="sdpa")
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False)).eval()
    for ids, mask in (rl_batch(), grouped_batch()):
        with torch.no_grad():
            want, _ = padded_logprobs(lora, ids, mask)
            got, _ = packed_response_logprobs(lora, ids, mask, RESPONSE_LEN)
            shared, _ = packed_response_logprobs(lora, ids, mask, RESPONSE_LEN, share_prompts=True)
        response_mask = mask[:, -RESPONSE_LEN:].bool()
        torch.testing.assert_close(got[response_mask], want[response_mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(shared[response_mask], want[response_mask], atol=1e-5, rtol=0)
    assert base.config._attn_implementation == "sdpa"


def test_batch_without_response_tokens(model):
    """All responses empty: zeros, and a loss on them still reaches the graph (DDP/FSDP ranks stay in step)."""
    ids, mask = rl_batch([(3, 0), (5, 0)])
    model.train()
    try:
        logp, entropy = packed_response_logprobs(model, ids, mask, RESPONSE_LEN, calculate_entropy=True)
        values_free = packed_token_nll_sum(model, ids, mask, compute_position_ids(mask), torch.zeros_like(mask))
    finally:
        model.eval()
    assert not logp.any() and not entropy.any() and logp.requires_grad
    assert float(values_free.detach()) == 0.0 and values_free.requires_grad
    with torch.no_grad():
        empty = packed_response_logprobs(model, ids * 0, mask * 0, RESPONSE_LEN)[0]
    assert empty.shape == (2, RESPONSE_LEN) and not empty.any()


def test_sliding_window_is_refused_by_name():
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0)
    config.architectures = ["Qwen2ForCausalLM"]
    model = Qwen2ForCausalLM(config).eval()
    ids, mask = rl_batch([(3, 4), (2, 6)], vocab=64)
    with pytest.raises(NotImplementedError, match=r"sliding-window.*Qwen2ForCausalLM.*use_remove_padding=false"):
        packed_response_logprobs(model, ids, mask, RESPONSE_LEN)


def test_padded_forward_inside_the_context_is_an_error(model):
    ids, mask = rl_batch()
    with pytest.raises(RuntimeError, match="runs only on packed input"), packed_attention(model), torch.no_grad():
        padded_logprobs(model, ids, mask)


# ------------------------------------------------------------------------- shared prompts (use_prefix_grouper)
def grouped_batch(seed: int = 3, vocab: int = 400):
    """GRPO-shaped rows: three prompts (lengths 7, 20, 1) with 3, 2 and 1 samples of very different response
    lengths (an empty one included), the groups interleaved so that a prompt's first row is not its only one."""
    gen = torch.Generator().manual_seed(seed)
    width = PROMPT_WIDTH + RESPONSE_LEN
    prompts = {0: 7, 1: 20, 2: 1}
    rows = [(0, 40), (1, 3), (0, 1), (2, 17), (0, 0), (1, 31), (0, 22)]
    prompt_ids = {g: torch.randint(3, vocab, (PROMPT_WIDTH,), generator=gen) for g in prompts}
    ids = torch.randint(3, vocab, (len(rows), width), generator=gen)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (g, r) in enumerate(rows):
        ids[b, :PROMPT_WIDTH] = prompt_ids[g]
        mask[b, PROMPT_WIDTH - prompts[g] : PROMPT_WIDTH + r] = 1
    return ids * mask, mask


def test_shared_prompts_pack_each_prompt_once():
    ids, mask = grouped_batch()
    packed = pack_sequences(ids, mask, share_prefix_width=PROMPT_WIDTH)
    responses = int(mask[:, PROMPT_WIDTH:].sum())
    assert packed.num_tokens == 7 + 20 + 1 + responses
    assert packed.shared.shared_tokens == 7 * 3 + 20 * 1
    # every padded real token reads back its own id and position (a follower's prompt from the leader's copy)
    torch.testing.assert_close(unpack(packed.input_ids, packed), ids, rtol=0, atol=0)
    torch.testing.assert_close(unpack(packed.position_ids[0], packed), compute_position_ids(mask) * mask,
                               rtol=0, atol=0)
    seg = packed.shared.segments
    assert [s[0] for s in seg] == sorted(s[0] for s in seg) and seg[-1][1] == packed.num_tokens
    assert all(a[1] == b[0] for a, b in itertools.pairwise(seg))
    # rows without a shared prompt pack as before
    ids[:, :PROMPT_WIDTH] = torch.arange(len(ids))[:, None] + 5
    assert pack_sequences(ids, mask, share_prefix_width=PROMPT_WIDTH).shared is None


def test_shared_prompts_match_padded_logprobs_and_gradients(model):
    ids, mask = grouped_batch()
    response_mask = mask[:, -RESPONSE_LEN:].bool()
    with torch.no_grad():
        want, want_entropy = padded_logprobs(model, ids, mask, calculate_entropy=True)
        got, got_entropy = packed_response_logprobs(model, ids, mask, RESPONSE_LEN, calculate_entropy=True,
                                                    share_prompts=True)
    torch.testing.assert_close(got[response_mask], want[response_mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_entropy[response_mask], want_entropy[response_mask], atol=1e-5, rtol=0)
    assert not got[~response_mask].any()
    model.train()
    try:
        want_g = _grads(model, lambda: _rl_loss(padded_logprobs(model, ids, mask, calculate_entropy=True), mask))
        got_g = _grads(model, lambda: _rl_loss(packed_response_logprobs(
            model, ids, mask, RESPONSE_LEN, calculate_entropy=True, share_prompts=True), mask))
    finally:
        model.eval()
    _assert_grads_close(got_g, want_g)


def test_shared_prompts_match_padded_values(critic):
    ids, mask = grouped_batch()
    response_mask = mask[:, -RESPONSE_LEN:].bool()
    with torch.no_grad():
        want = values_from_model(critic, ids, mask, compute_position_ids(mask), RESPONSE_LEN)
        got = packed_values(critic, ids, mask, RESPONSE_LEN, share_prompts=True)
    torch.testing.assert_close(got[response_mask], want[response_mask], atol=1e-5, rtol=0)


def test_shared_prompt_responses_do_not_see_each_other(model):
    """Changing one sample's response changes no other sample of its prompt (they share only the prompt)."""
    ids, mask = grouped_batch()
    changed = ids.clone()
    changed[2, PROMPT_WIDTH:] = torch.where(mask[2, PROMPT_WIDTH:].bool(), (ids[2, PROMPT_WIDTH:] + 7) % 397 + 3, 0)
    changed[0, PROMPT_WIDTH + 5:] = torch.where(mask[0, PROMPT_WIDTH + 5:].bool(),
                                                (ids[0, PROMPT_WIDTH + 5:] + 7) % 397 + 3, 0)
    with torch.no_grad():
        a, _ = packed_response_logprobs(model, ids, mask, RESPONSE_LEN, share_prompts=True)
        b, _ = packed_response_logprobs(model, changed, mask, RESPONSE_LEN, share_prompts=True)
    assert torch.equal(a[[1, 3, 4, 5, 6]], b[[1, 3, 4, 5, 6]])
    assert torch.equal(a[0, :5], b[0, :5]) and not torch.equal(a[0], b[0]) and not torch.equal(a[2], b[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_varlen_kernel_adds_no_error_beyond_bf16_itself(tiny_model_dir, monkeypatch):
    """On CUDA in bf16 the packed forward runs PyTorch's varlen flash kernel (`_varlen_cuda`): its log-probs and
    gradients are as close to the fp32 padded forward as the bf16 padded forward is (twice its error at most)."""
    import hyflow.models.varlen_attention as varlen_attention

    calls = []
    real = varlen_attention._varlen_cuda
    monkeypatch.setattr(varlen_attention, "_varlen_cuda", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask = (t.cuda() for t in rl_batch())
    response_mask = mask[:, -RESPONSE_LEN:].bool()
    fp32 = load_causal_lm(tiny_model_dir, attn_implementation="sdpa").cuda()
    bf16 = load_causal_lm(tiny_model_dir, attn_implementation="sdpa").cuda().to(torch.bfloat16)

    def grads_and_logp(model, packed: bool):
        model.zero_grad(set_to_none=True)
        if packed:
            out = packed_response_logprobs(model, ids, mask, RESPONSE_LEN, calculate_entropy=True)
        else:
            out = padded_logprobs(model, ids, mask, calculate_entropy=True)
        _rl_loss(tuple(t.float() for t in out), mask).backward()
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return out[0].float()[response_mask].detach(), grad

    want_logp, want_grad = grads_and_logp(fp32, packed=False)
    bf16_logp, bf16_grad = grads_and_logp(bf16, packed=False)
    got_logp, got_grad = grads_and_logp(bf16, packed=True)
    assert calls, "the packed bf16 forward on CUDA did not use the varlen kernel"
    logp_err, padded_logp_err = (got_logp - want_logp).abs().max(), (bf16_logp - want_logp).abs().max()
    assert logp_err <= 2 * padded_logp_err + 1e-3, (logp_err, padded_logp_err)
    grad_err = (got_grad - want_grad).norm() / want_grad.norm()
    padded_grad_err = (bf16_grad - want_grad).norm() / want_grad.norm()
    assert grad_err <= 2 * padded_grad_err + 1e-3, (grad_err, padded_grad_err)
