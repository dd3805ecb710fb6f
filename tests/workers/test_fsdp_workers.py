"""Multi-rank workers (FSDP2 over 2 gloo ranks on CPU, spawned with torch.multiprocessing) against one process.

One module-scoped run does the expensive part once:
1. one process: the actor (PPO + KL loss + entropy bonus) and the critic update on the full 8-sample batch, then
   a 1-rank DCP checkpoint of both;
2. two spawned ranks, each holding its share of the same batch: the same updates under FSDP2 (and the actor under
   DDP, and with token-budget micro-batches), log-prob passes, the rollout weight sync, full state dicts, the HF
   export, a 2-rank DCP checkpoint, the 1-rank DCP checkpoint loaded back into 2 ranks, and `wrap_fsdp2` options.
Then the tests compare metrics, updated weights, rollout copies and checkpoints (tolerance 1e-5, relative for
metrics such as the gradient norm).

Global mini-batch k is the concatenation of every rank's local mini-batch k, so the one-process batch is built
in that order: rank r holds rows `SHARES[r]` of it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks

from hyflow.batch import Batch
from hyflow.config import load_config
from hyflow.config.roles import role_specs
from hyflow.controller.worker import free_port

P, R, N = 6, 5, 8
SHARES = ([0, 1, 4, 5], [2, 3, 6, 7])  # 2 mini-batches of 4 samples: rank r holds 2 samples of each
ATOL = 1e-5
SMALL_BUCKET = 64 << 10  # forces several weight-sync buckets for the 0.5 M-parameter model


# Adam's first step moves every weight by about lr x g / (|g| + eps): with torch's eps = 1e-8 a gradient entry
# whose true value is within rounding of zero (the sum of terms that cancel) moves by up to +-lr with the sign of
# its rounding error, which differs between one process and two ranks, between thread counts and between CPUs.
# A larger eps keeps Adam (moments, bias correction, state layout) while an update stays proportional to its
# gradient near zero, so rounding-sized gradient differences give rounding-sized weight differences.
ADAM_EPS = 1e-4


def make_config(model_dir: str, *extra: str):
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.shuffle=false",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.grad_clip=0.5",
        f"+actor_rollout_ref.actor.optim.override_optimizer_config.eps={ADAM_EPS}",
        "critic.ppo_micro_batch_size_per_gpu=1", "critic.optim.lr=1e-4",
        f"+critic.optim.override_optimizer_config.eps={ADAM_EPS}", *extra,
    ])


def make_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts ++ right-padded responses with masks and position ids (no log-probs yet)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (N, P), generator=gen)
    responses = torch.randint(3, vocab, (N, R), generator=gen)
    prompt_len = torch.tensor([6, 4, 5, 3, 6, 2, 4, 5])
    resp_len = torch.tensor([5, 3, 4, 5, 1, 2, 5, 4])
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    response_mask = (torch.arange(R) < resp_len[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
    }


# Every clip decision of the tests is far from its boundary, so none depends on how a CPU rounds: the rollout's
# log-ratios (clip 0.8-1.2, i.e. -0.22..0.18 in log-ratio) and value offsets |V − V_old| (critic.cliprange_value
# 0.5) sit at fixed offsets from the models' own first predictions, some well inside the clip range and some
# well outside, farther than the updates move them (test_no_token_sits_near_a_clip_boundary checks it).
LOG_RATIO_OFFSETS = (0.0, 0.05, -0.6, -0.04, 0.7, 0.02, -0.8)
VALUE_OFFSETS = (0.0, 0.1, -1.0, -0.1, 1.5, 1.1)
CLIP_MARGIN = 0.02  # the least distance to a clip boundary required of the reference run (rounding is ~1e-6)


def _offsets(values: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(values).repeat(N * R // len(values) + 1)[: N * R].view(N, R)


def add_training_columns(columns: dict[str, torch.Tensor], old_log_probs: torch.Tensor,
                         critic_values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rollout log-probs and values at the offsets above from the models' own, a reference, advantages and
    returns."""
    gen = torch.Generator().manual_seed(1)
    mask = columns["response_mask"].float()
    noise = lambda scale: scale * torch.randn(N, R, generator=gen)  # noqa: E731
    return {**columns, "old_log_probs": (old_log_probs - _offsets(LOG_RATIO_OFFSETS)) * mask,
            "ref_log_prob": (old_log_probs + noise(0.1)) * mask, "advantages": noise(1.0) * mask,
            "values": (critic_values + _offsets(VALUE_OFFSETS)) * mask, "returns": noise(1.0) * mask}


