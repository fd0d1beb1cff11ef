"""The FLUX.2 Klein rectified-flow transformer (double- and single-stream blocks, 4-axis RoPE).

Module and parameter names follow the BFL / ComfyUI checkpoint layout
(``double_blocks.N.img_attn.qkv``...), so those files fill it without renaming; the diffusers
layout is mapped onto it by :mod:`klein_core.files.transformer_layout`. The config is inferred from
tensor shapes (:meth:`TransformerConfig.from_shapes`), never from file names. Build it with
:func:`klein_core.load_transformer`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..transfer import to_device
from .block_ops import PLAIN_OPS, BlockOps, QKPart
from .layers import rms_norm
from .transformer_math import NORM_EPS, ROPE_THETA, TIME_CHANNELS, modulate, rope_tables, timestep_embedding
from .variants import transformer_name


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
        return transformer_name(self.hidden_size, self.depth, self.depth_single, self.context_dim)

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
        return PLAIN_OPS.swiglu(x)


def _mlp(hidden: int, mlp_hidden: int) -> nn.Sequential:
    # Index 1 holds the parameterless activation so the linears are "N.0" and "N.2" as in BFL.
    return nn.Sequential(
        nn.Linear(hidden, 2 * mlp_hidden, bias=False), _SwiGLU(), nn.Linear(mlp_hidden, hidden, bias=False)
    )


def _run_mlp(mlp: nn.Sequential, x: torch.Tensor, ops: BlockOps) -> torch.Tensor:
    """``mlp(x)`` with its activation from ``ops`` (which may fuse it)."""
    return mlp[2](ops.swiglu(mlp[0](x)))


class _Modulation(nn.Module):
    """Shared modulation: ``lin(SiLU(vec))`` split into ``n`` vectors ``[B, 1, D]``."""

    def __init__(self, hidden: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(hidden, n * hidden, bias=False)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.n, dim=-1)


def _with_reference(k: torch.Tensor, v: torch.Tensor,
                    kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, H, L, D]`` followed by the stored reference ones ``[1 or B, H, N, D]``
    (attention does not depend on the order of the keys)."""
    rk, rv = kv
    b = k.shape[0]
    return (torch.cat([k, rk.to(k.dtype).expand(b, -1, -1, -1)], dim=2),
            torch.cat([v, rv.to(v.dtype).expand(b, -1, -1, -1)], dim=2))


@dataclass(frozen=True)
class ReferenceKV:
    """The references' keys and values of every block (KV mode): computed once from the reference
    tokens alone, then joined to the keys at every step. ``double``/``single``: one ``(k, v)``
    ``[1, H, N, D]`` per block; ``tokens``: N."""

    double: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    single: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    tokens: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in (*self.double, *self.single) for t in pair)


def kv_bytes(config: TransformerConfig, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes the stored references' keys and values take: 2 x tokens x hidden per block."""
    return 2 * tokens * config.hidden_size * (config.depth + config.depth_single) * dtype_bytes


def _per_token(main: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], n_main: int,
               n_ref: int, before: int = 0) -> tuple[torch.Tensor, ...]:
    """Modulation vectors ``[B, 1, D]`` made per token ``[B, before + n_main + n_ref, D]``: the last
    ``n_ref`` tokens take ``ref``'s (the "timestep zero" reference mode)."""
    out = []
    for m, r in zip(main, ref):
        b, _, d = m.shape
        out.append(torch.cat([m.expand(b, before + n_main, d), r.expand(b, n_ref, d)], dim=1))
    return tuple(out)


_FP16_MAX = 65504.0


def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    """Clamp an fp16 residual stream to the largest finite fp16 value, as diffusers and BFL do after
    the double blocks' text stream and every single block: an overflow there would otherwise turn
    into inf, then NaN in the next LayerNorm, and poison every token through the joint attention.
    Other dtypes pass through untouched (no extra op)."""
    return x.clamp(-_FP16_MAX, _FP16_MAX) if x.dtype == torch.float16 else x


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
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = mod_img
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = mod_txt
        iq, ik, iv = self.img_attn.split_heads(ops.modulate(img, i_shift1, i_scale1))
        tq, tk, tv = self.txt_attn.split_heads(ops.modulate(txt, t_shift1, t_scale1))
        # Joint attention over [txt, img]; RoPE tables are laid out in the same order.
        q, k = ops.qk_norm_rope([self.txt_attn.qk_part(tq, tk), self.img_attn.qk_part(iq, ik)], cos, sin)
        v = torch.cat([tv.transpose(1, 2), iv.transpose(1, 2)], dim=2)
        if kv is not None:  # stored reference keys/values join the keys (KV mode)
            k, v = _with_reference(k, v, kv)
        out = ops.attention(q, k, v)
        n_txt = txt.shape[1]
        txt = ops.gated_residual(txt, t_gate1, self.txt_attn.proj(out[:, :n_txt]))
        img = ops.gated_residual(img, i_gate1, self.img_attn.proj(out[:, n_txt:]))
        img = ops.gated_residual(img, i_gate2, _run_mlp(self.img_mlp, ops.modulate(img, i_shift2, i_scale2), ops))
        txt = ops.gated_residual(txt, t_gate2, _run_mlp(self.txt_mlp, ops.modulate(txt, t_shift2, t_scale2), ops))
        return img, _clip_fp16(txt)

    def reference(
        self, ref: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mod: tuple[torch.Tensor, ...],
        ops: BlockOps = PLAIN_OPS,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference tokens' own pass (KV mode): they attend only among themselves, through the
        image stream. Returns the new tokens and their keys and values ``[B, H, N, D]``."""
        shift1, scale1, gate1, shift2, scale2, gate2 = mod
        q, k, v = self.img_attn.split_heads(ops.modulate(ref, shift1, scale1))
        q, k = ops.qk_norm_rope([self.img_attn.qk_part(q, k)], cos, sin)
        v = v.transpose(1, 2)
        ref = ops.gated_residual(ref, gate1, self.img_attn.proj(ops.attention(q, k, v)))
        ref = ops.gated_residual(ref, gate2, _run_mlp(self.img_mlp, ops.modulate(ref, shift2, scale2), ops))
        return ref, k, v


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
        ops: BlockOps = PLAIN_OPS, kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self._run(x, cos, sin, mod, ops, kv)[0]

    def reference(
        self, ref: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mod: tuple[torch.Tensor, ...],
        ops: BlockOps = PLAIN_OPS,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference tokens' own pass (KV mode): new tokens, keys and values ``[B, H, N, D]``."""
        return self._run(ref, cos, sin, mod, ops, None)

    def _run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mod: tuple[torch.Tensor, ...],
        ops: BlockOps, kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shift, scale, gate = mod
        qkv, mlp = self.linear1(ops.modulate(x, shift, scale)).split(
            [3 * self.hidden, 2 * self.mlp_hidden], dim=-1
        )
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)) for t in qkv.chunk(3, dim=-1))
        q, k = ops.qk_norm_rope([(q, k, self.norm.query_norm.scale, self.norm.key_norm.scale)], cos, sin)
        v = v.transpose(1, 2)
        keys, values = _with_reference(k, v, kv) if kv is not None else (k, v)
        attn = ops.attention(q, keys, values)
        out = ops.gated_residual(x, gate, self.linear2(ops.attention_and_mlp(attn, mlp)))
        return _clip_fp16(out), k, v


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
        return self.linear(modulate(x, shift, scale))


@dataclass(frozen=True)
class BlockStack:
    """The blocks of one forward and what they share (RoPE tables, modulation, ops, stored reference
    keys/values), so a :class:`StepCacheHook` can run them piecewise. Image tokens are ``[B, N, D]``,
    text tokens ``[B, L, D]``."""

    model: Flux2Transformer
    cos: torch.Tensor
    sin: torch.Tensor
    mod_img: tuple[torch.Tensor, ...]
    mod_txt: tuple[torch.Tensor, ...]
    mod_single: tuple[torch.Tensor, ...]
    ops: BlockOps
    kv: ReferenceKV | None

    def double(self, i: int, x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Double block ``i``: image and text tokens in, both updated out."""
        kv = self.kv.double[i] if self.kv is not None else None
        return self.model.double_blocks[i](x, c, self.cos, self.sin, self.mod_img, self.mod_txt, self.ops, kv)

    def single(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Single block ``i``: the joint tokens ``[B, L + N, D]`` (text first) in, updated out."""
        kv = self.kv.single[i] if self.kv is not None else None
        return self.model.single_blocks[i](h, self.cos, self.sin, self.mod_single, self.ops, kv)

    def run(self, x: torch.Tensor, c: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Double blocks ``start``.. then every single block: the image tokens after the last one."""
        for i in range(start, len(self.model.double_blocks)):
            x, c = self.double(i, x, c)
        n_txt = c.shape[1]
        h = torch.cat([c, x], dim=1)
        for i in range(len(self.model.single_blocks)):
            h = self.single(i, h)
        return h[:, n_txt:]


BlocksRunner = Callable[[BlockStack, torch.Tensor, torch.Tensor], torch.Tensor]
"""What :meth:`Flux2Transformer.forward` may be given as ``blocks_runner``: ``(blocks, x [B, N, D],
c [B, L, D]) -> x`` runs the blocks in place of :meth:`BlockStack.run` (a host's per-block patches,
such as ComfyUI's block replacements), returning the image tokens after the last single block."""


class StepCacheHook(Protocol):
    """What :attr:`Flux2Transformer.step_cache` holds (:mod:`klein_core.accel.step_cache`)."""

    def start_run(self, steps: int, noisy_tokens: int) -> None: ...

    def run(
        self, blocks: BlockStack, x: torch.Tensor, c: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor: ...


class Flux2Transformer(nn.Module):
    """FLUX.2 Klein transformer. Build with :func:`load_transformer`; call with keyword arguments.

    Inputs: ``img [B, N, 128]`` (noisy tokens, then any reference tokens), ``img_ids [N, 4]`` or
    ``[B, N, 4]`` rows ``(t, h, w, l)``, ``txt [B, L, context_dim]``, ``txt_ids [L, 4]`` or
    ``[B, L, 4]``, ``timesteps [B]`` = sigma in [0, 1]. Returns the velocity ``[B, N, 128]`` for
    every image token passed in.
    """

    # The model reads its dtype and device from these layers: loaders keep them plain nn.Linear
    # (never a quantised layer), whatever the file stores.
    plain_layers: tuple[str, ...] = ("img_in",)

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        # Replaceable block steps (attention, QK-norm + RoPE, modulation); klein_core.accel swaps
        # in kernels. Not a submodule: it holds no weights and never enters the state dict.
        self.ops: BlockOps = PLAIN_OPS
        # Opt-in step cache (klein_core.accel.step_cache): may reuse the later blocks' residual from
        # an earlier step. None = every block runs every forward.
        self.step_cache: StepCacheHook | None = None
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
        ids = to_device(torch.cat([txt_ids, img_ids], dim=-2), self.device)
        return rope_tables(ids, self.config.axes_dim, self.config.theta)

    def _check_inputs(
        self, img: torch.Tensor, img_ids: torch.Tensor, txt: torch.Tensor, txt_ids: torch.Tensor, t: torch.Tensor
    ) -> None:
        cfg = self.config
        if img.ndim != 3 or img.shape[-1] != cfg.in_channels:
            raise ValueError(f"img must be [B, N, {cfg.in_channels}], got {list(img.shape)}")
        # Shapes only: what the embeddings are and where they came from is checked once per run
        # (klein_core.pipeline.inputs.check_denoise_inputs); this turns a direct call's opaque matmul error
        # into a clear one.
        if txt.ndim != 3 or txt.shape[-1] != cfg.context_dim:
            raise ValueError(f"txt must be [B, L, {cfg.context_dim}] (this {cfg.variant} transformer expects "
                             f"{cfg.context_dim} wide embeddings), got {list(txt.shape)}")
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
        kv: ReferenceKV | None = None,
        zero_time_tokens: int = 0,
        blocks_runner: BlocksRunner | None = None,
    ) -> torch.Tensor:
        """``kv``: stored reference keys/values (:meth:`reference_kv`), joined to every block's keys
        (KV mode; the references are then not in ``img``). ``zero_time_tokens``: the last that many
        tokens of ``img`` (the references) are modulated as at timestep 0 instead of the current one
        (ComfyUI's "index_timestep_zero" reference method); 0 = every token at the current timestep.
        ``blocks_runner``: runs the blocks instead of :meth:`BlockStack.run` (see :data:`BlocksRunner`);
        not together with a step cache, which runs them its own way.
        """
        self._check_inputs(img, img_ids, txt, txt_ids, timesteps)
        dtype = self.dtype
        img = img.to(dtype)
        txt = txt.to(dtype)
        vec = self._time_vector(timesteps, img.shape[0], img.device)
        mod_img = self.double_stream_modulation_img(vec)
        mod_txt = self.double_stream_modulation_txt(vec)
        mod_single = self.single_stream_modulation(vec)
        if zero_time_tokens:
            if not 0 < zero_time_tokens <= img.shape[1]:
                raise ValueError(f"zero_time_tokens must be from 0 to {img.shape[1]}, got {zero_time_tokens}")
            vec0 = self._time_vector(torch.zeros_like(timesteps), img.shape[0], img.device)
            n_main = img.shape[1] - zero_time_tokens
            mod_img = _per_token(mod_img, self.double_stream_modulation_img(vec0), n_main, zero_time_tokens)
            mod_single = _per_token(mod_single, self.single_stream_modulation(vec0), n_main, zero_time_tokens,
                                    before=txt.shape[1])
        if kv is not None and (len(kv.double), len(kv.single)) != (len(self.double_blocks), len(self.single_blocks)):
            raise ValueError("the stored reference keys/values were made by a transformer with other blocks")

        cos, sin = rope if rope is not None else self.rope(txt_ids, img_ids)
        ops = self.ops.bind(img.device, dtype)
        blocks = BlockStack(self, cos, sin, mod_img, mod_txt, mod_single, ops, kv)
        # The embeddings go straight in, never into locals here: a local would keep them alive while
        # every block runs (the planner's activation formula, checked against a trace, counts on it).
        if blocks_runner is not None:
            if self.step_cache is not None:
                raise ValueError("blocks_runner cannot run with a step cache enabled (it runs the blocks its own "
                                 "way): disable the step cache on this transformer first")
            x = blocks_runner(blocks, self.img_in(img), self.txt_in(txt))
        elif self.step_cache is None:
            x = blocks.run(self.img_in(img), self.txt_in(txt))
        else:
            x = self.step_cache.run(blocks, self.img_in(img), self.txt_in(txt), timesteps)
        return self.final_layer(x, vec)

    def _time_vector(self, timesteps: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
        # The references feed sigma*1000 to the embedder after a round trip through the model
        # dtype (bf16 pipelines see [1000, 968, 908, 768] for the 4-step schedule).
        t = timesteps.to(device=device, dtype=self.dtype) * 1000
        vec = self.time_in(timestep_embedding(t).to(self.dtype))
        return vec.expand(batch, -1) if vec.shape[0] != batch else vec

    @torch.no_grad()
    def reference_kv(self, ref: torch.Tensor, ref_ids: torch.Tensor, *, timestep: float = 0.0) -> ReferenceKV:
        """The references' keys and values for KV mode (Klein 9B-KV): the reference tokens ``[1, N,
        128]`` at positions ``ref_ids [N, 4]`` run alone through every block, modulated at
        ``timestep`` (0, as BFL's KV model), attending only among themselves.

        What this returns depends only on the weights and the references, never on the prompt, the
        noise or the step, so one result serves every step and every later run with the same
        references (see :class:`klein_core.pipeline.reference_kv.ReferenceKVCache`).
        """
        if ref.ndim != 3 or ref.shape[-1] != self.config.in_channels:
            raise ValueError(f"reference tokens must be [B, N, {self.config.in_channels}], got {list(ref.shape)}")
        if ref_ids.shape[-2] != ref.shape[1]:
            raise ValueError(f"reference ids {list(ref_ids.shape)} do not match {ref.shape[1]} reference tokens")
        dtype = self.dtype
        ref = ref.to(device=self.device, dtype=dtype)
        vec = self._time_vector(torch.full((1,), float(timestep), device=ref.device), ref.shape[0], ref.device)
        mod_img = self.double_stream_modulation_img(vec)
        mod_single = self.single_stream_modulation(vec)
        cos, sin = rope_tables(to_device(ref_ids, self.device), self.config.axes_dim, self.config.theta)
        ops = self.ops.bind(ref.device, dtype)
        x = self.img_in(ref)
        double, single = [], []
        for block in self.double_blocks:
            x, k, v = block.reference(x, cos, sin, mod_img, ops)
            double.append((k.contiguous(), v.contiguous()))
        for block in self.single_blocks:
            x, k, v = block.reference(x, cos, sin, mod_single, ops)
            single.append((k.contiguous(), v.contiguous()))
        return ReferenceKV(tuple(double), tuple(single), ref.shape[1])
