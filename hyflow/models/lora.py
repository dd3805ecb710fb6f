"""LoRA through peft: the functions the training engine, the reference policy, the rollout weight sync,
checkpoints and `hyflow export` call.

LoRA (Hu et al. 2021, arXiv 2106.09685). A targeted linear layer y = W x + b (W: [out, in]) keeps W and b
frozen and learns two low-rank factors A: [r, in] and B: [out, r]:

    y = W x + b + (alpha / r) * B (A x)        i.e. the effective weight is  W' = W + (alpha / r) * B @ A

(an embedding layer, only when targeted by name: W' = W + (alpha / r) * (B @ A)^T with A: [r, vocab],
B: [dim, r]). peft initialises A with kaiming-uniform from torch's RNG (deterministic for a given
`torch.manual_seed`) and B = 0, so a fresh LoRA model computes exactly the base model.

Config keys and defaults are verl's (`actor_rollout_ref.model.*`, `critic.model.*`):

    lora_rank          r; 0 = full fine-tuning (no LoRA unless `lora_adapter_path` is set)
    lora_alpha         alpha (16); the update is scaled by alpha / r
    target_modules     "all-linear" (every nn.Linear except the output layer `lm_head`), a list of module names
                       (a name matches a module whose full name equals it or ends with "." + it), a regex
                       matched in full against full module names (peft's rule for a string), or a
                       comma-separated string of names ("q_proj,v_proj", as a command line gives it)
    exclude_modules    None, a list of names or a regex, with the same matching rules
    lora_adapter_path  a peft adapter directory (adapter_config.json + adapter_model.safetensors) to continue
                       training from. As in verl (`PeftModel.from_pretrained(model, path, is_trainable=True)`)
                       the adapter's own adapter_config.json wins: its rank, alpha and targets replace
                       lora_rank / lora_alpha / target_modules (a note is printed when they differ).

lora_dropout is 0 and bias "none" (verl's peft defaults), so the forward is deterministic.

Value models (critics: `AutoModelForTokenClassification`, num_labels=1, head `score`; see `loading.py`) are
adapted with `task="value"`: the backbone gets LoRA, the head is not LoRA'd but trained in full (peft's
`modules_to_save`: the head is copied, the copy trains, the original stays as it was loaded).

Where the functions are used:

    training engine    `apply_lora(load_causal_lm(...), lora_settings(cfg.model))` before wrapping (DDP/FSDP2);
                       the optimizer gets the parameters that require grad; `describe_parameters` is printed
    reference policy   `with adapter_disabled(actor_model): ...` runs the base model: no second copy of it
    rollout sync       `merged_named_tensors(model)`: W + (alpha / r) B @ A named as the plain HF model
                       (same names and order as `hyflow.workers.fsdp.iter_full_tensors`)
    checkpoints        `adapter_state_dict` / `load_adapter_state_dict`: the adapter (and value head) only,
                       keyed as peft's `get_peft_model_state_dict` ("base_model.model.<module>.lora_A.weight",
                       "base_model.model.<module>.lora_B.weight", "base_model.model.score.weight"), which is
                       also the key format of adapter_model.safetensors
    export             `save_adapter` writes a peft adapter directory; `merge_adapter_into_state` merges an
                       adapter state into the base model's state dict offline (a plain HF checkpoint)

Distributed. DDP (`.module`) and FSDP2 (`fully_shard` changes classes in place; the PeftModel stays the outer
object) are both handled. Under FSDP2 parameters are DTensors sharded on dim 0: `merged_named_tensors`,
`adapter_state_dict` and `save_adapter` (given a model) all-gather them (`full_tensor()`), so they are
collectives: every rank must call them and consume them completely, in the same order.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyflow.models.forward import unwrap_model

# `settings` below: any object with rank, alpha, target_modules, exclude_modules, adapter_path, dropout and
# config_key (the role spec's `hyflow.specs.LoraSettings`, which `hyflow.config.lora.lora_settings` parses from a
# config section); models reads them and imports neither
LoraSettings = Any
ALL_LINEAR = "all-linear"  # peft's target_modules for every linear layer but the output head


def _is_settings(config: Any) -> bool:
    """A LoraSettings-shaped object (peft's LoraConfig has `r`, not `rank`; an adapter_config is a mapping)."""
    return not isinstance(config, Mapping) and hasattr(config, "rank") and hasattr(config, "config_key")

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_LEGACY_ADAPTER_WEIGHTS_FILE = "adapter_model.bin"
_PEFT_PREFIX = "base_model.model."
_TASKS = ("causal_lm", "value")
_VALUE_HEAD_NAMES = ("score", "classifier")


# ---------------------------------------------------------------------------------------------- settings


# ---------------------------------------------------------------------------------------------- building


def _check_task(task: str) -> None:
    if task not in _TASKS:
        raise ValueError(f"task={task!r}; use 'causal_lm' (actor) or 'value' (critic)")


def value_head_name(model: nn.Module) -> str:
    """The name of a value model's head (`score` for hyflow's critics; `classifier` for some models)."""
    for name in _VALUE_HEAD_NAMES:
        if isinstance(getattr(model, name, None), nn.Module):
            return name
    raise ValueError(f"{type(model).__name__} has no value head ({' or '.join(_VALUE_HEAD_NAMES)}); task='value' "
                     "needs a critic from hyflow.models.loading.load_value_model")


def _with_exclusion(excludes: str | list[str] | None, name: str) -> str | list[str]:
    if excludes is None:
        return [name]
    if isinstance(excludes, str):
        return f"(?:{excludes})|(?:{re.escape(name)})"
    return [*excludes, name] if name not in excludes else list(excludes)


def lora_config(settings: LoraSettings, *, task: str = "causal_lm", head: str = "score",
                base_model_name_or_path: str | None = None):
    """The `peft.LoraConfig` of `settings`: r, lora_alpha, targets, excludes, dropout 0, bias "none".

    task="causal_lm": TaskType.CAUSAL_LM ("all-linear" leaves out lm_head). task="value": TaskType.TOKEN_CLS,
    the value head `head` in modules_to_save (trained in full) and excluded from the LoRA targets.
    """
    from peft import LoraConfig, TaskType

    _check_task(task)
    if settings.rank <= 0:
        raise ValueError(f"{settings.config_key}.lora_rank={settings.rank} must be > 0 to build a new adapter")
    targets = settings.target_modules
    excludes = settings.exclude_modules
    extra: dict[str, Any] = {}
    if task == "value":
        excludes = _with_exclusion(excludes, head)
        extra["modules_to_save"] = [head]
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM if task == "causal_lm" else TaskType.TOKEN_CLS,
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=list(targets) if isinstance(targets, list) else targets,
        exclude_modules=list(excludes) if isinstance(excludes, list) else excludes,
        lora_dropout=settings.dropout,
        bias="none",
        base_model_name_or_path=base_model_name_or_path,
        **extra,
    )


