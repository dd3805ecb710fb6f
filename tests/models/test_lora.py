"""LoRA through peft (hyflow.models.lora): settings, adapters, base-model forwards, merged weights, adapter state,
export; one slow 2-rank FSDP2 (gloo) test. Everything on the tiny local Qwen2 in float32."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from peft import PeftModel
from ranks import init_gloo, spawn_ranks
from safetensors.torch import load_file

from hyflow.config.lora import lora_settings
from hyflow.config.schema import CriticModelConfig, ModelConfig
from hyflow.models.forward import unwrap_model
from hyflow.models.loading import load_causal_lm, load_value_model, save_value_model
from hyflow.models.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    adapter_disabled,
    adapter_state_dict,
    apply_lora,
    describe_parameters,
    load_adapter_state_dict,
    merge_adapter_into_state,
    merged_named_tensors,
    parameter_counts,
    read_adapter_dir,
    save_adapter,
    targeted_modules,
)
from hyflow.specs import LoraSettings
from hyflow.workers.fsdp import iter_full_tensors

# peft's PeftModel.from_pretrained reads a deprecated transformers property (apply_lora silences it itself)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

RANK, ALPHA = 4, 8
ALL_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _settings(**kwargs) -> LoraSettings:
    return LoraSettings(**{"rank": RANK, "alpha": ALPHA, **kwargs})


def _ids(seed: int = 1, batch: int = 3, length: int = 10) -> torch.Tensor:
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _out(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def _lora_model(model_dir, *, seed: int = 0, task: str = "causal_lm", **kwargs):
    model = load_causal_lm(model_dir) if task == "causal_lm" else load_value_model(model_dir)
    torch.manual_seed(seed)
    return apply_lora(model, _settings(**kwargs), task=task)


def _train(model, steps: int = 3, seed: int = 2) -> None:
    """A few Adam steps on random targets: moves every LoRA factor (and the value head) well away from init."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(steps):
        ids = torch.randint(3, 500, (4, 12), generator=gen)
        logits = model(input_ids=ids).logits
        if logits.shape[-1] == 1:
            loss = (logits[..., 0] - torch.randn(ids.shape, generator=gen)).pow(2).mean()
        else:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.randint(3, 500, (ids.numel(),),
                                                                                         generator=gen))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """A LoRA causal LM after 3 optimizer steps, with its logits on `_ids()`."""
    model = _lora_model(tiny_model_dir)
    _train(model)
    return model, _out(model, _ids())


@pytest.fixture(scope="module")
def base_logits(tiny_model_dir):
    return _out(load_causal_lm(tiny_model_dir), _ids())


# ---------------------------------------------------------------------------------------------- settings


def test_lora_settings_from_config_sections():
    assert lora_settings(ModelConfig()) is None  # lora_rank 0, no adapter: full fine-tuning
    assert lora_settings(CriticModelConfig(), config_key="critic.model") is None
    settings = lora_settings(ModelConfig(lora_rank=8, lora_alpha=32))
    assert (settings.rank, settings.alpha, settings.target_modules, settings.exclude_modules) == (8, 32, "all-linear",
                                                                                                  None)
    assert settings.scaling == 4.0 and settings.dropout == 0.0
    critic = lora_settings(CriticModelConfig(lora_rank=4, target_modules=["q_proj", "v_proj"]),
                           config_key="critic.model")  # the critic section has no exclude / adapter-path keys
    assert critic.target_modules == ["q_proj", "v_proj"] and critic.config_key == "critic.model"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("all-linear", "all-linear"),
        ("ALL-LINEAR", "all-linear"),
        ("q_proj,v_proj", ["q_proj", "v_proj"]),
        ("q_proj, v_proj ", ["q_proj", "v_proj"]),
        ("[q_proj, 'v_proj']", ["q_proj", "v_proj"]),
        ("q_proj", ["q_proj"]),
        ("self_attn.q_proj", ["self_attn.q_proj"]),
        (r".*\.(q|v)_proj", r".*\.(q|v)_proj"),
        (("q_proj", "up_proj"), ["q_proj", "up_proj"]),
        (["all-linear"], "all-linear"),
    ],
)
def test_target_modules_forms(given, expected):
    assert lora_settings({"lora_rank": 2, "target_modules": given}).target_modules == expected


def test_omegaconf_section_and_adapter_only():
    from omegaconf import OmegaConf

    section = OmegaConf.create({"lora_rank": 2, "target_modules": ["q_proj", "k_proj"], "exclude_modules": "o_proj"})
    settings = lora_settings(section)
    assert settings.target_modules == ["q_proj", "k_proj"] and settings.exclude_modules == ["o_proj"]
    only_adapter = lora_settings({"lora_rank": 0, "lora_adapter_path": "/some/adapter"})
    assert only_adapter.rank == 0 and only_adapter.adapter_path == "/some/adapter"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"lora_rank": -1}, r"lora_rank=-1 must be an integer >= 0"),
        ({"lora_rank": 4, "lora_alpha": 0}, r"lora_alpha=0 must be a positive number"),
        ({"lora_rank": 4, "target_modules": " , "}, r"target_modules=' , ' names no module"),
        ({"lora_rank": 4, "target_modules": ["all-linear", "q_proj"]}, r"mixes 'all-linear' with module names"),
        ({"lora_rank": 4, "exclude_modules": "all-linear"}, r"exclude_modules='all-linear' would exclude every"),
        ({"lora_rank": 4, "target_modules": "q_proj|(v"}, r"target_modules='q_proj\|\(v' is neither a list .* regex"),
    ],
)
def test_bad_settings(section, message):
    with pytest.raises(ValueError, match=message):
        lora_settings(section)


# ---------------------------------------------------------------------------------------------- building


def test_fresh_adapter_is_the_base_model_and_only_adapters_train(tiny_model_dir, base_logits):
    model = _lora_model(tiny_model_dir)
    assert isinstance(model, PeftModel)
    torch.testing.assert_close(_out(model, _ids()), base_logits, atol=0, rtol=0)  # B = 0
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(re.search(r"\.lora_[AB]\.default\.weight$", name) for name in trainable)
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable}
    assert adapted == ALL_TARGETS  # all-linear: every linear layer but the (tied) lm_head
    assert not any("lm_head" in name for name in trainable)
    plain = load_causal_lm(tiny_model_dir)
    linear = [m for m in plain.modules() if isinstance(m, torch.nn.Linear) and m is not plain.lm_head]
    expected = sum(RANK * (m.in_features + m.out_features) for m in linear)
    total = sum(p.numel() for p in plain.parameters()) + expected
    assert parameter_counts(model) == (expected, total)
    assert describe_parameters(model) == f"trainable params: {expected:,} of {total:,} ({100 * expected / total:.2f} %)"
    assert re.fullmatch(r"trainable params: [\d,]+ of [\d,]+ \(\d+\.\d\d %\)", describe_parameters(model))


def test_initialisation_is_deterministic_given_the_seed(tiny_model_dir):
    first = adapter_state_dict(_lora_model(tiny_model_dir, seed=5))
    again = adapter_state_dict(_lora_model(tiny_model_dir, seed=5))
    other = adapter_state_dict(_lora_model(tiny_model_dir, seed=6))
    assert first.keys() == again.keys() == other.keys()
    for key in first:
        assert torch.equal(first[key], again[key]), key
    a_key = next(k for k in first if k.endswith("lora_A.weight"))
    assert not torch.equal(first[a_key], other[a_key])
    assert all(not v.any() for k, v in first.items() if k.endswith("lora_B.weight"))


def test_target_list_and_exclusions(tiny_model_dir):
    model = _lora_model(tiny_model_dir, target_modules=["q_proj", "v_proj"],
                        exclude_modules=r"model\.layers\.1\..*")
    adapted = sorted({n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad})
    assert adapted == ["base_model.model.model.layers.0.self_attn.q_proj",
                       "base_model.model.model.layers.0.self_attn.v_proj"]


def test_value_model_trains_its_head_in_full(tiny_model_dir):
    base = load_value_model(tiny_model_dir)
    torch.manual_seed(0)
    reference = copy.deepcopy(base)
    model = apply_lora(base, _settings(), task="value")
    ids = _ids()
    torch.testing.assert_close(_out(model, ids), _out(reference, ids), atol=0, rtol=0)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    head = [name for name in trainable if ".score." in name]
    assert head == ["base_model.model.score.modules_to_save.default.weight",
                    "base_model.model.score.modules_to_save.default.bias"] or head == [
        "base_model.model.score.modules_to_save.default.weight"]
    assert not any("score" in name and "lora_" in name for name, _ in model.named_parameters())
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable if "lora_" in n} == ALL_TARGETS
    assert any(k.startswith("base_model.model.score.") for k in adapter_state_dict(model))


# ---------------------------------------------------------------------------------------------- base forwards


def test_adapter_disabled_runs_the_base_model(trained, base_logits):
    model, logits = trained
    assert (logits - base_logits).abs().max() > 1e-2  # training moved the policy away from the base
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    with adapter_disabled(model):
        torch.testing.assert_close(_out(model, _ids()), base_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(_out(model, _ids()), logits, atol=0, rtol=0)
    assert flags == {name: p.requires_grad for name, p in model.named_parameters()}


def test_adapter_disabled_and_merged_tensors_through_ddp(trained, base_logits, tmp_path):
    import torch.distributed as dist

    model, logits = trained
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with adapter_disabled(ddp):
            torch.testing.assert_close(_out(ddp, _ids()), base_logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(_out(ddp, _ids()), logits, atol=0, rtol=0)
        assert [n for n, _ in merged_named_tensors(ddp)] == [n for n, _ in merged_named_tensors(model)]
        assert adapter_state_dict(ddp).keys() == adapter_state_dict(model).keys()
    finally:
        dist.destroy_process_group()


def test_plain_model_is_refused(tiny_model_dir):
    plain = load_causal_lm(tiny_model_dir)
    with pytest.raises(TypeError, match="has no LoRA adapter .* call hyflow.models.lora.apply_lora"), \
            adapter_disabled(plain):
        pass
    with pytest.raises(TypeError, match="has no LoRA adapter"):
        adapter_state_dict(plain)
    model = apply_lora(plain, _settings())
    with pytest.raises(TypeError, match="apply_lora expects a plain Hugging Face model, got PeftModelForCausalLM"):
        apply_lora(model, _settings())


# ---------------------------------------------------------------------------------------------- merged weights


def test_merged_tensors_reproduce_the_trained_model(tiny_model_dir, trained):
    model, logits = trained
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = list(merged_named_tensors(model))
    plain = load_causal_lm(tiny_model_dir)
    assert [name for name, _ in merged] == [name for name, _ in iter_full_tensors(plain)]
    for name, tensor in merged:
        assert "base_layer" not in name and "lora_" not in name and not name.startswith("base_model")
        assert tensor.shape == plain.state_dict()[name].shape, name
    result = plain.load_state_dict(dict(merged), strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}  # tied to embed_tokens
    torch.testing.assert_close(_out(plain, _ids()), logits, atol=2e-5, rtol=1e-5)
    # the trained model is unchanged: same tensors, same outputs
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    torch.testing.assert_close(_out(model, _ids()), logits, atol=0, rtol=0)
    # W' = W + (alpha / r) B @ A, checked directly on one layer
    layer = unwrap_model(model).model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + (ALPHA / RANK) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(dict(merged)["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6, rtol=0)


def test_merged_tensors_of_a_model_without_lora_are_its_own(tiny_model_dir):
    plain = load_causal_lm(tiny_model_dir)
    got, expected = list(merged_named_tensors(plain)), list(iter_full_tensors(plain))
    assert [n for n, _ in got] == [n for n, _ in expected]
    assert all(a is b or torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))


def test_adapters_get_gradients_with_activation_checkpointing(tiny_model_dir):
    """hyflow checkpoints layers non-reentrantly, so LoRA factors inside a checkpointed layer get gradients even
    though the (frozen) embedding output does not require grad."""
    model = load_causal_lm(tiny_model_dir, enable_gradient_checkpointing=True)
    torch.manual_seed(0)
    model = apply_lora(model, _settings())
    model.train()
    model(input_ids=_ids()).logits.pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)  # dL/dB = (dL/dy) (A x)^T != 0


def test_merged_tensors_of_a_value_model(tiny_model_dir):
    base = load_value_model(tiny_model_dir)
    reference = copy.deepcopy(base)
    model = apply_lora(base, _settings(), task="value")
    _train(model)
    values = _out(model, _ids())
    merged = dict(merged_named_tensors(model))
    plain = load_value_model(tiny_model_dir)
    assert list(merged) == [name for name, _ in iter_full_tensors(plain)]
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(_out(plain, _ids()), values, atol=2e-5, rtol=1e-5)
    head = unwrap_model(model).score
    assert torch.equal(merged["score.weight"], head.modules_to_save["default"].weight)
    assert not torch.equal(merged["score.weight"], head.original_module.weight)
    with adapter_disabled(model):  # the base model, including the head as loaded
        torch.testing.assert_close(_out(model, _ids()), _out(reference, _ids()), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- adapter state


def test_adapter_state_round_trip_is_strict(tiny_model_dir, trained):
    model, logits = trained
    state = adapter_state_dict(model)
    assert all(k.startswith("base_model.model.model.layers.") and re.search(r"\.lora_[AB]\.weight$", k) for k in state)
    assert len(state) == 2 * 2 * len(ALL_TARGETS)  # A and B for 7 modules in 2 layers
    assert all(v.device.type == "cpu" for v in state.values())
    fresh = _lora_model(tiny_model_dir, seed=9)
    load_adapter_state_dict(fresh, state)
    torch.testing.assert_close(_out(fresh, _ids()), logits, atol=0, rtol=0)
    state_is_a_copy = next(iter(state))
    state[state_is_a_copy].add_(1.0)
    assert not torch.equal(adapter_state_dict(model)[state_is_a_copy], state[state_is_a_copy])

    some = sorted(state)[0]
    with pytest.raises(ValueError, match=rf"missing {re.escape(some)}"):
        load_adapter_state_dict(fresh, {k: v for k, v in state.items() if k != some})
    with pytest.raises(ValueError, match=r"unexpected base_model\.model\.extra\.lora_A\.weight"):
        load_adapter_state_dict(fresh, {**state, "base_model.model.extra.lora_A.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"shape mismatch .*\(4, 128\) vs \(8, 128\)"):
        load_adapter_state_dict(_lora_model(tiny_model_dir, rank=8), state)


def test_save_adapter_loads_with_peft(tiny_model_dir, trained, tmp_path):
    model, logits = trained
    out = save_adapter(model, None, tmp_path / "adapter")
    assert (out / ADAPTER_CONFIG_FILE).is_file() and (out / ADAPTER_WEIGHTS_FILE).is_file()
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    assert load_file(out / ADAPTER_WEIGHTS_FILE).keys() == adapter_state_dict(model).keys()
    reloaded = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), out)
    torch.testing.assert_close(_out(reloaded, _ids()), logits, atol=0, rtol=0)
    # from a checkpoint's adapter state + the run's settings (what `hyflow export` has)
    out2 = save_adapter(adapter_state_dict(model), _settings(), tmp_path / "from_state",
                        base_model_name_or_path="my/base")
    assert json.loads((out2 / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"] == "my/base"
    reloaded2 = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), out2)
    torch.testing.assert_close(_out(reloaded2, _ids()), logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="a state dict needs its LoraSettings or LoraConfig"):
        save_adapter(adapter_state_dict(model), None, tmp_path / "x")


def test_training_starts_from_an_adapter_directory(tiny_model_dir, trained, tmp_path, capsys):
    model, logits = trained
    out = save_adapter(model, None, tmp_path / "adapter")
    resumed = apply_lora(load_causal_lm(tiny_model_dir), LoraSettings(rank=0, adapter_path=str(out)))
    torch.testing.assert_close(_out(resumed, _ids()), logits, atol=0, rtol=0)
    trainable = [name for name, p in resumed.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * len(ALL_TARGETS) and all("lora_" in name for name in trainable)
    assert "LoRA note" not in capsys.readouterr().out
    # config keys that disagree with the adapter: the adapter's own config wins (verl), with a note
    apply_lora(load_causal_lm(tiny_model_dir),
               LoraSettings(rank=8, alpha=32, target_modules=["q_proj"], adapter_path=str(out)))
    printed = capsys.readouterr().out
    assert "adapter's own config" in printed and "lora_rank=8 -> r=4" in printed and "lora_alpha=32 -> lora_alpha=8"\
        in printed and "target_modules=['q_proj']" in printed


def test_value_training_starts_from_an_adapter_directory(tiny_model_dir, tmp_path):
    model = _lora_model(tiny_model_dir, task="value")
    _train(model)
    out = save_adapter(model, None, tmp_path / "adapter")
    resumed = apply_lora(load_value_model(tiny_model_dir), LoraSettings(rank=0, adapter_path=str(out)), task="value")
    torch.testing.assert_close(_out(resumed, _ids()), _out(model, _ids()), atol=0, rtol=0)  # trained head included
    trainable = [name for name, p in resumed.named_parameters() if p.requires_grad]
    assert "base_model.model.score.modules_to_save.default.weight" in trainable
    assert all("lora_" in name or ".score.modules_to_save." in name for name in trainable)


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("task", ["causal_lm", "value"])
def test_offline_merge_equals_merge_and_unload(tiny_model_dir, tmp_path, task):
    if task == "causal_lm":
        model_dir, load = tiny_model_dir, load_causal_lm
    else:  # a critic checkpoint with its head, so base weights can be read from a file
        torch.manual_seed(0)
        model_dir, load = save_value_model(load_value_model(tiny_model_dir), tmp_path / "critic"), load_value_model
    model = apply_lora(load(model_dir), _settings(), task=task)
    _train(model)
    base_state = load_file(model_dir / "model.safetensors")
    merged = merge_adapter_into_state(base_state, adapter_state_dict(model), model.peft_config["default"])
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(base_state)
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[key], atol=1e-6, rtol=0, msg=key)
    assert any(not torch.equal(merged[k], base_state[k]) for k in base_state)
    plain = load(model_dir)
    plain.load_state_dict(merged, strict=False)
    torch.testing.assert_close(_out(plain, _ids()), _out(model, _ids()), atol=2e-5, rtol=1e-5)
    # the same from the exported adapter directory's own files
    out = save_adapter(model, None, tmp_path / "adapter")
    from_files = merge_adapter_into_state(base_state, *read_adapter_dir(out))
    assert all(torch.equal(from_files[k], merged[k]) for k in merged)
    # the same from the model's own trainable state (keys with the adapter name, as a DCP model state has them)
    own = {k: v for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad}
    assert any(".default." in k for k in own)
    from_own = merge_adapter_into_state(base_state, own, model.peft_config["default"])
    assert all(torch.equal(from_own[k], merged[k]) for k in merged)


def test_offline_merge_errors(tiny_model_dir, trained, tmp_path):
    model, _ = trained
    with pytest.raises(ValueError, match=r"is not a peft adapter directory \(does not exist\)"):
        read_adapter_dir(tmp_path / "missing")
    state = adapter_state_dict(model)
    base = load_file(tiny_model_dir / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(KeyError, match="has no 'model.layers.0.self_attn.q_proj.weight'"):
        merge_adapter_into_state({k: v for k, v in base.items() if k != key}, state, _settings())
    with pytest.raises(ValueError, match=r"makes a \(128, 128\) update for a \(64, 128\) weight"):
        merge_adapter_into_state({**base, key: torch.zeros(64, 128)}, state, _settings())
    with pytest.raises(KeyError, match="lacks its B factor"):
        merge_adapter_into_state(base, {k: v for k, v in state.items() if not k.endswith("q_proj.lora_B.weight")},
                                 _settings())


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_modules": ["q_proj", "qproj"]},
         r"target_modules: 'qproj' matches no module of Qwen2ForCausalLM; the model's linear layers are: down_proj, "
         r"gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
        ({"target_modules": r".*\.attn\.q"}, r"matches no module"),
        ({"target_modules": ["mlp"]}, r"'mlp' matches .*\(Qwen2MLP\), which LoRA cannot adapt"),
        ({"target_modules": ["q_proj"], "exclude_modules": ["q_proj"]}, r"excludes every target .* narrow"),
        ({"target_modules": ["lm_head"]},
         r"selects 'lm_head', whose weight is tied to 'model.embed_tokens.weight'.*exclude_modules"),
    ],
)
def test_bad_targets_name_the_problem(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _lora_model(tiny_model_dir, **kwargs)


def test_exclude_that_matches_nothing_warns(tiny_model_dir):
    with pytest.warns(UserWarning, match=r"exclude_modules=\['nothing_here'\] matches no module"):
        targeted_modules(load_causal_lm(tiny_model_dir), _settings(exclude_modules=["nothing_here"]))


def test_bad_adapter_paths(tiny_model_dir, tmp_path):
    def start(path):
        return apply_lora(load_causal_lm(tiny_model_dir),
                          LoraSettings(rank=0, adapter_path=str(path), config_key="actor_rollout_ref.model"))

    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref.model.lora_adapter_path='.*nope' does not exist; "
                                                r"point .* to a peft adapter directory"):
        start(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"holds a full model checkpoint \(config.json\), not a LoRA adapter"):
        start(tiny_model_dir)
    half = tmp_path / "half"
    half.mkdir()
    (half / ADAPTER_CONFIG_FILE).write_text("{}")
    with pytest.raises(ValueError, match=r"has adapter_config.json but no adapter_model.safetensors"):
        start(half)
    (half / ADAPTER_WEIGHTS_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match=r"adapter_config.json is not a peft config \(no peft_type\)"):
        start(half)
    (half / ADAPTER_CONFIG_FILE).write_text('{"peft_type": "IA3"}')
    with pytest.raises(ValueError, match=r"holds a IA3 adapter, not LoRA"):
        start(half)


def test_adapter_of_another_base_model(tiny_model_dir, trained, tmp_path):
    model, _ = trained
    out = save_adapter(model, None, tmp_path / "adapter")
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    state = load_file(out / ADAPTER_WEIGHTS_FILE)
    from safetensors.torch import save_file

    save_file({k: torch.cat([v, v], dim=-1) if k.endswith("lora_A.weight") else v for k, v in state.items()},
              out / ADAPTER_WEIGHTS_FILE)  # as if trained on a model with hidden size 256
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not fit Qwen2ForCausalLM from .*: it was trained on another base model \(RuntimeError: .*size mismatch"):
        apply_lora(load_causal_lm(tiny_model_dir), LoraSettings(rank=0, adapter_path=str(out)))


# ---------------------------------------------------------------------------------------------- FSDP2, 2 ranks


def _fsdp_model(model_dir: str, task: str):
    """The same LoRA model in every process (the critic's fresh head too)."""
    torch.manual_seed(0)
    model = load_causal_lm(model_dir) if task == "causal_lm" else load_value_model(model_dir)
    return apply_lora(model, _settings(), task=task)


def _fsdp_steps(model, wrap, rank_tag: str) -> dict:
    ids = _ids(seed=3, batch=2)
    if wrap is not None:
        wrap(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        logits = model(input_ids=ids).logits
        (logits.float().pow(2).mean() + logits.float().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {"logits": _out(model, ids)}
    with adapter_disabled(model):
        out["base_logits"] = _out(model, ids)
    out["merged"] = {k: v.clone() for k, v in merged_named_tensors(model)}
    out["adapter"] = adapter_state_dict(model)
    out["counts"] = parameter_counts(model)
    shifted = {k: v + 0.25 for k, v in out["adapter"].items()}
    load_adapter_state_dict(model, shifted)
    reread = adapter_state_dict(model)
    assert all(torch.equal(reread[k], shifted[k]) for k in shifted), rank_tag
    out["logits_after_load"] = _out(model, ids)  # the forward uses the loaded shards
    return out


def _fsdp_rank(rank: int, model_dir: str, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from hyflow.parallel.fsdp import wrap_fsdp2

    init_gloo(rank, 2, init_file)
    try:
        results = {}
        for task in ("causal_lm", "value"):
            model = _fsdp_model(model_dir, task)
            results[task] = _fsdp_steps(model, lambda m: wrap_fsdp2(m, mixed_precision=None), f"rank {rank}")
            results[task]["sharded"] = type(unwrap_model(model).model.layers[0].self_attn.q_proj.lora_A["default"]
                                            .weight).__name__
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_ranks_match_one_process(tiny_model_dir, tmp_path):
    """fully_shard of a peft model (layers + root, frozen and trainable parameters in each group) on 2 gloo ranks:
    training, adapter_disabled, merged tensors, adapter state (and its loading) equal the single-process results."""
    spawn_ranks(_fsdp_rank, args=(str(tiny_model_dir), str(tmp_path / "init"), str(tmp_path)))
    for task in ("causal_lm", "value"):
        single = _fsdp_steps(_fsdp_model(str(tiny_model_dir), task), None, "single")
        for rank in (0, 1):
            got = torch.load(tmp_path / f"rank{rank}.pt")[task]
            assert got["sharded"] == "DTensor"
            assert got["counts"] == single["counts"]
            torch.testing.assert_close(got["logits"], single["logits"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got["base_logits"], single["base_logits"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got["logits_after_load"], single["logits_after_load"], atol=1e-5, rtol=1e-5)
            assert (single["logits_after_load"] - single["logits"]).abs().max() > 1e-3
            assert list(got["merged"]) == list(single["merged"])
            for name, tensor in single["merged"].items():
                torch.testing.assert_close(got["merged"][name], tensor, atol=1e-6, rtol=1e-5, msg=f"{task} {name}")
            assert got["adapter"].keys() == single["adapter"].keys()
            for key, tensor in single["adapter"].items():
                torch.testing.assert_close(got["adapter"][key], tensor, atol=1e-6, rtol=1e-5, msg=f"{task} {key}")
