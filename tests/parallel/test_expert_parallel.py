"""Expert parallelism and hybrid sharding (`hyflow.parallel.expert`, `ParallelDims.dp_replicate`) against one process.

Each case builds a `TrainEngine` on gloo ranks and the same engine in one process, gives each rank its contiguous
share of 8 rows (the controller's data-parallel split), and compares the log-probs of the shares, the global gradient
norm and the whole model after one SGD step (the loss -A log p has no clip, so no token sits on a boundary). Cases:

- 2 ranks, ep=2 (each rank holds 2 of 4 experts, tokens travel by all-to-all): Qwen3-MoE, Mixtral, DeepSeek-V3;
  the DCP and the full checkpoints of the ep=2 engine load into one process and one process's weights into an ep=2
  engine; Qwen3-MoE with gradient checkpointing too (the
  backward re-runs the layers' all-to-alls);
- 4 ranks: HSDP 2 x 2 (fsdp_size=2) on the dense tiny model; ep=2 x dp_shard=4 (two copies of each expert half,
  their gradients summed over the `edp` ranks); HSDP 2 x 2 with ep=2; Ulysses sp=2 x dp_shard=2 with ep=2 (the
  ranks of an ep group hold different slices of the same rows); tp=2 x dp_shard=2 with ep=2 and ep=4 (the MoE
  blocks whole on each tp rank, each sending half of the (token, choice) pairs).
"""

from __future__ import annotations

import types

import pytest
import torch
from engine_case import infer_and_update, rows_batch
from ranks import init_gloo, spawn_ranks

ROWS = 8
SIZES = types.SimpleNamespace(micro_batch_size_per_device=2, max_token_len_per_device=None, use_dynamic_bsz=False)


def _engine(path: str, world_size: int, ep: int = 1, fsdp_size: int = -1, checkpointing: bool = False, sp: int = 1,
            tp: int = 1):
    from hyflow.models.loading import load_causal_lm
    from hyflow.specs import FsdpSettings, OptimizerSpec, TrainEngineSpec
    from hyflow.workers.train_engine import TrainEngine

    spec = TrainEngineSpec(name="actor", head="lm", strategy="fsdp2", compute_dtype="fp32",
                           fsdp=FsdpSettings(fsdp_size=fsdp_size), use_remove_padding=True,
                           optim=OptimizerSpec(optimizer="SGD", lr=0.5, weight_decay=0.0), expert_parallel_size=ep,
                           ulysses_sequence_parallel_size=sp, tensor_parallel_size=tp)
    model = load_causal_lm(path, enable_gradient_checkpointing=checkpointing)
    return TrainEngine.from_spec(model, spec, device=torch.device("cpu"), world_size=world_size)


def _reference(path: str) -> dict:
    """The one-process engine's log-probs, grad norm and updated model (built before any group exists)."""
    one = _engine(path, 1)
    batch = rows_batch(one.module.config.vocab_size)
    before = {name: tensor.clone() for name, tensor in one.module.state_dict().items()}
    logp, metrics = infer_and_update(one, batch, SIZES)
    after = one.full_model_state()
    assert max(float((after[name] - before[name]).abs().max()) for name in after) > 1e-3  # the step moved it
    return {"batch": batch, "logp": logp, "grad_norm": metrics["actor/grad_norm"][0], "state": after}


