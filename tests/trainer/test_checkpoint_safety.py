"""Checkpoints cannot run code: a crafted pickle in any file hyflow reads back (trainer state, a model component,
a sharded checkpoint's .metadata or extra state) is refused on resume and on export, and its code never runs.

The attacker controls the whole checkpoint directory, so each test rewrites the sha256 manifest to match the
crafted file: the manifest is no defence, the loader is.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from hyflow.cli import main
from hyflow.serialization import CheckpointSecurityError, load_plain_data, read_dcp_metadata
from hyflow.trainer.checkpoint import (
    MANIFEST_FILE,
    CheckpointManager,
    CorruptCheckpointError,
    capture_rng_state,
    restore_rng_state,
)
from hyflow.trainer.export import export_checkpoint


class Exploit:
    """Unpickling this calls `Path.touch(marker)`: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def plant(path: Path, marker: Path, *, torch_format: bool = True) -> None:
    """Write a crafted pickle to `path` and fix up the sha256 manifest of its checkpoint, as an attacker would."""
    if torch_format:
        torch.save({"payload": Exploit(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(Exploit(marker)))
    assert not marker.exists()
    for parent in path.parents:
        manifest_file = parent / MANIFEST_FILE
        if manifest_file.is_file():
            manifest = json.loads(manifest_file.read_text())
            rel = path.relative_to(parent).as_posix()
            manifest["files"][rel] = {"size": path.stat().st_size,
                                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            manifest_file.write_text(json.dumps(manifest))
            return


def the_exploit_works(tmp_path: Path) -> None:
    """Control: the crafted file does run code when unpickled the old way."""
    marker = tmp_path / "control_marker"
    torch.save({"payload": Exploit(marker)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert marker.exists()


def _model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).state_dict()


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=32, vocab_size=32))


def test_rng_state_round_trips_as_plain_data(tmp_path):
    import random

    import numpy as np

    state = capture_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    restore_rng_state(load_plain_data(tmp_path / "rng.pt"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want


def test_crafted_trainer_state_is_refused_on_resume(tmp_path):
    the_exploit_works(tmp_path)
    manager = CheckpointManager(tmp_path / "run")
    ckpt = manager.save(2, {"actor_model": _model(), "trainer_state": {"step": 2, "rng": capture_rng_state()}})
    marker = tmp_path / "pwned"
    plant(ckpt / "trainer_state.pt", marker)
    resume = manager.resolve_resume("auto")  # sizes and sha256 agree: the manifest was rewritten too
    assert resume == ckpt
    with pytest.raises(CheckpointSecurityError, match="trainer_state.pt holds more than tensors and plain data"):
        manager.load(resume, verify=False)
    assert not marker.exists()


def test_crafted_model_component_is_refused_on_export(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    model = _qwen2()
    ckpt = manager.save(1, {"actor_model": model.state_dict()}, hf_config=model.config)
    marker = tmp_path / "pwned"
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    (ckpt / "actor_model.safetensors").unlink()
    del manifest["files"]["actor_model.safetensors"]
    manifest["components"]["actor_model"] = {"file": "actor_model.pt", "format": "torch"}
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    plant(ckpt / "actor_model.pt", marker)
    with pytest.raises(CheckpointSecurityError, match="refuses to unpickle a model"):
        export_checkpoint(ckpt, tmp_path / "out", base_model_path=None)
    with pytest.raises(CheckpointSecurityError):  # and the generic loader refuses it too
        manager.load(ckpt, names=["actor_model"])
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_crafted_dcp_metadata_and_extra_state_are_refused(tmp_path):
    from hyflow.workers.fsdp import load_sharded, read_sharded_model_state, save_sharded

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    save_sharded(model, optimizer, tmp_path / "dcp", extra={"actor_scheduler": {"last_epoch": 1}})
    assert read_dcp_metadata(tmp_path / "dcp").state_dict_metadata  # the real metadata passes the filter
    assert load_sharded(model, optimizer, tmp_path / "dcp") == {"actor_scheduler": {"last_epoch": 1}}

    marker = tmp_path / "pwned_extra"
    plant(tmp_path / "dcp" / "extra_state.pt", marker)
    with pytest.raises(CheckpointSecurityError, match="extra_state.pt holds more than tensors"):
        load_sharded(model, optimizer, tmp_path / "dcp")
    assert not marker.exists()

    marker = tmp_path / "pwned_metadata"
    plant(tmp_path / "dcp" / ".metadata", marker, torch_format=False)
    with pytest.raises(ValueError, match="asks for pathlib.Path.touch|asks for pathlib"):
        read_sharded_model_state(tmp_path / "dcp")
    with pytest.raises(ValueError, match="holds more than tensors and plain data"):
        load_sharded(model, optimizer, tmp_path / "dcp")
    assert not marker.exists()


def test_hyflow_export_of_a_crafted_sharded_checkpoint_is_one_line_and_runs_nothing(tmp_path, capsys):
    from hyflow.workers.fsdp import save_sharded

    model = _qwen2()
    manager = CheckpointManager(tmp_path / "run")
    def writer(directory: Path) -> dict:
        save_sharded(model, None, directory)
        return {"model_component": "actor_model"}

    ckpt = manager.save(1, {"trainer_state": {"step": 1}}, sharded={"actor": writer}, hf_config=model.config)
    marker = tmp_path / "pwned"
    plant(ckpt / "actor" / ".metadata", marker, torch_format=False)
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyflow export: error:") and "holds more than tensors and plain data" in err
    assert "Traceback" not in err
    assert not marker.exists()


# ------------------------------------------------------- DCP .metadata: dotted names resolve attribute by attribute

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def _short_unicode(text: str) -> bytes:
    raw = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _shell_call(command: str) -> bytes:
    """Opcodes that push `os.system(command)`, with os.system named as the dotted global
    (torch.distributed.checkpoint.metadata, "os.system"): from protocol 4 the unpickler resolves it attribute by
    attribute, through the `os` that the metadata module imports."""
    return (_short_unicode(_DCP_METADATA_MODULE) + _short_unicode("os.system") + pickle.STACK_GLOBAL
            + _short_unicode(command) + pickle.TUPLE1 + pickle.REDUCE)


def dotted_global_payload(marker: Path) -> bytes:
    """The tester's payload: the whole `.metadata` is `os.system("touch MARKER")`."""
    return pickle.PROTO + bytes([4]) + _shell_call(f"touch '{marker}'") + pickle.STOP


def stealthy_payload(real_metadata: bytes, marker: Path) -> bytes:
    """A `.metadata` that runs `touch MARKER`, drops the result, then unpickles the real `Metadata` as before:
    nothing looks wrong afterwards."""
    assert real_metadata[:2] == pickle.PROTO + bytes([4])
    return real_metadata[:2] + _shell_call(f"touch '{marker}'") + pickle.POP + real_metadata[2:]


def fix_manifest(path: Path) -> None:
    """Rewrite the sha256 manifest entry of `path`, as the attacker who planted it would."""
    for parent in path.parents:
        manifest_file = parent / MANIFEST_FILE
        if manifest_file.is_file():
            manifest = json.loads(manifest_file.read_text())
            manifest["files"][path.relative_to(parent).as_posix()] = {
                "size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            manifest_file.write_text(json.dumps(manifest))
            return


def test_the_dotted_name_payloads_do_run_code_under_a_plain_unpickler(tmp_path):
    """Control: both payloads are live (the plain unpickler runs them) and the stealthy one yields a real Metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    from hyflow.workers.fsdp import save_sharded

    save_sharded(torch.nn.Linear(4, 3), None, tmp_path / "dcp")
    real = (tmp_path / "dcp" / ".metadata").read_bytes()
    marker = tmp_path / "control_dotted"
    pickle.loads(dotted_global_payload(marker))
    assert marker.exists()
    marker = tmp_path / "control_stealthy"
    assert isinstance(pickle.loads(stealthy_payload(real, marker)), Metadata)
    assert marker.exists()


@pytest.mark.parametrize("kind", ["dotted", "stealthy"])
def test_a_dotted_global_in_dcp_metadata_is_refused_and_runs_nothing(tmp_path, kind):
    from hyflow.workers.fsdp import read_sharded_model_state, save_sharded

    save_sharded(torch.nn.Linear(4, 3), None, tmp_path / "dcp")
    metadata = tmp_path / "dcp" / ".metadata"
    marker = tmp_path / "pwned"
    metadata.write_bytes(dotted_global_payload(marker) if kind == "dotted"
                         else stealthy_payload(metadata.read_bytes(), marker))
    with pytest.raises(CheckpointSecurityError, match=r"\.metadata holds more than tensors.*os\.system"):
        read_dcp_metadata(tmp_path / "dcp")
    with pytest.raises(ValueError, match="refuses to load it"):
        read_sharded_model_state(tmp_path / "dcp")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["Metadata.__init__", "os.system", "torch.load", "field", "dataclass", "Enum"])
def test_dcp_metadata_admits_only_the_exact_metadata_classes(name):
    """Any other name under the metadata module, dotted or not, is refused before it is looked up."""
    from hyflow.serialization import _MetadataUnpickler

    data = pickle.PROTO + bytes([4]) + _short_unicode(_DCP_METADATA_MODULE) + _short_unicode(name) \
        + pickle.STACK_GLOBAL + pickle.STOP
    import io

    with pytest.raises(pickle.UnpicklingError, match=f"asks for {_DCP_METADATA_MODULE}.{name}"):
        _MetadataUnpickler(io.BytesIO(data)).load()


def _sharded_run(tmp_path: Path):
    """A finished 1-step RL run that saved a sharded (DCP) checkpoint, and the overrides that resume it."""
    from hyflow.data.tasks import make_task
    from hyflow.models.tiny import make_tiny_model

    make_task("arithmetic", tmp_path / "data", n_train=8, n_test=2, seed=0, digits=1)
    model = make_tiny_model(tmp_path / "model", preset="tiny", seed=0)
    run = tmp_path / "run"
    base = [f"actor_rollout_ref.model.path={model}", f"data.train_files={tmp_path}/data/train.parquet",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=48",
            "data.max_response_length=4", "trainer.logger=[file]", "reward_model.num_workers=0",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.checkpoint_format=sharded",
            "trainer.save_freq=1", f"trainer.default_local_dir={run}"]
    assert main(["train", *base, "trainer.total_training_steps=1"]) == 0
    return run / "global_step_1", base


@pytest.mark.parametrize("kind", ["dotted", "stealthy"])
def test_hyflow_export_and_resume_refuse_a_dotted_global_in_dcp_metadata(tmp_path, capsys, kind):
    ckpt, base = _sharded_run(tmp_path)
    metadata = ckpt / "actor" / ".metadata"
    assert metadata.is_file()
    marker = tmp_path / "pwned"
    metadata.write_bytes(dotted_global_payload(marker) if kind == "dotted"
                         else stealthy_payload(metadata.read_bytes(), marker))
    fix_manifest(metadata)
    capsys.readouterr()

    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyflow export: error:") and str(metadata) in err and "refuses to load it" in err, err
    assert "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "out").exists()

    assert main(["train", *base, "trainer.total_training_steps=2", "trainer.resume_mode=auto"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hyflow ")]
    assert len(lines) == 1 and lines[0].startswith("hyflow train: error:"), lines
    assert str(metadata) in lines[0] and "refuses to load it" in lines[0]
    assert not marker.exists()
    assert not (ckpt.parent / "global_step_2").exists()


def test_a_refused_file_is_not_met_with_torchs_advice_to_load_it_unsafely(tmp_path, capsys):
    """torch's refusal says the file 'can still be loaded' with `weights_only=False` (which runs the code): hyflow
    says only what the file asked for, on `hyflow export` too."""
    manager = CheckpointManager(tmp_path / "run")
    model = _qwen2()
    ckpt = manager.save(1, {"actor_model": model.state_dict(), "trainer_state": {"step": 1}}, hf_config=model.config)
    marker = tmp_path / "pwned"
    plant(ckpt / "trainer_state.pt", marker)
    with pytest.raises(CheckpointSecurityError) as caught:
        manager.load(ckpt, verify=False)
    message = str(caught.value)
    assert "it asks for getattr" in message, message  # Path.touch pickles as getattr(Path, "touch")
    assert "weights_only" not in message and "can still be loaded" not in message, message
    assert not marker.exists()


def test_a_malformed_safetensors_component_names_the_file_on_export_and_load(tmp_path, capsys):
    """A component whose safetensors header does not parse (the manifest agreeing, as when the whole directory was
    replaced) is one line naming the file, not 'maybe a bug in hyflow'."""
    manager = CheckpointManager(tmp_path / "run")
    model = _qwen2()
    ckpt = manager.save(1, {"actor_model": model.state_dict(), "trainer_state": {"step": 1}}, hf_config=model.config)
    weights = ckpt / "actor_model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[:8] + b"{garbage" + raw[16:])
    fix_manifest(weights)
    with pytest.raises(CorruptCheckpointError, match=f"{weights} is not a readable safetensors file"):
        manager.load(ckpt)
    capsys.readouterr()
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyflow export: error:") and f"{weights} is not a readable safetensors file" in err, err
    assert "maybe a bug" not in err
