"""Reading NVFP4 checkpoints (ComfyUI / BFL ``*-nvfp4`` files) and keeping their Linears in NVFP4.

A layer is NVFP4 when the file declares it (``<layer>.comfy_quant`` or ``_quantization_metadata``
format ``"nvfp4"``) or has a ``<layer>.weight_scale_2``. :func:`nvfp4_view_infos` hides the scales and
gives each packed weight an :class:`NVFP4TensorInfo` with its logical ``[out, in]`` shape;
:func:`plan_nvfp4` keeps each such Linear as an :class:`~klein_core.quant.nvfp4.NVFP4Linear`, and
anything else stored in NVFP4 is dequantised exactly.

Only ComfyUI's layout (swizzled block scales, even element in the high nibble) is read. The file's
origin decides (:func:`layout_problem`): a ComfyUI marker, or BFL block names, means ComfyUI's layout;
a ``quantization_config`` header entry (ModelOpt), or ``weight_scale_2`` under diffusers / Hugging
Face names without a marker, is refused. Why: docs/DESIGN.md.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import WeightFormatError
from ..models.layers import replace_module
from ..quant.nvfp4 import BLOCK, NVFP4Linear, dequantize, scale_shape
from .key_map import DecodingView, Op, Take, quantizable_linears
from .source import TensorInfo, WeightSource

logger = logging.getLogger(__name__)

FORMAT = "nvfp4"
_SUFFIXES = {"weight_scale": ".weight_scale", "tensor": ".weight_scale_2", "input": ".input_scale"}
_MODELOPT_KEY = "quantization_config"  # ModelOpt's hf_quant_config, written into the header by its export
_COMFY_METADATA_KEY = "_quantization_metadata"
_BFL_BLOCK = re.compile(r"(?:^|\.)(?:double_blocks|single_blocks)\.\d+\.")
_FIX = ("Use ComfyUI's or BFL's NVFP4 file of the model (comfy-kitchen layout), its fp8 or bf16 file, or "
        "re-quantise the bf16 weights with comfy-kitchen.")


@dataclass(frozen=True, eq=False)
class NVFP4TensorInfo(TensorInfo):
    """A packed NVFP4 weight: ``shape`` is the logical ``[out, in]``, ``dtype`` float32 (what it
    stands for); reading the key gives the packed uint8 codes. ``read_block_scale()`` reads the
    swizzled fp8 block scales; ``tensor_scale`` / ``input_scale`` are the float32 scalars."""

    read_block_scale: Callable[[], torch.Tensor] | None = None
    tensor_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None


def nvfp4_layers(src: WeightSource, declared: Mapping[str, dict]) -> set[str]:
    """The layers of ``src`` stored in NVFP4."""
    layers = {layer for layer, spec in declared.items() if spec.get("format") == FORMAT}
    layers |= {k[: -len(_SUFFIXES["tensor"])] for k in src.keys() if k.endswith(_SUFFIXES["tensor"])}
    return layers


def _header_nvfp4_layers(src: WeightSource) -> set[str]:
    try:
        layers = json.loads(src.metadata.get(_COMFY_METADATA_KEY) or "{}").get("layers", {})
        return {str(k) for k, v in layers.items() if isinstance(v, dict) and v.get("format") == FORMAT}
    except (json.JSONDecodeError, AttributeError):
        return set()  # fp8.prepare_quantized refuses a malformed entry before NVFP4 is looked at


def layout_problem(src: WeightSource, layers: set[str]) -> str | None:
    """Why the NVFP4 ``layers`` of ``src`` cannot be read as ComfyUI's layout (``None`` when they can):
    the rule in the module doc. The message names the file, a layer's block-scale tensor and the fix."""
    if not layers:
        return None
    first = sorted(layers)[0]
    where = f"'{first}{_SUFFIXES['weight_scale']}'" + (f" and {len(layers) - 1} more" if len(layers) > 1 else "")
    if _MODELOPT_KEY in src.metadata:
        return (f"{src.name}: the NVFP4 block scales {where} were written by NVIDIA ModelOpt (the header has a "
                f"'{_MODELOPT_KEY}' entry). ModelOpt stores them row-major unless its export was told to "
                "swizzle them and packs the fp4 codes low nibble first, and the file records neither, so "
                "klein_core cannot tell how to read them (at Klein's sizes both layouts have the same shape: "
                f"a wrong guess would load silently wrong). {_FIX}")
    declared = _header_nvfp4_layers(src) | {layer for layer in layers if layer + ".comfy_quant" in src}
    unmarked = sorted(layers - declared)
    if unmarked and not any(_BFL_BLOCK.search(k) for k in src.keys()):
        where = f"'{unmarked[0]}{_SUFFIXES['weight_scale']}'" + (
            f" and {len(unmarked) - 1} more" if len(unmarked) > 1 else "")
        return (f"{src.name}: the NVFP4 block scales {where} carry no ComfyUI marker ('<layer>.comfy_quant' "
                f"or the '{_COMFY_METADATA_KEY}' header entry) and the names are not BFL's, so the file's "
                "origin cannot be told: NVIDIA ModelOpt exports (diffusers / Hugging Face names) keep the "
                "block scales row-major and the fp4 codes low nibble first, ComfyUI's files swizzle the "
                "scales, and at Klein's sizes the two have the same shape. klein_core refuses rather than guess. "
                f"{_FIX}")
    return None


def _scalar(src: WeightSource, key: str) -> torch.Tensor:
    t = src.get(key)
    if not t.is_floating_point() or t.numel() != 1:
        raise WeightFormatError(f"{src.name}: '{key}' should be one float32 scale, got {t.dtype} {list(t.shape)}.")
    return t.float().reshape(())