def _check(rank: int, world: int, path: str, want: dict, *, ep: int, fsdp_size: int = -1,
           checkpointing: bool = False, sp: int = 1, tp: int = 1):
    split = _engine(path, world, ep=ep, fsdp_size=fsdp_size, checkpointing=checkpointing, sp=sp, tp=tp)
    layout = split.data_layout()
    # every rank data-parallel (its own share), or a sequence x tensor-parallel group's ranks on their group's share
    assert layout.dp_size == world // (sp * tp) and layout.dp_rank == rank // (sp * tp)
    share = ROWS // layout.dp_size
    own = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
    logp, metrics = infer_and_update(split, want["batch"][own], SIZES)
    where = f"{path.rsplit('/', 1)[-1]} ep={ep} fsdp_size={fsdp_size} sp={sp} tp={tp} rank {rank}"
    torch.testing.assert_close(logp, want["logp"][own], atol=1e-5, rtol=0, msg=lambda m: f"{where}: {m}")
    assert metrics["actor/grad_norm"][0] == pytest.approx(want["grad_norm"], rel=1e-5), where
    got = split.full_model_state()
    if rank == 0:
        assert set(got) == set(want["state"]), where
        for name, tensor in want["state"].items():
            torch.testing.assert_close(got[name], tensor, atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{where} {n}: {m}")
    return split


def _two_ranks(rank: int, init_file: str, paths: dict, ckpt: str) -> None:
    import torch.distributed as dist

    want = {name: _reference(path) for name, path in paths.items()}
    init_gloo(rank, 2, init_file)
    for name, path in paths.items():
        split = _check(rank, 2, path, want[name], ep=2)
        if name == "tiny-qwen3-moe":
            local = split.module.model.layers[0].mlp.experts.gate_up_proj.to_local()
            assert local.shape[0] == 2  # each rank holds 2 of the 4 experts
            split.save_sharded(ckpt)
            full = split.state_dict()  # the trainer's full checkpoint: model, optimizer, schedule on rank 0
            if rank == 0:
                torch.save(full, f"{ckpt}.full.pt")
            # and the reverse: the one-process weights loaded into an ep=2 engine (every rank gets them, as the
            # trainer's REPLICATE dispatch does)
            fresh = _engine(path, 2, ep=2)
            fresh.load_state_dict({"actor_model": {k: v.clone() for k, v in want[name]["state"].items()}},
                                  contents=("model",))
            again = fresh.full_model_state()
            for key, tensor in want[name]["state"].items() if rank == 0 else ():
                torch.testing.assert_close(again[key], tensor, atol=0, rtol=0)
            # gradient checkpointing re-runs each layer's forward, all-to-alls included, in the backward
            _check(rank, 2, path, want[name], ep=2, checkpointing=True)
    dist.destroy_process_group()
    if rank == 0:  # the ep=2 checkpoints in one process: the same model as the one-process update
        for load in ("sharded", "full"):
            one = _engine(paths["tiny-qwen3-moe"], 1)
            if load == "sharded":
                one.load_sharded(ckpt)
            else:
                one.load_state_dict(torch.load(f"{ckpt}.full.pt", weights_only=False))
            for name, tensor in want["tiny-qwen3-moe"]["state"].items():
                torch.testing.assert_close(one.module.state_dict()[name], tensor, atol=2e-6, rtol=1e-5)


def _four_ranks(rank: int, init_file: str, dense: str, moe: str) -> None:
    import torch.distributed as dist

    want_dense, want_moe = _reference(dense), _reference(moe)
    init_gloo(rank, 4, init_file)
    hsdp = _check(rank, 4, dense, want_dense, ep=1, fsdp_size=2)
    assert hsdp.mesh.root.mesh_dim_names == ("dp_replicate", "dp_shard")
    weight = hsdp.module.model.layers[0].mlp.up_proj.weight
    assert [type(p).__name__ for p in weight.placements] == ["Replicate", "Shard"]  # replicated x sharded
    split = _check(rank, 4, moe, want_moe, ep=2)  # ep=2 x dp_shard=4: two copies of each half of the experts
    assert split.mesh.expert.edp_group is not None
    _check(rank, 4, moe, want_moe, ep=2, fsdp_size=2)  # HSDP 2 x 2 with each replica's experts split in two
    _check(rank, 4, moe, want_moe, ep=2, sp=2)  # Ulysses sp=2 x dp_shard=2: an ep group is an sp group's ranks
    # tensor parallelism 2 x dp_shard 2 (attention split, MoE blocks whole): experts over a tp pair (ep=2) and over
    # all 4 ranks (ep=4, Megatron's layout with expert_tensor_parallel_size=1); each tp rank sends half the pairs
    _check(rank, 4, moe, want_moe, ep=2, tp=2)
    _check(rank, 4, moe, want_moe, ep=4, tp=2)
    dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned ranks, 3 MoE families
def test_expert_parallel_engines_match_one_process(moe_model_dirs, tmp_path):
    spawn_ranks(_two_ranks, args=(str(tmp_path / "init"), {k: str(v) for k, v in moe_model_dirs.items()},
                                  str(tmp_path / "ckpt")), nprocs=2, timeout_s=400)


@pytest.mark.slow  # 4 spawned ranks: about 2 min on 2 shared cores
def test_hybrid_sharding_and_expert_x_data_parallel_match_one_process(tiny_model_dir, moe_model_dirs, tmp_path):
    spawn_ranks(_four_ranks, args=(str(tmp_path / "init"), str(tiny_model_dir), str(moe_model_dirs["tiny-qwen3-moe"])),
                nprocs=4, timeout_s=500)
