"""Reading weight files and filling meta-built modules from them, strictly.

Every loader in the core goes through this module:

* :func:`open_weights` turns a file path, a folder or an in-memory state dict into a
  :class:`WeightSource`, a read-only view that knows every tensor's shape and dtype from the
  safetensors header and reads a tensor's bytes only when asked. Formats the core cannot run
  (pickles, GGUF, nvfp4 and other non-fp8 quantisations) are refused here with a message naming
  the format; fp8 files are opened as a view prepared by :func:`klein_core.quant.prepare_quantized`.
* A component describes how its module's parameters come from the source as a :class:`LoadPlan`:
  internal name -> an op (:class:`Take`, :class:`Cat`, :class:`SwapHalves`, :class:`Reshape`) whose
  output shape is known *before* any data is read, so key and shape mismatches are reported before
  a single weight is loaded.
* :func:`materialize` builds the module on the meta device, checks the plan against it and fills it
  tensor by tensor (no random initialisation, peak memory about one tensor above the result).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .errors import WeightFormatError
from .files.safetensors import NotSafetensors, open_safetensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one stored tensor, read from the file header (no data touched)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header without reading any tensor data.

    Returns ``(tensors, metadata)``. Raises :class:`WeightFormatError` naming the file when the
    header is truncated, malformed, or points outside the file, or when the file is another
    format (pickle, GGUF), named as such.
    """
    f = open_safetensors(path)
    return {k: TensorInfo(v.shape, v.dtype) for k, v in f.tensors.items()}, dict(f.metadata)


