"""NVFP4 weights (ComfyUI / comfy-kitchen / BFL format) in plain PyTorch.

A quantised Linear ``[out, in]`` stores ``weight`` (uint8 ``[out, in/2]``, two E2M1 codes per byte, the
even element in the high nibble), ``weight_scale`` (float8 e4m3 ``[roundup(out, 128), roundup(in/16, 4)]``,
one scale per 16 elements of a row, cuBLAS's swizzled layout; :func:`swizzle` / :func:`unswizzle`
convert ModelOpt's row-major ones), ``weight_scale_2`` (float32 ``[]``) and optionally ``input_scale``.

``W[r, c] = E2M1[code] * (block_scale[r, c // 16] * weight_scale_2)`` in float32, in that order: bit for
bit comfy-kitchen's ``dequantize_nvfp4(..., output_type=torch.float32)``. :class:`NVFP4Linear`
dequantises per call on any device; on Blackwell (sm_100+) with comfy-kitchen it runs fp4
``scaled_mm_nvfp4`` instead, which also rounds the activations to fp4 (:func:`set_native_matmul` or
``KLEIN_NVFP4_MATMUL=dequantize`` turns it off; a failing native call falls back to dequantising).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ..pipeline.request import indexed_device
from .ggml import _CHUNK, const

logger = logging.getLogger(__name__)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 16
FP4_MAX, FP8_E4M3_MAX = 6.0, 448.0
NATIVE_MIN_CAPABILITY = (10, 0)  # cuBLAS block-scaled fp4 GEMM: Blackwell
_NATIVE_DTYPES = (torch.bfloat16, torch.float16)


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """The stored (swizzled, padded) shape of the block scales of an ``[out, in]`` weight."""
    return _roundup(out_features, 128), _roundup(in_features // BLOCK, 4)


def unswizzle(block_scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled ``[Rp, Cp]`` block scales -> row-major ``[rows, cols]`` (cols = in / 16)."""
    rp, cp = block_scale.shape
    if rp % 128 or cp % 4 or rp < rows or cp < cols:
        raise ValueError(f"block scales {list(block_scale.shape)} are not the blocked layout of a "
                         f"[{rows}, {cols}] scale grid")
    tiles = block_scale.reshape(rp // 128, cp // 4, 32, 4, 4)  # (row tile, col tile, r % 32, r // 32 % 4, c % 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(rp, cp)[:rows, :cols]


def swizzle(plain: torch.Tensor) -> torch.Tensor:
    """Row-major ``[rows, cols]`` block scales -> the swizzled, zero-padded layout (the inverse)."""
    rows, cols = plain.shape
    rp, cp = _roundup(rows, 128), _roundup(cols, 4)
    padded = plain.new_zeros((rp, cp))
    padded[:rows, :cols] = plain
    return padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor,
               shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out, in]`` weight stored as NVFP4, as ``dtype`` (float32 maths, one final cast)."""
    out_features, in_features = shape
    if packed.dtype != torch.uint8 or packed.shape[0] < out_features or packed.shape[1] * 2 < in_features:
        raise ValueError(f"packed NVFP4 weight {packed.dtype} {list(packed.shape)} does not hold {list(shape)}")
    table = const(E2M1_VALUES, torch.float32, packed.device)  # made once per device
    scales = unswizzle(block_scale, out_features, in_features // BLOCK).float()
    total = tensor_scale.float().to(packed.device) * scales  # [out, in/16], as comfy-kitchen: global * block
    out = torch.empty((out_features, in_features), dtype=dtype, device=packed.device)
    # In row chunks: the int64 codes and float32 products of a whole 9B layer would be ~2.5 GB of
    # temporaries per call; a chunk is ~16 MiB of float32 (same values, each row computed alike).
    step = max(1, _CHUNK // in_features)
    for r in range(0, out_features, step):
        rows = packed[r : min(r + step, out_features), : in_features // 2]
        codes = torch.stack([rows >> 4, rows & 0x0F], dim=-1).reshape(rows.shape[0], in_features)  # high first
        w = table[codes.long()].reshape(rows.shape[0], -1, BLOCK) * total[r : r + rows.shape[0], :, None]
        out[r : r + rows.shape[0]] = w.reshape(rows.shape[0], in_features)
    return out


class NVFP4Linear(nn.Module):
    """A Linear whose weight stays NVFP4 (packed codes, swizzled fp8 block scales and a per-tensor
    scale, as buffers: they move with the module and count in its bytes), dequantised exactly for
    each call in the input's dtype on the layer's device.

    The scales are stored as integer bit patterns (``block_scale`` uint8, ``tensor_scale`` int32) so
    that ``model.to(dtype)`` can never round them; :attr:`scales` gives them as float8 / float32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, input_scale: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"NVFP4 needs whole blocks of {BLOCK} inputs, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("block_scale", torch.empty(scale_shape(out_features, in_features),
                                                        dtype=torch.uint8, device=device))
        self.register_buffer("tensor_scale", torch.empty((), dtype=torch.int32, device=device))
        # kept for a native fp4 matmul (activations quantised with it); the dequantising path ignores it
        self.register_buffer("input_scale", torch.empty((), dtype=torch.int32, device=device) if input_scale else None)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None
        self.compute_dtype = torch.bfloat16
        # fp4 x fp4 on Blackwell where comfy-kitchen can (see the module doc and the setter)
        self.native_matmul = os.environ.get("KLEIN_NVFP4_MATMUL", "auto").lower() != "dequantize"

    @property
    def native_matmul(self) -> bool:
        return self._native_matmul

    @native_matmul.setter
    def native_matmul(self, enabled: bool) -> None:
        # cuBLAS's fp4 GEMM needs whole 32-input groups (K % 32) and 8-aligned outputs (N % 8)
        self._native_matmul = bool(enabled) and self.in_features % 32 == 0 and self.out_features % 8 == 0

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block scales as float8 e4m3, per-tensor scale as float32)."""
        return self.block_scale.view(torch.float8_e4m3fn), self.tensor_scale.view(torch.float32)

    def float_parts(self) -> list[tuple[str, str, torch.Tensor]]:
        """The float values among the packed buffers, for a NaN/Inf scan: ``(file tensor suffix, what
        it is, the values)``: the per-tensor scale, the block scales that are used (the swizzled
        padding is not) and the input scale if any. The fp4 codes are integers, always finite."""
        block, tensor = self.scales
        parts = [("weight_scale_2", "its NVFP4 per-tensor scale", tensor),
                 ("weight_scale", "its NVFP4 block scales",
                  unswizzle(block, self.out_features, self.in_features // BLOCK))]
        if self.input_scale is not None:
            parts.append(("input_scale", "its NVFP4 input scale", self.input_scale.view(torch.float32)))
        return parts

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        block, tensor = self.scales
        return dequantize(self.qweight, block, tensor, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        # Training a LoRA below this layer needs a gradient through it: comfy-kitchen's fp4 matmul has
        # none, the dequantised weight's F.linear has.
        wants_grad = torch.is_grad_enabled() and x.requires_grad
        if self.native_matmul and not wants_grad and x.dtype in _NATIVE_DTYPES and native_unavailable(x.device) is None:
            try:
                # comfy-kitchen launches on the current device's stream: make it the layer's GPU
                with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
                    return native_linear(self, x, bias, _kitchen())
            except (RuntimeError, ValueError, AssertionError, TypeError) as exc:
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise
                self.native_matmul = False
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if why not in _FAILURES:  # one warning per distinct failure, not one per layer
                    _FAILURES.add(why)
                    logger.warning("NVFP4 layer [%d -> %d]: comfy-kitchen's fp4 matmul failed (%s); such layers "
                                   "dequantise their weight from now on", self.in_features, self.out_features, why)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4"


def _kitchen() -> ModuleType:
    import comfy_kitchen

    return comfy_kitchen


_NATIVE: dict[tuple[str, int | None], str | None] = {}
_FAILURES: set[str] = set()


def native_unavailable(device: torch.device) -> str | None:
    """Why the native fp4 matmul cannot run on ``device`` (``None`` when it can). Asked once per
    device, at the first call on it (never at import: no CUDA query before a model runs)."""
    device = indexed_device(device)  # "cuda" is the current device: one entry with "cuda:N"
    key = (device.type, device.index)
    if key not in _NATIVE:
        _NATIVE[key] = _native_reason(device)
        if _NATIVE[key] is None:
            logger.info("NVFP4 layers on %s multiply in fp4 (comfy-kitchen scaled_mm_nvfp4)", device)
        else:
            logger.info("NVFP4 layers on %s dequantise per call: %s", device, _NATIVE[key])
    return _NATIVE[key]


def _native_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"{device.type} has no fp4 matmul"
    capability = torch.cuda.get_device_capability(device)
    if capability < NATIVE_MIN_CAPABILITY:
        return (f"compute capability {capability[0]}.{capability[1]} (fp4 tensor cores need "
                f"{NATIVE_MIN_CAPABILITY[0]}.{NATIVE_MIN_CAPABILITY[1]}, Blackwell)")
    if importlib.util.find_spec("comfy_kitchen") is None:
        return "comfy-kitchen is not installed (pip install comfy-kitchen)"
    cuda = _kitchen().list_backends().get("cuda", {})
    if not cuda.get("available") or "scaled_mm_nvfp4" not in cuda.get("capabilities", ()):
        return f"comfy-kitchen's CUDA backend cannot run scaled_mm_nvfp4 ({cuda.get('unavailable_reason') or 'not listed'})"
    return None


def native_linear(layer: NVFP4Linear, x: torch.Tensor, bias: torch.Tensor | None, kitchen: ModuleType) -> torch.Tensor:
    """``layer(x)`` with fp4 activations: ``x`` ``[..., in]`` is quantised to NVFP4 per call (the
    file's ``input_scale``, else amax / (448 * 6)) and multiplied with the packed weight by
    ``kitchen.scaled_mm_nvfp4``; returns ``[..., out]`` in ``x.dtype``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, layer.in_features)
    rows = x2.shape[0]
    if layer.input_scale is not None:
        scale_x = layer.input_scale.view(torch.float32).to(x.device)
    else:  # stays on the device: no host sync
        scale_x = (x2.abs().amax().float() / (FP8_E4M3_MAX * FP4_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    # comfy-kitchen pads rows to 16 (and its scales to 128 rows) itself; the padding rows are cut below
    qx, block_x = kitchen.quantize_nvfp4(x2.contiguous(), scale_x, pad_16x=rows % 16 != 0)
    block_w, scale_w = layer.scales
    y = kitchen.scaled_mm_nvfp4(qx, layer.qweight, scale_x, scale_w, block_x, block_w, bias=bias, out_dtype=x.dtype)
    return y[:rows].reshape(*lead, layer.out_features)


def set_native_matmul(model: nn.Module, enabled: bool) -> int:
    """Allow (``True``, the default where it can run) or forbid (``False``: every layer dequantises
    its weight, the exact reference path) the native fp4 matmul in ``model``'s NVFP4 layers; returns
    how many layers it set."""
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    for m in layers:
        m.native_matmul = enabled  # the layer keeps it off where its shape cannot run natively
    return len(layers)


def nvfp4_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, NVFP4Linear)]


__all__ = ["E2M1_VALUES", "NVFP4Linear", "dequantize", "native_linear", "native_unavailable", "nvfp4_layers",
           "scale_shape", "set_native_matmul", "swizzle", "unswizzle"]
