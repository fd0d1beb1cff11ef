"""Trainable LoRA layers on the core transformer, chosen per block group.

A :class:`LoRALayer` is a forward hook adding ``scale * B @ A @ x`` to a frozen linear, with one
``(A, B)`` pair per row part (three for a double block's fused ``qkv``: diffusers' ``to_q/to_k/to_v``),
so the model's modules and state dict are untouched and :meth:`LoRASet.detach` restores it exactly.
Presets: ``"style"`` (the double blocks), ``"structure"`` (single blocks 0-12), ``"full"`` (every block;
ranks 128 double attention, 64 double MLPs, 64 single 0-12, 32 single 13+); the text encoder's
linears with :func:`text_encoder_preset`. Why not peft:
docs/DESIGN.md.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import Self

from ..memory.placement import BlockOffloader, find_block_lists
from ..quant.fp8 import FP8Linear
from ..quant.ggml import GGMLLinear
from ..quant.nvfp4 import NVFP4Linear

logger = logging.getLogger(__name__)

_DOUBLE_ATTN = r"double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)"
_DOUBLE_MLP = r"double_blocks\.\d+\.(img|txt)_mlp\.[02]"
_SINGLE_0_12 = r"single_blocks\.([0-9]|1[0-2])\.linear[12]"
_SINGLE_13_UP = r"single_blocks\.(1[3-9]|[2-9]\d|\d{3,})\.linear[12]"


@dataclass(frozen=True)
class TargetGroup:
    """Linears whose core name fully matches ``pattern`` (a regex) get rank ``rank`` and ``alpha``
    (None: alpha = rank, i.e. scale 1)."""

    name: str
    pattern: str
    rank: int
    alpha: float | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"group {self.name!r}: rank must be positive, got {self.rank}")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            # alpha 0 makes the LoRA's output (and its gradients) zero: nothing would be learnt
            raise ValueError(f"group {self.name!r}: alpha must be a positive number (None: alpha = rank), "
                             f"got {self.alpha}")
        try:
            re.compile(self.pattern)
        except re.error as exc:  # a ValueError, so that callers report it as bad input
            raise ValueError(f"group {self.name!r}: target pattern {self.pattern!r} is not a valid regular "
                             f"expression ({exc})") from None

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank


@dataclass(frozen=True)
class AdapterConfig:
    """What to adapt: groups tried in order, the first match wins. ``split_qkv``: a double block's
    fused ``qkv`` gets one factor pair per q/k/v (diffusers' layout)."""

    groups: tuple[TargetGroup, ...]
    split_qkv: bool = True
    dtype: torch.dtype = torch.float32

    @property
    def description(self) -> dict[str, Any]:
        return {g.name: {"pattern": g.pattern, "rank": g.rank, "alpha": g.alpha if g.alpha is not None else g.rank}
                for g in self.groups}


PRESETS: tuple[str, ...] = ("style", "structure", "full")
# The layer types a LoRA hooks onto: every Linear the loaders build, quantised or not.
ADAPTABLE: tuple[type[nn.Module], ...] = (nn.Linear, FP8Linear, GGMLLinear, NVFP4Linear)
# Every linear of the Qwen3 text encoder's decoder layers (attention and MLP), its core names.
TEXT_ENCODER_TARGETS = r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"


def preset(name: str, rank: int | None = None, alpha: float | None = None,
           patterns: Sequence[str] = ()) -> AdapterConfig:
    """The config of a preset. ``rank``/``alpha`` override every group's; ``patterns``: custom
    regexes over core module names (``"custom"``) used instead of a preset. ``rank`` 0 or below is
    refused (it is not "the preset's rank": that is None)."""
    if rank is not None and rank < 1:
        raise ValueError(f"LoRA rank must be 1 or more (leave it unset for the preset's rank), got {rank}")
    if patterns:
        r = rank if rank is not None else 32
        return AdapterConfig(tuple(TargetGroup(f"custom{i}", p, r, alpha) for i, p in enumerate(patterns)))
    if name == "style":
        groups = [TargetGroup("double", f"{_DOUBLE_ATTN}|{_DOUBLE_MLP}", 32)]
    elif name == "structure":
        groups = [TargetGroup("single_0_12", _SINGLE_0_12, 32)]
    elif name == "full":
        groups = [TargetGroup("double_attn", _DOUBLE_ATTN, 128), TargetGroup("double_mlp", _DOUBLE_MLP, 64),
                  TargetGroup("single_0_12", _SINGLE_0_12, 64), TargetGroup("single_13_up", _SINGLE_13_UP, 32)]
    else:
        raise ValueError(f"unknown preset {name!r}; choose one of {PRESETS} or give target patterns")
    if rank is not None or alpha is not None:
        groups = [TargetGroup(g.name, g.pattern, rank if rank is not None else g.rank, alpha) for g in groups]
    return AdapterConfig(tuple(groups))


def text_encoder_preset(rank: int = 8, alpha: float | None = None) -> AdapterConfig:
    """LoRA on every attention and MLP linear of the text encoder's layers (``q/k/v/o_proj``,
    ``gate/up/down_proj``), as kohya's and diffusers' text-encoder LoRAs do."""
    return AdapterConfig((TargetGroup("text_encoder", TEXT_ENCODER_TARGETS, rank, alpha),), split_qkv=False)


class LoRALayer(nn.Module):
    """LoRA factors for one linear ``[out, in]`` split into ``parts`` equal row blocks.

    ``down`` ``[parts, r, in]`` (A), ``up`` ``[parts, out/parts, r]`` (B); ``delta(x) = scale *
    cat_p(x @ A_p.T @ B_p.T)``. A starts as peft's default (Kaiming-uniform, a = sqrt(5)), B at 0.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float, parts: int = 1, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if out_features % parts:
            raise ValueError(f"{out_features} rows cannot be split in {parts} parts")
        self.parts, self.rank, self.scale = parts, rank, float(scale)
        bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        down = (torch.rand(parts, rank, in_features, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        self.down = nn.Parameter(down.to(device=device, dtype=dtype))
        self.up = nn.Parameter(torch.zeros(parts, out_features // parts, rank, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.down.dtype)
        outs = [nn.functional.linear(nn.functional.linear(h, self.down[p]), self.up[p]) * self.scale
                for p in range(self.parts)]
        return outs[0] if self.parts == 1 else torch.cat(outs, dim=-1)

    def delta(self) -> torch.Tensor:
        """The weight delta ``[out, in]`` float32 (scale included)."""
        return torch.cat([self.up[p].float() @ self.down[p].float() for p in range(self.parts)]) * self.scale


def _key(name: str) -> str:
    return name.replace(".", "__")


def _model_device(model: nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


class LoRASet(nn.Module):
    """The trainable layers, by core module name (``self.layers[_key(name)]``), plus the hooks
    that attach them to a model (the transformer, or the text encoder with
    :func:`text_encoder_preset`). ``groups``: core module name -> group name. ``device``: where the
    layers live (default: the model's, which for a block-streamed model is its resident part's)."""

    def __init__(self, model: nn.Module, config: AdapterConfig, *, seed: int = 0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict()
        self.groups: dict[str, str] = {}
        self._hooks: list[Any] = []
        g = torch.Generator().manual_seed(seed)
        compiled = [(grp, re.compile(grp.pattern)) for grp in config.groups]
        device = torch.device(device) if device is not None else _model_device(model)
        matched: set[str] = set()  # groups whose pattern matches some linear (taken by it or an earlier one)
        for name, module in model.named_modules():
            # a quantised base (fp8, GGUF, NVFP4): the hook adds to the frozen layer's output, as QLoRA
            if not isinstance(module, ADAPTABLE):
                continue
            matched.update(grp.name for grp, rx in compiled if rx.fullmatch(name))
            grp = next((grp for grp, rx in compiled if rx.fullmatch(name)), None)
            if grp is None:
                continue
            parts = 3 if config.split_qkv and re.fullmatch(r"double_blocks\.\d+\.(img|txt)_attn\.qkv", name) else 1
            self.layers[_key(name)] = LoRALayer(module.in_features, module.out_features, grp.rank, grp.scale, parts,
                                                dtype=config.dtype, device=device, generator=g)
            self.groups[name] = grp.name
        what = getattr(getattr(model, "config", None), "variant", "")
        if not self.groups:
            raise ValueError(f"no linear of this {what} {type(model).__name__} matches the targets "
                             f"{[grp.pattern for grp in config.groups]}")
        unused = [grp for grp in config.groups if grp.name not in matched]
        # A custom pattern that matches nothing is a typo: refused, or those layers would silently not
        # train. A preset's group may match nothing on a smaller model (single blocks 13+).
        custom = [grp.pattern for grp in unused if grp.name.startswith("custom")]
        if custom:
            raise ValueError(f"target pattern(s) {custom} match no linear of this {what} {type(model).__name__} "
                             "(a pattern must fully match core module names such as "
                             "'double_blocks.0.img_attn.qkv' or 'single_blocks.3.linear1')")
        for grp in unused:
            logger.info("LoRA group %r (%s) matches no linear of this model", grp.name, grp.pattern)
        logger.info("LoRA on %d linears (%d trainable parameters)", len(self.groups),
                    sum(p.numel() for p in self.parameters()))

    def names(self) -> list[str]:
        """Core module names adapted, in model order."""
        return list(self.groups)

    def layer(self, name: str) -> LoRALayer:
        return self.layers[_key(name)]  # type: ignore[return-value]

    def items(self) -> Iterator[tuple[str, LoRALayer]]:
        for name in self.groups:
            yield name, self.layer(name)

    def attach(self, model: nn.Module) -> LoRASet:
        """Add every layer's output to its linear's (forward hooks). Returns self."""
        if self._hooks:
            raise RuntimeError("these LoRA layers are already attached; detach() first")
        modules = dict(model.named_modules())
        for name, layer in self.items():
            def hook(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor, layer: LoRALayer = layer) -> torch.Tensor:
                return out + layer(args[0]).to(out.dtype)
            self._hooks.append(modules[name].register_forward_hook(hook))
        return self

    def detach(self) -> None:
        """Remove the hooks: the model computes exactly as before :meth:`attach`."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class gradient_checkpointing:
    """Context manager: every block of ``model`` (the transformer's double and single blocks, the
    text encoder's layers: its ``nn.ModuleList`` children) recomputes its activations in the
    backward pass (``torch.utils.checkpoint``, non-reentrant) instead of keeping them.

    With ``streamer`` (a :class:`~klein_core.memory.placement.BlockOffloader` attached with
    ``hooks=False`` over the same blocks), each block's weights are on the device only while it runs:
    in the forward pass (the next block copied meanwhile) and again in the backward pass's
    recomputation (the previous block copied meanwhile). Without checkpointing, the backward pass
    would keep every block's device weights alive, so streaming always checkpoints.
    """

    def __init__(self, model: nn.Module, enabled: bool = True, *, streamer: BlockOffloader | None = None) -> None:
        blocks = [b for lst in find_block_lists(model) for b in lst]
        if streamer is not None and [id(b) for b in streamer.blocks] != [id(b) for b in blocks]:
            raise ValueError("the block streamer does not stream this model's blocks")
        self.blocks = blocks if enabled or streamer is not None else []
        self.streamer = streamer

    def __enter__(self) -> Self:
        # A block's own instance forward (a compiled one, klein_core.accel) is wrapped, and put back on
        # exit: popping it would leave the model uncompiled while its speed still says "compile".
        self._previous = [block.__dict__.get("forward") for block in self.blocks]
        for i, block in enumerate(self.blocks):
            block.forward = self._checkpointed(i, block.forward)  # instance attribute: shadows the class method
        return self

    def _checkpointed(self, i: int, original: Callable[..., Any]) -> Callable[..., Any]:
        streamer = self.streamer
        if streamer is None:
            def run(*args: Any, **kwargs: Any) -> Any:
                return checkpoint(original, *args, use_reentrant=False, **kwargs)
            return run

        def run_streamed(*args: Any, **kwargs: Any) -> Any:
            # Only the forward pass calls this; checkpoint calls ``body`` again from the backward pass
            # to recompute, when the blocks come in reverse order.
            forward = [True]

            def body(*a: Any, **k: Any) -> Any:
                return streamer.run(i, original, *a, ahead=1 if forward[0] else -1, **k)
            try:
                return checkpoint(body, *args, use_reentrant=False, **kwargs)
            finally:
                forward[0] = False
        return run_streamed

    def __exit__(self, *exc: object) -> None:
        for block, previous in zip(self.blocks, self._previous):
            if previous is None:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = previous