def clip_boundary_distances(columns: dict[str, torch.Tensor], log_probs: torch.Tensor,
                            vpreds: torch.Tensor) -> tuple[float, float]:
    """The least distance of any valid token to the PPO ratio clip (in log-ratio) and to the value clip."""
    mask = columns["response_mask"].bool()
    log_ratio = (log_probs - columns["old_log_probs"])[mask]
    bounds = torch.log(torch.tensor([0.8, 1.2]))
    ratio_distance = (log_ratio[:, None] - bounds).abs().min()
    value_distance = ((vpreds - columns["values"]).abs() - 0.5)[mask].abs().min()
    return float(ratio_distance), float(value_distance)


def share(columns: dict[str, torch.Tensor], rank: int) -> Batch:
    return Batch({k: v[SHARES[rank]] for k, v in columns.items()})


# ------------------------------------------------------------------------------------------------ fast, one process


class Block(torch.nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)


class ToyLM(torch.nn.Module):
    """GPT-2-like naming (`transformer.h`), an embedding and a head."""

    def __init__(self, tie_into_layer: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.transformer = torch.nn.Module()
        self.transformer.h = torch.nn.ModuleList([Block(), Block()])
        self.extras = torch.nn.ModuleList([torch.nn.Linear(4, 1)])  # a smaller list of blocks
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)
        if tie_into_layer:
            self.transformer.h[1].proj.weight = self.transformer.h[0].proj.weight


def test_decoder_layers_hf_and_generic(tiny_model_dir):
    from hyflow.models.loading import load_causal_lm
    from hyflow.parallel.fsdp import decoder_layers

    model = load_causal_lm(tiny_model_dir)
    assert decoder_layers(model) == list(model.model.layers)
    toy = ToyLM()
    assert decoder_layers(toy) == list(toy.transformer.h)
    assert decoder_layers(torch.nn.Linear(2, 2)) == []


def test_weight_tied_into_a_layer_is_refused():
    from hyflow.parallel.fsdp import check_shard_groups

    toy = ToyLM()
    check_shard_groups(toy, list(toy.transformer.h))  # nothing shared
    tied = ToyLM(tie_into_layer=True)
    with pytest.raises(ValueError, match=r"'transformer.h.\d.proj.weight' is shared with decoder layer "
                                         r"'transformer.h.\d'.*would untie it"):
        check_shard_groups(tied, list(tied.transformer.h))


def test_wrap_fsdp2_needs_a_process_group():
    from hyflow.parallel.fsdp import wrap_fsdp2

    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        wrap_fsdp2(ToyLM(), mixed_precision=None)


def test_mixed_precision_policy_and_strategy():
    from hyflow.parallel.fsdp import mixed_precision_policy
    from hyflow.workers.fsdp import parallel_strategy

    bf16 = mixed_precision_policy("bfloat16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy("fp32").param_dtype is None
    assert mixed_precision_policy(None).param_dtype is None
    with pytest.raises(ValueError, match=r"fsdp_config.dtype='int8' is not a mixed-precision dtype"):
        mixed_precision_policy("int8")
    assert [parallel_strategy(s, 1) for s in ("fsdp", "ddp")] == ["single", "single"]
    assert [parallel_strategy(s, 2) for s in ("fsdp", "fsdp2", "ddp")] == ["fsdp2", "fsdp2", "ddp"]
    # verl's other engines run on FSDP2 (hyflow.config.engine_compat)
    assert {parallel_strategy(s, 2) for s in ("megatron", "veomni", "torchtitan")} == {"fsdp2"}
    with pytest.raises(ValueError, match="strategy='deepspeed' is not supported for 2 ranks"):
        parallel_strategy("deepspeed", 2)


def test_full_tensor_buckets_are_bounded_and_cover_every_tensor_once():
    from hyflow.workers.fsdp import full_tensor_buckets

    toy = ToyLM()
    buckets = list(full_tensor_buckets(toy, bucket_bytes=80))
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == [n for n, _ in toy.named_parameters()] + ["scale"]  # no non-persistent buffer
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes) <= 80 or len(bucket) == 1  # embed (160 bytes) is a bucket alone
    assert len(buckets) > 2
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        list(full_tensor_buckets(toy, bucket_bytes=0))


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def test_positional_optimizer_state_loads_by_name():
    from hyflow.workers.fsdp import load_full_optimizer_state_dict, optimizer_state_by_name

    _, optimizer = _trained()
    fresh, fresh_opt = _trained(seed=1)
    load_full_optimizer_state_dict(fresh, fresh_opt, optimizer.state_dict())  # a pre-FSDP checkpoint
    for p, q in zip(optimizer.param_groups[0]["params"], fresh_opt.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(fresh_opt.state[q]["exp_avg"], optimizer.state[p]["exp_avg"], atol=0, rtol=0)
    assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)  # kept a tuple
    bigger = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="optimizer state has 4 parameters, the optimizer 6"):
        optimizer_state_by_name(bigger, torch.optim.AdamW(bigger.parameters()), optimizer.state_dict())


