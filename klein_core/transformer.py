"""The FLUX.2 Klein rectified-flow transformer (double- and single-stream blocks, 4-axis RoPE).

Parameter names follow the BFL / ComfyUI checkpoint layout (``double_blocks.N.img_attn.qkv``...),
so those files load without renaming; the diffusers layout is mapped onto it by
:func:`diffusers_to_bfl`. Sizes are inferred from tensor shapes, never from file names.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import attention, rms_norm
from .weights import Cat, LoadPlan, Op, SwapHalves, Take, WeightSource, materialize, open_weights

logger = logging.getLogger(__name__)

ROPE_THETA = 2000.0
TIME_CHANNELS = 256  # sinusoidal timestep embedding width
NORM_EPS = 1e-6

# (hidden, double blocks, single blocks, context width) -> published variant name
_VARIANTS = {
    (3072, 5, 20, 7680): "Klein 4B",
    (4096, 8, 24, 12288): "Klein 9B",
}
# Text width -> the Qwen3 encoder that produces it (3 x hidden of layers 9/18/27).
TEXT_ENCODER_FOR_WIDTH = {7680: "Qwen3-4B (qwen_3_4b.safetensors)", 12288: "Qwen3-8B (qwen_3_8b.safetensors)"}


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of a Flux2 transformer; built from tensor shapes by :meth:`from_shapes`."""

    hidden_size: int
    num_heads: int
    depth: int  # double-stream blocks
    depth_single: int  # single-stream blocks
    context_dim: int  # text feature width (txt_in input)
    mlp_hidden: int
    in_channels: int = 128
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)
    theta: float = ROPE_THETA

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden size {self.hidden_size} is not divisible by {self.num_heads} heads")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"RoPE axes {self.axes_dim} must sum to the head dim {self.head_dim}")
        if any(a % 2 for a in self.axes_dim):
            raise ValueError(f"RoPE axes {self.axes_dim} must be even")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def variant(self) -> str:
        key = (self.hidden_size, self.depth, self.depth_single, self.context_dim)
        return _VARIANTS.get(
            key, f"Flux2 (hidden {self.hidden_size}, {self.depth}+{self.depth_single} blocks)"
        )

    @property
    def text_dim(self) -> int:
        """Width of the text features this transformer expects (3 x the Qwen3 hidden size)."""
        return self.context_dim

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]]) -> TransformerConfig:
        """Infer the config from BFL-layout tensor shapes (no data needed)."""
        hidden, in_ch = shapes["img_in.weight"]
        context = shapes["txt_in.weight"][1]
        head_dim = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
        mlp_hidden = shapes["double_blocks.0.img_mlp.0.weight"][0] // 2
        depth = _count_blocks(shapes, "double_blocks")
        depth_single = _count_blocks(shapes, "single_blocks")
        if head_dim % 8:
            raise ValueError(f"head dim {head_dim} cannot be split into 4 even RoPE axes")
        return cls(
            hidden_size=hidden,
            num_heads=hidden // head_dim,
            depth=depth,
            depth_single=depth_single,
            context_dim=context,
            mlp_hidden=mlp_hidden,
            in_channels=in_ch,
            axes_dim=(head_dim // 4,) * 4,  # Flux2 splits the head evenly over (t, h, w, l)
        )


def _count_blocks(shapes: Mapping[str, tuple[int, ...]], prefix: str) -> int:
    idx = {int(m.group(1)) for k in shapes if (m := re.match(rf"{prefix}\.(\d+)\.", k))}
    if idx != set(range(len(idx))):
        raise ValueError(f"{prefix} indices are not contiguous: {sorted(idx)}")
    return len(idx)


# ---------------------------------------------------------------------------------------------
# Maths


def timestep_embedding(t: torch.Tensor, dim: int = TIME_CHANNELS, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``[cos | sin]`` of ``t`` (already x1000), in float32: ``[B] -> [B, dim]``."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t.float()[:, None] * torch.exp(exponent)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_cos_sin(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved 4-axis RoPE tables for position ids.

    ``ids``: ``[N, A]`` or ``[B, N, A]`` (A = len(axes_dim)). Returns cos and sin, float32,
    ``[N, head_dim]`` or ``[B, N, head_dim]``, each frequency repeated for its (2j, 2j+1) pair.
    Angles are computed in float64 (float32 on MPS, which has no float64), like the references.
    """
    f64 = torch.float32 if ids.device.type == "mps" else torch.float64
    pos = ids.to(torch.float32)
    cos, sin = [], []
    for a, d in enumerate(axes_dim):
        freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=f64, device=ids.device) / d))
        ang = pos[..., a : a + 1].to(f64) * freqs
        cos.append(ang.cos().repeat_interleave(2, dim=-1).float())
        sin.append(ang.sin().repeat_interleave(2, dim=-1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x`` ``[B, H, L, D]`` by the angles in ``cos``/``sin`` (fp32 maths)."""
    xf = x.float()
    x0, x1 = xf.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-x1, x0], dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (1 + scale) * F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) + shift


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    # [B, H, L, D] -> [B, L, H*D]
    return x.transpose(1, 2).flatten(2)


