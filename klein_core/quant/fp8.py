"""fp8 weights in memory: per-tensor quantisation maths and the :class:`FP8Linear` layer.

A weight ``W`` is stored as ``q * scale``: ``q`` float8 (e4m3 by default, max 448) and ``scale``
fp32, per tensor ``[]`` or per output row ``[out]``. :class:`FP8Linear` runs ``torch._scaled_mm``
on GPUs with fp8 tensor cores and otherwise upcasts its weight one layer at a time.
:func:`quantize_model_` converts a loaded model; reading fp8 checkpoints (and quantising while
loading) is :mod:`klein_core.files.fp8`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import replace_module
from ..pipeline.request import indexed_device
from .ggml import const, divide

logger = logging.getLogger(__name__)

# The float8 formats klein_core stores and runs, by ComfyUI's format name.
FP8_DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
FP8_FORMAT_OF: dict[torch.dtype, str] = {v: k for k, v in FP8_DTYPES.items()}
# Every float8 dtype this torch has (the "fnuz" ROCm flavours too): the one "is it float8" set.
FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# fp8 tensor-core matmul (torch._scaled_mm) needs Ada (8.9) or newer.
MIN_SCALED_MM_CAPABILITY = (8, 9)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a float8 storage dtype (never a compute dtype)."""
    return dtype in FLOAT8_DTYPES


def quantize_fp8(weight: torch.Tensor, fmt: str = "float8_e4m3fn") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor absmax quantisation: ``weight ~ q.float() * scale``.

    Returns ``(q, scale)``: ``q`` has ``weight``'s shape in the float8 dtype of ``fmt``; ``scale``
    is a 0-dim float32 ``absmax / fp8_max`` (1 for an all-zero tensor). Computed in float32 with
    true divisions, so a bf16 and an fp32 copy of the same values give the same bytes, on the CPU
    and on a GPU alike.
    """
    dtype = FP8_DTYPES[fmt]
    fmax = float(torch.finfo(dtype).max)
    w = weight.float()
    amax = w.abs().amax()
    # ``divide``, not ``amax / fmax``: on CUDA that is ``amax * (1 / 448)``, one ulp off for some amax
    # (0.0361328125), and a file quantised on the CPU then differed from quantise-on-load on a GPU.
    scale = torch.where(amax > 0, divide(amax, fmax).reshape(()), torch.ones_like(amax)).to(torch.float32)
    q = (w / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reshape(())


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in float32, cast to ``dtype``; ``scale`` is ``[]`` or ``[rows]``."""
    s = scale.float()
    if s.ndim == 1:
        s = s.reshape(-1, *([1] * (q.ndim - 1)))
    return (q.float() * s).to(dtype)


_float8_storage: dict[str, bool] = {}