def test_sharded_round_trip_in_one_process(tmp_path):
    from hyflow.workers.fsdp import full_optimizer_state_dict, load_sharded, save_sharded

    model, optimizer = _trained()
    save_sharded(model, optimizer, tmp_path / "ckpt", extra={"scheduler": {"last_epoch": 3}})
    fresh, fresh_opt = _trained(seed=1)
    assert load_sharded(fresh, fresh_opt, tmp_path / "ckpt") == {"scheduler": {"last_epoch": 3}}
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=0, rtol=0, msg=name)
    want, got = full_optimizer_state_dict(model, optimizer), full_optimizer_state_dict(fresh, fresh_opt)
    for name, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][name][key], value, atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="is not a sharded checkpoint directory"):
        load_sharded(fresh, fresh_opt, tmp_path / "missing")


@pytest.mark.parametrize("save", ["full", "sharded"])
def test_a_checkpoint_before_the_first_step_does_not_change_training(save, tmp_path):
    """torch's get_optimizer_state_dict steps an unstepped optimizer with zero gradients (Adam's step count 1);
    the save functions must not, or saving before the first update changes the run (and its resume)."""
    from hyflow.workers.fsdp import (
        full_optimizer_state_dict,
        load_full_optimizer_state_dict,
        load_sharded,
        save_sharded,
    )

    def train(save_first: bool, restore: bool = False):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        if save_first and save == "full":
            state = full_optimizer_state_dict(model, optimizer)
            assert state == {}
            if restore:
                load_full_optimizer_state_dict(model, optimizer, state)
        elif save_first:
            save_sharded(model, optimizer, tmp_path / f"dcp_{restore}")
            if restore:
                load_sharded(model, optimizer, tmp_path / f"dcp_{restore}")
        assert not optimizer.state
        model(torch.ones(3, 4)).square().sum().backward()
        optimizer.step()
        return model.weight.detach().clone(), optimizer.state_dict()["state"][0]["step"]

    plain, step = train(save_first=False)
    assert step == 1
    for restore in (False, True):
        weights, step = train(save_first=True, restore=restore)
        assert step == 1
        torch.testing.assert_close(weights, plain, atol=0, rtol=0)


def test_sharded_merge_reads_only_the_model_whole(tmp_path):
    from hyflow.workers.fsdp import read_sharded_model_state, save_sharded, sharded_checkpoint_problem

    model, optimizer = _trained()
    save_sharded(model, optimizer, tmp_path / "ckpt")
    assert sharded_checkpoint_problem(tmp_path / "ckpt") is None
    merged = read_sharded_model_state(tmp_path / "ckpt")
    assert list(merged) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(merged[name], tensor, atol=0, rtol=0, msg=name)


def test_sharded_checkpoint_problems_name_the_shard(tmp_path):
    from hyflow.workers.fsdp import (
        load_sharded,
        read_sharded_model_state,
        save_sharded,
        sharded_checkpoint_problem,
    )

    model, optimizer = _trained()
    save_sharded(model, optimizer, tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert "shard file __0_0.distcp" in sharded_checkpoint_problem(tmp_path / "ckpt")
    assert "truncated" in sharded_checkpoint_problem(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="truncated"):
        load_sharded(model, optimizer, tmp_path / "ckpt")
    shard.unlink()
    assert "shard file __0_0.distcp is missing" in sharded_checkpoint_problem(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"not a pickle")
    assert "unreadable .metadata" in sharded_checkpoint_problem(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="unreadable .metadata"):
        read_sharded_model_state(tmp_path / "ckpt")


def test_sharded_checkpoint_without_optimizer_leaves_the_optimizer(tmp_path):
    from hyflow.workers.fsdp import full_optimizer_state_dict, load_sharded, save_sharded

    model, _ = _trained()
    save_sharded(model, None, tmp_path / "ckpt")
    fresh, fresh_opt = _trained(seed=1)
    before = full_optimizer_state_dict(fresh, fresh_opt)
    load_sharded(fresh, fresh_opt, tmp_path / "ckpt")
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=0, rtol=0, msg=name)
    after = full_optimizer_state_dict(fresh, fresh_opt)
    for name, state in before["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(after["state"][name][key], value, atol=0, rtol=0)


def test_dynamic_micro_batches_split_up_to_a_count():
    from hyflow.workers.engine import split_micro_batches, sync_micro_batch_count

    mask = torch.tensor([[1] * 8, [1] * 2 + [0] * 6, [1] * 3 + [0] * 5, [1] * 1 + [0] * 7])
    batch = Batch({"attention_mask": mask, "x": torch.arange(4)})
    packed = split_micro_batches(batch, micro_batch_size=None, use_dynamic_bsz=True, max_token_len=8)
    assert len(packed) == 2
    for target in (3, 4):
        micros = split_micro_batches(batch, micro_batch_size=None, use_dynamic_bsz=True, max_token_len=8,
                                     min_micro_batches=target)
        assert len(micros) == target
        assert sorted(torch.cat([rows for _, rows in micros]).tolist()) == [0, 1, 2, 3]
        assert all(int(m["attention_mask"].sum()) <= 8 for m, _ in micros)
    with pytest.raises(ValueError, match="cannot cut 4 samples into 5 micro-batches"):
        split_micro_batches(batch, micro_batch_size=None, use_dynamic_bsz=True, max_token_len=8,
                            min_micro_batches=5)
    same = sync_micro_batch_count(batch, micro_batch_size=None, use_dynamic_bsz=True, max_token_len=8)
    assert [rows.tolist() for _, rows in same] == [rows.tolist() for _, rows in packed]  # one process: as packed


def test_token_budget_keeps_a_prompts_samples_together_when_they_share_it():
    """With prompt sharing the budget counts a prompt once for its samples, and they stay in one micro-batch
    unless together they exceed the budget; without it, rows are placed one by one, longest first."""
    from hyflow.models.packing import pack_sequences
    from hyflow.workers.engine import split_micro_batches

    P_W, R_W = 6, 4
    prompt_len = [6, 6, 6, 6, 2, 2, 2, 2]            # prompt a (rows 0-3), prompt b (rows 4-7)
    resp_len = [4, 1, 3, 2, 4, 4, 1, 1]
    ids = torch.zeros(8, P_W + R_W, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(prompt_len, resp_len, strict=True)):
        ids[row, :P_W] = 5 if row < 4 else 6
        mask[row, P_W - p : P_W + r] = 1
    ids = ids * mask
    batch = Batch({"input_ids": ids, "attention_mask": mask, "responses": ids[:, P_W:]})
    shared = split_micro_batches(batch, micro_batch_size=None, use_dynamic_bsz=True, max_token_len=16,
                                 share_prompts=True)
    groups = [sorted(rows.tolist()) for _, rows in shared]
    assert sorted(groups) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 6 + 10 and 2 + 10 packed tokens
    for micro, _ in shared:
        packed = pack_sequences(micro["input_ids"], micro["attention_mask"], share_prefix_width=P_W)
        assert packed.num_tokens <= 16
    # a group over the budget is cut into items that fit (here: 6+4+1+3 = 14, then 6+2)
    cut = split_micro_batches(batch, micro_batch_size=None, use_dynamic_bsz=True, max_token_len=14,
                              share_prompts=True)
    assert all(pack_sequences(m["input_ids"], m["attention_mask"], share_prefix_width=P_W).num_tokens <= 14
               for m, _ in cut)
    plain = split_micro_batches(batch, micro_batch_size=None, use_dynamic_bsz=True, max_token_len=16)
    assert all(int(m["attention_mask"].sum()) <= 16 for m, _ in plain) and len(plain) > len(shared)


def test_clip_grad_norm_matches_torch():
    from hyflow.workers.engine import all_reduce_metrics, clip_grad_norm

    model, _ = _trained()
    model(torch.randn(2, 3)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    clipped = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    got = clip_grad_norm(list(model.parameters()), 0.1)
    assert float(got) == float(want) > 0.1
    for p, c in zip(model.parameters(), clipped, strict=True):
        torch.testing.assert_close(p.grad, c, atol=0, rtol=0)
    assert all_reduce_metrics({"a": 1.5, "b_min": -1.0}) == {"a": 1.5, "b_min": -1.0}  # one process: unchanged


def test_merge_metric_sums_but_keeps_the_least_and_greatest_of_min_and_max_names():
    from hyflow.workers.engine import merge_metric

    def merged(name, values):
        total = None
        for value in values:
            total = merge_metric(name, total, value)
        return total

    assert merged("actor/pg_loss", [0.5, 0.25, -1.0]) == -0.25
    assert merged("distillation/loss_min", [0.5, float("inf"), -1.0, 2.0]) == -1.0  # inf: a micro-batch of no token
    assert merged("distillation/loss_max", [0.5, float("-inf"), 2.0, -1.0]) == 2.0
    assert merged("x_maximal", [1.0, 2.0]) == 3.0


# ------------------------------------------------------------------------------------------------ spawned ranks


def _rank_main(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    """One rank: FSDP2 actor/critic updates on its share, sync, state dicts, DCP save/load; writes rank<r>.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from hyflow.workers.fsdp import is_fsdp2, iter_full_tensors

    out = Path(out)
    columns = torch.load(out / "batch.pt")
    batch = share(columns, rank)
    cfg = make_config(model_dir)
    result = {}

    actor = actor_worker(cfg, rank=rank, world_size=world_size)
    actor.init_process_group("gloo", timeout_s=120.0)  # a mismatched collective fails the test, not hangs it
    init_for_test(actor)
    actor.weight_bucket_bytes = SMALL_BUCKET
    result["ref_log_prob"] = actor.compute_ref_log_prob(batch)["ref_log_prob"]
    result["actor_is_fsdp2"] = is_fsdp2(actor.model) and is_fsdp2(actor.ref.model)
    result["tied"] = actor.model.lm_head.weight is actor.model.model.embed_tokens.weight
    result["actor_metrics"] = actor.update_actor(batch).meta["metrics"]
    result["sync_seconds"] = actor.sync_rollout_weights()
    result["rollout"] = {k: v.clone() for k, v in actor.rollout.model.state_dict().items()}
    rollout_state = actor.rollout.model.state_dict()
    result["rollout_matches_shards"] = all(  # every rank, against its own gather of the shards
        torch.equal(tensor, rollout_state[name]) for name, tensor in iter_full_tensors(actor.model))
    log_probs = actor.compute_log_prob(batch, with_sum_pi_squared=True)
    result["log_probs"], result["sum_pi_squared"] = log_probs["old_log_probs"], log_probs["sum_pi_squared"]
    result["actor_state"] = actor.state_dict()
    hf = actor.hf_model()
    result["hf_model"] = None if hf is None else {k: v.clone() for k, v in hf[0].state_dict().items()}
    actor.save_sharded_checkpoint(str(out / "dcp_actor_2"))

    critic = critic_worker(cfg, rank=rank, world_size=world_size)
    init_for_test(critic)
    result["critic_metrics"] = critic.update_critic(batch).meta["metrics"]
    result["critic_state"] = critic.state_dict()
    critic.save_sharded_checkpoint(str(out / "dcp_critic_2"))

    fresh = actor_worker(cfg, rank=rank, world_size=world_size)
    init_for_test(fresh)
    fresh.load_sharded_checkpoint(str(out / "dcp_actor_1"))
    result["dcp_1_to_2_actor"] = fresh.state_dict()
    result["dcp_1_to_2_rollout"] = {k: v.clone() for k, v in fresh.rollout.model.state_dict().items()}
    fresh_critic = critic_worker(cfg, rank=rank, world_size=world_size)
    init_for_test(fresh_critic)
    fresh_critic.load_sharded_checkpoint(str(out / "dcp_critic_1"))
    result["dcp_1_to_2_critic"] = fresh_critic.state_dict()

    ddp = actor_worker(make_config(model_dir, "actor_rollout_ref.actor.strategy=ddp"), rank=rank,
                                world_size=world_size)
    init_for_test(ddp)
    result["ddp_metrics"] = ddp.update_actor(batch).meta["metrics"]
    result["ddp_state"] = ddp.state_dict()

    # Token-budget micro-batches: the ranks pack their second mini-batch into 1 and 2 micro-batches.
    dynamic = actor_worker(make_config(model_dir, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16"),
                                    rank=rank, world_size=world_size)
    init_for_test(dynamic)
    result["dynamic_metrics"] = dynamic.update_actor(batch).meta["metrics"]
    result["dynamic_state"] = dynamic.state_dict()
    result["wrap_options"] = _wrap_options(model_dir, batch)
    from hyflow.workers.engine import all_reduce_metrics

    # sums, minima and maxima over the ranks in one call (distillation/loss_min|max)
    result["reduced"] = all_reduce_metrics({"s": rank + 1.0, "x_min": [-2.0, 3.0][rank], "x_max": [-2.0, 3.0][rank],
                                            "y_min": [5.0, 4.0][rank], "y/max": [5.0, 4.0][rank]})
    torch.save(result, out / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _wrap_options(model_dir: str, batch: Batch) -> dict:
    """Gradients with activation checkpointing equal those without; bf16 mixed precision computes in bf16 and
    keeps fp32 shards and gradients."""
    from hyflow.models.forward import response_logprobs
    from hyflow.models.loading import load_causal_lm
    from hyflow.parallel.fsdp import wrap_fsdp2

    def grads(**options):
        model = wrap_fsdp2(load_causal_lm(model_dir), **options)
        seen = []
        handle = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
            lambda module, _: seen.append(module.weight.dtype))
        logp, _ = response_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], R)
        (logp * batch["response_mask"]).sum().backward()
        handle.remove()
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}, seen[0], model

    plain, _, _ = grads(mixed_precision=None)
    checkpointed, _, _ = grads(mixed_precision=None, activation_checkpointing=True)
    bf16, compute_dtype, model = grads(mixed_precision="bf16")
    return {
        "checkpointed_max_diff": max(float((checkpointed[n] - g).abs().max()) for n, g in plain.items()),
        "bf16_compute_dtype": compute_dtype,
        "bf16_master_dtypes": {p.dtype for p in model.parameters()} | {g.dtype for g in bf16.values()},
        "bf16_max_rel_diff": max(float((bf16[n] - g).norm() / g.norm().clamp(min=1e-12)) for n, g in plain.items()),
    }


def _timeout_main(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    """Rank 0 syncs the rollout weights; rank 1 never joins: rank 0 must raise within the short timeout."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)

    worker = actor_worker(make_config(model_dir), rank=rank, world_size=world_size)
    worker.init_process_group("gloo", timeout_s=3.0)
    init_for_test(worker)
    if rank == 1:
        time.sleep(8.0)
        return
    start = time.perf_counter()
    try:
        worker.sync_rollout_weights()
        outcome = "returned"
    except RuntimeError as err:
        outcome = str(err)
    torch.save({"outcome": outcome, "seconds": time.perf_counter() - start}, Path(out) / "timeout.pt")


# ------------------------------------------------------------------------------------------------ the run


@pytest.fixture(scope="module")
def run(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    """Reference (one process) and 2-rank results."""

    out = tmp_path_factory.mktemp("fsdp_run")
    cfg = make_config(str(tiny_model_dir))
    torch.set_num_threads(2)
    columns = make_batch(len(tiny_tokenizer))
    actor = actor_worker(cfg)
    init_for_test(actor)
    old = actor.compute_log_prob(Batch(columns))["old_log_probs"]
    critic = critic_worker(cfg)
    init_for_test(critic)
    columns = add_training_columns(columns, old, critic.compute_values(Batch(columns))["values"])
    torch.save(columns, out / "batch.pt")
    distances = {"before": clip_boundary_distances(columns, old, critic.compute_values(Batch(columns))["values"])}

    ref = {"actor_metrics": actor.update_actor(Batch(columns)).meta["metrics"]}
    ref["actor_state"] = actor.state_dict()
    log_probs = actor.compute_log_prob(Batch(columns), with_sum_pi_squared=True)
    ref["log_probs"], ref["sum_pi_squared"] = log_probs["old_log_probs"], log_probs["sum_pi_squared"]
    ref["ref_log_prob"] = actor.compute_ref_log_prob(Batch(columns))["ref_log_prob"]
    actor.save_sharded_checkpoint(str(out / "dcp_actor_1"))
    ref["critic_initial_model"] = {k: v.clone() for k, v in critic.state_dict()["critic_model"].items()}
    ref["critic_metrics"] = critic.update_critic(Batch(columns)).meta["metrics"]
    ref["critic_state"] = critic.state_dict()
    distances["after"] = clip_boundary_distances(columns, ref["log_probs"],
                                                 critic.compute_values(Batch(columns))["values"])
    ref["clip_boundary_distances"] = distances
    critic.save_sharded_checkpoint(str(out / "dcp_critic_1"))

    spawn_ranks(_rank_main, args=(2, free_port(), str(tiny_model_dir), str(out)))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"ref": ref, "ranks": ranks, "out": out, "cfg": cfg, "columns": columns}


def assert_state_close(got: dict, want: dict, atol: float = ATOL) -> None:
    assert set(got) == set(want)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def assert_optimizer_close(got: dict, want: dict) -> None:
    for g, w in zip(got["param_groups"], want["param_groups"], strict=True):
        assert {k: v for k, v in g.items() if g[k] != w.get(k)} == {}, {k: w.get(k) for k in g}
    assert set(got["state"]) == set(want["state"])
    for name, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][name][key], value, atol=ATOL, rtol=0, msg=f"{name}.{key}")


def assert_metrics_equal(got: dict, want: dict, names) -> None:
    for name in names:
        assert got[name] == pytest.approx(want[name], rel=ATOL, abs=ATOL), name


ACTOR_METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy_loss", "actor/pg_clipfrac",
                 "actor/ppo_kl", "actor/lr")


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.slow
def test_fsdp2_wraps_actor_and_ref_and_keeps_embeddings_tied(run):
    for rank in run["ranks"]:
        assert rank["actor_is_fsdp2"]
        assert rank["tied"]
    state = run["ranks"][0]["actor_state"]["actor_model"]
    torch.testing.assert_close(state["lm_head.weight"], state["model.embed_tokens.weight"], atol=0, rtol=0)