# One stream's share of the joint attention: (q, k, q_scale, k_scale), q/k [B, L_i, H, D].
QKPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class BlockOps:
    """The steps of a block that a fast path may replace (see :mod:`klein_core.fast`).

    These methods are the plain PyTorch path: the default, and the reference every fast path is
    tested against. A model holds one in :attr:`Flux2Transformer.ops`; :meth:`bind` runs once per
    forward, outside the blocks, so a subclass can pick backends for the call's device and dtype
    there (and keep that decision out of any compiled region).
    """

    def bind(self, device: torch.device, dtype: torch.dtype) -> BlockOps:
        """The ops to use for one forward on ``device`` in ``dtype``."""
        return self

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``(1 + scale) * LayerNorm(x) + shift``: x ``[B, L, D]``, shift/scale ``[B, 1, D]``."""
        return _modulate(x, shift, scale)

    def qk_norm_rope(
        self, parts: Sequence[QKPart], cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k, joined along the sequence, then RoPE.

        ``parts``: one ``(q, k, q_scale, k_scale)`` per stream in sequence order ([txt, img] in
        double blocks), q/k ``[B, L_i, H, D]`` (views of the projection), scales ``[D]``.
        ``cos``/``sin``: ``[1 or B, 1, sum(L_i), D]`` float32. Returns q, k ``[B, H, sum(L_i), D]``.
        """
        q = [rms_norm(p[0].transpose(1, 2), p[2], NORM_EPS) for p in parts]
        k = [rms_norm(p[1].transpose(1, 2), p[3], NORM_EPS) for p in parts]
        q_all = q[0] if len(q) == 1 else torch.cat(q, dim=2)
        k_all = k[0] if len(k) == 1 else torch.cat(k, dim=2)
        return apply_rope(q_all, cos, sin), apply_rope(k_all, cos, sin)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Unmasked attention, scale 1/sqrt(D): q/k/v ``[B, H, L, D]`` -> ``[B, L, H*D]``."""
        return _merge_heads(attention(q, k, v))


PLAIN_OPS = BlockOps()  # stateless, shared by every model that has no fast path enabled


# ---------------------------------------------------------------------------------------------
# Modules (names mirror the BFL checkpoint keys)


class _ScaleNorm(nn.Module):
    """RMSNorm whose weight is called ``scale`` (BFL's QK-norm naming)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale, NORM_EPS)


class _QKNorm(nn.Module):
    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.query_norm = _ScaleNorm(head_dim)
        self.key_norm = _ScaleNorm(head_dim)


class _Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.norm = _QKNorm(hidden // num_heads)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``x [B, L, hidden]`` to q, k, v ``[B, L, H, D]`` (views of one output, no copy)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return tuple(t.unflatten(-1, (self.num_heads, -1)) for t in (q, k, v))  # type: ignore[return-value]

    def qk_part(self, q: torch.Tensor, k: torch.Tensor) -> QKPart:
        return q, k, self.norm.query_norm.scale, self.norm.key_norm.scale


class _SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _mlp(hidden: int, mlp_hidden: int) -> nn.Sequential:
    # Index 1 holds the parameterless activation so the linears are "N.0" and "N.2" as in BFL.
    return nn.Sequential(
        nn.Linear(hidden, 2 * mlp_hidden, bias=False), _SwiGLU(), nn.Linear(mlp_hidden, hidden, bias=False)
    )


class _Modulation(nn.Module):
    """Shared modulation: ``lin(SiLU(vec))`` split into ``n`` vectors ``[B, 1, D]``."""

    def __init__(self, hidden: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(hidden, n * hidden, bias=False)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.n, dim=-1)


class DoubleStreamBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.img_attn = _Attention(cfg.hidden_size, cfg.num_heads)
        self.txt_attn = _Attention(cfg.hidden_size, cfg.num_heads)
        self.img_mlp = _mlp(cfg.hidden_size, cfg.mlp_hidden)
        self.txt_mlp = _mlp(cfg.hidden_size, cfg.mlp_hidden)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mod_img: tuple[torch.Tensor, ...],
        mod_txt: tuple[torch.Tensor, ...],
        ops: BlockOps = PLAIN_OPS,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = mod_img
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = mod_txt
        iq, ik, iv = self.img_attn.split_heads(ops.modulate(img, i_shift1, i_scale1))
        tq, tk, tv = self.txt_attn.split_heads(ops.modulate(txt, t_shift1, t_scale1))
        # Joint attention over [txt, img]; RoPE tables are laid out in the same order.
        q, k = ops.qk_norm_rope([self.txt_attn.qk_part(tq, tk), self.img_attn.qk_part(iq, ik)], cos, sin)
        out = ops.attention(q, k, torch.cat([tv.transpose(1, 2), iv.transpose(1, 2)], dim=2))
        n_txt = txt.shape[1]
        txt = txt + t_gate1 * self.txt_attn.proj(out[:, :n_txt])
        img = img + i_gate1 * self.img_attn.proj(out[:, n_txt:])
        img = img + i_gate2 * self.img_mlp(ops.modulate(img, i_shift2, i_scale2))
        txt = txt + t_gate2 * self.txt_mlp(ops.modulate(txt, t_shift2, t_scale2))
        return img, txt


class SingleStreamBlock(nn.Module):
    """Parallel block: one fused in-projection to [q | k | v | mlp gate | mlp up]."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.hidden = cfg.hidden_size
        self.mlp_hidden = cfg.mlp_hidden
        self.linear1 = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size + 2 * cfg.mlp_hidden, bias=False)
        self.linear2 = nn.Linear(cfg.hidden_size + cfg.mlp_hidden, cfg.hidden_size, bias=False)
        self.norm = _QKNorm(cfg.head_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mod: tuple[torch.Tensor, ...],
        ops: BlockOps = PLAIN_OPS,
    ) -> torch.Tensor:
        shift, scale, gate = mod
        qkv, mlp = self.linear1(ops.modulate(x, shift, scale)).split(
            [3 * self.hidden, 2 * self.mlp_hidden], dim=-1
        )
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)) for t in qkv.chunk(3, dim=-1))
        q, k = ops.qk_norm_rope([(q, k, self.norm.query_norm.scale, self.norm.key_norm.scale)], cos, sin)
        attn = ops.attention(q, k, v.transpose(1, 2))
        gate_mlp, up = mlp.chunk(2, dim=-1)
        return x + gate * self.linear2(torch.cat([attn, F.silu(gate_mlp) * up], dim=-1))


class _TimeEmbedder(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.in_layer = nn.Linear(TIME_CHANNELS, hidden, bias=False)
        self.out_layer = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class _FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden, bias=False))
        self.linear = nn.Linear(hidden, out_channels, bias=False)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, dim=-1)  # BFL order: shift first
        return self.linear(_modulate(x, shift, scale))


class Flux2Transformer(nn.Module):
    """FLUX.2 Klein transformer. Build with :func:`load_transformer`; call with keyword arguments.

    Inputs: ``img [B, N, 128]`` (noisy tokens, then any reference tokens), ``img_ids [N, 4]`` or
    ``[B, N, 4]`` rows ``(t, h, w, l)``, ``txt [B, L, context_dim]``, ``txt_ids [L, 4]`` or
    ``[B, L, 4]``, ``timesteps [B]`` = sigma in [0, 1]. Returns the velocity ``[B, N, 128]`` for
    every image token passed in.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        # Replaceable block steps (attention, QK-norm + RoPE, modulation); klein_core.fast swaps
        # in kernels. Not a submodule: it holds no weights and never enters the state dict.
        self.ops: BlockOps = PLAIN_OPS
        h = config.hidden_size
        self.img_in = nn.Linear(config.in_channels, h, bias=False)
        self.txt_in = nn.Linear(config.context_dim, h, bias=False)
        self.time_in = _TimeEmbedder(h)
        self.double_stream_modulation_img = _Modulation(h, 6)
        self.double_stream_modulation_txt = _Modulation(h, 6)
        self.single_stream_modulation = _Modulation(h, 3)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(config) for _ in range(config.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(config) for _ in range(config.depth_single))
        self.final_layer = _FinalLayer(h, config.in_channels)

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    def rope(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for the joint ``[txt, img]`` sequence, shaped to broadcast over heads.

        The tables depend only on the ids, so a sampler can compute them once per generation and
        pass them to :meth:`forward` as ``rope=`` instead of recomputing them every step.
        """
        if txt_ids.ndim != img_ids.ndim:
            if txt_ids.ndim == 2:
                txt_ids = txt_ids.expand(img_ids.shape[0], -1, -1)
            else:
                img_ids = img_ids.expand(txt_ids.shape[0], -1, -1)
        ids = torch.cat([txt_ids, img_ids], dim=-2).to(self.device)
        cos, sin = rope_cos_sin(ids, self.config.axes_dim, self.config.theta)
        # [N, D] -> [1, 1, N, D]; [B, N, D] -> [B, 1, N, D]
        return (cos[None, None], sin[None, None]) if cos.ndim == 2 else (cos[:, None], sin[:, None])

    def _check_inputs(
        self, img: torch.Tensor, img_ids: torch.Tensor, txt: torch.Tensor, txt_ids: torch.Tensor, t: torch.Tensor
    ) -> None:
        cfg = self.config
        if img.ndim != 3 or img.shape[-1] != cfg.in_channels:
            raise ValueError(f"img must be [B, N, {cfg.in_channels}], got {list(img.shape)}")
        if txt.ndim != 3 or txt.shape[-1] != cfg.context_dim:
            hint = TEXT_ENCODER_FOR_WIDTH.get(cfg.context_dim)
            raise ValueError(
                f"txt has width {txt.shape[-1] if txt.ndim == 3 else list(txt.shape)}, but this "
                f"{cfg.variant} transformer expects {cfg.context_dim}"
                + (f": encode the prompt with {hint}." if hint else ".")
            )
        if txt.shape[0] != img.shape[0]:
            raise ValueError(f"batch mismatch: img {img.shape[0]}, txt {txt.shape[0]}")
        for name, ids, n in (("img_ids", img_ids, img.shape[1]), ("txt_ids", txt_ids, txt.shape[1])):
            if ids.ndim not in (2, 3) or ids.shape[-2] != n or ids.shape[-1] != len(cfg.axes_dim):
                raise ValueError(f"{name} must be [{n}, {len(cfg.axes_dim)}] or [B, {n}, 4], got {list(ids.shape)}")
        if t.ndim != 1 or t.shape[0] not in (1, img.shape[0]):
            raise ValueError(f"timesteps must be [B] (B={img.shape[0]}), got {list(t.shape)}")

    def forward(
        self,
        *,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        self._check_inputs(img, img_ids, txt, txt_ids, timesteps)
        dtype = self.dtype
        img = img.to(dtype)
        txt = txt.to(dtype)
        # The references feed sigma*1000 to the embedder after a round trip through the model
        # dtype (bf16 pipelines see [1000, 968, 908, 768] for the 4-step schedule).
        t = timesteps.to(device=img.device, dtype=dtype) * 1000
        vec = self.time_in(timestep_embedding(t).to(dtype))
        if vec.shape[0] != img.shape[0]:
            vec = vec.expand(img.shape[0], -1)
        mod_img = self.double_stream_modulation_img(vec)
        mod_txt = self.double_stream_modulation_txt(vec)
        mod_single = self.single_stream_modulation(vec)

        cos, sin = rope if rope is not None else self.rope(txt_ids, img_ids)
        ops = self.ops.bind(img.device, dtype)
        x = self.img_in(img)
        c = self.txt_in(txt)
        for block in self.double_blocks:
            x, c = block(x, c, cos, sin, mod_img, mod_txt, ops)
        n_txt = c.shape[1]
        h = torch.cat([c, x], dim=1)
        for block in self.single_blocks:
            h = block(h, cos, sin, mod_single, ops)
        return self.final_layer(h[:, n_txt:], vec)


# ---------------------------------------------------------------------------------------------
# Checkpoint layouts

_BFL_MARKERS = ("double_stream_modulation_img.lin.weight", "single_stream_modulation.lin.weight")
_DIFFUSERS_MARKERS = ("double_stream_modulation_img.linear.weight", "single_stream_modulation.linear.weight")

_DIFFUSERS_GLOBAL = {
    "x_embedder.weight": "img_in.weight",
    "context_embedder.weight": "txt_in.weight",
    "time_guidance_embed.timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
    "time_guidance_embed.timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
    "double_stream_modulation_img.linear.weight": "double_stream_modulation_img.lin.weight",
    "double_stream_modulation_txt.linear.weight": "double_stream_modulation_txt.lin.weight",
    "single_stream_modulation.linear.weight": "single_stream_modulation.lin.weight",
    "proj_out.weight": "final_layer.linear.weight",
}
_DIFFUSERS_DOUBLE = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "ff.linear_in.weight": "img_mlp.0.weight",
    "ff.linear_out.weight": "img_mlp.2.weight",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "ff_context.linear_in.weight": "txt_mlp.0.weight",
    "ff_context.linear_out.weight": "txt_mlp.2.weight",
}
_DIFFUSERS_DOUBLE_QKV = {
    "img_attn.qkv.weight": ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"),
    "txt_attn.qkv.weight": ("attn.add_q_proj.weight", "attn.add_k_proj.weight", "attn.add_v_proj.weight"),
}
_DIFFUSERS_SINGLE = {
    "attn.to_qkv_mlp_proj.weight": "linear1.weight",
    "attn.to_out.weight": "linear2.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}


def _find_prefix(keys: list[str], markers: tuple[str, ...]) -> str | None:
    for k in keys:
        for m in markers:
            if k.endswith(m):
                return k[: -len(m)]
    return None


def _plan_bfl(src: WeightSource) -> LoadPlan:
    return LoadPlan(ops={k: Take(k) for k in src.keys()})


def diffusers_to_bfl(src: WeightSource) -> LoadPlan:
    """Plan that reads a diffusers ``Flux2Transformer2DModel`` state dict into BFL names.

    q/k/v projections are concatenated into the fused ``qkv``; the final layer's (scale, shift)
    halves are swapped back to BFL's (shift, scale). Keys that fit no rule are ``unexpected``.
    """
    plan = LoadPlan()
    used: set[str] = set()

    def add(name: str, op: Op) -> None:
        plan.ops[name] = op
        used.update(op.sources())

    keys = src.keys()
    for d, b in _DIFFUSERS_GLOBAL.items():
        if d in src:
            add(b, Take(d))
    if "norm_out.linear.weight" in src:
        add("final_layer.adaLN_modulation.1.weight", SwapHalves("norm_out.linear.weight"))
    doubles = sorted({int(m.group(1)) for k in keys if (m := re.match(r"transformer_blocks\.(\d+)\.", k))})
    for i in doubles:
        p = f"transformer_blocks.{i}."
        for d, b in _DIFFUSERS_DOUBLE.items():
            if p + d in src:
                add(f"double_blocks.{i}.{b}", Take(p + d))
        for b, parts in _DIFFUSERS_DOUBLE_QKV.items():
            if all(p + x in src for x in parts):
                add(f"double_blocks.{i}.{b}", Cat(tuple(p + x for x in parts)))
    singles = sorted({int(m.group(1)) for k in keys if (m := re.match(r"single_transformer_blocks\.(\d+)\.", k))})
    for i in singles:
        p = f"single_transformer_blocks.{i}."
        for d, b in _DIFFUSERS_SINGLE.items():
            if p + d in src:
                add(f"single_blocks.{i}.{b}", Take(p + d))
    plan.unexpected = [k for k in keys if k not in used]
    return plan


def bfl_to_diffusers(state: Mapping[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """A BFL-layout state dict (this module's names) in ``Flux2Transformer2DModel`` names.

    The exact inverse of :func:`diffusers_to_bfl`, from the same tables: ``qkv`` split into
    q/k/v (row views, no copy) and the final layer's (shift, scale) halves swapped to diffusers'
    (scale, shift). Used to export a model or to feed the same weights to diffusers.
    """
    out = {d: state[b] for d, b in _DIFFUSERS_GLOBAL.items()}
    shift, scale = state["final_layer.adaLN_modulation.1.weight"].chunk(2)
    out["norm_out.linear.weight"] = torch.cat([scale, shift])
    for i in range(config.depth):
        b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        out.update({d + dk: state[b + bk] for dk, bk in _DIFFUSERS_DOUBLE.items()})
        for bk, parts in _DIFFUSERS_DOUBLE_QKV.items():
            out.update(zip((d + x for x in parts), state[b + bk].split(config.hidden_size)))
    for i in range(config.depth_single):
        b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        out.update({d + dk: state[b + bk] for dk, bk in _DIFFUSERS_SINGLE.items()})
    return out


def _describe_other(keys: list[str]) -> str:
    """Guess what a file that is not a Flux2 transformer is, for the error message."""
    ks = set(keys)
    if any(k.endswith("double_blocks.0.img_mod.lin.weight") for k in ks):
        return "a FLUX.1 transformer (it has per-block modulation); Klein needs a FLUX.2 Klein file"
    if any("layers.0.self_attn.q_proj.weight" in k for k in ks):
        return "a text encoder (LLM); put it in text_encoders/ and pick a Klein transformer here"
    if any(k.endswith("decoder.conv_in.weight") for k in ks):
        return "a VAE; put it in vae/ and pick a Klein transformer here"
    if any("lora_" in k or k.endswith(".alpha") for k in ks):
        return "a LoRA; load it with a LoRA loader on top of a Klein transformer"
    if any(k.startswith(("model.diffusion_model.input_blocks", "input_blocks.")) for k in ks):
        return "a Stable Diffusion UNet checkpoint"
    return "not a FLUX.2 transformer"


def plan_transformer(src: WeightSource) -> tuple[LoadPlan, TransformerConfig, str, WeightSource]:
    """Detect the layout of ``src``, plan it into BFL names and infer the config.

    Returns ``(plan, config, layout, view)``: layout is ``"bfl"`` or ``"diffusers"`` and ``view``
    is ``src`` with any key prefix stripped (the source the plan reads from).
    """
    keys = src.keys()
    prefix = _find_prefix(keys, _BFL_MARKERS)
    if prefix is not None:
        view = src.strip_prefix(prefix)
        plan, layout = _plan_bfl(view), "bfl"
        # Keys outside the prefix (e.g. a VAE or text encoder bundled in an all-in-one
        # checkpoint) are not part of the transformer: report them rather than drop silently.
        others = [k for k in keys if not k.startswith(prefix)]
        if others:
            logger.warning(
                "%s: ignoring %d tensors outside the transformer prefix '%s' (e.g. %s)",
                src.name, len(others), prefix, others[0],
            )
        src = view
    else:
        prefix = _find_prefix(keys, _DIFFUSERS_MARKERS)
        if prefix is None:
            raise ValueError(f"{src.name}: not a FLUX.2 Klein transformer: it looks like {_describe_other(keys)}.")
        src = src.strip_prefix(prefix)
        plan, layout = diffusers_to_bfl(src), "diffusers"
    shapes = {k: op.shape(src) for k, op in plan.ops.items()}
    if any(k.startswith("guidance_in.") for k in shapes) or shapes.get("txt_in.weight", (0, 0))[1] == 15360:
        raise ValueError(
            f"{src.name}: this is a FLUX.2 [dev] transformer (guidance embedder, Mistral text width "
            "15360); klein_core runs FLUX.2 Klein 4B/9B. Pick flux-2-klein-4b or flux-2-klein-9b."
        )
    required = ("img_in.weight", "txt_in.weight", "double_blocks.0.img_attn.norm.query_norm.scale",
                "double_blocks.0.img_mlp.0.weight")
    absent = [k for k in required if k not in shapes]
    if absent:
        raise ValueError(f"{src.name}: incomplete FLUX.2 transformer, missing {absent}.")
    try:
        config = TransformerConfig.from_shapes(shapes)
    except ValueError as exc:
        raise ValueError(f"{src.name}: cannot infer the transformer size: {exc}") from None
    return plan, config, layout, src


def load_transformer(
    source: str | os.PathLike | Mapping[str, torch.Tensor] | WeightSource,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> Flux2Transformer:
    """Load a FLUX.2 Klein transformer from a BFL/ComfyUI or diffusers checkpoint.

    ``source``: a ``.safetensors`` file (keys optionally prefixed ``model.diffusion_model.``), a
    diffusers folder (``transformer/`` of a repo, sharded or not), or a state dict. The model is
    built on the meta device and filled from the file. ``dtype`` None keeps the stored dtype.
    ``quantize``: None keeps fp8 files in fp8 (block Linears as FP8Linear); "fp8" quantises a
    bf16 file's block Linears while loading; "dequantize" loads everything in ``dtype``.
    """
    src = open_weights(source, component="transformer", subfolder="transformer")
    plan, config, layout, view = plan_transformer(src)
    logger.info("%s: %s transformer (%s layout), text width %d", src.name, config.variant, layout, config.context_dim)
    model = materialize(
        lambda: Flux2Transformer(config), plan, view, component=f"{config.variant} transformer",
        device=device, dtype=dtype, quantize=quantize,
    )
    assert isinstance(model, Flux2Transformer)
    return model


def position_ids(height: int, width: int, t: int = 0) -> torch.Tensor:
    """Image token ids ``LongTensor[height*width, 4]``, rows ``(t, h, w, 0)`` in row-major order.

    ``height``/``width`` are in tokens (pixels / 16). References use t = 10, 20, ...
    """
    if height < 1 or width < 1:
        raise ValueError(f"position_ids needs a positive grid, got {height}x{width}")
    hh, ww = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.zeros(height * width, 4, dtype=torch.long)
    ids[:, 0] = t
    ids[:, 1] = hh.reshape(-1)
    ids[:, 2] = ww.reshape(-1)
    return ids


def text_position_ids(length: int) -> torch.Tensor:
    """Text token ids ``LongTensor[length, 4]``, rows ``(0, 0, 0, l)``."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids
