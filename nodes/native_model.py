"""Klein Model to MODEL: a Klein transformer as ComfyUI's own ``MODEL``.

The MODEL is a ModelPatcher over ``comfy.model_base.Flux2`` (``nodes/host.py``) whose
``diffusion_model`` is :class:`KleinDiffusionModel`, an adapter around klein_core's
``Flux2Transformer``. ComfyUI's samplers, schedulers, guiders and model patches (EasyCache...) then
drive it like a native FLUX.2 model, while the weights stay klein_core's (every file format, the
fast paths, LoRAs applied through the pack's LoRA handle).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.nn.functional as F
from comfy_api.latest import io

from klein_core.accel.fast import eager_view
from klein_core.accel.speed import apply_speed
from klein_core.memory.placement import StagePlacer
from klein_core.models.transformer import Flux2Transformer, TransformerConfig
from klein_core.models.transformer_math import rope_tables
from klein_core.models.variants import encoder_for_text_width, variant_for_text_width
from klein_core.pipeline.sampling import REF_TIME_OFFSET, pack, position_ids, text_position_ids, unpack
from klein_core.quant.fp8 import FP8Linear
from klein_core.quant.ggml import GGMLLinear
from klein_core.quant.nvfp4 import NVFP4Linear

from . import cache, host, model_patches, notices
from .common import errors_named
from .encode import NODE as ENCODER_NODE
from .types import KleinModel, KleinModelType

logger = logging.getLogger(__name__)

NODE = "Klein Model to MODEL"
# ComfyUI's reference methods this model runs: "index" (FLUX.2's default: reference k at RoPE time
# 10k, modulated at the current timestep) and "index_timestep_zero" (modulated as at timestep 0).
REF_METHODS = ("index", "index_timestep_zero")
# The loader's memory modes whose transformer stays in CPU memory and is streamed to the GPU block by
# block in every step, as the Klein Sampler runs it; other modes let ComfyUI load the model whole.
STREAMED_MODES = ("blocks", "minimum")


class PatchableFP8Linear(FP8Linear):
    """The view of an :class:`FP8Linear` that ComfyUI's weight patching (LoRAs from LoraLoaderModelOnly)
    can patch. Its ``weight`` is float8 *scaled* by ``weight_scale``: without these hooks ComfyUI adds a
    LoRA's deltas to the raw float8 values, so the LoRA lands scaled by ``weight_scale`` (next to no
    effect) without a warning. ``convert_weight`` / ``set_weight`` are the hooks ComfyUI's own scaled-fp8
    layers give it (``comfy.model_patcher.get_key_weight`` looks them up by name).

    A patched weight is re-quantised under a new scale (as the Klein LoRA Loader merges into fp8), so a
    LoRA that widens the weight's range is not clipped. ComfyUI's unpatching restores only the
    ``weight`` Parameter, so the new scale is kept on the layer until the MODEL's patcher restores the
    weight (:meth:`klein_restored`). It was once tied to the patched Parameter object, which streaming
    (memory_mode blocks) replaces by a device copy each step: the streamed layer then read the patched
    float8 values under the old scale, a LoRA distorted beyond its own effect. It is a plain attribute
    (None when unpatched) so that torch.compile (TorchCompileModel) guards on it and compiles anew.
    """

    _klein_patched_scale: torch.Tensor | None = None  # the scale of a patched weight, while patched

    @property
    def weight_scale(self) -> torch.Tensor:
        patched = self._klein_patched_scale
        if patched is not None:
            return patched.to(self._parameters["weight"].device)
        return self._buffers["weight_scale"]

    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **kwargs: Any) -> torch.Tensor:
        """The raw float8 values (as float32, a copy ComfyUI made) -> the weight they stand for."""
        scale = self.weight_scale.to(device=weight.device, dtype=weight.dtype)
        scale = scale[:, None] if scale.ndim else scale
        return weight.mul_(scale) if inplace else weight * scale

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed: Any = None,
                   return_weight: bool = False, **kwargs: Any) -> torch.Tensor | None:
        """The patched weight (float32) back to float8."""
        fmax = float(torch.finfo(self.weight.dtype).max)
        w = weight.float()
        if return_weight:  # ComfyUI casts it per use under the layer's current scale
            scale = self.weight_scale.to(device=w.device, dtype=torch.float32)
            return (w / (scale[:, None] if scale.ndim else scale)).clamp(-fmax, fmax).to(self.weight.dtype)
        per_row = self._buffers["weight_scale"].ndim == 1
        amax = w.abs().amax(dim=1) if per_row else w.abs().amax()
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        q = (w / (scale[:, None] if per_row else scale)).clamp(-fmax, fmax).to(self.weight.dtype)
        # A new Parameter even for inplace_update: the old tensor is shared with the pack's transformer,
        # which must never see ComfyUI's patch (unpatching puts the original Parameter back).
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self._klein_patched_scale = scale
        return None

    def klein_restored(self) -> None:
        """ComfyUI put the original weight back: its own scale applies again."""
        self._klein_patched_scale = None


class _PackedWeightPatches:
    """ComfyUI's weight patches on a view of a layer whose weight stays packed (GGUF blocks, NVFP4):
    applied at each call to the dequantised weight, as ComfyUI-GGUF applies them, so the packed bytes
    never change and memory stays that of the packed model. Re-quantising the patched weight to 4 bits
    instead would lose a LoRA's small deltas in the rounding, and a dense copy would cost the memory the
    format saves.

    The view gets a 0-dim ``weight`` Parameter standing for the packed weight (it holds no values):
    ComfyUI finds a layer's LoRA keys in the model's state dict and loads the Parameters a module has,
    so without it every key of a LoRA was "not loaded" and the LoRA silently did nothing. The MODEL's
    patcher (``nodes/host.py``) hands the patches to :meth:`klein_patch_weight` and calls
    :meth:`klein_restored` when it unpatches. ``convert_weight`` / ``set_weight`` serve ComfyUI's other
    weight paths (hooks, model merging): a weight they set is kept dense until restored.

    The state is in plain attributes (None when unpatched), which torch.compile (TorchCompileModel)
    guards on; the patched weight is computed outside the compiled graph (any patch kind ComfyUI has).
    """

    _klein_live_patches: tuple[list, str] | None = None  # (ComfyUI's patches, their key), while patched
    _klein_dense_weight: torch.Tensor | None = None  # a weight ComfyUI set itself, while patched

    def klein_patch_weight(self, patches: list, key: str) -> None:
        """Apply ``patches`` (ComfyUI's list for ``key``) from the next call on."""
        self._klein_live_patches = (list(patches), key)

    def klein_restored(self) -> None:
        """ComfyUI unpatched the layer: the packed weight alone again."""
        self._klein_live_patches = None
        self._klein_dense_weight = None

    @torch.compiler.disable
    def klein_weight(self, dtype: torch.dtype, patches: list | None = None, key: str = "") -> torch.Tensor:
        """The weight ``[out, in]`` the layer stands for in ``dtype``, with ``patches`` (default: its own)."""
        if patches is None:
            if self._klein_dense_weight is not None:
                return self._klein_dense_weight.to(dtype)
            if self._klein_live_patches is not None:
                patches, key = self._klein_live_patches
        w = self.dequantized(torch.float32)
        if patches:
            import comfy.lora

            w = comfy.lora.calculate_weight(patches, w, key)
        return w.to(dtype)

    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **kwargs: Any) -> torch.Tensor:
        """The placeholder ComfyUI copied -> the weight it stands for (float32, on its device)."""
        return self.dequantized(torch.float32).to(weight.device)

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed: Any = None,
                   return_weight: bool = False, **kwargs: Any) -> torch.Tensor | None:
        """A weight ComfyUI computed itself (hooks, merges): used as it is until restored."""
        if return_weight:
            return weight
        self._klein_dense_weight = weight.to(self.compute_dtype)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._klein_live_patches is None and self._klein_dense_weight is None:
            return super().forward(x)  # type: ignore[misc]
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.klein_weight(x.dtype), bias)


