"""Output of a batch job: PNGs written atomically, and ``manifest.jsonl`` (one entry per row).

An entry is ``{"id", "file", "seed", "seconds", "worker", "error"}``; the last entry of an id wins.
An id is *done* when its entry has no error and its PNG exists. PNGs are written to a temporary name
and renamed, and the entry is appended only after the rename, so a killed job leaves at most a
temporary file (ignored, removed on the next run) or a PNG without an entry (redone).
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .. import __version__
from ..files.atomic import nearest_existing

logger = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
LOCK = ".klein-batch.lock"
IMAGES = "images"
_TMP_TAG = ".tmp-"


@dataclass(frozen=True)
class Entry:
    """One row's outcome. ``file``: the PNG relative to the output folder (None on error)."""

    id: str
    file: str | None
    seed: int | None
    seconds: float
    worker: str | None
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def png_bytes(image: Image.Image, params: dict, index: int = 0) -> bytes:
    """``image`` as PNG bytes with the CLI's metadata: ``parameters`` (JSON of ``params`` plus
    ``batch_index``) and ``Software``."""
    meta = PngInfo()
    meta.add_text("parameters", json.dumps({**params, "batch_index": index}))
    meta.add_text("Software", f"klein_core {__version__}")
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=meta)
    return buf.getvalue()


def image_path(out_dir: Path, row_id: str) -> Path:
    """Where the PNG of ``row_id`` goes."""
    return out_dir / IMAGES / f"{row_id}.png"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, fsync'd, then renamed:
    ``path`` is either absent, its old content, or all of ``data``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{_TMP_TAG}{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def folds_case(folder: Path) -> bool:
    """Whether the file system of ``folder`` (or of its nearest existing parent) takes names that
    differ only in case for one file (macOS and Windows by default), asked with a probe file."""
    probe = nearest_existing(folder) / f".klein-case-{uuid.uuid4().hex[:12]}a"
    try:
        probe.touch(exist_ok=False)
        return probe.with_name(probe.name[:-1] + "A").exists()
    except OSError:  # a folder that cannot be written: the job fails on it later; guess by platform
        return sys.platform in ("darwin", "win32")
    finally:
        probe.unlink(missing_ok=True)


class OutputInUse(RuntimeError):
    """Another job holds the output folder's lock."""


class OutputLock:
    """An exclusive lock on an output folder for the duration of a job (``with OutputLock(out_dir):``).

    Two jobs on one folder each ran every row, and the second one's start-up removed the temporary
    PNGs the first was about to rename, so the first job's rows failed. The lock is an ``flock`` on
    ``out_dir/.klein-batch.lock``: the kernel drops it when the holder exits, even when killed, so a
    stopped job never leaves a stale lock. Where ``fcntl`` is missing (Windows) nothing is locked.
    """

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.path = Path(out_dir) / LOCK
        self._fh = None

    def __enter__(self) -> OutputLock:  # noqa: PYI034 - typing.Self needs Python 3.11; 3.10 is supported
        try:
            import fcntl
        except ImportError:
            logger.warning("no fcntl here: %s is not locked against a second job", self.path.parent)
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise OutputInUse(f"{self.path.parent} is in use by another batch job ({holder}); wait for it to "
                              "finish or give another --out") from None
        except BaseException:
            fh.close()
            raise
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}\n")  # who holds it, for the message the next job gives
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the file releases the flock
            self._fh = None


class Manifest:
    """``out_dir/manifest.jsonl``: read once at start, appended to by one process (the job's driver)."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / MANIFEST
        self.entries: dict[str, Entry] = {}
        if self.path.is_file():
            self._read()

    def _read(self) -> None:
        with open(self.path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                try:
                    d = json.loads(line)
                    entry = Entry(**d)
                except (ValueError, TypeError):  # a line cut by a killed job: that id is not done
                    logger.warning("%s line %d is incomplete; ignored", self.path, n)
                    continue
                self.entries[entry.id] = entry

    def done(self, row_id: str) -> bool:
        """``row_id`` has an entry without error and its PNG exists."""
        e = self.entries.get(row_id)
        return e is not None and e.error is None and e.file is not None and (self.out_dir / e.file).is_file()

    def done_ids(self) -> set[str]:
        return {i for i in self.entries if self.done(i)}

    def append(self, entries: list[Entry]) -> None:
        """Append ``entries`` (one line each) and fsync; a partial last line from a killed writer is
        first closed with a newline so it stays one unreadable line."""
        if not entries:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab+") as fh:
            if fh.tell() > 0:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            fh.write("".join(e.to_json() + "\n" for e in entries).encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        for e in entries:
            self.entries[e.id] = e

    def clean_temporaries(self) -> int:
        """Remove the temporary PNGs a killed job left; returns how many."""
        folder = self.out_dir / IMAGES
        n = 0
        if folder.is_dir():
            for p in folder.glob(f".*{_TMP_TAG}*"):
                p.unlink(missing_ok=True)
                n += 1
        return n
