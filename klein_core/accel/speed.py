"""One switch over the fast paths for a whole pipeline: the nodes' ``speed`` input, the CLI's ``--speed``.

* ``fast`` (the default): :func:`~klein_core.accel.fast.enable_fast_paths` with ``attention="auto"``
  and comfy-kitchen's fused kernels, and :func:`~klein_core.accel.fast.enable_fast_vae` uncompiled
  (GroupNorm + SiLU in one kernel, channels-last); on CUDA the text encoder's plain forward is
  replayed as a CUDA graph per prompt shape (:mod:`klein_core.accel.text_graph`: the same kernels,
  one launch). On the CPU exactly the plain path.
* ``compile``: ``fast`` plus ``torch.compile`` of each block kind, of the VAE decoder (the encoder too
  where comfy-kitchen's fused norms cannot serve it; where they can, eager measured faster), and of
  the text encoder's layers (:mod:`klein_core.accel.text_encoder`); the first run at each size compiles
  (logged), and the cache (``TORCHINDUCTOR_CACHE_DIR``) outlives the process. Under ``plain`` the
  text encoder runs its plain path.
* ``plain``: the reference PyTorch path that the parity tests check against diffusers and BFL.

:func:`apply_speed` is idempotent, so a caller may apply it before every run; switching the fast
paths by hand (the speed is then ``"custom"``) makes the next :func:`apply_speed` set them again.
"""

from __future__ import annotations

import logging

from ..models.qwen3 import Qwen3TextEncoder
from ..models.transformer import Flux2Transformer
from ..models.vae import Flux2VAE
from .fast import SPEED_ATTR, disable_fast_paths, disable_fast_vae, enable_fast_paths, enable_fast_vae
from .text_encoder import disable_fast_text_encoder, enable_fast_text_encoder

logger = logging.getLogger(__name__)

SPEEDS: tuple[str, ...] = ("fast", "compile", "plain")
DEFAULT_SPEED = "fast"


def check_speed(speed: str) -> str:
    """``speed`` if it is one of :data:`SPEEDS`, else a ValueError naming the choices."""
    if speed not in SPEEDS:
        raise ValueError(f"speed must be one of {', '.join(SPEEDS)}; got {speed!r}")
    return speed


def speed_of(model: Flux2Transformer | Flux2VAE | Qwen3TextEncoder) -> str:
    """The speed ``model`` was set to by :func:`apply_speed` ("plain" if never), or ``"custom"``
    where its fast paths were switched on by hand since (``enable_fast_paths``, ``enable_fast_vae``,
    ``enable_fast_text_encoder``): the next :func:`apply_speed` then sets its speed whatever it is."""
    return getattr(model, SPEED_ATTR, "plain")


def apply_speed(
    transformer: Flux2Transformer | None = None, vae: Flux2VAE | None = None, speed: str = DEFAULT_SPEED,
    text_encoder: Qwen3TextEncoder | None = None,
) -> None:
    """Put ``transformer``, ``vae`` and ``text_encoder`` (any may be None) on ``speed`` (see the
    module doc), in place.

    Models of other classes (a test double, a wrapped model) are left alone. The choice of kernels
    happens on the first forward on each device and is logged there once.
    """
    check_speed(speed)
    if isinstance(transformer, Flux2Transformer) and speed_of(transformer) != speed:
        if speed == "plain":
            disable_fast_paths(transformer)
        else:
            enable_fast_paths(transformer, compile=speed == "compile")
        setattr(transformer, SPEED_ATTR, speed)
    if isinstance(vae, Flux2VAE) and speed_of(vae) != speed:
        if speed == "plain":
            disable_fast_vae(vae)
        else:
            enable_fast_vae(vae, compile=speed == "compile")
        setattr(vae, SPEED_ATTR, speed)
    if isinstance(text_encoder, Qwen3TextEncoder) and speed_of(text_encoder) != speed:
        if speed == "compile":
            enable_fast_text_encoder(text_encoder)
        elif speed == "fast":
            # The plain forward replayed as a CUDA graph (eager off CUDA): measured exact and
            # 40.1 -> 14.0 ms per 512-token prompt on an H100 (benchmarks/results/2026-11-27_h100_textgraph).
            enable_fast_text_encoder(text_encoder, compile=False, graphs=True)
        else:
            disable_fast_text_encoder(text_encoder)
        setattr(text_encoder, SPEED_ATTR, speed)


def describe_speed(transformer: Flux2Transformer) -> str:
    """What ran, e.g. ``"fast (cuda:0 torch.bfloat16: attention=sdpa_cudnn, qk-norm+rope=comfy-kitchen,
    modulation=comfy-kitchen, elementwise=fused, swiglu=triton, compile=False)"``; the kernels are known after the first forward."""
    speed = speed_of(transformer)
    resolved = getattr(transformer.ops, "resolved", None)
    where = resolved() if callable(resolved) else {}
    return speed + "".join(f" ({k}: {v})" for k, v in where.items())


__all__ = ["DEFAULT_SPEED", "SPEEDS", "apply_speed", "check_speed", "describe_speed", "speed_of"]
