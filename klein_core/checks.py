"""NaN and Inf named where they enter, instead of showing up later as a black image.

Inputs are checked when a stage receives them (:func:`require_finite`: the prompt embeddings,
reference pixels and latents, noise, latents to decode) and each stage's output once it is done
(:func:`check_output`). When an output is not finite although its inputs were, the component's
weights are scanned to name the corrupt tensor and its file; only if they are clean is the cause
numeric (an fp16 overflow, an extreme setting). One reduction per tensor: no per-step host syncs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .errors import NonFiniteWeights


def is_finite(t: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite (float8 included); other dtypes are.

    One reduction: a NaN or an infinity makes the sum NaN or infinite, so a finite sum (in float32,
    float64 for float64) means every value is finite. ``isfinite(t).all()`` takes four passes over
    ``t`` and two temporaries of its size; on the host, for the noise checked before every run,
    those passes sat on the path between the text stage and the first step. Only a sum that
    overflowed is checked again value by value.
    """
    if not t.is_floating_point():
        return True
    t = t.detach()  # a check, not part of any graph (and no warning for a tensor that needs grad)
    if t.dtype.itemsize == 1:  # float8 has no reductions
        t = t.float()
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    if math.isfinite(float(total)):
        return True
    return bool(torch.isfinite(t).all())


def require_finite(t: torch.Tensor, what: str) -> None:
    """Raise ValueError naming ``what`` ("reference 2", "the noise") if ``t`` holds NaN or Inf."""
    if not is_finite(t):
        raise ValueError(f"{what} contains NaN or infinite values; klein_core does not run on them. Check where "
                         "it came from (a corrupt image or file, or an earlier step that overflowed).")


def non_finite_tensor(module: nn.Module) -> tuple[str, str] | None:
    """The first tensor of ``module`` holding NaN or Inf, as ``(name, what)``, if any: a float
    parameter or buffer (``what`` is ``""``), or a float part packed inside a quantised layer (GGUF
    block scales, NVFP4 scales: layers with a ``float_parts()`` method), named as the file names it
    (``"blocks.0.qkv.weight_scale_2"``) with ``what`` saying which part (``"its NVFP4 per-tensor
    scale"``). Integer payloads (packed codes, scales kept as bit patterns) are never read as floats."""
    for prefix, mod in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, t in (*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)):
            if t is not None and t.device.type != "meta" and not is_finite(t.detach()):
                return dot + name, ""
        parts = getattr(mod, "float_parts", None)
        if callable(parts) and all(t.device.type != "meta" for t in mod.buffers(recurse=False)):
            for name, what, t in parts():
                if not is_finite(t.detach()):
                    return dot + name, what
    return None


def non_finite_weight(module: nn.Module) -> str | None:
    """The name of the first tensor of ``module`` holding NaN or Inf, if any (see
    :func:`non_finite_tensor`; a quantised layer's scales included)."""
    bad = non_finite_tensor(module)
    return None if bad is None else bad[0]


def check_output(t: torch.Tensor, stage: str, module: nn.Module, cause: str) -> None:
    """After a stage: raise if ``t`` is not finite, naming the corrupt weight of ``module`` (a
    :class:`~klein_core.errors.NonFiniteWeights`) or else the numeric ``cause`` (FloatingPointError)."""
    if is_finite(t):
        return
    bad = non_finite_tensor(module)
    source = getattr(module, "source", None) or f"the in-memory {type(module).__name__}"
    if bad is not None:
        name, what = bad
        raise NonFiniteWeights(f"{stage} produced NaN/Inf because its weights are corrupt: tensor '{name}'"
                                f"{f' ({what})' if what else ''} of {source} contains NaN or infinite values. "
                                "Download the file again.")
    raise FloatingPointError(f"{stage} produced NaN/Inf values ({source}); likely cause: {cause}.")


__all__ = ["check_output", "is_finite", "non_finite_tensor", "non_finite_weight", "require_finite"]
