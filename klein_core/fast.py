"""``klein_core.fast``: the name the README gives for the fast paths; they live in :mod:`klein_core.accel`."""

from .accel.fast import (
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
