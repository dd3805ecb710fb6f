"""Checkpoint storage: round trips, the tracker file, rotation, crash safety, corruption errors, resume modes,
RNG capture/restore and the Hugging Face directory."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hyflow
from hyflow.trainer import checkpoint as ckpt_mod
from hyflow.trainer.checkpoint import (
    TRACKER_FILE,
    CheckpointManager,
    CorruptCheckpointError,
    capture_rng_state,
    checkpoint_step,
    restore_rng_state,
    verify_checkpoint,
)


def _training_state(seed: int = 0):
    """A tiny model, AdamW and a scheduler after two optimizer steps."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _components(model, opt, sched, extra=None):
    return {
        "actor_model": model.state_dict(),
        "actor_optimizer": opt.state_dict(),
        "lr_scheduler": sched.state_dict(),
        "rng": capture_rng_state(),
        "extra": extra if extra is not None else {"epoch": 3, "names": ["a", "b"], "loader": {"pos": 17}},
    }


def _one_more_step(model, opt, sched, x):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _flip_byte(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------ round trip


def test_round_trip_restores_model_optimizer_scheduler_rng_and_extra(tmp_path):
    model, opt, sched = _training_state()
    manager = CheckpointManager(tmp_path)
    path = manager.save(5, _components(model, opt, sched), config_yaml="trainer:\n  total_epochs: 1\n")
    assert path == tmp_path / "global_step_5"
    assert (path / "actor_model.safetensors").is_file() and (path / "actor_optimizer.pt").is_file()
    assert (path / "config.yaml").read_text() == "trainer:\n  total_epochs: 1\n"

    loaded = manager.load(5)
    assert list(loaded) == ["actor_model", "actor_optimizer", "lr_scheduler", "rng", "extra"]
    assert type(loaded["actor_model"]) is dict
    assert list(loaded["actor_model"]) == list(model.state_dict())  # saved key order
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded["actor_model"][key], tensor)
    assert loaded["extra"] == {"epoch": 3, "names": ["a", "b"], "loader": {"pos": 17}}
    assert loaded["lr_scheduler"] == sched.state_dict()

    # A fresh model/optimizer/scheduler restored from disk takes the same next step as the originals.
    model2, opt2, sched2 = _training_state(seed=1)
    model2.load_state_dict(loaded["actor_model"])
    opt2.load_state_dict(loaded["actor_optimizer"])
    sched2.load_state_dict(loaded["lr_scheduler"])
    x = torch.randn(5, 4)
    assert torch.equal(_one_more_step(model, opt, sched, x), _one_more_step(model2, opt2, sched2, x))
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    import hashlib

    model, opt, sched = _training_state()
    path = CheckpointManager(tmp_path).save(2, _components(model, opt, sched))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 2 and checkpoint_step(path) == 2
    assert manifest["hyflow_version"] == hyflow.__version__
    assert manifest["saved_at"].endswith("+00:00")
    assert manifest["components"]["actor_model"] == {
        "file": "actor_model.safetensors",
        "format": "safetensors",
    }
    assert manifest["components"]["rng"] == {"file": "rng.pt", "format": "torch"}
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    for rel, meta in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert meta == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_tied_and_viewed_tensors_are_stored_per_key(tmp_path):
    weight = torch.randn(6, 4)
    state = {"embed.weight": weight, "lm_head.weight": weight, "half": weight[:3], "t": weight.t()}
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"m": state})
    loaded = manager.load(1)["m"]
    assert set(loaded) == set(state)
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor)


@settings(max_examples=15, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=3), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]),
)
def test_flat_tensor_dicts_round_trip_bit_exactly(shapes, dtype):
    state = {f"k{i}": (torch.rand(shape) * 10).to(dtype) for i, shape in enumerate(shapes)}
    with tempfile.TemporaryDirectory() as run_dir:
        manager = CheckpointManager(run_dir)
        manager.save(0, {"m": state})
        loaded = manager.load(0)["m"]
    assert list(loaded) == list(state)
    for key, tensor in state.items():
        assert loaded[key].dtype == tensor.dtype and loaded[key].shape == tensor.shape
        assert torch.equal(loaded[key], tensor)


def test_load_selected_names_and_unknown_name(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"a": {"x": 1}, "b": {"y": 2}})
    assert manager.load(1, names=["b"]) == {"b": {"y": 2}}
    with pytest.raises(KeyError, match=r"no component\(s\) \['c'\]; it holds \['a', 'b'\]"):
        manager.load(1, names=["c"])


