"""Files written whole or not at all: a temporary file in the same folder, then a rename over the name.

A write that fails or is interrupted (a full disk, Ctrl+C) leaves the file that was there as it was
and no temporary file behind. The temporary name is short (``.klein-<16 hex>.tmp``), so a file name
near the 255-byte limit of most file systems can still be written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` for the caller to write the whole file to. When the block
    ends normally the file is flushed to disk and renamed over ``path``; when it raises (an interrupt
    included) the temporary file is removed and ``path`` is untouched. The parent folder must exist.
    A symbolic link at ``path`` is written through (its target is replaced, as ``open`` would write
    it), and a file replaced keeps its permission bits; hard links to it keep the old content."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    tmp = path.with_name(f".klein-{uuid.uuid4().hex[:16]}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDWR)  # (Windows flushes only a file open for writing)
        try:
            os.fsync(fd)  # the bytes on disk before the name points at them
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):  # none there yet, or a mode this system cannot set
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _mode(path: Path) -> int | None:
    """``path``'s file mode, or None if it cannot be read (missing, or a name the OS refuses: Path's
    own ``exists`` / ``is_dir`` raise for a name over the length limit)."""
    try:
        return os.stat(path).st_mode
    except (OSError, ValueError):
        return None


def is_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder; False, not an error, for a name the OS refuses."""
    mode = _mode(Path(path))
    return mode is not None and stat.S_ISDIR(mode)


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` if it exists, else its nearest existing parent (the root at last)."""
    path = Path(path)
    while _mode(path) is None and path != path.parent:
        path = path.parent
    return path


def name_max(folder: str | os.PathLike) -> int:
    """The longest file name, in bytes, that the file system of ``folder`` (or of its nearest existing
    parent) takes; 255 where it cannot be asked (Windows)."""
    folder = nearest_existing(Path(folder))
    try:
        limit = int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError):
        return 255
    return limit if limit > 0 else 1 << 30  # -1: no limit


def _name_length(name: str) -> int:
    """A name's length as the file system counts it: UTF-16 units on Windows and macOS (NTFS, HFS+;
    counting them there never refuses a name APFS takes), bytes elsewhere."""
    if sys.platform in ("win32", "darwin"):
        return len(name.encode("utf-16-le", "surrogatepass")) // 2
    return len(os.fsencode(name))


def unwritable(path: str | os.PathLike) -> str | None:
    """Why a file could not be written at ``path`` (checked before long work whose result goes
    there): it is a folder, the nearest existing parent is not a folder, or the name is longer than
    the file system takes. None if nothing stands in the way that can be seen now."""
    path = Path(path)
    parent = nearest_existing(path.parent)
    if _mode(parent) is None:
        return f"{path.parent} does not exist (nor any folder above it)"
    if not is_folder(parent):
        return f"{parent} is a file, not a folder"
    size, limit = _name_length(path.name), name_max(parent)
    if size > limit:
        unit = "characters" if sys.platform in ("win32", "darwin") else "bytes"
        return f"the file name is {size} {unit}, over the {limit} this file system takes; give a shorter name"
    if is_folder(path):
        return f"{path} is a folder; give a file name in it"
    if not os.access(parent, os.W_OK | os.X_OK) or (_mode(path) is not None and not os.access(path, os.W_OK)):
        return f"{path if _mode(path) is not None else parent} cannot be written (permissions)"
    return None


__all__ = ["atomic_path", "is_folder", "name_max", "nearest_existing", "unwritable"]
