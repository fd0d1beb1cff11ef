"""GGML block quantisation (the GGUF formats) in plain PyTorch.

* :func:`dequantize`: raw GGUF blocks -> float, bit for bit ``gguf.quants.dequantize`` (numpy, float32)
  for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (float32 in
  numpy's order, in row chunks, then cast to the compute dtype).
* :func:`quantize`: float -> Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks, bit for bit ``gguf.quants.quantize``.
* :class:`GGMLLinear`: a Linear whose weight stays in its blocks and is dequantised for each call,
  on the layer's device (as ComfyUI-GGUF does, but exact).

Blocks run along a weight's rows (``in_features``): a row of ``n`` elements is ``n / block`` blocks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from enum import IntEnum

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class GGMLType(IntEnum):
    """The GGUF tensor types klein_core reads (ggml's enum values)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# (elements per block, bytes per block)
BLOCKS: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34), GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210),
}
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
QUANTIZE_TYPES = {"q8": GGMLType.Q8_0, "q4": GGMLType.Q4_0}  # quantize= on load -> block type
_CHUNK = 1 << 22  # elements dequantised at a time (16 MiB of float32)
# where a block keeps its fp16 scale (and minimum) fields: a byte range within each block; every
# other byte is an integer code, always "finite"
SCALE_BYTES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q4_0: (0, 2), GGMLType.Q4_1: (0, 4), GGMLType.Q5_0: (0, 2), GGMLType.Q5_1: (0, 4),
    GGMLType.Q8_0: (0, 2), GGMLType.Q2_K: (80, 84), GGMLType.Q3_K: (108, 110), GGMLType.Q4_K: (0, 4),
    GGMLType.Q5_K: (0, 4), GGMLType.Q6_K: (208, 210),
}
_FLOAT_VIEWS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


def bits_per_weight(qtype: GGMLType) -> float:
    elems, nbytes = BLOCKS[qtype]
    return 8 * nbytes / elems


def row_bytes(qtype: GGMLType, n: int) -> int:
    """Bytes of a row of ``n`` elements; raises if ``n`` is not a whole number of blocks."""
    elems, nbytes = BLOCKS[qtype]
    if n % elems:
        raise ValueError(f"a row of {n} elements is not a whole number of {qtype.name} blocks ({elems} each)")
    return n // elems * nbytes


# ----- dequantisation (float32, numpy's operation order) -------------------------------------------


_CONSTS: dict[tuple, torch.Tensor] = {}


def const(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor, made once per device: dequantisation runs for every layer at every
    step, and building it anew would copy it from the host each time."""
    key = (values, dtype, device)
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


def divide(x: torch.Tensor, n: float) -> torch.Tensor:
    """``x / n`` rounded as the CPU (and numpy) round it, on every device. CUDA computes ``tensor /
    number`` as ``tensor * (1 / number)`` (a divisor that is a host scalar becomes a multiplication by
    its reciprocal), which is one ulp off for some ``x`` when ``n`` is not a power of two; dividing
    by a tensor on ``x``'s device is a true division there too. ``n`` becomes a ``[1]`` tensor."""
    return x / const((float(n),), x.dtype, x.device)


_BIT_SHIFTS = tuple(range(8))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row -> the fp16 value widened to float32, ``[n, 1]``."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: the low nibbles are elements 0..15, the high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits32(b: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32) -> its 32 bits, bit j for element j, as uint8 ``[n, 32]``."""
    shifts = const(_BIT_SHIFTS, torch.uint8, b.device)
    return ((b[:, :, None] >> shifts) & 1).reshape(b.shape[0], 32)


def _shifted(b: torch.Tensor, groups: int, width: int, shifts: list[int], mask: int) -> torch.Tensor:
    """Bytes ``[n, groups * width]`` -> ``[n, groups, len(shifts), width]`` of ``(byte >> s) & mask``."""
    s = const(tuple(shifts), torch.uint8, b.device).view(1, 1, -1, 1)
    return (b.reshape(b.shape[0], groups, 1, width) >> s) & mask


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b[:, 80:82]) * (scales & 0xF).float())[:, :, None]  # per 16 elements
    ml = (_f16(b[:, 82:84]) * (scales >> 4).float())[:, :, None]
    q = _shifted(b[:, 16:80], 2, 32, [0, 2, 4, 6], 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 96:108]
    low = torch.cat([sc[:, :8] & 0xF, sc[:, :8] >> 4], dim=1)  # 16 scales' low 4 bits
    high = _shifted(sc[:, 8:12], 1, 4, [0, 2, 4, 6], 3).reshape(n, 16)  # and their high 2 bits
    s = (low | (high << 4)).to(torch.int8) - 32
    dl = (_f16(b[:, 108:110]) * s.float())[:, :, None]
    q2 = _shifted(b[:, 32:96], 2, 32, [0, 2, 4, 6], 3).reshape(n, 16, 16).to(torch.int8)
    hbit = (b[:, None, :32] >> const(_BIT_SHIFTS, torch.uint8, b.device)[None, :, None]) & 1
    q = q2 - ((hbit.reshape(n, 16, 16) ^ 1) << 2).to(torch.int8)  # minus 4 where the high bit is clear
    return (dl * q.float()).reshape(n, 256)


