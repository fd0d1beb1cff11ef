"""Optional fast paths: attention backends, fused kernels (comfy-kitchen), torch.compile, a faster VAE decode.

Everything is off until turned on (:func:`enable_fast_paths`, :func:`enable_fast_vae`); the plain
PyTorch path stays the default and the reference every fast path is checked against.
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

__all__ = [
    "ATTENTION_BACKENDS", "FastOps", "FastSettings", "disable_fast_paths", "disable_fast_vae", "enable_fast_paths",
    "enable_fast_vae",
]
