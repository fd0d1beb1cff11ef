"""Memory planner: estimate a request's peak device memory per stage and pick a placement plan.

Stages: ``text`` (text encoder), ``references`` (VAE encoder, one reference at a time), ``denoise``
(transformer) and ``decode`` (VAE decoder); a stage's peak is the weights on the device plus its
activations. :func:`estimate` is a pure function of the request and the component sizes;
:func:`choose_plan` picks the first placement, fastest first, whose peak fits the free memory:
everything resident; the VAE tiled; text encoder and transformer taking turns; the transformer's
blocks streamed from pinned CPU memory (:class:`~klein_core.memory.placement.BlockOffloader`); the
text encoder's layers streamed too, the VAE staged and smaller VAE tiles.

The activation formulas follow a meta-device trace (:mod:`klein_core.memory.trace`, checked by
tests/test_planner.py); CUDA allocator rounding and library workspaces are left to ``reserve_bytes``.
"""

from __future__ import annotations

import functools
import logging
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..models.qwen3 import Qwen3TextEncoder
from ..models.transformer import Flux2Transformer
from ..models.vae import Flux2VAE
from ..pipeline.request import indexed_device
from ..quant.fp8 import block_linear_names
from .placement import block_footprint, device_census, find_block_lists, module_bytes
from .tiling import TILE_SIDES, tile_overlap

logger = logging.getLogger(__name__)

GB = 1e9

# --- activation coefficients (bytes, 16-bit activations), from trace_activation_bytes ----------
# Transformer: the peak is inside a single-stream block, during RoPE on k: the fused linear1
# output (9 x hidden), the residual, q, and the float32 RoPE temporaries. Per token and hidden
# unit of every sequence in the (CFG-doubled) batch; Klein 4B and 9B both trace to 66.0.
TRANSFORMER_BYTES_PER_TOKEN_DIM = 66.0
# KV mode's reference pass (the references alone, batch 1), on top of the keys and values stored
# so far: Klein 4B traces to 82.35 with one, two and four 1024² references.
KV_REFERENCE_PASS_BYTES_PER_TOKEN_DIM = 83.0
# ref_mode "timestep_zero": the 9 modulation vectors of a block ([B, tokens, hidden] each) per token.
PER_TOKEN_MODULATION_VECTORS = 9
# Qwen3: inside a late layer's MLP, five hidden-size maps (the kept states 9 and 18, the residual,
# its norm, the attention output) and three intermediate-size ones (gate, up, their product);
# after layer 27 the three states and their concatenation (12 x hidden). Plus the boolean
# attention masks: the causal [L, L] and the per-prompt [B, 1, L, L].
TEXT_BYTES_PER_TOKEN_HIDDEN = 10
TEXT_BYTES_PER_TOKEN_INTER = 6
TEXT_BYTES_PER_TOKEN_CONCAT = 12
# VAE: within a resolution level the level's input stays alive (the caller holds it) while its
# ResNet blocks run; a block holds its input, GroupNorm output and SiLU output, and from the second
# block on also its first conv's output. So a level peaks at max(3 c_in, c_in + 4 c_out) maps of
# its resolution; in the full decoder that is the first full-resolution level (3 x 256 maps).

DEFAULT_RESERVE_BYTES = 768 * 1024**2  # allocator rounding, cuBLAS/cuDNN workspaces, fragmentation

Placement = str  # "resident" | "staged" | "blocks"
COMPONENTS = ("text_encoder", "transformer", "vae")
STAGES = {"text": "text_encoder", "references": "vae", "denoise": "transformer", "decode": "vae"}


# ---------------------------------------------------------------------------------------------
# Requests and component sizes