@pytest.mark.slow
def test_metric_all_reduce_sums_but_takes_the_extremes_of_min_and_max_names(run):
    for rank in run["ranks"]:
        assert rank["reduced"] == {"s": 3.0, "x_min": -2.0, "x_max": 3.0, "y_min": 4.0, "y/max": 5.0}


@pytest.mark.slow
def test_activation_checkpointing_and_bf16_mixed_precision(run):
    for rank in run["ranks"]:
        options = rank["wrap_options"]
        assert options["checkpointed_max_diff"] < 1e-6
        assert options["bf16_compute_dtype"] == torch.bfloat16
        assert options["bf16_master_dtypes"] == {torch.float32}
        assert options["bf16_max_rel_diff"] < 0.05  # bf16 rounding, not a different gradient


@pytest.mark.slow
def test_actor_update_on_two_ranks_matches_one_process(run):
    """Same metrics on every rank (all-reduced in the worker) as one process, and the same updated weights."""
    want = run["ref"]["actor_metrics"]
    assert len(want["actor/pg_loss"]) == 2  # two optimizer steps
    assert all(0 < fraction < 1 for fraction in want["actor/pg_clipfrac"])  # the PPO clip really acts
    for rank in run["ranks"]:
        assert_metrics_equal(rank["actor_metrics"], want, ACTOR_METRICS)
    assert want["actor/grad_norm"][0] > 0.5  # grad_clip=0.5 was active: the clipped update matches too
    assert run["ranks"][1]["actor_state"] == {}  # only rank 0 returns the components
    got = run["ranks"][0]["actor_state"]
    assert_state_close(got["actor_model"], run["ref"]["actor_state"]["actor_model"])
    assert_optimizer_close(got["actor_optimizer"], run["ref"]["actor_state"]["actor_optimizer"])
    assert got["actor_scheduler"] == run["ref"]["actor_state"]["actor_scheduler"]


