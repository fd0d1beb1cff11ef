"""Filling a meta-built module from a source following a plan, strictly (no random init)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..memory import host
from ..quant.fp8 import float8_refused, holds_float8, is_fp8
from . import fp8 as fp8_files
from . import gguf as gguf_files
from . import nvfp4 as nvfp4_files
from .key_map import KeyMap, check_key_map
from .source import WeightSource
from .staging import DeviceStager, device_stager, reading_through

logger = logging.getLogger(__name__)


def materialize(
    factory: Callable[[], nn.Module],
    plan: KeyMap,
    src: WeightSource,
    *,
    component: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    keep_fp32: Callable[[str], bool] = lambda name: False,
    quantize: str | None = None,
) -> nn.Module:
    """Build ``factory()`` on the meta device, fill it from ``src`` following ``plan``; eval mode, no grads.

    ``dtype`` applies to floating tensors except those where ``keep_fp32(name)``, loaded as float32. None
    means the stored dtype of most weights (float8 is storage only: an all-fp8 file computes in bfloat16).
    ``device="meta"`` reads no tensor data (shapes, dtypes and fp8 layers as a real load would give them).
    ``quantize`` (:func:`klein_core.files.fp8.plan_fp8`): None keeps fp8 files' block weights in fp8
    (:class:`~klein_core.quant.fp8.FP8Linear`) and dequantises other float8 tensors; ``"fp8"`` also
    quantises float block weights while loading; ``"dequantize"`` loads everything in ``dtype``.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if dtype is not None and is_fp8(dtype):
        raise ValueError(
            f"{component}: dtype {dtype} is a storage format, not a compute dtype; load with "
            "dtype=torch.bfloat16 and quantize='fp8' to keep the weights in fp8."
        )
    quantized_file = gguf_files.has_ggml(src, (k for op in plan.ops.values() for k in op.sources())) or any(
        nvfp4_files.reads_nvfp4(op, src) for op in plan.ops.values())
    if dtype is None:
        # GGUF blocks are storage only; their models compute in bf16 (as the files were made from)
        dtype = torch.bfloat16 if quantized_file else _dominant_float_dtype(plan, src)
    with torch.device("meta"):
        module = factory()
    check_key_map(module, plan, src, component)
    # Packed layers (GGML blocks, NVFP4) stay as stored or are dequantised: quantise="fp8" / "q8" /
    # "q4" converts float weights only (a packed tensor read as float would be its raw bytes).
    packed = {k for k, op in plan.ops.items() if gguf_files.reads_ggml(op, src) or nvfp4_files.reads_nvfp4(op, src)}
    fp8 = fp8_files.plan_fp8(module, {k: v for k, v in plan.ops.items() if k not in packed}, src, quantize)
    if fp8 and not holds_float8(device):  # Apple's MPS: no float8 dtypes at all
        if quantize == "fp8":
            raise float8_refused(component, device)
        logger.warning("%s: %s holds no float8 tensors; the %d fp8 weights of %s are dequantised to %s as they "
                       "load (%d bytes a weight instead of 1)", component, device.type, len(fp8), src.name, dtype,
                       dtype.itemsize)
        dequantized, fp8 = set(fp8), {}  # read below as any float8 tensor is: dequantised to dtype
    else:
        dequantized = set()
    fp8_files.swap_to_fp8_(module, fp8.values())  # free: the module is still on the meta device
    ggml = gguf_files.plan_ggml(module, {k: v for k, v in plan.ops.items() if k not in fp8 and k not in dequantized
                                         and not nvfp4_files.reads_nvfp4(v, src)}, src, quantize)
    gguf_files.swap_to_ggml_(module, ggml, dtype)
    nv = nvfp4_files.plan_nvfp4(module, plan.ops, src, quantize)
    nvfp4_files.swap_to_nvfp4_(module, nv, src, plan.ops, dtype)
    if device.type == "cpu":  # Linux ends a process that takes more than memory and swap: say so first
        _warn_if_short_of_ram(module, plan, src, component, dtype, keep_fp32, fp8, nv, ggml)
    state: dict[str, torch.Tensor] = {}
    with device_stager(device) as stager:  # CUDA: the plain weights read through page-locked buffers
        _fill(state, module, plan, src, device, dtype, keep_fp32, fp8, nv, ggml, stager)
    module.load_state_dict(state, strict=True, assign=True)
    leftovers = [n for n, b in module.named_buffers() if b.is_meta]
    if leftovers and device.type != "meta":  # a non-persistent buffer would be left on meta: a bug in the module definition
        raise RuntimeError(f"{component}: buffers left uninitialised after loading: {leftovers[:5]}")
    module.eval().requires_grad_(False)
    n = sum(p.numel() for p in module.parameters())
    logger.info("Loaded %s from %s: %.1fM parameters, %d tensors", component, src.name, n / 1e6, len(state))
    if nv:
        logger.info("%s: %d Linear layers kept in NVFP4 (dequantised per call), compute dtype %s", component,
                    len(nv), dtype)
    if ggml:
        kinds = sorted({q.name for q in ggml.values()})
        logger.info("%s: %d Linear layers kept as GGML blocks (%s), compute dtype %s", component, len(ggml),
                    ", ".join(kinds), dtype)
    if fp8:
        made = sum(1 for spec in fp8.values() if spec.quantize)
        logger.info("%s: %d Linear layers in fp8 (%d quantised while loading), compute dtype %s",
                    component, len(fp8), made, dtype)
    return module


def _fill(state: dict[str, torch.Tensor], module: nn.Module, plan: KeyMap, src: WeightSource, device: torch.device,
          dtype: torch.dtype, keep_fp32: Callable[[str], bool], fp8: dict, nv: dict, ggml: dict,
          stager: DeviceStager | None) -> None:
    """Every tensor of ``plan`` into ``state``, as :func:`materialize` plans them: what is loaded as
    stored (plain weights, fp8 weights' bytes, GGUF blocks kept packed) through ``stager`` onto a
    CUDA device; data decoded on the CPU (NVFP4, GGUF or fp8 weights dequantised) as before."""
    for name, op in plan.ops.items():
        if name in fp8:
            state.update(fp8_files.load_fp8(name, fp8[name], op, src, device, stager))
            continue
        if name in nv:
            layer = nv[name]
            if device.type == "meta":
                state.update({f"{layer}.{b}": t for b, t in module.get_submodule(layer).named_buffers()})
            else:
                state.update(nvfp4_files.load_nvfp4(name, op, src, device))
            continue
        if name in ggml:
            layer = name.rsplit(".", 1)[0]
            if device.type == "meta":
                state[f"{layer}.qweight"] = module.get_submodule(layer).qweight  # already the right shape
            else:
                state.update(gguf_files.load_ggml(name, ggml[name], op, src, device, dtype, stager))
            continue
        if device.type == "meta":  # a meta_model model: shapes and dtypes only, no tensor data read
            stored = src.dtype(op.sources()[0])
            if gguf_files.reads_ggml(op, src) or nvfp4_files.reads_nvfp4(op, src):
                stored = torch.float32  # dequantised while loading
            target = (torch.float32 if keep_fp32(name) else dtype) if stored.is_floating_point else stored
            state[name] = torch.empty(op.shape(src), dtype=target, device=device)
            continue
        if gguf_files.reads_ggml(op, src):
            t = gguf_files.dequantize_op(op, src)
        elif nvfp4_files.reads_nvfp4(op, src):
            t = nvfp4_files.dequantize_op(op, src)
        elif fp8_files.reads_fp8(op, src):
            t = fp8_files.dequantize_op(op, src)
        else:
            with reading_through(stager):
                t = op.load(src)
        if t.is_floating_point():
            target = torch.float32 if keep_fp32(name) else dtype
            t = t.to(device=device, dtype=target)
        else:
            t = t.to(device=device)
        state[name] = t.contiguous()


def _warn_if_short_of_ram(module: nn.Module, plan: KeyMap, src: WeightSource, component: str, dtype: torch.dtype,
                          keep_fp32: Callable[[str], bool], fp8: dict, nv: dict, ggml: dict) -> None:
    """One warning before a CPU load that does not fit the CPU memory available (its bytes counted
    as :func:`_fill` would make them, on the meta device: shapes only, nothing read)."""
    shapes: dict[str, torch.Tensor] = {}
    _fill(shapes, module, plan, src, torch.device("meta"), dtype, keep_fp32, fp8, nv, ggml, None)
    nbytes = sum(t.nbytes for t in shapes.values())
    short = host.shortfall(nbytes)
    if short is not None:
        logger.warning("%s: loading %s into CPU memory: %s. Close other programs, unload other models, or use "
                       "a smaller file (fp8, or a GGUF quantisation).", component, src.name, short)


def _dominant_float_dtype(plan: KeyMap, src: WeightSource) -> torch.dtype:
    """The floating dtype holding most of the plan's stored bytes (float32 if there is none;
    bfloat16 if every float tensor is float8, the dtype fp8 checkpoints are made from)."""
    sizes: dict[torch.dtype, int] = {}
    saw_fp8 = False
    for op in plan.ops.values():
        for key in op.sources():
            info = src.info(key)
            # float8 is storage only: the compute dtype comes from the other tensors.
            saw_fp8 = saw_fp8 or is_fp8(info.dtype)
            if info.dtype.is_floating_point and not is_fp8(info.dtype):
                n = 1
                for d in info.shape:
                    n *= d
                sizes[info.dtype] = sizes.get(info.dtype, 0) + n * info.dtype.itemsize
    if not sizes:
        return torch.bfloat16 if saw_fp8 else torch.float32
    return max(sizes, key=sizes.__getitem__)
