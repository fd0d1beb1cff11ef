"""Weight sources: one read-only, lazily read view over a file, a folder of shards or a state dict.

A :class:`WeightSource` knows every tensor's shape and dtype up front (from the safetensors
header, or the tensors of a dict) and reads a tensor's bytes only when asked. Files are read by
:mod:`klein_core.files.safetensors` (owned copies, never memory maps). Hugging Face folders are
read shard by shard, following their ``*.safetensors.index.json`` when there is one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import WeightFormatError
from .safetensors import open_safetensors

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


def file_source(path: Path, component: str = "weights") -> WeightSource:
    f = open_safetensors(path, component)
    infos = {k: TensorInfo(v.shape, v.dtype) for k, v in f.tensors.items()}
    return WeightSource(str(path), infos, f.read, f.metadata)


def sharded_source(name: str, files: Sequence[Path], key_to_file: Mapping[str, Path] | None) -> WeightSource:
    """One source over several shards. ``key_to_file`` (a shard index's ``weight_map``) settles which
    copy of a tensor held by two shards is read; the shards' own headers say where each tensor is, as
    for transformers' and diffusers' loaders, which read every shard whole: an index that lists a
    tensor under another shard than the one holding it still loads (with a warning)."""
    parts = {f: file_source(f) for f in files}
    infos: dict[str, TensorInfo] = {}
    owner: dict[str, Path] = {}
    metadata: dict[str, str] = {}
    for f, src in parts.items():
        metadata.update(src.metadata)
        for k in src.keys():
            listed = key_to_file.get(k) if key_to_file is not None else None
            if k in owner:
                if listed == owner[k]:
                    continue  # the index names the copy already taken
                if listed != f:
                    raise WeightFormatError(f"{name}: tensor '{k}' appears in two shards ({owner[k]}, {f}).")
            infos[k] = src.info(k)
            owner[k] = f
    if key_to_file is not None:
        absent = [k for k in key_to_file if k not in infos]
        if absent:
            raise WeightFormatError(
                f"{name}: the shard index lists {len(absent)} tensors that no shard holds (first: "
                + ", ".join(f"'{k}' in {key_to_file[k].name}" for k in absent[:3])
                + "); a shard is incomplete. Download it again."
            )
        moved = [k for k, f in owner.items() if k in key_to_file and key_to_file[k] != f]
        if moved:
            # The data is where the shard headers say; the index is only a table of contents.
            logger.warning("%s: the shard index lists %d tensors under another shard than the one holding "
                           "them (e.g. '%s' is listed in %s but stored in %s); reading them from where they "
                           "are", name, len(moved), moved[0], key_to_file[moved[0]].name, owner[moved[0]].name)
    return WeightSource(name, infos, lambda k: parts[owner[k]].get(k), metadata)


def _read_weight_map(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` of a Hugging Face shard index, checked: tensor name -> a shard file name
    in the same folder."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WeightFormatError(f"{index_path}: not a valid shard index ({str(exc)[:120]}).") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightFormatError(f"{index_path}: not a valid shard index: it needs a 'weight_map' object mapping "
                                "tensor names to shard files. Download the index again.")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise WeightFormatError(f"{index_path}: the shard for tensor '{key}' is {shard!r}, not a file name in "
                                    "this folder; the index is corrupt. Download it again.")
    return weight_map


def _folder_files(folder: Path, subfolder: str | None) -> tuple[Path, Path | None, dict[str, str] | None, list[Path]]:
    """The folder a folder source reads (``folder/subfolder`` first, when it holds weights), its shard
    index and ``weight_map`` (None without one), and its ``.safetensors`` files."""
    candidates = [folder]
    if subfolder:
        candidates.insert(0, folder / subfolder)
    for d in candidates:
        if not d.is_dir():
            continue
        indexes = sorted(d.glob("*.safetensors.index.json"))
        if indexes:
            weight_map = _read_weight_map(indexes[0])
            return d, indexes[0], weight_map, sorted({d / f for f in weight_map.values()})
        files = sorted(d.glob("*.safetensors"))
        if files:
            return d, None, None, files
    where = f"{folder}" + (f" (or its '{subfolder}' subfolder)" if subfolder else "")
    raise WeightFormatError(f"{where}: no .safetensors files found.")


def folder_source(folder: Path, subfolder: str | None) -> WeightSource:
    d, index_path, weight_map, files = _folder_files(folder, subfolder)
    if index_path is not None and weight_map is not None:
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightFormatError(f"{index_path}: shard files are missing: {missing[:3]}.")
        return sharded_source(str(d), files, {k: d / v for k, v in weight_map.items()})
    if len(files) == 1:
        return file_source(files[0])
    return sharded_source(str(d), files, None)


def source_files(source: str | os.PathLike, subfolder: str | None = None) -> list[Path]:
    """The files that opening ``source`` reads: the file itself, or the shard index and shards of a
    folder (of its ``subfolder`` in a repo root), chosen as :func:`folder_source` chooses them. Reads
    at most a shard index, never weights. Raises ``OSError`` / :class:`WeightFormatError` as opening would."""
    path = Path(source).expanduser()
    if not path.is_dir():
        return [path]
    _, index_path, _, files = _folder_files(path, subfolder)
    return ([index_path] if index_path is not None else []) + files


def files_stamp(files: Sequence[Path]) -> str:
    """Name, size and modification time of each file (``stat`` only): what changes when one is
    replaced. Raises ``OSError`` for a file that cannot be seen."""
    return "|".join(f"{f.name}:{(st := f.stat()).st_size}:{st.st_mtime_ns}" for f in files)


def dict_source(sd: Mapping[str, torch.Tensor], name: str) -> WeightSource:
    infos = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name}: value for '{k}' is {type(v).__name__}, expected a torch.Tensor")
        infos[k] = TensorInfo(tuple(v.shape), v.dtype)
    return WeightSource(name, infos, lambda k: sd[k])
