"""Optional Triton kernels for the transformer's memory-bound steps.

* :func:`qk_norm_rope_into`: per-head QK-RMSNorm + interleaved RoPE for q and k in one pass,
  writing straight into the joint-sequence buffer the attention reads;
* :func:`modulate`: ``(1 + scale) * LayerNorm(x) + shift`` in one pass.

Both follow the rounding steps of the plain PyTorch path (``klein_core.models``), which
stays the reference. Nothing here imports Triton until a function is called, and
:func:`available` says whether the kernels can run on a device: CUDA with Triton installed, or
the CPU when the kernel modules were imported under ``TRITON_INTERPRET=1`` (the tests do this).
Use them through :mod:`klein_core.accel.fast`, which falls back to the plain path when they cannot run.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_QK = "klein_core.accel.kernels._qk_norm_rope"
_MOD = "klein_core.accel.kernels._modulate"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _module(name: str) -> ModuleType:
    # Looked up on every call (a dict hit) rather than cached in a global, so a test can drop the
    # module and re-import it under TRITON_INTERPRET=1.
    mod = sys.modules.get(name)
    return mod if mod is not None else importlib.import_module(name)


def available(device: torch.device | str) -> tuple[bool, str]:
    """``(True, "")`` if the kernels can run on ``device``, else ``(False, reason)``."""
    device = torch.device(device)
    try:
        qk = _module(_QK)
        _module(_MOD)
    except ImportError as exc:
        return False, f"Triton is not installed ({exc.msg})"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu" and qk.is_interpreted():
        return True, ""
    return False, f"Triton kernels need a CUDA device, not {device.type}"


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a launch. Triton launches on the current CUDA device and its
    current stream, not on the tensors' device: with tensors on ``cuda:1`` while ``cuda:0`` is current,
    a launch fails ("cannot be accessed from Triton") or reads another GPU's memory."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_rows(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {list(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dim (stride {t.stride(-1)})")


def qk_norm_rope_into(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_q: torch.Tensor,
    out_k: torch.Tensor,
    offset: int = 0,
    eps: float = 1e-6,
) -> None:
    """RMS-normalise each head of q and k, rotate them, and write ``out[:, offset:offset+L]``.

    Args:
        q, k: ``[B, L, H, D]`` in fp32/bf16/fp16, any strides except along D (e.g. views of the
            fused qkv projection, read in place).
        q_weight, k_weight: RMSNorm weights ``[D]``.
        cos, sin: float32 RoPE tables of the joint sequence ``[1 or B, N, D]``, the value of each
            frequency repeated for its (2j, 2j+1) pair; token ``l`` of q uses row ``offset + l``.
        out_q, out_k: contiguous ``[B, N, H, D]`` buffers in q's dtype.
        offset: where this stream starts in the joint sequence.
    """
    _check_rows("q", q, 4)
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(f"k {list(k.shape)} {k.dtype} must match q {list(q.shape)} {q.dtype}")
    _check_rows("k", k, 4)
    b, length, heads, dim = q.shape
    if q.dtype not in _DTYPES:
        raise ValueError(f"qk_norm_rope supports {_DTYPES}, got {q.dtype}")
    if dim % 2 or dim & (dim - 1):
        raise ValueError(f"qk_norm_rope needs a power-of-two head dim, got {dim}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (dim,) or w.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous [{dim}] tensor, got {list(w.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        _check_rows(name, t, 3)
        if t.dtype != torch.float32 or t.shape[-1] != dim or t.shape[0] not in (1, b):
            raise ValueError(f"{name} must be float32 [1 or {b}, N, {dim}], got {t.dtype} {list(t.shape)}")
    if cos.stride() != sin.stride() or cos.shape != sin.shape:
        raise ValueError("cos and sin must have the same shape and strides")
    n = out_q.shape[1] if out_q.ndim == 4 else -1
    for name, o in (("out_q", out_q), ("out_k", out_k)):
        if o.shape != (b, n, heads, dim) or not o.is_contiguous() or o.dtype != q.dtype:
            raise ValueError(f"{name} must be a contiguous [{b}, N, {heads}, {dim}] {q.dtype} tensor, "
                             f"got {list(o.shape)} {o.dtype}")
    if not 0 <= offset <= n - length or cos.shape[1] != n:
        raise ValueError(f"rows {offset}..{offset + length} do not fit the joint sequence of {n} "
                         f"(RoPE tables have {cos.shape[1]} rows)")
    devices = {t.device for t in (q, k, q_weight, k_weight, cos, sin, out_q, out_k)}
    if len(devices) != 1:
        raise ValueError(f"qk_norm_rope tensors are on several devices: {sorted(map(str, devices))}")
    if length == 0:
        return
    # A batch-1 table serves every batch item: stride 0 over the batch.
    if cos.shape[0] == 1 and b > 1:
        cos, sin = cos.expand(b, -1, -1), sin.expand(b, -1, -1)
    with _device_guard(q.device):
        _module(_QK).launch(q, k, q_weight, k_weight, cos, sin, out_q, out_k, offset, eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(1 + scale) * LayerNorm(x) + shift`` (LayerNorm without affine parameters).

    Args:
        x: ``[B, L, D]`` in fp32/bf16/fp16, contiguous along D.
        shift, scale: ``[B or 1, 1, D]`` in x's dtype (views of the modulation output are fine).

    Returns:
        A new contiguous ``[B, L, D]`` tensor in x's dtype.
    """
    _check_rows("x", x, 3)
    if x.dtype not in _DTYPES:
        raise ValueError(f"modulate supports {_DTYPES}, got {x.dtype}")
    b, length, dim = x.shape
    for name, t in (("shift", shift), ("scale", scale)):
        _check_rows(name, t, 3)
        if t.shape[1:] != (1, dim) or t.shape[0] not in (1, b) or t.dtype != x.dtype:
            raise ValueError(f"{name} must be [{b} or 1, 1, {dim}] {x.dtype}, got {list(t.shape)} {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    out = torch.empty((b, length, dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if shift.shape[0] == 1 and b > 1:
        shift = shift.expand(b, -1, -1)
    if scale.shape[0] == 1 and b > 1:
        scale = scale.expand(b, -1, -1)
    with _device_guard(x.device):
        _module(_MOD).launch(x, shift, scale, out, eps)
    return out


__all__ = ["available", "modulate", "qk_norm_rope_into"]
