"""Exporting a checkpoint's model component as a Hugging Face directory: identical logits, tokenizer,
dtype, wrapper prefixes, and the errors for corrupt checkpoints, missing configs and mismatched keys."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from hyflow.trainer.checkpoint import CheckpointManager, CorruptCheckpointError
from hyflow.trainer.export import export_checkpoint, strip_wrapper_prefixes


def _tiny_qwen2(seed: int = 0, tie: bool = True) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def _same_logits(a, b) -> bool:
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.equal(a(ids).logits, b(ids).logits)


def test_export_from_hf_config_gives_identical_logits(tmp_path):
    model = _tiny_qwen2()
    model.generation_config = GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, temperature=0.7, do_sample=True
    )
    ckpt = CheckpointManager(tmp_path / "run").save(
        3,
        {"actor_model": model.state_dict(), "actor_optimizer": {"state": {}}},
        hf_config=model.config,
        generation_config=model.generation_config,
    )
    with pytest.warns(
        UserWarning,
        match=r"global_step_3 holds no tokenizer/ and no base_model_path was given: the export has no tokenizer",
    ):
        out = export_checkpoint(ckpt, tmp_path / "export")
    assert out == tmp_path / "export"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert _same_logits(exported, model)
    assert exported.generation_config.temperature == 0.7
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_export_strips_wrapper_prefixes_and_keeps_bf16(tmp_path):
    model = _tiny_qwen2(seed=1, tie=False).to(torch.bfloat16)
    wrapped = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    ckpt = CheckpointManager(tmp_path / "run").save(1, {"actor_model": wrapped}, hf_config=model.config)
    with pytest.warns(UserWarning, match="no tokenizer"):
        out = export_checkpoint(ckpt, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    assert exported.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert _same_logits(exported, model)


def test_export_copies_the_saved_huggingface_dir(tmp_path):
    model = _tiny_qwen2(seed=2)
    ckpt = CheckpointManager(tmp_path / "run").save(2, {"actor_model": model.state_dict()}, hf_model=model)
    with pytest.warns(UserWarning, match="no tokenizer"):
        out = export_checkpoint(ckpt, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (ckpt / "huggingface").iterdir())
    assert _same_logits(AutoModelForCausalLM.from_pretrained(out).eval(), model)


def test_export_from_base_model_path_with_its_tokenizer(tmp_path, tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.01)  # "trained" weights differ from the base directory's
    ckpt = CheckpointManager(tmp_path / "run").save(4, {"actor_model": base.state_dict()})
    out = export_checkpoint(ckpt, tmp_path / "export", base_model_path=str(tiny_model_dir))
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert _same_logits(exported, base)
    original = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "What is 12 + 7?\nAnswer: 19"
    assert tokenizer(text)["input_ids"] == original(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_export_copies_the_checkpoint_tokenizer(tmp_path, tiny_tokenizer):
    model = _tiny_qwen2(seed=3)
    ckpt = CheckpointManager(tmp_path / "run").save(
        5, {"actor_model": model.state_dict()}, hf_config=model.config, tokenizer=tiny_tokenizer
    )
    out = export_checkpoint(ckpt, tmp_path / "export")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (ckpt / "tokenizer" / name).read_bytes()
    assert AutoTokenizer.from_pretrained(out)("a b\nc")["input_ids"] == tiny_tokenizer("a b\nc")["input_ids"]


def test_export_refuses_a_corrupt_checkpoint(tmp_path):
    model = _tiny_qwen2()
    ckpt = CheckpointManager(tmp_path / "run").save(
        1, {"actor_model": model.state_dict()}, hf_config=model.config
    )
    weights = ckpt / "actor_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(
        CorruptCheckpointError, match=r"global_step_1: checksum mismatch for actor_model\.safetensors"
    ):
        export_checkpoint(ckpt, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_export_without_config_or_base_model_names_the_fix(tmp_path):
    model = _tiny_qwen2()
    yaml_text = "actor_rollout_ref:\n  model:\n    path: /models/my-base\n"
    ckpt = CheckpointManager(tmp_path / "run").save(
        1, {"actor_model": model.state_dict()}, config_yaml=yaml_text
    )
    with pytest.raises(
        FileNotFoundError,
        match=r"no huggingface/ .* no hf_config/config\.json .* no base_model_path was given\. Fix: pass "
        r"base_model_path=<the model the run started from> \(actor_rollout_ref\.model\.path=/models/my-base",
    ):
        export_checkpoint(ckpt, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_export_lists_missing_and_unexpected_keys(tmp_path):
    model = _tiny_qwen2()
    state = dict(model.state_dict())
    state.pop("model.norm.weight")
    state["value_head.weight"] = torch.zeros(1, 32)
    ckpt = CheckpointManager(tmp_path / "run").save(1, {"actor_model": state}, hf_config=model.config)
    with pytest.raises(
        ValueError,
        match=r"does not fit the model: 1 missing key\(s\) \[model\.norm\.weight\]; 1 unexpected key\(s\) \[value_head\.weight\]",
    ):
        export_checkpoint(ckpt, tmp_path / "export")
    bigger = _tiny_qwen2()
    bigger.config.intermediate_size = 96
    ckpt2 = CheckpointManager(tmp_path / "run").save(
        2, {"actor_model": model.state_dict()}, hf_config=bigger.config
    )
    with pytest.raises(
        ValueError,
        match=r"shape mismatch\(es\) \[model\.layers\.0\.mlp\.\w+_proj\.weight \(\d+, \d+\) vs model",
    ):
        export_checkpoint(ckpt2, tmp_path / "export2")


def test_export_argument_errors(tmp_path):
    model = _tiny_qwen2()
    ckpt = CheckpointManager(tmp_path / "run").save(
        1, {"actor_model": model.state_dict(), "actor_optimizer": {"state": {}}}, hf_config=model.config
    )
    with pytest.raises(
        KeyError, match=r"has no component 'critic_model'; it holds \['actor_model', 'actor_optimizer'\]"
    ):
        export_checkpoint(ckpt, tmp_path / "export", component="critic_model")
    with pytest.raises(
        ValueError, match=r"'actor_optimizer' .* is not a model state dict .* \['actor_model'\]"
    ):
        export_checkpoint(ckpt, tmp_path / "export", component="actor_optimizer")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(
        FileExistsError, match="busy exists and is not empty; delete it or choose another --out"
    ):
        export_checkpoint(ckpt, tmp_path / "busy")
    (tmp_path / "empty").mkdir()
    with pytest.warns(UserWarning, match="no tokenizer"):
        assert export_checkpoint(ckpt, tmp_path / "empty") == tmp_path / "empty"


def test_strip_wrapper_prefixes():
    t = torch.zeros(1)
    state = {
        "module._orig_mod.model.embed.weight": t,
        "model.layers.0._fsdp_wrapped_module.mlp.weight": t,
        "model.layers.1._checkpoint_wrapped_module.attn.module.weight": t,
    }
    assert list(strip_wrapper_prefixes(state)) == [
        "model.embed.weight",
        "model.layers.0.mlp.weight",
        "model.layers.1.attn.module.weight",
    ]
    with pytest.raises(ValueError, match=r"collide after removing wrapper prefixes: 'module\.w' -> 'w'"):
        strip_wrapper_prefixes({"w": t, "module.w": t})


def test_export_of_a_critic_gives_a_value_model_and_sharded_components_merge(tmp_path):
    import warnings

    from transformers import AutoModelForTokenClassification

    from hyflow.models.loading import load_value_model
    from hyflow.workers.fsdp import save_sharded

    policy = _tiny_qwen2()
    policy.config.save_pretrained(tmp_path / "base")
    policy.save_pretrained(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        critic = load_value_model(tmp_path / "base")
    with torch.no_grad():
        critic.score.weight.normal_()

    def shards(directory):
        save_sharded(critic, None, directory)
        return {"model_component": "critic_model"}

    ckpt = CheckpointManager(tmp_path / "run").save(
        1, {"actor_model": policy.state_dict()}, hf_config=policy.config, sharded={"critic": shards})
    with pytest.warns(UserWarning, match="no tokenizer"):
        out = export_checkpoint(ckpt, tmp_path / "critic_hf", component="critic_model")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]
    exported = AutoModelForTokenClassification.from_pretrained(out)
    for name, tensor in critic.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
    with pytest.raises(KeyError, match=r"has no component 'ref_model'; it holds \['actor_model', 'critic_model'\]"):
        export_checkpoint(ckpt, tmp_path / "nope", component="ref_model")
