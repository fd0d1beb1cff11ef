"""Page-locked (pinned) CPU memory for offloaded weights, packed so that little of it is wasted.

A copy to a GPU from page-locked memory is queued without waiting and runs at the bus's speed, so
:mod:`klein_core.memory.placement` keeps the weights it streams or copies in there. torch's
page-locked allocator rounds every allocation up to a power of two (ATen's
``CachingHostAllocator``: ``PowerOf2Ceil``), so pinning Klein's weights one by one locks far more
than their bytes: 9B's single-block ``linear1`` (288 MiB) takes 512 MiB. Counted from the weights'
shapes (tests/test_pinned.py), the blocks of 9B lock 24064 MiB for 16640 MiB of bf16 weights that
way, 1.45x (4B: 10560 for 7020 MiB, 1.50x). Here the tensors are packed into chunks of
:data:`CHUNK_BYTES` (a power of two), largest first, each into the first chunk with room, and a
chunk is allocated at the power of two that holds what it got: the 9B blocks lock 16896 MiB
(1.015x), 4B's 7168 MiB (1.021x).

Page-locked memory cannot be swapped out, so what klein_core locks is kept within
:func:`pin_budget` (the share of the machine's memory ComfyUI allows its own pinned memory), and
what does not fit, or what the system refuses to lock, stays in ordinary memory: copies from there
are slower, never wrong. That is said once per process.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .host import ram_total

logger = logging.getLogger(__name__)

CHUNK_BYTES = 512 << 20  # a power of two: torch's allocator would round anything else up to one
ALIGN = 512  # each tensor's offset in a chunk: every dtype's alignment, and whole DMA bursts

_left_said = False  # weights were left in ordinary memory: said once per process

# Page-locked memory the host application holds outside torch's allocator, in bytes (ComfyUI
# registers its own with cudaHostRegister, which torch does not count): counted against the bound
# too. The nodes set it; None: none.
other_locked: Callable[[], int] | None = None


@dataclass(frozen=True)
class PinReport:
    """What :func:`pin_tensors` did: ``pinned`` tensor bytes moved into ``locked`` bytes of
    page-locked chunks, ``left`` tensor bytes left in ordinary memory and why (``reason``)."""

    pinned: int = 0
    locked: int = 0
    left: int = 0
    reason: str | None = None


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1): what torch's page-locked allocator gives for ``n``."""
    return 1 << (n - 1).bit_length()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _page_locked(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked memory as a flat ``uint8`` tensor (the tests stand ordinary memory in)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s values fill its span with no gap and no overlap (contiguous in some order of
    its dimensions: a channels-last weight is), so a copy with its strides takes ``t.nbytes``."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first value to its last (an overlapping view, a broadcast, spans fewer
    than its values take)."""
    return (1 + sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))) * t.itemsize


def _locked_now() -> int:
    """Bytes torch's page-locked allocator has handed out in this process (0 where torch does not say)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return 0
    try:
        got = stats()
    except (RuntimeError, AssertionError):
        return 0
    for key in ("active_bytes.current", "allocated_bytes.current"):
        if key in got:
            return int(got[key])
    return 0


def pin_budget(total: int | None = None) -> int | None:
    """Bytes klein_core may lock now: of the machine's memory (``total``, default
    :func:`~klein_core.memory.host.ram_total`), 40 % on Windows (where ComfyUI's code notes a
    limit near half), elsewhere 90 % but 4 GiB left free (at least 40 %), as ComfyUI bounds its own
    pinned memory; less what torch has locked in this process already, and what the host
    application has (:data:`other_locked`). None if the machine's memory is not known (no bound)."""
    total = ram_total() if total is None else total
    if total is None:
        return None
    cap = 0.4 * total if sys.platform == "win32" else max(0.4 * total, min(0.9 * total, total - (4 << 30)))
    return max(0, int(cap) - _locked_now() - (other_locked() if other_locked is not None else 0))


def plan_chunks(sizes: Sequence[int], chunk: int | None = None) -> list[tuple[int, list[tuple[int, int]]]]:
    """Pack tensors of ``sizes`` bytes into chunks: ``[(chunk bytes, [(index, offset), ...]), ...]``.

    Largest first, each into the first chunk with room (offsets aligned to :data:`ALIGN`); a tensor
    larger than ``chunk`` (default :data:`CHUNK_BYTES`) gets a chunk of its own. Each chunk's size is
    the power of two that holds its content (so torch's allocator rounds nothing up)."""
    chunk = CHUNK_BYTES if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    bins: list[list] = []  # [capacity, used, [(index, offset)]]
    for i in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        need = _aligned(sizes[i])
        if need > chunk:
            bins.append([next_pow2(need), need, [(i, 0)]])
            continue
        for b in bins:
            if b[0] == chunk and b[1] + need <= chunk:
                b[2].append((i, b[1]))
                b[1] += need
                break
        else:
            bins.append([chunk, need, [(i, 0)]])
    return [(next_pow2(used), items) for _, used, items in bins]


