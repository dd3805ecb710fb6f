"""Load tokenizers, causal LMs, critics (value models) and reward models from a local directory or hub id.

Paths. A local directory is used as is (`~` expanded). A string that looks like a filesystem path (starts
with `/`, `.` or `~`, has more separators than a hub id `org/name`, or starts with a folder that exists here,
as `models/tiyn` does when `models/` is local) but does not exist is an instant error naming the config key to
fix, not a minute of hub retries. Anything else is a hub id handed to `from_pretrained` (which needs the network
or a filled HF cache); when the hub cannot provide it, that is a one-line error naming the id.

Damaged model files are errors naming the file and the fix: a directory without tokenizer files, a safetensors
file whose header does not parse, a `.bin` / `.pt` weight file that holds pickled objects or calls (refused as
`hyflow.serialization` refuses them in checkpoints, without torch's advice to load it with `weights_only=False`).

Critic format (same as verl): a critic is `AutoModelForTokenClassification` with `num_labels=1`, i.e. the
causal-LM backbone plus `score = nn.Linear(hidden, 1)` applied to every position, so
`model(...).logits[..., 0]` is the per-token value V(s_t) of shape [B, L]. It saves with `save_pretrained` as a
normal HF checkpoint (architectures `<Arch>ForTokenClassification`). Loading a causal-LM checkpoint as a
critic keeps the backbone and initialises a fresh head: weight ~ normal(0, (1 / (hidden + 1))^2), bias 0, so
initial values are close to 0 (std about 1 / sqrt(hidden)) but the backbone gets gradients from the first
step. Classifier dropout is set to 0: dropout on value predictions would make PPO's value clipping noisy.

Reward models are `AutoModelForSequenceClassification` with `num_labels=1` (one scalar per sequence).

Padding side is not set here: the rollout pads prompts on the left for generation, training batches are
built from token ids directly.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from hyflow.models.vision import VisionProcessor, is_vision_config
from hyflow.serialization import refusal, weights_only_reason

DTypeLike = str | torch.dtype | None

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# org/name or name: letters, digits, '-', '_', '.'; no leading '.' (that is a relative path).
_HUB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)?$")

# Config attributes that models read with getattr(..., default), so they are valid overrides even when the
# loaded config does not carry them.
_OPTIONAL_CONFIG_KEYS = {"classifier_dropout", "token_classification_bias"}


def resolve_model_path(path: str | os.PathLike, *, config_key: str = "actor_rollout_ref.model.path") -> str:
    """A local checkpoint directory (expanded) or a hub id; raise for a local-looking path that is missing.

    Raises FileNotFoundError naming `config_key` when `path` looks like a filesystem path but is not an
    existing directory.
    """
    if path is None or str(path).strip() == "":
        raise ValueError(f"{config_key} is empty; set it to a local HF checkpoint directory or a hub id")
    raw = str(path)
    local = Path(raw).expanduser()
    if local.is_dir():
        return str(local)
    hint = (
        f"set {config_key} to a local HF checkpoint directory (config.json + weights + tokenizer) or a hub id "
        f"like 'Qwen/Qwen2.5-0.5B-Instruct'; `hyflow init-model --preset tiny --out DIR` writes a tiny local one"
    )
    if local.exists():
        raise FileNotFoundError(f"{config_key}={raw!r} is a file, not a checkpoint directory; {hint}")
    if _HUB_ID.match(raw) is None:
        raise FileNotFoundError(f"{config_key}={raw!r} does not exist; {hint}")
    if "/" in raw and Path(raw.split("/", 1)[0]).is_dir():
        raise FileNotFoundError(f"{config_key}={raw!r} does not exist (the folder {raw.split('/', 1)[0]!r} is local, "
                                f"so this is a path, not a hub id); {hint}")
    return raw


_HUB_FIX = ("check the id (and the path, if a local directory was meant: run from the folder it is relative to or "
            "give it absolutely), or reach the hub / fill the Hugging Face cache (HF_HUB_OFFLINE=1 uses the cache only)")


@contextlib.contextmanager
def _hub_errors(resolved: str, config_key: str):
    """A hub id that the hub (or the offline cache) cannot provide: one line naming the key and the id."""
    try:
        yield
    except OSError as e:
        if Path(resolved).is_dir():
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FileNotFoundError(f"{config_key}={resolved!r} is not a local directory and could not be loaded from the "
                                f"Hugging Face hub ({first}); {_HUB_FIX}") from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                    "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def _check_tokenizer_files(resolved: str, config_key: str) -> None:
    """A local directory with none of the files a tokenizer is read from is an error naming it and the fix
    (transformers would otherwise build an empty tokenizer that fails later, far from the cause)."""
    directory = Path(resolved)
    if directory.is_dir() and not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{config_key}: {directory} has no tokenizer files (none of {', '.join(_TOKENIZER_FILES)}); save the "
            "base model's tokenizer into it (AutoTokenizer.from_pretrained(BASE).save_pretrained(DIR)), or point the "
            "tokenizer_path key at a directory that has one (e.g. actor_rollout_ref.model.tokenizer_path)"
        )


def as_torch_dtype(dtype: DTypeLike) -> torch.dtype | str | None:
    """Map "float32"/"bfloat16"/"float16" (or fp32/bf16/fp16, or a torch.dtype) to a torch.dtype; keep "auto"."""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}, 'auto' or a torch.dtype")
    return _DTYPES[dtype]


def load_tokenizer(
    path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
    config_key: str = "actor_rollout_ref.model.path",
):
    """Load a tokenizer with `AutoTokenizer`; pad token := eos token when the tokenizer has none.

    `chat_template` replaces the tokenizer's template: a Jinja string, or the path of a `.jinja` file.
    The padding side is left as saved; generation code pads prompts on the left itself.
    """
    resolved = resolve_model_path(path, config_key=config_key)
    _check_tokenizer_files(resolved, config_key)
    with _hub_errors(resolved, config_key):
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = _read_chat_template(chat_template)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer at {resolved!r} has neither a pad nor an eos token; add one to its "
                f'tokenizer_config.json (e.g. "eos_token": "<|im_end|>")'
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _read_chat_template(chat_template: str) -> str:
    if chat_template.endswith(".jinja") and "{" not in chat_template:
        template_path = Path(chat_template).expanduser()
        if not template_path.is_file():
            raise FileNotFoundError(f"chat template file {chat_template!r} does not exist")
        return template_path.read_text()
    return chat_template


def apply_config_overrides(config: PretrainedConfig, overrides: dict[str, Any] | None) -> PretrainedConfig:
    """Set `overrides` on `config` in place and return it.

    Each key must already be a config attribute (or a known optional one such as `classifier_dropout`); a
    dict value merges into a dict attribute (e.g. `rope_parameters`) and recurses into a sub-config (e.g.
    `text_config`). `rope_theta` goes into `rope_parameters` on configs that keep it there (transformers 5).
    """
    for key, value in _plain(overrides or {}).items():
        current = getattr(config, key, None)
        if (
            key == "rope_theta"
            and not hasattr(config, key)
            and isinstance(getattr(config, "rope_parameters", None), dict)
        ):
            config.rope_parameters = {**config.rope_parameters, "rope_theta": value}
        elif isinstance(current, PretrainedConfig) and isinstance(value, dict):
            apply_config_overrides(current, value)
        elif isinstance(current, dict) and isinstance(value, dict):
            setattr(config, key, {**current, **value})
        elif hasattr(config, key) or key in _OPTIONAL_CONFIG_KEYS:
            setattr(config, key, value)
        else:
            known = sorted(config.to_dict())
            close = difflib.get_close_matches(key, known, n=3)
            suggestion = f"did you mean {close}? " if close else ""
            raise ValueError(
                f"override_config key {key!r} is not a field of {type(config).__name__}; {suggestion}"
                f"valid keys: {known}"
            )
    return config


def _plain(value: Any) -> Any:
    """Mappings (an OmegaConf DictConfig included) as plain dicts, sequences as lists, recursively."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(item) for item in value]
    return value


