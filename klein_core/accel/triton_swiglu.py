"""SwiGLU, ``silu(gate) * up``, in one pass: the one kernel klein_core writes itself (Triton).

Every transformer MLP applies it to the ``[gate | up]`` halves of a projection. It reads the input
once and writes the output once, possibly into a slice of a larger buffer (the single blocks write it
straight into their second projection's input). Why it is ours, and what it measured: docs/DESIGN.md.

Rounding follows the two PyTorch ops: the SiLU is rounded to the input dtype before the product.
Triton is imported on first use only; :func:`triton_available` checks without importing it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .comfy_kitchen import _device_guard

_BLOCK = 1024
_kernel: Any = None


def triton_available() -> bool:
    """Whether Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x_row = x_ptr + row * x_row_stride
        gate = tl.load(x_row + cols, mask=mask, other=0.0)
        up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(gate.dtype)  # torch rounds silu's output before the product
        out = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    return swiglu_kernel


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a 2-D view ``[rows, cols]`` with unit column stride, or None if it has no such view."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims that cannot be merged into one stride
        return None


def swiglu(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` ``[..., 2F]`` (CUDA, unit stride over the last
    dim; may be a slice of a wider tensor) into ``out`` ``[..., F]`` (new if None; may be a slice).

    Raises ValueError for layouts the kernel does not take (the caller then runs the PyTorch ops).
    """
    global _kernel
    if x.shape[-1] % 2:
        raise ValueError(f"SwiGLU needs an even last dim, got {list(x.shape)}")
    f = x.shape[-1] // 2
    if out is None:
        out = torch.empty(*x.shape[:-1], f, dtype=x.dtype, device=x.device)
    if out.shape != (*x.shape[:-1], f) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out {list(out.shape)} {out.dtype} does not fit input {list(x.shape)} {x.dtype}")
    x2, o2 = _rows(x), _rows(out)
    if x2 is None or o2 is None:
        raise ValueError("SwiGLU kernel: the input and output need rows with one stride and unit column stride")
    if x2.shape[0] == 0 or f == 0:
        return out
    if _kernel is None:
        _kernel = _build()
    grid = (x2.shape[0], -(-f // _BLOCK))
    with _device_guard(x.device):
        _kernel[grid](x2, o2, f, x2.stride(0), o2.stride(0), BLOCK=_BLOCK)
    return out



__all__ = ["swiglu", "triton_available"]