@pytest.mark.slow
def test_hf_model_gathers_the_full_policy_on_rank_zero(run):
    assert run["ranks"][1]["hf_model"] is None
    assert_state_close(run["ranks"][0]["hf_model"], run["ref"]["actor_state"]["actor_model"])


@pytest.mark.slow
def test_actor_update_under_ddp_matches_one_process(run):
    for rank in run["ranks"]:
        assert_metrics_equal(rank["ddp_metrics"], run["ref"]["actor_metrics"], ACTOR_METRICS)
    assert_state_close(run["ranks"][0]["ddp_state"]["actor_model"], run["ref"]["actor_state"]["actor_model"])


@pytest.mark.slow
def test_dynamic_micro_batch_counts_are_synchronised_across_ranks(run):
    from hyflow.workers.engine import split_micro_batches

    columns = run["columns"]
    counts = [len(split_micro_batches(share(columns, rank)[2:], micro_batch_size=None, use_dynamic_bsz=True,
                                      max_token_len=16)) for rank in range(2)]
    assert counts == [1, 2]  # unsynchronised, the ranks would run different numbers of FSDP forwards
    for rank in run["ranks"]:
        assert_metrics_equal(rank["dynamic_metrics"], run["ref"]["actor_metrics"], ACTOR_METRICS)
    assert_state_close(run["ranks"][0]["dynamic_state"]["actor_model"], run["ref"]["actor_state"]["actor_model"])


