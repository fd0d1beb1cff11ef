"""Files in the exact layouts of the public Klein checkpoints, with zero data (sparse on disk).

``tests/data/real_layouts/*.json`` (a copy of ``shared/data/real_layouts``) give every tensor name,
shape and dtype, the ``__metadata__`` and the header length of each public file. :func:`write_layout`
writes a file with exactly that header, serialised as the safetensors writer does it (compact JSON,
tensors ordered by dtype size then name, padded with spaces to a multiple of 8), so its header
length and total size are those of the real file, and then extends it to the full size with
``os.truncate``, which allocates no disk. The only bytes written besides the header are the small
tensors the manifest gives values for (ComfyUI's ``.comfy_quant`` JSON markers).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

LAYOUTS = Path(__file__).resolve().parent / "data" / "real_layouts"
_SIZES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
          "U8": 1, "I8": 1, "BOOL": 1}


def manifests() -> dict[str, dict]:
    """Every manifest by file stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(LAYOUTS.glob("*.json"))}


def _nbytes(shape: list[int], dtype: str) -> int:
    n = _SIZES[dtype]
    for s in shape:
        n *= s
    return n


def header_bytes(tensors: dict[str, list], metadata: dict | None, pad_to: int | None = None) -> tuple[bytes, dict]:
    """``(padded header JSON, {name: (offset, nbytes)})`` as the safetensors writer lays them out."""
    order = sorted(tensors.items(), key=lambda kv: (-_SIZES[kv[1][1]], kv[0]))
    header: dict = {"__metadata__": metadata} if metadata else {}
    where = {}
    offset = 0
    for name, (shape, dtype) in order:
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        where[name] = (offset, n)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    target = pad_to if pad_to is not None else (len(raw) + 7) // 8 * 8
    if target < len(raw):
        raise ValueError(f"header needs {len(raw)} bytes, more than {target}")
    return raw + b" " * (target - len(raw)), where


def write_safetensors(path: Path, tensors: dict[str, list], metadata: dict | None,
                      values: dict[str, bytes] | None = None, pad_to: int | None = None) -> int:
    """Write a sparse safetensors file; ``values`` gives the bytes of some tensors (others are zero).
    Returns the header length."""
    raw, where = header_bytes(tensors, metadata, pad_to)
    total = 8 + len(raw) + sum(n for _, n in where.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for name, data in (values or {}).items():
            offset, n = where[name]
            if len(data) != n:
                raise ValueError(f"{name}: {len(data)} bytes given, the layout has {n}")
            fh.seek(8 + len(raw) + offset)
            fh.write(data)
    os.truncate(path, total)
    return len(raw)


def _shards(manifest: dict) -> list[str]:
    """Shard file names for the manifests of multi-file Hugging Face folders, else []."""
    file = manifest["file"]
    if "model-0000{1,2}-of-00002" in file:
        return [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    if "model-0000{1..4}-of-00004" in file:
        return [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    if "diffusion_pytorch_model*" in file:
        return [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    return []


def file_name(stem: str, manifest: dict) -> str:
    """The public file name of a single-file manifest (its ``file`` field), or the stem for folders."""
    name = manifest["file"]
    return name if name.endswith(".safetensors") and " " not in name else stem


def write_layout(stem: str, manifest: dict, root: Path) -> Path:
    """Write the file (or sharded folder) of ``manifest`` under ``root / stem``; returns what to load.

    A single file keeps its public name; a sharded Hugging Face folder gets its shards (tensors
    split in key order) and the ``*.safetensors.index.json`` naming them.
    """
    tensors = manifest["tensors"]
    values = {k: v.encode() for k, v in manifest.get("small_tensor_values", {}).items()}
    shards = _shards(manifest)
    if not shards:  # its own folder: several manifests are hypotheses for one public file name
        path = root / stem / file_name(stem, manifest)
        n = write_safetensors(path, tensors, manifest["metadata"], values)
        assert n == manifest["header_json_bytes"], (stem, n, manifest["header_json_bytes"])
        if manifest.get("predicted_size_bytes"):
            assert path.stat().st_size == manifest["predicted_size_bytes"], stem
        return path
    folder = root / stem
    keys = sorted(tensors)
    per = -(-len(keys) // len(shards))
    weight_map = {}
    for i, shard in enumerate(shards):
        part = {k: tensors[k] for k in keys[i * per : (i + 1) * per]}
        write_safetensors(folder / shard, part, manifest["metadata"], {k: values[k] for k in part if k in values})
        weight_map |= {k: shard for k in part}
    index = "model.safetensors.index.json" if shards[0].startswith("model-") else \
        "diffusion_pytorch_model.safetensors.index.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder
