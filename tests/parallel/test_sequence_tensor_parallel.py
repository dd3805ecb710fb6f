"""Sequence x tensor parallelism in one role (a 2-D (sp, tp) mesh, `hyflow.parallel`): a `TrainEngine` on 4 gloo ranks
with ulysses_sequence_parallel_size=2 x tensor_parallel_size=2 (FSDP2 over the sp dimension, each layer split over tp,
each packed row cut over sp) computes the same log-probs and the same update as the engine in one process. The four
ranks share rows (the mesh's `sp_tp` group, data-parallel size 1): each reports data-parallel rank 0 of 1, so the
controller sends each the whole batch (`@register(..., mesh=...)`); ranks given different rows fail by name."""

from __future__ import annotations

import types

import pytest
import torch
from engine_case import infer_and_update, rows_batch
from ranks import init_gloo, spawn_ranks

from hyflow.controller.dispatch import DataLayout

SIZES = types.SimpleNamespace(micro_batch_size_per_device=3, max_token_len_per_device=None, use_dynamic_bsz=False)


def _engine(path: str, world_size: int):
    from hyflow.models.loading import load_causal_lm
    from hyflow.specs import FsdpSettings, OptimizerSpec, TrainEngineSpec
    from hyflow.workers.train_engine import TrainEngine

    spec = TrainEngineSpec(name="actor", head="lm", strategy="fsdp2", compute_dtype="fp32", fsdp=FsdpSettings(),
                           optim=OptimizerSpec(optimizer="SGD", lr=0.5, weight_decay=0.0), use_remove_padding=True,
                           ulysses_sequence_parallel_size=2 if world_size > 1 else 1,
                           tensor_parallel_size=2 if world_size > 1 else 1)
    return TrainEngine.from_spec(load_causal_lm(path), spec, device=torch.device("cpu"), world_size=world_size)


def _rank(rank: int, init_file: str, path: str) -> None:
    import torch.distributed as dist

    one = _engine(path, 1)  # the reference: the same engine alone, before the group exists (its sums are its own)
    batch = rows_batch(one.module.config.vocab_size)
    before = {name: tensor.clone() for name, tensor in one.module.state_dict().items()}
    want_logp, want_metrics = infer_and_update(one, batch, SIZES)
    want = one.full_model_state()
    init_gloo(rank, 4, init_file)
    split = _engine(path, 4)
    assert (split.dp_size, split.sp_size, split.tp_size, split.group_size, split.group_rank) == (1, 2, 2, 4, rank)
    assert split.mesh.root.mesh_dim_names == ("dp_shard", "sp", "tp")  # dp_shard of size 1: FSDP2 shards over sp
    assert split.data_layout() == DataLayout(dp_rank=0, dp_size=1, collects=rank == 0)
    logp, metrics = infer_and_update(split, batch, SIZES)  # the controller gives every rank the whole batch
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(metrics["actor/pg_loss"], want_metrics["actor/pg_loss"], atol=1e-6, rtol=1e-5)
    got = split.full_model_state()
    if rank == 0:  # the step moved the weights, and the same way in both
        assert max(float((want[name] - before[name]).abs().max()) for name in want) > 1e-3
        assert set(got) == set(want)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    own = slice(2 * rank, 2 * rank + 2)  # a split over all ranks (a method dispatched without the engine's mesh)
    with pytest.raises(RuntimeError, match=r"actor: the 4 ranks of a sequence x tensor-parallel group got different "
                                           r"rows.*mesh=<name>"):
        split.infer(batch[own], SIZES)
    dist.destroy_process_group()


@pytest.mark.slow  # 4 spawned ranks: about 2 min on 2 shared cores
def test_sequence_x_tensor_parallel_engine_matches_one_process(tiny_model_dir, tmp_path):
    spawn_ranks(_rank, args=(str(tmp_path / "init"), str(tiny_model_dir)), nprocs=4, timeout_s=400)