def test_invalid_step_and_component_name(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        manager.save(-1, {"a": 1})
    with pytest.raises(ValueError, match=r"component name '\.\./x' is not a valid file name"):
        manager.save(1, {"../x": 1})
    with pytest.raises(ValueError, match="DTensor shard"):
        ckpt_mod._tensors_for_safetensors("m", {"w": type("DTensor", (torch.Tensor,), {})()})


def test_non_hf_objects_are_rejected_and_leave_nothing(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match=r"hf_config must have a save_pretrained\(dir\) method"):
        manager.save(1, {"a": 1}, hf_config={"hidden_size": 8})
    assert list(tmp_path.iterdir()) == []


def test_concurrent_saves_from_threads_all_complete(tmp_path):
    import threading

    manager = CheckpointManager(tmp_path, max_to_keep=3)
    threads = [
        threading.Thread(target=manager.save, args=(s, {"w": torch.full((64,), float(s))})) for s in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the threads finish in any order; a save older than the newest 3 stays too (the step just saved always stays,
    # test_max_to_keep_deletes_the_oldest), so 3 or 4 checkpoints remain: always the newest 3
    assert {3, 4, 5} <= set(manager.list_steps()) and len(manager.list_steps()) in (3, 4)
    for step in manager.list_steps():
        manager.verify(step)
        assert torch.equal(manager.load(step)["w"], torch.full((64,), float(step)))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------------------ tracker, rotation


def test_tracker_file_holds_the_latest_step(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.latest_step() is None and manager.list_steps() == []
    manager.save(3, {"a": 1})
    assert (tmp_path / TRACKER_FILE).read_text() == "3"
    manager.save(10, {"a": 2})
    assert (tmp_path / TRACKER_FILE).read_text() == "10"
    assert manager.latest_step() == 10
    assert manager.list_steps() == [3, 10]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_tracker_decides_like_verl(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        manager.save(step, {"a": step})
    (tmp_path / TRACKER_FILE).write_text("2\n")  # a user rolls back by editing the tracker
    assert manager.latest_step() == 2


def test_max_to_keep_deletes_the_oldest(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, {"a": step})
    assert manager.list_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", "global_step_4", TRACKER_FILE]
    manager.save(2, {"a": 2})  # the checkpoint just saved always stays
    assert manager.list_steps() == [2, 3, 4]
    assert CheckpointManager(tmp_path, max_to_keep=0).max_to_keep is None
    with pytest.raises(ValueError, match="max_to_keep=-1 is invalid; use a positive number"):
        CheckpointManager(tmp_path, max_to_keep=-1)


def test_resaving_a_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"a": "old", "stale": 0})
    manager.save(1, {"a": "new"})
    assert manager.load(1) == {"a": "new"}
    assert not (tmp_path / "global_step_1" / "stale.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", TRACKER_FILE]


# ------------------------------------------------------------------------------------------ crashes


def test_crash_midway_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _training_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, _components(model, opt, sched))

    real_write = ckpt_mod._write_component
    calls = []

    def crash_on_second(directory, name, state):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real_write(directory, name, state)

    monkeypatch.setattr(ckpt_mod, "_write_component", crash_on_second)
    with pytest.raises(OSError, match="simulated"):
        manager.save(2, _components(model, opt, sched))
    monkeypatch.undo()

    assert not (tmp_path / "global_step_2").exists()
    assert (tmp_path / TRACKER_FILE).read_text() == "1"
    assert manager.list_steps() == [1] and manager.latest_step() == 1
    manager.verify(1)
    assert torch.equal(manager.load(1)["actor_model"]["weight"], model.weight.detach())


def test_crash_while_replacing_the_same_step_keeps_the_old_one(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"a": "old"})
    real_rename = os.rename

    def fail_moving_new_into_place(src, dst):
        if Path(src).name.startswith(".tmp_") and Path(dst).name == "global_step_1":
            raise OSError("killed (simulated)")
        return real_rename(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "rename", fail_moving_new_into_place)
    with pytest.raises(OSError, match="simulated"):
        manager.save(1, {"a": "new"})
    monkeypatch.undo()
    assert manager.load(1) == {"a": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", TRACKER_FILE]


def test_hard_kill_leftovers_are_ignored_then_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"a": 1})
    # A process killed mid-save leaves its temp dir; one killed between the two renames of a re-save leaves
    # the old checkpoint as trash; one killed mid-rotation leaves a .deleting_ dir.
    partial = tmp_path / ".tmp_global_step_2_99999"
    partial.mkdir()
    (partial / "actor_model.safetensors").write_bytes(b"half")
    (tmp_path / ".deleting_global_step_0_99999").mkdir()
    assert manager.list_steps() == [1] and manager.latest_step() == 1

    manager.save(3, {"a": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "global_step_3", TRACKER_FILE]


def test_kill_between_renames_is_recovered(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"a": "old"})
    os.rename(tmp_path / "global_step_1", tmp_path / ".trash_global_step_1_4242")
    with pytest.warns(UserWarning, match="restored .*global_step_1 from .trash_global_step_1_4242"):
        resumed = manager.resolve_resume("auto")
    assert resumed == tmp_path / "global_step_1"
    assert manager.load(resumed) == {"a": "old"}


