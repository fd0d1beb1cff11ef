"""A training checkpoint's state in a safetensors file: the tensors as tensors, everything else (step,
losses, the optimizer's hyper-parameters, key types) as JSON in its metadata. Nothing is unpickled on
resume, whoever wrote the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import WeightFormatError
from ..files.atomic import atomic_path
from ..files.safetensors import open_safetensors

_META_KEY = "klein.trainer_state"


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().to("cpu").contiguous().clone()
        return {"__tensor__": name}
    if isinstance(value, dict):  # keys keep their type (an optimizer's state is keyed by int)
        return {"__dict__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a training state holds a {type(value).__name__}, which a checkpoint cannot store")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__tuple__" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__dict__"]}
    return value


def save_state(state: dict, path: str | Path) -> None:
    """Write ``state`` (nested dicts, lists and tuples of tensors and plain values) to ``path``,
    atomically (a temporary file beside it, then a rename)."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(tree)})


def load_state(path: str | Path) -> dict:
    """The state :func:`save_state` wrote. A file that is not one (another safetensors file, a pickle, a
    truncated file) raises WeightFormatError naming it; nothing is unpickled."""
    path = Path(path)
    sf = open_safetensors(path, "training checkpoint")  # names pickles, zips and broken files
    meta = sf.metadata.get(_META_KEY)
    if meta is None:
        raise WeightFormatError(f"{path}: not a klein_core training checkpoint (no '{_META_KEY}' metadata)")
    try:
        state = _decode(json.loads(meta), {name: sf.read(name) for name in sf.tensors})
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightFormatError(f"{path}: cannot read this training checkpoint ({exc})") from None
    if not isinstance(state, dict):
        raise WeightFormatError(f"{path}: not a klein_core training checkpoint")
    return state


__all__ = ["load_state", "save_state"]
