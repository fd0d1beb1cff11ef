"""ComfyUI's own FLUX.2 transformer as a timing peer, on the same weights as klein_core's.

Users who do not install this pack run Klein through ComfyUI's native ``comfy.ldm.flux.model.Flux``
(``image_model="flux2"``). This module builds that class directly (no model detection: ComfyUI
0.3.75's FLUX.2 detection hard-codes FLUX.2 [dev]'s 48 heads and cannot load Klein) with Klein's
sizes taken from a :class:`klein_core.models.TransformerConfig`, fills it with the tensors of a
klein_core :class:`~klein_core.models.Flux2Transformer` (both use the BFL checkpoint key layout, so the
state dict loads by name, strictly, as shared tensors: nothing is copied), and runs it with
ComfyUI's own layers (the ops class its loader picks, ``comfy.ops.pick_operations``) and ComfyUI's
own attention (``optimized_attention`` as ComfyUI chose it at import).

The ComfyUI copy is the one ``tests/e2e/setup_host.py`` prepares (``.comfy_host/ComfyUI``, ComfyUI
0.3.75); ``--comfy-dir`` or ``KLEIN_COMFYUI_DIR`` point elsewhere. It is put at the end of
``sys.path`` (nothing of this repository is shadowed), never installed.

API::

    model = build_comfy_flux2(transformer)                   # ComfyUI's Flux on klein_core's tensors
    v = comfy_step(model, latents, txt, sigma, refs=None)    # [B,128,h,w] velocity, as ComfyUI's sampler asks
    v = klein_step(transformer, latents, txt, sigma, refs)   # the same step through klein_core
    velocity_diff(model, transformer, latents, txt, sigma)   # {"max_abs", "rel_l2", ...}
    time_comfy_steps(model, latents, txt, sigma, runs=5)     # {"median_ms", ...}

Usage::

    python benchmarks/comfy_peer.py --tiny                                    # CPU self-test
    python benchmarks/comfy_peer.py --model 4b --size 1024 --runs 5 --out out/comfy_peer_4b.json
    python benchmarks/comfy_peer.py --model 9b --size 1024 --refs 0,2 --runs 5 --out out/comfy_peer_9b.json

The GPU run builds the full-size transformer with random weights on the GPU in bf16 (meta device,
``to_empty``, :func:`klein_core.testing.fill.random_fill_` seeded as ``benchmarks/speed.py`` seeds
its transformer), builds the ComfyUI peer on those tensors, and times per denoising step (median of
``--runs`` after ``--warmup``; CUDA events): ComfyUI's ``Flux.forward``, klein_core's plain forward
and klein_core's default fast path (:func:`klein_core.accel.enable_fast_paths`). It reports the
velocity differences between the three (and, in bf16, each one's distance from a float32 copy of the
same weights: the size of bf16 rounding alone), the attention function ComfyUI picked and the GPU
attention kernels that ran. Diffusers is not needed.

The velocities are compared at the time value klein_core embeds: in bf16 klein_core (like
diffusers) rounds sigma x 1000 to bf16, ComfyUI keeps it in float32, so ComfyUI is given the sigma
that rounding yields (``comfy_vs_plain``); ``comfy_raw_sigma_vs_plain`` is the same step with the
unrounded sigma, as each pipeline would actually run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks.timing import call_times  # noqa: E402
from klein_core.models import Flux2Transformer, TransformerConfig  # noqa: E402
from klein_core.models.variants import KLEIN_4B, KLEIN_9B  # noqa: E402
from klein_core.pipeline.sampling import (  # noqa: E402
    make_noise,
    pack,
    position_ids,
    reference_tokens,
    text_position_ids,
    unpack,
)
from klein_core.testing.fill import full_size_configs, random_fill_  # noqa: E402

SEED = 1234  # benchmarks/speed.py's seed: the transformer gets the same random weights there
DEFAULT_COMFY_DIR = REPO / ".comfy_host" / "ComfyUI"
TINY_CONFIG = TransformerConfig(hidden_size=64, num_heads=2, depth=1, depth_single=2, context_dim=96,
                                mlp_hidden=192, axes_dim=(8, 8, 8, 8))

# ---------------------------------------------------------------------------------------------
# The ComfyUI host


def comfy_dir(path: str | os.PathLike | None = None) -> Path:
    """The ComfyUI root to use: ``path``, else ``$KLEIN_COMFYUI_DIR``, else ``.comfy_host/ComfyUI``."""
    return Path(path or os.environ.get("KLEIN_COMFYUI_DIR") or DEFAULT_COMFY_DIR).resolve()


def host_problem(path: str | os.PathLike | None = None) -> str | None:
    """None when ComfyUI's Flux can be imported from the ComfyUI root, else a one-line reason."""
    root = comfy_dir(path)
    if not (root / "comfy" / "ldm" / "flux" / "model.py").is_file():
        return (f"no ComfyUI at {root} (comfy/ldm/flux/model.py missing); prepare it with: "
                f"{sys.executable} tests/e2e/setup_host.py")
    import importlib.util

    missing = [m for m in ("einops", "psutil") if importlib.util.find_spec(m) is None]
    if missing:
        return f"ComfyUI's modules need {', '.join(missing)}, not importable in {sys.executable}"
    return None


def comfy_version(root: Path) -> str | None:
    try:
        text = (root / "comfyui_version.py").read_text()
    except OSError:
        return None
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
    return m.group(1) if m else None


@dataclass(frozen=True)
class ComfyHost:
    """The imported ComfyUI modules this peer uses."""

    root: Path
    version: str | None
    cpu_mode: bool  # ComfyUI's --cpu (its device and attention choice follow it)
    flux_model: ModuleType  # comfy.ldm.flux.model
    flux_math: ModuleType  # comfy.ldm.flux.math (binds optimized_attention at import)
    ops: ModuleType  # comfy.ops
    attention: ModuleType  # comfy.ldm.modules.attention
    model_management: ModuleType

    @property
    def attention_name(self) -> str:
        """The attention function ComfyUI's Flux calls (``attention_pytorch``, ``attention_sub_quad``...)."""
        fn = self.flux_math.optimized_attention
        return getattr(fn, "__name__", repr(fn))


class _Stand(ModuleType):
    """A module whose every attribute is a placeholder class (for imports the pack never uses)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {})
        setattr(self, name, value)
        return value


def stand_in_for_av() -> None:
    """Empty stand-ins for PyAV when it is not installed (the GPU image lacks it): ComfyUI's V3 API
    imports it for its video types, which the pack never uses."""
    if importlib.util.find_spec("av") is not None:
        return
    for name in ("av", "av.container", "av.subtitles", "av.subtitles.stream", "av.video", "av.audio"):
        sys.modules.setdefault(name, _Stand(name))


def import_comfy(path: str | os.PathLike | None = None, *, cpu: bool | None = None) -> ComfyHost:
    """Import ComfyUI's Flux modules from the ComfyUI root (appended to ``sys.path``).

    ComfyUI parses its command line when ``comfy.cli_args`` is first imported: it is given exactly
    ``--cpu`` (``cpu=True``, the default without CUDA; otherwise ``model_management`` probes CUDA at
    import) or no flags, never this script's arguments. If ``comfy`` is already imported (e.g. by the
    node tests' fixture, which uses ``--cpu`` too) those modules are reused; they must come from
    the same root.
    """
    root = comfy_dir(path)
    problem = host_problem(root)
    if problem:
        raise RuntimeError(problem)
    if cpu is None:
        cpu = not torch.cuda.is_available()
    loaded = sys.modules.get("comfy")
    if loaded is not None:
        origin = getattr(loaded, "__file__", None) or next(iter(getattr(loaded, "__path__", [""])))
        where = Path(origin).resolve()
        if root not in where.parents:
            raise RuntimeError(f"a different ComfyUI is already imported ({where}); wanted {root}")
    if str(root) not in sys.path:
        sys.path.append(str(root))  # appended: nothing of the repository is shadowed
    argv = sys.argv
    try:
        if "comfy.cli_args" not in sys.modules:
            sys.argv = [argv[0], *(["--cpu"] if cpu else [])]
            import comfy.options

            comfy.options.enable_args_parsing()
        import comfy.cli_args
        import comfy.ldm.flux.math
        import comfy.ldm.flux.model
        import comfy.ldm.modules.attention
        import comfy.model_management
        import comfy.ops
    finally:
        sys.argv = argv
    return ComfyHost(root=root, version=comfy_version(root), cpu_mode=bool(comfy.cli_args.args.cpu),
                     flux_model=comfy.ldm.flux.model, flux_math=comfy.ldm.flux.math, ops=comfy.ops,
                     attention=comfy.ldm.modules.attention, model_management=comfy.model_management)


# ---------------------------------------------------------------------------------------------
# ComfyUI's Flux with Klein's sizes


def comfy_flux2_kwargs(cfg: TransformerConfig, host: ComfyHost | None = None) -> dict[str, Any]:
    """The ``comfy.ldm.flux.model.Flux(**kwargs)`` arguments that make it this Klein transformer.

    The FLUX.2 flags are those of ComfyUI's FLUX.2 detection (``model_detection.py``): shared
    ("global") modulation, SiLU-gated MLPs, no biases, 4 RoPE axes, theta 2000, 128 latent channels,
    patch 1, references by "index" with t = 10, 20, ... The sizes come from ``cfg`` (detection would
    say 48 heads). Klein has no guidance embedder and no pooled vector input (``vec_in_dim=None``).
    Newer ComfyUI parameters, where the given ComfyUI has them, get Klein's values: text position ids
    on axis 3 (``txt_ids_dims=[3]``; 0.3.75 does that for every 4-axis model), no extra text norm, no
    "yak" MLP.
    """
    ratio = cfg.mlp_hidden / cfg.hidden_size
    if int(cfg.hidden_size * ratio) != cfg.mlp_hidden:
        raise ValueError(f"MLP width {cfg.mlp_hidden} is not int(hidden {cfg.hidden_size} x ratio)")
    theta = int(cfg.theta) if float(cfg.theta).is_integer() else float(cfg.theta)
    kwargs: dict[str, Any] = {
        "image_model": "flux2",
        "in_channels": cfg.in_channels,
        "out_channels": cfg.in_channels,
        "vec_in_dim": None,
        "context_in_dim": cfg.context_dim,
        "hidden_size": cfg.hidden_size,
        "mlp_ratio": ratio,
        "num_heads": cfg.num_heads,
        "depth": cfg.depth,
        "depth_single_blocks": cfg.depth_single,
        "axes_dim": list(cfg.axes_dim),
        "theta": theta,
        "patch_size": 1,
        "qkv_bias": False,
        "guidance_embed": False,
        "global_modulation": True,
        "mlp_silu_act": True,
        "ops_bias": False,
        "default_ref_method": "index",
        "ref_index_scale": 10.0,
    }
    if host is not None:
        fields = {f.name for f in dataclasses.fields(host.flux_model.FluxParams)}
        for name, value in (("txt_ids_dims", [3]), ("txt_norm", False), ("yak_mlp", False)):
            if name in fields:
                kwargs[name] = value
    return kwargs


class WeightMismatch(RuntimeError):
    """klein_core's state dict does not fit ComfyUI's module (names or shapes)."""


def load_bfl_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load a BFL-layout state dict into ComfyUI's Flux (built on the meta device) strictly, by
    assignment: ComfyUI's parameters become the given tensors (shared storage, no copy).

    Raises :class:`WeightMismatch` naming every missing, unexpected and mis-shaped key.
    """
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    shapes = [f"{k}: klein_core {tuple(state_dict[k].shape)} vs ComfyUI {tuple(expected[k].shape)}"
              for k in sorted(set(expected) & set(state_dict))
              if tuple(expected[k].shape) != tuple(state_dict[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing in klein_core's state dict ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected, not in ComfyUI's Flux ({len(unexpected)}): {', '.join(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch ({len(shapes)}): {'; '.join(shapes)}")
        raise WeightMismatch("ComfyUI Flux <- klein_core weights: " + " | ".join(parts))
    model.load_state_dict(state_dict, strict=True, assign=True)
    tensors = [*model.parameters(), *model.buffers()]
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise WeightMismatch(f"tensors left on the meta device after loading: {', '.join(left)}")
    ours = {t.untyped_storage().data_ptr() for t in state_dict.values()}
    shared = sum(t.untyped_storage().data_ptr() in ours for t in tensors)
    return {"tensors": len(tensors), "shared_with_klein_core": shared,
            "copied": len(tensors) - shared}


def build_comfy_flux2(transformer: Flux2Transformer, *, host: ComfyHost | None = None,
                      comfy_path: str | os.PathLike | None = None) -> torch.nn.Module:
    """ComfyUI's ``Flux`` (``image_model="flux2"``) with ``transformer``'s sizes and tensors.

    The layers are the ops class ComfyUI's loader would pick for these weights
    (``comfy.ops.pick_operations(weight dtype, no manual cast)``: ``disable_weight_init`` for bf16
    or fp32 weights used in their own dtype). The module is built on the meta device and takes
    ``transformer``'s tensors by assignment. ``model.klein_peer`` records the constructor arguments,
    the ops class, the attention function and the loading summary.
    """
    if host is None:
        host = import_comfy(comfy_path, cpu=transformer.device.type == "cpu")
    cfg = transformer.config
    dtype, device = transformer.dtype, transformer.device
    kwargs = comfy_flux2_kwargs(cfg, host)
    ops = host.ops.pick_operations(dtype, None, load_device=device)
    with torch.device("meta"):
        model = host.flux_model.Flux(**kwargs, dtype=dtype, device=torch.device("meta"), operations=ops)
    loaded = load_bfl_weights(model, transformer.state_dict())
    model.eval().requires_grad_(False)
    model.klein_peer = {  # type: ignore[attr-defined]
        "comfyui_version": host.version,
        "comfyui_dir": str(host.root),
        "constructor": {k: v for k, v in kwargs.items()},
        "operations": f"comfy.ops.{getattr(ops, '__name__', repr(ops))}",
        "attention": host.attention_name,
        "comfy_cpu_mode": host.cpu_mode,
        "weights": loaded,
    }
    return model


# ---------------------------------------------------------------------------------------------
# One denoising step, each the way its own sampler asks for it


def _model_place(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


def _batch_refs(refs: Sequence[torch.Tensor] | None, b: int) -> list[torch.Tensor]:
    out = []
    for i, r in enumerate(refs or ()):
        if r.ndim != 4 or r.shape[0] not in (1, b):
            raise ValueError(f"reference {i + 1}: expected latents [1 or {b}, C, h, w], got {list(r.shape)}")
        out.append(r)
    return out


def comfy_step(model: torch.nn.Module, img_latents: torch.Tensor, txt: torch.Tensor,
               sigma: float | torch.Tensor, refs: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """ComfyUI's velocity ``[B, 128, h, w]`` (float32) for latents ``[B, 128, h, w]`` at ``sigma``.

    Does what ComfyUI's ``BaseModel._apply_model`` does around the diffusion model for FLUX.2
    (``ModelSamplingFlux``: the timestep passed is sigma itself, in float32; ``Flux`` multiplies by
    1000 inside ``timestep_embedding``): latents, text and references cast to the model dtype, then
    ``Flux.forward(x, timestep, context, ref_latents=[...])``, which packs the image, makes the ids
    (image ``(0, h, w, 0)``, text ``(0, 0, 0, l)``, reference k ``(10k, h, w, 0)``) and drops the
    reference tokens from the output.
    """
    device, dtype = _model_place(model)
    b = img_latents.shape[0]
    x = img_latents.to(device=device, dtype=dtype)
    t = torch.as_tensor(sigma, dtype=torch.float32, device=device).reshape(-1)
    t = t.expand(b) if t.numel() == 1 else t
    context = txt.to(device=device, dtype=dtype)
    ref_latents = [r.to(device=device, dtype=dtype).expand(b, -1, -1, -1)
                   for r in _batch_refs(refs, b)] or None
    out = model(x, t, context=context, ref_latents=ref_latents, transformer_options={})
    return out.float()


def klein_timesteps(sigma: float | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The timestep tensor klein_core's sampler passes for ``sigma`` (sigma x 1000 rounded to the
    latent dtype, / 1000: SPEC §4.4)."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=device).reshape(-1)
    return ((s * 1000).to(dtype) / 1000).to(dtype)


def klein_effective_sigma(sigma: float | torch.Tensor, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
    """The float32 sigma that makes ComfyUI embed the same time value as klein_core does in ``dtype``
    (klein_core's forward computes ``timesteps.to(dtype) * 1000`` in the model dtype; ComfyUI
    computes ``1000 * sigma`` in float32). Equal to ``sigma`` in float32 models."""
    t = klein_timesteps(sigma, dtype, device)
    return (t.to(dtype) * 1000).float() / 1000


@dataclass
class KleinStep:
    """One denoising step through klein_core, prepared like its sampler (``klein_core.pipeline.sampling``):
    ids and RoPE tables once per run, then per step the reference tokens joined, the forward, the
    noisy tokens kept."""

    transformer: Flux2Transformer
    latents: torch.Tensor  # packed [B, N, 128] in the model dtype
    txt: torch.Tensor
    img_ids: torch.Tensor
    txt_ids: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    ref_tokens: torch.Tensor | None
    timesteps: torch.Tensor
    grid: tuple[int, int]

    def __call__(self) -> torch.Tensor:
        x = self.latents
        if self.ref_tokens is not None:
            x = torch.cat([x, self.ref_tokens.expand(x.shape[0], -1, -1)], dim=1)
        h, w = self.grid
        v = self.transformer(img=x, img_ids=self.img_ids, txt=self.txt, txt_ids=self.txt_ids,
                             timesteps=self.timesteps.expand(x.shape[0]), rope=self.rope)[:, : h * w]
        return unpack(v, h, w).float()


def prepare_klein_step(transformer: Flux2Transformer, img_latents: torch.Tensor, txt: torch.Tensor,
                       sigma: float | torch.Tensor, refs: Sequence[torch.Tensor] | None = None) -> KleinStep:
    device, dtype = transformer.device, transformer.dtype
    b, _, h, w = img_latents.shape
    img_ids = position_ids(h, w)
    ref_tok = None
    batched = _batch_refs(refs, b)
    if batched:
        if any(r.shape[0] != 1 for r in batched):
            raise ValueError("klein_core's references are shared by the batch: pass them as [1, C, h, w]")
        rt = reference_tokens(batched)
        ref_tok = rt.tokens.to(device=device, dtype=dtype)
        img_ids = torch.cat([img_ids, rt.ids])
    txt_ids = text_position_ids(txt.shape[1])
    return KleinStep(transformer, pack(img_latents).to(device=device, dtype=dtype),
                     txt.to(device=device, dtype=dtype), img_ids, txt_ids, transformer.rope(txt_ids, img_ids),
                     ref_tok, klein_timesteps(sigma, dtype, device), (h, w))


def klein_step(transformer: Flux2Transformer, img_latents: torch.Tensor, txt: torch.Tensor,
               sigma: float | torch.Tensor, refs: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """klein_core's velocity ``[B, 128, h, w]`` (float32) for the same inputs as :func:`comfy_step`."""
    return prepare_klein_step(transformer, img_latents, txt, sigma, refs)()


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """``max_abs`` = max |a - b|, ``rel_l2`` = ||a - b|| / ||b|| (float64), and b's scale."""
    a64, b64 = a.double(), b.double()
    d = a64 - b64
    return {"max_abs": float(d.abs().max()), "rel_l2": float(d.norm() / b64.norm().clamp_min(1e-30)),
            "ref_max_abs": float(b64.abs().max()), "ref_rms": float(b64.pow(2).mean().sqrt()),
            "finite": bool(torch.isfinite(a).all() and torch.isfinite(b).all())}


def velocity_diff(model: torch.nn.Module, transformer: Flux2Transformer, img_latents: torch.Tensor,
                  txt: torch.Tensor, sigma: float, refs: Sequence[torch.Tensor] | None = None, *,
                  match_timestep: bool = True) -> dict[str, Any]:
    """ComfyUI's velocity vs klein_core's (plain or fast, whatever ``transformer.ops`` holds) for the
    same noise, text, references and sigma: ``max_abs`` and ``rel_l2`` relative to klein_core's.

    ``match_timestep``: give ComfyUI the float32 sigma whose x1000 equals the time value klein_core
    embeds in its dtype (:func:`klein_effective_sigma`); in bf16, klein_core (like diffusers) rounds
    sigma x 1000 to bf16 while ComfyUI keeps float32, a difference of the input, not of the model.
    """
    with torch.inference_mode():
        v_klein = klein_step(transformer, img_latents, txt, sigma, refs)
        s = klein_effective_sigma(sigma, transformer.dtype, transformer.device) if match_timestep else sigma
        v_comfy = comfy_step(model, img_latents, txt, s, refs)
    out = diff_stats(v_comfy, v_klein)
    out["sigma"] = float(sigma)
    out["sigma_given_to_comfy"] = float(torch.as_tensor(s).reshape(-1)[0])
    return out


# ---------------------------------------------------------------------------------------------
# Timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, runs: int = 5, warmup: int = 2) -> dict[str, Any]:
    """Median milliseconds per call of ``fn`` after ``warmup`` untimed calls: CUDA events around each
    call on CUDA, the host clock (``perf_counter``) elsewhere."""
    if runs < 1 or warmup < 0:
        raise ValueError("runs must be >= 1 and warmup >= 0")
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    _sync(device)
    warm_ms = (time.perf_counter() - t0) * 1000.0
    times = call_times(fn, device, runs)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "all_ms": times, "runs": runs,
            "warmup": warmup, "warmup_total_ms": warm_ms,
            "clock": "cuda events" if device.type == "cuda" else "host perf_counter"}


def time_comfy_steps(model: torch.nn.Module, img_latents: torch.Tensor, txt: torch.Tensor, sigma: float,
                     refs: Sequence[torch.Tensor] | None = None, runs: int = 5,
                     warmup: int = 2) -> dict[str, Any]:
    """Median ms per ComfyUI denoising step (:func:`comfy_step`, under ``torch.inference_mode`` as
    ComfyUI runs its nodes)."""
    device, _ = _model_place(model)
    with torch.inference_mode():
        return time_calls(lambda: comfy_step(model, img_latents, txt, sigma, refs), device, runs, warmup)


def time_klein_steps(transformer: Flux2Transformer, img_latents: torch.Tensor, txt: torch.Tensor,
                     sigma: float, refs: Sequence[torch.Tensor] | None = None, runs: int = 5,
                     warmup: int = 2) -> dict[str, Any]:
    """Median ms per klein_core denoising step with whatever ops ``transformer`` has (plain / fast)."""
    with torch.inference_mode():
        step = prepare_klein_step(transformer, img_latents, txt, sigma, refs)
        return time_calls(step, transformer.device, runs, warmup)


def attention_kernels(fn: Callable[[], Any], device: torch.device) -> list[str]:
    """Names of the GPU kernels of one call of ``fn`` that look like attention (profiler), or []."""
    if device.type != "cuda":
        return []
    try:
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        names = {e.key for e in prof.key_averages()}
    except Exception as exc:  # informative only
        return [f"(profiler failed: {type(exc).__name__}: {exc})"]
    pat = re.compile(r"flash|fmha|attention|attn|cudnn.*(sdpa|mha)|efficient", re.I)
    return sorted(n[:160] for n in names if pat.search(n))


# ---------------------------------------------------------------------------------------------
# Models and inputs for the CLI


def random_transformer(cfg: TransformerConfig, device: torch.device, dtype: torch.dtype,
                       seed: int = SEED) -> Flux2Transformer:
    """``Flux2Transformer(cfg)`` with random weights made on ``device`` (built on meta, ``to_empty``,
    :func:`random_fill_` with a generator on the device seeded ``seed``), as benchmarks/speed.py
    builds its transformer."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        tr = Flux2Transformer(cfg)
    tr.to(dtype)
    tr.to_empty(device=device)
    random_fill_(tr, g)
    return tr.eval().requires_grad_(False)


def make_inputs(cfg: TransformerConfig, size: tuple[int, int], text_len: int,
                ref_sizes: Sequence[tuple[int, int]], device: torch.device, dtype: torch.dtype,
                batch: int = 1, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Noise ``[B, C, h, w]`` (klein_core's / ComfyUI's seeded CPU noise), random text features
    ``[B, L, context_dim]`` and reference latents ``[1, C, h_k, w_k]``; ``size`` and ``ref_sizes`` are
    latent grids (pixels / 16)."""
    h, w = size
    noise = make_noise(seed, batch, cfg.in_channels, h, w).to(device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    txt = torch.randn((batch, text_len, cfg.context_dim), generator=g).to(device=device, dtype=dtype)
    refs = [make_noise(seed + 10 * (k + 1), 1, cfg.in_channels, rh, rw).to(device)
            for k, (rh, rw) in enumerate(ref_sizes)]
    return noise, txt, refs


def fp32_copy(transformer: Flux2Transformer) -> Flux2Transformer:
    """A float32 copy of ``transformer`` on its device (the accuracy yardstick for the bf16 runs)."""
    with torch.device("meta"):
        copy = Flux2Transformer(transformer.config)
    fp32 = {k: v.float() for k, v in transformer.state_dict().items()}
    copy.load_state_dict(fp32, strict=True, assign=True)
    return copy.eval().requires_grad_(False)


def run_case(model: torch.nn.Module, tr: Flux2Transformer, *, size: tuple[int, int], text_len: int,
             ref_sizes: Sequence[tuple[int, int]], sigma: float, runs: int, warmup: int, batch: int = 1,
             fast: bool = True, reference32: Flux2Transformer | None = None) -> dict[str, Any]:
    """Velocity diffs and step timings of one input shape: ComfyUI, klein_core plain, klein_core fast.

    ``reference32``: a float32 copy of ``tr``; each velocity is then also compared with its float32
    velocity (at the time value ``tr`` embeds), which says how far bf16 rounding alone moves them.
    """
    from klein_core.accel import disable_fast_paths, enable_fast_paths

    device, dtype = tr.device, tr.dtype
    noise, txt, refs = make_inputs(tr.config, size, text_len, ref_sizes, device, dtype, batch)
    n_img = size[0] * size[1]
    res: dict[str, Any] = {
        "latent_grid": list(size), "batch": batch, "text_tokens": text_len,
        "reference_grids": [list(r) for r in ref_sizes],
        "image_tokens": n_img + sum(a * b for a, b in ref_sizes), "sigma": sigma,
    }
    disable_fast_paths(tr)
    with torch.inference_mode():
        v_plain = klein_step(tr, noise, txt, sigma, refs)
        s_c = klein_effective_sigma(sigma, dtype, device)
        v_comfy = comfy_step(model, noise, txt, s_c, refs)
        v_comfy_raw = comfy_step(model, noise, txt, sigma, refs)
    res["sigma_given_to_comfy_for_diffs"] = float(s_c[0])
    diffs = {"comfy_vs_plain": diff_stats(v_comfy, v_plain),
             "comfy_raw_sigma_vs_plain": diff_stats(v_comfy_raw, v_plain)}
    v32 = None
    if reference32 is not None:
        try:
            with torch.inference_mode():
                v32 = klein_step(reference32, noise, txt, s_c, refs)
            diffs["comfy_vs_fp32"] = diff_stats(v_comfy, v32)
            diffs["plain_vs_fp32"] = diff_stats(v_plain, v32)
        except torch.cuda.OutOfMemoryError as exc:
            res["fp32_reference_error"] = f"out of memory: {exc}"[:300]
            torch.cuda.empty_cache()
    timing = {"comfyui": time_comfy_steps(model, noise, txt, sigma, refs, runs, warmup)}
    timing["comfyui"]["attention_function"] = model.klein_peer["attention"]
    kernels = {"comfyui": attention_kernels(lambda: comfy_step(model, noise, txt, sigma, refs), device)}
    timing["klein_plain"] = time_klein_steps(tr, noise, txt, sigma, refs, runs, warmup)
    notes: dict[str, Any] = {}
    if fast:
        ops = enable_fast_paths(tr)
        try:
            with torch.inference_mode():
                v_fast = klein_step(tr, noise, txt, sigma, refs)
            diffs["comfy_vs_fast"] = diff_stats(v_comfy, v_fast)
            diffs["fast_vs_plain"] = diff_stats(v_fast, v_plain)
            if v32 is not None:
                diffs["fast_vs_fp32"] = diff_stats(v_fast, v32)
            timing["klein_fast"] = time_klein_steps(tr, noise, txt, sigma, refs, runs, warmup)
            step = prepare_klein_step(tr, noise, txt, sigma, refs)
            kernels["klein_fast"] = attention_kernels(step, device)
            notes["fast_resolved"] = ops.resolved() if hasattr(ops, "resolved") else {}
            cache = getattr(tr, "step_cache", None)
            notes["fast_step_cache"] = None if cache is None else type(cache).__name__
        finally:
            disable_fast_paths(tr)
    res["diffs"] = diffs
    res["timing"] = timing
    res["attention_kernels"] = kernels
    res["notes"] = notes
    base = timing["comfyui"]["median_ms"]
    res["speedup_vs_comfyui"] = {k: base / v["median_ms"] for k, v in timing.items()}
    return res


def _env(device: torch.device, host: ComfyHost) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "device": str(device), "comfyui_version": host.version,
                           "comfyui_dir": str(host.root), "comfy_cpu_mode": host.cpu_mode}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    for mod in ("comfy_kitchen", "triton", "flash_attn", "flash_attn_interface"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "installed")
        except ImportError:
            env[mod] = None
    return env


def print_report(report: dict[str, Any], out: Any = None) -> None:
    out = out if out is not None else sys.stdout
    peer = report["peer"]
    print(f"\n{report['model']} ({report['env'].get('gpu') or report['env']['device']}, {report['dtype']}); "
          f"ComfyUI {peer['comfyui_version']} Flux, {peer['operations']}, attention {peer['attention']}; "
          f"weights shared {peer['weights']['shared_with_klein_core']}/{peer['weights']['tensors']}",
          file=out)
    for case in report["cases"]:
        refs = case["reference_grids"]
        print(f"\n  latents {case['latent_grid'][0]}x{case['latent_grid'][1]}, text {case['text_tokens']}, "
              f"{len(refs)} reference(s), {case['image_tokens']} image tokens, sigma {case['sigma']}: "
              f"ms per step (median of {case['timing']['comfyui']['runs']})", file=out)
        for name, t in case["timing"].items():
            speedup = case["speedup_vs_comfyui"][name]
            print(f"    {name:14} {t['median_ms']:10.2f}   {speedup:5.2f}x vs ComfyUI",
                  file=out)
        for name, d in case["diffs"].items():
            print(f"    velocity {name:26} max|d| {d['max_abs']:.3e}  rel L2 {d['rel_l2']:.3e}  "
                  f"(|v| max {d['ref_max_abs']:.3g})", file=out)
        for who, names in case["attention_kernels"].items():
            if names:
                print(f"    {who} attention kernels: {', '.join(names[:3])}", file=out)
        for k, v in case["notes"].items():
            print(f"    {k}: {v}", file=out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="4b", choices=("4b", "9b"), help="full-size Klein transformer (GPU)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU self-test: tiny fp32 models (parity and plumbing)")
    ap.add_argument("--size", type=int, default=1024, help="output pixels per side (latent grid = size/16)")
    ap.add_argument("--refs", default="0", help="comma list of reference counts, one case each (refs are "
                                                "size x size); e.g. 0,2")
    ap.add_argument("--text-len", type=int, default=512,
                    help="text tokens (ComfyUI pads Klein prompts to 512)")
    ap.add_argument("--sigma", type=float, default=0.9081, help="sigma of the timed step")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-fast", action="store_true", help="skip klein_core's fast path")
    ap.add_argument("--no-fp32-reference", action="store_true",
                    help="skip the float32 copy that bf16 velocities are also compared with")
    ap.add_argument("--device", default=None, help="default: cuda when available (cpu with --tiny)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--comfy-dir", default=None,
                    help=f"ComfyUI root (default $KLEIN_COMFYUI_DIR or {DEFAULT_COMFY_DIR})")
    ap.add_argument("--out", default=None, help="write the JSON report here (its folder is created)")
    args = ap.parse_args(argv)
    try:
        ref_counts = [int(x) for x in args.refs.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--refs {args.refs!r}: comma list of integers")
    if args.runs < 1 or args.warmup < 0 or args.batch < 1 or not ref_counts or min(ref_counts) < 0:
        ap.error("--runs and --batch must be >= 1, --warmup >= 0, --refs counts >= 0")

    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda"))
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    problem = host_problem(args.comfy_dir)
    if problem:
        raise SystemExit(f"comfy_peer: {problem}")
    t0 = time.perf_counter()
    host = import_comfy(args.comfy_dir, cpu=device.type == "cpu")
    import_s = time.perf_counter() - t0

    if args.tiny:
        cfg, name = TINY_CONFIG, "tiny"
        grid = (3, 5)  # non-square, so h/w positions cannot be confused
        text_len = 16
        ref_grids = [(4, 4), (2, 6), (3, 3)]
        ref_counts = sorted({*ref_counts, 0, 2})
    else:
        variant = KLEIN_4B if args.model == "4b" else KLEIN_9B
        cfg, name = full_size_configs(variant)[0], variant.name
        if args.size % 16:
            ap.error("--size must be a multiple of 16")
        grid = (args.size // 16, args.size // 16)
        text_len = args.text_len
        ref_grids = [grid] * max(ref_counts)
    t0 = time.perf_counter()
    with torch.inference_mode(False), torch.no_grad():
        tr = random_transformer(cfg, device, dtype)
        model = build_comfy_flux2(tr, host=host)
        _sync(device)
        build_s = time.perf_counter() - t0
        ref32 = None if dtype == torch.float32 or args.no_fp32_reference else fp32_copy(tr)
        cases = [run_case(model, tr, size=grid, text_len=text_len, ref_sizes=ref_grids[:n], sigma=args.sigma,
                          runs=args.runs, warmup=args.warmup, batch=args.batch, fast=not args.no_fast,
                          reference32=ref32)
                 for n in ref_counts]
        del ref32
    report = {"model": name, "dtype": str(dtype), "env": _env(device, host), "peer": model.klein_peer,
              "transformer_config": dataclasses.asdict(cfg), "import_comfy_s": import_s, "build_s": build_s,
              "args": vars(args), "cases": cases}
    if device.type == "cuda":
        report["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 1024**3
    print_report(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"\nfull results: {args.out}")
    return report


if __name__ == "__main__":
    main()