def _matches(spec: str | list[str], name: str) -> bool:
    """peft's rule: a string is a regex matched in full; a list entry equals the name or is its dotted suffix."""
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == entry or name.endswith("." + entry) for entry in spec)


def _lora_capable(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, nn.Embedding, Conv1D))


def _linear_names(model: nn.Module) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    return [name for name, module in model.named_modules() if isinstance(module, (nn.Linear, Conv1D))]


def _leaf_names(names: list[str]) -> str:
    return ", ".join(sorted({name.rsplit(".", 1)[-1] for name in names}))


def targeted_modules(model: nn.Module, settings: LoraSettings, *, task: str = "causal_lm") -> list[str]:
    """The full names of the modules that `apply_lora` gives adapters, checking the config on the way.

    Raises ValueError naming the problem and the fix when a target name (or the regex) matches no module (the
    message lists the model's linear layers), when it matches a module LoRA cannot adapt (only Linear,
    Embedding and GPT-2's Conv1D can), when exclude_modules leaves nothing, and when a targeted weight is tied to
    another parameter (LoRA on a tied lm_head would untie it from the input embedding).
    """
    _check_task(task)
    key = settings.config_key
    modules = dict(model.named_modules())
    linear = _linear_names(model)
    hint = (f"the model's linear layers are: {_leaf_names(linear)} (full names look like {linear[0]!r}); use "
            f"'all-linear', a list of these names, or a regex matched against full module names"
            if linear else "the model has no linear layers")
    targets = settings.target_modules
    if targets == ALL_LINEAR:
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        candidates = [name for name in linear if modules[name] is not output]
    else:
        specs = [targets] if isinstance(targets, str) else [[entry] for entry in targets]
        candidates = []
        for spec in specs:
            shown = spec if isinstance(spec, str) else spec[0]
            matched = [name for name in modules if name and _matches(spec, name)]
            if not matched:
                raise ValueError(f"{key}.target_modules: {shown!r} matches no module of {type(model).__name__}; "
                                 f"{hint}")
            unsupported = [name for name in matched if not _lora_capable(modules[name])]
            if unsupported:
                kinds = sorted({type(modules[name]).__name__ for name in unsupported})
                raise ValueError(f"{key}.target_modules: {shown!r} matches {unsupported[:3]} ({', '.join(kinds)}), "
                                 f"which LoRA cannot adapt (only Linear and Embedding layers); {hint}")
            candidates += [name for name in matched if name not in candidates]
    excludes = settings.exclude_modules
    if task == "value":
        excludes = _with_exclusion(excludes, value_head_name(model))
    chosen = [name for name in candidates if excludes is None or not _matches(excludes, name)]
    if not chosen:
        raise ValueError(f"{key}.exclude_modules={settings.exclude_modules!r} excludes every target of "
                         f"{key}.target_modules={targets!r}; nothing would be trained: narrow exclude_modules")
    if settings.exclude_modules is not None:
        excluded = [name for name in modules if name and _matches(settings.exclude_modules, name)]
        if not excluded:
            warnings.warn(f"{key}.exclude_modules={settings.exclude_modules!r} matches no module; {hint}",
                          stacklevel=2)
    _check_untied(model, chosen, key)
    return chosen


