"""Calibration tool for the planner's formulas: the peak bytes an eager forward pass allocates.

:func:`trace_activation_bytes` runs a forward on meta-device modules and inputs (no data, no
compute) and tracks the bytes of every tensor the eager code allocates and frees, with
scaled-dot-product attention counted as a memory-efficient kernel. tests/test_planner.py checks
every formula in :mod:`klein_core.memory.planner` against it at real Klein sizes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


class _AllocationTracker(TorchDispatchMode):
    """Counts live bytes of tensors created by ops (views and in-place results share their
    source's allocation), freeing them when the last tensor object using them dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alloc: dict[int, list[int]] = {}  # allocation id -> [tensor objects, bytes]
        self._owner: dict[int, int] = {}  # id(tensor) -> allocation id
        self._next = 0

    def _attach(self, t: torch.Tensor, alloc: int) -> None:
        self._alloc[alloc][0] += 1
        tid = id(t)
        self._owner[tid] = alloc
        weakref.finalize(t, self._detach, tid, alloc)

    def _detach(self, tid: int, alloc: int) -> None:
        self._owner.pop(tid, None)
        entry = self._alloc[alloc]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._alloc[alloc]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, o in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(o, torch.Tensor):
                continue
            if i < len(returns) and returns[i].alias_info is not None:  # a view or in-place result
                src = next((a for s, a in zip(func._schema.arguments, args)
                            if s.alias_info is not None and isinstance(a, torch.Tensor)), None)
                alloc = self._owner.get(id(src)) if src is not None else None
                if alloc is not None and o is not src:
                    self._attach(o, alloc)
                continue
            alloc, self._next = self._next, self._next + 1
            self._alloc[alloc] = [0, o.numel() * o.element_size()]
            self.live += self._alloc[alloc][1]
            self.peak = max(self.peak, self.live)
            self._attach(o, alloc)
        return out


def _efficient_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    # What flash / memory-efficient SDPA allocate: the output and a float32 logsumexp.
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    del lse
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@contextlib.contextmanager
def _sdpa_as_efficient() -> Iterator[None]:
    real = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _efficient_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def trace_activation_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of the tensors allocated while ``fn()`` runs (its inputs and the weights, made
    before, are not counted). Run it on meta-device modules and inputs to measure real-size
    models without memory or compute. Scaled-dot-product attention is counted as a
    memory-efficient kernel. A calibration tool: slow-ish (Python per op), not for every request.
    """
    with _sdpa_as_efficient(), torch.no_grad(), _AllocationTracker() as tracker:
        fn()
    return tracker.peak


__all__ = ["trace_activation_bytes"]
