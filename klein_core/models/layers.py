"""Small building blocks shared by the text encoder and the transformer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 and cast back before the weight multiply.

    This is the order both Qwen3 (``Qwen3RMSNorm``) and BFL's QK-norm use; it differs from
    ``torch.nn.RMSNorm`` only at bf16 rounding level.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise ``x`` over its last dim in float32, cast back, then scale by ``weight``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(dtype) * weight.to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention on ``[B, H, L, D]`` tensors with the default 1/sqrt(D) scale.

    ``mask`` is a boolean ``[B, 1, Lq, Lk]`` (True = attend) or None. Returns ``[B, H, Lq, D]``.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@contextlib.contextmanager
def computing_in(module: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """Run ``module`` with its floating parameters and buffers cast to ``dtype`` for the duration
    (float8 weights stay: their layers upcast themselves); the originals are put back afterwards.

    What ComfyUI's "manual cast" does per layer: e.g. bf16 weights computing with fp32 activations.
    Only one module's copies exist at a time; hooks on the module (LoRA branches) keep working.
    """
    swapped: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    try:
        for owner in module.modules():
            for store, is_param in ((owner._parameters, True), (owner._buffers, False)):
                for name, t in store.items():
                    if t is None or not t.is_floating_point() or t.dtype == dtype or t.dtype.itemsize == 1:
                        continue
                    swapped.append((owner, name, is_param, t))
                    cast = t.detach().to(dtype)
                    store[name] = nn.Parameter(cast, requires_grad=False) if is_param else cast
        yield module
    finally:
        for owner, name, is_param, t in swapped:
            (owner._parameters if is_param else owner._buffers)[name] = t


@contextlib.contextmanager
def computing_in_calls(module: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """:func:`computing_in` around each call of ``module`` while inside, entered by forward hooks:
    after the hooks already on the module (a :class:`~klein_core.memory.placement.BlockOffloader`'s,
    which put the block's weights on the device) and left before their post hooks run.

    Casting outside the call instead would cast the block's CPU home copies (which the offloader's
    pre-hook then replaces with device weights in the file dtype) or, on CUDA, read the device copies
    before the compute stream has waited for their transfer; its restore would then put the device
    copies back after the offloader released them, leaving them on the device.
    """
    active: list[contextlib.ExitStack] = []

    def pre(mod: nn.Module, args: object) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(computing_in(mod, dtype))
        active.append(stack)

    def post(mod: nn.Module, args: object, output: object) -> None:
        if active:
            active.pop().close()

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post, prepend=True)]
    try:
        yield module
    finally:
        for h in handles:
            h.remove()
        while active:  # the call raised: its post hook never ran
            active.pop().close()


def replace_module(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``root.get_submodule(path)`` is (dotted path); returns the module replaced."""
    parent_name, _, child = path.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old
