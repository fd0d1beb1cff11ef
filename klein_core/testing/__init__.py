"""Tiny random Klein components with the real structure: the CLI's ``--demo`` and the tests' fixtures."""

from .tiny import (
    TINY_4B,
    TINY_9B,
    TinySpec,
    build_tiny_components,
    tiny_text_encoder,
    tiny_transformer,
    tiny_vae,
    write_tiny_model_files,
)

__all__ = ["TINY_4B", "TINY_9B", "TinySpec", "build_tiny_components", "tiny_text_encoder", "tiny_transformer",
           "tiny_vae", "write_tiny_model_files"]