def nvfp4_view_infos(src: WeightSource, layers: set[str]) -> tuple[dict[str, TensorInfo], set[str]]:
    """``(infos of the packed weights, keys to hide)`` for the NVFP4 ``layers`` of ``src``."""
    for layer in sorted(layers):  # complete and of the right dtypes first: those errors say more
        wkey, skey, tkey = layer + ".weight", layer + _SUFFIXES["weight_scale"], layer + _SUFFIXES["tensor"]
        missing = [k for k in (wkey, skey, tkey) if k not in src]
        if missing:
            raise WeightFormatError(f"{src.name}: NVFP4 layer '{layer}' lacks {missing}; the file is incomplete. "
                                    "Download it again.")
        w, s = src.info(wkey), src.info(skey)
        if w.dtype != torch.uint8 or len(w.shape) != 2 or s.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise WeightFormatError(f"{src.name}: NVFP4 layer '{layer}' should have uint8 packed weights and fp8 "
                                    f"block scales, got {w.dtype} {list(w.shape)} and {s.dtype}.")
    problem = layout_problem(src, layers)  # the shape check below cannot tell the layouts apart
    if problem is not None:
        raise WeightFormatError(problem)
    infos: dict[str, TensorInfo] = {}
    hidden: set[str] = set()
    for layer in sorted(layers):
        wkey, skey, tkey, ikey = (layer + ".weight", layer + _SUFFIXES["weight_scale"], layer + _SUFFIXES["tensor"],
                                  layer + _SUFFIXES["input"])
        w, s = src.info(wkey), src.info(skey)
        out_features, in_features = w.shape[0], w.shape[1] * 2
        if tuple(s.shape) != scale_shape(out_features, in_features):
            raise WeightFormatError(
                f"{src.name}: NVFP4 layer '{layer}' has block scales {list(s.shape)}, expected "
                f"{list(scale_shape(out_features, in_features))} (the swizzled layout ComfyUI writes); a file with "
                "row-major (ModelOpt) scales is another format.")

        def read_scales(key: str = skey) -> torch.Tensor:
            t = src.get(key)
            return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t

        infos[wkey] = NVFP4TensorInfo((out_features, in_features), torch.float32, read_block_scale=read_scales,
                                      tensor_scale=_scalar(src, tkey),
                                      input_scale=_scalar(src, ikey) if ikey in src else None)
        hidden |= {skey, tkey} | ({ikey} if ikey in src else set())
    return infos, hidden


# ----- loading into a model -------------------------------------------------------------------------


def reads_nvfp4(op: Op, src: WeightSource) -> bool:
    return any(isinstance(src.info(k), NVFP4TensorInfo) for k in op.sources())


def _decode(info: TensorInfo, raw: torch.Tensor) -> torch.Tensor:
    if isinstance(info, NVFP4TensorInfo):
        return dequantize(raw, info.read_block_scale(), info.tensor_scale, info.shape)  # type: ignore[misc, arg-type]
    return raw


def dequantize_op(op: Op, src: WeightSource) -> torch.Tensor:
    """An op whose sources include NVFP4 weights, on their exact float32 values."""
    return op.load(DecodingView(src, _decode))  # type: ignore[arg-type]


def plan_nvfp4(module: nn.Module, ops: Mapping[str, Op], src: WeightSource, quantize: str | None) -> dict[str, str]:
    """Which ``<layer>.weight`` stay NVFP4: every Linear whose weight is one NVFP4 tensor (none with
    ``quantize="dequantize"``). Values: the layer name."""
    if quantize == "dequantize":
        return {}
    linears = quantizable_linears(module)
    return {name: name.rsplit(".", 1)[0] for name, op in ops.items()
            if name.endswith(".weight") and name.rsplit(".", 1)[0] in linears and isinstance(op, Take)
            and isinstance(src.info(op.key), NVFP4TensorInfo) and src.info(op.key).shape[1] % BLOCK == 0}


def swap_to_nvfp4_(module: nn.Module, layers: Mapping[str, str], src: WeightSource, ops: Mapping[str, Op],
                   dtype: torch.dtype) -> None:
    for name, path in layers.items():
        lin = module.get_submodule(path)
        info = src.info(ops[name].sources()[0])
        new = NVFP4Linear(lin.in_features, lin.out_features, lin.bias is not None,
                          input_scale=getattr(info, "input_scale", None) is not None, device="meta")
        new.compute_dtype = dtype
        replace_module(module, path, new)


def load_nvfp4(name: str, op: Op, src: WeightSource, device: torch.device) -> dict[str, torch.Tensor]:
    """The state of one :class:`NVFP4Linear`: the file's packed codes and scales, as they are."""
    layer = name.rsplit(".", 1)[0]
    info = src.info(op.sources()[0])
    assert isinstance(info, NVFP4TensorInfo)
    out_features, in_features = info.shape
    packed = src.get(op.sources()[0])[:out_features, : in_features // 2]  # files may pad rows to 16
    state = {f"{layer}.qweight": packed.contiguous().to(device),  # scales as their bit patterns (see NVFP4Linear)
             f"{layer}.block_scale": info.read_block_scale().view(torch.uint8).to(device),  # type: ignore[misc]
             f"{layer}.tensor_scale": info.tensor_scale.float().reshape(()).view(torch.int32).to(device)}  # type: ignore[union-attr]
    if info.input_scale is not None:
        state[f"{layer}.input_scale"] = info.input_scale.float().reshape(()).view(torch.int32).to(device)
    return state


__all__ = ["FORMAT", "NVFP4TensorInfo", "dequantize_op", "layout_problem", "load_nvfp4", "nvfp4_layers",
           "nvfp4_view_infos", "plan_nvfp4", "reads_nvfp4", "swap_to_nvfp4_"]