@pytest.mark.slow
def test_log_prob_passes_on_two_ranks_match_one_process(run):
    """compute_ref_log_prob (sharded reference), compute_log_prob with sum_pi_squared (lm_head after the root
    forward) on each rank's share equal the one-process values."""
    for key in ("ref_log_prob", "log_probs", "sum_pi_squared"):
        two_rank = torch.empty_like(run["ref"][key])
        for rank, result in enumerate(run["ranks"]):
            two_rank[SHARES[rank]] = result[key]
        torch.testing.assert_close(two_rank, run["ref"][key], atol=ATOL, rtol=0, msg=key)


@pytest.mark.slow
def test_no_token_sits_near_a_clip_boundary(run):
    """The premise of the equality tests: before and after the one-process update (the second mini-batch decides
    between the two) every token's PPO ratio and value prediction are at least CLIP_MARGIN from a clip boundary,
    so rounding cannot flip a clip decision."""
    for when, (ratio_distance, value_distance) in run["ref"]["clip_boundary_distances"].items():
        assert ratio_distance > CLIP_MARGIN, (when, ratio_distance, value_distance)
        assert value_distance > CLIP_MARGIN, (when, ratio_distance, value_distance)


@pytest.mark.slow
def test_critic_update_on_two_ranks_matches_one_process(run):
    want = run["ref"]["critic_metrics"]
    assert all(0 < fraction < 1 for fraction in want["critic/vf_clipfrac"])  # the value clip really acts
    initial = run["ref"]["critic_initial_model"]
    moved = max(float((run["ref"]["critic_state"]["critic_model"][k] - v).abs().max()) for k, v in initial.items())
    assert moved > 10 * ATOL  # a real update, far larger than the tolerance of the comparison below
    for rank in run["ranks"]:
        assert_metrics_equal(rank["critic_metrics"], want, ("critic/vf_loss", "critic/grad_norm",
                                                            "critic/vf_clipfrac", "critic/vpred_mean"))
    got = run["ranks"][0]["critic_state"]
    assert_state_close(got["critic_model"], run["ref"]["critic_state"]["critic_model"])
    assert_optimizer_close(got["critic_optimizer"], run["ref"]["critic_state"]["critic_optimizer"])