def _check_untied(model: nn.Module, chosen: list[str], key: str) -> None:
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    modules = dict(model.named_modules())
    for name in chosen:
        weight = getattr(modules[name], "weight", None)
        others = [other for other in owners.get(id(weight), []) if other != f"{name}.weight"]
        if others:
            raise ValueError(f"{key}.target_modules selects {name!r}, whose weight is tied to {others[0]!r}: an "
                             f"adapter on it would untie them. Add {name.rsplit('.', 1)[-1]!r} to "
                             f"{key}.exclude_modules (or target other modules)")


def apply_lora(model: nn.Module, settings: LoraSettings, *, task: str = "causal_lm"):
    """Wrap a plain HF model in peft LoRA adapters; returns the `peft.PeftModel` (the model is changed in place).

    A new adapter: r, alpha, targets, excludes from `settings` (see `lora_config`), A ~ kaiming-uniform from
    torch's RNG, B = 0 (the output equals the base model's until B moves). With `settings.adapter_path`: the
    peft adapter directory is loaded trainable and its own config wins (verl), see `load_adapter_dir`.
    Afterwards only the LoRA factors (and, for task="value", the copied value head) require grad; the adapter
    is cast to the base weights' dtype (FSDP2 all-gathers one dtype per shard group).
    """
    from peft import PeftModel, get_peft_model

    _check_task(task)
    if isinstance(model, PeftModel) or not isinstance(model, nn.Module):
        raise TypeError(f"apply_lora expects a plain Hugging Face model, got {type(model).__name__}; apply it "
                        "once, right after loading and before DDP/FSDP wrapping")
    head = value_head_name(model) if task == "value" else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
        if settings.adapter_path is not None:
            peft_model = load_adapter_dir(model, settings, task=task)
        else:
            targeted_modules(model, settings, task=task)
            config = lora_config(settings, task=task, head=head or "score",
                                 base_model_name_or_path=getattr(model, "name_or_path", None) or None)
            peft_model = get_peft_model(model, config)
    _check_supported(peft_model)
    _cast_adapter_to_base_dtype(peft_model)
    if head is not None:
        wrapper = getattr(peft_model.get_base_model(), head)
        if not hasattr(wrapper, "modules_to_save"):
            raise RuntimeError(f"the value head {head!r} was not put in modules_to_save; it would stay frozen")
    return peft_model


def _adapter_dir_problem(path: Path) -> str | None:
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is a file, not a directory"
    if not (path / ADAPTER_CONFIG_FILE).is_file():
        if (path / "config.json").is_file():
            return (f"holds a full model checkpoint (config.json), not a LoRA adapter ({ADAPTER_CONFIG_FILE}); "
                    "to start from a full model set model.path to it instead")
        return f"has no {ADAPTER_CONFIG_FILE}"
    if not ((path / ADAPTER_WEIGHTS_FILE).is_file() or (path / _LEGACY_ADAPTER_WEIGHTS_FILE).is_file()):
        return f"has {ADAPTER_CONFIG_FILE} but no {ADAPTER_WEIGHTS_FILE}"
    return None


