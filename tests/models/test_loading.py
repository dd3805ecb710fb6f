"""Loading tokenizers, causal LMs, critics and reward models from local directories; path and override errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from hyflow.models.forward import compute_position_ids, values_from_model
from hyflow.models.loading import (
    apply_config_overrides,
    as_torch_dtype,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
    save_value_model,
)


def test_resolve_local_dir_and_hub_ids(tiny_model_dir):
    assert resolve_model_path(tiny_model_dir) == str(tiny_model_dir)
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_path("gpt2") == "gpt2"


@pytest.mark.parametrize("missing", ["/no/such/model", "./no_such_model", "~/no_such_model_hyflow", "a/b/c"])
def test_missing_local_path_names_the_config_key(missing):
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref\.model\.path=.* does not exist; set"):
        load_causal_lm(missing)
    with pytest.raises(FileNotFoundError, match=r"critic\.model\.path="):
        load_value_model(missing)


def test_path_to_a_file_is_rejected(tiny_model_dir):
    with pytest.raises(FileNotFoundError, match=r"is a file, not a checkpoint directory"):
        load_tokenizer(tiny_model_dir / "config.json")


def test_empty_path():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.path is empty"):
        resolve_model_path("")


def test_load_tokenizer_and_chat_template_override(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    assert tokenizer.pad_token == "<|endoftext|>"
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}]
    custom = load_tokenizer(tiny_model_dir, chat_template=template)
    assert custom.apply_chat_template(msgs, tokenize=False) == "[user] hi\n"
    template_file = tmp_path / "t.jinja"
    template_file.write_text(template)
    from_file = load_tokenizer(tiny_model_dir, chat_template=str(template_file))
    assert from_file.apply_chat_template(msgs, tokenize=False) == "[user] hi\n"


def test_missing_pad_token_falls_back_to_eos(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None
    reloaded = load_tokenizer(tmp_path)
    assert reloaded.pad_token == reloaded.eos_token == "<|im_end|>"


def test_tokenizer_without_pad_and_eos_is_rejected(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has neither a pad nor an eos token; add one"):
        load_tokenizer(tmp_path)


def test_missing_chat_template_file(tiny_model_dir):
    with pytest.raises(
        FileNotFoundError, match=r"chat template file '/no/such/template.jinja' does not exist"
    ):
        load_tokenizer(tiny_model_dir, chat_template="/no/such/template.jinja")


def checkpointing(model) -> bool:
    """Whether gradient checkpointing is on (transformers >= 5.24 names it is_activation_checkpointing; older
    releases, which Python 3.10 resolves to, is_gradient_checkpointing)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(model.is_gradient_checkpointing if flag is None else flag)


def test_load_causal_lm_float32_matches_weights(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    assert model.dtype == torch.float32
    assert not checkpointing(model)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    torch.testing.assert_close(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("dtype", "expected"), [("bfloat16", torch.bfloat16), (torch.float16, torch.float16)]
)
def test_load_causal_lm_dtype(tiny_model_dir, dtype, expected):
    assert load_causal_lm(tiny_model_dir, dtype=dtype).dtype == expected


def test_load_causal_lm_auto_dtype_keeps_checkpoint_dtype(tiny_model_dir):
    assert load_causal_lm(tiny_model_dir, dtype="auto").dtype == torch.float32


def test_unknown_dtype():
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'"):
        as_torch_dtype("float8")


def test_attn_implementation_and_gradient_checkpointing(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, attn_implementation="eager", enable_gradient_checkpointing=True)
    assert model.config._attn_implementation == "eager"
    assert checkpointing(model)
    assert model.config.use_cache is False
    model.train()
    ids = torch.tensor([[4, 5, 6, 7]])
    model(ids).logits.sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
    sdpa = load_causal_lm(tiny_model_dir, override_config={"attn_implementation": "sdpa"})
    assert sdpa.config._attn_implementation == "sdpa"


def test_override_config_is_applied_before_instantiation(tiny_model_dir):
    model = load_causal_lm(
        tiny_model_dir,
        override_config={"attention_dropout": 0.25, "rope_theta": 5e5, "max_position_embeddings": 128},
    )
    assert model.config.attention_dropout == 0.25
    assert model.config.rope_parameters["rope_theta"] == 5e5
    assert model.config.max_position_embeddings == 128
    assert model.model.layers[0].self_attn.attention_dropout == 0.25


def test_override_config_merges_dicts(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, override_config={"rope_parameters": {"rope_theta": 123.0}})
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 123.0}


