"""What made an image, for its metadata: the same seed gives another image after a torch update or
on another GPU (ComfyUI#11967), so the CLI's and the Ray jobs' PNGs say what ran."""

from __future__ import annotations

import torch

from . import __version__
from .accel.speed import describe_speed
from .models.transformer import Flux2Transformer


def device_name(device: torch.device) -> str:
    """``device`` with the GPU's name, e.g. ``cuda:0 (NVIDIA H100 80GB HBM3)``; others as they are
    (``cuda`` without an index is the current device)."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def run_environment(transformer: Flux2Transformer) -> dict[str, str]:
    """klein_core's and torch's versions, the transformer's device and the fast paths that ran
    (:func:`klein_core.accel.speed.describe_speed`: call it after the run, since the kernels are
    chosen at the first forward)."""
    return {"klein_core": __version__, "torch": torch.__version__, "device": device_name(transformer.device),
            "fast_paths": describe_speed(transformer)}


def strength_text(strength: float) -> str:
    """A LoRA strength as the parameters keep it: short (``0.5``, ``1``) when that is exact, else every
    digit (``"%g"`` alone rounded 0.123456789 to 0.123457, a strength that did not run)."""
    short = f"{strength:g}"
    return short if float(short) == strength else repr(strength)


__all__ = ["device_name", "run_environment", "strength_text"]
