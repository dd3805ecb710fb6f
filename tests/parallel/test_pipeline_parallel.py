"""Pipeline parallelism (`hyflow.parallel.pipeline`) against one process.

Each case builds a `TrainEngine` with `pipeline_parallel_size` on gloo ranks and the same engine in one process on a
4-layer tiny Qwen2, gives each data-parallel rank its contiguous share of 8 rows, and compares the log-probs (or a
critic's values), the loss, the global gradient norm (clipping at 1.0 is active: the norm is ~8) and the whole model
after one SGD step (the loss -A log p has no clip, so no token sits on a clip boundary). Cases:

- 2 ranks (pp=2): 1F1B on the tied-embedding model (its two copies' gradients summed), 1F1B with 2 virtual stages
  per rank (Interleaved1F1B), GPipe on the untied model, a critic's values and update; DCP checkpoints with SGD
  momentum state from one process into pp=2, and pp=2's DCP and full (gathered) checkpoints back into one process,
  each continuing as one process does (tied and untied); one process's full weights into pp=2;
- 4 ranks: pp=2 x dp_shard=2 and pp=2 x tp=2 (the dense model), pp=2 x ep=2 (a tied Qwen3-MoE, its router metrics
  too).
"""

from __future__ import annotations

import types

import pytest
import torch
from engine_case import infer_and_update, rows_batch
from ranks import init_gloo, spawn_ranks

ROWS = 8
SIZES = types.SimpleNamespace(micro_batch_size_per_device=2, max_token_len_per_device=None, use_dynamic_bsz=False)


# ------------------------------------------------------------------------------------------ no processes


def test_stage_layer_ranges_split_the_layers_evenly_first_stages_one_more():
    from hyflow.parallel.pipeline import rank_stages, stage_layer_ranges

    assert stage_layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert stage_layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert stage_layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="at least one decoder layer each.*has 2"):
        stage_layer_ranges(2, 4)
    assert rank_stages(1, 2, 2) == [1, 3]  # torch's looped placement: stage s on pp rank s mod pp
    assert rank_stages(0, 4, 1) == [0]


def test_schedule_names_and_their_refusals():
    from hyflow.parallel.pipeline import schedule_name

    assert schedule_name(None, 1) == "1F1B" and schedule_name(None, 2) == "Interleaved1F1B"
    assert schedule_name("GPipe", 1) == "GPipe"
    with pytest.raises(ValueError, match="use one of"):
        schedule_name("ZeroBubble", 1)
    with pytest.raises(ValueError, match="Interleaved1F1B runs several stages per rank"):
        schedule_name("1F1B", 2)
    with pytest.raises(ValueError, match="Interleaved1F1B runs several stages per rank"):
        schedule_name("Interleaved1F1B", 1)


