"""Writing GGUF test files with gguf-py (llama.cpp's writer), in the namings published files use:
BFL names for Klein transformers (city96 / unsloth), llama.cpp ``blk.N.*`` names for Qwen3."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from klein_core.testing import tiny_text_encoder, tiny_transformer

KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(name: str, rows: int, cols: int, rng, scale: float = 0.02, finite: bool = True) -> np.ndarray:
    """Valid blocks of any GGML type: random codes, small fp16 scales (or fully random bytes)."""
    import gguf

    qt = getattr(gguf.GGMLQuantizationType, name)
    elems, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    if finite:
        for off in F16_FIELDS[name]:
            vals = (rng.standard_normal(raw.shape[:2]) * scale).astype(np.float16)
            raw[..., off:off + 2] = vals.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_gguf(path: str | Path, tensors: dict, arch: str | None, fields: dict | None = None) -> Path:
    """``tensors``: name -> (float32 array in torch shape, type name). K types get random blocks
    (gguf-py has no K quantiser)."""
    import gguf

    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch=arch or "flux")
    for key, value in (fields or {}).items():
        w.add_array(key, value) if isinstance(value, list) else w.add_string(key, value)
    rng = np.random.default_rng(7)
    for name, (arr, kind) in tensors.items():
        if kind == "F32":
            w.add_tensor(name, arr.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif kind in KQUANTS:
            w.add_tensor(name, random_blocks(kind, arr.shape[0], arr.shape[1], rng), raw_dtype=getattr(T, kind))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, getattr(T, kind)), raw_dtype=getattr(T, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def block_kind(name: str, arr: np.ndarray, block: str) -> str:
    """How converters store a Klein tensor: 1-D in F32, repeated blocks quantised, the rest F16."""
    if arr.ndim == 1:
        return "F32"
    if name.startswith(("double_blocks.", "single_blocks.")):
        return block
    return "F16"


@lru_cache(maxsize=1)
def _llama_qwen3_names():
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 64)


def hf_to_llama(name: str) -> str:
    """A Hugging Face Qwen3 tensor name as llama.cpp writes it, from gguf-py's own name map (the one
    llama.cpp's converter uses), never from klein_core's table, which these files test."""
    mapped = _llama_qwen3_names().get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise KeyError(f"gguf-py has no llama.cpp name for {name!r}")
    return mapped


def write_tiny_gguf_transformer(path: str | Path, block: str = "Q8_0", seed: int = 0) -> Path:
    """The tiny 4B-family transformer of klein_core.testing as a GGUF (arch "flux", BFL names)."""
    sd = {k: v.float().numpy() for k, v in tiny_transformer(seed=seed).state_dict().items()}
    return write_gguf(path, {k: (v, block_kind(k, v, block)) for k, v in sd.items()}, "flux")


def write_tiny_gguf_qwen(path: str | Path, block: str = "Q8_0", seed: int = 0) -> Path:
    """The tiny 4B-family Qwen3 encoder as a llama.cpp GGUF (arch "qwen3", blk.N names)."""
    sd = {"model." + k: v.float().numpy() for k, v in tiny_text_encoder(seed=seed).state_dict().items()}
    return write_gguf(path, {hf_to_llama(k): (v, "F32" if v.ndim == 1 else block) for k, v in sd.items()}, "qwen3")


def dequantized_values(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file as gguf's own reader dequantises it (torch names and shapes)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = tuple(int(v) for v in reversed(list(t.shape)))
        out[t.name] = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(shape).float()
    return out