# ------------------------------------------------------------------------------------------ corruption


@pytest.fixture
def two_checkpoints(tmp_path):
    model, opt, sched = _training_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, _components(model, opt, sched))
    manager.save(2, _components(model, opt, sched))
    return manager


def test_truncated_file_is_a_size_mismatch(two_checkpoints):
    path = two_checkpoints.step_dir(2) / "actor_optimizer.pt"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(
        CorruptCheckpointError,
        match=r"global_step_2: size mismatch for actor_optimizer\.pt: \d+ bytes on disk, \d+ in manifest\.json",
    ) as info:
        two_checkpoints.verify(2)
    assert "Fix: delete it or resume from global_step_1" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(CorruptCheckpointError, match="size mismatch"):
        two_checkpoints.load(2)


def test_flipped_byte_is_a_checksum_mismatch(two_checkpoints):
    _flip_byte(two_checkpoints.step_dir(2) / "actor_model.safetensors")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"checksum mismatch for actor_model\.safetensors: sha256 .*\(the file's bytes changed",
    ):
        verify_checkpoint(two_checkpoints.step_dir(2))
    assert two_checkpoints.list_steps() == [1, 2]  # listing checks sizes only; verify/load check bytes
    two_checkpoints.load(2, verify=False)  # safetensors data bytes are not validated by the reader


def test_missing_manifest_is_a_partial_checkpoint(two_checkpoints):
    (two_checkpoints.step_dir(1) / "manifest.json").unlink()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"global_step_1: partial checkpoint \(no manifest\.json: the save did not finish\)\. Fix: delete it or resume from global_step_2",
    ):
        two_checkpoints.verify(1)
    assert two_checkpoints.list_steps() == [2]


