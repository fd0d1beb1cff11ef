"""What the host did behind the benchmark's back during timed runs: Python garbage collections and
torch.compile (re)compilations.

Under ``compile`` the H100 runs lost 54-67 ms per run outside the timed stages (against about 5 ms for
the eager fast path), and the profile showed one 47 ms GPU-idle gap with no host operator to explain
it (benchmarks/results/2026-11-27_h100/README.md). Two causes leave no operator in a profile: a full
Python garbage collection (compilation leaves hundreds of thousands of long-lived objects: on the
2-core CPU machine a full collection took 177 ms after the eager warm-up and 423 ms after
compiling the tiny models) and a recompilation (a guard that fails each run). :class:`HostAudit`
counts both inside its ``with`` block, so a benchmark can say whether either happened in its
timed runs, and (``profile=True``) marks each collection as a ``python.gc.gen<N>`` profiler range,
so ``profile_run.py``'s gap report names it.

Usage::

    with HostAudit() as audit:
        run()
    audit.result()  # {"gc": {"gen0": {"count": .., "ms": ..}, ..., "largest_ms": ..}, "compiles": {...}}
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch


def _dynamo_counts() -> dict[str, int]:
    """Frames dynamo compiled (``frames.total``) and graphs it produced so far in this process; empty
    where torch has no dynamo counters."""
    try:
        from torch._dynamo.utils import counters  # private, but stable since torch 2.0
    except Exception:  # noqa: BLE001 - an audit must not break the benchmark it watches
        return {}
    return {"frames": int(counters["frames"]["total"]), "graphs": int(counters["stats"]["unique_graphs"])}


class HostAudit:
    """Counts garbage collections (by generation, with their wall time) and torch.compile frame
    compilations between ``__enter__`` and ``__exit__``. Re-entrant use is not supported; one audit
    per block."""

    def __init__(self, *, profile: bool = False) -> None:
        self.profile = profile
        self.collections: list[tuple[int, float]] = []  # (generation, ms)
        self._start: float | None = None
        self._range: Any = None
        self._compiles_before: dict[str, int] = {}
        self._compiles_after: dict[str, int] = {}

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            if self.profile:
                self._range = torch.profiler.record_function(f"python.gc.gen{info['generation']}")
                self._range.__enter__()
        elif self._start is not None:
            if self._range is not None:
                self._range.__exit__(None, None, None)
                self._range = None
            self.collections.append((int(info["generation"]), (time.perf_counter() - self._start) * 1000.0))
            self._start = None

    def __enter__(self) -> HostAudit:
        self.collections.clear()
        self._compiles_before = _dynamo_counts()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self._compiles_after = _dynamo_counts()

    def result(self) -> dict[str, Any]:
        """``gc``: per generation the number of collections and their total ms, and the largest one;
        ``compiles``: frames and graphs dynamo compiled inside the block (0 in a warm, stable run)."""
        per_gen = {f"gen{g}": {"count": 0, "ms": 0.0} for g in range(3)}
        for g, ms in self.collections:
            row = per_gen.setdefault(f"gen{g}", {"count": 0, "ms": 0.0})
            row["count"] += 1
            row["ms"] = round(row["ms"] + ms, 3)
        largest = max((ms for _, ms in self.collections), default=0.0)
        compiles = {k: self._compiles_after.get(k, v) - v for k, v in self._compiles_before.items()}
        return {"gc": {**per_gen, "largest_ms": round(largest, 3)}, "compiles": compiles}
