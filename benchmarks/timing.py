"""The one timing loop of the benchmarks: CUDA events around each call on a GPU, the host clock elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def call_times(fn: Callable[[], Any], device: torch.device, runs: int) -> list[float]:
    """Milliseconds of each of ``runs`` calls of ``fn`` (no warm-up: the caller's)."""
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000.0)
    return times


__all__ = ["call_times"]