def holds_float8(device: torch.device | str) -> bool:
    """Whether tensors of a float8 dtype can live on ``device``: yes on the CPU and CUDA; Apple's MPS
    has had no float8 dtypes, so fp8 files are dequantised as they load there. Other device types
    are probed once (a one-element float8 tensor made and read there), never at import."""
    kind = torch.device(device).type
    if kind in ("cpu", "cuda", "meta"):
        return True
    if kind not in _float8_storage:
        try:
            torch.zeros(1, dtype=torch.float8_e4m3fn, device=device).float().cpu()
            ok = True
        except (TypeError, RuntimeError, NotImplementedError) as exc:
            logger.info("%s holds no float8 tensors (%s): fp8 weights are dequantised as they load", kind,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            ok = False
        _float8_storage[kind] = ok
    return _float8_storage[kind]


def float8_refused(what: str, device: torch.device) -> ValueError:
    """The error for fp8 storage asked of a device that holds no float8 tensors (``what``: the file
    or the component, named first)."""
    return ValueError(f"{what}: {device.type} cannot hold float8 tensors, so its weights cannot be stored in fp8 "
                      "there; load with quantize=None (the file's dtype), or 'q8' for 8-bit GGML blocks")


# ---------------------------------------------------------------------------------------------
# The layer


_scaled_mm_support: dict[tuple[str, int | None], bool] = {}


def scaled_mm_available(device: torch.device) -> bool:
    """Whether ``device`` has fp8 tensor cores (CUDA compute capability >= 8.9).

    Checked once per device, at first use (never at import), with one info log line.
    """
    if device.type != "cuda":
        return False
    device = indexed_device(device)  # "cuda" and "cuda:N" share an entry; "cuda" is the current device
    key = (device.type, device.index)
    if key not in _scaled_mm_support:
        cap = torch.cuda.get_device_capability(device)
        # ROCm reports "cuda" devices too, but its fp8 matmul wants the e4m3fnuz flavour.
        ok = (tuple(cap) >= MIN_SCALED_MM_CAPABILITY and hasattr(torch, "_scaled_mm")
              and torch.version.hip is None)
        _scaled_mm_support[key] = ok
        logger.info(
            "fp8 matmul on %s (compute capability %d.%d): %s", device, cap[0], cap[1],
            "torch._scaled_mm" if ok else "not available, fp8 weights are upcast per layer",
        )
    return _scaled_mm_support[key]


class FP8Linear(nn.Module):
    """A Linear layer whose weight is stored in float8: ``y = x @ (weight * weight_scale)^T + bias``.

    State: ``weight [out, in]`` float8, ``weight_scale`` fp32 ``[]`` or ``[out]``, ``input_scale`` fp32
    ``[]`` or None (else activations are scaled dynamically), ``bias [out]`` or None. Input ``x [..., in]``
    in any float dtype; output ``[..., out]`` in ``x.dtype``.

    ``matmul``: ``"auto"`` uses ``torch._scaled_mm`` on CUDA with compute capability >= 8.9 (e4m3, sizes
    multiple of 16, half-precision input, no full-precision hint) for the layers in :attr:`scaled_mm_pays`,
    else upcasts the weight for this layer; ``"upcast"`` / ``"scaled_mm"`` force a path (CPU too).
    """

    matmul: str = "auto"
    _warned: bool = False  # one warning per layer for fp8 matmul failures

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        fmt: str = "float8_e4m3fn",
        per_row_scale: bool = False,
        input_scale: bool = False,
        full_precision_mm: bool = False,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if fmt not in FP8_DTYPES:
            raise ValueError(f"FP8Linear: unknown format '{fmt}' (expected one of {sorted(FP8_DTYPES)})")
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.full_precision_mm = full_precision_mm
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPES[fmt], device=device), requires_grad=False
        )
        scale_shape = (out_features,) if per_row_scale else ()
        self.register_buffer("weight_scale", torch.ones(scale_shape, device=device))
        self.register_buffer("input_scale", torch.ones((), device=device) if input_scale else None)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=bias_dtype, device=device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        scale = "per-row" if self.weight_scale.ndim else "per-tensor"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"{scale} scale, bias={self.bias is not None}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str = "float8_e4m3fn") -> FP8Linear:
        """Quantise an ``nn.Linear`` (per-tensor absmax) on the device its weight is on."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, fmt=fmt,
                    device="meta")
        q, scale = quantize_fp8(w.detach(), fmt)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = scale.to(w.device)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``dtype`` (``[out, in]``): float8 upcast, then scaled in ``dtype`` (as
        ComfyUI's fp8 ops scale), except in float16: there it is scaled in float32 and rounded once.
        A scale is ``amax / fp8_max``; float16 holds it only as a subnormal for weights with small
        amax (e5m2 below 3.5, e4m3 below 0.027), and as 0 below 6e-8 (the layer's output then
        all zeros). bfloat16 has float32's range."""
        if dtype == torch.float16:  # in float32 row blocks: a temporary of 4 MiB-ish rows, not the weight's
            out = torch.empty(self.weight.shape, dtype=dtype, device=self.weight.device)
            s = self.weight_scale.float()
            rows = max(1, (1 << 22) // max(1, self.in_features))
            for i in range(0, self.out_features, rows):
                part = s[i:i + rows, None] if s.ndim else s
                out[i:i + rows] = (self.weight[i:i + rows].float() * part).to(dtype)
            return out
        w = self.weight.to(dtype)
        s = self.weight_scale.to(dtype)
        return w.mul_(s[:, None] if s.ndim else s)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FP8Linear:
        # nn.Module.to(dtype) casts every floating tensor, float8 included: the weight became a dense
        # bf16 weight (twice the memory) and the float32 scales were rounded to bf16 for good. The
        # stored tensors keep their dtype and follow only the device (and in-place changes).
        kept = {id(t) for t in (self.weight, self.weight_scale, self.input_scale) if t is not None}

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if id(t) in kept and out.dtype != t.dtype:
                return t.to(device=out.device)
            return out

        return super()._apply(keep_dtype, recurse)

    def _use_scaled_mm(self, x: torch.Tensor) -> bool:
        if self.matmul == "upcast":
            return False
        shape_ok = self.in_features % 16 == 0 and self.out_features % 16 == 0
        if self.matmul == "scaled_mm":
            return shape_ok
        return (
            not self.full_precision_mm and shape_ok and self.fmt == "float8_e4m3fn" and self.scaled_mm_pays
            and x.dtype in (torch.bfloat16, torch.float16) and scaled_mm_available(x.device)
        )

    @property
    def scaled_mm_pays(self) -> bool:
        """Whether ``matmul="auto"`` takes the fp8 matmul for this layer's shape: widening layers only.

        Quantising the activations costs passes over ``x [tokens, in]``; the fp8 matmul saves time in
        proportion to ``in * out``. The H100 measurements behind the rule: docs/DESIGN.md.
        """
        return self.out_features >= 2 * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_scaled_mm(x):
            # torch._scaled_mm has no backward: when a gradient must reach x (training a LoRA on an fp8
            # base), the backward pass multiplies by the upcast weight instead.
            fp8_mm = _ScaledMMWithBackward.apply if torch.is_grad_enabled() and x.requires_grad else None
            if self.matmul == "scaled_mm":
                return fp8_mm(x, self) if fp8_mm else self._scaled_mm(x)
            try:
                return fp8_mm(x, self) if fp8_mm else self._scaled_mm(x)
            except torch.OutOfMemoryError:
                raise  # never a reason to change paths (the upcast needs more memory, not less)
            except RuntimeError as exc:
                # An input the fp8 kernel does not take (a shape, a build): upcast for this call only;
                # the device itself can do fp8 matmuls (scaled_mm_available), so the next call tries again.
                if not self._warned:
                    logger.warning("fp8 matmul failed for a %dx%d layer on %s (%s); upcasting its weight for "
                                   "this call", self.out_features, self.in_features, list(x.shape),
                                   str(exc).splitlines()[0])
                    self._warned = True
        # Upcast one layer at a time: the only extra memory is this layer's weight in x.dtype.
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            xs = self.input_scale.float()
        else:
            # The floor must survive the rounding to x's dtype below: 1e-12 is 0 in fp16, and an
            # all-zero (or tiny) fp16 input would then be divided by 0 (NaN / inf outputs).
            xs = (x2.abs().amax().float() / E4M3_MAX).clamp(min=max(1e-12, torch.finfo(x.dtype).tiny))
        # Round the activation scale to x's dtype first so the division below and the scale given
        # to the kernel are the same number.
        xs = xs.to(x.dtype).float().reshape(())
        # contiguous(): CUDA's fp8 matmul takes a row-major mat1 only, and the division keeps x's
        # memory layout (a transposed view of x gives a column-major xq). No copy in the usual case.
        xq = (x2 / xs.to(x.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
        per_row = self.weight_scale.ndim == 1
        ws = const((1.0,), torch.float32, x.device).reshape(()) if per_row else self.weight_scale.float().reshape(())
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype)
        if per_row:  # per-row weight scales factor out of the dot products: scale the columns
            y = y * self.weight_scale.to(y.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features).to(x.dtype)


class _ScaledMMWithBackward(torch.autograd.Function):
    """``layer._scaled_mm(x)`` forward; backward ``grad_x = grad_y @ W`` with ``W`` the upcast weight
    (the weight and bias are frozen: no gradient for them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: FP8Linear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer, ctx.dtype = layer, x.dtype
        return layer._scaled_mm(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        w = ctx.layer.dequantized_weight(grad.dtype)
        return (grad @ w).to(ctx.dtype), None


# ---------------------------------------------------------------------------------------------
# Which layers, and models already loaded


def block_linear_names(module: nn.Module) -> list[str]:
    """Qualified names of the ``nn.Linear`` layers inside repeated blocks (any ``nn.ModuleList``).

    These are the layers kept in (or quantised to) fp8 by default: the transformer's
    ``double_blocks``/``single_blocks`` and the text encoder's ``layers``. Embedders, modulation,
    the final layer, embeddings and norms stay in the compute dtype: they are a few percent of the
    weights, run once per step on a handful of rows, and the models read their compute dtype from
    ``img_in`` / ``embed_tokens``.
    """
    names: list[str] = []

    def walk(mod: nn.Module, prefix: str, in_list: bool) -> None:
        for name, child in mod.named_children():
            q = f"{prefix}{name}"
            if isinstance(child, (nn.Linear, FP8Linear)) and in_list:
                names.append(q)
            walk(child, q + ".", in_list or isinstance(child, nn.ModuleList))

    walk(module, "", False)
    return names


def quantize_model_(
    model: nn.Module, layers: Callable[[str], bool] | Iterable[str] | None = None, fmt: str = "float8_e4m3fn"
) -> list[str]:
    """Replace ``nn.Linear`` layers of a loaded model by :class:`FP8Linear`, in place.

    ``layers``: a predicate on module names, an explicit list of names, or None for the default
    (:func:`block_linear_names`). Each layer is quantised on its own device, one at a time, so the
    extra memory is one layer. Gives the same bytes as loading a file written by
    :func:`quantize_state_dict` from the same weights. Returns the names replaced.
    """
    candidates = block_linear_names(model) if layers is None or callable(layers) else list(layers)
    if callable(layers):
        all_linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        candidates = [n for n in all_linears if layers(n)]
    done = []
    for name in candidates:
        old = model.get_submodule(name)
        if isinstance(old, FP8Linear):
            continue
        if not isinstance(old, nn.Linear):
            raise TypeError(f"quantize_model_: '{name}' is a {type(old).__name__}, not an nn.Linear")
        replace_module(model, name, FP8Linear.from_linear(old, fmt))
        done.append(name)
    logger.info("Quantised %d Linear layers to %s", len(done), fmt)
    return done


def fp8_layers(model: nn.Module) -> list[str]:
    """Names of the :class:`FP8Linear` modules of ``model``."""
    return [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]


__all__ = [
    "E4M3_MAX", "FLOAT8_DTYPES", "FP8Linear", "FP8_DTYPES", "FP8_FORMAT_OF", "block_linear_names", "dequantize",
    "float8_refused", "fp8_layers", "holds_float8", "is_fp8", "quantize_fp8", "quantize_model_", "scaled_mm_available",
]