def _scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    a, m, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=1)
    mins = torch.cat([m & 63, (c >> 4) | ((m >> 6) << 4)], dim=1)
    return scales, mins


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scales_mins(b[:, 4:16])
    dd = (_f16(b[:, :2]) * sc.float())[:, :, None]  # per 32 elements
    dm = (_f16(b[:, 2:4]) * mn.float())[:, :, None]
    q = _shifted(b[:, 16:144], 4, 32, [0, 4], 0xF).reshape(n, 8, 32).float()
    return (dd * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scales_mins(b[:, 4:16])
    dd = (_f16(b[:, :2]) * sc.float())[:, :, None]
    dm = (_f16(b[:, 2:4]) * mn.float())[:, :, None]
    low = _shifted(b[:, 48:176], 4, 32, [0, 4], 0xF).reshape(n, 8, 32)
    high = (b[:, None, 16:48] >> const(_BIT_SHIFTS, torch.uint8, b.device)[None, :, None]) & 1
    return (dd * (low | (high << 4)).float() - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dd = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float())[:, :, None]  # per 16
    low = _shifted(b[:, :128], 2, 64, [0, 4], 0xF).reshape(n, 8, 32)
    high = _shifted(b[:, 128:192], 2, 32, [0, 2, 4, 6], 3).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (dd * q.reshape(n, 16, 16).float()).reshape(n, 256)


_DEQUANT: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0, GGMLType.Q2_K: _q2_k, GGMLType.Q3_K: _q3_k, GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k, GGMLType.Q6_K: _q6_k,
}


