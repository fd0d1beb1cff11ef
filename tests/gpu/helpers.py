"""Helpers of the GPU suite: the target device, measures, small and full-size random components."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from klein_core.testing.fill import random_fill_ as fill_

GIB = 1024**3

# ---------------------------------------------------------------------------------------------
# Where and how


@dataclass(frozen=True)
class Target:
    """Where the suite runs and the sizes and tolerances that go with it."""

    device: torch.device
    dtype: torch.dtype
    size: int  # output side in pixels for the small runs
    ref_sizes: tuple[tuple[int, int], ...]  # (width, height) of the two references

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def half(self) -> bool:
        return self.dtype in (torch.bfloat16, torch.float16)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def make_target(device: torch.device, dtype: torch.dtype | None = None) -> Target:
    """CUDA in bf16 at 256 px, or (CPU mode) the CPU in float32 at 64 px; ``dtype`` overrides the
    dtype (the CPU mode in bf16 shows what the bf16 tolerances are made of)."""
    if device.type == "cpu":
        return Target(device, dtype or torch.float32, 64, ((64, 80), (96, 64)))
    return Target(device, dtype or torch.bfloat16, 256, ((256, 192), (192, 256)))


# ---------------------------------------------------------------------------------------------
# Measures


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float32 (NaN-safe: NaN compares as failing)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, in float32 on the CPU."""
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


def tag(target: Target, name: str) -> str:
    """A parity-table row name that says where it was measured."""
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(target.dtype, str(target.dtype))
    return f"gpu suite [{target.device.type} {dtype}] {name}"


# ---------------------------------------------------------------------------------------------
# Small components (real structure; on CUDA the real head dim)


def small_spec(target: Target):
    """Transformer sizes for the small runs: tiny on the CPU; on CUDA hidden 256 with 2 heads of 128
    (the real head dim, so flash/cuDNN attention and the fused kernels run the real tile shapes)."""
    from klein_core.testing import TINY_4B, TinySpec

    if target.cpu:
        return TINY_4B
    return TinySpec(text_hidden=32, hidden=256, heads=2, depth=2, depth_single=3)


def _cpu_states(seed: int, target: Target) -> dict[str, dict[str, torch.Tensor]]:
    from klein_core.testing import TINY_4B, tiny_text_encoder, tiny_transformer, tiny_vae

    return {"transformer": tiny_transformer(small_spec(target), seed).state_dict(),
            "text_encoder": tiny_text_encoder(TINY_4B, seed).state_dict(),
            "vae": tiny_vae(seed).state_dict()}


def load_small(target: Target, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
               seed: int = 0, source: str = "flux-2-klein-4b.safetensors", rounded: bool = False):
    """(transformer, text encoder, VAE) loaded through the public loaders from tiny random state
    dicts, on ``device`` in ``dtype`` (default: the target's). ``rounded``: the weights are first
    rounded to the target's dtype, so an fp32 CPU copy holds exactly the values the target computes
    with (the reference for a bf16 GPU run). ``source`` is the file name the transformer reports
    (the model kind is read from it)."""
    import klein_core as kc

    device = target.device if device is None else torch.device(device)
    dtype = target.dtype if dtype is None else dtype
    states = _cpu_states(seed, target)
    if rounded:
        states = {c: {k: (v.to(target.dtype) if v.is_floating_point() and "running_" not in k else v)
                      for k, v in sd.items()} for c, sd in states.items()}
    tr = kc.load_transformer(states["transformer"], device=device, dtype=dtype)
    te = kc.load_text_encoder(states["text_encoder"], device=device, dtype=dtype)
    vae = kc.load_vae(states["vae"], device=device, dtype=dtype)
    tr.source = source
    return tr, te, vae


def cpu_reference(target: Target, **kw):
    """The small components as an fp32 CPU reference holding the target's (rounded) weights."""
    return load_small(target, device="cpu", dtype=torch.float32, rounded=True, **kw)


def transformer_inputs(model, target: Target, h: int, w: int, *, txt_len: int = 32, ref: tuple[int, int] | None = None,
                       batch: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random forward inputs for ``model`` on the target: an ``h x w`` latent grid (+ one reference
    grid at time offset 10), ``txt_len`` text tokens; drawn in fp32 on the CPU, then moved."""
    from klein_core.pipeline.sampling import position_ids, text_position_ids

    g = torch.Generator().manual_seed(seed)
    ids = position_ids(h, w)
    if ref is not None:
        ids = torch.cat([ids, position_ids(*ref, t=10)])
    cfg = model.config
    kw = {"img": torch.randn(batch, ids.shape[0], cfg.in_channels, generator=g), "img_ids": ids,
          "txt": torch.randn(batch, txt_len, cfg.context_dim, generator=g), "txt_ids": text_position_ids(txt_len),
          "timesteps": torch.linspace(0.9, 0.4, batch)}
    dev = model.img_in.weight.device
    return {k: (v.to(dev, target.dtype) if k in ("img", "txt") else v.to(dev)) for k, v in kw.items()}


def forward(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """One transformer forward without autograd."""
    with torch.no_grad():
        return model(**inputs)


def reference_images(sizes, seed: int = 0):
    """Smooth random RGB images (PIL) of the given (width, height) sizes: upsampled noise."""
    import numpy as np
    from PIL import Image

    out = []
    for i, (w, h) in enumerate(sizes):
        g = torch.Generator().manual_seed(seed + i)
        low = torch.rand(1, 3, max(2, h // 16), max(2, w // 16), generator=g)
        px = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)[0]
        arr = (px.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        out.append(Image.fromarray(arr))
    return out


def host_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` in (pinned, where CUDA is) CPU memory; ``module`` is left where it is.
    Copied on its own device first, one component at a time, then moved out."""
    import copy

    from klein_core.memory.placement import pin_memory_

    clone = copy.deepcopy(module)
    clone.source = getattr(module, "source", "")
    pin_memory_(clone)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return clone


def peak_bytes(device: torch.device, fn):
    """``(result, peak bytes allocated above the start)`` of ``fn()`` on a CUDA device."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - start


# ---------------------------------------------------------------------------------------------
# Full-size Klein 4B, random weights built on the GPU


def full_4b_configs():
    """The Klein 4B transformer, its Qwen3-4B encoder (as the file holds it) and the FLUX.2 VAE configs."""
    from klein_core.models.variants import KLEIN_4B
    from klein_core.testing.fill import full_size_configs

    return full_size_configs(KLEIN_4B)


def random_fill_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """:func:`klein_core.testing.fill.random_fill_` with a generator on the module's device seeded ``seed``."""
    device = next(module.parameters()).device
    return fill_(module, torch.Generator(device=device).manual_seed(seed))


def build_full_4b(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Full-size random Klein 4B components directly on ``device`` (built on meta, then ``to_empty``);
    the VAE's BatchNorm statistics stay float32 as the loader keeps them."""
    from klein_core.models.qwen3 import Qwen3TextEncoder
    from klein_core.models.transformer import Flux2Transformer
    from klein_core.models.vae import Flux2VAE

    tc, qc, vc = full_4b_configs()
    out = []
    for i, factory in enumerate((lambda: Flux2Transformer(tc), lambda: Qwen3TextEncoder(qc), lambda: Flux2VAE(vc))):
        with torch.device("meta"):
            module = factory()
        module.to(dtype)
        if isinstance(module, Flux2VAE):
            module.bn.float()
        module.to_empty(device=device)
        out.append(random_fill_(module, seed + i))
    out[0].source = "flux-2-klein-4b.safetensors"
    return tuple(out)
