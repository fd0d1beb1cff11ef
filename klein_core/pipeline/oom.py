"""Running out of device memory: recognised, the failed attempt's memory released, and explained in
one place (:func:`explain_oom`, used by every engine stage)."""

from __future__ import annotations

import contextlib
import gc
import traceback
from collections.abc import Iterator

import torch

from ..errors import KleinOutOfMemory

# The CPU allocator's words (Linux/macOS, then Windows): the host ran out, whatever the device.
_HOST_WORDS = ("can't allocate memory", "not enough memory", "DefaultCPUAllocator")


def is_out_of_memory(exc: BaseException) -> bool:
    """A device running out of memory: CUDA's OutOfMemoryError, or the CPU / MPS allocators' errors."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (*_HOST_WORDS, "MPS backend out of memory"))


def memory_ran_out(exc: BaseException, device: torch.device) -> str:
    """Which memory ``exc`` (:func:`is_out_of_memory`) says ran out: "CPU" for the host's allocator
    (also while running on a GPU: a batch prepared on the host, pinned copies), else the device's
    ("GPU" for CUDA)."""
    text = str(exc)
    if not isinstance(exc, torch.OutOfMemoryError) and "MPS" not in text and any(s in text for s in _HOST_WORDS):
        return "CPU"
    return "GPU" if device.type == "cuda" else device.type.upper()


def release_failed_attempt(exc: BaseException, device: torch.device) -> None:
    """Free what a computation that raised ``exc`` still holds, then return the cached blocks.

    While ``exc`` is being handled, its traceback keeps every failed frame alive, and with them
    their local tensors (the activations that filled the memory): ``del exc`` alone frees nothing.
    Clearing the finished frames' locals does; the frames still running (the handler's own and its
    callers') are left as they are."""
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def explain_oom(stage: str, device: torch.device, w: int | None = None, h: int | None = None, batch: int = 1,
                n_refs: int = 0) -> Iterator[None]:
    """Turn an out-of-memory error in ``stage`` into :class:`KleinOutOfMemory` naming what to lower
    (the output size ``w`` x ``h`` when the stage depends on it), after releasing the memory the
    failed attempt held. The one place that explains running out of memory."""
    try:
        yield
    except RuntimeError as exc:
        if not is_out_of_memory(exc) or isinstance(exc, KleinOutOfMemory):  # already explained (a refusal)
            raise
        where = memory_ran_out(exc, device)
        release_failed_attempt(exc, device)
        del exc
        hints = [f"a lower resolution than {w}x{h}"] if w and h else []
        if batch > 1:
            hints.append(f"a smaller batch (now {batch} images per step including CFG)")
        if n_refs:
            hints.append(f"fewer or smaller references (now {n_refs})")
        if where == "CPU" and device.type != "cpu":
            # Offloading would make it worse: the offloading modes keep the weights in CPU memory.
            hints.append("more free CPU memory (close other programs; the memory modes that offload to the "
                         "CPU, swap, blocks and minimum, keep the weights there)")
        else:
            hints.append("a lower-memory mode (offload the text encoder or transformer blocks, tiled VAE)")
        raise KleinOutOfMemory(
            f"Out of {where} memory while {stage}; the memory was released. Try " + ", or ".join(hints) + "."
        ) from None


__all__ = ["explain_oom", "is_out_of_memory", "memory_ran_out", "release_failed_attempt"]
