"""Copies between the host and a GPU that never stall the GPU on pageable memory.

A copy from pageable (ordinary) host memory to a CUDA device first waits for all the work already
queued on the stream, and one from the device to pageable memory runs at a fraction of the bus
speed through the driver's staging buffer. Both left the GPU idle in a run's host-side gaps (H100,
4B text to image: "Memcpy DtoH (Device -> Pageable)" 6.1 ms for the decoded pixels, and a 39.6 ms
idle gap while the host sat in a pageable host-to-device copy before the first step;
``benchmarks/results/2026-11-26_h100_elementwise``). Here every such copy goes through page-locked
memory from torch's caching host allocator: a host-to-device copy is queued without waiting, and
the allocator keeps the page-locked block alive until the copy has run (it records an event on
the stream), so the temporary may go out of scope at once.

Off CUDA (the CPU, other accelerators) the functions are plain ``.to`` / no-ops; the values never
differ from a plain copy.
"""

from __future__ import annotations

import torch

__all__ = ["HostCopies", "to_device", "to_host"]


def to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (then cast to ``dtype``, there, if given), queued without a host wait.

    A CPU tensor bound for a CUDA device is staged through page-locked memory and copied
    asynchronously; the cast runs on the device after the copy (the same rounding as on the host:
    float casts round to nearest even on both). Anything else is ``t.to(device, dtype)``.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or t.requires_grad:  # (.to keeps the autograd link)
        return t.to(device=device, dtype=dtype)
    # Always a fresh page-locked copy, even of a page-locked ``t``: the caller may change ``t`` as
    # soon as this returns, before the stream has run the copy.
    src = torch.empty_like(t, pin_memory=True).copy_(t)
    out = src.to(device, non_blocking=True)
    return out if dtype is None else out.to(dtype)


class HostCopies:
    """Copies to the host queued now and waited for once: ``copies = HostCopies(); a, = copies.add(x)``
    (per image of a batch, say), then ``copies.wait()`` before reading any of them.

    CUDA tensors are copied into page-locked memory without waiting, so the GPU runs on while the
    host queues more work; a tensor's values may be read only after :meth:`wait`. CPU tensors are
    returned as they are (not copied). Freeing a source tensor at once is safe: the copy runs on the
    current stream, before anything queued on it later may reuse the memory.
    """

    def __init__(self) -> None:
        self._streams: dict[tuple[int, int | None], torch.cuda.Stream] = {}

    def add(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors' host copies, queued (each with its shape, dtype and values after :meth:`wait`)."""
        out: list[torch.Tensor] = []
        for t in tensors:
            if t.device.type != "cuda":
                out.append(t)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            stream = torch.cuda.current_stream(t.device)
            self._streams[stream.cuda_stream, t.device.index] = stream
            out.append(host)
        return tuple(out)

    def wait(self) -> None:
        """Wait until every copy queued so far has run: one wait per stream."""
        for stream in self._streams.values():
            stream.synchronize()
        self._streams.clear()


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the CPU, each with its shape, dtype and values; CUDA ones copied through
    page-locked memory, all copies queued before one wait per stream. CPU tensors are returned as
    they are (not copied)."""
    copies = HostCopies()
    out = copies.add(*tensors)
    copies.wait()
    return out
