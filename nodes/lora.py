"""Klein LoRA Loader: a LoRA on a Klein model, chainable, never changing the model it receives.

ComfyUI caches node outputs and may feed one model to several graphs, so merging into shared
weights would change other graphs' images. The node instead returns a new KLEIN_MODEL whose
transformer is a copy sharing every weight tensor with the input, with branch hooks on the
touched linears (:func:`klein_core.with_loras`): the cost is the LoRA factors, not the weights.

Two shapes of KLEIN_MODEL are handled: one that holds the transformer (``.transformer``), and one
that holds a lazy handle to it (``.ref`` with ``.get()``, as the pack's model cache does), which is
wrapped so that ``get()`` returns the patched copy, made once per loaded base model.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import weakref
from typing import Any

import torch
from comfy_api.latest import io
from torch import nn

import klein_core as kc
from klein_core.lora import check_loras

from . import host, notices
from .common import check_choices, file_state
from .types import KleinModelType

logger = logging.getLogger(__name__)

NODE = "Klein LoRA Loader"


class LoRAModelRef:
    """A model handle (``get()``) returning the base handle's transformer with LoRAs applied.

    The patched copy is cached per base model object through a weak reference, so when the pack's
    model cache drops the base model the copy goes too (it never pins the weights). ``name`` is the
    base model's file name.
    """

    def __init__(self, base: Any, loras: list[tuple[kc.LoRA, float]]) -> None:
        self.base = base
        self.loras = loras
        self._patched: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()

    @property
    def name(self) -> str:
        return self.base.name

    def __str__(self) -> str:
        return f"{self.name} + " + " + ".join(f"{lora.name.rsplit('/', 1)[-1]}:{s:g}" for lora, s in self.loras)

    def get(self) -> nn.Module:
        model = self.base.get()  # any handle with get() works as the base
        patched = self._patched.get(model)
        if patched is None:
            patched = kc.with_loras(model, self.loras)
            if patched is not model:  # (nothing for this model: caching it as its own value would pin it)
                self._patched[model] = patched
        return patched


def _replace(obj: Any, **changes: Any) -> Any:
    """A copy of ``obj`` with some attributes changed (frozen dataclasses included)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **changes)
    new = copy.copy(obj)
    for key, value in changes.items():
        object.__setattr__(new, key, value)
    return new


def patch_model(model: Any, lora: kc.LoRA, strength: float) -> Any:
    """A new KLEIN_MODEL with ``lora`` at ``strength``; ``model`` is not changed. Strength 0 -> ``model``."""
    if strength == 0.0:
        return model
    transformer = getattr(model, "transformer", None)
    if isinstance(transformer, nn.Module):
        return _replace(model, transformer=kc.with_loras(transformer, [(lora, strength)]))
    ref = getattr(model, "ref", None)
    if ref is not None and callable(getattr(ref, "get", None)):
        config = getattr(model, "config", None)
        if config is not None:  # check the fit now (on a meta_model model), not at sampling time
            with torch.device("meta"):
                check_loras(kc.Flux2Transformer(config), [(lora, strength)])
        if isinstance(ref, LoRAModelRef):  # chained loaders: one copy carrying every LoRA
            new_ref = LoRAModelRef(ref.base, [*ref.loras, (lora, strength)])
        else:
            new_ref = LoRAModelRef(ref, [(lora, strength)])
        return _replace(model, ref=new_ref)
    raise TypeError(
        f"{NODE}: the model input is a {type(model).__name__} without a transformer; connect the model "
        "output of Klein Model Loader (or another Klein LoRA Loader)."
    )


class KleinLoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinLoraLoader",
            display_name=NODE,
            category="Klein",
            description="Applies a FLUX.2 Klein LoRA (diffusers/PEFT, ai-toolkit, Kohya, LyCORIS LoKr/LoHa) to "
                        "the model. Chain several loaders to stack LoRAs. The input model is not changed. A "
                        "LoRA made for another model size is refused with both sizes named.",
            inputs=[
                KleinModelType.Input("model", tooltip="From Klein Model Loader or another Klein LoRA Loader."),
                io.Combo.Input("lora_name", options=host.filename_list("loras"),
                               tooltip="LoRA .safetensors from models/loras, made for this Klein size (4B or "
                                       "9B). Text-encoder parts of a LoRA are not applied by this node."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.05,
                               tooltip="LoRA strength; 0 = off, negative values invert the effect."),
            ],
            outputs=[KleinModelType.Output(display_name="model", tooltip="The model with the LoRA applied.")],
        )

    @classmethod
    def validate_inputs(cls, lora_name: str) -> bool | str:
        # Checked when the prompt is queued (ComfyUI 0.3.75 does not check V3 combos itself).
        return check_choices(cls, {"lora_name": "loras"}, lora_name=lora_name)

    @classmethod
    def fingerprint_inputs(cls, lora_name: str = "", strength: float = 1.0, **_: Any) -> Any:
        # Re-run when the LoRA file is replaced under the same name.
        return file_state("loras", lora_name), strength

    @classmethod
    @notices.reported
    def execute(cls, model: Any, lora_name: str, strength: float = 1.0) -> io.NodeOutput:
        path = host.full_path("loras", lora_name)
        if path is None:
            raise FileNotFoundError(f"{NODE}: lora_name '{lora_name}' was not found in models/loras.")
        try:
            lora = kc.load_lora(path)
            patched = patch_model(model, lora, float(strength))
        except (ValueError, NotImplementedError) as exc:
            raise type(exc)(f"{NODE}: {exc}") from exc
        text_parts = [p for p in lora.patches if p.component == "text_encoder"]
        if text_parts:
            logger.warning("%s: %s also adapts the text encoder (%d modules); this node applies the transformer "
                           "part only: choose the same file as the Qwen3 Layer-Concat Encoder's lora_name for the "
                           "text-encoder part", NODE, lora_name, len(text_parts))
        logger.info("%s: %s at strength %.2f", NODE, lora.summary(), strength)
        return io.NodeOutput(patched)
