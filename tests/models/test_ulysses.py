"""Ulysses sequence parallelism on 2 (and 4) gloo ranks (hyflow.models.ulysses): each rank runs its slice of the row, the
attention exchanges heads for tokens by all-to-all, and the log-probs, values and gradients equal one process's
packed forward (with verl's grad scale, the gradients averaged over the group), with grouped-query heads,
K/V heads fewer than the group (repeated; on 4 ranks with 2 K/V heads, where the order of the repeats decides which
query heads each K/V head meets), shared prompts, and a row whose length the group does not divide. The 2-rank
cases run one after another in one spawn of 2 ranks (the `two_ranks` fixture: a spawn costs each rank its imports,
~5 CPU-s, a case under one), and each test asserts that its own case failed no check."""

from __future__ import annotations

import pytest
import torch
from ranks import spawn_cases

from hyflow.models import ulysses

R = 5


def _batch(seed: int = 0):
    """Left-padded prompts (two samples each of two prompts, one prompt of its own) + right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 400, (n,), generator=g).tolist() for n in (7, 4, 9)]
    rows = [(prompts[0], 5), (prompts[0], 3), (prompts[1], 4), (prompts[1], 5), (prompts[2], 2)]
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(rows), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (prompt, n) in enumerate(rows):
        ids[b, P - len(prompt):P] = torch.tensor(prompt)
        ids[b, P:P + n] = torch.randint(5, 400, (n,), generator=g)
        mask[b, P - len(prompt):P + n] = 1
    return ids, mask


def _model(path: str, kv_heads: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _logprobs_and_grads(model, ids, mask, share: bool):
    from hyflow.models.packing import packed_response_logprobs

    model.zero_grad()
    logp, _ = packed_response_logprobs(model, ids, mask, R, share_prompts=share)
    weights = torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)  # no two tokens weigh the same
    (logp * weights * mask[:, -R:]).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _logprobs_case(rank: int, checks, path: str, kv_heads: int, share: bool, size: int) -> None:
    import torch.distributed as dist

    model = _model(path, kv_heads)
    ids, mask = _batch()
    ids, mask = ids[:, 1:], mask[:, 1:]  # 24 real tokens less the trimmed one: the group does not divide some rows
    reference, reference_grads = _logprobs_and_grads(model, ids, mask, share)
    group = dist.new_group(list(range(size)))
    with ulysses.sequence_parallel(group):
        logp, grads = _logprobs_and_grads(model, ids, mask, share)
    real = mask[:, -R:].bool()
    with checks.check("log-probs"):
        assert torch.allclose(logp[real], reference[real], atol=1e-5, rtol=0), (logp - reference).abs().max()
    # the layers' gradients are split over the ranks, the (tied) lm_head's whole on each: with the grad scale the
    # group's average is the whole gradient, as a data-parallel average over dp x sp ranks needs
    for grad in grads.values():
        dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=group)
    with checks.check("gradients"):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], atol=2e-5, rtol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _logprobs_case_name(kv_heads: int, share: bool, size: int) -> str:
    return f"log-probs and gradients, {kv_heads} K/V heads, shared prompts {share}, {size} ranks"


VISION_PRESETS = ["tiny-vl", "tiny-vl-2.5"]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    """{case: failures} of every 2-rank case of this module, run in one spawn of 2 gloo ranks."""
    from hyflow.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("ulysses")
    cases = [(_logprobs_case_name(kv, share, 2), _logprobs_case, (str(tiny_model_dir), kv, share, 2))
             for kv, share in [(2, False), (1, False), (2, True)]]
    cases.append(("values", _values_case, (str(tiny_model_dir),)))
    for preset in VISION_PRESETS:
        path = make_tiny_model(root / preset, preset=preset, seed=0)
        cases.append((f"vision-language model {preset}", _vision_case, (str(path),)))
    return spawn_cases(cases, root / "ranks", timeout_s=300)


@pytest.mark.parametrize(("kv_heads", "share", "size"), [
    (2, False, 2), (1, False, 2), (2, True, 2),
    pytest.param(2, False, 4, marks=pytest.mark.slow),
])
def test_sequence_parallel_log_probs_and_gradients_equal_one_process(request, tiny_model_dir, tmp_path, kv_heads,
                                                                     share, size):
    """kv_heads=1 < 2 ranks: the K/V head is repeated so each rank's query heads find theirs. 2 K/V heads on 4 ranks
    (4 query heads, one per rank): query heads 0, 1 read K/V head 0 and 2, 3 head 1, so the repeats must be
    interleaved (k0 k0 k1 k1); repeated whole (k0 k1 k0 k1) rank 1 would attend with K/V head 1. With one K/V head
    (or as many as the ranks) both orders are the same, which is why this case has 4 ranks."""
    name = _logprobs_case_name(kv_heads, share, size)
    if size == 2:
        failures = request.getfixturevalue("two_ranks")[name]
    else:
        failures = spawn_cases([(name, _logprobs_case, (str(tiny_model_dir), kv_heads, share, size))], tmp_path,
                               nprocs=size, timeout_s=300)[name]
    assert not failures, "\n".join(failures)


def _values_case(rank: int, checks, path: str) -> None:
    import torch.distributed as dist

    from hyflow.models.loading import load_value_model
    from hyflow.models.packing import packed_values

    torch.manual_seed(0)
    critic = load_value_model(path).eval()
    ids, mask = _batch(seed=1)
    with torch.no_grad():
        reference = packed_values(critic, ids, mask, R)
        with ulysses.sequence_parallel(dist.new_group([0, 1])):
            values = packed_values(critic, ids, mask, R)
    with checks.check("values"):
        assert torch.allclose(values, reference, atol=1e-5, rtol=0)


def test_sequence_parallel_values_equal_one_process(two_ranks):
    failures = two_ranks["values"]
    assert not failures, "\n".join(failures)


def test_kv_repeats_give_each_rank_whole_heads():
    assert ulysses.kv_repeats(2, 2) == 1 and ulysses.kv_repeats(1, 2) == 2 and ulysses.kv_repeats(2, 4) == 2
    assert ulysses.kv_repeats(3, 2) == 2 and ulysses.kv_repeats(4, 8) == 2
    for kv, size in ((1, 2), (2, 4), (3, 2), (4, 8), (6, 4)):
        assert kv * ulysses.kv_repeats(kv, size) % size == 0


def _vision_case(rank: int, checks, path: str) -> None:
    """A vision-language model: each rank runs the vision tower and the embeddings on the whole row, its
    language model on its slice; log-probs and every gradient (vision tower included) equal one process."""
    import torch.distributed as dist
    from test_vision import image_batch
    from transformers import AutoModelForImageTextToText

    from hyflow.models.packing import packed_response_logprobs
    from hyflow.models.vision import VisionProcessor

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    ids, mask, pos, R_, images, image_mask = image_batch(VisionProcessor.from_pretrained(path))

    def run():
        model.zero_grad()
        logp, _ = packed_response_logprobs(model, ids, mask, R_, position_ids=pos, images=images,
                                           image_mask=image_mask)
        weights = torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)
        (logp * weights * mask[:, -R_:]).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference, reference_grads = run()
    group = dist.new_group([0, 1])
    with ulysses.sequence_parallel(group):
        logp, grads = run()
    real = mask[:, -R_:].bool()
    with checks.check("log-probs"):
        assert torch.allclose(logp[real], reference[real], atol=1e-5, rtol=0), (logp - reference).abs().max()
    with checks.check("gradients of every parameter"):
        assert any(name.startswith("model.visual.") for name in grads) and set(grads) == set(reference_grads)
    for grad in grads.values():
        dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=group)
    with checks.check("gradients"):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], atol=2e-5, rtol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("preset", VISION_PRESETS)
def test_sequence_parallel_vision_language_model_equals_one_process(two_ranks, preset):
    failures = two_ranks[f"vision-language model {preset}"]
    assert not failures, "\n".join(failures)