def load_adapter_dir(model: nn.Module, settings: LoraSettings, *, task: str = "causal_lm"):
    """`PeftModel.from_pretrained(model, settings.adapter_path, is_trainable=True)` with checks (verl semantics).

    The adapter's own adapter_config.json (rank, alpha, targets) wins over lora_rank / lora_alpha /
    target_modules; a note is printed when they differ. For task="value" the value head is put in
    modules_to_save and excluded from LoRA even when the adapter was saved from a causal LM (the head then
    starts as the model's). Raises FileNotFoundError / ValueError naming the config key when the path is
    missing, is not a peft adapter directory, is not a LoRA adapter, or does not fit the model.
    """
    from peft import LoraConfig, PeftModel, TaskType
    from peft.tuners.lora import LoraLayer

    key = f"{settings.config_key}.lora_adapter_path"
    path = Path(str(settings.adapter_path)).expanduser()
    fix = (f"point {key} to a peft adapter directory ({ADAPTER_CONFIG_FILE} + {ADAPTER_WEIGHTS_FILE}, as written "
           "by `hyflow export` / save_adapter / PeftModel.save_pretrained), or unset it to start a new adapter")
    problem = _adapter_dir_problem(path)
    if problem is not None:
        error = FileNotFoundError if problem == "does not exist" else ValueError
        raise error(f"{key}={str(settings.adapter_path)!r} {problem}; {fix}")
    try:
        peft_type = json.loads((path / ADAPTER_CONFIG_FILE).read_text()).get("peft_type")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}={str(path)!r}: {ADAPTER_CONFIG_FILE} is not a peft config ({e}); {fix}") from e
    if peft_type is None:
        raise ValueError(f"{key}={str(path)!r}: {ADAPTER_CONFIG_FILE} is not a peft config (no peft_type); {fix}")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{key}={str(path)!r} holds a {peft_type} adapter, not LoRA; {fix}")
    config = LoraConfig.from_pretrained(str(path))
    asked = None
    if settings.rank > 0:
        with contextlib.suppress(ValueError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            asked = targeted_modules(model, settings, task=task)
    if task == "value":
        head = value_head_name(model)
        config.task_type = TaskType.TOKEN_CLS
        config.modules_to_save = sorted({*(config.modules_to_save or []), head})
        config.exclude_modules = _with_exclusion(
            sorted(config.exclude_modules) if isinstance(config.exclude_modules, set) else config.exclude_modules,
            head)
    else:
        config.task_type = TaskType.CAUSAL_LM
    config.inference_mode = False
    print(f"LoRA: loading the adapter {path} (r={config.r}, lora_alpha={config.lora_alpha}) for training")
    name_or_path = getattr(model, "name_or_path", "?")
    try:
        peft_model = PeftModel.from_pretrained(model, str(path), config=config, is_trainable=True)
    except (RuntimeError, ValueError, KeyError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        shown = " ".join(lines[:2]) + (f" (and {len(lines) - 2} more)" if len(lines) > 2 else "")
        raise ValueError(f"{key}={str(path)!r} does not fit {type(model).__name__} from {name_or_path!r}: it was "
                         f"trained on another base model ({type(e).__name__}: {shown}); {fix}") from e
    loaded = [name for name, module in peft_model.get_base_model().named_modules() if isinstance(module, LoraLayer)]
    _note_overridden_settings(config, settings, path, asked, loaded)
    return peft_model


def _note_overridden_settings(config, settings: LoraSettings, path: Path, asked: list[str] | None,
                               loaded: list[str]) -> None:
    """Print which of lora_rank / lora_alpha / target_modules the adapter's own config replaced."""
    key = settings.config_key
    differences = []
    if settings.rank > 0 and settings.rank != config.r:
        differences.append(f"{key}.lora_rank={settings.rank} -> r={config.r}")
    if settings.rank > 0 and settings.alpha != config.lora_alpha:
        differences.append(f"{key}.lora_alpha={settings.alpha} -> lora_alpha={config.lora_alpha}")
    if asked is not None and set(asked) != set(loaded):
        differences.append(f"{key}.target_modules={settings.target_modules!r} ({_leaf_names(asked)}) -> the "
                           f"adapter's modules ({_leaf_names(loaded)})")
    if differences:
        print(f"LoRA note: the adapter's own config ({path / ADAPTER_CONFIG_FILE}) is used, as in verl: "
              + "; ".join(differences))


def _check_supported(peft_model) -> None:
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in peft_model.named_modules():
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer):
            raise ValueError(f"{name} is a {type(module).__name__}; hyflow supports LoRA adapters only")
        if isinstance(module, LoraLayer):
            if any(module.use_dora.values()):
                raise ValueError(f"{name} uses DoRA; hyflow's weight sync and export support plain LoRA only")
            if any(getattr(module, "lora_bias", {}).values()):
                raise ValueError(f"{name} has a LoRA bias (lora_bias=True); hyflow supports bias='none' only")


def _cast_adapter_to_base_dtype(peft_model) -> None:
    frozen = [p.dtype for p in peft_model.parameters() if not p.requires_grad]
    if not frozen:
        return
    with torch.no_grad():
        for param in peft_model.parameters():
            if param.requires_grad and param.dtype != frozen[0]:
                param.data = param.data.to(frozen[0])


# ---------------------------------------------------------------------------------------------- inspection


def peft_model_of(model: nn.Module):
    """The `peft.PeftModel` inside DDP (`.module`) or torch.compile (`_orig_mod`); FSDP2 keeps it outermost.

    Raises TypeError when there is none (the model has no LoRA: call `apply_lora` first).
    """
    from peft import PeftModel

    current = model
    while not isinstance(current, PeftModel):
        inner = getattr(current, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(current, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            raise TypeError(f"{type(model).__name__} has no LoRA adapter (no peft.PeftModel inside); call "
                            "hyflow.models.lora.apply_lora on the model first")
        current = inner
    return current


def is_lora_model(model: nn.Module) -> bool:
    """True when a peft LoRA model is `model` or inside its DDP / compile wrappers."""
    try:
        peft_model_of(model)
    except TypeError:
        return False
    return True


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) element counts of the model's distinct parameters.

    Under FSDP2 a DTensor counts its global size. For a value model the frozen original head and its trained copy
    (peft's modules_to_save) both count in the total.
    """
    trainable = total = 0
    for param in model.parameters():
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return trainable, total


def describe_parameters(model: nn.Module) -> str:
    """"trainable params: 1,234 of 567,890 (0.22 %)" (see `parameter_counts`)."""
    trainable, total = parameter_counts(model)
    share = 100.0 * trainable / total if total else 0.0
    return f"trainable params: {trainable:,} of {total:,} ({share:.2f} %)"


@contextlib.contextmanager
def adapter_disabled(model: nn.Module):
    """Within the block every forward of `model` runs the base model (the reference policy of a LoRA actor).

    Sets the disable flag of every LoRA layer and modules_to_save wrapper (the original head is used) and
    restores the previous flags on exit. Unlike `PeftModel.disable_adapter()` it never touches requires_grad,
    so it is safe with DDP (fixed set of gradient buckets) and FSDP2 (sharded and unsharded parameters are
    different tensors). Works on the PeftModel, on DDP around it and on an FSDP2-sharded one. Run the forward
    under `torch.no_grad()`: gradients taken inside the block would be the base model's.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    peft_model_of(model)  # raises with a clear message for a model without LoRA
    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    previous = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True
        yield model
    finally:
        for layer, flag in zip(layers, previous, strict=True):
            layer._disable_adapters = flag


# ---------------------------------------------------------------------------------------------- full tensors


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _reshard_all(model: nn.Module) -> None:
    """Reshard every FSDP2 group (the root stays gathered after a forward): parameters are DTensors again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _wrappers(inner: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return {name: module for name, module in inner.named_modules()
            if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper))}


def _owner(name: str, wrappers: dict[str, nn.Module]) -> tuple[str, nn.Module] | None:
    """The outermost peft wrapper whose sub-tree holds `name`, with its prefix."""
    parts = name.split(".")
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        if prefix in wrappers:
            return prefix, wrappers[prefix]
    return None


def _plain_name(name: str, wrappers: dict[str, nn.Module]) -> tuple[str | None, nn.Module | None]:
    """(the plain HF name of a tensor of the adapted model or None to skip it, the LoRA layer whose base weight it
    is or None)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    found = _owner(name, wrappers)
    if found is None:
        return name, None
    prefix, wrapper = found
    rest = name[len(prefix) + 1:]
    if isinstance(wrapper, LoraLayer):
        if not rest.startswith("base_layer."):
            return None, None  # lora_A / lora_B / lora_embedding_*: folded into the base weight
        rest = rest[len("base_layer."):]
        return f"{prefix}.{rest}", wrapper if rest == "weight" else None
    if isinstance(wrapper, ModulesToSaveWrapper):
        active = [a for a in wrapper.active_adapters if a in wrapper.modules_to_save]
        if rest.startswith("original_module."):
            return (None, None) if active else (f"{prefix}.{rest[len('original_module.'):]}", None)
        for adapter in active:
            head = f"modules_to_save.{adapter}."
            if rest.startswith(head):
                return f"{prefix}.{rest[len(head):]}", None
        return None, None
    raise ValueError(f"{prefix} is a {type(wrapper).__name__}; hyflow's weight sync supports LoRA and "
                     "modules_to_save only")


def _merged_weight(layer, weight: torch.Tensor) -> torch.Tensor:
    """W + sum over active adapters of scaling * B @ A (transposed for embeddings / fan_in_fan_out), in fp32."""
    from peft.tuners import lora

    merged = weight.float()
    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "merged_adapters", []):
            continue  # already folded into the base weight by peft's merge_adapter()
        if isinstance(layer, lora.Embedding) and adapter in layer.lora_embedding_A:
            a, b = _full(layer.lora_embedding_A[adapter].detach()), _full(layer.lora_embedding_B[adapter].detach())
            delta = (b.float() @ a.float()).T
        elif isinstance(layer, lora.Linear) and adapter in layer.lora_A:
            a, b = _full(layer.lora_A[adapter].weight.detach()), _full(layer.lora_B[adapter].weight.detach())
            delta = b.float() @ a.float()
            if layer.fan_in_fan_out:
                delta = delta.T
        elif adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {}):
            raise ValueError(f"{type(layer).__name__} LoRA layers are not supported by merged_named_tensors")
        else:
            continue
        merged = merged + layer.scaling[adapter] * delta
    return merged.to(weight.dtype)


def merged_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the plain HF model a rollout engine loads, with LoRA merged in; model unchanged.

    Each adapted weight is W' = W + (alpha / r) * B @ A (computed in fp32, returned in W's dtype, a new tensor);
    every other parameter (tied ones once) and persistent buffer is yielded as it is (no copy for a plain model).
    Names and order are those of `hyflow.workers.fsdp.iter_full_tensors` on the plain HF model: no
    "base_model.model." prefix, no ".base_layer", no lora_A / lora_B entries, the value head's trained copy
    (modules_to_save) under the head's own name. A model without LoRA yields its plain tensors.

    Collective under FSDP2: every sharded tensor is all-gathered (`full_tensor()`, base weight then A then B for
    each adapted layer), so every rank must consume the whole iterator.
    """
    _reshard_all(model)
    inner = unwrap_model(model)
    wrappers = _wrappers(inner)
    with torch.no_grad():
        for name, param in inner.named_parameters():
            plain, layer = _plain_name(name, wrappers)
            if plain is None:
                continue
            full = _full(param.detach())
            yield plain, (full if layer is None else _merged_weight(layer, full))
        seen: set[int] = set()
        for module_name, module in inner.named_modules():
            for buffer_name, buffer in module._buffers.items():
                if buffer is None or id(buffer) in seen or buffer_name in module._non_persistent_buffers_set:
                    continue
                seen.add(id(buffer))
                name = f"{module_name}.{buffer_name}" if module_name else buffer_name
                plain, _ = _plain_name(name, wrappers)
                if plain is not None:
                    yield plain, _full(buffer.detach())


# ---------------------------------------------------------------------------------------------- adapter state


def _adapter_key_map(peft_model, adapter_name: str = "default") -> dict[str, str]:
    """{peft adapter-state key: key in peft_model.state_dict()}, computed by peft's own key function."""
    from peft import get_peft_model_state_dict

    model_keys = list(peft_model.state_dict(keep_vars=True).keys())
    tagged = {key: torch.tensor(i) for i, key in enumerate(model_keys)}
    picked = get_peft_model_state_dict(peft_model, state_dict=tagged, adapter_name=adapter_name,
                                       save_embedding_layers=False)
    return {key: model_keys[int(index)] for key, index in picked.items()}


