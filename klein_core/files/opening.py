"""The one entry point from a weight source to what the component loaders read.

:func:`open_weights` accepts a file, a folder (a Hugging Face repo root or component folder, with
or without shards) or a state dict; refuses formats the core cannot run, naming them; and returns
fp8 files as a view in which quantised weights look like plain ones (their scales carried along),
so every component's plan sees the keys and shapes of the bf16 file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import WeightFormatError
from .fp8 import prepare_quantized, unsupported_format
from .gguf import gguf_source, is_gguf
from .source import WeightSource, dict_source, file_source, folder_source


def open_weights(
    source: str | os.PathLike | Mapping[str, torch.Tensor] | WeightSource,
    *,
    component: str,
    subfolder: str | None = None,
) -> WeightSource:
    """Open ``source`` (a file, a folder, a state dict or a WeightSource) for reading.

    ``component`` ("transformer", "text encoder", "VAE") is used in messages; ``subfolder`` is the
    Hugging Face repo subfolder to look in when ``source`` is a repo root ("transformer", ...).
    """
    if isinstance(source, WeightSource):
        src = source
    elif isinstance(source, Mapping):
        src = dict_source(source, f"<in-memory {component} state dict>")
    elif not isinstance(source, (str, os.PathLike)):  # Path(None) names neither the loader nor the fix
        raise TypeError(f"the {component} source must be a file or folder path (str or Path), a state dict or a "
                        f"WeightSource, got {type(source).__name__}")
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{component} weights not found: {path}")
        if path.is_dir():
            src = folder_source(path, subfolder)
        elif path.is_file() and is_gguf(path):  # regular files only: never open a FIFO to sniff it
            src = gguf_source(path, component)
        else:
            src = file_source(path, component)
    fmt = unsupported_format(src)
    if fmt is not None:
        raise WeightFormatError(
            f"{src.name}: this {component} file is in the {fmt} format, which this version of "
            f"klein_core cannot run yet. Use the bf16 or fp8 .safetensors {component} file instead."
        )
    if len(src) == 0:
        raise WeightFormatError(f"{src.name}: contains no tensors.")
    # fp8 files: a view without the scale/marker tensors, whose quantised weights carry their
    # scales, so every component plan sees the keys and shapes of the bf16 file.
    return prepare_quantized(src)
