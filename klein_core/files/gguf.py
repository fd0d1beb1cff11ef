"""GGUF files (llama.cpp's format): Klein transformers and Qwen3 text encoders, quantised blocks kept.

Read with the ``gguf`` package (``pip install klein-nodes[gguf]``). Transformers carry BFL names
(``double_blocks.0.img_attn.qkv.weight``; a ``model.diffusion_model.`` prefix is stripped); Qwen3's
llama.cpp names (``blk.N.attn_q.weight``) map one by one to Hugging Face names. Shapes are GGUF's
``ne`` reversed, or ``comfy.gguf.orig_shape.<name>``. Float tensors read as such, quantised ones as
raw uint8 blocks with a :class:`GGMLTensorInfo`, so :func:`plan_ggml` can keep them quantised
(:class:`~klein_core.quant.ggml.GGMLLinear`); everything else dequantises exactly.

Hostile files: :func:`_prescan` checks every count in the header against the file's size before
gguf-py parses it, and tensor data is read with file reads (no memory map), re-checking the file's
identity: a file truncated or rewritten after it was opened is refused ("changed on disk").
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
import struct
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import WeightFormatError
from ..models.layers import replace_module
from ..quant.fp8 import block_linear_names
from ..quant.ggml import BLOCKS, FLOAT_TYPES, QUANTIZE_TYPES, GGMLLinear, GGMLType, dequantize, quantize
from .key_map import DecodingView, Op, Take, quantizable_linears
from .safetensors import SafetensorsFile, StoredTensor, _identity, _open_regular
from .source import TensorInfo, WeightSource
from .staging import DeviceStager, reading_through

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


# ----- header pre-scan: every count checked against the file's size before gguf-py reads it -----

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> size
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
# gguf-py walks arrays and tensor infos one element at a time (~17 us an element): bound the work a
# header can ask for. A Qwen3 file's tokenizer arrays hold ~455k elements in all (~8 s in gguf-py), so
# a hostile header costs at most about twice that; Klein and Qwen3 files have < 1,000 tensors.
_MAX_ARRAY_ITEMS = 1 << 20
_MAX_TENSORS = 1 << 16


class _Header:
    """Bounded reads of a GGUF header: each length is checked against what is left of the file."""

    def __init__(self, path: Path, fh, size: int) -> None:
        self.path, self.fh, self.size, self.pos, self.order, self.items = path, fh, size, 0, "<", 0

    def fail(self, what: str, claim: str) -> WeightFormatError:
        return WeightFormatError(
            f"{self.path}: {what} claims {claim} at byte {self.pos}, but the file has only {self.size} bytes; "
            "the GGUF header is corrupt or the file is truncated. Download it again.")

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise self.fail(what, f"{n} bytes")
        data = self.fh.read(n)
        if len(data) != n:  # the file shrank while it was read
            raise self.fail(what, f"{n} bytes")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(what, f"{n} bytes")
        self.fh.seek(n, os.SEEK_CUR)
        self.pos += n

    def num(self, fmt: str, what: str) -> int:
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, min_bytes: int, cap: int | None = None) -> int:
        """A u64 count of items of at least ``min_bytes`` each, checked against the bytes left."""
        n = self.num("Q", what)
        if n * min_bytes > self.size - self.pos:
            raise self.fail(what, f"{n:,} items")
        if cap is not None and n > cap:
            raise WeightFormatError(f"{self.path}: {what} is {n:,}, more than any Klein or Qwen3 file holds "
                                    f"({cap:,} at most); the GGUF header is corrupt.")
        return n

    def string(self, what: str, keep: bool) -> str:
        n = self.count(f"the length of {what}", 1)
        if not keep:
            self.skip(n, what)
            return ""
        return self.take(n, what).decode("utf-8", "replace")

    def value(self, vtype: int, what: str) -> int | None:
        """Skip one value of GGUF type ``vtype`` (returning a u32's value, for general.alignment)."""
        if vtype in _SCALAR_BYTES:
            if vtype == _UINT32:
                return self.num("I", what)
            self.skip(_SCALAR_BYTES[vtype], what)
        elif vtype == _STRING:
            self.string(what, keep=False)
        elif vtype == _ARRAY:
            itype = self.num("I", f"the item type of {what}")
            if itype not in _SCALAR_BYTES and itype not in (_STRING, _ARRAY):
                raise WeightFormatError(f"{self.path}: {what} is an array of unknown GGUF type {itype}; the "
                                        "file is corrupt.")
            n = self.count(f"the length of {what}", _SCALAR_BYTES.get(itype, 8 if itype == _STRING else 12))
            self.items += n
            if self.items > _MAX_ARRAY_ITEMS:
                raise WeightFormatError(f"{self.path}: {what} makes the metadata arrays hold more than "
                                        f"{_MAX_ARRAY_ITEMS:,} elements, more than any Klein or Qwen3 file holds; "
                                        "the GGUF header is corrupt.")
            if itype in _SCALAR_BYTES:
                self.skip(n * _SCALAR_BYTES[itype], what)
            else:
                for _ in range(n):
                    self.value(itype, what)
        else:
            raise WeightFormatError(f"{self.path}: {what} has unknown GGUF value type {vtype}; the file is corrupt.")
        return None


def _prescan(path: Path, fh, size: int, quant_sizes: Mapping[int, tuple[int, int]]) -> int:
    """Validate the sizes in a GGUF header (v2/v3: magic, version, u64 tensor and key-value counts;
    key-values as string key + u32 type + value, strings as u64 length + bytes, arrays as u32 item
    type + u64 count + items; tensor infos as name + u32 n_dims + u64 dims + u32 type + u64 offset)
    without building anything. Returns the header's length (where gguf-py stops reading)."""
    h = _Header(path, fh, size)
    if h.take(4, "the GGUF magic") != MAGIC:
        raise WeightFormatError(f"{path}: not a GGUF file (no GGUF magic).")
    version = h.num("I", "the GGUF version")
    if version & 0xFFFF == 0:  # written on a big-endian machine (gguf-py reads those too)
        h.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise WeightFormatError(f"{path}: GGUF version {version}, which cannot be read (versions 2 and 3 can); "
                                "convert the file again with a current llama.cpp or ComfyUI-GGUF.")
    n_tensors = h.count("the tensor count", 24, _MAX_TENSORS)  # name length, n_dims, type, offset
    n_kv = h.count("the key-value count", 13)  # key length, type, a one-byte value at least
    alignment = 32
    for i in range(n_kv):
        key = h.string(f"the key of metadata field {i}", keep=True)
        value = h.value(h.num("I", f"the type of field '{key}'"), f"field '{key}'")
        if key == "general.alignment":
            if value is None or value == 0 or value & (value - 1):
                raise WeightFormatError(f"{path}: field 'general.alignment' must be a power of two (a uint32); "
                                        "the file is corrupt.")
            alignment = value
    extents = []
    for i in range(n_tensors):
        name = h.string(f"the name of tensor {i}", keep=True)
        n_dims = h.num("I", f"the dimension count of tensor '{name}'")
        if n_dims * 8 > size - h.pos:
            raise h.fail(f"the dimension count of tensor '{name}'", f"{n_dims:,} dimensions")
        dims = [h.num("Q", f"the dimensions of tensor '{name}'") for _ in range(n_dims)]
        qtype = h.num("I", f"the type of tensor '{name}'")
        offset = h.num("Q", f"the data offset of tensor '{name}'")
        if qtype in quant_sizes:
            elems, nbytes = quant_sizes[qtype]
            numel = math.prod(dims)
            extents.append((name, dims, offset, numel * nbytes // elems))
    data_start = -(-h.pos // alignment) * alignment
    for name, dims, offset, nbytes in extents:
        if data_start + offset + nbytes > size:
            raise WeightFormatError(
                f"{path}: tensor '{name}' (dimensions {dims}) claims {nbytes:,} bytes at offset {offset:,} of the "
                f"data, past the end of the file ({size:,} bytes); the file is truncated or corrupt. Download it "
                "again.")
    return h.pos


def _private_header(fh, length: int, size: int):
    """A private copy of the file's first ``length`` bytes, as long as the file (the rest a hole):
    what gguf-py maps, so nobody can truncate it under the parse. None where Linux's memfd is missing."""
    if not hasattr(os, "memfd_create"):
        return None
    fh.seek(0)
    head = fh.read(length)
    fd = os.memfd_create("klein-gguf-header")
    try:
        view = memoryview(head)
        while view:
            view = view[os.write(fd, view):]
        os.ftruncate(fd, size)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _reader(path: Path):
    """(gguf-py reader of the header, the file's identity when opened)."""
    try:
        import gguf
    except ImportError:
        raise WeightFormatError(
            f"{path}: this is a GGUF file; reading it needs the 'gguf' package: pip install gguf (or "
            "pip install 'klein-nodes[gguf]'), then load it again.") from None
    private = None
    try:
        with _open_regular(path) as raw:
            st = os.fstat(raw.fileno())
            fh = io.BufferedReader(raw, 1 << 20)
            length = _prescan(path, fh, st.st_size, {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()})
            private = _private_header(fh, length, st.st_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # gguf-py maps what it parses: the private copy where there is one, else the file itself
            # (a file truncated during these milliseconds is then the one window left; every tensor
            # read below is a checked file read).
            reader = gguf.GGUFReader(private if private is not None else path, mode="r")
        return reader, _identity(st)
    except WeightFormatError:
        raise
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise WeightFormatError(f"{path}: not a readable GGUF file ({str(exc)[:160]}); it may be truncated. "
                                "Download it again.") from None
    finally:
        if private is not None:
            private.close()  # the reader's map stays valid without the descriptor


def _string_field(reader, key: str, path: Path) -> str | None:
    f = reader.get_field(key)
    if f is None:
        return None
    if [int(t) for t in f.types] != [_STRING]:
        raise WeightFormatError(f"{path}: field '{key}' is not a string; the GGUF metadata is corrupt.")
    return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")


def _orig_shape(reader, name: str, numel: int, path: Path) -> tuple[int, ...] | None:
    """``comfy.gguf.orig_shape.<name>`` (ComfyUI-GGUF's true torch shape), checked: a non-empty
    array of non-negative integers holding the tensor's element count."""
    key = _ORIG_SHAPE + name
    f = reader.get_field(key)
    if f is None:
        return None
    types = [int(t) for t in f.types]
    values = [f.parts[i] for i in f.data] if types[:1] == [_ARRAY] else []
    if types[:1] != [_ARRAY] or (values and types[1:] and types[1] not in _INT_TYPES) or not values:
        raise WeightFormatError(f"{path}: field '{key}' is not an array of integers; the GGUF metadata is "
                                "corrupt.")
    shape = tuple(int(v[0]) for v in values)
    if any(d < 0 for d in shape) or math.prod(shape) != numel:
        raise WeightFormatError(f"{path}: field '{key}' gives shape {list(shape)} ({math.prod(shape):,} elements) "
                                f"for a tensor of {numel:,} elements; the GGUF metadata is corrupt.")
    return shape


def _hf_name(name: str) -> str:
    """A llama.cpp Qwen3 tensor name as the Hugging Face one (other names unchanged)."""
    m = _BLK.match(name)
    if m and m.group(2) in _QWEN3_LAYER:
        return f"model.layers.{m.group(1)}.{_QWEN3_LAYER[m.group(2)]}.{m.group(3)}"
    stem, _, leaf = name.rpartition(".")
    if stem in _QWEN3_TOP and leaf in ("weight", "bias"):
        return f"{_QWEN3_TOP[stem]}.{leaf}"
    return name


def _llama_named(names: Iterable[str]) -> bool:
    """Whether tensors are named as llama.cpp names a Qwen3 text encoder (``blk.N.attn_q.weight``,
    ``token_embd.weight``): names no Klein transformer uses, whatever ``general.architecture`` says."""
    return any(_BLK.match(n) or n.rpartition(".")[0] in ("token_embd", "output_norm") for n in names)


def _scan(path: Path):
    """({our name: (StoredTensor, info)}, metadata, identity) of a GGUF file."""
    reader, identity = _reader(path)
    arch = _string_field(reader, "general.architecture", path)
    names = [t.name for t in reader.tensors]
    prefixed = any(n.startswith(_PREFIX) for n in names)
    kept = [t for t in reader.tensors if not prefixed or t.name.startswith(_PREFIX)]
    # The names decide how to read a file: a Qwen3 file whose architecture field says "flux" is still
    # a Qwen3 file, read whole in Hugging Face names (not half renamed, then refused).
    llama = arch in ("qwen3", "qwen2", "llama") or _llama_named(
        t.name[len(_PREFIX):] if prefixed else t.name for t in kept)
    if llama and arch not in ("qwen3", "qwen2", "llama"):
        logger.warning("%s: field 'general.architecture' says %r, but the tensors are named as llama.cpp names a "
                       "Qwen3 text encoder; reading them as such", path, arch)
    out: dict[str, tuple[StoredTensor, TensorInfo]] = {}
    for t in kept:  # as ComfyUI-GGUF: with any prefixed name, only prefixed tensors are the model
        name = t.name[len(_PREFIX):] if prefixed else t.name
        try:
            qtype = GGMLType(int(t.tensor_type))
        except ValueError:
            kind = getattr(t.tensor_type, "name", str(t.tensor_type))
            raise WeightFormatError(
                f"{path}: tensor '{t.name}' is of GGML type {kind}, which klein_core does not read (it reads "
                f"{', '.join(q.name for q in GGMLType)}); use a file quantised to one of those.") from None
        numel = int(t.n_elements)
        shape = _orig_shape(reader, t.name, numel, path) or tuple(int(v) for v in reversed(list(t.shape)))
        if qtype in FLOAT_TYPES:
            info: TensorInfo = TensorInfo(shape, _TORCH_FLOAT[qtype])
            nbytes = numel * info.dtype.itemsize
            stored = StoredTensor(shape, info.dtype, int(t.data_offset), nbytes)
        else:
            info = GGMLTensorInfo(shape, torch.float32, qtype)
            nbytes = info.nbytes
            stored = StoredTensor((nbytes,), torch.uint8, int(t.data_offset), nbytes)
        if nbytes != int(t.n_bytes):
            raise WeightFormatError(f"{path}: tensor '{t.name}' has {int(t.n_bytes)} bytes, {nbytes} expected for "
                                    f"{qtype.name} {list(shape)}; the file is corrupt.")
        key = _hf_name(name) if llama else name
        if key in out:
            raise WeightFormatError(f"{path}: two tensors are read as '{key}'; the file is corrupt.")
        out[key] = (stored, info)
    metadata = {"format": "gguf", "general.architecture": arch or ""}
    name = _string_field(reader, "general.name", path)
    if name:
        metadata["general.name"] = name
    return out, metadata, identity


def gguf_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Our name -> :class:`TensorInfo` for every tensor of a GGUF file (no tensor data read)."""
    return {k: info for k, (_, info) in _scan(Path(path))[0].items()}


def gguf_source(path: str | os.PathLike, component: str = "weights") -> WeightSource:
    """A :class:`WeightSource` over a GGUF file; every read copies the tensor out of the file (the
    model never depends on the file afterwards)."""
    path = Path(path)
    tensors, metadata, identity = _scan(path)
    if not tensors:
        raise WeightFormatError(f"{path}: a GGUF file holding no {component} tensors; it is truncated or not a "
                                "model. Download it again.")
    # File reads checked as safetensors reads are (never the memory map: a file truncated after it
    # was opened would kill the process with SIGBUS; one rewritten in place is refused).
    data = SafetensorsFile(path, {k: st for k, (st, _) in tensors.items()}, {}, 0, identity)

    logger.info("%s: GGUF (%s), %d tensors, types %s", path.name, metadata["general.architecture"] or "no architecture",
                len(tensors), sorted({getattr(i, "qtype", None).name if isinstance(i, GGMLTensorInfo) else str(i.dtype)
                                      for _, i in tensors.values()}))
    return WeightSource(str(path), {k: i for k, (_, i) in tensors.items()}, data.read, metadata)


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
              dtype: torch.dtype, stager: DeviceStager | None = None) -> dict[str, torch.Tensor]:
    """The state of one :class:`GGMLLinear` (``<layer>.qweight``): the file's blocks as they are
    (read through ``stager`` onto the device, if given: a copy of the bytes), or a float weight
    quantised on ``device`` (the float copy never stays there)."""
    layer = name.rsplit(".", 1)[0]
    if isinstance(op, Take) and is_quantized(src, op.key):
        with reading_through(stager):
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
