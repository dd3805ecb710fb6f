"""Export one model component of a checkpoint as a Hugging Face model directory (`hyflow export`).

`export_checkpoint(run_dir/global_step_N, out_dir)` writes safetensors weights, `config.json`,
`generation_config.json` and the tokenizer, loadable with `AutoModelForCausalLM.from_pretrained(out_dir)`
(verl's equivalent is `python -m verl.model_merger merge`). The checkpoint is verified (sizes, sha256) first.

Where the model comes from, first match wins:

1. `global_step_N/huggingface/` (saved when `checkpoint.save_contents` has `hf_model`) for the component it
   was saved for: copied as is.
2. Otherwise the model is rebuilt from a config and the component's state dict is loaded into it. The config
   is `global_step_N/hf_config/config.json` (saved by the trainer via `CheckpointManager.save(hf_config=...)`)
   or else the one at `base_model_path` (the model the run started from). The class is the config's
   `architectures[0]` (AutoModelForCausalLM when absent); the weights keep the checkpoint's dtype. A component
   saved sharded (`trainer.checkpoint_format=sharded`: `global_step_N/actor/` holds the
   torch.distributed.checkpoint shards of every rank) is merged first: each tensor is read whole from the
   shards, whatever the number of ranks that wrote them (verl's `model_merger`; here nothing else is needed).
   A critic component (`critic_model`) is rebuilt as the value model hyflow trains: the config's architecture
   as a token classifier with one label (`*ForTokenClassification`), which `load_value_model` reloads with its
   head.

State-dict keys written by wrapped modules are normalised first: a leading `module.` (DDP) is stripped,
and `_orig_mod.` (torch.compile), `_fsdp_wrapped_module.` (FSDP1) and `_checkpoint_wrapped_module.`
(activation checkpointing) are removed wherever they occur. Every key must then match the model: missing
or unexpected keys, or a shape mismatch, are an error listing them (a key that is missing only because its
tensor is tied to a present one, like `lm_head.weight` with tied embeddings, is fine).

Generation config: `hf_config/generation_config.json`, else the base model's, else the one transformers
derives from the model config. Tokenizer: `global_step_N/tokenizer/` (copied byte for byte), else the base
model's; without either the export has no tokenizer (a warning).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
)

from hyflow.models.loading import as_vision_value_model, load_causal_lm, load_value_model, resolve_model_path
from hyflow.models.vision import is_vision_config
from hyflow.serialization import CheckpointSecurityError, load_plain_data
from hyflow.trainer.checkpoint import (
    CONFIG_YAML,
    HF_CONFIG_DIR,
    HF_MODEL_DIR,
    TOKENIZER_DIR,
    CheckpointManager,
    read_manifest,
    verify_checkpoint,
)
from hyflow.workers.fsdp import EXTRA_STATE_FILE, read_sharded_model_state

LEADING_WRAPPER_PREFIX = "module"
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_MAX_KEYS_SHOWN = 10


def strip_wrapper_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys as the bare model names them: leading `module.` removed, `_orig_mod.` / `_fsdp_wrapped_module.`
    / `_checkpoint_wrapped_module.` removed anywhere; two keys that collapse to one are an error."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        parts = [p for p in key.split(".") if p not in WRAPPER_SEGMENTS]
        while len(parts) > 1 and parts[0] == LEADING_WRAPPER_PREFIX:
            parts = parts[1:]
        clean = ".".join(parts)
        if clean in out:
            raise ValueError(f"state-dict keys collide after removing wrapper prefixes: {key!r} -> {clean!r}")
        out[clean] = tensor
    return out


def _show(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_KEYS_SHOWN])
    more = f", … ({len(keys) - _MAX_KEYS_SHOWN} more)" if len(keys) > _MAX_KEYS_SHOWN else ""
    return f"[{shown}{more}]"


def _prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"export directory {out} exists and is not empty; delete it or choose another --out"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


_MODEL_PATH_KEYS = {"critic_model": ("critic.model.path", "actor_rollout_ref.model.path"),
                    "model": ("model.partial_pretrain",)}


def _run_model_path(ckpt: Path, component: str) -> tuple[str, str | None]:
    """(config key, value) of the model path the component's run started from, read from the checkpoint's
    config.yaml (a critic without its own path starts from the actor's); the value is None when unreadable."""
    keys = _MODEL_PATH_KEYS.get(component, ("actor_rollout_ref.model.path",))
    try:
        config: Any = yaml.safe_load((ckpt / CONFIG_YAML).read_text())
    except (OSError, yaml.YAMLError):
        return keys[0], None
    for key in keys:
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node:
            return key, str(node)
    return keys[0], None


def _base_model_hint(ckpt: Path, component: str) -> str:
    """`key=value` of the run's own model path from the checkpoint's config.yaml, when readable."""
    key, value = _run_model_path(ckpt, component)
    return f"the run's {key}" if value is None else f"{key}={value} in the run's config.yaml"


def _load_model_config(ckpt: Path, component: str, base: str | None) -> tuple[Any, str]:
    """(config, where it came from): the checkpoint's hf_config/, else the base model's."""
    if (ckpt / HF_CONFIG_DIR / "config.json").is_file():
        return AutoConfig.from_pretrained(ckpt / HF_CONFIG_DIR), str(ckpt / HF_CONFIG_DIR)
    if base is not None:
        return AutoConfig.from_pretrained(base), base
    raise FileNotFoundError(
        f"cannot export {ckpt}: it has no {HF_MODEL_DIR}/ (checkpoint.save_contents without hf_model) and no "
        f"{HF_CONFIG_DIR}/config.json (the model config), and no base_model_path was given. Fix: pass "
        f"base_model_path=<the model the run started from> ({_base_model_hint(ckpt, component)})"
    )


def _build_model(config: Any, component: str) -> torch.nn.Module:
    """A randomly initialised model of the config's `architectures[0]` (a causal LM when unnamed); for a critic
    component, the token classifier with one label that `hyflow.models.loading.load_value_model` builds."""
    architectures = getattr(config, "architectures", None) or []
    if component.startswith("critic") and is_vision_config(config):  # the VLM with its value head
        from transformers import AutoModelForImageTextToText

        return as_vision_value_model(AutoModelForImageTextToText.from_config(config))
    if component.startswith("critic") and not any(a.endswith("ForTokenClassification") for a in architectures):
        config.num_labels, config.classifier_dropout = 1, 0.0
        return AutoModelForTokenClassification.from_config(config)
    cls = getattr(transformers, architectures[0], None) if architectures else None
    return cls(config) if cls is not None else AutoModelForCausalLM.from_config(config)


def _uniform_float_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _check_keys(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Every model key present (or tied to a present one), no extra keys, equal shapes; else ValueError."""
    expected = model.state_dict()
    storage_keys: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        storage_keys.setdefault(tensor.data_ptr(), []).append(key)
    missing = [
        k
        for k in expected
        if k not in state and not any(twin in state for twin in storage_keys[expected[k].data_ptr()])
    ]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in state
        if k in expected and state[k].shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s) {_show(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) {_show(unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es) {_show(shapes)}")
    if problems:
        raise ValueError(
            f"{where} does not fit the model: {'; '.join(problems)}. Fix: export with the config of the model "
            "the run trained (base_model_path), or choose the right component"
        )


def _add_tokenizer(ckpt: Path, out: Path, base: str | None) -> bool:
    """Put a tokenizer into `out` unless it has one: the checkpoint's (bytes copied), else the base model's.
    False when there is none to add."""
    if (out / "tokenizer_config.json").is_file():
        return True
    if (ckpt / TOKENIZER_DIR).is_dir():
        shutil.copytree(ckpt / TOKENIZER_DIR, out, dirs_exist_ok=True)
        return True
    if base is not None:
        AutoTokenizer.from_pretrained(base).save_pretrained(out)
        return True
    return False


def _generation_config(ckpt: Path, base: str | None) -> GenerationConfig | None:
    for directory in (ckpt / HF_CONFIG_DIR, Path(base) if base else None):
        if directory is not None and (directory / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(directory)
    return None


def _sharded_model_components(manifest: dict) -> dict[str, str]:
    """model component name (e.g. `actor_model`) -> the sharded directory holding it (e.g. `actor`)."""
    return {entry["model_component"]: entry["dir"] for entry in (manifest.get("sharded") or {}).values()
            if entry.get("model_component")}


def _model_components(manifest: dict) -> list[str]:
    return [n for n, e in manifest["components"].items() if e["format"] == "safetensors"] + list(
        _sharded_model_components(manifest))


def _read_state(ckpt: Path, manifest: dict, component: str) -> Any:
    """The component's state dict: a saved one, or the merge of every rank's shards of a sharded directory."""
    shards = _sharded_model_components(manifest)
    if component in shards and component not in manifest["components"]:
        return read_sharded_model_state(ckpt / shards[component])
    entry = manifest["components"].get(component, {})
    is_model = component == "model" or component.endswith("_model")
    if is_model and entry.get("format") != "safetensors":  # hyflow writes model weights as safetensors only
        raise CheckpointSecurityError(
            f"{ckpt}: component {component!r} is stored as {entry.get('format')!r} ({entry.get('file')}), not as "
            "safetensors; hyflow writes model weights only as safetensors and refuses to unpickle a model: "
            "export a checkpoint written by hyflow")
    return CheckpointManager(ckpt.parent).load(ckpt, names=[component], verify=False)[component]


def lora_of(ckpt: Path, manifest: dict, component: str) -> dict | None:
    """The LoRA settings `component` was trained with (its `<prefix>lora` entry: `actor_lora` for `actor_model`,
    `lora` for an SFT `model`), None for a fully trained model. A LoRA component holds the adapter only."""
    name = component[: -len("model")] + "lora" if component.endswith("model") else None
    if name is None:
        return None
    if name in manifest["components"]:
        return CheckpointManager(ckpt.parent).load(ckpt, names=[name], verify=False)[name]
    shards = _sharded_model_components(manifest)
    extra = ckpt / shards[component] / EXTRA_STATE_FILE if component in shards else None
    if extra is not None and extra.is_file():
        return load_plain_data(extra).get(name)
    return None


def _adapter_state(ckpt: Path, manifest: dict, component: str) -> dict[str, torch.Tensor]:
    raw = _read_state(ckpt, manifest, component)
    if not isinstance(raw, dict) or not raw or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise ValueError(f"component {component!r} of {ckpt} is not an adapter state dict (name -> tensor)")
    return strip_wrapper_prefixes(raw)


def _lora_base(ckpt: Path, component: str, base: str | None) -> str:
    path = base or _run_model_path(ckpt, component)[1]
    if path is None:
        raise FileNotFoundError(f"{ckpt}: component {component!r} is a LoRA adapter; merging it needs the base model "
                                "the run trained it on, and the checkpoint's config.yaml names none. Fix: pass "
                                "base_model_path=<that model> (hyflow export --base-model)")
    return str(resolve_model_path(path, config_key="base_model_path"))


def _merged_lora_state(ckpt: Path, manifest: dict, component: str, base: str | None, settings: dict
                       ) -> tuple[dict[str, torch.Tensor], str]:
    """(base weights + the checkpoint's adapter merged, base path): W' = W + (alpha / r) B A per adapted module."""
    from hyflow.models.lora import merge_adapter_into_state
    from hyflow.specs import LoraSettings

    path = _lora_base(ckpt, component, base)
    loader = load_value_model if component.startswith("critic") else load_causal_lm
    base_state = loader(path, dtype="float32").state_dict()
    lora = LoraSettings(**settings)
    return merge_adapter_into_state(base_state, _adapter_state(ckpt, manifest, component), lora), path


def _write_adapter(ckpt: Path, manifest: dict, out: Path, component: str, base: str | None) -> None:
    """`hyflow export --adapter`: the component's LoRA adapter as a peft adapter directory."""
    from hyflow.models.lora import save_adapter
    from hyflow.specs import LoraSettings

    settings = lora_of(ckpt, manifest, component)
    if settings is None:
        raise ValueError(f"component {component!r} of {ckpt} was trained without LoRA (lora_rank=0): it has no "
                         "adapter to export; drop --adapter to export the model")
    path = base or _run_model_path(ckpt, component)[1]
    save_adapter(_adapter_state(ckpt, manifest, component), LoraSettings(**settings), out,
                 base_model_name_or_path=path, task="value" if component.startswith("critic") else "causal_lm")


def _build_from_state_dict(ckpt: Path, manifest: dict, out: Path, component: str, base: str | None) -> None:
    config, source = _load_model_config(ckpt, component, base)
    lora = lora_of(ckpt, manifest, component)
    if lora is not None:
        state, base_path = _merged_lora_state(ckpt, manifest, component, base, lora)
        source += f", LoRA adapter merged into {base_path}"
    else:
        raw = _read_state(ckpt, manifest, component)
        if not isinstance(raw, dict) or not raw or not all(isinstance(v, torch.Tensor) for v in raw.values()):
            models = _model_components(manifest)
            raise ValueError(
                f"component {component!r} of {ckpt} is not a model state dict (a flat name -> tensor dict); "
                f"model components in this checkpoint: {models}"
            )
        state = strip_wrapper_prefixes(raw)
    model = _build_model(config, component)
    dtype = _uniform_float_dtype(state)
    if dtype is not None:
        model.to(dtype)
    _check_keys(model, state, f"component {component!r} of {ckpt} (model config from {source})")
    model.load_state_dict(state, strict=False)
    generation_config = _generation_config(ckpt, base)
    if generation_config is not None and model.can_generate():
        model.generation_config = generation_config
    model.save_pretrained(out, safe_serialization=True)


DEFAULT_COMPONENTS = ("actor_model", "model")


def export_checkpoint(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    component: str | None = None,
    base_model_path: str | None = None,
    adapter: bool = False,
) -> Path:
    """Write `component` of the checkpoint `ckpt_dir` (a `global_step_N` directory) as a Hugging Face model
    directory `out_dir` (safetensors + config + generation config + tokenizer); returns `out_dir`.

    A LoRA component (trained with lora_rank > 0: the checkpoint holds the adapter only) is merged into the base
    model the run started from (its config.yaml's model path, or `base_model_path`); `adapter=True` writes the
    bare adapter instead (a peft directory: adapter_config.json + adapter_model.safetensors, loadable with
    `peft.PeftModel.from_pretrained(base, out_dir)`), with the tokenizer.

    The checkpoint must verify (CorruptCheckpointError otherwise). `out_dir` must be new or empty; it is
    written as a sibling temporary directory and renamed into place, so a failed export leaves nothing.
    See the module docstring for where the model, generation config and tokenizer come from.
    """
    ckpt = Path(ckpt_dir).expanduser()
    verify_checkpoint(ckpt)
    manifest = read_manifest(ckpt)
    held = [*manifest["components"], *_sharded_model_components(manifest)]
    if component is None:  # the policy of an RL run, or the model of an SFT run
        component = next((c for c in DEFAULT_COMPONENTS if c in held), DEFAULT_COMPONENTS[0])
    if component not in held and (manifest.get("huggingface") or {}).get("component") != component:
        raise KeyError(f"{ckpt} has no component {component!r}; it holds {sorted(held)}")
    out = _prepare_out_dir(out_dir)
    base = resolve_model_path(base_model_path, config_key="base_model_path") if base_model_path else None
    tmp = out.parent / f".tmp_export_{out.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        saved_hf = manifest.get("huggingface") or {}
        if adapter:
            tmp.mkdir()
            _write_adapter(ckpt, manifest, tmp, component, base_model_path)
        elif saved_hf.get("component") == component and (ckpt / HF_MODEL_DIR).is_dir():
            shutil.copytree(ckpt / HF_MODEL_DIR, tmp)
        else:
            tmp.mkdir()
            _build_from_state_dict(ckpt, manifest, tmp, component, base)
        if not _add_tokenizer(ckpt, tmp, base):
            warnings.warn(
                f"{ckpt} holds no {TOKENIZER_DIR}/ and no base_model_path was given: the export has no tokenizer",
                stacklevel=2,
            )
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
