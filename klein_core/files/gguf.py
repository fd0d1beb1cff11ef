"""GGUF files (llama.cpp's format): Klein transformers and Qwen3 text encoders, quantised blocks kept.

Read with the ``gguf`` package (llama.cpp's own reader; ``pip install klein-nodes[gguf]``). Names:

* transformers (city96 / unsloth files for ComfyUI-GGUF, stable-diffusion.cpp conversions): the BFL
  checkpoint names (``double_blocks.0.img_attn.qkv.weight``), optionally prefixed
  ``model.diffusion_model.`` (stripped);
* Qwen3 (llama.cpp conversions): ``blk.N.attn_q.weight``... mapped one name at a time to the
  Hugging Face names (``model.layers.N.self_attn.q_proj.weight``); Qwen3's q/k weights are stored
  unpermuted, so nothing else changes.

Shapes are GGUF's ``ne`` reversed (torch order), or ``comfy.gguf.orig_shape.<name>`` when a file
carries it. Float tensors (F32, F16, BF16) read as such; quantised ones read as their raw uint8
blocks, with a :class:`GGMLTensorInfo` saying their type, so :func:`plan_ggml` can keep them
quantised (:class:`~klein_core.quant.ggml.GGMLLinear`) and everything else dequantises exactly.
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import WeightFormatError
from ..models.layers import replace_module
from ..quant.fp8 import block_linear_names
from ..quant.ggml import BLOCKS, FLOAT_TYPES, QUANTIZE_TYPES, GGMLLinear, GGMLType, dequantize, quantize
from .plan import DecodingView, Op, Take, quantizable_linears
from .source import TensorInfo, WeightSource

logger = logging.getLogger(__name__)

MAGIC = b"GGUF"
_PREFIX = "model.diffusion_model."
_ORIG_SHAPE = "comfy.gguf.orig_shape."
_QWEN3_LAYER = {  # llama.cpp block tensor -> Hugging Face module path under model.layers.N
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_QWEN3_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TORCH_FLOAT = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


@dataclass(frozen=True, eq=False)
class GGMLTensorInfo(TensorInfo):
    """A quantised GGUF tensor: ``shape`` is its torch shape, ``dtype`` float32 (what it stands for:
    plans and shape checks treat it as a float tensor; reading it gives its uint8 blocks, which only
    the GGML-aware load paths do), ``qtype`` the GGML type."""

    qtype: GGMLType = GGMLType.Q8_0

    @property
    def nbytes(self) -> int:
        elems, nbytes = BLOCKS[self.qtype]
        return math.prod(self.shape) // elems * nbytes


def is_gguf(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise WeightFormatError(
            f"{path}: this is a GGUF file; reading it needs the 'gguf' package: pip install gguf (or "
            "pip install 'klein-nodes[gguf]'), then load it again.") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return gguf.GGUFReader(path, mode="r")
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise WeightFormatError(f"{path}: not a readable GGUF file ({str(exc)[:160]}); it may be truncated. "
                                "Download it again.") from None


def _field(reader, key: str):
    f = reader.get_field(key)
    if f is None:
        return None
    try:
        return f.contents()
    except (ValueError, IndexError, AttributeError):
        return None


def _hf_name(name: str) -> str:
    """A llama.cpp Qwen3 tensor name as the Hugging Face one (other names unchanged)."""
    m = _BLK.match(name)
    if m and m.group(2) in _QWEN3_LAYER:
        return f"model.layers.{m.group(1)}.{_QWEN3_LAYER[m.group(2)]}.{m.group(3)}"
    stem, _, leaf = name.rpartition(".")
    if stem in _QWEN3_TOP and leaf in ("weight", "bias"):
        return f"{_QWEN3_TOP[stem]}.{leaf}"
    return name


def _scan(path: Path):
    """(reader, {our name: (reader tensor, info)}, metadata) of a GGUF file."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    names = [t.name for t in reader.tensors]
    prefixed = any(n.startswith(_PREFIX) for n in names)
    out: dict[str, tuple[object, TensorInfo]] = {}
    for t in reader.tensors:
        name = t.name
        if prefixed:  # as ComfyUI-GGUF: with any prefixed name, only prefixed tensors are the model
            if not name.startswith(_PREFIX):
                continue
            name = name[len(_PREFIX):]
        try:
            qtype = GGMLType(int(t.tensor_type))
        except ValueError:
            kind = getattr(t.tensor_type, "name", str(t.tensor_type))
            raise WeightFormatError(
                f"{path}: tensor '{t.name}' is of GGML type {kind}, which klein_core does not read (it reads "
                f"{', '.join(q.name for q in GGMLType)}); use a file quantised to one of those.") from None
        orig = _field(reader, _ORIG_SHAPE + t.name)
        shape = tuple(int(v) for v in orig) if orig else tuple(int(v) for v in reversed(list(t.shape)))
        if qtype in FLOAT_TYPES:
            info: TensorInfo = TensorInfo(shape, _TORCH_FLOAT[qtype])
        else:
            info = GGMLTensorInfo(shape, torch.float32, qtype)
        out[_hf_name(name) if arch in ("qwen3", "qwen2", "llama") or name.startswith("blk.") else name] = (t, info)
    metadata = {"format": "gguf", "general.architecture": str(arch) if arch is not None else ""}
    name = _field(reader, "general.name")
    if name:
        metadata["general.name"] = str(name)
    return reader, out, metadata