def adapter_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The trainable adapter of a LoRA model: {peft key: full tensor}, copies (on the CPU unless `cpu=False`).

    Keys are `peft.get_peft_model_state_dict`'s (adapter name removed): "base_model.model.<module>.lora_A.weight",
    "base_model.model.<module>.lora_B.weight", and for a value model the trained head
    "base_model.model.score.weight" / ".bias". This is what checkpoints hold and what adapter_model.safetensors
    holds. Collective under FSDP2 (every rank gets the full dict).
    """
    peft_model = peft_model_of(model)
    _reshard_all(model)
    tensors = peft_model.state_dict(keep_vars=True)
    out = {}
    for key, model_key in _adapter_key_map(peft_model).items():
        full = _full(tensors[model_key].detach())
        out[key] = full.to("cpu", copy=True) if cpu else full.clone()
    return out


def _describe_keys(keys: set[str]) -> str:
    listed = sorted(keys)
    more = f" and {len(listed) - 5} more" if len(listed) > 5 else ""
    return ", ".join(listed[:5]) + more


def load_adapter_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load what `adapter_state_dict` returned into a LoRA model (DDP or FSDP2-sharded too); strict.

    Raises ValueError naming the missing and unexpected keys, or the shape mismatches (a checkpoint of another
    rank, targets or base model). Under FSDP2 every rank passes the full dict and keeps its own shard.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    peft_model = peft_model_of(model)
    _reshard_all(model)
    key_map = _adapter_key_map(peft_model)
    missing, unexpected = set(key_map) - set(state), set(state) - set(key_map)
    if missing or unexpected:
        parts = [f"missing {_describe_keys(missing)}" if missing else "",
                 f"unexpected {_describe_keys(unexpected)}" if unexpected else ""]
        raise ValueError(f"the adapter state does not fit this LoRA model: {'; '.join(p for p in parts if p)}. It was "
                         "saved with another lora_rank / target_modules / task or for another base model")
    tensors = peft_model.state_dict(keep_vars=True)
    mismatched = [f"{key} {tuple(state[key].shape)} vs {tuple(tensors[model_key].shape)}"
                  for key, model_key in key_map.items() if tuple(state[key].shape) != tuple(tensors[model_key].shape)]
    if mismatched:
        raise ValueError(f"the adapter state does not fit this LoRA model: shape mismatch {mismatched[:3]}; it was "
                         "saved with another lora_rank or for another base model")
    with torch.no_grad():
        for key, model_key in key_map.items():
            target = tensors[model_key]
            if isinstance(target, DTensor):
                value = state[key].to(device=target.device, dtype=target.dtype)
                local = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(state[key])


# ---------------------------------------------------------------------------------------------- export


def _as_lora_config(config: Any, *, task: str, base_model_name_or_path: str | None):
    from peft import LoraConfig

    if _is_settings(config):
        return lora_config(config, task=task, base_model_name_or_path=base_model_name_or_path)
    if isinstance(config, LoraConfig):
        return copy.deepcopy(config)
    if isinstance(config, Mapping):
        return LoraConfig(**{k: v for k, v in config.items() if k != "peft_type"})
    raise TypeError(f"config must be LoraSettings, peft.LoraConfig or an adapter_config dict, got {type(config)}")


def save_adapter(model_or_state: nn.Module | Mapping[str, torch.Tensor], config: Any, out_dir: str | os.PathLike, *,
                 base_model_name_or_path: str | None = None, task: str = "causal_lm") -> Path | None:
    """Write a peft adapter directory: adapter_config.json + adapter_model.safetensors.

    `model_or_state`: a LoRA model (DDP / FSDP2 too: collective, rank 0 writes) or an `adapter_state_dict`.
    `config`: None (a model's own peft config), `LoraSettings` (+ `task`), a `peft.LoraConfig` or an
    adapter_config dict. `base_model_name_or_path` goes into adapter_config.json (default: the config's). The
    directory loads with `peft.PeftModel.from_pretrained(base_model, out_dir)` and as a lora_adapter_path.
    Returns the directory (None on ranks other than 0).
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    if isinstance(model_or_state, nn.Module):
        peft_model = peft_model_of(model_or_state)
        state = adapter_state_dict(model_or_state)
        config = peft_model.peft_config["default"] if config is None else config
    else:
        state = dict(model_or_state)
        if config is None:
            raise ValueError("save_adapter(state, config=None): a state dict needs its LoraSettings or LoraConfig")
    peft_config = _as_lora_config(config, task=task, base_model_name_or_path=base_model_name_or_path)
    if base_model_name_or_path is not None:
        peft_config.base_model_name_or_path = str(base_model_name_or_path)
    peft_config.inference_mode = True
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    peft_config.save_pretrained(str(out))
    save_file({key: tensor.detach().cpu().contiguous() for key, tensor in state.items()},
              str(out / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def read_adapter_dir(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(adapter state, adapter_config dict) of a peft adapter directory (safetensors weights)."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    problem = _adapter_dir_problem(path)
    if problem is not None or not (path / ADAPTER_WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a peft adapter directory ({problem or 'no ' + ADAPTER_WEIGHTS_FILE})")
    return load_file(str(path / ADAPTER_WEIGHTS_FILE)), json.loads((path / ADAPTER_CONFIG_FILE).read_text())


_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")
_LORA_EMBEDDING_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_embedding_A|lora_embedding_B)$")


def _adapter_key(name: str) -> str | None:
    """A peft adapter key for a model parameter name (with the adapter name, as `named_parameters` or a DCP model
    state give it): "...lora_A.default.weight" -> "...lora_A.weight", "score.modules_to_save.default.weight" ->
    "score.weight"; None for frozen base tensors ("base_layer", "original_module"), which the base state holds."""
    if ".base_layer." in name or ".original_module." in name:
        return None
    name = re.sub(r"\.(lora_A|lora_B)\.[^.]+\.weight$", r".\1.weight", name)
    name = re.sub(r"\.(lora_embedding_A|lora_embedding_B)\.[^.]+$", r".\1", name)
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def merge_adapter_into_state(base_state: Mapping[str, torch.Tensor], adapter_state: Mapping[str, torch.Tensor],
                             peft_config: Any) -> dict[str, torch.Tensor]:
    """Offline merge: the plain HF state dict of base + adapter, as `PeftModel.merge_and_unload()` gives it.

    For each adapted module m: W'_m = W_m + s_m * B_m @ A_m (embeddings: (B_m @ A_m)^T; fan_in_fan_out: transposed)
    with s_m = alpha_m / r_m (alpha_m / sqrt(r_m) with use_rslora), r_m = rows of A_m, alpha_m from
    alpha_pattern or lora_alpha; computed in fp32 and cast to W_m's dtype. A modules_to_save entry (the value head)
    replaces the base tensor of the same name. `base_state`: the base model's state dict (e.g. read from its
    safetensors); `adapter_state`: peft keys (`adapter_state_dict`, adapter_model.safetensors) or the trainable
    entries of the peft model's own state dict (keys with the adapter name, e.g. a DCP checkpoint saved with
    `ignore_frozen_params`);
    `peft_config`: a peft.LoraConfig, an adapter_config dict or LoraSettings. Returns a new dict (tensors that are
    not merged are shared with `base_state`, which is not modified).
    """
    from peft.utils.other import get_pattern_key

    if _is_settings(peft_config):
        alpha, alpha_pattern, rslora, fan_in_fan_out = peft_config.alpha, {}, False, False
    else:
        get = peft_config.get if isinstance(peft_config, Mapping) else lambda k, d=None: getattr(peft_config, k, d)
        if get("use_dora", False) or get("lora_bias", False):
            raise ValueError("merge_adapter_into_state supports plain LoRA (no DoRA, no lora_bias)")
        alpha = get("lora_alpha", 8)
        alpha_pattern = dict(get("alpha_pattern", None) or {})
        rslora, fan_in_fan_out = bool(get("use_rslora", False)), bool(get("fan_in_fan_out", False))
    factors: dict[str, dict[str, torch.Tensor]] = {}
    replaced: dict[str, torch.Tensor] = {}
    for key, tensor in adapter_state.items():
        name = _adapter_key(key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key)
        if name is None:
            continue
        found = _LORA_KEY.match(name) or _LORA_EMBEDDING_KEY.match(name)
        if found is not None:
            factors.setdefault(found["module"], {})[found["part"]] = tensor
        elif "lora_" in name:
            raise ValueError(f"adapter key {key!r} is not a LoRA A/B factor; only plain LoRA can be merged")
        else:
            replaced[name] = tensor  # modules_to_save: the trained copy replaces the base tensor
    merged = dict(base_state)
    for name, tensor in replaced.items():
        if name not in base_state:
            raise KeyError(f"adapter tensor {name!r} has no counterpart in the base state dict; is it the base "
                           "model the adapter was trained on?")
        merged[name] = tensor.to(base_state[name].dtype)
    for module, parts in factors.items():
        weight_key = f"{module}.weight"
        if weight_key not in base_state:
            raise KeyError(f"adapted module {module!r} has no {weight_key!r} in the base state dict (a tied weight "
                           "saved under another name, or another base model)")
        embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
        a = parts.get("lora_embedding_A" if embedding else "lora_A")
        b = parts.get("lora_embedding_B" if embedding else "lora_B")
        if a is None or b is None:
            raise KeyError(f"adapter for {module!r} lacks its {'A' if a is None else 'B'} factor")
        rank = a.shape[0]
        pattern = get_pattern_key(alpha_pattern.keys(), module) if alpha_pattern else None
        module_alpha = alpha_pattern.get(pattern, alpha) if pattern is not None else alpha
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        delta = b.float() @ a.float()
        if embedding or fan_in_fan_out:
            delta = delta.T
        weight = base_state[weight_key]
        if tuple(delta.shape) != tuple(weight.shape):
            raise ValueError(f"adapter for {module!r} makes a {tuple(delta.shape)} update for a {tuple(weight.shape)} "
                             "weight: it was trained on another base model")
        merged[weight_key] = (weight.float() + scaling * delta).to(weight.dtype)
    return merged