def dequantize(raw: torch.Tensor, qtype: GGMLType | int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor of ``shape`` stored as ``raw`` (uint8 bytes, any shape, on any device) in GGML
    type ``qtype``, as ``dtype``. Float32 arithmetic in gguf's order: bit-identical to
    ``gguf.quants.dequantize`` before the final cast."""
    qtype = GGMLType(qtype)
    flat = raw.reshape(-1)
    if raw.dtype != torch.uint8:
        raise TypeError(f"GGML blocks must be uint8 bytes, got {raw.dtype}")
    if qtype in FLOAT_TYPES:
        return flat.view(_FLOAT_VIEWS[qtype]).reshape(shape).to(dtype)
    elems, nbytes = BLOCKS[qtype]
    numel = math.prod(shape)
    if flat.numel() != numel // elems * nbytes or numel % elems:
        raise ValueError(f"{flat.numel()} bytes of {qtype.name} do not hold a tensor of shape {list(shape)}")
    blocks = flat.view(-1, nbytes)
    out = torch.empty(numel, dtype=dtype, device=raw.device)
    step = max(1, _CHUNK // elems)  # blocks per chunk
    fn = _DEQUANT[qtype]
    for start in range(0, blocks.shape[0], step):
        part = fn(blocks[start : start + step])
        out[start * elems : start * elems + part.numel()] = part.reshape(-1).to(dtype)
    return out.reshape(shape)


# ----- quantisation (gguf's numpy algorithms, float32) ----------------------------------------------


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    floored = a.floor()
    return torch.sign(x) * (floored + (2 * (a - floored)).floor())


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    idx = blocks.abs().argmax(dim=-1, keepdim=True)
    return torch.gather(blocks, -1, idx)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    half = q.shape[-1] // 2
    return q[:, :half] | (q[:, half:] << 4)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.uint8)


def _pack_bits32(bits: torch.Tensor) -> torch.Tensor:
    """``[n, 32]`` of 0/1 -> 4 bytes, bit j of the little-endian uint32 for element j."""
    weights = (1 << torch.arange(8, dtype=torch.int32, device=bits.device))
    return (bits.reshape(-1, 4, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _quant_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = divide(x.abs().amax(dim=1, keepdim=True), 127)
    q = _round_half_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=1)


def _quant_q4_0(x: torch.Tensor) -> torch.Tensor:
    d = divide(_signed_absmax(x), -8)
    q = torch.trunc(x * _inverse(d) + 8.5).to(torch.uint8).clamp(0, 15)  # (x*id + 8.5 >= 0 always)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=1)


def _quant_q4_1(x: torch.Tensor) -> torch.Tensor:
    hi, lo = x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True)
    d = divide(hi - lo, 15)
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 15)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], dim=1)


def _quant_q5_0(x: torch.Tensor) -> torch.Tensor:
    d = divide(_signed_absmax(x), -16)
    q = torch.trunc(x * _inverse(d) + 16.5).to(torch.uint8).clamp(0, 31)
    return torch.cat([_f16_bytes(d), _pack_bits32(q >> 4), _pack_nibbles(q & 0xF)], dim=1)


def _quant_q5_1(x: torch.Tensor) -> torch.Tensor:
    hi, lo = x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True)
    d = divide(hi - lo, 31)
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 31)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_bits32(q >> 4), _pack_nibbles(q & 0xF)], dim=1)


_QUANT: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q8_0: _quant_q8_0, GGMLType.Q4_0: _quant_q4_0, GGMLType.Q4_1: _quant_q4_1,
    GGMLType.Q5_0: _quant_q5_0, GGMLType.Q5_1: _quant_q5_1,
}


def quantize(weight: torch.Tensor, qtype: GGMLType | int) -> torch.Tensor:
    """``weight`` ``[..., n]`` (float) as GGML blocks ``[..., row_bytes]`` uint8 on its device
    (float32 arithmetic, as ``gguf.quants.quantize``). Rows must be whole blocks."""
    qtype = GGMLType(qtype)
    if qtype not in _QUANT:
        raise ValueError(f"quantising to {qtype.name} is not supported; use one of "
                         f"{', '.join(t.name for t in _QUANT)}")
    elems, _ = BLOCKS[qtype]
    lead, n = weight.shape[:-1], weight.shape[-1]
    nbytes = row_bytes(qtype, n)
    blocks = weight.detach().float().reshape(-1, elems)
    out = torch.cat([_QUANT[qtype](blocks[i : i + (_CHUNK // elems)])
                     for i in range(0, blocks.shape[0], _CHUNK // elems)])
    return out.reshape(*lead, nbytes)


# ----- the layer ------------------------------------------------------------------------------------


class GGMLLinear(nn.Module):
    """A bias-free or biased Linear whose weight stays as GGML blocks (``qweight`` ``[out,
    row_bytes]`` uint8, a buffer: it moves with the module and counts in its bytes) and is
    dequantised, exactly, for each call in the input's dtype on the layer's device."""

    def __init__(self, in_features: int, out_features: int, qtype: GGMLType | int, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.qtype = GGMLType(qtype)
        self.register_buffer("qweight", torch.empty(out_features, row_bytes(self.qtype, in_features),
                                                    dtype=torch.uint8, device=device))
        self.compute_dtype = torch.bfloat16  # what the model computes in (set by the loader; for LoRA branches)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, qtype: GGMLType | int) -> GGMLLinear:
        """Quantise a Linear's weight (on its device)."""
        layer = cls(linear.in_features, linear.out_features, qtype, linear.bias is not None,
                    device=linear.weight.device)
        layer.qweight = quantize(linear.weight, qtype)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` as ``dtype`` (on the layer's device)."""
        return dequantize(self.qweight, self.qtype, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized(x.dtype)  # one layer's weight alive at a time
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, w, bias)

    def float_parts(self) -> list[tuple[str, str, torch.Tensor]]:
        """The float values packed inside :attr:`qweight`, for a NaN/Inf scan: ``(file tensor suffix,
        what it is, the values)``; for a block type, the fp16 block scales (and minimums), viewed
        from the bytes without a copy of the codes; for F32/F16/BF16, the values themselves."""
        if self.qtype in FLOAT_TYPES:
            return [("weight", f"GGUF {self.qtype.name} values", self.qweight.reshape(-1).view(_FLOAT_VIEWS[self.qtype]))]
        start, end = SCALE_BYTES[self.qtype]
        blocks = self.qweight.reshape(-1, BLOCKS[self.qtype][1])
        return [("weight", f"its GGUF {self.qtype.name} block scales",
                 blocks[:, start:end].contiguous().view(torch.float16))]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype.name}"


def ggml_layers(model: nn.Module) -> dict[str, str]:
    """Name -> GGML type of every :class:`GGMLLinear` in ``model``."""
    return {name: m.qtype.name for name, m in model.named_modules() if isinstance(m, GGMLLinear)}


__all__ = [
    "BLOCKS", "FLOAT_TYPES", "QUANTIZE_TYPES", "SCALE_BYTES", "GGMLLinear", "GGMLType", "bits_per_weight", "dequantize",
    "ggml_layers", "quantize", "row_bytes",
]