def test_engine_dims_put_pipeline_stages_outermost_and_hsdp_inside_them():
    from hyflow.specs import FsdpSettings, TrainEngineSpec
    from hyflow.workers.train_engine import engine_dims

    def spec(**kwargs):
        return TrainEngineSpec(name="actor", head="lm", strategy="fsdp2", fsdp=FsdpSettings(**kwargs.pop("fsdp", {})),
                               compute_dtype="fp32", **kwargs)

    dims = engine_dims(spec(pipeline_parallel_size=2), 8)
    assert (dims.pp, dims.dp_shard, dims.dp_replicate) == (2, 4, 1)
    dims = engine_dims(spec(pipeline_parallel_size=2, fsdp={"fsdp_size": 2}), 8)  # 8 / (2 x pp 2) = 2 replicas
    assert (dims.pp, dims.dp_shard, dims.dp_replicate) == (2, 2, 2)
    dims = engine_dims(spec(pipeline_parallel_size=2, tensor_parallel_size=2), 8)
    assert (dims.pp, dims.tp, dims.dp_shard) == (2, 2, 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3.*must divide the role's 4 ranks"):
        engine_dims(spec(pipeline_parallel_size=3), 4)
    dims = engine_dims(spec(pipeline_parallel_size=2, expert_parallel_size=2), 4)  # ep within a stage's 2 ranks
    assert (dims.pp, dims.dp_shard, dims.ep) == (2, 2, 2)


def test_one_rank_refuses_virtual_stages_without_pipeline_stages():
    from hyflow.parallel import ParallelDims
    from hyflow.parallel.parallelize import apply_pp

    dims = ParallelDims(world_size=1)
    with pytest.raises(ValueError, match="virtual_pipeline_parallel_size=2 needs pipeline_parallel_size > 1"):
        apply_pp(torch.nn.Linear(2, 2), dims, dims.build_mesh(), virtual=2)


# ------------------------------------------------------------------------------------------ gloo ranks


@pytest.fixture(scope="module")
def four_layer_dirs(tiny_model_dir, tmp_path_factory):
    """The tiny model's config with 4 layers, tied (as the tiny preset) and untied embeddings, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for name, tied in (("tied", True), ("untied", False)):
        config = AutoConfig.from_pretrained(tiny_model_dir)
        config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
        config.tie_word_embeddings = tied
        torch.manual_seed(1)
        path = tmp_path_factory.mktemp(f"four_layers_{name}")
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        out[name] = str(path)
    return out


def _engine(path: str, world_size: int, *, pp: int = 1, virtual: int = 1, tp: int = 1, schedule: str | None = None,
            head: str = "lm", momentum: float = 0.0, ep: int = 1):
    from hyflow.models.loading import load_causal_lm, load_value_model
    from hyflow.specs import FsdpSettings, OptimizerSpec, TrainEngineSpec
    from hyflow.workers.train_engine import TrainEngine

    optim = OptimizerSpec(optimizer="SGD", lr=0.5, weight_decay=0.0, override_optimizer_config={"momentum": momentum})
    spec = TrainEngineSpec(name="actor" if head == "lm" else "critic", head=head, strategy="fsdp2",
                           compute_dtype="fp32", fsdp=FsdpSettings(), use_remove_padding=True, optim=optim,
                           grad_clip=1.0, pipeline_parallel_size=pp, virtual_pipeline_parallel_size=virtual,
                           pipeline_schedule=schedule, tensor_parallel_size=tp, expert_parallel_size=ep)
    torch.manual_seed(2)  # a critic's fresh value head: the same on every load
    model = load_causal_lm(path) if head == "lm" else load_value_model(path)
    return TrainEngine.from_spec(model, spec, device=torch.device("cpu"), world_size=world_size)


def _value_loss(out: dict, cols: dict, ctx) -> tuple[torch.Tensor, dict]:
    from hyflow.algos import agg_loss

    loss = agg_loss(0.5 * (out["values"] - cols["advantages"]) ** 2, cols["response_mask"], "token-mean", **ctx.norms)
    return loss, {"critic/vf_loss": float(loss.detach())}


def _pass(engine, batch):
    """(outputs, metrics) of infer + one update: log-probs and the pg loss, or a critic's values and its loss."""
    if engine.head == "lm":
        return infer_and_update(engine, batch, SIZES)
    from hyflow.workers.train_engine import UpdatePlan

    values = engine.infer(batch, SIZES)["values"]
    plan = UpdatePlan(mini_batch_size=len(batch), epochs=1, shuffle=False, seed=0, sizes=SIZES,
                      loss_agg_mode="token-mean", metric_prefix="critic")
    return values, engine.update(batch, plan, _value_loss, columns=("advantages", "response_mask"))


def _reference(path: str, head: str = "lm") -> dict:
    """The one-process engine's outputs, metrics and updated model (built before any group exists)."""
    one = _engine(path, 1, head=head)
    batch = rows_batch(one.module.config.vocab_size)
    out, metrics = _pass(one, batch)
    single = _pass(_engine(path, 1, head=head), batch[:1])  # one row: fewer micro-batches than stages
    return {"batch": batch, "out": out, "metrics": metrics, "state": one.full_model_state(), "single": single}


def _close_states(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: {sorted(set(got) ^ set(want))}"
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{where} {n}: {m}")


def _check(rank: int, world: int, path: str, want: dict, **kwargs):
    split = _engine(path, world, **kwargs)
    layout = split.data_layout()
    share = ROWS // layout.dp_size
    own = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
    out, metrics = _pass(split, want["batch"][own])
    where = f"{path.rsplit('/', 1)[-1]} {kwargs} rank {rank}"
    torch.testing.assert_close(out, want["out"][own], atol=1e-5, rtol=0, msg=lambda m: f"{where}: {m}")
    for key, value in want["metrics"].items():
        if key.endswith(("grad_norm", "pg_loss", "vf_loss")) or "/moe/" in key:  # a MoE model's router metrics
            assert metrics[key][0] == pytest.approx(value[0], rel=1e-5), f"{where} {key}"
    got = split.full_model_state()  # the export the rollout sync and save_pretrained take: every stage's tensors
    if rank == 0:
        _close_states(got, want["state"], where)
    return split


def _resume_reference(rank: int, path: str, directory: str) -> list[dict]:
    """One process with SGD momentum: one update, a DCP checkpoint (rank 0 writes it), then the models after a
    second and a third update (built before any group exists)."""
    one = _engine(path, 1, momentum=0.9)
    batch = rows_batch(one.module.config.vocab_size)
    infer_and_update(one, batch, SIZES)
    if rank == 0:
        one.save_sharded(f"{directory}/one")
    states = []
    for _ in range(2):
        infer_and_update(one, batch, SIZES)
        states.append(one.full_model_state())
    return states


def _resume(rank: int, path: str, directory: str, states: list[dict]) -> dict:
    """A pp=2 engine that loads the one-process checkpoint and updates matches one process's second update (the
    momentum state came along); it writes its own checkpoint after that update, DCP and full (returned: rank 0's)."""
    split = _engine(path, 2, pp=2, momentum=0.9)
    split.load_sharded(f"{directory}/one")
    infer_and_update(split, rows_batch(split.module.config.vocab_size), SIZES)
    got = split.full_model_state()
    split.save_sharded(f"{directory}/two")
    if rank == 0:
        _close_states(got, states[0], "one process -> pp=2")
    return split.state_dict()


def _two_ranks(rank: int, init_file: str, paths: dict, directory: str) -> None:
    import torch.distributed as dist

    want = {name: _reference(path) for name, path in paths.items()}
    critic = _reference(paths["untied"], head="value")
    resumed = {name: _resume_reference(rank, path, f"{directory}/{name}") for name, path in paths.items()}
    init_gloo(rank, 2, init_file)
    split = _check(rank, 2, paths["tied"], want["tied"], pp=2)
    assert [len(stage.layers) for stage in split.parallelized.pipeline.stages] == [2]
    # one row is one micro-batch, 1F1B needs two: an idle one (no real token, a zero loss) makes them up
    out, metrics = _pass(_engine(paths["tied"], 2, pp=2), want["tied"]["batch"][:1])
    torch.testing.assert_close(out, want["tied"]["single"][0], atol=1e-5, rtol=0)
    assert metrics["actor/grad_norm"][0] == pytest.approx(want["tied"]["single"][1]["actor/grad_norm"][0], rel=1e-5)
    assert (split.parallelized.pipeline.tied.module is not None) and split.data_layout().collects == (rank == 0)
    _check(rank, 2, paths["tied"], want["tied"], pp=2, virtual=2)  # Interleaved1F1B: stages 0, 2 | 1, 3
    _check(rank, 2, paths["untied"], want["untied"], pp=2, schedule="GPipe")
    _check(rank, 2, paths["untied"], critic, pp=2, head="value")
    # the full checkpoint (rank 0 gathers every stage's weights and optimizer state) and its load into pp=2
    full = split.state_dict()
    if rank == 0:
        _close_states(full["actor_model"], {**want["tied"]["state"], "lm_head.weight":
                                            want["tied"]["state"]["model.embed_tokens.weight"]}, "full state")
    fresh = _engine(paths["tied"], 2, pp=2)
    fresh.load_state_dict({"actor_model": {k: v.clone() for k, v in want["tied"]["state"].items()}}, contents=("model",))
    again = fresh.full_model_state()
    if rank == 0:
        _close_states(again, want["tied"]["state"], "one process's weights -> pp=2")
    full = {name: _resume(rank, path, f"{directory}/{name}", resumed[name]) for name, path in paths.items()}
    dist.destroy_process_group()
    if rank == 0:  # the pp=2 checkpoints (DCP, full) in one process
        for name, path in paths.items():
            for load in ("sharded", "full"):
                one = _engine(path, 1, momentum=0.9)
                if load == "sharded":
                    one.load_sharded(f"{directory}/{name}/two")
                else:
                    one.load_state_dict(full[name])
                where = f"{name} pp=2 -> one process ({load})"
                _close_states(one.full_model_state(), resumed[name][0], where)
                infer_and_update(one, rows_batch(one.module.config.vocab_size), SIZES)
                _close_states(one.full_model_state(), resumed[name][1], f"{where}, next update")


def _four_ranks(rank: int, init_file: str, path: str, moe: str) -> None:
    import torch.distributed as dist

    want, want_moe = _reference(path), _reference(moe)
    assert any("/moe/" in key for key in want_moe["metrics"])
    init_gloo(rank, 4, init_file)
    split = _check(rank, 4, path, want, pp=2)  # pp=2 x dp_shard=2
    assert split.mesh.root.mesh_dim_names == ("pp", "dp_shard") and split.dp_size == 2
    split = _check(rank, 4, path, want, pp=2, tp=2)  # pp=2 x tp=2 (dp_shard 1)
    assert split.mesh.root.mesh_dim_names == ("pp", "dp_shard", "tp")
    # a tied Qwen3-MoE, one layer per stage, its 4 experts split over the stage's 2 ranks (ep=2 x pp=2): the
    # all-to-alls run inside the stages, the expert gradients are averaged within a stage, the router metrics
    # are every stage's
    split = _check(rank, 4, moe, want_moe, pp=2, ep=2)
    assert split.mesh.expert.edp_group is None and split.module.model.layers["0" if rank < 2 else "1"] is not None
    dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned ranks
def test_pipeline_parallel_engines_match_one_process_and_resume_across_pp(four_layer_dirs, tmp_path):
    spawn_ranks(_two_ranks, args=(str(tmp_path / "init"), four_layer_dirs, str(tmp_path / "ckpt")), nprocs=2,
                timeout_s=500)


@pytest.mark.slow  # 4 spawned ranks
def test_pipeline_with_data_tensor_and_expert_parallel_matches_one_process(four_layer_dirs, moe_model_dirs, tmp_path):
    spawn_ranks(_four_ranks, args=(str(tmp_path / "init"), four_layer_dirs["tied"],
                                   str(moe_model_dirs["tiny-qwen3-moe"])), nprocs=4, timeout_s=500)
