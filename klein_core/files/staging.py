"""Reading weight files straight to a CUDA device through page-locked buffers.

A tensor bound for the GPU used to be read into fresh CPU memory it owned, then copied to the
device from there. Both halves are slow: the first touch of every page of fresh memory faults it in
(zeroed by the kernel), and a copy from ordinary (pageable) memory runs through the driver's
bounce buffer, synchronously. Measured on the CPU machine of the twentieth session (2 cores, a
7.75 GB bf16 file in the page cache): ``readinto`` fresh memory 1.5-1.7 GB/s, one reused buffer
6.6-8.6 GB/s. A :class:`DeviceStager` reads each tensor in slices into a few page-locked slots
that are reused, and queues each slice's copy to the device at once; a slot is refilled only after
its previous copy has finished (a CUDA event), so reading the next slice overlaps the copy of the
last. The device tensor owns its memory, as before: a file changed on disk cannot change it.
(:func:`klein_core.transfer.to_device` stages a tensor that is already in memory; here the file is
read straight into the page-locked slot, and a fixed pair of slots bounds the locked memory to
128 MiB whatever the read and copy speeds, where fresh page-locked blocks from torch's caching
allocator would grow with any backlog of copies.)

:func:`reading_through` makes :meth:`klein_core.files.safetensors.SafetensorsFile.read` use a
stager for the reads inside it (a context variable: the key-mapping views over a file need not
know). ``klein_core.files.materialize`` uses it for the weights it loads as they are stored, fp8 weights
and GGUF blocks kept packed included (their bytes), not for data decoded on the CPU (NVFP4, GGUF or
fp8 weights dequantised as they load). :data:`STAGED_READS` turns it off (for a before/after measurement).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import torch

logger = logging.getLogger(__name__)

STAGED_READS = True  # False: device loads read through ordinary memory, as before (benchmarks compare)
SLOT_BYTES = 64 << 20  # each page-locked slot; a tensor larger than one is read slice by slice
SLOTS = 2  # reading one slot while the other's copy runs
READ_CAP = 1 << 30  # one readinto call reads at most this much (Linux caps a read near 2 GiB)

_active: contextvars.ContextVar[DeviceStager | None] = contextvars.ContextVar("klein_stager", default=None)
_refused_said = False  # page-locked memory was refused once: said then, not at every load


# A read of at least PARALLEL_BYTES is split into pieces of at least PIECE_BYTES read by up to
# READ_THREADS threads at once (positioned reads on the one open file: the file checked when it was
# opened is the file read), as far as the page cache holds it; the rest is read in order after
# (:func:`_read_pieces`). Reading into fresh memory is bound by the page faults of its first touch,
# one page at a time in a single read; in parallel they are taken on several cores. Measured on the
# CPU machine of the twenty-first session (2 cores, a 1.5 GB file in the page cache, fresh memory):
# one thread 1.8-2.1 GB/s, two 3.9 GB/s, four 3.1-3.7 GB/s.
PARALLEL_BYTES = 64 << 20
PIECE_BYTES = 16 << 20
READ_THREADS = min(8, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has none of its parent's threads: it starts its own pool


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def read_full(fh: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``fh``'s position; the bytes read (fewer only at the end of the file).
    ``fh``'s position ends after them. A large read is split over threads (:data:`PARALLEL_BYTES`)
    where the system has positioned reads that need not wait for the disk (``os.preadv`` with
    ``RWF_NOWAIT``: Linux)."""
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # counted and sliced in bytes (a view of wider items counts items)
    size = len(view)
    pieces = min(READ_THREADS, size // PIECE_BYTES)
    if size >= PARALLEL_BYTES and pieces > 1 and hasattr(os, "preadv") and hasattr(os, "RWF_NOWAIT"):
        start = fh.tell()
        done = _read_pieces(fh.fileno(), view, start, pieces)
        fh.seek(start + done)
        return done
    done = 0
    while done < size:
        got = fh.readinto(view[done : done + READ_CAP])
        if not got:
            break
        done += got
    return done


def _read_pieces(fd: int, view: memoryview, start: int, pieces: int) -> int:
    """``view`` from ``fd`` at ``start``; the bytes read before the first gap (the end of the file).

    What the page cache holds is read in ``pieces`` parallel pieces without waiting for the disk
    (``RWF_NOWAIT``: a read of data not in the cache returns at once); the rest after, in file
    order, one read at a time as before, so that a spinning disk is never asked for several places
    at once."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="klein-read")
    step = -(-len(view) // pieces)
    bounds = [(a, min(a + step, len(view))) for a in range(0, len(view), step)]

    def cached(a: int, b: int) -> tuple[int, bool]:  # (where it stopped, whether at the end of the file)
        done = a
        while done < b:
            try:
                got = os.preadv(fd, [view[done : min(b, done + READ_CAP)]], start + done, os.RWF_NOWAIT)
            except OSError:  # not in the page cache (EAGAIN); or no non-waiting reads on this file
                # system (EOPNOTSUPP, EINVAL), kernel (ENOSYS) or sandbox (EPERM): read in order
                # below, where a real I/O error is raised
                return done, False
            if not got:
                return done, True
            done += got
        return done, False

    stops = [f.result() for f in [_pool.submit(cached, a, b) for a, b in bounds]]
    for (_, b), (done, at_end) in zip(bounds, stops):
        if at_end:
            return done
        while done < b:
            got = os.preadv(fd, [view[done : min(b, done + READ_CAP)]], start + done)
            if not got:
                return done
            done += got
    return len(view)


class DeviceStager:
    """Reads byte ranges of files into ``slots`` page-locked buffers of ``slot_bytes`` each and
    queues their copies into device tensors (see the module doc). Off CUDA (the tests) the slots are
    ordinary memory and each copy is done at once. :meth:`finish` waits for the queued copies."""

    def __init__(self, device: torch.device, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS) -> None:
        if slot_bytes < 1 or slots < 1:
            raise ValueError(f"slot_bytes and slots must be positive, got {slot_bytes} and {slots}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.slot_bytes = slot_bytes
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(slots)]
        self._done: list[object | None] = [None] * slots  # per slot: its last copy, until waited for
        self._next = 0
        self.bytes_read = 0

    def read(self, fh: BinaryIO, nbytes: int) -> tuple[torch.Tensor, int]:
        """``nbytes`` from ``fh``'s position into a new ``uint8`` tensor on the device; returns it and
        the bytes actually read (fewer if the file ends first: the caller names that error)."""
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        done = 0
        while done < nbytes:
            i = self._next
            self._next = (i + 1) % len(self._slots)
            token = self._done[i]
            if token is not None:
                self._wait(token)  # the slot's previous copy has read it: it may be refilled
                self._done[i] = None
            n = min(self.slot_bytes, nbytes - done)
            slot = self._slots[i]
            got = read_full(fh, memoryview(slot.numpy())[:n])
            if got:
                self._done[i] = self._queue_copy(out[done : done + got], slot[:got])
            done += got
            if got < n:
                break
        self.bytes_read += done
        return out, done

    def finish(self) -> None:
        """Wait for every queued copy: the tensors are complete and the slots free."""
        self._wait_all()
        self._done = [None] * len(self._slots)

    # The three steps that differ on a GPU, apart so that the tests can stand in a device whose
    # copies run late (tests/test_staging.py) and check that no slot is refilled too early.
    def _queue_copy(self, dst: torch.Tensor, src: torch.Tensor) -> object | None:
        """Queue ``dst.copy_(src)`` (``src`` a slot); returns what :meth:`_wait` takes to know
        that the copy has run (None: it has run already, as on the CPU)."""
        dst.copy_(src, non_blocking=self.cuda)
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait(self, token: object) -> None:
        """Return once the copy that gave ``token`` has run."""
        token.synchronize()  # type: ignore[attr-defined]  # a torch.cuda.Event

    def _wait_all(self) -> None:
        """Return once every copy queued so far has run."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()


def active_stager() -> DeviceStager | None:
    """The stager reads should go through here, if any (see :func:`reading_through`)."""
    return _active.get()


@contextlib.contextmanager
def device_stager(device: torch.device | str) -> Iterator[DeviceStager | None]:
    """A :class:`DeviceStager` for loads onto ``device`` if it is a CUDA device (and
    :data:`STAGED_READS`), else None; on leaving, its copies are waited for. If page-locked memory
    cannot be had, None (reads go through ordinary memory), said once per process in the log."""
    global _refused_said
    device = torch.device(device)
    stager = None
    if STAGED_READS and device.type == "cuda":
        try:
            stager = DeviceStager(device, SLOT_BYTES, SLOTS)
        except RuntimeError as exc:  # page-locked memory refused (little free RAM, a restricted environment)
            if not _refused_said:
                _refused_said = True
                logger.warning("weights are read through ordinary memory: no page-locked buffer (%s)", exc)
    try:
        yield stager
    finally:
        if stager is not None:
            stager.finish()


@contextlib.contextmanager
def reading_through(stager: DeviceStager | None) -> Iterator[None]:
    """Safetensors reads inside the block go through ``stager`` (nothing changes for None)."""
    if stager is None:
        yield
        return
    token = _active.set(stager)
    try:
        yield
    finally:
        _active.reset(token)


__all__ = ["SLOTS", "SLOT_BYTES", "STAGED_READS", "DeviceStager", "active_stager", "device_stager", "read_full",
           "reading_through"]
