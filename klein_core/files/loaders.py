"""The three public loaders: a file, folder or state dict in any supported layout -> a ready module.

Each one opens the source (:func:`klein_core.files.opening.open_weights`), plans its keys onto the
module's names and infers the config from shapes (``klein_core.files.*_layout``), then builds the
module on the meta device and fills it tensor by tensor (:func:`klein_core.files.materialize.materialize`).
``device="meta"`` gives the module with its config and layer types but reads no tensor data.
"""

from __future__ import annotations

import logging
import os
import pkgutil
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import WeightFormatError
from ..models.qwen3 import Qwen3Config, Qwen3TextEncoder
from ..models.transformer import Flux2Transformer
from ..models.vae import Flux2VAE
from ..pipeline.request import as_device
from ..quant.fp8 import float8_refused, fp8_layers, holds_float8
from .materialize import materialize
from .opening import open_weights
from .qwen3_layout import COMPONENT, hf_config_path, normalise_keys, qwen3_key_map, read_hf_config
from .source import WeightSource, files_stamp, source_files
from .transformer_layout import plan_transformer
from .vae_layout import open_vae_source, prepare_vae

logger = logging.getLogger(__name__)

_building = threading.local()


class _MetaBuildLogs(logging.Filter):
    """While this thread builds a model on the meta device (:func:`meta_model`, to plan memory before
    the real load), the file modules' records go out at DEBUG: the load that follows says each of them
    (a file's ignored tensors, its "Loaded" line) once, not once more for the estimate."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(_building, "depth", 0) and record.levelno < logging.ERROR:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            # the logger let the record through at its first level; kept only where DEBUG is on (a
            # host's root handler at NOTSET, as ComfyUI's, would print it otherwise)
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_META_LOGS = _MetaBuildLogs()
for _module in pkgutil.iter_modules([str(Path(__file__).parent)]):
    logging.getLogger(f"{__package__}.{_module.name}").addFilter(_META_LOGS)

Source = str | os.PathLike | Mapping[str, torch.Tensor] | WeightSource
_DTYPE_NAMES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


def as_dtype(dtype: torch.dtype | str | None, what: str) -> torch.dtype | None:
    """A compute dtype from a torch dtype or its name ("bf16", "bfloat16", "torch.float16"...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"{what}: dtype must be a floating dtype, got {dtype}.")
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise TypeError(f"{what}: dtype must be a torch dtype or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}.")


def load_transformer(
    source: Source,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
) -> Flux2Transformer:
    """Load a FLUX.2 Klein transformer from a BFL/ComfyUI or diffusers checkpoint.

    ``source``: a ``.safetensors`` file (keys optionally prefixed ``model.diffusion_model.``), a
    diffusers folder (``transformer/`` of a repo, sharded or not), or a state dict. The model is
    built on the meta device and filled from the file. ``dtype`` None keeps the stored dtype.
    ``quantize``: None keeps fp8 files in fp8 (block Linears as FP8Linear); "fp8" quantises a
    bf16 file's block Linears while loading; "dequantize" loads everything in ``dtype``.
    """
    dtype = as_dtype(dtype, "load_transformer")
    device = as_device(device)  # "cuda" on a CPU-only torch, or "gpu": one error naming the fix
    src = open_weights(source, component="transformer", subfolder="transformer")
    plan, config, layout, view = plan_transformer(src)
    logger.info("%s: %s transformer (%s layout), text width %d", src.name, config.variant, layout, config.context_dim)
    model = materialize(
        lambda: Flux2Transformer(config), plan, view, component=f"{config.variant} transformer",
        device=device, dtype=dtype, quantize=quantize,
    )
    assert isinstance(model, Flux2Transformer)
    model.source = src.name  # where it came from: names it in messages, and the model kind is read from it
    return model


def load_text_encoder(
    source: Source,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
) -> Qwen3TextEncoder:
    """Load the Klein text encoder (Qwen3-4B's or -8B's first 27 layers) as a :class:`Qwen3TextEncoder`.

    Args:
        source: a ``.safetensors`` file (also an all-in-one checkpoint, its prefix found), a Hugging Face
            folder (or repo root with ``text_encoder/``), a state dict, or a :class:`WeightSource`.
        device: where to put the weights (default CPU).
        dtype: floating dtype of the weights and of the output (default: as stored).
        quantize: None keeps fp8 as fp8; "fp8" quantises the Linears while loading; "dequantize": all dtype.

    Raises ValueError (naming the file and keys) for anything but a complete Qwen3 decoder of 27+ layers.
    """
    dtype = as_dtype(dtype, "load_text_encoder")
    device = as_device(device)  # "cuda" on a CPU-only torch, or "gpu": one error naming the fix
    hf_config = None
    if isinstance(source, (str, os.PathLike)) and Path(source).expanduser().is_dir():
        hf_config = read_hf_config(Path(source).expanduser())
    stamp = source_stamp(source, "text_encoder")  # taken before reading: a file replaced meanwhile is seen
    src = normalise_keys(open_weights(source, component=COMPONENT, subfolder="text_encoder"))
    config = Qwen3Config.from_source(src, hf_config)
    plan = qwen3_key_map(src)
    model = materialize(
        lambda: Qwen3TextEncoder(config), plan, src, component=COMPONENT, device=device, dtype=dtype,
        quantize=quantize,
    )
    logger.info(
        "%s text encoder: %d of %d layers loaded, output width %d",
        config.variant,
        config.num_layers_run,
        config.num_layers_in_file,
        config.text_dim,
    )
    assert isinstance(model, Qwen3TextEncoder)
    model.source = src.name
    model.quantize = quantize  # with source and dtype: what cached prompt embeddings depend on
    # The files as they were read: embeddings cached later belong to these weights, also after the
    # file is replaced while this encoder stays loaded. None (never cached) if it changed during the load.
    model.source_stamp = (src.name, stamp if stamp is not None and source_stamp(source, "text_encoder") == stamp
                          else None)
    return model


def load_vae(
    source: Source,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> Flux2VAE:
    """Load a FLUX.2 VAE from a file, a folder (or a diffusers repo root), or a state dict.

    Args:
        source: ``flux2-vae.safetensors`` (as ComfyUI ships it), BFL's ``ae.safetensors``, a diffusers
            file, a folder holding one (or a repo root with ``vae/``), or a state dict in these layouts.
        device: where to put the weights (default CPU).
        dtype: compute dtype (default: as stored); the BatchNorm statistics stay float32.

    Raises ValueError for weights that are not a FLUX.2 VAE (the message says what they seem to be) or
    missing / misshaped tensors (the message names the file and the first keys).
    """
    dtype = as_dtype(dtype, "load_vae")
    device = as_device(device)  # "cuda" on a CPU-only torch, or "gpu": one error naming the fix
    src, plan, cfg, layout = prepare_vae(open_vae_source(source))
    if dtype is None:
        # One compute dtype for every conv, even if the file mixes them.
        dtype = src.dtype(plan.ops["encoder.conv_in.weight"].sources()[0])
    try:
        model = materialize(
            lambda: Flux2VAE(cfg), plan, src, component=cfg.variant, device=device, dtype=dtype,
            keep_fp32=lambda name: name.startswith("bn."),
        )
    except ValueError as exc:
        if layout != "diffusers":
            raise
        raise ValueError(f"{exc} (Tensor names are given in the BFL layout; this file uses the "
                         "diffusers layout.)") from None
    assert isinstance(model, Flux2VAE)
    model.source = src.name
    n = sum(p.numel() for p in model.parameters())
    logger.info("%s (%s layout): %.2fM parameters, %s", cfg.variant, layout, n / 1e6, dtype)
    return model


_SUBFOLDERS = {"transformer": "transformer", "text_encoder": "text_encoder", "vae": "vae"}


def source_stamp(source: object, component: str = "text_encoder") -> str | None:
    """Names, sizes and modification times of the files that loading ``source`` as ``component``
    reads (a repo root's ``text_encoder/``, ``vae/`` or ``transformer/`` folder as the loaders choose
    it, a shard index, the text encoder's ``config.json``): what changes when one is replaced. ``stat``
    only, plus a shard index. None for a state dict, or files that cannot be seen or opened."""
    if component not in _SUBFOLDERS:
        raise ValueError(f"source_stamp: component must be one of {sorted(_SUBFOLDERS)}, got {component!r}.")
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source).expanduser()
    try:
        files = source_files(path, _SUBFOLDERS[component])
        if component == "text_encoder" and path.is_dir() and (config := hf_config_path(path)) is not None:
            files.append(config)
        return files_stamp(files) or None
    except (OSError, WeightFormatError):
        return None


LOADERS = {"transformer": load_transformer, "text_encoder": load_text_encoder, "vae": load_vae}


def meta_model(source: Source, component: str, *, dtype: torch.dtype | str | None = None,
               quantize: str | None = None) -> torch.nn.Module:
    """The module a load would give, built on the meta device without reading tensor data: its
    config, layer types (fp8 layers included) and the exact bytes of its weights
    (``klein_core.memory.placement.module_bytes``), for planning before loading."""
    kwargs = {"quantize": quantize} if component != "vae" else {}
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        return LOADERS[component](source, device="meta", dtype=dtype, **kwargs)
    finally:
        _building.depth -= 1


def quantize_for(source: Source, component: str, device: torch.device | str, quantize: str | None = None, *,
                 dtype: torch.dtype | str | None = None) -> str | None:
    """The ``quantize=`` to load ``source`` with, for a model that computes on ``device`` but may be
    loaded into CPU memory first (to stream or copy its weights in): ``quantize`` itself, except on a
    device that holds no float8 tensors (Apple's MPS), where a file storing fp8 layers gives
    ``"dequantize"`` (they then never reach the device in fp8; ``"q8"``/``"q4"`` too, since fp8
    layers are never requantised), and ``quantize="fp8"`` raises, naming the device. A load straight
    onto such a device needs none of this (:func:`materialize` dequantises there itself)."""
    device = torch.device(device)
    if holds_float8(device):
        return quantize
    name = Path(source).name if isinstance(source, (str, os.PathLike)) else component
    if quantize == "fp8":
        raise float8_refused(name, device)
    if quantize in (None, "q8", "q4") and fp8_layers(meta_model(source, component, dtype=dtype)):
        logger.info("%s: %s holds no float8 tensors; its fp8 layers are dequantised as it loads", name, device.type)
        return "dequantize"
    return quantize


__all__ = ["LOADERS", "as_dtype", "load_text_encoder", "load_transformer", "load_vae", "meta_model", "quantize_for"]
