"""What a worker loads, given once per job or server: :class:`ModelSpec`, and :func:`open_engine`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..accel.speed import DEFAULT_SPEED
from ..cli import vae_tile_text
from ..pipeline.engine import Engine
from ..pipeline.prompts import TextOptions
from ..pipeline.request import reference_mode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """The models of a job and how they run; plain data, sent to every worker.

    ``transformer`` / ``text_encoder`` / ``vae``: file paths (None with ``demo``, the tiny random
    models). ``kind``: "distilled", "base" or "kv". ``device``: None = the worker's GPU if it has
    one, else the CPU. ``dtype``: "bf16", "fp16", "fp32" or None (bf16 on GPU, fp32 on CPU).
    ``max_tokens``: 512 or None (whole prompts); ``text_precision``: "model" or "fp32"; ``trim``:
    :attr:`~klein_core.pipeline.prompts.TextOptions.trim` (None: padded to 512).
    ``vae_tile``: :class:`~klein_core.pipeline.engine.Engine`'s (``"auto"``, None or a tile side).
    ``speed``: as ``klein-generate --speed`` ("fast" by default: the plain path on a CPU worker; None
    runs the models as loaded).
    ``lora_dir``: where row LoRA names are looked up.
    """

    transformer: Path | None = None
    text_encoder: Path | None = None
    vae: Path | None = None
    demo: bool = False
    kind: str = "distilled"
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    speed: str | None = DEFAULT_SPEED
    memory: str = "auto"
    vae_tile: int | str | None = "auto"
    max_tokens: int | None = 512
    text_precision: str = "model"
    trim: int | None = None
    ref_mode: str | None = None
    lora_dir: Path | None = None
    names: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> TextOptions:
        """The prompt options the engine runs with."""
        return TextOptions(max_tokens=self.max_tokens,
                           activations=torch.float32 if self.text_precision == "fp32" else None, trim=self.trim)

    def png_params(self) -> dict:
        """The job-wide keys of a PNG's ``parameters`` text, as the CLI writes them."""
        return {"model_kind": self.kind, "demo": self.demo,
                **(self.names or {"transformer": "demo", "text_encoder": "demo", "vae": "demo"}),
                "text_precision": self.text_precision, "max_tokens": "whole" if self.max_tokens is None else "512",
                "trim_padding": self.trim,
                "ref_mode": reference_mode(self.kind, self.ref_mode), "speed": self.speed,
                "vae_tile": vae_tile_text(self.vae_tile), "quantize": self.quantize}


def spec_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The dtype the models of ``spec`` load in on ``device``: the one asked, else bf16 on a GPU, fp32
    on the CPU (the CLI's rule)."""
    from ..files.loaders import as_dtype

    return as_dtype(spec.dtype, "--dtype") or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def open_engine(spec: ModelSpec) -> Engine:
    """Load the three models of ``spec`` on this worker's device and return their :class:`Engine`
    (memory planned per call for this device's free memory when ``spec.memory`` is "auto")."""
    from ..files.loaders import load_text_encoder, load_transformer, load_vae, meta_model, quantize_for
    from ..memory.planner import weights_home
    from ..pipeline.request import as_device

    device = as_device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = spec_dtype(spec, device)
    # Each model lives where the memory mode wants it between runs, as the loader node decides: on
    # the GPU, or in CPU memory for the engine to copy or stream in (loaded onto the GPU, a model is
    # run there as it is, and one larger than the card fails to load).
    components = ("transformer", "text_encoder", "vae")
    if spec.demo:
        from ..testing.tiny import build_tiny_components

        built = [m.to(dtype=dtype) for m in build_tiny_components()]
        models = [m.to(weights_home(m, device, mode=spec.memory, component=c)) for m, c in zip(built, components)]
    else:
        quantize = quantize_for(spec.transformer, "transformer", device, spec.quantize, dtype=dtype)
        homes = [weights_home(meta_model(path, c, dtype=dtype, quantize=q), device, mode=spec.memory, component=c)
                 for path, c, q in zip((spec.transformer, spec.text_encoder, spec.vae), components,
                                       (quantize, None, None))]
        models = [load_transformer(spec.transformer, device=homes[0], dtype=dtype, quantize=quantize),
                  load_text_encoder(spec.text_encoder, device=homes[1], dtype=dtype),
                  load_vae(spec.vae, device=homes[2], dtype=dtype)]
    logger.info("models loaded for %s (%s): %s", device, dtype,
                ", ".join(f"{c} in {'CPU memory' if next(m.parameters()).device.type == 'cpu' else 'device memory'}"
                          for c, m in zip(components, models)))
    return Engine(*models, kind=spec.kind, device=device, memory=spec.memory, vae_tile=spec.vae_tile, text=spec.text,
                  ref_mode=spec.ref_mode, speed=spec.speed)
