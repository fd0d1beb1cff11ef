"""Where one end-to-end generation spends its time: GPU kernels by kind, and the GPU's idle gaps.

``speed.py`` times stages with CUDA events; what falls between them (tokenising, planning, image
conversion, launch latency) only shows as ``e2e - sum(stages)``. This script runs one warm
``klein_core.generate`` (full-size random weights, as ``speed.py`` builds them) under
``torch.profiler`` and reports:

* ``kernels``: GPU time per kernel family (matmul, attention, norm/rope, elementwise, copies,
  convolution, other), and the top kernels by total time; the engine's ``klein.*`` ranges, which
  the profiler also draws on the GPU timeline, are not kernels: ``stage_spans_ms`` gives their spans;
* ``gaps``: total GPU idle time inside the run, and the largest idle gaps with the kernels on
  either side and (the largest eight) what the host was doing meanwhile: the engine's ``klein.*``
  profiler ranges (stages, input checks, the denoising set-up, each step) and the host events
  overlapping the gap, so host-side stalls can be placed;
* ``cpu_ops``: the host operators with the most self time;
* ``host_audit``: Python garbage collections and torch.compile compilations during the profiled run
  (:mod:`benchmarks.host_audit`; each collection is also a ``python.gc.gen<N>`` range, so a gap's
  ``host`` names it), and in ``unprofiled`` those of the run without the profiler;
* ``unprofiled``: one run without the profiler, its wall time against the engine's own stage clocks
  (``GenerationResult.timings``: on CUDA the device's time from each stage's start to its end, the
  host waiting for the device only at the end of the run); ``cprofile_cumulative`` and
  ``cprofile_self``: Python's profile of one more run (:func:`python_profile`).

Usage (GPU)::

    python benchmarks/profile_run.py --model 4b --case a --out profile_4b_a.json
    python benchmarks/profile_run.py --tiny --device cpu --out /tmp/p.json   # CPU self-test
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import klein_core
from benchmarks.host_audit import HostAudit
from benchmarks.speed import PROMPT, SEED, _cases, _images, _spec, build_ours
from klein_core.accel import speed
from klein_core.pipeline.sampling import make_noise

FAMILIES = (  # (family, substrings of the kernel name, lower case), first match wins
    ("attention", ("attn", "fmha", "flash", "cudnn_generated_fort_native_sdpa", "sdpa")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")),
    ("convolution", ("conv", "implicit", "winograd", "fprop", "dgrad")),
    ("norm/rope", ("norm", "rope", "adaln", "moments")),
    ("copy", ("copy", "cat", "memcpy", "memset", "transpose")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton", "silu", "swiglu", "reduce")),
)


#: What Inductor's fused kernels fuse, by the aten ops in their names (``triton_<kind>_fused_<ops>_<n>``):
#: a fused kernel is named after every op it fuses, views and copies included, so the substrings
#: above misplace them (``..._to_copy_...rsqrt...`` is the QK norm, ``..._cat_mul_silu_...`` the
#: SwiGLU: the 2026-11-27 compile profile counted both, 15.4 ms, as copies).
TRITON_NORM = ("norm", "rsqrt", "mean", "var")
TRITON_MOVES = frozenset(("cat", "clone", "copy", "to", "view", "unsafe", "transpose", "permute", "split", "with",
                          "sizes", "expand", "reshape", "slice", "select", "stack", "unbind", "squeeze",
                          "unsqueeze", "contiguous", "t"))


def triton_family(name: str) -> str:
    """The family of an Inductor kernel by what it computes: matmul (templates, fused mm), norm/rope
    (a reduction of a norm), copy (only data movement), else elementwise."""
    parts = name.lower().split("_")
    kind = parts[1] if len(parts) > 1 else ""
    ops = [p for p in parts[3:] if p and not p.isdigit()] if len(parts) > 2 and parts[2] == "fused" else parts[2:]
    if kind == "tem" or any(op in ("mm", "addmm", "bmm", "baddbmm") for op in ops):
        return "matmul"
    if any(k in op for op in ops for k in TRITON_NORM):
        return "norm/rope"
    if ops and all(op in TRITON_MOVES for op in ops):
        return "copy"
    return "elementwise"


def family(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):
        return triton_family(low)
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def host_during(events: list[Any], start: float, end: float, top: int = 8) -> dict[str, Any]:
    """What the host was doing while the GPU sat idle from ``start`` to ``end`` (profiler us): the
    engine's ``klein.*`` ranges and the other host events overlapping the gap, by overlap (ms).
    Nested events all count (a range and the operators inside it)."""
    klein: dict[str, float] = defaultdict(float)
    other: dict[str, float] = defaultdict(float)
    for e in events:
        overlap = min(e.time_range.end, end) - max(e.time_range.start, start)
        if overlap > 0:
            (klein if e.name.startswith("klein.") else other)[e.name] += overlap / 1000
    ranked = sorted(other.items(), key=lambda kv: -kv[1])[:top]
    return {"klein": dict(sorted(klein.items(), key=lambda kv: -kv[1])),
            "ops": [{"op": k[:80], "ms": round(v, 3)} for k, v in ranked]}


def device_events(events: list[Any]) -> tuple[list[Any], list[Any]]:
    """The GPU timeline's ``(kernels and copies, annotated ranges)``.

    The engine marks its stages with ``torch.profiler.record_function`` ranges (``klein.text``,
    ``klein.step``, ...), and the profiler mirrors each range on the GPU timeline as a user annotation
    spanning the stage's kernels. Counted as kernels (the 2026-11-27 compile profile) they made the
    GPU "busy" 840 ms in a 324 ms span and covered every idle gap inside a stage."""
    kernels, ranges = [], []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        annotated = bool(getattr(e, "is_user_annotation", False)) or e.name.startswith("klein.")
        (ranges if annotated else kernels).append(e)
    return kernels, ranges


def _device_us(e: Any) -> float:
    return e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total


def python_profile(run: Callable[[], Any], pattern: str, top: int = 40) -> dict[str, list[str]]:
    """Python's profile of ``run()``: ``cumulative``, the functions whose file matches ``pattern``
    (waits for the GPU included), and ``self``, any function by its own time; the table's header
    line and rows. Profiling slows the host: read the shares, not the times."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        run()
    finally:
        prof.disable()
    out: dict[str, list[str]] = {}
    for key, order, restrict in (("cumulative", "cumulative", (pattern, top)), ("self", "tottime", (top // 2,))):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(*restrict)
        out[key] = [line.rstrip() for line in text.getvalue().splitlines() if "(" in line and ":" in line]
    return out


def summarise(prof: Any, wall_ms: float) -> dict[str, Any]:
    kernels, ranges = device_events(prof.events())
    stage_spans: dict[str, float] = defaultdict(float)
    for e in ranges:
        stage_spans[e.name] += (e.time_range.end - e.time_range.start) / 1000
    by_name: dict[str, float] = defaultdict(float)
    by_family: dict[str, float] = defaultdict(float)
    spans = []
    for e in kernels:
        us = _device_us(e)
        by_name[e.name] += us / 1000
        by_family[family(e.name)] += us / 1000
        spans.append((e.time_range.start, e.time_range.end, e.name))
    spans.sort()
    gaps = []
    busy_end = spans[0][1] if spans else 0
    prev = spans[0][2] if spans else ""
    for start, end, name in spans[1:]:
        if start > busy_end:
            gaps.append(((start - busy_end) / 1000, prev, name, (busy_end - spans[0][0]) / 1000, busy_end, start))
        if end > busy_end:
            busy_end, prev = end, name
    gaps.sort(reverse=True)
    host = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    cpu = sorted(((e.key, e.self_cpu_time_total / 1000, e.count) for e in prof.key_averages()
                  if e.self_cpu_time_total > 0), key=lambda r: -r[1])
    copies: dict[str, dict[str, float]] = {}  # host <-> device copies by kind (pageable ones stall the GPU)
    for e in kernels:
        if e.name.startswith("Memcpy"):
            row = copies.setdefault(e.name, {"count": 0, "ms": 0.0})
            row["count"] += 1
            row["ms"] += _device_us(e) / 1000
    return {
        "wall_ms": wall_ms,
        "gpu_busy_ms": sum(by_family.values()),
        "gpu_first_to_last_ms": (spans[-1][1] - spans[0][0]) / 1000 if spans else 0.0,
        "gpu_idle_ms": sum(g[0] for g in gaps),
        "kernels_by_family_ms": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
        "stage_spans_ms": dict(sorted(stage_spans.items(), key=lambda kv: -kv[1])),  # GPU spans of klein.* ranges
        "top_kernels_ms": sorted(by_name.items(), key=lambda kv: -kv[1])[:25],
        "largest_gaps": [{"ms": g[0], "at_ms": g[3], "after": g[1][:80], "before": g[2][:80],
                          **({"host": host_during(host, g[4], g[5])} if i < 8 else {})}
                         for i, g in enumerate(gaps[:20])],
        "cpu_ops_self_ms": [{"op": k, "self_ms": ms, "count": n} for k, ms, n in cpu[:25]],
        "memcpy": copies,
        "host_waits": {k: {"self_ms": ms, "count": n} for k, ms, n in cpu
                       if k in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="4b", choices=["4b", "9b"])
    ap.add_argument("--case", default="a", choices=["a", "b", "c"])
    ap.add_argument("--speed", default=speed.DEFAULT_SPEED, choices=list(speed.SPEEDS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny models on small images (tests the script)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = _spec("tiny" if args.tiny else args.model)
    case = _cases(args.tiny)[args.case]
    tr, te, vae = build_ours(spec, device, dtype)
    speed.apply_speed(tr, vae, args.speed, te)
    noise = make_noise(SEED, 1, spec.transformer.in_channels, case.size // 16, case.size // 16)
    refs = _images(case.size, case.n_refs)

    def run() -> dict[str, float]:
        res = klein_core.generate(tr, te, vae, prompt=PROMPT, references=refs, width=case.size, height=case.size,
                                  steps=case.steps, guidance=case.guidance, kind="distilled" if case.distilled else "base", noise=noise,
                                  cache=None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return {k: v * 1000 for k, v in res.timings.items()}

    for _ in range(args.warmup):
        run()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof, HostAudit(profile=True) as profiled_audit:
        t0 = time.perf_counter()
        run()
        wall = (time.perf_counter() - t0) * 1000
    # The engine's own stage clocks (synchronised) against the wall, then Python's view of one run.
    with HostAudit() as plain_audit:
        t0 = time.perf_counter()
        stages = run()
        plain_wall = (time.perf_counter() - t0) * 1000
    python = python_profile(run, r"klein_core|PIL|numpy")
    result = {"model": spec.name, "case": case.title, "speed": args.speed, "device": str(device),
              "described": speed.describe_speed(tr), **summarise(prof, wall),
              "host_audit": profiled_audit.result(),
              "unprofiled": {"wall_ms": plain_wall, "engine_stages_ms": stages,
                             "outside_stages_ms": plain_wall - sum(stages.values()),
                             "host_audit": plain_audit.result()},
              "cprofile_cumulative": python["cumulative"], "cprofile_self": python["self"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("model", "case", "wall_ms", "gpu_busy_ms", "gpu_idle_ms",
                                             "kernels_by_family_ms", "memcpy", "host_audit", "unprofiled")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
