"""Switchboard for klein_core's fast paths: :func:`enable_fast_paths`, :func:`enable_fast_vae` and
:func:`disable_fast_paths`.

Models run the plain path (``klein_core.models.block_ops.BlockOps``, the reference every fast path is
checked against) until one of these, or a speed from :mod:`klein_core.accel.speed`, asks. Backends are
chosen on a model's first run per device and dtype (never at import) and logged in one line; what
cannot run falls back to the plain path with one warning (silently on the CPU). Global torch settings
are left alone. Attention backends (``attention=``): ``auto`` (by GPU from :data:`AUTO_ATTENTION`, else
``sdpa``; plain off CUDA); ``sdpa`` (SDPA's flash, then memory-efficient, then math kernels);
``sdpa_cudnn`` (SDPA preferring cuDNN); ``flash3`` (FlashAttention-3 package, Hopper, bf16/fp16);
``flash2`` (FlashAttention-2 package, Ampere+, bf16/fp16); ``plain`` (``models.layers.attention``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..models.block_ops import PLAIN_OPS, BlockOps, QKPart
from ..models.transformer import Flux2Transformer
from ..models.transformer_math import rope_tables
from ..models.vae import Flux2VAE, GroupNormAct
from .comfy_kitchen import (
    INSTALL_HINT,
    KitchenOps,
    group_norm_silu,
    kitchen_available,
    kitchen_serves_group_norm,
)
from .qk_norm_rope_grad import records_grad
from .triton_swiglu import swiglu as triton_swiglu
from .triton_swiglu import triton_available

logger = logging.getLogger(__name__)

SPEED_ATTR = "_klein_speed"  # set by klein_core.accel.speed.apply_speed on the models it switched
CUSTOM_SPEED = "custom"  # what the enable_* functions mark: switched by hand, not one of apply_speed's speeds
ATTENTION_BACKENDS = ("auto", "sdpa", "sdpa_cudnn", "flash3", "flash2", "plain")
_HALF = (torch.bfloat16, torch.float16)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SwiGLUFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]  # (x [..., 2F], out or None)


@dataclass(frozen=True)
class FastSettings:
    """What :func:`enable_fast_paths` was asked for (what actually runs: :meth:`FastOps.resolved`)."""

    attention: str = "auto"
    fused_rope: bool = True  # comfy-kitchen rms_rope: QK-RMSNorm + RoPE in one pass
    fused_modulation: bool = True  # comfy-kitchen adaln: LayerNorm + (1 + scale) * x + shift
    compile: bool = False  # torch.compile each block (Inductor then fuses norms and RoPE itself)
    # Gated residuals as one addcmul, SwiGLU as one kernel (Triton), the single blocks' concatenation
    # written in place (CUDA, not with compile: Inductor fuses these itself).
    fused_elementwise: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")


# ---------------------------------------------------------------------------------------------
# Attention backends: each maps q/k/v [B, H, L, D] (any strides, unit stride over D) to [B, L, H*D].


def _sdpa_backends(names: Sequence[str]) -> list[Any]:
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, n) for n in names]


def _make_sdpa(names: Sequence[str]) -> AttentionFn:
    from torch.nn.attention import sdpa_kernel

    backends = _sdpa_backends(names)
    # set_priority (torch >= 2.6) makes the list an order of preference, not just a set.
    kwargs = {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backends, **kwargs):
            out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).flatten(2)

    return attention


def _make_flash(fn: Callable[..., Any]) -> AttentionFn:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # flash-attn works on [B, L, H, D]; the transposes are views (the fused QK kernel already
        # writes q and k in that layout, so they are contiguous).
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if isinstance(out, tuple):  # some FlashAttention-3 releases return (out, lse)
            out = out[0]
        return out.flatten(2)

    return attention


def _import_flash(backend: str) -> Callable[..., Any] | None:
    module = "flash_attn_interface" if backend == "flash3" else "flash_attn"
    try:
        return getattr(importlib.import_module(module), "flash_attn_func")
    except (ImportError, AttributeError):
        return None


def _flash_unavailable(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``backend`` (flash3/flash2) cannot run here, or None if it can."""
    if device.type != "cuda":
        return f"it needs CUDA, not {device.type}"
    if dtype not in _HALF:
        return f"it supports bf16/fp16, not {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"head dim {head_dim} is not supported"
    major, minor = torch.cuda.get_device_capability(device)
    if backend == "flash3" and major != 9:
        return f"FlashAttention-3 needs a Hopper GPU (sm_90), this is sm_{major}{minor}"
    if backend == "flash2" and major < 8:
        return f"FlashAttention-2 needs sm_80 or newer, this is sm_{major}{minor}"
    if _import_flash(backend) is None:
        package = "flash_attn_interface (FlashAttention-3)" if backend == "flash3" else "flash_attn"
        return f"{package} is not installed"
    return None


# What ``attention="auto"`` runs on each CUDA architecture (compute capability major version): the
# backend that measured fastest there (docs/DESIGN.md); architectures not listed get ``sdpa``.
AUTO_ATTENTION: dict[int, str] = {9: "sdpa_cudnn"}


def auto_attention(device: torch.device) -> str:
    """The backend ``attention="auto"`` picks on ``device`` (see :data:`AUTO_ATTENTION`)."""
    if device.type != "cuda":
        return "plain"
    return AUTO_ATTENTION.get(torch.cuda.get_device_capability(device)[0], "sdpa")


def _resolve_attention(
    requested: str, device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[AttentionFn | None, str]:
    """``(function, name)`` for the attention to use; function None means the plain path.

    An explicitly requested backend that cannot run here gives one warning naming the reason and
    the replacement; ``auto`` picks silently (its choice is in the info line).
    """
    if requested == "auto":
        return _resolve_attention(auto_attention(device), device, dtype, head_dim)
    if requested == "plain":
        return None, "plain"
    why = None
    if requested in ("flash3", "flash2"):
        why = _flash_unavailable(requested, device, dtype, head_dim)
        if why is None:
            fn = _import_flash(requested)
            assert fn is not None
            return _make_flash(fn), requested
    elif device.type != "cuda":
        why = f"it needs CUDA, not {device.type}"
    if device.type != "cuda":
        fn, name = None, "plain"
    elif requested == "sdpa_cudnn":
        fn = _make_sdpa(["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"])
        name = "sdpa_cudnn"
    else:
        fn, name = _make_sdpa(["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]), "sdpa"
    if why is not None:
        logger.warning("attention=%r cannot run on %s (%s); using %s", requested, device, why, name)
    return fn, name


# ---------------------------------------------------------------------------------------------
# Ops


class _BoundOps(BlockOps):
    """The fast ops resolved for one device and dtype; each step falls back to the plain one.

    ``fused``: comfy-kitchen's steps (:class:`~klein_core.accel.comfy_kitchen.KitchenOps`, with only the
    ones that passed their checks switched on), or None for the plain norms and RoPE.
    """

    def __init__(
        self,
        attention_fn: AttentionFn | None,
        fused: KitchenOps | None,
        elementwise: bool = False,
        swiglu_fn: SwiGLUFn | None = None,
    ) -> None:
        self._attention_fn = attention_fn
        self._fused = fused
        self._elementwise = elementwise  # addcmul residuals, the single blocks' concat in place
        self._swiglu = swiglu_fn  # one-pass SwiGLU (only with elementwise), else silu then *

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self._fused is None:
            return super().modulate(x, shift, scale)
        return self._fused.modulate(x, shift, scale)

    def qk_norm_rope(
        self, parts: Sequence[QKPart], cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused is None:
            return super().qk_norm_rope(parts, cos, sin)
        return self._fused.qk_norm_rope(parts, cos, sin)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._attention_fn is None:
            return super().attention(q, k, v)
        return self._attention_fn(q, k, v)

    def gated_residual(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self._elementwise:
            return super().gated_residual(x, gate, y)
        return torch.addcmul(x, gate, y)  # one pass, the product kept in float32 before the sum

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        if self._swiglu is None or records_grad(x):  # the kernel has no backward
            return super().swiglu(x)
        return self._swiglu(x, None)

    def attention_and_mlp(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        if not self._elementwise or records_grad(attn, mlp):  # out= and the kernel have no backward
            return super().attention_and_mlp(attn, mlp)
        d = attn.shape[-1]
        out = attn.new_empty(*attn.shape[:-1], d + mlp.shape[-1] // 2)
        out[..., :d].copy_(attn)
        if self._swiglu is not None:
            self._swiglu(mlp, out[..., d:])
        else:
            gate, up = mlp.chunk(2, dim=-1)
            torch.mul(F.silu(gate), up, out=out[..., d:])
        return out


def _compare(fused: Sequence[torch.Tensor], plain: Sequence[torch.Tensor], dtype: torch.dtype) -> str | None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(fused, plain):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
        if not err <= tol:  # also catches NaN
            return f"its self-check is off by {err:.2e} (relative) against the plain path"
    return None


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _attention_self_check(
    fn: AttentionFn, device: torch.device, dtype: torch.dtype, head_dim: int
) -> str | None:
    """Run an attention backend once in the layouts the blocks use (q/k transposed views of
    [B, L, H, D] buffers, v a strided view of a fused projection) against the plain path."""
    g = torch.Generator(device=device).manual_seed(0)
    try:
        qkv = torch.randn(1, 37, 3, 2, head_dim, generator=g, device=device).to(dtype)
        q, k = (qkv[:, :, i].contiguous().transpose(1, 2) for i in (0, 1))
        v = qkv[:, :, 2].transpose(1, 2)
        return _compare([fn(q, k, v)], [PLAIN_OPS.attention(q, k, v)], dtype)
    except Exception as exc:  # a backend that fails here would fail inside every block
        return f"its self-check raised {_first_line(exc)}"


def _self_check(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, hidden: int) -> str | None:
    """Run one fused step once on small random data against the plain path.

    Returns why it cannot be trusted (it raised, or its result is off), or None. This guards
    against a GPU / comfy-kitchen combination it was never run on: such a step is switched off
    with a warning instead of producing wrong images. Once per device and dtype (one sync).
    """
    g = torch.Generator(device=device).manual_seed(0)
    try:
        if name == "qk-norm+rope":
            heads, lengths = 3, (5, 7)
            qkv = torch.randn(2, sum(lengths), 3, heads, head_dim, generator=g, device=device).to(dtype)
            scales = (1 + 0.1 * torch.randn(4, head_dim, generator=g, device=device)).to(dtype)
            streams = qkv.split(lengths, dim=1)
            parts = [(st[:, :, 0], st[:, :, 1], scales[2 * i], scales[2 * i + 1])
                     for i, st in enumerate(streams)]
            ids = torch.randint(0, 64, (sum(lengths), 1), generator=g, device=device)
            cos, sin = rope_tables(ids, (head_dim,), 2000.0)
            fused = KitchenOps(rope=True, modulation=False).qk_norm_rope(parts, cos, sin)
            plain = PLAIN_OPS.qk_norm_rope(parts, cos, sin)
        else:
            x = (torch.randn(2, 7, hidden, generator=g, device=device) * 3).to(dtype)
            mod = torch.randn(2, 1, 3 * hidden, generator=g, device=device).to(dtype)
            shift, scale, _ = mod.chunk(3, dim=-1)
            fused = (KitchenOps(rope=False, modulation=True).modulate(x, shift, scale),)
            plain = (PLAIN_OPS.modulate(x, shift, scale),)
        return _compare(fused, plain, dtype)
    except Exception as exc:  # a launch failure must not take the model down
        return f"its self-check raised {_first_line(exc)}"


# Devices whose fused steps go through comfy-kitchen. Not the CPU: there it runs its eager PyTorch
# code (docs/DESIGN.md) and the fast paths are for GPUs; the tests add "cpu" to run the wiring through it.
KITCHEN_DEVICES: tuple[str, ...] = ("cuda",)


class FastOps(BlockOps):
    """The ops :func:`enable_fast_paths` installs: resolves backends per (device, dtype) on first use."""

    def __init__(self, settings: FastSettings, head_dim: int, hidden: int) -> None:
        self.settings = settings
        self.head_dim = head_dim
        self.hidden = hidden
        self._bound: dict[tuple[str, int | None, torch.dtype], _BoundOps] = {}
        self._described: dict[str, str] = {}
        self._eager: FastOps | None = None  # without_compile's

    def bind(self, device: torch.device, dtype: torch.dtype) -> BlockOps:
        key = (device.type, device.index, dtype)
        ops = self._bound.get(key)
        if ops is None:
            ops = self._bound[key] = self._resolve(device, dtype)
        return ops

    def resolved(self) -> dict[str, str]:
        """What runs where, e.g. ``{"cuda:0 torch.bfloat16": "attention=flash3, ..."}``."""
        return dict(self._described)

    def compile_failed(self) -> None:
        """Compilation was given up (:func:`_compile_group`'s fallback): the blocks run eagerly, so
        resolve anew, with the fused kernels the fast path runs without Inductor (every model sharing
        these ops, LoRA copies included, falls back with its group)."""
        self.settings = dataclasses.replace(self.settings, compile=False)
        self._bound.clear()
        self._described.clear()

    def without_compile(self) -> FastOps:
        """These ops for an eager copy of a compiled model (the same choices, ``compile=False``): one
        for all its copies, so its kernels are chosen and checked once."""
        if not self.settings.compile:
            return self
        if self._eager is None:
            eager = dataclasses.replace(self.settings, compile=False)
            self._eager = FastOps(eager, self.head_dim, self.hidden)
        return self._eager

    def _kernel_choice(self, wanted: bool, name: str, device: torch.device, dtype: torch.dtype) -> bool:
        if not wanted:
            return False
        if self.settings.compile:  # Inductor fuses these itself; opaque kernels would only split graphs
            return False
        why = None
        if device.type not in KITCHEN_DEVICES:
            why = f"fused kernels are used on {'/'.join(KITCHEN_DEVICES)}, not {device.type}"
        elif not kitchen_available():
            why = f"comfy-kitchen is not installed; {INSTALL_HINT}"
        elif dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why = f"dtype {dtype} is not supported"
        else:
            why = _self_check(name, device, dtype, self.head_dim, self.hidden)
        if why is not None:
            # Off the kitchen's devices the plain path is simply what runs (no news); a failure on
            # a GPU is a warning.
            log = (logger.debug if device.type not in KITCHEN_DEVICES
                   else logger.warning if device.type == "cuda" else logger.info)
            log("fused %s unavailable on %s (%s); using the plain PyTorch path", name, device, why)
        return why is None

    def _resolve(self, device: torch.device, dtype: torch.dtype) -> _BoundOps:
        s = self.settings
        attention_fn, attention_name = _resolve_attention(s.attention, device, dtype, self.head_dim)
        if attention_fn is not None:
            failure = _attention_self_check(attention_fn, device, dtype, self.head_dim)
            if failure is not None:
                logger.warning("attention=%s on %s: %s; using the plain path",
                               attention_name, device, failure)
                attention_fn, attention_name = None, "plain"
        rope = self._kernel_choice(s.fused_rope, "qk-norm+rope", device, dtype)
        mod = self._kernel_choice(s.fused_modulation, "modulation", device, dtype)
        elementwise = s.fused_elementwise and not s.compile and device.type in KITCHEN_DEVICES
        swiglu_fn = _resolve_swiglu(device, dtype) if elementwise else None
        fused = "inductor" if s.compile else "comfy-kitchen"
        text = (f"attention={attention_name}, qk-norm+rope={fused if rope or s.compile else 'plain'}, "
                f"modulation={fused if mod or s.compile else 'plain'}, "
                f"elementwise={'inductor' if s.compile else 'fused' if elementwise else 'plain'}, "
                f"swiglu={'inductor' if s.compile else 'triton' if swiglu_fn else 'plain'}, compile={s.compile}")
        self._described[f"{device} {dtype}"] = text
        logger.info("klein fast paths on %s %s: %s", device, dtype, text)
        return _BoundOps(attention_fn, KitchenOps(rope=rope, modulation=mod) if rope or mod else None,
                         elementwise, swiglu_fn)


def _resolve_swiglu(device: torch.device, dtype: torch.dtype) -> SwiGLUFn | None:
    """The one-pass SwiGLU kernel if it can run here and agrees with the plain ops, else None (one
    warning on CUDA naming why; the two PyTorch ops run instead)."""
    why = None
    if device.type != "cuda":
        why = f"its kernel runs on CUDA, not {device.type}"
    elif not triton_available():
        why = "Triton is not installed (pip install triton; triton-windows on Windows)"
    else:
        why = _swiglu_self_check(device, dtype)
    if why is None:
        return triton_swiglu
    log = logger.warning if device.type == "cuda" else logger.debug
    log("one-pass SwiGLU unavailable on %s (%s); using silu then multiply", device, why)
    return None


def _swiglu_self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """The SwiGLU kernel once, in the layouts the single blocks use (a slice of a wider projection
    in, a slice of a wider buffer out), against the plain ops."""
    g = torch.Generator(device=device).manual_seed(0)
    try:
        wide = (torch.randn(2, 7, 40 + 2 * 1100, generator=g, device=device) * 3).to(dtype)
        x = wide[..., 40:]
        out = torch.zeros(2, 7, 24 + 1100, dtype=dtype, device=device)
        triton_swiglu(x, out[..., 24:])
        if out[..., :24].any():
            return "its self-check wrote outside its output"
        return _compare([out[..., 24:], triton_swiglu(x, None)], [PLAIN_OPS.swiglu(x)] * 2, dtype)
    except Exception as exc:  # a launch failure must not take the model down
        return f"its self-check raised {_first_line(exc)}"


# ---------------------------------------------------------------------------------------------
# The VAE's GroupNorms


def _group_norm_self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """comfy-kitchen's GroupNorm + SiLU once on small random data (two images, 32 groups of 8
    channels, an odd size) against the plain path; None when it agrees."""
    g = torch.Generator(device=device).manual_seed(0)
    try:
        x = (torch.randn(2, 256, 9, 13, generator=g, device=device) * 3 + 1).to(dtype)
        w = (1 + 0.1 * torch.randn(256, generator=g, device=device)).to(dtype)
        b = (0.1 * torch.randn(256, generator=g, device=device)).to(dtype)
        fused = [group_norm_silu(x, w, b, 32, 1e-6, silu) for silu in (True, False)]
        y = F.group_norm(x, 32, w, b, 1e-6)
        return _compare(fused, [F.silu(y), y], dtype)
    except Exception as exc:  # a launch failure must not take the decode down
        return f"its self-check raised {_first_line(exc)}"


class FastVAENorm:
    """What :func:`enable_fast_vae` installs as every VAE GroupNorm's ``fused`` step.

    On CUDA in bf16/fp16 with comfy-kitchen installed, GroupNorm and the SiLU after it run as one
    comfy-kitchen kernel (float32 statistics, channels-last out, so the convolutions after it run
    channels-last too); the choice is made on the first call per device and dtype, checked once
    against the plain path and logged. Elsewhere, and for widths the kernel does not take, the
    plain GroupNorm runs: silently off CUDA, with one warning on a GPU where the kernel cannot.
    When the kernel is chosen, the convolution weights of the parts that run it (:meth:`serve`) are
    stored channels-last too, so that cuDNN does not convert around every convolution (docs/speed.md,
    "The VAE"); a part compiled instead keeps the layout it was given.
    """

    def __init__(self) -> None:
        self._usable: dict[tuple[str, int | None, torch.dtype], bool] = {}
        self._parts: list[weakref.ref[torch.nn.Module]] = []

    def serve(self, part: torch.nn.Module) -> None:
        """Run ``part``'s (the encoder's or the decoder's) GroupNorms; channels-last at once when the
        kernel was already chosen on some device (a part fused after its compilation failed)."""
        if not any(ref() is part for ref in self._parts):
            self._parts.append(weakref.ref(part))
        _set_vae_norms(part, self)
        if any(self._usable.values()):
            part.to(memory_format=torch.channels_last)

    def __call__(self, norm: GroupNormAct, x: torch.Tensor) -> torch.Tensor | None:
        if records_grad(x, norm.weight, norm.bias):  # the kernel has no backward: the plain GroupNorm
            return None
        if not self._usable_for(x) or x.ndim != 4 or not kitchen_serves_group_norm(
                x.shape[1], norm.num_groups, x.shape[0]):
            return None
        return group_norm_silu(x, norm.weight, norm.bias, norm.num_groups, norm.eps, norm.silu)

    def before_pass(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook on the encoder and decoder: choose (and store the weights channels-last)
        before their first convolution, so that no pass runs half in one layout and half in the
        other (which left the next pass to meet the new layout's convolutions first)."""
        if args and isinstance(args[0], torch.Tensor):
            self._usable_for(args[0])

    def _usable_for(self, x: torch.Tensor) -> bool:
        key = (x.device.type, x.device.index, x.dtype)
        usable = self._usable.get(key)
        if usable is None:
            usable = self._usable[key] = self._resolve(x.device, x.dtype)
        return usable

    def resolved(self) -> dict[str, bool]:
        """Whether the fused kernel runs, per device and dtype seen, e.g. ``{"cuda:0 torch.bfloat16": True}``."""
        return {f"{t}{'' if i is None else f':{i}'} {d}": ok for (t, i, d), ok in self._usable.items()}

    def _resolve(self, device: torch.device, dtype: torch.dtype) -> bool:
        why = None
        if device.type not in KITCHEN_DEVICES:
            why = f"fused kernels are used on {'/'.join(KITCHEN_DEVICES)}, not {device.type}"
        elif not kitchen_available():
            why = f"comfy-kitchen is not installed; {INSTALL_HINT}"
        elif dtype not in _HALF:
            why = f"its kernel takes bf16/fp16, the VAE runs in {dtype}"
        else:
            why = _group_norm_self_check(device, dtype)
        if why is None:
            for ref in self._parts:  # at the first use on a GPU, so a VAE that never runs there stays NCHW
                part = ref()
                if part is not None:
                    part.to(memory_format=torch.channels_last)
            logger.info("klein fast VAE on %s %s: GroupNorm+SiLU=comfy-kitchen, channels-last", device, dtype)
            return True
        log = logger.debug if device.type not in KITCHEN_DEVICES else logger.warning
        log("fused VAE GroupNorm unavailable on %s (%s); using the plain PyTorch path", device, why)
        return False


_VAE_HOOKS = "_klein_fast_vae_hooks"  # the FastVAENorm pre-hooks enable_fast_vae registered


def _set_vae_norms(part: torch.nn.Module, fused: FastVAENorm | None) -> None:
    """Every GroupNorm (+ SiLU) of ``part`` (the VAE, its encoder or its decoder) runs ``fused``."""
    for module in part.modules():
        if isinstance(module, GroupNormAct):
            module.fused = fused


def _fuse_vae_norms(vae: Flux2VAE, part: torch.nn.Module, norm: FastVAENorm) -> None:
    """``part``'s (the encoder's or the decoder's) GroupNorms + SiLUs as ``norm``: what the
    uncompiled fast VAE runs, and a compiled part after compilation was given up."""
    norm.serve(part)
    vae.__dict__.setdefault(_VAE_HOOKS, []).append(part.register_forward_pre_hook(norm.before_pass))


# ---------------------------------------------------------------------------------------------
# Compilation


class _CompileTimer:
    """Forward hooks that log how long the first call at each input shape took.

    torch.compile compiles lazily inside that call, so its wall time (synchronised) is the
    compilation cost, paid once per shape and process.
    """

    def __init__(self) -> None:
        self.seen: set[tuple[Any, ...]] = set()
        self._pending: tuple[tuple[Any, ...], float] | None = None
        self.off = False  # compilation given up: nothing to time (LoRA copies keep copies of the hooks)

    @staticmethod
    def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The shapes that compile anew: the transformer's ``img`` and ``txt``, else every tensor
        argument (with any dtype argument, e.g. the text encoder's ``activations``)."""
        given = [kwargs.get("img"), kwargs.get("txt")] if "img" in kwargs else [*args, *kwargs.values()]
        tensors = [t for t in given if isinstance(t, torch.Tensor)]
        first = tensors[0] if tensors else None
        return (tuple(tuple(t.shape) for t in tensors), str(getattr(first, "device", "")),
                str(getattr(first, "dtype", "")), *(str(a) for a in given if isinstance(a, torch.dtype)))

    def pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.off:
            return
        key = self._key(args, kwargs)
        self._pending = None if key in self.seen else (key, time.perf_counter())

    def post(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if self._pending is None or self.off:
            self._pending = None
            return
        key, t0 = self._pending
        self._pending = None
        if isinstance(output, torch.Tensor) and output.is_cuda:
            torch.cuda.synchronize(output.device)
        self.seen.add(key)
        logger.info("torch.compile: first forward at shapes %s took %.1f s (compilation included; "
                    "later calls at these shapes reuse it)", list(key[0]), time.perf_counter() - t0)


def _blocks(model: Flux2Transformer) -> list[torch.nn.Module]:
    return [*model.double_blocks, *model.single_blocks]


def _uncompile(module: torch.nn.Module) -> None:
    # The compiled bound forward is an instance attribute shadowing the class method.
    module.__dict__.pop("forward", None)


class _CompileGroup:
    """Modules compiled together (a model's blocks, a VAE part, the text encoder's layers) and the
    copies made of them later (``klein_core.lora.with_loras``). A compiler failure in the modules
    sends them and every copy back to eager; one in a copy sends the copies back (a copy's LoRA
    branches are its own to compile) and leaves the modules compiled. Each is said once: a compiler
    that fails for one module fails for the next (no C++ compiler, an unsupported GPU), so they are
    not each tried and warned about, nor is each new copy (another LoRA strength)."""

    def __init__(self, modules: Sequence[torch.nn.Module], what: str,
                 on_eager: Callable[[], None] | None) -> None:
        self.modules = list(modules)
        self.what = what
        self.on_eager = on_eager
        self.failed = False
        self.copies_failed = False

    def fail(self, exc: Exception, in_copy: bool) -> None:
        if self.failed or (in_copy and self.copies_failed):
            return
        self.copies_failed = True
        if in_copy:
            # The copies then run with the ops their model shares with the original (compiled): the
            # plain steps where Inductor would have fused them. Exact, if slower.
            logger.warning("torch.compile failed for a copy of the %s (%s); running the copies eagerly",
                           self.what, _first_line(exc))
            return
        self.failed = True
        for m in self.modules:
            _uncompile(m)
        logger.warning("torch.compile failed for the %s (%s); running them eagerly (the fast path "
                       "without compilation)", self.what, _first_line(exc))
        if self.on_eager is not None:
            self.on_eager()


def _compile_group(modules: Sequence[torch.nn.Module], what: str,
                   on_eager: Callable[[], None] | None = None, **options: Any) -> None:
    """``torch.compile`` the bound ``forward`` of each of ``modules`` (in place), falling back to eager.

    Only ``forward`` is replaced, so hooks on the modules stay eager. Modules of one class share one
    compiled graph (their parameters are graph inputs), compiled at the first call at each new shape.
    On a compiler failure the call is re-run eagerly: if that succeeds the group (and every copy of
    its modules) goes back to eager with one warning, and ``on_eager()`` switches on what the
    eager fast path runs instead (kernels that compilation leaves to Inductor); if not, the eager
    error is raised and compilation stays on.
    """
    group = _CompileGroup(modules, what, on_eager)
    for module in modules:
        module.forward = _compiled_forward(module, group, options)  # type: ignore[method-assign]


# Compiled entries dynamo may keep per block kind (its default, 8, is per code object: every model
# and LoRA copy of a process shares it). One model at one LoRA structure takes about four (batch 1
# and larger, with and without per-token modulation for references); each further model size or
# set of LoRA-adapted Linears takes as many again. Past the limit dynamo runs every new combination
# eagerly for the rest of the process, with one warning in its log: a ComfyUI session that switched
# a model and a LoRA or two was back to eager speed for good.
RECOMPILE_LIMIT = 64


class _HookGuards:
    """A context for our compiled calls (reentrant): dynamo guards on the hooks of the modules it
    inlines, and may keep :data:`RECOMPILE_LIMIT` graphs per block kind.

    By default (``skip_nnmodule_hook_guards``) it does not guard hooks: a graph traced for a block
    without hooks was then reused for a LoRA copy of it, whose Linear children carry branch hooks,
    and the LoRA was silently ignored. With the guards a hooked copy compiles its own graph. Dynamo
    reads both settings when it looks a call up or compiles it, inside this context. Set and put back
    around each compiled call (a few microseconds), so other compiled code is left alone.
    """

    def __init__(self) -> None:
        self._saved: list[dict[str, Any]] = []

    def __enter__(self) -> None:
        import torch._dynamo  # loaded with torch.compile anyway; not at import time

        config = torch._dynamo.config
        saved: dict[str, Any] = {}
        if hasattr(config, "skip_nnmodule_hook_guards"):  # (a torch without it always guards them)
            saved["skip_nnmodule_hook_guards"] = config.skip_nnmodule_hook_guards
            config.skip_nnmodule_hook_guards = False
        # recompile_limit since torch 2.6 (cache_size_limit its old name, still an alias).
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        current = getattr(config, limit, None)
        if isinstance(current, int) and current < RECOMPILE_LIMIT:  # never lower a user's setting
            saved[limit] = current
            setattr(config, limit, RECOMPILE_LIMIT)
        self._saved.append(saved)

    def __exit__(self, *exc: object) -> None:
        if self._saved:
            for name, value in self._saved.pop().items():
                setattr(torch._dynamo.config, name, value)


_hook_guards = _HookGuards()


def _not_compiler_failures() -> tuple[type[BaseException], ...]:
    """Exceptions that pass through a compiled forward untouched, never taken for a compiler failure.

    Out of memory: eager would need the same memory (the caller explains it). Gradient
    checkpointing's ``_StopRecomputationError``: non-reentrant ``torch.utils.checkpoint`` raises it
    from inside the forward it recomputes in the backward pass, once it has the tensors it needs, to
    stop the recomputation early. Taken for a compiler failure, the forward was re-run eagerly inside
    that recomputation, where checkpoint refused it ("early_stop is set"): training a LoRA with
    gradient checkpointing on a compiled model crashed at the first backward pass.
    """
    kinds: list[type[BaseException]] = [torch.OutOfMemoryError]
    stop = getattr(importlib.import_module("torch.utils.checkpoint"), "_StopRecomputationError", None)
    if isinstance(stop, type) and issubclass(stop, BaseException):  # private: absent from some torch
        kinds.append(stop)
    return tuple(kinds)


_NOT_COMPILER_FAILURES = _not_compiler_failures()


def _compiled_forward(module: torch.nn.Module, group: _CompileGroup, options: dict[str, Any],
                      in_copy: bool = False) -> Callable[..., Any]:
    """``module``'s compiled forward with the eager fallback, for its instance ``forward``.

    It carries ``klein_rebind(copy)``: a shallow copy of ``module`` (``klein_core.lora.with_loras``
    makes them to hang LoRA branches on) must not call this one, which is bound to ``module`` and
    would run ``module``'s children without the copy's branches; it gets its own, in the same group.
    """
    eager = type(module).forward.__get__(module)  # the class's: module.forward may be a copied instance one
    compiled = torch.compile(eager, **options)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if group.failed or (in_copy and group.copies_failed):  # fell back after this was made
            _uncompile(module)
            return eager(*args, **kwargs)
        try:
            with _hook_guards:
                return compiled(*args, **kwargs)
        except _NOT_COMPILER_FAILURES:
            raise
        except Exception as exc:
            out = eager(*args, **kwargs)  # raises itself when the input is at fault
            group.fail(exc, in_copy)
            _uncompile(module)
            return out

    def rebind(copy: torch.nn.Module) -> Callable[..., Any]:
        return _compiled_forward(copy, group, options, in_copy=True)

    forward.klein_rebind = rebind  # type: ignore[attr-defined]
    return forward


def _remove_hooks(module: torch.nn.Module, handles: Sequence[Any]) -> None:
    """Remove the hooks of ``handles`` from ``module``'s own hook dicts, by id. ``handle.remove()``
    would act on the dicts the hooks were registered on, which for a LoRA copy of the model
    (``with_loras`` copies the dicts, ids and all) are the original model's."""
    for handle in handles:
        for name in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
                     "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            hooks = getattr(module, name, None)
            if hooks is not None:
                hooks.pop(handle.id, None)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether :func:`enable_fast_paths` / :func:`enable_fast_vae` left ``module`` compiled."""
    return "forward" in module.__dict__


# ---------------------------------------------------------------------------------------------
# Public API


def enable_fast_paths(
    model: Flux2Transformer,
    *,
    attention: str = "auto",
    fused_rope: bool = True,
    fused_modulation: bool = True,
    fused_elementwise: bool = True,
    compile: bool = False,
    compile_mode: str | None = None,
    compile_dynamic: bool | None = None,
    compile_backend: str = "inductor",
) -> FastOps:
    """Turn on the fast paths for ``model`` in place (replacing earlier ones); returns its :class:`FastOps`.

    Args:
        attention: one of :data:`ATTENTION_BACKENDS` (see the module docstring).
        fused_rope: comfy-kitchen's fused QK-RMSNorm + RoPE (needs CUDA and comfy-kitchen, else plain).
        fused_modulation: comfy-kitchen's fused modulated LayerNorm (``adaln``; same needs).
        fused_elementwise: on CUDA, ``addcmul`` residuals, one-pass SwiGLU (Triton), in-place concatenation.
        compile: ``torch.compile`` each block kind (one graph per kind; compiles at each new shape, logged).
        compile_mode, compile_dynamic, compile_backend: ``torch.compile``'s ``mode``/``dynamic``/``backend``.
    """
    if not isinstance(model, Flux2Transformer):
        raise TypeError(f"enable_fast_paths expects a Flux2Transformer, got {type(model).__name__}")
    disable_fast_paths(model)
    settings = FastSettings(attention, fused_rope, fused_modulation, compile, fused_elementwise)
    ops = FastOps(settings, model.config.head_dim, model.config.hidden_size)
    model.ops = ops
    if compile:
        timer = _CompileTimer()
        # Weak: LoRA copies of the blocks (with_loras) share this group; a strong reference would
        # keep the whole original model alive for as long as any copy lives.
        model_ref = weakref.ref(model)

        def eager_fast() -> None:  # the fast path's own kernels, which compilation left to Inductor
            ops.compile_failed()
            timer.off = True
            owner = model_ref()
            if owner is not None and owner.ops is ops:  # the timer's hooks, unless the model was switched since
                _remove_hooks(owner, getattr(owner, "_fast_hooks", ()))
                owner._fast_hooks = []  # type: ignore[assignment]

        _compile_group(_blocks(model), "transformer blocks", eager_fast, mode=compile_mode,
                       dynamic=compile_dynamic, backend=compile_backend)
        model._fast_hooks = [  # type: ignore[assignment]
            model.register_forward_pre_hook(timer.pre, with_kwargs=True),
            model.register_forward_hook(timer.post, with_kwargs=True),
        ]
        logger.info("torch.compile (%s) enabled for %d blocks (mode=%s, dynamic=%s); compiled on first use",
                    compile_backend, len(_blocks(model)), compile_mode or "default", compile_dynamic)
    model.__dict__[SPEED_ATTR] = CUSTOM_SPEED  # apply_speed names its own speed after this
    return ops


def eager_view(view: Flux2Transformer, model: Flux2Transformer) -> None:
    """Make ``view``, a copy of ``model``'s module tree that runs without ``model``'s compiled
    forwards (the nodes' native MODEL), run ``model``'s fast path eagerly: its ops without
    compilation (whose kernels compilation leaves to Inductor) and without the compile timer's
    hooks. Nothing to do for a model not compiled."""
    if isinstance(view.ops, FastOps):
        view.ops = view.ops.without_compile()
    _remove_hooks(view, getattr(model, "_fast_hooks", ()))


def disable_fast_paths(model: Flux2Transformer) -> None:
    """Back to the plain PyTorch path: default ops, no compiled blocks, no hooks."""
    model.__dict__.pop(SPEED_ATTR, None)  # plain; klein_core.accel.speed sets it anew
    model.ops = PLAIN_OPS
    for block in _blocks(model):
        _uncompile(block)
    _remove_hooks(model, getattr(model, "_fast_hooks", ()))
    model._fast_hooks = []  # type: ignore[assignment]


def enable_fast_vae(
    vae: Flux2VAE,
    *,
    compile: bool = True,
    fused_norm: bool | None = None,
    channels_last: bool | None = None,
    dtype: torch.dtype | None = None,
    compile_mode: str | None = None,
    compile_backend: str = "inductor",
    compile_encoder: bool | None = None,
) -> None:
    """The fast VAE (in place): fused GroupNorm + SiLU kernels, or the decoder compiled.

    Args:
        compile: ``torch.compile`` the decoder, channels-last (``speed="compile"``); compiles at each new
            image size (logged), reused later and across processes via torch's disk cache.
        fused_norm: each GroupNorm + SiLU as one comfy-kitchen kernel (CUDA, bf16/fp16, else plain).
            None: in each part that is not compiled.
        channels_last: store the decoder's convolution weights and input NHWC. None: with ``compile``.
        dtype: convert the decoder to this dtype (None keeps the VAE's).
        compile_mode, compile_backend: ``torch.compile``'s ``mode`` and ``backend``.
        compile_encoder: compile the encoder as well (with ``compile``). None: only where the fused
            norms cannot serve it (``fused_norm=False``, no comfy-kitchen, or a VAE in neither bf16 nor
            fp16; judged here, not per device: a bf16 VAE that runs on the CPU keeps its encoder eager
            and plain there). On an H200 (2026-11-28) two 1024² bf16 references took 55.8 ms compiled
            (66.8 ms wall) against 43.6 ms (62.8 wall) eager with the fused norms, timed in two
            processes on one machine (``benchmarks/results/2026-11-28_h200``).
    """
    if not isinstance(vae, Flux2VAE):
        raise TypeError(f"enable_fast_vae expects a Flux2VAE, got {type(vae).__name__}")
    disable_fast_vae(vae)
    layout = compile if channels_last is None else channels_last
    parts = {"decoder": vae.decoder, "encoder": vae.encoder}
    if compile_encoder is None:  # the fused kernel's own conditions, but for the device (known at first use)
        compile_encoder = fused_norm is False or not (kitchen_available() and vae.dtype in _HALF)
    compiled = [name for name in parts if compile and (name == "decoder" or compile_encoder)]
    fused = [name for name in parts if ((name not in compiled) if fused_norm is None else fused_norm)]
    vae.set_decode_format(dtype=dtype or vae.dtype, channels_last=layout)
    norm = FastVAENorm()  # one for both parts: the kernel is chosen (and checked) once per device
    for name in fused:
        _fuse_vae_norms(vae, parts[name], norm)
    for name in compiled:
        eager = None if name in fused else functools.partial(_fuse_vae_norms, vae, parts[name], norm)
        _compile_group([parts[name]], f"VAE {name}", eager, mode=compile_mode, backend=compile_backend)
    logger.info("VAE: decoder in %s, %s%s%s", vae.decoder_dtype, "channels-last" if layout else "NCHW",
                f", GroupNorm+SiLU fused in the {' and '.join(fused)} where the device allows" if fused else "",
                f", the {' and '.join(compiled)} compiled on first use" if compiled else "")
    vae.__dict__[SPEED_ATTR] = CUSTOM_SPEED


def disable_fast_vae(vae: Flux2VAE) -> None:
    """Back to the plain decode: the decoder in the model dtype (the encoder's), NCHW, not compiled,
    plain GroupNorms.

    Weights that :func:`enable_fast_vae` rounded to a lower precision stay rounded; reload the VAE
    for bit-exact decoding in the original precision.
    """
    vae.__dict__.pop(SPEED_ATTR, None)
    for handle in vae.__dict__.pop(_VAE_HOOKS, ()):
        handle.remove()
    _uncompile(vae.decoder)
    _uncompile(vae.encoder)
    _set_vae_norms(vae, None)
    vae.encoder.to(memory_format=torch.contiguous_format)  # FastVAENorm may have stored it channels-last
    vae.set_decode_format(dtype=vae.dtype, channels_last=False)


__all__ = [
    "ATTENTION_BACKENDS", "AUTO_ATTENTION", "CUSTOM_SPEED", "FastOps", "FastSettings", "FastVAENorm",
    "auto_attention", "disable_fast_paths", "disable_fast_vae", "eager_view", "enable_fast_paths",
    "enable_fast_vae", "is_compiled",
]