def test_override_config_accepts_omegaconf(tiny_model_dir):
    from omegaconf import OmegaConf

    overrides = OmegaConf.create({"rope_parameters": {"rope_theta": 77.0}, "attention_dropout": 0.5})
    model = load_causal_lm(tiny_model_dir, override_config=overrides)
    assert model.config.rope_parameters["rope_theta"] == 77.0
    assert model.config.attention_dropout == 0.5


def test_unknown_override_key_names_key_and_class(tiny_model_dir):
    with pytest.raises(
        ValueError, match=r"override_config key 'hiden_size' is not a field of Qwen2Config; did you mean"
    ):
        load_causal_lm(tiny_model_dir, override_config={"hiden_size": 64})


def test_apply_config_overrides_recurses_into_sub_configs():
    from transformers import PretrainedConfig, Qwen2Config

    outer = PretrainedConfig()
    outer.text_config = Qwen2Config(hidden_size=64)
    apply_config_overrides(outer, {"text_config": {"hidden_size": 32}})
    assert outer.text_config.hidden_size == 32


def _batch():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    return ids, mask, compute_position_ids(mask)


def test_value_model_fresh_head_and_save_reload(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    critic = load_value_model(tiny_model_dir)
    hidden = critic.config.hidden_size
    assert critic.score.out_features == 1 and critic.config.num_labels == 1
    assert critic.dropout.p == 0.0
    assert critic.score.bias.abs().max() == 0
    assert critic.score.weight.std().item() == pytest.approx(1 / (hidden + 1), rel=0.3)
    lm = load_causal_lm(tiny_model_dir)
    torch.testing.assert_close(
        critic.model.layers[1].mlp.down_proj.weight, lm.model.layers[1].mlp.down_proj.weight
    )

    with torch.no_grad():
        critic.score.weight.add_(0.5)  # a "trained" head, different from any fresh init
        critic.score.bias.fill_(0.25)
        values = values_from_model(critic, *_batch(), response_length=3)
    out = save_value_model(critic, tmp_path / "critic", tokenizer=load_tokenizer(tiny_model_dir))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]
    reloaded = load_value_model(out)
    for (name, a), b in zip(critic.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        torch.testing.assert_close(values_from_model(reloaded, *_batch(), response_length=3), values)
    assert (out / "tokenizer.json").exists()


def test_value_model_dtype_and_checkpointing(tiny_model_dir):
    critic = load_value_model(tiny_model_dir, dtype="bfloat16", enable_gradient_checkpointing=True)
    assert critic.dtype == torch.bfloat16
    assert checkpointing(critic)
    with torch.no_grad():
        assert values_from_model(critic, *_batch(), response_length=2).dtype == torch.float32


def test_value_model_override_classifier_dropout(tiny_model_dir):
    critic = load_value_model(tiny_model_dir, override_config={"classifier_dropout": 0.2})
    assert critic.dropout.p == 0.2


def test_reward_model_round_trip(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    rm = load_reward_model(tiny_model_dir, allow_fresh_head=True)
    assert not rm.training and rm.score.out_features == 1
    rm.save_pretrained(tmp_path / "rm")
    reloaded = load_reward_model(tmp_path / "rm")
    assert torch.equal(reloaded.score.weight, rm.score.weight)


def test_reward_model_requires_a_classifier_checkpoint(tiny_model_dir):
    with pytest.raises(ValueError, match=r"reward_model\.model\.path=.*not a reward model; point it to an"):
        load_reward_model(tiny_model_dir)


def test_reward_model_with_several_labels_is_rejected(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3).save_pretrained(
        tmp_path / "c"
    )
    with pytest.raises(ValueError, match=r"num_labels=3; a reward model needs num_labels=1"):
        load_reward_model(tmp_path / "c")


def test_value_model_from_a_causal_lm_is_quiet_but_other_gaps_warn(tiny_model_dir, tmp_path, capfd):
    import warnings

    from safetensors.torch import load_file, save_file

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_value_model(tiny_model_dir)  # only the new `score` head is missing: no warning
    assert "MISSING" not in capfd.readouterr().err  # and no transformers load report listing it
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"missing \['model.layers.1.mlp.down_proj.weight'\]"):
        load_value_model(broken)


# ------------------------------------------- a model directory the user broke: one line naming the file and the fix

def _train_one_line(capsys, model_path, tmp_path) -> str:
    from hyflow.cli import main
    from hyflow.data.io import write_rows

    row = {"data_source": "hyflow/arithmetic", "prompt": [{"role": "user", "content": "1 + 2?"}],
           "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": 0}}
    train = write_rows([row, row], tmp_path / "train.jsonl")
    status = main(["train", f"actor_rollout_ref.model.path={model_path}", f"data.train_files={train}",
                   f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=2",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.logger=[file]"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hyflow ")]
    assert status == 2 and len(lines) == 1, err
    assert "maybe a bug" not in lines[0] and "Traceback" not in err
    return lines[0]


def _copy_model(tiny_model_dir, out, keep=None):
    out.mkdir()
    for file in tiny_model_dir.iterdir():
        if keep is None or file.name in keep:
            shutil.copy(file, out / file.name)
    return out


def test_a_model_directory_without_tokenizer_files_is_one_line(tiny_model_dir, tmp_path, capsys):
    bare = _copy_model(tiny_model_dir, tmp_path / "bare", keep={"config.json", "model.safetensors",
                                                                "generation_config.json"})
    with pytest.raises(ValueError, match="has no tokenizer files"):
        load_tokenizer(bare)
    err = _train_one_line(capsys, bare, tmp_path)
    assert f"{bare} has no tokenizer files" in err and "actor_rollout_ref.model.tokenizer_path" in err


def test_a_malformed_safetensors_header_names_the_file(tiny_model_dir, tmp_path, capsys):
    broken = _copy_model(tiny_model_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[:8] + b"{garbage" + raw[16:])
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file"):
        load_causal_lm(broken)
    err = _train_one_line(capsys, broken, tmp_path)
    assert f"{weights} is not a readable safetensors file" in err


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (self.marker,))


def test_a_pickled_object_in_pytorch_model_bin_is_refused_without_torchs_advice(tiny_model_dir, tmp_path, capsys):
    from hyflow.serialization import CheckpointSecurityError

    crafted = _copy_model(tiny_model_dir, tmp_path / "crafted")
    state = load_file(crafted / "model.safetensors")
    (crafted / "model.safetensors").unlink()
    torch.save({**state, "payload": _Exploit(tmp_path / "pwned")}, crafted / "pytorch_model.bin")
    with pytest.raises(CheckpointSecurityError, match="pytorch_model.bin holds more than tensors") as caught:
        load_causal_lm(crafted)
    assert "weights_only" not in str(caught.value) and "can still be loaded" not in str(caught.value)
    err = _train_one_line(capsys, crafted, tmp_path)
    assert f"{crafted / 'pytorch_model.bin'} holds more than tensors" in err and "weights_only" not in err
    assert not (tmp_path / "pwned").exists()


def test_a_mistyped_local_path_fails_at_once_naming_it(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """`models/tiyn` looks like a hub id `org/name`, but `models/` is a local folder: a typo, not a hub model."""
    import time

    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the hub would be tried (and retried) if it were asked
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref\.model\.path='models/tiyn' does not exist"):
        resolve_model_path("models/tiyn")
    start = time.perf_counter()
    err = _train_one_line(capsys, "models/tiyn", tmp_path)
    assert time.perf_counter() - start < 5
    assert "'models/tiyn' does not exist" in err and "actor_rollout_ref.model.path" in err
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # no local folder Qwen/: a hub id


def test_a_hub_id_that_cannot_be_fetched_is_one_line(tmp_path, capsys, monkeypatch):
    """With the hub unreachable (offline) and nothing cached, a hub id is a one-line error naming it, not a bug."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    err = _train_one_line(capsys, "hyflow-test-org/no-such-model", tmp_path)
    assert "'hyflow-test-org/no-such-model'" in err and "actor_rollout_ref.model.path" in err
