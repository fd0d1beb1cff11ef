"""NaN and Inf named where they enter, instead of showing up later as a black image.

Inputs are checked when a stage receives them (:func:`require_finite`: the prompt embeddings,
reference pixels and latents, noise, latents to decode) and each stage's output once it is done
(:func:`check_output`). When an output is not finite although its inputs were, the component's
weights are scanned to name the corrupt tensor and its file; only if they are clean is the cause
numeric (an fp16 overflow, an extreme setting). One reduction per tensor: no per-step host syncs.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import NonFiniteWeights


def is_finite(t: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite (float8 included); other dtypes are."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t if t.dtype.itemsize > 1 else t.float()).all())


def require_finite(t: torch.Tensor, what: str) -> None:
    """Raise ValueError naming ``what`` ("reference 2", "the noise") if ``t`` holds NaN or Inf."""
    if not is_finite(t):
        raise ValueError(f"{what} contains NaN or infinite values; klein_core does not run on them. Check where "
                         "it came from (a corrupt image or file, or an earlier step that overflowed).")


def non_finite_weight(module: nn.Module) -> str | None:
    """The name of the first parameter or buffer of ``module`` holding NaN or Inf, if any."""
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if t.device.type != "meta" and not is_finite(t.detach()):
            return name
    return None


def check_output(t: torch.Tensor, stage: str, module: nn.Module, cause: str) -> None:
    """After a stage: raise if ``t`` is not finite, naming the corrupt weight of ``module`` (a
    :class:`~klein_core.errors.NonFiniteWeights`) or else the numeric ``cause`` (FloatingPointError)."""
    if is_finite(t):
        return
    bad = non_finite_weight(module)
    source = getattr(module, "source", None) or f"the in-memory {type(module).__name__}"
    if bad is not None:
        raise NonFiniteWeights(f"{stage} produced NaN/Inf because its weights are corrupt: tensor '{bad}' of "
                                f"{source} contains NaN or infinite values. Download the file again.")
    raise FloatingPointError(f"{stage} produced NaN/Inf values ({source}); likely cause: {cause}.")


__all__ = ["check_output", "is_finite", "non_finite_weight", "require_finite"]
