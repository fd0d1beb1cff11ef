"""Load plans: how a module's parameters come from a source, checked before any data is read.

A component describes each internal tensor as an op over source tensors (:class:`Take`,
:class:`Cat`, :class:`SwapHalves`, :class:`Reshape`) whose output shape is known from the header
alone, so :func:`check_key_map` reports missing, unexpected and misshaped tensors (naming the file
and the first keys) before a single weight is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .source import TensorInfo, WeightSource

_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


class Op:
    """One internal tensor, described in terms of source tensors. ``shape`` reads no data."""

    def sources(self) -> list[str]:
        raise NotImplementedError

    def shape(self, src: WeightSource) -> tuple[int, ...]:
        raise NotImplementedError

    def load(self, src: WeightSource) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Take(Op):
    key: str

    def sources(self) -> list[str]:
        return [self.key]

    def shape(self, src: WeightSource) -> tuple[int, ...]:
        return src.shape(self.key)

    def load(self, src: WeightSource) -> torch.Tensor:
        return src.get(self.key)


@dataclass(frozen=True)
class Cat(Op):
    """Concatenation of several source tensors along ``dim`` (e.g. to_q/to_k/to_v -> qkv)."""

    keys: tuple[str, ...]
    dim: int = 0

    def sources(self) -> list[str]:
        return list(self.keys)

    def shape(self, src: WeightSource) -> tuple[int, ...]:
        shapes = [src.shape(k) for k in self.keys]
        if any(len(s) != len(shapes[0]) for s in shapes):
            return (-1,)
        out = list(shapes[0])
        out[self.dim] = sum(s[self.dim] for s in shapes)
        for s in shapes[1:]:
            if any(a != b for i, (a, b) in enumerate(zip(s, shapes[0])) if i != self.dim):
                return (-1,)
        return tuple(out)

    def load(self, src: WeightSource) -> torch.Tensor:
        parts = [src.get(k) for k in self.keys]
        if len({t.dtype for t in parts}) == 1 and parts[0].dtype in _FLOAT8:
            # torch.cat of float8 is missing on CUDA in some torch versions (2.4: "cat_cuda" not
            # implemented): a loaded fp8 weight may be on the GPU. Its bytes, joined, are the same.
            dtype = parts[0].dtype
            return torch.cat([t.view(torch.uint8) for t in parts], dim=self.dim).view(dtype)
        return torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class SwapHalves(Op):
    """Swap the two halves along dim 0 (diffusers' final-layer (scale, shift) <-> BFL (shift, scale))."""

    key: str

    def sources(self) -> list[str]:
        return [self.key]

    def shape(self, src: WeightSource) -> tuple[int, ...]:
        return src.shape(self.key)

    def load(self, src: WeightSource) -> torch.Tensor:
        a, b = src.get(self.key).chunk(2, dim=0)
        return torch.cat([b, a], dim=0)


@dataclass(frozen=True)
class Reshape(Op):
    """A source tensor viewed with another shape of the same size (e.g. a 1x1 conv as a Linear)."""

    key: str
    new_shape: tuple[int, ...]

    def sources(self) -> list[str]:
        return [self.key]

    def shape(self, src: WeightSource) -> tuple[int, ...]:
        n = 1
        for s in src.shape(self.key):
            n *= s
        m = 1
        for s in self.new_shape:
            m *= s
        return self.new_shape if n == m else (-1,)

    def load(self, src: WeightSource) -> torch.Tensor:
        return src.get(self.key).reshape(self.new_shape)


def quantizable_linears(module: nn.Module) -> set[str]:
    """Names of the ``nn.Linear`` layers a quantised file may keep quantised: all but those the
    model reads its dtype and device from (``module.plain_layers``)."""
    keep = set(getattr(module, "plain_layers", ()))
    return {n for n, m in module.named_modules() if isinstance(m, nn.Linear) and n not in keep}


class DecodingView:
    """A stand-in source whose tensors read through ``decode(info, raw)``, so an Op computes on the
    decoded values (quantised formats use it to evaluate an op on dequantised float32 sources)."""

    def __init__(self, src: WeightSource, decode: Callable[[TensorInfo, torch.Tensor], torch.Tensor]) -> None:
        self._src = src
        self._decode = decode

    def get(self, key: str) -> torch.Tensor:
        return self._decode(self._src.info(key), self._src.get(key))

    def shape(self, key: str) -> tuple[int, ...]:
        return self._src.shape(key)


@dataclass
class KeyMap:
    """How to fill a module: ``ops[internal_name]``, plus the source keys deliberately not read
    (``ignored``) and those the component did not understand (``unexpected``)."""

    ops: dict[str, Op] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def build_key_map(
    src: WeightSource,
    rename: Callable[[str], str | Op | None],
    *,
    ignore: Callable[[str], bool] = lambda k: False,
) -> KeyMap:
    """Map every source key through ``rename`` (-> internal name, an Op for the internal name via
    a (name, op) tuple, or None for "not understood"), skipping keys for which ``ignore`` is True."""
    plan = KeyMap()
    for key in src.keys():
        if ignore(key):
            plan.ignored.append(key)
            continue
        target = rename(key)
        if target is None:
            plan.unexpected.append(key)
            continue
        name, op = (target, Take(key)) if isinstance(target, str) else target  # type: ignore[misc]
        if name in plan.ops:
            raise ValueError(
                f"{src.name}: tensors '{plan.ops[name].sources()[0]}' and '{key}' both provide '{name}'; "
                "the file holds two copies of one weight and it is unclear which to use."
            )
        plan.ops[name] = op
    return plan


def _first(items: Iterable[str], n: int = 5) -> str:
    items = list(items)
    shown = ", ".join(f"'{i}'" for i in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def check_key_map(module: nn.Module, plan: KeyMap, src: WeightSource, component: str) -> None:
    """Compare a plan with a (meta) module; raise ValueError naming the file and first bad keys."""
    state = module.state_dict()
    expected = {k: tuple(v.shape) for k, v in state.items()}
    missing = [k for k in expected if k not in plan.ops]
    unexpected = list(plan.unexpected) + [k for k in plan.ops if k not in expected]
    misshaped = []
    for k, op in plan.ops.items():
        if k in expected:
            got = op.shape(src)
            if got != expected[k]:
                stored = " + ".join(str(list(src.shape(s))) for s in op.sources())
                misshaped.append(f"{k} (file {stored}, model {list(expected[k])})")
    wrong_dtype = [
        f"{k} ({src.dtype(s)})" for k, op in plan.ops.items() if k in state and state[k].is_floating_point()
        for s in op.sources() if not src.dtype(s).is_floating_point
    ]
    if wrong_dtype:
        misshaped += [f"{w} is not floating point" for w in wrong_dtype]
    if missing or unexpected or misshaped:
        parts = [f"{src.name}: does not fit the {component} it appears to be."]
        if missing:
            parts.append(f"Missing {len(missing)} tensors: {_first(missing)}.")
        if unexpected:
            parts.append(f"Unexpected {len(unexpected)} tensors: {_first(unexpected)}.")
        if misshaped:
            parts.append(f"Wrong shape for {len(misshaped)} tensors: {_first(misshaped, 3)}.")
        parts.append("The file may be incomplete, or a different model than expected.")
        raise ValueError(" ".join(parts))