class WeightSource:
    """A read-only, lazily read collection of named tensors.

    ``name`` describes where the tensors come from (a file or folder path) and is used in every
    error message. Tensors are read one at a time by :meth:`get`.
    """

    def __init__(
        self,
        name: str,
        infos: Mapping[str, TensorInfo],
        reader: Callable[[str], torch.Tensor],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self._infos = dict(infos)
        self._reader = reader
        self.metadata: dict[str, str] = dict(metadata or {})

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, key: str) -> TensorInfo:
        return self._infos[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._infos[key].shape

    def dtype(self, key: str) -> torch.dtype:
        return self._infos[key].dtype

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor (on the CPU, in its stored dtype)."""
        if key not in self._infos:
            raise KeyError(f"{self.name}: no tensor named '{key}'")
        return self._reader(key)

    def strip_prefix(self, prefix: str) -> WeightSource:
        """A view in which keys starting with ``prefix`` lose it; other keys are dropped."""
        if not prefix:
            return self
        infos = {k[len(prefix) :]: v for k, v in self._infos.items() if k.startswith(prefix)}
        reader = self._reader
        return WeightSource(self.name, infos, lambda k: reader(prefix + k), self.metadata)


def _file_source(path: Path, component: str = "weights") -> WeightSource:
    f = open_safetensors(path, component)
    infos = {k: TensorInfo(v.shape, v.dtype) for k, v in f.tensors.items()}
    return WeightSource(str(path), infos, f.read, f.metadata)


def _sharded_source(name: str, files: Sequence[Path], key_to_file: Mapping[str, Path] | None) -> WeightSource:
    parts = {f: _file_source(f) for f in files}
    infos: dict[str, TensorInfo] = {}
    owner: dict[str, WeightSource] = {}
    metadata: dict[str, str] = {}
    for f, src in parts.items():
        metadata.update(src.metadata)
        for k in src.keys():
            if key_to_file is not None and key_to_file.get(k, f) != f:
                continue
            if k in owner:
                raise WeightFormatError(f"{name}: tensor '{k}' appears in two shards ({owner[k].name}, {f}).")
            infos[k] = src.info(k)
            owner[k] = src
    if key_to_file is not None:
        absent = [k for k in key_to_file if k not in infos]
        if absent:
            raise WeightFormatError(
                f"{name}: the shard index lists {len(absent)} tensors that are not in the shards "
                f"(first: {absent[:3]}); a shard is missing or incomplete."
            )
    return WeightSource(name, infos, lambda k: owner[k].get(k), metadata)


def _folder_source(folder: Path, subfolder: str | None) -> WeightSource:
    candidates = [folder]
    if subfolder:
        candidates.insert(0, folder / subfolder)
    for d in candidates:
        if not d.is_dir():
            continue
        indexes = sorted(d.glob("*.safetensors.index.json"))
        if indexes:
            index_path = indexes[0]
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as exc:
                raise WeightFormatError(f"{index_path}: not a valid shard index ({exc}).") from None
            files = sorted({d / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise WeightFormatError(f"{index_path}: shard files are missing: {missing[:3]}.")
            return _sharded_source(str(d), files, {k: d / v for k, v in weight_map.items()})
        files = sorted(d.glob("*.safetensors"))
        if len(files) == 1:
            return _file_source(files[0])
        if len(files) > 1:
            return _sharded_source(str(d), files, None)
    where = f"{folder}" + (f" (or its '{subfolder}' subfolder)" if subfolder else "")
    raise WeightFormatError(f"{where}: no .safetensors files found.")


def _dict_source(sd: Mapping[str, torch.Tensor], name: str) -> WeightSource:
    infos = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name}: value for '{k}' is {type(v).__name__}, expected a torch.Tensor")
        infos[k] = TensorInfo(tuple(v.shape), v.dtype)
    return WeightSource(name, infos, lambda k: sd[k])


def detect_unsupported_format(src: WeightSource) -> str | None:
    """Name the quantised format of ``src`` if the core cannot run it (nvfp4, mxfp8, int8, ...).

    fp8 files (ComfyUI ``comfy_quant`` mixed precision, ``scaled_fp8``, ``weight_scale`` /
    ``input_scale``, plain float8) are runnable and give None; see :mod:`klein_core.quant`.
    """
    from .quant import unsupported_format  # quant builds on this module

    return unsupported_format(src)


def open_weights(
    source: str | os.PathLike | Mapping[str, torch.Tensor] | WeightSource,
    *,
    component: str,
    subfolder: str | None = None,
) -> WeightSource:
    """Open ``source`` (a file, a folder, a state dict or a WeightSource) for reading.

    ``component`` ("transformer", "text encoder", "VAE") is used in messages; ``subfolder`` is the
    Hugging Face repo subfolder to look in when ``source`` is a repo root ("transformer", ...).
    """
    if isinstance(source, WeightSource):
        src = source
    elif isinstance(source, Mapping):
        src = _dict_source(source, f"<in-memory {component} state dict>")
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{component} weights not found: {path}")
        if path.is_dir():
            src = _folder_source(path, subfolder)
        else:
            try:
                src = _file_source(path, component)
            except NotSafetensors as exc:
                if exc.kind == "gguf":
                    raise WeightFormatError(
                        f"{path}: this is a GGUF file, which this version of klein_core cannot read yet; use "
                        f"the bf16 or fp8 .safetensors {component} file."
                    ) from None
                raise
    fmt = detect_unsupported_format(src)
    if fmt is not None:
        raise WeightFormatError(
            f"{src.name}: this {component} file is in the {fmt} format, which this version of "
            f"klein_core cannot run yet. Use the bf16 or fp8 .safetensors {component} file instead."
        )
    if len(src) == 0:
        raise WeightFormatError(f"{src.name}: contains no tensors.")
    from .quant import prepare_quantized

    # fp8 files: a view without the scale/marker tensors, whose quantised weights carry their
    # scales, so every component plan sees the keys and shapes of the bf16 file.
    return prepare_quantized(src)


# ---------------------------------------------------------------------------------------------
# Load plans: declarative ops from source keys to internal parameters.


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
        return torch.cat([src.get(k) for k in self.keys], dim=self.dim)


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


@dataclass
class LoadPlan:
    """How to fill a module: ``ops[internal_name]``, plus the source keys deliberately not read
    (``ignored``) and those the component did not understand (``unexpected``)."""

    ops: dict[str, Op] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def build_plan(
    src: WeightSource,
    rename: Callable[[str], str | Op | None],
    *,
    ignore: Callable[[str], bool] = lambda k: False,
) -> LoadPlan:
    """Map every source key through ``rename`` (-> internal name, an Op for the internal name via
    a (name, op) tuple, or None for "not understood"), skipping keys for which ``ignore`` is True."""
    plan = LoadPlan()
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


def check_plan(module: nn.Module, plan: LoadPlan, src: WeightSource, component: str) -> None:
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


def materialize(
    factory: Callable[[], nn.Module],
    plan: LoadPlan,
    src: WeightSource,
    *,
    component: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    keep_fp32: Callable[[str], bool] = lambda name: False,
    quantize: str | None = None,
) -> nn.Module:
    """Build ``factory()`` on the meta device and fill it from ``src`` following ``plan``.

    ``dtype`` applies to floating tensors except those for which ``keep_fp32(name)`` is True,
    which are loaded as float32. None means the stored dtype of most of the weights (a file that
    mixes dtypes still gives a module of one dtype; float8 is a storage format, never the compute
    dtype: an all-fp8 file computes in bfloat16). The module is returned in eval mode with
    gradients off.

    ``device="meta"`` builds the model without reading any tensor data (shapes, dtypes and fp8
    layers as a real load would give them; for planning and for checking a file cheaply).

    ``quantize`` (see :func:`klein_core.quant.plan_fp8`): None keeps fp8 block weights of fp8
    files in fp8 (as :class:`~klein_core.quant.FP8Linear`) and dequantises any other float8
    tensor; ``"fp8"`` also quantises float block weights while loading (the float copy never
    reaches ``device``); ``"dequantize"`` loads everything in ``dtype``.
    """
    from . import quant  # quant builds on this module

    device = torch.device(device) if device is not None else torch.device("cpu")
    if dtype is not None and quant.is_fp8(dtype):
        raise ValueError(
            f"{component}: dtype {dtype} is a storage format, not a compute dtype; load with "
            "dtype=torch.bfloat16 and quantize='fp8' to keep the weights in fp8."
        )
    if dtype is None:
        dtype = _dominant_float_dtype(plan, src)
    with torch.device("meta"):
        module = factory()
    check_plan(module, plan, src, component)
    fp8 = quant.plan_fp8(module, plan.ops, src, quantize)
    quant.swap_to_fp8_(module, fp8.values())  # free: the module is still on the meta device
    state: dict[str, torch.Tensor] = {}
    for name, op in plan.ops.items():
        if name in fp8:
            state.update(quant.load_fp8(name, fp8[name], op, src, device))
            continue
        if device.type == "meta":  # a weightless model: shapes and dtypes only, no tensor data read
            stored = src.dtype(op.sources()[0])
            target = (torch.float32 if keep_fp32(name) else dtype) if stored.is_floating_point else stored
            state[name] = torch.empty(op.shape(src), dtype=target, device=device)
            continue
        t = quant.dequantize_op(op, src) if quant.reads_fp8(op, src) else op.load(src)
        if t.is_floating_point():
            target = torch.float32 if keep_fp32(name) else dtype
            t = t.to(device=device, dtype=target)
        else:
            t = t.to(device=device)
        state[name] = t.contiguous()
    module.load_state_dict(state, strict=True, assign=True)
    leftovers = [n for n, b in module.named_buffers() if b.is_meta]
    if leftovers and device.type != "meta":  # a non-persistent buffer would be left on meta: a bug in the module definition
        raise RuntimeError(f"{component}: buffers left uninitialised after loading: {leftovers[:5]}")
    module.eval().requires_grad_(False)
    n = sum(p.numel() for p in module.parameters())
    logger.info("Loaded %s from %s: %.1fM parameters, %d tensors", component, src.name, n / 1e6, len(state))
    if fp8:
        made = sum(1 for spec in fp8.values() if spec.quantize)
        logger.info("%s: %d Linear layers in fp8 (%d quantised while loading), compute dtype %s",
                    component, len(fp8), made, dtype)
    return module


def _dominant_float_dtype(plan: LoadPlan, src: WeightSource) -> torch.dtype:
    """The floating dtype holding most of the plan's stored bytes (float32 if there is none;
    bfloat16 if every float tensor is float8, the dtype fp8 checkpoints are made from)."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    sizes: dict[torch.dtype, int] = {}
    saw_fp8 = False
    for op in plan.ops.values():
        for key in op.sources():
            info = src.info(key)
            # float8 is storage only: the compute dtype comes from the other tensors.
            saw_fp8 = saw_fp8 or info.dtype in fp8
            if info.dtype.is_floating_point and info.dtype not in fp8:
                n = 1
                for d in info.shape:
                    n *= d
                sizes[info.dtype] = sizes.get(info.dtype, 0) + n * info.dtype.itemsize
    if not sizes:
        return torch.bfloat16 if saw_fp8 else torch.float32
    return max(sizes, key=sizes.__getitem__)