def test_missing_file_and_the_fix_when_nothing_else_is_left(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(4, {"a": 1, "b": 2})
    (manager.step_dir(4) / "b.pt").unlink()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"missing file b\.pt \(listed in manifest\.json\)\. Fix: delete it \(there is no other complete checkpoint",
    ):
        manager.load(4)
    (manager.step_dir(4) / "manifest.json").write_text('{"step": 4, "components": {}, "files": {"a.pt": {}}}')
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json is malformed"):
        manager.verify(4)
    (manager.step_dir(4) / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json is unreadable"):
        manager.verify(4)
    with pytest.raises(FileNotFoundError, match="global_step_9 does not exist"):
        manager.verify(9)


def test_latest_step_falls_back_with_a_warning(two_checkpoints):
    run_dir = two_checkpoints.run_dir
    (two_checkpoints.step_dir(2) / "actor_model.safetensors").unlink()
    with pytest.warns(
        UserWarning,
        match=r"names step 2 but .*missing file actor_model\.safetensors.*falling back to global_step_1",
    ):
        assert two_checkpoints.latest_step() == 1
    (run_dir / TRACKER_FILE).unlink()
    with pytest.warns(UserWarning, match="is missing; using the newest complete checkpoint"):
        assert two_checkpoints.latest_step() == 1
    (run_dir / TRACKER_FILE).write_text("banana")
    with pytest.warns(UserWarning, match="holds 'banana', not a step number"):
        assert two_checkpoints.latest_step() == 1


# ------------------------------------------------------------------------------------------ resume


def test_resolve_resume_modes(two_checkpoints, monkeypatch):
    manager, run_dir = two_checkpoints, two_checkpoints.run_dir
    assert manager.resolve_resume("disable") is None
    assert manager.resolve_resume("auto") == manager.step_dir(2)
    assert manager.resolve_resume("resume_path", str(manager.step_dir(1))) == manager.step_dir(1).resolve()
    assert manager.resolve_resume("resume_path", "global_step_1") == manager.step_dir(1).resolve()
    monkeypatch.chdir(run_dir)
    assert manager.resolve_resume("resume_path", "./global_step_2") == manager.step_dir(2).resolve()
    assert CheckpointManager(run_dir / "fresh").resolve_resume("auto") is None


def test_resolve_resume_auto_skips_a_corrupt_latest(two_checkpoints):
    _flip_byte(two_checkpoints.step_dir(2) / "actor_optimizer.pt")
    with pytest.warns(UserWarning, match=r"skipping corrupt checkpoint .*global_step_2: checksum mismatch"):
        assert two_checkpoints.resolve_resume("auto") == two_checkpoints.step_dir(1)


def test_resolve_resume_errors(two_checkpoints):
    manager = two_checkpoints
    with pytest.raises(
        ValueError, match=r"trainer\.resume_mode='latest' is not one of \['auto', 'disable', 'resume_path'\]"
    ):
        manager.resolve_resume("latest")
    with pytest.raises(
        ValueError,
        match=r"resume_path needs trainer\.resume_from_path=<run_dir>/global_step_N .*global_step_2",
    ):
        manager.resolve_resume("resume_path", None)
    with pytest.raises(
        FileNotFoundError, match=r"trainer\.resume_from_path='/no/such/global_step_3' does not exist"
    ):
        manager.resolve_resume("resume_path", "/no/such/global_step_3")
    with pytest.raises(ValueError, match=r"is a run directory, not a checkpoint; .* e\.g\. .*global_step_2"):
        manager.resolve_resume("resume_path", str(manager.run_dir))
    _flip_byte(manager.step_dir(1) / "rng.pt")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"trainer\.resume_from_path=.*global_step_1.*: corrupt checkpoint .*checksum mismatch for rng\.pt",
    ):
        manager.resolve_resume("resume_path", str(manager.step_dir(1)))


# ------------------------------------------------------------------------------------------ RNG


def _draws():
    return (
        random.random(),
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 100, (4,)).tolist(),
    )


def test_rng_restore_repeats_the_same_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    state = capture_rng_state()
    first = _draws()
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"rng": state})
    _draws()  # move every generator on
    restore_rng_state(manager.load(1)["rng"])
    assert _draws() == first
    assert _draws() != first
    if not torch.cuda.is_available():
        assert state["torch_cuda"] is None


def test_rng_restore_rejects_a_foreign_dict():
    with pytest.raises(
        ValueError,
        match=r"RNG state is missing \['numpy', 'torch_cpu', 'torch_cuda'\]; pass the dict that capture_rng_state\(\) returned",
    ):
        restore_rng_state({"python": random.getstate()})


def test_rng_restore_warns_when_cuda_states_cannot_be_restored(monkeypatch):
    state = capture_rng_state()
    state["torch_cuda"] = [torch.get_rng_state()]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match=r"CUDA RNG states for 1 device\(s\) but CUDA is not available"):
        restore_rng_state(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_and_map_location(tmp_path):
    torch.cuda.manual_seed_all(5)
    torch.rand(2, device="cuda")
    state = capture_rng_state()
    assert state["torch_cuda"] is not None and len(state["torch_cuda"]) == torch.cuda.device_count()
    first = torch.rand(4, device="cuda").tolist()
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"rng": state, "m": {"w": torch.randn(3, device="cuda")}})
    torch.rand(4, device="cuda")
    loaded = manager.load(1, map_location="cuda")
    assert loaded["m"]["w"].device.type == "cuda"
    restore_rng_state(loaded["rng"])
    assert torch.rand(4, device="cuda").tolist() == first


# ------------------------------------------------------------------------------------------ Hugging Face dir


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_hf_model_directory_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tiny_qwen2()
    manager = CheckpointManager(tmp_path)
    path = manager.save(7, {"actor_model": model.state_dict()}, hf_model=model, hf_config=model.config)
    manager.verify(7)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["huggingface"] == {"component": "actor_model"}
    assert "huggingface/model.safetensors" in manifest["files"]
    assert "hf_config/config.json" in manifest["files"]

    reloaded = AutoModelForCausalLM.from_pretrained(path / "huggingface").eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


# ------------------------------------------------------------------------------------------ sharded directories


def _shard_writer(payloads: dict[str, bytes], info: dict | None = None):
    def write(directory: Path):
        directory.mkdir()
        for name, data in payloads.items():
            (directory / name).write_bytes(data)
        return info

    return write


def test_sharded_directories_are_hashed_listed_and_found(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(3, {"trainer_state": {"step": 3}},
                        sharded={"actor": _shard_writer({".metadata": b"m", "__0_0.distcp": b"a", "__1_0.distcp": b"bb"},
                                                        {"world_size": 2})})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["sharded"] == {"actor": {"dir": "actor", "world_size": 2}}
    assert {"actor/.metadata", "actor/__0_0.distcp", "actor/__1_0.distcp"} <= set(manifest["files"])
    found = manager.sharded_dirs(3)
    assert found["actor"]["path"] == path / "actor" and found["actor"]["world_size"] == 2
    (path / "actor" / "__1_0.distcp").write_bytes(b"cc")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch for actor/__1_0.distcp"):
        verify_checkpoint(path)


def test_a_sharded_writer_that_fails_or_writes_nothing_leaves_the_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"trainer_state": {"step": 1}})

    def failing(directory: Path):
        directory.mkdir()
        (directory / "__0_0.distcp").write_bytes(b"half")
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        manager.save(2, {"trainer_state": {"step": 2}}, sharded={"actor": failing})
    with pytest.raises(RuntimeError, match="wrote nothing"):
        manager.save(2, {"trainer_state": {"step": 2}}, sharded={"actor": _shard_writer({})})
    assert manager.list_steps() == [1] and manager.latest_step() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", TRACKER_FILE]
    with pytest.raises(ValueError, match="clash"):
        manager.save(2, {"trainer_state": {}}, sharded={"tokenizer": _shard_writer({"x": b"1"})})


def test_shards_left_on_another_node_are_an_error_naming_the_fix(tmp_path):
    """A rank on another node writes its shard to that node's own disk: the driver sees it missing."""
    from hyflow.trainer.role_checkpoints import write_shards
    from hyflow.workers.fsdp import save_sharded

    class OneNodeVisible:
        world_size = 2

        def save_sharded_checkpoint(self, path, contents):
            model = _training_state()[0]
            save_sharded(model, None, path)
            (Path(path) / "__0_0.distcp").unlink()  # as if it had gone to another machine's local disk

    manager = CheckpointManager(tmp_path / "run")
    manager.save(1, {"trainer_state": {"step": 1}})
    writer = lambda d: write_shards("actor", OneNodeVisible(), ["model"], d)  # noqa: E731
    with pytest.raises(RuntimeError) as info:
        manager.save(2, {"trainer_state": {"step": 2}}, sharded={"actor": writer})
    text = str(info.value)
    assert "actor's sharded checkpoint is incomplete: shard file __0_0.distcp is missing" in text
    assert "shared filesystem" in text and "trainer.checkpoint_format=full" in text
    assert manager.list_steps() == [1]


def test_a_run_directory_or_a_foreign_directory_is_not_called_corrupt(tmp_path):
    from hyflow.trainer.checkpoint import NotACheckpointError

    CheckpointManager(tmp_path / "run").save(4, {"trainer_state": {"step": 4}})
    with pytest.raises(NotACheckpointError, match=r"is a run directory, not a checkpoint: .* latest complete one "
                                                  r"is .*global_step_4"):
        verify_checkpoint(tmp_path / "run")
    (tmp_path / "other").mkdir()
    with pytest.raises(NotACheckpointError, match=r"other is not a hyflow checkpoint \(no manifest.json\)"):
        verify_checkpoint(tmp_path / "other")
    (tmp_path / "run" / "global_step_5").mkdir()  # a step directory without a manifest is a partial save
    with pytest.raises(CorruptCheckpointError, match="partial checkpoint"):
        verify_checkpoint(tmp_path / "run" / "global_step_5")


# ---- the roles' part of a checkpoint (hyflow.trainer.role_checkpoints) ------------------------------------------