class PatchableGGMLLinear(_PackedWeightPatches, GGMLLinear):
    """The view of a :class:`GGMLLinear` (GGUF blocks) that ComfyUI's LoRA loaders can patch."""


class PatchableNVFP4Linear(_PackedWeightPatches, NVFP4Linear):
    """The view of an :class:`NVFP4Linear` that ComfyUI's LoRA loaders can patch."""


PATCHABLE_VIEWS: dict[type, type] = {FP8Linear: PatchableFP8Linear, GGMLLinear: PatchableGGMLLinear,
                                     NVFP4Linear: PatchableNVFP4Linear}


def module_view(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s tree of module objects sharing every parameter and buffer tensor: a
    parameter set on the view (as ComfyUI sets a patched weight) leaves ``module`` as it was. Forward
    hooks are kept; a compiled forward (an instance attribute bound to the original module) is
    dropped, so the view runs its own modules eagerly."""
    view = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):  # _modules, _parameters, _buffers, hook dicts
            view.__dict__[key] = copy.copy(value)
    view.__dict__.pop("forward", None)
    # ComfyUI's mark that it has patched a module's weights (the pack's own ModelPatcher marks the
    # original when it loads it): the view's weights are not patched yet.
    view.__dict__.pop("comfy_patched_weights", None)
    patchable = PATCHABLE_VIEWS.get(type(module))
    if patchable is not None:  # ComfyUI's LoRA patching needs their hooks (see the classes)
        view.__class__ = patchable
        if isinstance(view, _PackedWeightPatches):  # the key ComfyUI's LoRA key maps look for
            view._parameters["weight"] = torch.nn.Parameter(
                torch.zeros((), dtype=torch.uint8, device=module.qweight.device), requires_grad=False)
    for name, child in module._modules.items():
        view._modules[name] = module_view(child) if child is not None else None
    return view


class KleinDiffusionModel(torch.nn.Module):
    """ComfyUI's Flux diffusion-model call turned into klein_core's transformer call.

    ``forward(x [B, 128, h, w], timestep [B] (sigma), context [B, L, D], ref_latents=[[B or 1, 128,
    h_k, w_k], ...])`` -> velocity ``[B, 128, h, w]``.

    It runs a view of the transformer (:func:`module_view`: its own module objects over the same
    tensors) whose modules are this module's own, so ComfyUI's ModelPatcher sees, counts and moves
    the weights under their BFL names (``diffusion_model.double_blocks.0.img_attn.qkv.weight``): the
    names ComfyUI's own LoRA loaders map. What ComfyUI patches is set on the view, never on the pack's
    transformer, which other nodes keep using as it is.
    """

    patch_size = 1  # what model_base.Flux reads for attention masks

    def __init__(self, transformer: Flux2Transformer, model_name: str, kind: str = "distilled",
                 stream_to: torch.device | None = None, source_model: torch.nn.Module | None = None) -> None:
        super().__init__()
        view = module_view(transformer)
        eager_view(view, transformer)  # "fast + compile" runs the fast kernels here, not the compile speed's
        object.__setattr__(self, "transformer", view)  # an attribute, not a child: no "transformer." in the keys
        # The pack's cached transformer (the same tensors as the view; for a LoRA'd model its base, which
        # the LoRA copy shares them with): after the pack's cache lets it go (Unload models), the cache
        # takes this one back rather than read the file again beside it.
        object.__setattr__(self, "source_model", transformer if source_model is None else source_model)
        self._modules = view._modules
        self._parameters = view._parameters
        self._buffers = view._buffers
        self.model_name = model_name
        self.kind = kind
        self.stream_to = stream_to  # the compute device when the blocks are streamed there each step
        # RoPE tables depend only on the sequence's layout: made once per sampling run, not per step
        self._rope: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._patch_notes: set[str] = set()  # what model_patches.check_patches has said once already

    @property
    def dtype(self) -> torch.dtype:  # model_base.get_dtype() reads it
        return self.transformer.dtype

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, y: Any = None,
                guidance: Any = None, ref_latents: list | None = None, control: Any = None,
                transformer_options: dict | None = None, **kwargs: Any) -> torch.Tensor:
        # Positional, in Flux.forward's order: wrappers such as EasyCache's read args[0] and args[-1].
        options = {} if transformer_options is None else transformer_options
        return host.run_diffusion_model_wrappers(self._forward, self, options, x, timestep, context, y, guidance,
                                                 ref_latents, control, options, **kwargs)

    def _check_context(self, context: torch.Tensor) -> None:
        want = self.transformer.config.context_dim
        got = context.shape[-1]
        if got == want:
            return
        made = variant_for_text_width(got)
        made_by = f"{made.encoder} ({made.name})" if made else f"an encoder with width {got} (not a Klein Qwen3 one)"
        raise ValueError(
            f"{NODE}: the conditioning is {got} wide, made by {made_by}, but the model {self.model_name} takes "
            f"{want}-wide conditioning from {encoder_for_text_width(want)}: encode the prompt with that "
            f"encoder ({ENCODER_NODE}, or CLIPLoader type flux2) for this model.")

    def _references(self, refs: list, batch: int, method: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Reference tokens ``[B, R, 128]`` and ids ``[R, 4]`` at RoPE times 10, 20, ... (index method)."""
        if self.kind == "kv":  # its references run as stored keys/values, which no core method expresses
            raise ValueError(f"{NODE}: the model {self.model_name} is Klein 9B-KV, whose references run in KV "
                             f"mode; the references from ReferenceLatent (method {method!r}) would run in the "
                             f"sequence instead, which this model is not made for. Edit with the Klein Sampler "
                             f"(reference_mode auto or kv), or use Klein 9B for ReferenceLatent edits.")
        if method not in REF_METHODS:
            raise ValueError(f"{NODE}: reference_latents method {method!r} is not supported by the Klein model "
                             f"{self.model_name}; use one of {', '.join(REF_METHODS)} (Edit Model Reference "
                             f"Method node).")
        toks, ids = [], []
        for k, ref in enumerate(refs, start=1):
            if ref.ndim != 4 or ref.shape[1] != self.transformer.config.in_channels:
                raise ValueError(f"{NODE}: reference latent {k} must be FLUX.2 latents [B, "
                                 f"{self.transformer.config.in_channels}, h, w], got {list(ref.shape)}.")
            toks.append(pack(ref).expand(batch, -1, -1) if ref.shape[0] == 1 else pack(ref))
            ids.append(position_ids(ref.shape[-2], ref.shape[-1], t=REF_TIME_OFFSET * k))
        return torch.cat(toks, dim=1), torch.cat(ids)

    def _forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, y: Any = None,
                 guidance: Any = None, ref_latents: list | None = None, control: Any = None,
                 transformer_options: dict | None = None, **kwargs: Any) -> torch.Tensor:
        tr = self.transformer
        b, c, h, w = x.shape
        if c != tr.config.in_channels:
            raise ValueError(f"{NODE}: the latent has {c} channels; FLUX.2 Klein takes {tr.config.in_channels} "
                             f"(EmptyFlux2LatentImage or VAEEncode with the FLUX.2 VAE).")
        self._check_context(context)
        options = transformer_options if transformer_options is not None else {}
        model_patches.check_patches(options, tr.config.depth, tr.config.depth_single, self.model_name, self._patch_notes)
        dtype, device = tr.dtype, (self.stream_to or tr.device)
        img = pack(x).to(device=device, dtype=dtype)
        img_ids = position_ids(h, w)
        zero_time = 0
        if ref_latents:
            method = kwargs.get("ref_latents_method", "index")
            ref_tok, ref_ids = self._references(list(ref_latents), b, method)
            img = torch.cat([img, ref_tok.to(device=device, dtype=dtype)], dim=1)
            img_ids = torch.cat([img_ids, ref_ids])
            zero_time = ref_tok.shape[1] if method == "index_timestep_zero" else 0
        # ComfyUI passes sigma in fp32; klein_core's sampler gives the model sigma*1000 round-tripped
        # through the model dtype, /1000 (SPEC §4.4): the same here, so bf16 runs match too.
        t = ((timestep.to(device=device, dtype=torch.float32) * 1000).to(dtype) / 1000).to(dtype)
        txt_ids = text_position_ids(context.shape[1])
        layout = (context.shape[1], h, w, tuple(r.shape[-2:] for r in ref_latents or ()), str(device))
        if self._rope is None or self._rope[0] != layout:
            ids = torch.cat([txt_ids, img_ids]).to(device)
            self._rope = (layout, rope_tables(ids, tr.config.axes_dim, tr.config.theta))  # as Flux2Transformer.rope
        inputs = dict(img=img, img_ids=img_ids, txt=context.to(device=device, dtype=dtype), txt_ids=txt_ids,
                      timesteps=t.expand(b) if t.numel() == 1 else t, rope=self._rope[1],
                      zero_time_tokens=zero_time)
        runner = model_patches.FluxPatches.of(options, control, self.model_name)
        if runner is not None:  # ComfyUI's block / attention patches, ControlNet residuals
            inputs["blocks_runner"] = runner
        if self.stream_to is None:
            out = tr(**inputs)
        else:  # the memory plan the loader asked for: blocks streamed in, as in the Klein Sampler
            with StagePlacer(self.stream_to, {"transformer": tr}, {"transformer": "blocks"}).stage("transformer") as m:
                out = m(**inputs)
        return unpack(out[:, : h * w], h, w).to(x.device)


def unet_config(cfg: TransformerConfig) -> dict:
    """ComfyUI's FLUX.2 ``unet_config`` for a Klein transformer of ``cfg`` (its sizes, FLUX.2's flags)."""
    return {"in_channels": cfg.in_channels, "out_channels": cfg.in_channels, "context_in_dim": cfg.context_dim,
            "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads, "depth": cfg.depth,
            "depth_single_blocks": cfg.depth_single, "axes_dim": list(cfg.axes_dim), "theta": cfg.theta,
            "patch_size": 1, "guidance_embed": False}


def bridge(model: KleinModel) -> Any:
    """The native MODEL for ``model``: its transformer (LoRAs applied, on its speed) in a Flux2 model_base."""
    with errors_named(NODE, "model", model.name):
        transformer = model.ref.get()
        base = model.ref
        while not isinstance(base, cache.ModelRef) and hasattr(base, "base"):  # a LoRA's ref: its base model's
            base = base.base
        source = base.get() if isinstance(base, cache.ModelRef) and base is not model.ref else transformer
    apply_speed(transformer, None, model.speed)
    compute = host.torch_device()
    streamed = model.memory in STREAMED_MODES
    diffusion = KleinDiffusionModel(transformer, model.name, model.kind, stream_to=compute if streamed else None,
                                    source_model=source)
    # Streamed: ComfyUI keeps the weights where they live (CPU memory) and samples there; each step
    # streams the blocks to the GPU. Otherwise ComfyUI loads the model whole onto the GPU.
    load_device = host.offload_device() if streamed else compute
    return host.native_flux2_model(diffusion, unet_config(transformer.config), transformer.dtype, load_device)


class KleinModelToMODEL(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinModelToMODEL",
            display_name=NODE,
            category="Klein/native",
            description="A Klein model as ComfyUI's own MODEL (FLUX.2), for KSampler, SamplerCustomAdvanced "
                        "(any sampler; Flux2Scheduler for Klein's schedule), CFGGuider and model patches such "
                        "as EasyCache. References come from ReferenceLatent (index method). With the "
                        "loader's memory_mode blocks or minimum the weights stay in CPU memory and the "
                        "blocks stream to the GPU each step (for cards smaller than the model); with the "
                        "other modes ComfyUI loads it whole onto the GPU.",
            inputs=[KleinModelType.Input("model", tooltip="From Klein Model Loader (or Klein LoRA Loader).")],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="A native FLUX.2 MODEL over the Klein weights.")],
        )

    @classmethod
    @notices.reported
    def execute(cls, model: KleinModel) -> io.NodeOutput:
        patcher = bridge(model)
        logger.info("%s: %s (%s) as a native FLUX.2 MODEL, %.1f MiB of weights", NODE, model.name,
                    model.config.variant, patcher.model_size() / 2**20)
        return io.NodeOutput(patcher)