def _auto_config(resolved: str, trust_remote_code: bool, config_key: str = "actor_rollout_ref.model.path"):
    """`AutoConfig.from_pretrained`, with a hub id the hub cannot provide as a one-line error."""
    with _hub_errors(resolved, config_key):
        return AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)


def _load_config(
    resolved: str,
    overrides: dict[str, Any] | None,
    trust_remote_code: bool,
    role_updates: dict[str, Any] | None = None,
    config_key: str = "actor_rollout_ref.model.path",
) -> tuple[PretrainedConfig, str | None]:
    """AutoConfig + the role's updates (e.g. num_labels=1) + the user's overrides, in that order.

    An `attn_implementation` key in the overrides is returned separately (it is a loading argument).
    """
    overrides = dict(overrides or {})
    attn_from_overrides = overrides.pop("attn_implementation", None)
    config = _auto_config(resolved, trust_remote_code, config_key)
    for key, value in (role_updates or {}).items():
        setattr(config, key, value)
    return apply_config_overrides(config, overrides), attn_from_overrides


def _from_pretrained(
    auto_cls,
    path: str | os.PathLike,
    *,
    dtype: DTypeLike,
    attn_implementation: str | None,
    trust_remote_code: bool,
    override_config: dict[str, Any] | None,
    enable_gradient_checkpointing: bool,
    device: str | torch.device | None,
    config_key: str,
    role_updates: dict[str, Any] | None = None,
    new_head: str | None = None,
    load_kwargs: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """`auto_cls.from_pretrained` with hyflow's config handling. `new_head`: the name of a head the checkpoint is
    known not to have (a critic's `score` on a causal-LM checkpoint): transformers' load report, which would list
    it as MISSING on every rank, is replaced by a warning only when something else is missing or unexpected."""
    resolved = resolve_model_path(path, config_key=config_key)
    config, attn_from_overrides = _load_config(resolved, override_config, trust_remote_code, role_updates,
                                               config_key)
    if auto_cls is AutoModelForCausalLM and is_vision_config(config):  # Qwen2-VL family: the image-text-to-text class
        from transformers import AutoModelForImageTextToText

        auto_cls = AutoModelForImageTextToText
    kwargs: dict[str, Any] = {"config": config, "trust_remote_code": trust_remote_code, **(load_kwargs or {})}
    torch_dtype = as_torch_dtype(dtype)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    attn = attn_implementation or attn_from_overrides
    if attn is not None:
        kwargs["attn_implementation"] = attn
    with _weight_file_errors(resolved), _hub_errors(resolved, config_key):
        if new_head is None:
            model = auto_cls.from_pretrained(resolved, **kwargs)
        else:
            model = _from_pretrained_with_new_head(auto_cls, resolved, new_head, kwargs)
    if enable_gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    if device is not None:
        model.to(device)
    return model


_MODEL_FILE_FIX = ("use weights you trust saved as safetensors (save_pretrained(DIR, safe_serialization=True) "
                   "where the model comes from), or another copy of the model")


@contextlib.contextmanager
def _weight_file_errors(resolved: str):
    """A weight file of a local model directory that cannot be read safely: an error naming that file.

    A safetensors file whose header does not parse is a `ValueError`; a `.bin` / `.pt` file that asks the
    `weights_only` unpickler for a class or call is a `CheckpointSecurityError` (nothing in it ran)."""
    try:
        yield
    except pickle.UnpicklingError as e:
        file = _first_bad_file(resolved, ("*.bin", "*.pt", "*.pth"), _probe_pickle)
        raise refusal(file or resolved, weights_only_reason(e), _MODEL_FILE_FIX) from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        file = _first_bad_file(resolved, ("*.safetensors",), _probe_safetensors)
        first = (str(e).strip().splitlines() or ["SafetensorError"])[0]
        raise ValueError(f"{file or resolved} is not a readable safetensors file ({first}): it is damaged (an "
                         "interrupted copy or download?) or not safetensors; copy or export the model again") from None


def _probe_pickle(file: Path) -> None:
    torch.load(file, map_location="cpu", weights_only=True, mmap=True)


def _probe_safetensors(file: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        handle.keys()


def _first_bad_file(resolved: str, patterns: tuple[str, ...], probe) -> Path | None:
    """The first file of the local directory `resolved` matching `patterns` that `probe` fails on, or None."""
    directory = Path(resolved)
    if not directory.is_dir():
        return None
    for file in sorted(f for pattern in patterns for f in directory.glob(pattern)):
        try:
            probe(file)
        except Exception:
            return file
    return None


def _from_pretrained_with_new_head(auto_cls, resolved: str, head: str, kwargs: dict) -> PreTrainedModel:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = auto_cls.from_pretrained(resolved, output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(head + "."))
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not k.startswith("lm_head."))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", ()) if not str(k).startswith(f"('{head}.")
                        and not str(k).startswith(head + "."))
    if missing or unexpected or mismatched:
        warnings.warn(
            f"loading {resolved} as {auto_cls.__name__}: missing {missing}, unexpected {unexpected}, shape-mismatched "
            f"{mismatched} (beyond the new '{head}' head); those weights are freshly initialised or dropped",
            stacklevel=3,
        )
    return model


def _enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing of every decoder layer; the KV cache is turned off."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: DTypeLike = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
    enable_gradient_checkpointing: bool = False,
    device: str | torch.device | None = None,
    config_key: str = "actor_rollout_ref.model.path",
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` with hyflow's path checks, dtype names and config overrides (a
    vision-language model of `hyflow.models.vision`'s family loads with `AutoModelForImageTextToText`).

    `dtype`: "float32" (default; fp32 master weights for training), "bfloat16", "float16", "auto" (the
    checkpoint's dtype) or a torch.dtype. `attn_implementation`: "sdpa", "eager", ... (None: transformers'
    default; an `attn_implementation` key in `override_config` is used when this is None).
    `override_config` is applied to the AutoConfig before the weights are built (see
    `apply_config_overrides`); unknown keys raise ValueError naming the key and the config class.
    """
    model = _from_pretrained(
        AutoModelForCausalLM,
        path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        override_config=override_config,
        enable_gradient_checkpointing=enable_gradient_checkpointing,
        device=device,
        config_key=config_key,
    )
    return model


def _architecture_endswith(config: PretrainedConfig, suffix: str) -> bool:
    return any(arch.endswith(suffix) for arch in (config.architectures or []))


def init_value_head(head: nn.Linear) -> None:
    """Fresh value head: weight ~ normal(0, (1 / (hidden + 1))^2), bias = 0 (values start near 0)."""
    with torch.no_grad():
        nn.init.normal_(head.weight, mean=0.0, std=1.0 / (head.in_features + 1))
        if head.bias is not None:
            head.bias.zero_()


def load_value_model(
    path: str | os.PathLike,
    *,
    dtype: DTypeLike = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
    enable_gradient_checkpointing: bool = False,
    device: str | torch.device | None = None,
    config_key: str = "critic.model.path",
) -> PreTrainedModel:
    """A critic: `AutoModelForTokenClassification` (num_labels=1) = backbone + Linear(hidden, 1) per token.

    A checkpoint saved by `save_value_model` (architectures `*ForTokenClassification`, num_labels 1) loads
    with its head; any other checkpoint (a causal LM) gives the backbone plus a fresh head from
    `init_value_head`. `model(input_ids, attention_mask, position_ids).logits[..., 0]` is V [B, L];
    `hyflow.models.forward.values_from_model` slices the response positions. Classifier dropout is 0.

    A vision-language model (`hyflow.models.vision`'s family, which has no token-classification class) is its
    image-text-to-text model whose output head becomes Linear(hidden, 1) (`as_vision_value_model`; verl puts trl's
    value head on the same model): `.logits[..., 0]` is V again, with the images in the call.
    """
    resolved = resolve_model_path(path, config_key=config_key)
    saved_config = _auto_config(resolved, trust_remote_code, config_key)
    if is_vision_config(saved_config):
        return _load_vision_value_model(resolved, saved_config, dtype=dtype, attn_implementation=attn_implementation,
                                        trust_remote_code=trust_remote_code, override_config=override_config,
                                        enable_gradient_checkpointing=enable_gradient_checkpointing, device=device,
                                        config_key=config_key)
    has_saved_head = (
        _architecture_endswith(saved_config, "ForTokenClassification") and saved_config.num_labels == 1
    )
    model = _from_pretrained(
        AutoModelForTokenClassification,
        resolved,
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        override_config=override_config,
        enable_gradient_checkpointing=enable_gradient_checkpointing,
        device=device,
        config_key=config_key,
        role_updates={"num_labels": 1, "classifier_dropout": 0.0},
        new_head=None if has_saved_head else "score",
    )
    if not has_saved_head:
        init_value_head(model.score)
    return model


VALUE_HEAD_FLAG = "hyflow_value_head"
"""Config attribute of a vision-language critic saved by hyflow: its `lm_head` is the value head [1, hidden]."""


def as_vision_value_model(model: PreTrainedModel) -> PreTrainedModel:
    """A vision-language model as a critic, in place: its output head becomes a fresh `Linear(hidden, 1)`
    (`init_value_head`; untied from the embeddings), so `model(...).logits` is [B, L, 1], the values."""
    old = model.get_output_embeddings()
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    head = nn.Linear(old.in_features, 1, bias=True, device=old.weight.device, dtype=old.weight.dtype)
    init_value_head(head)
    model.set_output_embeddings(head)
    model.config.num_labels = 1
    setattr(model.config, VALUE_HEAD_FLAG, True)
    return model


def _load_vision_value_model(resolved: str, saved_config, *, config_key: str, **kwargs) -> PreTrainedModel:
    """`load_value_model` of a vision-language model: the model with a value head (`as_vision_value_model`); a
    critic hyflow saved (`VALUE_HEAD_FLAG` in its config) gets its saved head back."""
    saved_head = bool(getattr(saved_config, VALUE_HEAD_FLAG, False))
    device = kwargs.pop("device")
    model = _from_pretrained(AutoModelForCausalLM, resolved, **kwargs, device=None, config_key=config_key,
                             new_head="lm_head" if saved_head else None,
                             load_kwargs={"ignore_mismatched_sizes": True} if saved_head else None)
    as_vision_value_model(model)
    if saved_head:
        from safetensors import safe_open

        found = {}
        for file in sorted(Path(resolved).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                found.update({key: handle.get_tensor(key) for key in handle.keys() if key.startswith("lm_head.")})  # noqa: SIM118
        head = model.get_output_embeddings()
        if set(found) != {"lm_head.weight", "lm_head.bias"} or found["lm_head.weight"].shape != head.weight.shape:
            raise ValueError(f"{resolved}: a vision-language critic ({VALUE_HEAD_FLAG} in its config) needs its value "
                             f"head lm_head.weight [1, hidden] and lm_head.bias in its safetensors files; found "
                             f"{ {k: tuple(v.shape) for k, v in found.items()} }")
        with torch.no_grad():
            head.weight.copy_(found["lm_head.weight"])
            head.bias.copy_(found["lm_head.bias"])
    if device is not None:
        model.to(device)
    return model


def save_value_model(model: PreTrainedModel, out_dir: str | os.PathLike, tokenizer=None) -> Path:
    """Save a critic (backbone + value head) as an HF checkpoint that `load_value_model` reloads exactly."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_reward_model(
    path: str | os.PathLike,
    *,
    dtype: DTypeLike = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    allow_fresh_head: bool = False,
    config_key: str = "reward_model.model.path",
) -> PreTrainedModel:
    """A sequence-classification reward model (`AutoModelForSequenceClassification`, num_labels=1), eval mode.

    The checkpoint must be a saved `*ForSequenceClassification` with one label; `allow_fresh_head=True`
    accepts any backbone and leaves HF's random score head (for tests and for training a reward model).
    `hyflow.models.forward.reward_scores` reads the score at the last attended token.
    """
    resolved = resolve_model_path(path, config_key=config_key)
    saved_config = _auto_config(resolved, trust_remote_code, config_key)
    is_reward_model = _architecture_endswith(saved_config, "ForSequenceClassification")
    if is_reward_model and saved_config.num_labels != 1:
        raise ValueError(
            f"{config_key}={str(path)!r} is a classifier with num_labels={saved_config.num_labels}; a reward "
            f"model needs num_labels=1 (one scalar score per sequence)"
        )
    if not is_reward_model and not allow_fresh_head:
        raise ValueError(
            f"{config_key}={str(path)!r} holds {saved_config.architectures}, not a reward model; point it to an "
            f"AutoModelForSequenceClassification checkpoint with num_labels=1, or pass allow_fresh_head=True "
            f"for a randomly initialised score head"
        )
    model = _from_pretrained(
        AutoModelForSequenceClassification,
        resolved,
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        override_config=override_config,
        enable_gradient_checkpointing=False,
        device=device,
        config_key=config_key,
        role_updates={"num_labels": 1},
    )
    if model.config.pad_token_id is None:
        # HF's sequence classifiers refuse batches > 1 without a pad id; reward_scores pools by attention mask.
        eos = model.config.eos_token_id
        model.config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model.eval()

def load_vision_processor(model_path: str | Path, tokenizer, *, image_kwargs: dict | None = None,
                          trust_remote_code: bool = False) -> VisionProcessor | None:
    """The `VisionProcessor` of the model at `model_path` (a directory or hub id) with `tokenizer`, None for a text
    model or a path without a model config (the model's own loading then says what is wrong)."""
    resolved = resolve_model_path(str(model_path))
    config = _vision_config(resolved, trust_remote_code)
    if config is None:
        return None
    return VisionProcessor.from_pretrained(resolved, tokenizer=tokenizer, config=config, image_kwargs=image_kwargs,
                                           trust_remote_code=trust_remote_code)


def is_vision_model(model_path: str | Path, *, trust_remote_code: bool = False) -> bool:
    """Whether the model at `model_path` is a vision-language model of `hyflow.models.vision`'s family (its config
    only; False for a path without a model config)."""
    return _vision_config(resolve_model_path(str(model_path)), trust_remote_code) is not None


def is_score_model(model_path: str | Path, *, trust_remote_code: bool = False) -> bool:
    """Whether the model at `model_path` is a discriminative reward model: its config names a sequence or token
    classification architecture (`*ForSequenceClassification`, `*ForTokenClassification`); False for a causal LM
    (a generative reward model) and for a path without a model config."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(str(model_path)), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return False
    return any(name.endswith(("ForSequenceClassification", "ForTokenClassification"))
               for name in getattr(config, "architectures", None) or ())


def _vision_config(resolved: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    return config if is_vision_config(config) else None


