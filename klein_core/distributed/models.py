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


def _homes(spec: ModelSpec, device: torch.device, models: list[torch.nn.Module]) -> list[torch.device]:
    """Where each of the three models (loaded or meta) lives between runs on ``device``: on it where
    the memory plan for a typical request (1024², all stages) keeps it resident, else in CPU memory,
    for the engine to copy or stream in (a model loaded onto the GPU runs there as it is, and one
    that does not fit fails to load). The three are planned together: each fitting alone is not
    all three fitting."""
    if device.type != "cuda":
        return [device] * 3
    from ..memory.planner import MemoryRequest, ModelSizes, choose_plan, estimate, plan_for

    request = MemoryRequest(cfg=spec.kind == "base")
    if spec.memory == "auto":  # for this device's free memory
        plan = plan_for(request, *models, device=device)
    else:  # the mode's own placement
        plan = choose_plan(estimate(request, ModelSizes.from_modules(*models)), 1 << 62, mode=spec.memory)
    return [device if plan.placements.get(c, "resident") == "resident" else torch.device("cpu")
            for c in ("transformer", "text_encoder", "vae")]


def spec_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The dtype the models of ``spec`` load in on ``device``: the one asked, else bf16 on a GPU, fp32
    on the CPU (the CLI's rule)."""
    from ..files.loaders import as_dtype

    return as_dtype(spec.dtype, "--dtype") or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def open_engine(spec: ModelSpec) -> Engine:
    """Load the three models of ``spec`` on this worker's device and return their :class:`Engine`
    (memory planned per call for this device's free memory when ``spec.memory`` is "auto")."""
    from ..files.loaders import load_text_encoder, load_transformer, load_vae, meta_model, quantize_for
    from ..pipeline.request import as_device

    device = as_device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = spec_dtype(spec, device)
    components = ("transformer", "text_encoder", "vae")
    if spec.demo:
        from ..testing.tiny import build_tiny_components

        built = [m.to(dtype=dtype) for m in build_tiny_components()]
        homes = _homes(spec, device, built)
        models = [m.to(home) for m, home in zip(built, homes)]
    else:
        quantize = quantize_for(spec.transformer, "transformer", device, spec.quantize, dtype=dtype)
        homes = _homes(spec, device, [meta_model(path, c, dtype=dtype, quantize=q) for path, c, q in zip(
            (spec.transformer, spec.text_encoder, spec.vae), components, (quantize, None, None))])
        models = [load_transformer(spec.transformer, device=homes[0], dtype=dtype, quantize=quantize),
                  load_text_encoder(spec.text_encoder, device=homes[1], dtype=dtype),
                  load_vae(spec.vae, device=homes[2], dtype=dtype)]
    logger.info("models loaded for %s (%s): %s", device, dtype,
                ", ".join(f"{c} in {'CPU memory' if next(m.parameters()).device.type == 'cpu' else 'device memory'}"
                          for c, m in zip(components, models)))
    return Engine(*models, kind=spec.kind, device=device, memory=spec.memory, vae_tile=spec.vae_tile, text=spec.text,
                  ref_mode=spec.ref_mode, speed=spec.speed)