@pytest.mark.slow
def test_rollout_copy_on_every_rank_holds_the_updated_weights(run):
    want = run["ref"]["actor_state"]["actor_model"]
    for rank in run["ranks"]:
        assert rank["rollout_matches_shards"]
        assert rank["sync_seconds"] > 0
        assert_state_close(rank["rollout"], want)


@pytest.mark.slow
def test_full_state_dict_from_two_ranks_gives_identical_log_probs_in_one(run):

    worker = actor_worker(run["cfg"])
    init_for_test(worker)
    worker.load_state_dict(run["ranks"][0]["actor_state"])
    columns = run["columns"]
    got = worker.compute_log_prob(Batch(columns))["old_log_probs"]
    two_rank = torch.empty_like(got)
    for rank, result in enumerate(run["ranks"]):
        two_rank[SHARES[rank]] = result["log_probs"]
    torch.testing.assert_close(got, two_rank, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, run["ref"]["log_probs"], atol=ATOL, rtol=0)
    assert_optimizer_close(worker.state_dict()["actor_optimizer"], run["ref"]["actor_state"]["actor_optimizer"])


@pytest.mark.slow
def test_sharded_checkpoint_from_two_ranks_loads_into_one(run):

    actor = actor_worker(run["cfg"])
    init_for_test(actor)
    actor.load_sharded_checkpoint(str(run["out"] / "dcp_actor_2"))
    got = actor.state_dict()
    want = run["ref"]["actor_state"]
    assert_state_close(got["actor_model"], want["actor_model"])
    assert_optimizer_close(got["actor_optimizer"], want["actor_optimizer"])
    assert got["actor_scheduler"] == want["actor_scheduler"]
    from hyflow.workers.fsdp import read_sharded_model_state, sharded_checkpoint_problem, sharded_shard_files

    assert sharded_shard_files(run["out"] / "dcp_actor_2") == ["__0_0.distcp", "__1_0.distcp"]
    assert sharded_checkpoint_problem(run["out"] / "dcp_actor_2") is None
    assert_state_close(read_sharded_model_state(run["out"] / "dcp_actor_2"), got["actor_model"], atol=0)
    critic = critic_worker(run["cfg"])
    init_for_test(critic)
    critic.load_sharded_checkpoint(str(run["out"] / "dcp_critic_2"))
    assert_state_close(critic.state_dict()["critic_model"], run["ref"]["critic_state"]["critic_model"])


@pytest.mark.slow
def test_sharded_checkpoint_from_one_rank_loads_into_two(run):
    got = run["ranks"][0]["dcp_1_to_2_actor"]
    want = run["ref"]["actor_state"]
    assert_state_close(got["actor_model"], want["actor_model"], atol=0)
    assert_optimizer_close(got["actor_optimizer"], want["actor_optimizer"])
    assert got["actor_scheduler"] == want["actor_scheduler"]
    for rank in run["ranks"]:  # loading refreshed the rollout copies
        assert_state_close(rank["dcp_1_to_2_rollout"], want["actor_model"], atol=0)
    critic = run["ranks"][0]["dcp_1_to_2_critic"]
    assert_state_close(critic["critic_model"], run["ref"]["critic_state"]["critic_model"], atol=0)
    assert_optimizer_close(critic["critic_optimizer"], run["ref"]["critic_state"]["critic_optimizer"])


@pytest.mark.slow
def test_weight_sync_raises_when_a_rank_never_joins(tiny_model_dir, tmp_path):
    spawn_ranks(_timeout_main, args=(2, free_port(), str(tiny_model_dir), str(tmp_path)))
    result = torch.load(tmp_path / "timeout.pt")
    assert "every rank must call sync_rollout_weights together" in result["outcome"]
    assert result["seconds"] < 7.0


def actor_worker(cfg, *, rank: int = 0, world_size: int = 1):
    """The actor worker with the spec the trainer would give it (the world size as the devices, 1 step)."""
    from hyflow.workers.actor import ActorRolloutRefWorker

    return ActorRolloutRefWorker(role_specs(cfg, n_devices=world_size, total_steps=1).actor, rank=rank,
                                 world_size=world_size)


def critic_worker(cfg, *, rank: int = 0, world_size: int = 1):
    """The critic worker with the spec the trainer would give it (the world size as the devices, 1 step)."""
    from hyflow.workers.critic import CriticWorker

    return CriticWorker(role_specs(cfg, n_devices=world_size, total_steps=1).critic, rank=rank,
                        world_size=world_size)


def init_for_test(worker) -> None:
    """init_model: load the models the worker's spec describes."""
    worker.init_model()
