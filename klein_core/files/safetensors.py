"""The one reader of ``.safetensors`` files: header first, then tensors as owned copies.

A file is always parsed as safetensors first (its first bytes are a header length, so any magic
bytes can occur by chance); only a file whose header does not parse is examined for the magic bytes
of other formats (pickle, zip, GGUF) and refused by what it is.

Only the requested tensors are read, with ``readinto`` into memory the returned tensor owns (no
memory map), so a file replaced or truncated on disk cannot crash the process (SIGBUS) or change a
loaded model. Every read re-checks the file's identity (device, inode, size, modification time) and
refuses a file that changed since its header was read. Loads onto a GPU read through page-locked
buffers straight into device memory (:mod:`klein_core.files.staging`).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import WeightFormatError
from .staging import active_stager, read_full

# safetensors dtype strings -> torch dtypes (every dtype the format defines that torch has).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)

# A header larger than this is not a real checkpoint header (the 9B transformer's is ~50 KB; the
# largest fp8 text encoder's ~125 KB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in its file: shape, dtype, absolute byte offset and byte count."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int
    nbytes: int


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _require_regular(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(st.st_mode) else
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "a socket" if stat.S_ISSOCK(st.st_mode) else
                "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
        raise WeightFormatError(f"{path}: is {kind}, not a weight file; give the path of a .safetensors file.")


def _open_regular(path: Path):
    """Open ``path`` for reading, refusing anything but a regular file.

    Opened non-blocking first: opening a FIFO without a writer would otherwise wait forever.
    """
    _require_regular(path, os.stat(path))  # before opening: a socket cannot be opened at all
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        _require_regular(path, os.fstat(fd))  # and again: the path may have changed in between
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def sniff_format(head: bytes) -> str | None:
    """What a non-safetensors file is, from its first bytes: ``"gguf"``, ``"zip"`` (``torch.save``'s
    zip container, whose payload is a pickle), ``"pickle"`` or None (unknown)."""
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # PROTO opcode + protocol 2..5
        return "pickle"
    return None


_FORMAT_NAMES = {
    "zip": "a zipped PyTorch checkpoint (torch.save), whose contents are pickled Python objects",
    "pickle": "a Python pickle (a .ckpt / .pt / .bin checkpoint)",
}
_SNIFF_BYTES = 256  # the first bytes read: enough to name a format and quote a text file's first line

# What a component file must be, for messages about files that hold no weights at all.
_EXPECTED = {
    "transformer": "a .safetensors or .gguf file (e.g. flux-2-klein-4b.safetensors) or a diffusers folder",
    "text encoder": "a .safetensors or .gguf file (e.g. qwen_3_4b.safetensors) or a Hugging Face folder",
    "VAE": "a .safetensors file (flux2-vae.safetensors)",
    "LoRA": "a .safetensors file",
}


def _as_text(head: bytes) -> str | None:
    """``head`` as text when it reads as UTF-8 without control characters (tabs and newlines aside)."""
    head = head.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:  # a character cut at the end of what was read is still text
        if exc.reason != "unexpected end of data" or exc.start < len(head) - 3:
            return None
        text = head[: exc.start].decode("utf-8")
    if not text.strip() or any(not (c.isprintable() or c in "\t\n\r") for c in text):
        return None
    return text


def what_else(head: bytes) -> str | None:
    """What a file that holds no weights is, from its first bytes ("a JPEG image", "an HTML page",
    "a Git LFS pointer", "a text file"...), or None when they do not say. Only meaningful for a
    file whose safetensors header did not parse: a safetensors file may start with any bytes."""
    if head[:3] == b"\xff\xd8\xff":
        return "a JPEG image"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "a PNG image"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "a GIF image"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "a WebP image"
    if head[4:8] == b"ftyp":
        heif = head[8:12] in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1")
        return "a HEIC/AVIF image" if heif else "an MP4/QuickTime video"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "a TIFF image"
    if head[:2] == b"BM" and head[6:10] == b"\x00\x00\x00\x00":
        return "a BMP image"
    if head[:5] == b"%PDF-":
        return "a PDF document"
    if head[:2] == b"\x1f\x8b":
        return "a gzip-compressed file (a .gz or .tar.gz archive)"
    if head[:6] == b"7z\xbc\xaf\x27\x1c":
        return "a 7-Zip archive"
    if head[:6] == b"Rar!\x1a\x07":
        return "a RAR archive"
    if head[:6] == b"\xfd7zXZ\x00":
        return "an xz-compressed file"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "a zstd-compressed file"
    text = _as_text(head)
    if text is None:
        return None
    start = text.lstrip().lower()
    if start.startswith("version https://git-lfs"):
        return "a Git LFS pointer"
    if start.startswith(("<!doctype html", "<html")):
        return "an HTML page"
    first = text.strip().splitlines()[0][:60]
    noun = "a JSON text file" if start.startswith(("{", "[")) else "a text file"
    return f'{noun} (it begins "{first}")'


class NotSafetensors(WeightFormatError):
    """The file is not safetensors. ``kind`` is ``"gguf"``, ``"zip"``, ``"pickle"``, ``"other"`` (a
    file that holds no weights: an image, a web page...; ``what`` names it) or ``"unknown"``."""

    def __init__(self, message: str, kind: str, what: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.what = what


def _refuse(path: Path, head: bytes, problem: str, component: str) -> WeightFormatError:
    """The error for a file whose header did not parse: what it is if its first bytes say so, else
    ``problem`` (a truncated or corrupt safetensors file)."""
    kind = sniff_format(head)
    if kind == "gguf":
        return NotSafetensors(f"{path}: this is a GGUF file, not safetensors.", "gguf", "a GGUF file")
    # A safetensors file cut short still starts with a sane header length and the header's "{".
    looks_like_safetensors = (len(head) >= 9 and head[8:9] == b"{"
                              and struct.unpack("<Q", head[:8])[0] <= MAX_HEADER_BYTES)
    if looks_like_safetensors:
        return NotSafetensors(f"{path}: {problem}", "unknown")
    if kind in _FORMAT_NAMES:
        return NotSafetensors(
            f"{path}: this is {_FORMAT_NAMES[kind]}, not safetensors. Pickles can run arbitrary code when "
            f"loaded, so klein_core never unpickles. Use the .safetensors {component} file instead.", kind,
            _FORMAT_NAMES[kind])
    what = what_else(head) if len(head) >= 8 else None
    if what == "a Git LFS pointer":
        return NotSafetensors(
            f"{path}: this is a Git LFS pointer, not the weights: a small text file that stands in for the real "
            "file when a repository is cloned without Git LFS. Fetch the file itself (git lfs pull in the "
            "clone, or download it from the model page).", "other", what)
    if what == "an HTML page":
        return NotSafetensors(
            f"{path}: this is an HTML page, not a safetensors or GGUF file: the download saved a web page (an "
            "error or login page) instead of the file. Download the file itself again; a gated repository "
            "needs its licence accepted and a login first.", "other", what)
    if what is not None:
        expected = _EXPECTED.get(component, "a .safetensors or .gguf file")
        folder = ("; for a diffusers or sharded model, give the folder that holds this file"
                  if what.startswith("a JSON") else "")
        return NotSafetensors(f"{path}: this is {what}, not a safetensors or GGUF file. The {component} must be "
                              f"{expected}{folder}.", "other", what)
    return NotSafetensors(f"{path}: {problem}", "unknown")


@dataclass(frozen=True)
class SafetensorsFile:
    """A parsed safetensors header; :meth:`read` returns one tensor as an owned CPU tensor."""

    path: Path
    tensors: Mapping[str, StoredTensor]
    metadata: Mapping[str, str]
    header_bytes: int
    identity: tuple[int, int, int, int]

    def read(self, key: str) -> torch.Tensor:
        """Tensor ``key`` in its stored dtype and shape, in memory it owns (never a file map): on the
        CPU, or on the device of the :func:`~klein_core.files.staging.reading_through` block it is
        read in."""
        info = self.tensors[key]
        stager = active_stager()
        try:
            with _open_regular(self.path) as fh:
                if _identity(os.fstat(fh.fileno())) != self.identity:
                    raise WeightFormatError(
                        f"{self.path}: the file changed on disk after it was opened (replaced, rewritten or "
                        f"truncated), so tensor '{key}' cannot be read consistently. Load the model again."
                    )
                fh.seek(info.begin)
                if stager is not None:
                    raw, done = stager.read(fh, info.nbytes)
                else:
                    raw = torch.empty(info.nbytes, dtype=torch.uint8)
                    done = read_full(fh, memoryview(raw.numpy()))
        except OSError as exc:
            raise WeightFormatError(f"{self.path}: cannot read tensor '{key}' ({exc}).") from exc
        if done != info.nbytes:
            raise WeightFormatError(
                f"{self.path}: tensor '{key}' ends past the end of the file (read {done} of {info.nbytes} "
                "bytes); the file is truncated. Download it again."
            )
        return raw.view(info.dtype).reshape(info.shape)


def open_safetensors(path: str | os.PathLike, component: str = "weights") -> SafetensorsFile:
    """Parse and validate the header of a safetensors file without reading any tensor data.

    ``component`` ("transformer", "LoRA", ...) is used in messages. Raises
    :class:`NotSafetensors` (a :class:`WeightFormatError`) naming the format of a file that is not
    safetensors (pickle, zip, GGUF), and :class:`WeightFormatError` naming the file for a truncated
    or corrupt one, for a FIFO or device, and for a header pointing outside the file.
    """
    path = Path(path)
    with _open_regular(path) as fh:
        st = os.fstat(fh.fileno())
        size = st.st_size
        head = fh.read(_SNIFF_BYTES)
        if len(head) < 8:
            raise _refuse(path, head, f"not a safetensors file (only {size} bytes long).", component)
        (n,) = struct.unpack("<Q", head[:8])
        if n < 2 or n > min(size - 8, MAX_HEADER_BYTES):
            raise _refuse(path, head, (
                f"not a valid safetensors file (its header claims {n} bytes, the file has {size}); the file "
                "is truncated or not safetensors. Download it again."), component)
        fh.seek(8)
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers invalid JSON and integers too long to convert; RecursionError deep nesting.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:120]
        raise _refuse(path, head, f"safetensors header is not valid JSON ({reason}); the file is corrupt "
                                  "or not safetensors. Download it again.", component) from None
    if not isinstance(header, dict):
        raise _refuse(path, head, "safetensors header is not a JSON object; the file is corrupt or not "
                                  "safetensors.", component)
    data_start = 8 + n
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise WeightFormatError(f"{path}: safetensors __metadata__ is not an object; the file is corrupt.")
    tensors: dict[str, StoredTensor] = {}
    for key, entry in header.items():
        try:
            dtype_s, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype_s, str) or not isinstance(shape, list):
                raise TypeError
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (*shape, start, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise WeightFormatError(f"{path}: malformed header entry for tensor '{key}'; the file is corrupt.") from None
        if dtype_s not in DTYPES:
            raise WeightFormatError(f"{path}: tensor '{key}' has unsupported dtype '{dtype_s}'.")
        dtype = DTYPES[dtype_s]
        numel = 1
        for s in shape:
            if s < 0:
                raise WeightFormatError(f"{path}: tensor '{key}' has a negative dimension {shape}.")
            numel *= s
        if not (0 <= start <= end <= data_size) or end - start != numel * dtype.itemsize:
            raise WeightFormatError(
                f"{path}: tensor '{key}' points outside the file or has the wrong byte size "
                f"(offsets {start}..{end}, data section {data_size} bytes); the file is truncated "
                "or corrupt. Download it again."
            )
        tensors[key] = StoredTensor(tuple(shape), dtype, data_start + start, end - start)
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    return SafetensorsFile(path, tensors, meta, n, _identity(st))


__all__ = ["DTYPES", "MAX_HEADER_BYTES", "NotSafetensors", "SafetensorsFile", "StoredTensor", "open_safetensors",
           "sniff_format", "what_else"]