@dataclass(frozen=True)
class MemoryRequest:
    """What one generation asks for. Sizes in pixels (multiples of 16)."""

    width: int = 1024
    height: int = 1024
    references: tuple[tuple[int, int], ...] = ()  # (width, height) after preprocessing (<= 1 MP)
    batch: int = 1  # images generated together (prompts x batch size)
    cfg: bool = False  # classifier-free guidance: the transformer runs pos and neg in one batch
    text_length: int = 512  # Klein pads prompts to at least 512 tokens
    encode_text: bool = True  # False when the prompt embeddings are cached
    denoise: bool = True
    decode: bool = True
    activation_bytes: int = 2  # bf16/fp16 activations (a float32 component counts 4 itself: ModelSizes)
    reference_kv: bool = False  # KV mode: references run once alone; their keys/values stay stored
    text_batch: int | None = None  # texts the encoder runs at once (prompts, + the negative); None: batch
    text_activation_bytes: int | None = None  # 4: ComfyUI's float32 text activations; None: as the encoder
    per_token_modulation: bool = False  # ref_mode "timestep_zero": modulation vectors per token
    encoded: tuple[tuple[int, int], ...] = ()  # images VAE-encoded that join no sequence (an init image)

    def __post_init__(self) -> None:
        for name in ("width", "height"):
            v = getattr(self, name)
            if v < 16 or v % 16:
                raise ValueError(f"MemoryRequest.{name} must be a positive multiple of 16 pixels, got {v}")
        if self.batch < 1 or self.text_length < 1 or (self.text_batch is not None and self.text_batch < 1):
            raise ValueError(
                f"MemoryRequest.batch and text_length must be positive, got {self.batch}, {self.text_length}"
            )

    @property
    def image_tokens(self) -> int:
        return (self.width // 16) * (self.height // 16)

    @property
    def reference_tokens(self) -> int:
        return sum((w // 16) * (h // 16) for w, h in self.references)


@dataclass(frozen=True)
class ComponentSize:
    """Weight bytes of a component: ``total``; under block streaming ``nonblock`` stays on the
    device and ``blocks`` (each block's bytes, in forward order) pass through it."""

    total: int
    nonblock: int = 0
    blocks: tuple[int, ...] = ()
    block_params: int = 0  # the largest block's parameter count (what a per-layer cast copies)

    def streamed(self, prefetch: int = 1) -> int:
        """Bytes on the device while streaming: non-block weights + the largest run of
        ``prefetch + 1`` consecutive blocks (cyclic, since the next forward is prefetched)."""
        if not self.blocks:
            return self.total
        k = min(prefetch + 1, len(self.blocks))
        ring = self.blocks + self.blocks[: k - 1]
        return self.nonblock + max(sum(ring[i : i + k]) for i in range(len(self.blocks)))


@dataclass(frozen=True)
class ModelSizes:
    """The three components by config (plus each one's weight bytes and shape parameters).

    Build with :meth:`from_configs` (sizes counted on a meta-device model, for bf16 or fp8
    weights) or :meth:`from_modules` (bytes of the loaded tensors, fp8 layers included).
    """

    transformer: ComponentSize | None
    text_encoder: ComponentSize | None
    vae_encoder: ComponentSize | None
    vae_decoder: ComponentSize | None
    hidden: int = 0  # transformer width
    text_hidden: int = 0
    text_inter: int = 0
    context_dim: int = 0
    encoder_channels: tuple[int, ...] = ()
    decoder_channels: tuple[int, ...] = ()
    downscale: int = 16
    # Bytes per activation element of a component computing in float32 (4), by component
    # ("transformer", "text_encoder", "vae_encoder", "vae_decoder"); absent: the request's.
    activation_elem: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_configs(
        cls,
        transformer: Any | None = None,
        text_encoder: Any | None = None,
        vae: Any | None = None,
        *,
        transformer_precision: str = "bf16",
        text_precision: str = "bf16",
    ) -> ModelSizes:
        """Sizes from ``TransformerConfig`` / ``Qwen3Config`` / ``VAEConfig`` (any may be absent); ``*_precision`` is
        ``"bf16"`` or ``"fp8"`` (block Linear weights in float8, the rest bf16)."""
        tr = _meta_size(Flux2Transformer, transformer, transformer_precision) if transformer is not None else None
        te = _meta_size(Qwen3TextEncoder, text_encoder, text_precision) if text_encoder is not None else None
        enc = dec = None
        if vae is not None:
            enc, dec = _meta_vae_sizes(Flux2VAE, vae)
        return cls(
            transformer=tr, text_encoder=te, vae_encoder=enc, vae_decoder=dec,
            hidden=getattr(transformer, "hidden_size", 0), context_dim=getattr(transformer, "context_dim", 0),
            text_hidden=getattr(text_encoder, "hidden_size", 0),
            text_inter=getattr(text_encoder, "intermediate_size", 0),
            encoder_channels=tuple(getattr(vae, "block_channels", ())),
            decoder_channels=tuple(getattr(vae, "decoder_block_channels", ())),
            downscale=getattr(vae, "downscale", 16),
        )

    @classmethod
    def from_modules(cls, transformer: nn.Module | None = None, text_encoder: nn.Module | None = None,
                     vae: nn.Module | None = None) -> ModelSizes:
        """Sizes of loaded components (any of them may be absent), from the bytes their tensors occupy."""
        def size(m: nn.Module) -> ComponentSize:
            total, blocks, params = block_footprint(m)  # one walk (its docstring: host time per run)
            return ComponentSize(total, total - sum(blocks), blocks, params)

        dtypes = {"transformer": getattr(transformer, "dtype", None),
                  "text_encoder": _compute_dtype(text_encoder),
                  "vae_encoder": getattr(vae, "dtype", None),
                  "vae_decoder": getattr(vae, "decoder_dtype", None)}
        elems = {name: 4 for name, dtype in dtypes.items()
                 if dtype == torch.float32}

        enc = dec = None
        if vae is not None:
            enc = ComponentSize(module_bytes(vae.encoder) + module_bytes(vae.bn))
            dec = ComponentSize(module_bytes(vae.decoder) + module_bytes(vae.bn))
        tc = transformer.config if transformer is not None else None  # type: ignore[union-attr]
        qc = text_encoder.config if text_encoder is not None else None  # type: ignore[union-attr]
        vc = vae.config if vae is not None else None  # type: ignore[union-attr]
        return cls(
            transformer=size(transformer) if transformer is not None else None,
            text_encoder=size(text_encoder) if text_encoder is not None else None,
            vae_encoder=enc, vae_decoder=dec, hidden=getattr(tc, "hidden_size", 0),
            context_dim=getattr(tc, "context_dim", 0),
            text_hidden=getattr(qc, "hidden_size", 0), text_inter=getattr(qc, "intermediate_size", 0),
            encoder_channels=tuple(getattr(vc, "block_channels", ())),
            decoder_channels=tuple(getattr(vc, "decoder_block_channels", ())),
            downscale=getattr(vc, "downscale", 16), activation_elem=elems,
        )

    @property
    def vae(self) -> ComponentSize | None:
        if self.vae_encoder is None or self.vae_decoder is None:
            return None
        return ComponentSize(self.vae_encoder.total + self.vae_decoder.total)


def _compute_dtype(module: nn.Module | None) -> torch.dtype | None:
    """The dtype ``module`` computes in: that of its first floating-point parameter of 2 bytes or
    more (fp8 weights compute in their scale's dtype, not in fp8); None if it has none."""
    if module is None:
        return None
    floats = (p.dtype for p in module.parameters() if p.is_floating_point() and p.element_size() >= 2)
    return next(floats, None)


@functools.lru_cache(maxsize=16)
def _meta_size(cls: type, config: Any, precision: str) -> ComponentSize:
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    with torch.device("meta"):
        model = cls(config)
    fp8 = set(block_linear_names(model)) if precision == "fp8" else set()

    def nbytes(mod: nn.Module, prefix: str) -> int:
        total = 0
        for name, p in mod.named_parameters():
            layer = (prefix + name).rpartition(".")[0]
            # fp8 Linear: one byte a weight plus a float32 scale; everything else bf16.
            total += p.numel() + 4 if layer in fp8 and name.endswith("weight") else 2 * p.numel()
        return total

    blocks = []
    params = 0
    for lst in find_block_lists(model):
        lst_name = next(n for n, m in model.named_children() if m is lst)
        blocks += [nbytes(b, f"{lst_name}.{i}.") for i, b in enumerate(lst)]
        params = max([params, *(sum(p.numel() for p in b.parameters()) for b in lst)])
    total = nbytes(model, "")
    return ComponentSize(total, total - sum(blocks), tuple(blocks), params)


@functools.lru_cache(maxsize=8)
def _meta_vae_sizes(cls: type, config: Any) -> tuple[ComponentSize, ComponentSize]:
    with torch.device("meta"):
        model = cls(config)
    enc = sum(2 * p.numel() for p in model.encoder.parameters())
    dec = sum(2 * p.numel() for p in model.decoder.parameters())
    bn = 4 * 2 * config.latent_channels  # float32 running mean and variance
    return ComponentSize(enc + bn), ComponentSize(dec + bn)


# ---------------------------------------------------------------------------------------------
# Activation formulas


def transformer_activation_bytes(tokens: int, batch: int, hidden: int, text_tokens: int, context_dim: int,
                                 image_tokens: int, head_dim: int = 128, elem: int = 2) -> int:
    """Peak bytes a denoising step allocates for ``batch`` sequences of ``tokens`` tokens.

    Adds what the sampler keeps alive across the step: text features ``[batch, L, context]``,
    the RoPE tables (float32) and the latents / velocity in float32.
    """
    blocks = TRANSFORMER_BYTES_PER_TOKEN_DIM * batch * tokens * hidden * elem / 2
    sampler = (batch * text_tokens * context_dim * elem + 2 * tokens * head_dim * 4
               + 4 * batch * image_tokens * 128 * 4)
    return int(blocks + sampler)


def text_activation_bytes(length: int, batch: int, hidden: int, inter: int, elem: int = 2) -> int:
    """Peak bytes of a Qwen3 text-encoder forward: one layer's temporaries, the kept hidden states,
    and the boolean attention masks ``[B, 1, L, L]``."""
    per_token = max(TEXT_BYTES_PER_TOKEN_HIDDEN * hidden + TEXT_BYTES_PER_TOKEN_INTER * inter,
                    TEXT_BYTES_PER_TOKEN_CONCAT * hidden)
    return int(batch * length * per_token * elem / 2 + (batch + 1) * length * length)


def _level_peak(channels: Sequence[int], decoder: bool) -> float:
    """Elements per full-resolution pixel at the busiest resolution level (see the VAE note at
    the top): a level ``b`` has a quarter as many pixels as level ``b - 1``."""
    n = len(channels)
    best = 0.0
    for b in range(n):
        c_out = channels[b]
        if decoder:  # fed by the (upsampled) level below it, or by the mid block
            c_in = channels[min(b + 1, n - 1)]
        else:  # fed by conv_in, or by the (downsampled) level above it
            c_in = channels[max(b - 1, 0)]
        best = max(best, max(3 * c_in, c_in + 4 * c_out) / 4**b)
    return best


def vae_decode_activation_bytes(
    height: int, width: int, batch: int, channels: Sequence[int], elem: int = 2
) -> int:
    """Peak bytes of decoding ``batch`` images of ``height x width`` pixels (untiled)."""
    per_px = _level_peak(channels, decoder=True) + 3
    return int(batch * height * width * per_px * elem)


def vae_encode_activation_bytes(
    height: int, width: int, batch: int, channels: Sequence[int], elem: int = 2
) -> int:
    """Peak bytes of encoding ``batch`` images of ``height x width`` pixels (untiled)."""
    per_px = _level_peak(channels, decoder=False) + 3
    return int(batch * height * width * per_px * elem)


def tiled_decode_bytes(req: MemoryRequest, channels: Sequence[int], tile: int) -> int:
    """Peak bytes of :func:`~klein_core.memory.tiling.decode_tiled`: one tile's activations plus the
    float32 accumulator and weight map of the whole image."""
    side = 16 * tile
    one = vae_decode_activation_bytes(min(side, req.height), min(side, req.width), req.batch, channels,
                                      req.activation_bytes)
    return one + req.batch * req.height * req.width * (3 * 4 + 3 * 4) + req.height * req.width * 4


# ---------------------------------------------------------------------------------------------
# MemoryEstimate


@dataclass(frozen=True)
class StageEstimate:
    """One stage: the component it runs, its activation bytes untiled and per VAE tile size."""

    component: str
    activations: int
    tiled: Mapping[int, int] = field(default_factory=dict)  # decode tile -> activation bytes

    def activation_bytes(self, tile: int | None) -> int:
        return self.tiled.get(tile, self.activations) if tile is not None else self.activations


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-stage activation bytes and per-component weight bytes for one request."""

    request: MemoryRequest
    components: Mapping[str, ComponentSize]
    stages: Mapping[str, StageEstimate]

    def stage_peaks(self, plan: MemoryPlan) -> dict[str, int]:
        """Peak device bytes of each stage under ``plan``."""
        out = {}
        for stage, est in self.stages.items():
            on_device = 0
            for comp, size in self.components.items():
                placement = plan.placements.get(comp, "resident")
                if placement == "resident":
                    on_device += size.total
                elif comp == est.component:
                    on_device += size.streamed(plan.prefetch) if placement == "blocks" else size.total
            out[stage] = on_device + est.activation_bytes(plan.vae_tile)
        return out

    def peak(self, plan: MemoryPlan) -> int:
        return max(self.stage_peaks(plan).values(), default=0)


def estimate(request: MemoryRequest, components: ModelSizes) -> MemoryEstimate:
    """Estimate per-stage memory for ``request`` (pure: sizes and formulas only, no device)."""
    r = request

    def elem(component: str) -> int:  # bytes per activation element
        return max(r.activation_bytes, components.activation_elem.get(component, 0))

    comps: dict[str, ComponentSize] = {}
    if components.transformer is not None:
        comps["transformer"] = components.transformer
    if components.text_encoder is not None:
        comps["text_encoder"] = components.text_encoder
    if components.vae is not None:
        comps["vae"] = components.vae
    stages: dict[str, StageEstimate] = {}
    if r.encode_text and components.text_encoder is not None:
        te = components.text_encoder
        e = r.text_activation_bytes or elem("text_encoder")
        act = text_activation_bytes(r.text_length, r.text_batch or r.batch, components.text_hidden,
                                    components.text_inter, e)
        if r.text_activation_bytes and e * te.block_params > max(te.blocks, default=0):
            act += e * te.block_params  # each layer's weights cast to the activations' dtype while it runs
        stages["text"] = StageEstimate("text_encoder", act)
    encoded = r.references + r.encoded
    if encoded and components.vae is not None:
        enc, e = components.encoder_channels, elem("vae_encoder")
        # Images are encoded one at a time; the largest one sets the peak.
        act = max(vae_encode_activation_bytes(h, w, 1, enc, e) for w, h in encoded)
        tiled = {}
        for tile in TILE_SIDES:
            side = 16 * tile
            tiled[tile] = max(vae_encode_activation_bytes(min(h, side), min(w, side), 1, enc, e)
                              + h * w // 256 * 128 * 8 for w, h in encoded)
        stages["references"] = StageEstimate("vae", act, tiled)
    if r.denoise and components.transformer is not None:
        e, hidden = elem("transformer"), components.hidden
        seqs = r.batch * (2 if r.cfg else 1)
        kv = r.reference_kv and r.reference_tokens
        tokens = r.text_length + r.image_tokens + (0 if kv else r.reference_tokens)
        act = transformer_activation_bytes(tokens, seqs, hidden, r.text_length, components.context_dim,
                                           r.image_tokens, elem=e)
        if r.per_token_modulation:
            every = r.text_length + r.image_tokens + r.reference_tokens
            act += PER_TOKEN_MODULATION_VECTORS * seqs * every * hidden * e
        if kv:
            # The references' own pass (batch 1), then steps that join their stored keys and values to
            # each sequence's ([B, heads, L + N, head_dim] twice per block); the keys and values (2 x
            # tokens x hidden per block) stay stored throughout.
            act += 2 * seqs * (tokens + r.reference_tokens) * hidden * e
            ref_pass = int(KV_REFERENCE_PASS_BYTES_PER_TOKEN_DIM * r.reference_tokens * hidden * e / 2)
            stored = 2 * r.reference_tokens * hidden * len(components.transformer.blocks) * e
            act = max(act, ref_pass) + stored
        stages["denoise"] = StageEstimate("transformer", act)
    if r.decode and components.vae is not None:
        dec, e = components.decoder_channels, elem("vae_decoder")
        one = replace(r, batch=1, activation_bytes=e)  # the engine decodes one image at a time
        act = vae_decode_activation_bytes(r.height, r.width, 1, dec, e)
        stages["decode"] = StageEstimate("vae", act, {t: tiled_decode_bytes(one, dec, t) for t in TILE_SIDES})
    return MemoryEstimate(r, comps, stages)


# ---------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class MemoryPlan:
    """Where each component lives, and whether the VAE is tiled.

    ``placements[component]``: ``"resident"`` (on the device throughout), ``"staged"`` (on the
    device only for its own stages, see :func:`~klein_core.memory.placement.on_device`) or ``"blocks"``
    (blocks streamed during its stage, :class:`~klein_core.memory.placement.BlockOffloader`).
    ``vae_tile``: decode tile side in latent positions (encode tiles are 16x that in pixels), or
    None for untiled. ``reason`` is one line for the log.
    """

    placements: Mapping[str, Placement]
    vae_tile: int | None = None
    prefetch: int = 1
    name: str = "resident"
    peak_bytes: int = 0
    free_bytes: int = 0
    fits: bool = True
    reason: str = ""

    @property
    def vae_overlap(self) -> int | None:
        return tile_overlap(self.vae_tile) if self.vae_tile is not None else None


_R, _S, _B = "resident", "staged", "blocks"
# Fastest first. Staging the text encoder only helps if the transformer leaves the device during
# the text stage too, so the two are staged together. Streaming blocks costs PCIe bandwidth every
# step, so it comes after staging (which costs a copy only when the prompt is not cached).
PLACEMENT_ORDER: tuple[tuple[str, dict[str, Placement]], ...] = (
    ("resident", {"text_encoder": _R, "transformer": _R, "vae": _R}),
    ("swap text encoder and transformer", {"text_encoder": _S, "transformer": _S, "vae": _R}),
    ("stream transformer blocks", {"text_encoder": _S, "transformer": _B, "vae": _R}),
    ("stream all blocks", {"text_encoder": _B, "transformer": _B, "vae": _S}),
)
MODES = ("auto", "resident", "swap", "blocks", "minimum")
#: What ``vae_tile`` may pin (besides "auto", the planner's choice): None (never tiled: weights move
#: first) or one tile side in latent positions. A tiled decode is not exact (each tile's GroupNorms
#: see only that tile), so an image decoded whole on a large GPU and tiled on a small one differ;
#: pinning the tile makes them the same.
VAE_TILES: tuple[int | None, ...] = (None, *TILE_SIDES)


def check_vae_tile(vae_tile: object) -> int | str | None:
    """``vae_tile`` as given if it is "auto", None or one of :data:`~klein_core.memory.tiling.TILE_SIDES`
    (any integer type; not a bool); else a ValueError that lists them."""
    if vae_tile is None or (isinstance(vae_tile, str) and vae_tile == "auto"):
        return vae_tile
    if isinstance(vae_tile, numbers.Integral) and not isinstance(vae_tile, bool) and int(vae_tile) in TILE_SIDES:
        return int(vae_tile)
    raise ValueError(f"vae_tile must be 'auto', None (never tiled) or one of {', '.join(map(str, TILE_SIDES))} "
                     f"latent positions, got {vae_tile!r}")


def _candidates(mode: str, vae_tile: int | str | None = "auto") -> list[tuple[str, dict[str, Placement], int | None]]:
    if mode not in MODES:
        raise ValueError(f"memory mode must be one of {MODES}, got {mode!r}")
    vae_tile = check_vae_tile(vae_tile)
    out = []
    for i, (name, placements) in enumerate(PLACEMENT_ORDER):
        if mode != "auto" and i != MODES.index(mode) - 1:
            continue
        # Tiling down to 32 is cheaper than moving weights; tiles of 16 only in the last resort.
        tiles: tuple[int | None, ...] = (None, *TILE_SIDES[:-1]) + (TILE_SIDES[-1:] if i == len(PLACEMENT_ORDER) - 1 else ())
        if vae_tile != "auto":
            tiles = (vae_tile,)  # type: ignore[assignment]  # pinned: only the placement is searched
        out += [(name, placements, t) for t in tiles]
    return out


def choose_plan(
    est: MemoryEstimate, free_bytes: int, *, mode: str = "auto", reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    prefetch: int = 1, vae_tile: int | str | None = "auto", stay: frozenset[str] = frozenset(),
) -> MemoryPlan:
    """The fastest plan whose estimated peak fits ``free_bytes - reserve_bytes``.

    ``mode``: ``"auto"`` searches every placement in :data:`PLACEMENT_ORDER`; ``"resident"``,
    ``"swap"``, ``"blocks"`` or ``"minimum"`` fix the placement (the VAE may still be tiled).
    ``vae_tile``: ``"auto"`` tries each placement untiled, then in VAE tiles of 64 and 32 latents
    (16 only with everything streamed), before the next placement; None never tiles; a side of
    :data:`~klein_core.memory.tiling.TILE_SIDES` always tiles at that side (:data:`VAE_TILES`). If nothing fits, the plan with the smallest peak is
    returned with ``fits=False`` and a reason that says how much is missing. ``stay``:
    components already on the device, which run there whatever their placement (resident in
    every plan).
    """
    budget = free_bytes - reserve_bytes
    best: MemoryPlan | None = None
    resident = MemoryPlan({c: _R for c in est.components})
    resident_peak = est.peak(resident)
    for name, placements, tile in _candidates(mode, vae_tile):
        placements = {c: p for c, p in placements.items() if c in est.components}
        held = sorted(c for c in stay if placements.get(c, _R) != _R)
        if held:
            placements.update(dict.fromkeys(held, _R))
            name = f"{name} ({', '.join(c.replace('_', ' ') for c in held)} on the device already)"
        plan = MemoryPlan(placements, tile, prefetch, name)
        peak = est.peak(plan)
        plan = replace(plan, peak_bytes=peak, free_bytes=free_bytes, fits=peak <= budget)
        if plan.fits:
            return replace(plan, reason=_reason(est, plan, resident_peak, budget))
        if best is None or peak <= best.peak_bytes:  # ties: the later, more frugal plan
            best = plan
    assert best is not None
    instead = None
    if mode != "auto":  # a forced mode that does not fit: say which one would
        other = choose_plan(est, free_bytes, reserve_bytes=reserve_bytes, prefetch=prefetch,
                            vae_tile=vae_tile, stay=stay)
        instead = other.name if other.fits else None
    return replace(best, reason=_reason(est, best, resident_peak, budget, instead, stay))


def _reason(est: MemoryEstimate, plan: MemoryPlan, resident_peak: int, budget: int,
            instead: str | None = None, stay: frozenset[str] = frozenset()) -> str:
    peaks = est.stage_peaks(plan)
    if not peaks:
        return f"{plan.name}: nothing to run on the device"
    worst = max(peaks, key=peaks.__getitem__)
    tiling = f", VAE tiles of {plan.vae_tile} latents" if plan.vae_tile else ""
    head = f"{plan.name}{tiling}: estimated peak {plan.peak_bytes / GB:.2f} GB ({worst})"
    if not plan.fits:
        fix = (f"memory mode auto would fit ({instead}), or use fp8 weights" if instead is not None
               else "use fp8 weights")
        if stay:  # held on the device, they cannot be swapped or streamed
            held = " and ".join(c.replace("_", " ") for c in sorted(stay))
            fix = (f"load the {held} into CPU memory (held on the device, it can be neither swapped nor "
                   f"streamed), {fix}")
        return (f"{head} does not fit {budget / GB:.2f} GB usable ({plan.free_bytes / GB:.2f} GB free); "
                f"short by {(plan.peak_bytes - budget) / GB:.2f} GB: {fix}, a smaller size or fewer "
                "references")
    if plan.name == "resident" and not plan.vae_tile:
        return f"{head} fits {budget / GB:.2f} GB usable"
    return (f"{head} fits {budget / GB:.2f} GB usable; everything resident would need "
            f"{resident_peak / GB:.2f} GB")


def free_device_bytes(device: torch.device | str, modules: Sequence[nn.Module] = ()) -> int:
    """Memory a plan may use on ``device``: free memory reported by the driver, plus what
    PyTorch's allocator holds cached, plus what ``modules`` already occupy there (the estimate
    counts their weights itself). Queried now; CUDA only."""
    device = indexed_device(device)  # "cuda" is the current device; its modules' tensors say "cuda:N"
    return _unused_bytes(device) + device_census(modules, device)[1]


def _unused_bytes(device: torch.device) -> int:
    """:func:`free_device_bytes` without the modules: the driver's free memory and the allocator's cache."""
    if device.type != "cuda":
        raise ValueError(f"free_device_bytes needs a CUDA device, got {device}")
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)


MakeRoom = Callable[[int, torch.device], None]
"""A host's hook ``make_room(nbytes, device)``: free ``nbytes`` more on ``device`` (for example by
unloading the host's own models) without moving the components being planned."""


def plan_for(
    request: MemoryRequest,
    transformer: nn.Module | None = None,
    text_encoder: nn.Module | None = None,
    vae: nn.Module | None = None,
    *,
    device: torch.device | str = "cuda",
    mode: str = "auto",
    free_bytes: int | None = None,
    make_room: MakeRoom | None = None,
    vae_tile: int | str | None = "auto",
) -> MemoryPlan:
    """Plan a request for loaded components on ``device``: one estimate, one choice.

    ``free_bytes`` defaults to :func:`free_device_bytes` on CUDA; before measuring it,
    ``make_room`` (if given) is asked for what the fastest plan of ``mode`` needs beyond the
    components already there, so a host can unload its own models first. Other devices (CPU, MPS)
    have no memory to measure: ``"auto"`` keeps everything resident there, and a forced mode is
    applied as asked (the same placement code runs, with host-to-host copies). ``vae_tile``: see
    :func:`choose_plan`; a pinned tile applies on every device.
    """
    device = torch.device(device)
    if mode not in MODES:
        raise ValueError(f"memory mode must be one of {MODES}, got {mode!r}")
    vae_tile = check_vae_tile(vae_tile)
    est = estimate(request, ModelSizes.from_modules(transformer, text_encoder, vae))
    given = free_bytes is not None  # by the caller: its plan's reason says what fits it
    # A component held on the device runs there whatever its plan (StagePlacer.in_place): never
    # planned off it. (On the CPU, the tests' stand-in device, streaming a CPU model still runs.)
    named = [(c, m) for c, m in (("transformer", transformer), ("text_encoder", text_encoder), ("vae", vae))
             if m is not None]
    modules = [m for _, m in named]
    stay: frozenset[str] = frozenset()
    mine = 0  # bytes the components occupy on the device already
    if device.type != "cpu":
        # one walk of each (its docstring); a bare "cuda" is resolved only for CUDA tensors, so planning
        # for a GPU with a given free_bytes asks CUDA nothing
        held, mine = device_census(modules, device)
        stay = frozenset(c for (c, _), kept in zip(named, held) if kept)
    if free_bytes is None:
        if device.type != "cuda":
            if mode == "auto":
                tile = None if vae_tile == "auto" else vae_tile
                plan = MemoryPlan({c: "resident" for c in est.components}, tile, name="resident")  # type: ignore[arg-type]
                tiling = f", VAE tiles of {tile} latents (pinned)" if tile else ""
                reason = f"{device.type}: no memory planning, all resident{tiling}"
                return replace(plan, peak_bytes=est.peak(plan), reason=reason)
            free_bytes = 1 << 62
        else:
            # The hook gets the device with its index: a host compares it with its models' devices
            # ("cuda" != "cuda:0" in torch), and would free nothing for a bare "cuda".
            here = indexed_device(device)
            if make_room is not None:
                # the first candidate: its peak is the wish
                fastest = choose_plan(est, 1 << 62, mode=mode, vae_tile=vae_tile, stay=stay)
                wanted = fastest.peak_bytes + DEFAULT_RESERVE_BYTES - mine
                if wanted > 0:
                    make_room(wanted, here)
                    # A host's hook may load our components back onto the device (the nodes' hook has
                    # ComfyUI load every model it is handed): what they hold there is counted again.
                    mine = device_census(modules, here)[1]
            free_bytes = _unused_bytes(here) + mine  # free_device_bytes(device, modules)
    plan = choose_plan(est, free_bytes, mode=mode, vae_tile=vae_tile, stay=stay)
    if device.type != "cuda" and not given:
        tiling = f", VAE tiles of {plan.vae_tile} latents" if plan.vae_tile else ""
        plan = replace(plan, reason=f"{plan.name}{tiling}: forced mode on {device.type} (no memory to measure); "
                                    f"estimated peak {plan.peak_bytes / GB:.2f} GB")
    return plan


def weights_home(
    model: nn.Module, device: torch.device | str, *, mode: str = "auto", free_bytes: int | None = None,
    component: str = "transformer", request: MemoryRequest | None = None,
) -> torch.device:
    """Where a component's weights should live between runs: ``device`` when the plan for a typical
    request keeps it resident there, else the CPU (its stages then copy or stream it in).

    ``model`` may be meta_model (``load_transformer(path, device="meta")``): only its tensors'
    sizes and dtypes are read. ``free_bytes`` defaults to the free memory of ``device``.
    """
    device = torch.device(device)
    if mode not in MODES:
        raise ValueError(f"memory mode must be one of {MODES}, got {mode!r}")
    if device.type != "cuda":
        return device
    if mode != "auto":
        return device if mode == "resident" else torch.device("cpu")
    if request is None:  # a typical request whose stages use the component (a 1024² image)
        request = MemoryRequest(encode_text=component == "text_encoder", denoise=component == "transformer",
                                decode=component == "vae")
    sizes = ModelSizes.from_modules(**{component: model})
    if free_bytes is None:
        free_bytes = free_device_bytes(device)
    plan = choose_plan(estimate(request, sizes), free_bytes)
    where = plan.placements.get(component, "resident")
    logger.info("%s weights: %s (plan for a %dx%d image: %s)", component, "on " + str(device) if where ==
                "resident" else "in CPU memory", request.width, request.height, plan.reason)
    return device if where == "resident" else torch.device("cpu")


__all__ = [
    "MODES",
    "VAE_TILES",
    "check_vae_tile",
    "MakeRoom",
    "PLACEMENT_ORDER",
    "ComponentSize",
    "MemoryEstimate",
    "MemoryPlan",
    "MemoryRequest",
    "ModelSizes",
    "StageEstimate",
    "choose_plan",
    "estimate",
    "free_device_bytes",
    "plan_for",
    "weights_home",
    "text_activation_bytes",
    "transformer_activation_bytes",
    "vae_decode_activation_bytes",
    "vae_encode_activation_bytes",
]
