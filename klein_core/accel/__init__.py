"""Fast paths: attention backends, fused kernels (comfy-kitchen), torch.compile, a compiled VAE and
text encoder.

:func:`apply_speed` is the one switch the nodes and the CLI use (``fast`` by default there,
``compile``, ``plain``). For library users a model runs the plain path until it is switched
(:func:`apply_speed`, ``Engine(speed=...)``, or :func:`enable_fast_paths` for finer control); the
plain PyTorch path stays the reference every fast path is checked against.
"""

from .fast import (
    ATTENTION_BACKENDS,
    FastOps,
    FastSettings,
    disable_fast_paths,
    disable_fast_vae,
    enable_fast_paths,
    enable_fast_vae,
)
from .speed import DEFAULT_SPEED, SPEEDS, apply_speed, check_speed, speed_of
from .text_encoder import disable_fast_text_encoder, enable_fast_text_encoder
from .step_cache import (
    StepCache,
    StepCacheSettings,
    StepCacheStats,
    disable_step_cache,
    enable_step_cache,
    relative_l2,
)

__all__ = [
    "DEFAULT_SPEED", "SPEEDS", "apply_speed", "check_speed", "speed_of",
    "ATTENTION_BACKENDS", "FastOps", "FastSettings", "disable_fast_paths", "disable_fast_vae", "enable_fast_paths",
    "enable_fast_vae", "disable_fast_text_encoder", "enable_fast_text_encoder",
    # approximate, opt-in: klein_core.accel.step_cache
    "StepCache", "StepCacheSettings", "StepCacheStats", "disable_step_cache", "enable_step_cache", "relative_l2",
]