def pin_tensors(tensors: list[torch.Tensor], *, budget: int | Callable[[], int | None] | None = None,
                what: str = "weights", on_pinned: Callable[[int, torch.Tensor], None] | None = None) -> PinReport:
    """Replace, in the list ``tensors``, each tensor (on the CPU, or on a device: copied straight in)
    by a page-locked CPU copy with its dtype, shape and values, and tell ``on_pinned(index, copy)``;
    a tensor stays where none is made (already page-locked, empty, on the meta device, a view
    spanning fewer bytes than its values take, such as a broadcast, beyond ``budget`` bytes of
    page-locked memory, or the system refused to lock more).

    The tensors are packed into chunks (:func:`plan_chunks`: a copy is a view of one). A copy keeps
    the tensor's strides where its values are dense (a channels-last convolution weight stays
    channels-last); a view with gaps (a slice of a larger weight) is copied contiguous, its values
    only. One chunk at a time, each tensor replaced as soon as it is copied: with ``on_pinned``
    replacing the caller's own references, an original is freed before the next chunk is made, so
    the copies never hold twice the memory. A chunk beyond ``budget`` is left out and the smaller
    ones after it are still made; after a refusal none is. ``budget`` may be a function (such as
    :func:`pin_budget`), asked only when there is something to pin. ``what`` names the tensors in
    the warning."""
    global _left_said
    wanted = [i for i, t in enumerate(tensors)
              if t.numel() and t.device.type != "meta" and not (t.device.type == "cpu" and t.is_pinned())
              and (_dense(t) or _span(t) >= t.nbytes)]
    if not wanted:
        return PinReport()
    if callable(budget):
        budget = budget()
    groups = [(size, [(wanted[k], offset) for k, offset in items])
              for size, items in plan_chunks([tensors[i].nbytes for i in wanted])]
    pinned = locked = left = 0
    reason = None
    refused = False
    for size, items in groups:
        memory = None
        if not refused and budget is not None and locked + size > budget:  # a smaller chunk may still fit
            reason = reason or (f"only {budget / 2**30:.1f} GiB more may be page-locked (the share of this "
                                "machine's memory klein_core keeps it to)")
        elif not refused:
            try:  # only the allocation: a failure there is the system refusing to lock more
                memory = _page_locked(size)
            except RuntimeError as exc:  # little free memory, a limit on locked memory (on Windows, said to be near half)
                reason, refused = f"the system refused to lock more ({str(exc).splitlines()[0]})", True
        if memory is None:
            left += sum(tensors[i].nbytes for i, _ in items)
            continue
        locked += size
        for i, offset in items:
            t = tensors[i]
            copy = memory[offset : offset + t.nbytes].view(t.dtype)
            copy = copy.as_strided(t.shape, t.stride()) if _dense(t) else copy.view(t.shape)
            with torch.no_grad():
                copy.copy_(t)
            pinned += t.nbytes
            tensors[i] = copy
            del t
            if on_pinned is not None:
                on_pinned(i, copy)
        del memory
    if left and not _left_said:
        _left_said = True
        logger.warning("%.2f GB of %s stay in ordinary CPU memory, not page-locked: %s. Their copies to the GPU "
                       "are slower (the results are the same).", left / 1e9, what, reason)
    if pinned:
        logger.info("%s: %.2f GB page-locked in %.2f GB", what, pinned / 1e9, locked / 1e9)
    return PinReport(pinned, locked, left, reason)


def release_cached() -> bool:
    """Give back to the system the page-locked blocks torch's allocator keeps cached for reuse once
    their tensors are gone (they stay locked until then: a dropped model's chunks too). True if
    torch was asked (CUDA in use, and a torch that has the call: ``torch.accelerator.empty_host_cache``,
    or ``torch._C._host_emptyCache`` before it)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return False
    empty()
    return True


__all__ = ["ALIGN", "CHUNK_BYTES", "PinReport", "next_pow2", "pin_budget", "pin_tensors", "plan_chunks",
           "release_cached"]