class FakeRole:
    """A role's worker group as RoleCheckpoints sees it: full state dicts, or shards written by save_sharded."""

    def __init__(self, name: str, world_size: int = 1):
        self.name, self.world_size = name, world_size
        self.model = _training_state()[0]
        self.loaded = None

    def state_dict(self, contents):
        sd = {f"{self.name}_model": self.model.state_dict()}
        if "optimizer" in contents:
            sd[f"{self.name}_optimizer"] = {"step": torch.tensor(2)}
        return sd

    def load_state_dict(self, components, contents):
        self.loaded = ("full", sorted(components), list(contents))

    def save_sharded_checkpoint(self, path, contents):
        from hyflow.workers.fsdp import save_sharded

        save_sharded(self.model, None, path)

    def load_sharded_checkpoint(self, path, contents):
        self.loaded = ("sharded", Path(path).name, list(contents))


def _role_checkpoints(tmp_path, roles, fmt="auto", save=("model", "optimizer"), load=("model", "optimizer")):
    from transformers import LlamaConfig

    from hyflow.trainer.role_checkpoints import RoleCheckpoints, RoleState

    model_dir = tmp_path / "model"
    LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=32).save_pretrained(model_dir)
    model_cfg = type("Model", (), {"path": str(model_dir), "trust_remote_code": False,
                                   "override_config": {"rope_theta": 5.0}})
    return RoleCheckpoints(CheckpointManager(tmp_path / "run"),
                           {role.name: RoleState(role, tuple(save), tuple(load)) for role in roles},
                           checkpoint_format=fmt, model_cfg=model_cfg)


def test_role_checkpoints_save_full_roles_and_return_the_trainer_state(tmp_path):
    actor, critic = FakeRole("actor"), FakeRole("critic")
    roles = _role_checkpoints(tmp_path, [actor, critic])
    path = roles.save(3, {"global_step": 3}, config_yaml="a: 1\n")
    manifest = json.loads((path / "manifest.json").read_text())
    assert {"actor_model", "actor_optimizer", "critic_model", "critic_optimizer", "trainer_state"} <= set(
        manifest["components"]) and not manifest.get("sharded")
    assert json.loads((path / "hf_config" / "config.json").read_text())["rope_theta"] == 5.0  # override applied
    assert (path / "hf_config" / "generation_config.json").is_file()  # derived from the model's config
    assert (path / "config.yaml").read_text() == "a: 1\n"
    assert roles.load(path) == {"global_step": 3}
    assert actor.loaded == ("full", ["actor_model", "actor_optimizer"], ["model", "optimizer"])
    assert critic.loaded == ("full", ["critic_model", "critic_optimizer"], ["model", "optimizer"])


@pytest.mark.parametrize(("fmt", "world_size", "layout"), [("auto", 2, "sharded"), ("auto", 1, "full"),
                                                            ("sharded", 1, "sharded"), ("full", 2, "full")])
def test_role_checkpoints_layout_per_role(tmp_path, fmt, world_size, layout):
    from hyflow.trainer.role_checkpoints import checkpoint_layout

    assert checkpoint_layout(fmt, world_size) == layout
    actor = FakeRole("actor", world_size)
    roles = _role_checkpoints(tmp_path, [actor], fmt=fmt)
    path = roles.save(1, {"global_step": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    if layout == "sharded":
        assert manifest["sharded"]["actor"]["world_size"] == world_size and "actor_model" not in manifest["components"]
    else:
        assert "actor_model" in manifest["components"] and not manifest.get("sharded")
    roles.load(path)
    assert actor.loaded[:2] == (("sharded", "actor") if layout == "sharded" else ("full", ["actor_model",
                                                                                           "actor_optimizer"]))


def test_role_checkpoints_load_names_a_missing_role_and_fresh_state(tmp_path):
    path = _role_checkpoints(tmp_path, [FakeRole("actor")], save=("model",)).save(2, {"global_step": 2})
    with pytest.raises(ValueError, match=r"holds no critic state \(it was saved by a run without a critic\), but "
                                         r"this config has one; resume with the config"):
        _role_checkpoints(tmp_path, [FakeRole("actor"), FakeRole("critic")], load=("model",)).load(path)
    with pytest.warns(UserWarning, match=r"has no actor optimizer state \(saved with save_contents=\['model'\]\): "
                                         r"optimizer start\(s\) fresh"):
        assert _role_checkpoints(tmp_path, [FakeRole("actor")]).load(path) == {"global_step": 2}
