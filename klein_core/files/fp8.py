"""Reading fp8 checkpoints, and keeping or putting block Linears in fp8 while loading.

Formats read (per-tensor or per-row scaled float8, ``W = q * scale``): ComfyUI "mixed precision"
(``<layer>.comfy_quant`` JSON or the file-level ``_quantization_metadata``, ``weight_scale``, optional
``input_scale``), ComfyUI's older ``scaled_fp8`` marker (``scale_weight`` / ``scale_input``), BFL /
ModelOpt float8 weights with ``weight_scale`` and no marker, and plain float8 (scale 1). Other
quantised formats are refused by name (:func:`unsupported_format`). :func:`prepare_quantized` hides
the scale and marker tensors, so plans see the bf16 file's keys and shapes; :func:`plan_fp8` picks the
weights kept in fp8 (by default the blocks' ``nn.Linear`` weights, as ``quant.fp8.FP8Linear``) and
:func:`dequantize_op` dequantises other float8 tensors. ``quantize="fp8"`` quantises bf16 block
weights one layer at a time on the target device (per-tensor absmax, e4m3 max 448), with the same
bytes as :func:`~klein_core.quant.fp8.quantize_model_`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import WeightFormatError
from ..models.layers import replace_module
from ..quant.fp8 import (
    FP8_DTYPES,
    FP8_FORMAT_OF,
    FP8Linear,
    block_linear_names,
    dequantize,
    is_fp8,
    quantize_fp8,
)
from . import nvfp4 as nvfp4_files
from .key_map import Cat, DecodingView, Op, SwapHalves, Take
from .source import TensorInfo, WeightSource
from .staging import DeviceStager, reading_through

logger = logging.getLogger(__name__)

QuantizeMode = str | None  # None (as stored), "fp8" / "q8" / "q4" (quantise bf16 block weights), "dequantize"
QUANTIZE_MODES = (None, "fp8", "q8", "q4", "dequantize")  # q8/q4: GGML blocks (klein_core.files.gguf)

_WEIGHT_SCALE_SUFFIXES = (".weight_scale", ".scale_weight")  # ComfyUI reads both spellings
_INPUT_SCALE_SUFFIXES = (".input_scale", ".scale_input")
_COMFY_QUANT = ".comfy_quant"
_SCALED_FP8_MARKER = "scaled_fp8"
_METADATA_KEY = "_quantization_metadata"
# Tensors that belong to formats we do not run; named in the refusal.
_REFUSED_SUFFIXES = {
    ".pre_quant_scale": "AWQ / SmoothQuant (pre_quant_scale)",
}


@dataclass(frozen=True, eq=False)
class QuantTensorInfo(TensorInfo):
    """Header info of a quantised weight: ``dtype`` is its float8 dtype, the rest says how to
    read it. ``scale`` is fp32, ``[]`` (per tensor) or ``[rows]`` (per output row); ``input_scale``
    is the calibrated fp32 activation scale or None."""

    fmt: str = "float8_e4m3fn"
    scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    full_precision_mm: bool = False  # ComfyUI's "full_precision_matrix_mult" hint
    origin: str = "weight_scale"  # comfy_quant | scaled_fp8 | weight_scale, for messages


def _layer_of(key: str, suffixes: Iterable[str]) -> str | None:
    for s in suffixes:
        if key.endswith(s):
            return key[: -len(s)]
    return None


def unsupported_format(src: WeightSource) -> str | None:
    """Name the quantised format of ``src`` if klein_core cannot run it (nvfp4, mxfp8, int8, ...).

    Reads only key names, the header metadata and the tiny ``.comfy_quant`` tensors.
    """
    for key in src.keys():
        for suffix, name in _REFUSED_SUFFIXES.items():
            if key.endswith(suffix):
                return name
    for layer, spec in _declared_formats(src).items():
        fmt = spec.get("format")
        if fmt not in FP8_DTYPES and fmt != nvfp4_files.FORMAT:
            return f"'{fmt}' quantised (declared for layer '{layer}')"
    return None


def _declared_formats(src: WeightSource) -> dict[str, dict]:
    """Per-layer format declarations: ``.comfy_quant`` tensors and ``_quantization_metadata``."""
    out: dict[str, dict] = {}
    raw_meta = src.metadata.get(_METADATA_KEY)
    if raw_meta:
        try:
            layers = json.loads(raw_meta).get("layers", {})
            if not isinstance(layers, dict):
                raise TypeError
        except (json.JSONDecodeError, TypeError, AttributeError):
            raise WeightFormatError(
                f"{src.name}: the '{_METADATA_KEY}' header entry is not the JSON object ComfyUI writes; "
                "the file is corrupt or from an unknown tool."
            ) from None
        for layer, spec in layers.items():
            out[str(layer)] = dict(spec) if isinstance(spec, dict) else {"format": spec}
    for key in src.keys():
        if key.endswith(_COMFY_QUANT):
            out[key[: -len(_COMFY_QUANT)]] = _read_comfy_quant(src, key)
    return out


def _read_comfy_quant(src: WeightSource, key: str) -> dict:
    info = src.info(key)
    if info.dtype != torch.uint8 or len(info.shape) != 1:
        raise WeightFormatError(
            f"{src.name}: '{key}' should be a 1-D uint8 tensor holding JSON (ComfyUI comfy_quant), "
            f"got {info.dtype} {list(info.shape)}."
        )
    try:
        spec = json.loads(bytes(src.get(key).tolist()).decode("utf-8"))
        if not isinstance(spec, dict) or not isinstance(spec.get("format"), str):
            raise TypeError
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError):
        raise WeightFormatError(
            f"{src.name}: '{key}' does not hold a comfy_quant JSON object with a \"format\" entry."
        ) from None
    return spec


def _read_scale(src: WeightSource, key: str, rows: int, what: str) -> torch.Tensor:
    t = src.get(key)
    if not t.is_floating_point():
        raise WeightFormatError(f"{src.name}: {what} '{key}' has dtype {t.dtype}, expected a float scale.")
    t = t.float()
    if t.numel() == 1:
        return t.reshape(())
    if t.numel() == rows and (t.ndim == 1 or (t.ndim == 2 and t.shape[1] == 1)):
        return t.reshape(rows)
    raise WeightFormatError(
        f"{src.name}: {what} '{key}' has shape {list(t.shape)}; only per-tensor or per-output-row "
        "fp8 scales are supported (block-wise scales are another format). Use a per-tensor fp8 file "
        "or the bf16 file."
    )


def prepare_quantized(src: WeightSource) -> WeightSource:
    """A view of ``src`` in which fp8-quantised layers look like plain weights.

    Scale, marker and ``.comfy_quant`` tensors are hidden; each quantised ``<layer>.weight`` keeps
    its key and shape, reports its float8 dtype and carries a :class:`QuantTensorInfo`; reading it
    returns the raw float8 data (a uint8 container is viewed as float8). Returns ``src`` itself when
    nothing is quantised (plain float8 tensors need no view: their scale is 1).

    Raises :class:`WeightFormatError` (naming the file, key and fix) for formats klein_core cannot
    run and for inconsistent files (a scale with no weight, a "float8" layer stored as bf16, ...).
    """
    fmt = unsupported_format(src)
    if fmt is not None:
        raise WeightFormatError(
            f"{src.name}: this file is {fmt}, which klein_core cannot run. Use the bf16 or fp8 "
            ".safetensors file of the same model."
        )
    keys = src.keys()
    declared = _declared_formats(src)
    # NVFP4 layers first: their scales are not fp8 weight scales
    nv_layers = nvfp4_files.nvfp4_layers(src, declared)
    nv_infos, nv_hidden = nvfp4_files.nvfp4_view_infos(src, nv_layers)
    declared = {k: v for k, v in declared.items() if k not in nv_layers}
    keys = [k for k in keys if k not in nv_hidden and k not in nv_infos
            and not (k.endswith(_COMFY_QUANT) and k[: -len(_COMFY_QUANT)] in nv_layers)]
    markers = [k for k in keys if k == _SCALED_FP8_MARKER or k.endswith("." + _SCALED_FP8_MARKER)]
    marker_fmt = None
    if markers:
        marker_fmt = FP8_FORMAT_OF.get(src.dtype(markers[0]), "float8_e4m3fn")
    scale_keys = {layer: k for k in keys if (layer := _layer_of(k, _WEIGHT_SCALE_SUFFIXES)) is not None}
    input_keys = {layer: k for k in keys if (layer := _layer_of(k, _INPUT_SCALE_SUFFIXES)) is not None}
    layers = set(scale_keys) | {
        layer for layer in declared if layer + ".weight" in src or layer + _COMFY_QUANT in src
    }
    if not layers and not markers and not declared and not nv_infos:
        if input_keys:  # only activation scales: nothing to run differently
            logger.warning("%s: ignoring %d input_scale tensors of unquantised layers", src.name,
                           len(input_keys))
            hidden = set(input_keys.values())
            return _view(src, {k: src.info(k) for k in keys if k not in hidden}, set())
        return src

    infos: dict[str, TensorInfo] = dict(nv_infos)
    containers: set[str] = set()
    for layer in sorted(layers):
        wkey = layer + ".weight"
        tag = scale_keys.get(layer) or (layer + _COMFY_QUANT)
        if wkey not in src:
            kind = "scaled_fp8 weight scale" if tag.endswith(".scale_weight") else "quantisation entry"
            raise WeightFormatError(
                f"{src.name}: '{tag}' is a {kind}, but there is no '{wkey}' for it to scale; the "
                "file is incomplete or its keys were renamed. Download it again."
            )
        winfo = src.info(wkey)
        spec = declared.get(layer, {})
        origin = "comfy_quant" if layer in declared else ("scaled_fp8" if markers else "weight_scale")
        want = spec.get("format") or FP8_FORMAT_OF.get(winfo.dtype) or marker_fmt
        if winfo.dtype == torch.uint8 and want in FP8_DTYPES:
            containers.add(wkey)  # fp8 bytes stored in a uint8 container: same shape, reinterpret
        elif not is_fp8(winfo.dtype) or (want is not None and FP8_DTYPES.get(want) != winfo.dtype):
            where = f"'{layer}{_COMFY_QUANT}'" if layer in declared else f"'{tag}'"
            raise WeightFormatError(
                f"{src.name}: {where} marks layer '{layer}' as {want or 'fp8-scaled'}, but '{wkey}' "
                f"is stored as {winfo.dtype}; the file is inconsistent. Re-export it, or use the bf16 file."
            )
        rows = winfo.shape[0] if winfo.shape else 1
        scale = (_read_scale(src, scale_keys[layer], rows, "weight scale") if layer in scale_keys
                 else torch.ones((), dtype=torch.float32))
        in_scale = (_read_scale(src, input_keys[layer], 1, "input scale") if layer in input_keys else None)
        infos[wkey] = QuantTensorInfo(
            winfo.shape, FP8_DTYPES[want], fmt=want, scale=scale, input_scale=in_scale,
            full_precision_mm=bool(spec.get("full_precision_matrix_mult", False)), origin=origin,
        )
    hidden = set(markers) | set(scale_keys.values()) | set(input_keys.values())
    hidden |= {k for k in keys if k.endswith(_COMFY_QUANT)}
    orphans = [k for layer, k in input_keys.items() if layer not in layers]
    if orphans:  # calibrated scales of layers left in bf16 (seen in BFL/NVIDIA mixed files)
        logger.info("%s: ignoring %d input scales of unquantised layers (e.g. %s)", src.name, len(orphans),
                    orphans[0])
    for k in keys:
        if k not in hidden and k not in infos:
            infos[k] = src.info(k)
    n_fp8 = sum(1 for i in infos.values() if isinstance(i, QuantTensorInfo))
    if n_fp8:
        logger.info("%s: %d fp8-scaled layers (%s)", src.name, n_fp8,
                    ", ".join(sorted({i.origin for i in infos.values() if isinstance(i, QuantTensorInfo)})))
    if nv_infos:
        logger.info("%s: %d NVFP4 layers", src.name, len(nv_infos))
    return _view(src, infos, containers)


def _view(src: WeightSource, infos: Mapping[str, TensorInfo], containers: set[str]) -> WeightSource:
    def reader(key: str) -> torch.Tensor:
        t = src.get(key)
        return t.view(infos[key].dtype) if key in containers else t

    return WeightSource(src.name, infos, reader, src.metadata)


def quantize_state_dict(
    state: Mapping[str, torch.Tensor],
    layers: Iterable[str],
    *,
    style: str = "comfy_quant",
    fmt: str = "float8_e4m3fn",
    input_scales: Mapping[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Write an fp8 checkpoint state dict from a float one (a converter, and the tests' fixture).

    ``layers``: layer names (``<layer>.weight`` must be in ``state``) to quantise per tensor.
    ``style``: ``"comfy_quant"`` (``.comfy_quant`` JSON + ``weight_scale``), ``"scaled_fp8"`` (a
    ``scaled_fp8`` marker + ``scale_weight``), ``"bfl"`` (``weight_scale`` only) or ``"plain"``
    (float8 weights, scale 1: saturating cast, so only for weights within the fp8 range).
    ``input_scales``: optional calibrated activation scales by layer (not used by ``"plain"``).
    Other tensors are copied unchanged.
    """
    if style not in ("comfy_quant", "scaled_fp8", "bfl", "plain"):
        raise ValueError(
            f"quantize_state_dict: unknown style '{style}' (comfy_quant, scaled_fp8, bfl, plain)"
        )
    out = dict(state)
    dtype = FP8_DTYPES[fmt]
    fmax = float(torch.finfo(dtype).max)
    for layer in layers:
        key = layer + ".weight"
        if key not in state:
            raise ValueError(f"quantize_state_dict: no tensor '{key}' to quantise")
        if style == "plain":
            out[key] = state[key].float().clamp(-fmax, fmax).to(dtype)
            continue
        q, scale = quantize_fp8(state[key], fmt)
        out[key] = q
        out[layer + (".scale_weight" if style == "scaled_fp8" else ".weight_scale")] = scale
        if input_scales and layer in input_scales:
            out[layer + (".scale_input" if style == "scaled_fp8" else ".input_scale")] = torch.tensor(
                float(input_scales[layer]), dtype=torch.float32)
        if style == "comfy_quant":
            spec = json.dumps({"format": fmt}).encode()
            out[layer + _COMFY_QUANT] = torch.tensor(list(spec), dtype=torch.uint8)
    if style == "scaled_fp8":
        out[_SCALED_FP8_MARKER] = torch.empty(0, dtype=dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Keeping layers in fp8 while loading


@dataclass(frozen=True)
class Fp8Layer:
    """One layer :func:`plan_fp8` keeps in fp8. ``quantize``: its source is float and gets
    quantised while loading; otherwise it is read from fp8 data."""

    name: str  # module path
    fmt: str
    per_row_scale: bool
    input_scale: bool
    full_precision_mm: bool
    quantize: bool


def reads_fp8(op: Op, src: WeightSource) -> bool:
    """Whether ``op`` reads any float8 tensor from ``src``."""
    return any(is_fp8(src.dtype(k)) for k in op.sources())


def _scales(op: Op, src: WeightSource) -> list[torch.Tensor]:
    out = []
    for k in op.sources():
        info = src.info(k)
        out.append(info.scale if isinstance(info, QuantTensorInfo) and info.scale is not None
                   else torch.ones((), dtype=torch.float32))
    return out


def _raw_layout(op: Op, src: WeightSource) -> tuple[bool, bool]:
    """(can stay fp8, needs a per-row scale) for an op over fp8 sources."""
    dtypes = {src.dtype(k) for k in op.sources()}
    if len(dtypes) != 1 or not is_fp8(next(iter(dtypes))):
        return False, False  # mixed sources: dequantise
    scales = _scales(op, src)
    uniform = all(s.ndim == 0 for s in scales) and all(torch.equal(s, scales[0]) for s in scales)
    if uniform:
        return True, False
    # Row-preserving ops carry per-row scales along exactly (e.g. diffusers to_q/to_k/to_v -> qkv,
    # each with its own per-tensor scale).
    rows_ok = isinstance(op, (Take, SwapHalves)) or (isinstance(op, Cat) and op.dim == 0)
    return rows_ok, True


def plan_fp8(
    module: nn.Module, plan_ops: Mapping[str, Op], src: WeightSource, quantize: QuantizeMode = None,
    layers: Callable[[str], bool] | None = None,
) -> dict[str, Fp8Layer]:
    """Which internal weights of ``module`` (built on meta) to hold in fp8: ``{weight name: layer}``.

    ``quantize``: None keeps what the file stores (fp8 block weights stay fp8); ``"fp8"`` also
    quantises float block weights; ``"dequantize"`` keeps nothing in fp8 (for devices without
    float8 support, e.g. MPS). ``layers(name)`` overrides the default selection
    (:func:`block_linear_names`).
    """
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    if quantize == "dequantize":
        return {}
    if quantize in ("q8", "q4"):  # GGML blocks instead (plan_ggml); fp8 files' layers stay fp8
        quantize = None
    allowed = set(block_linear_names(module)) if layers is None else None
    out: dict[str, Fp8Layer] = {}
    for name, op in plan_ops.items():
        if not name.endswith(".weight"):
            continue
        layer = name[: -len(".weight")]
        if (allowed is not None and layer not in allowed) or (layers is not None and not layers(layer)):
            continue
        if not isinstance(module.get_submodule(layer), nn.Linear):
            continue
        if reads_fp8(op, src):
            ok, per_row = _raw_layout(op, src)
            if not ok:
                if quantize == "fp8":
                    out[name] = Fp8Layer(layer, "float8_e4m3fn", False, False, False, True)
                continue
            infos = [src.info(k) for k in op.sources()]
            q = [i for i in infos if isinstance(i, QuantTensorInfo)]
            out[name] = Fp8Layer(
                layer, FP8_FORMAT_OF[infos[0].dtype], per_row,
                input_scale=bool(q) and len(q) == len(infos) and all(i.input_scale is not None for i in q),
                full_precision_mm=any(i.full_precision_mm for i in q), quantize=False,
            )
        elif quantize == "fp8" and all(src.dtype(k).is_floating_point for k in op.sources()):
            out[name] = Fp8Layer(layer, "float8_e4m3fn", False, False, False, True)
    return out


def swap_to_fp8_(module: nn.Module, layers: Iterable[Fp8Layer]) -> None:
    """Replace the ``nn.Linear`` modules named in ``layers`` by empty :class:`FP8Linear` (meta)."""
    for spec in layers:
        old = module.get_submodule(spec.name)
        replace_module(module, spec.name, FP8Linear(
            old.in_features, old.out_features, bias=old.bias is not None, fmt=spec.fmt,
            per_row_scale=spec.per_row_scale, input_scale=spec.input_scale,
            full_precision_mm=spec.full_precision_mm, device="meta",
        ))


class _RowScales:
    """A stand-in source whose tensors are each key's weight scale as a ``[rows]`` vector, so an
    Op applied to it moves the scales exactly as it moves the weight rows."""

    def __init__(self, src: WeightSource) -> None:
        self._src = src

    def get(self, key: str) -> torch.Tensor:
        info = self._src.info(key)
        s = info.scale if isinstance(info, QuantTensorInfo) and info.scale is not None else torch.ones(())
        return s.float().expand(info.shape[0]).clone() if s.ndim == 0 else s.float()

    def shape(self, key: str) -> tuple[int, ...]:
        return (self._src.shape(key)[0],)


def _decode(info: TensorInfo, t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor dequantised to float32 (others as read)."""
    if not is_fp8(t.dtype):
        return t
    scale = info.scale if isinstance(info, QuantTensorInfo) and info.scale is not None else torch.ones(())
    return dequantize(t, scale)


def dequantize_op(op: Op, src: WeightSource) -> torch.Tensor:
    """``op`` evaluated on dequantised (float32) sources."""
    return op.load(DecodingView(src, _decode))  # type: ignore[arg-type]


def load_fp8(
    name: str, spec: Fp8Layer, op: Op, src: WeightSource, device: torch.device,
    stager: DeviceStager | None = None,
) -> dict[str, torch.Tensor]:
    """State-dict entries (``weight``, ``weight_scale``, [``input_scale``]) of one FP8Linear.
    ``stager``: the weight's bytes are read through it onto the device (as stored: a copy, exact)."""
    prefix = spec.name + "."
    if device.type == "meta":  # shapes only (see weights.materialize)
        rows = op.shape(src)[0]
        out = {name: torch.empty(op.shape(src), dtype=FP8_DTYPES[spec.fmt], device=device),
               prefix + "weight_scale": torch.empty((rows,) if spec.per_row_scale else (), device=device)}
        if spec.input_scale:
            out[prefix + "input_scale"] = torch.empty((), device=device)
        return out
    if spec.quantize:
        # Quantised where it will live (one layer's float32 copy at a time): far faster on a GPU.
        if reads_fp8(op, src):
            w = dequantize_op(op, src).to(device)
        else:
            with reading_through(stager):
                w = op.load(src).to(device)
        q, scale = quantize_fp8(w, spec.fmt)
        return {name: q, prefix + "weight_scale": scale}
    with reading_through(stager):
        data = op.load(src)
    if spec.per_row_scale:
        scale = op.load(_RowScales(src))  # type: ignore[arg-type]
    else:
        scale = _scales(op, src)[0]
    out = {name: data.contiguous().to(device), prefix + "weight_scale": scale.float().to(device)}
    if spec.input_scale:
        infos = [src.info(k) for k in op.sources()]
        # Fused layers read one input; the largest calibrated scale never clips any of them.
        scales = [i.input_scale.float().reshape(()) for i in infos]  # type: ignore[union-attr]
        xs = torch.stack(scales).amax()
        out[prefix + "input_scale"] = xs.to(device)
    return out


__all__ = [
    "QUANTIZE_MODES", "Fp8Layer", "QuantTensorInfo", "dequantize_op", "load_fp8", "plan_fp8", "prepare_quantized",
    "quantize_state_dict", "reads_fp8", "swap_to_fp8_", "unsupported_format",
]