def gguf_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Our name -> :class:`TensorInfo` for every tensor of a GGUF file (no tensor data read)."""
    return {k: info for k, (_, info) in _scan(Path(path))[1].items()}


def gguf_source(path: str | os.PathLike, component: str = "weights") -> WeightSource:
    """A :class:`WeightSource` over a GGUF file; every read copies the tensor out of the file (the
    model never depends on the file afterwards)."""
    path = Path(path)
    reader, tensors, metadata = _scan(path)
    if not tensors:
        raise WeightFormatError(f"{path}: a GGUF file holding no {component} tensors; it is truncated or not a "
                                "model. Download it again.")

    def read(key: str) -> torch.Tensor:
        t, info = tensors[key]
        data = np.array(t.data, copy=True)  # owned: never a view of the memory-mapped file
        if isinstance(info, GGMLTensorInfo):
            raw = torch.from_numpy(data.view(np.uint8).reshape(-1))
            if raw.numel() != info.nbytes:
                raise WeightFormatError(f"{path}: tensor '{key}' has {raw.numel()} bytes, {info.nbytes} expected for "
                                        f"{info.qtype.name} {list(info.shape)}; the file is corrupt.")
            return raw
        return torch.from_numpy(data.view(np.uint8).reshape(-1)).view(info.dtype).reshape(info.shape)

    logger.info("%s: GGUF (%s), %d tensors, types %s", path.name, metadata["general.architecture"] or "no architecture",
                len(tensors), sorted({getattr(i, "qtype", None).name if isinstance(i, GGMLTensorInfo) else str(i.dtype)
                                      for _, i in tensors.values()}))
    del reader
    return WeightSource(str(path), {k: i for k, (_, i) in tensors.items()}, read, metadata)


# ----- loading into a model -------------------------------------------------------------------------


def is_quantized(src: WeightSource, key: str) -> bool:
    return isinstance(src.info(key), GGMLTensorInfo)


def reads_ggml(op: Op, src: WeightSource) -> bool:
    return any(is_quantized(src, k) for k in op.sources())


def _decode(info: TensorInfo, raw: torch.Tensor) -> torch.Tensor:
    return dequantize(raw, info.qtype, info.shape) if isinstance(info, GGMLTensorInfo) else raw


def dequantize_op(op: Op, src: WeightSource) -> torch.Tensor:
    """An op whose sources include GGML tensors, computed on their exact float32 values."""
    return op.load(DecodingView(src, _decode))  # type: ignore[arg-type]


def plan_ggml(module: nn.Module, ops: Mapping[str, Op], src: WeightSource, quantize_mode: str | None) -> dict[str, GGMLType]:
    """Which ``<layer>.weight`` stay (or become) GGML blocks: every Linear whose weight is one
    quantised GGUF tensor (unless ``quantize_mode == "dequantize"``), and with ``"q8"`` / ``"q4"`` the
    model's repeated-block Linears (as fp8 quantises them) whose rows are whole blocks."""
    linears = quantizable_linears(module)
    out: dict[str, GGMLType] = {}
    if quantize_mode != "dequantize":
        for name, op in ops.items():
            layer = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and layer in linears and isinstance(op, Take) and is_quantized(src, op.key):
                out[name] = src.info(op.key).qtype  # type: ignore[attr-defined]
    target = QUANTIZE_TYPES.get(quantize_mode or "")
    if target is not None:
        elems = BLOCKS[target][0]
        for layer in block_linear_names(module):
            name = layer + ".weight"
            if name in out or name not in ops:
                continue
            if module.get_submodule(layer).in_features % elems:  # type: ignore[operator]
                logger.info("%s stays unquantised: %d inputs are not whole %s blocks", layer,
                            module.get_submodule(layer).in_features, target.name)
                continue
            out[name] = target
    return out


def swap_to_ggml_(module: nn.Module, layers: Mapping[str, GGMLType], dtype: torch.dtype) -> None:
    """Replace each ``nn.Linear`` named in ``layers`` by a :class:`GGMLLinear` (on the meta device)
    computing in ``dtype``."""
    for name, qtype in layers.items():
        path = name.rsplit(".", 1)[0]
        lin = module.get_submodule(path)
        new = GGMLLinear(lin.in_features, lin.out_features, qtype, lin.bias is not None, device="meta")
        new.compute_dtype = dtype
        replace_module(module, path, new)


def load_ggml(name: str, qtype: GGMLType, op: Op, src: WeightSource, device: torch.device,
              dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state of one :class:`GGMLLinear` (``<layer>.qweight``): the file's blocks as they are, or
    a float weight quantised on ``device`` (the float copy never stays there)."""
    layer = name.rsplit(".", 1)[0]
    if isinstance(op, Take) and is_quantized(src, op.key):
        raw = src.get(op.key)
        out_features = op.shape(src)[0]
        return {f"{layer}.qweight": raw.reshape(out_features, -1).to(device)}
    w = dequantize_op(op, src) if reads_ggml(op, src) else op.load(src)
    # Quantise the weight as the compute dtype would hold it, on the target device.
    return {f"{layer}.qweight": quantize(w.to(device=device, dtype=dtype), qtype)}


def has_ggml(src: WeightSource, keys: Iterable[str] | None = None) -> bool:
    return any(is_quantized(src, k) for k in (keys if keys is not None else src.keys()))


__all__ = [
    "GGMLTensorInfo", "dequantize_op", "gguf_header", "gguf_source", "has_ggml", "is_gguf", "load_ggml",
    "plan_ggml", "reads_ggml", "swap_to_ggml_",
]
