"""The FLUX.2 VAE decode in every layout klein_core can run it, timed and profiled (issue #26, item 3).

Variants (full-size random-weight VAE built on the device, one 1024x1024 image by default):

* ``plain``: NCHW, PyTorch's GroupNorm, the model dtype (``speed="plain"``);
* ``fast``: ``enable_fast_vae(compile=False)``, what ``speed="fast"`` runs: each GroupNorm + SiLU
  as one comfy-kitchen kernel writing channels-last, so the convolutions after it run NHWC;
* ``fast+channels_last``: the same with the decoder's weights and input stored NHWC too;
* ``channels_last``: the eager NHWC decode with PyTorch's GroupNorm (the old ``enable_fast_vae``
  default, measured slower than plain);
* ``plain+cudnn_benchmark``: plain under ``torch.backends.cudnn.benchmark`` (set only around this
  script's calls; with ``--all``);
* ``compiled``: ``enable_fast_vae(compile=True)`` (channels-last under Inductor; ``speed="compile"``);
  ``compiled_nchw`` the same with ``channels_last=False`` (with ``--all``).

For the eager variants the CUDA time is split by kernel (torch.profiler, one decode): the five
costliest kernels and the share of GroupNorm, SiLU, upsampling, convolutions and layout copies.
Medians of ``--runs`` decodes (CUDA events) after ``--warmup`` decodes; every variant's pixels are
compared with ``plain``.

Memory, per variant on CUDA: the peak one decode allocates above what was allocated before it
(``peak_mb``), next to the memory planner's estimate for the decode (``estimate_mb``,
:func:`klein_core.memory.planner.vae_decode_activation_bytes`, which matches the eager trace on the
CPU), and what was live at that peak (``at_peak``: the largest allocations, each with the Python
line that made it, from the allocator's history). On an H100 the decode stage measured about 1 GB
above the estimate at 1024² (2026-11-26/27); this names where it goes.

    python benchmarks/vae_decode.py --out vae.json           # GPU
    python benchmarks/vae_decode.py --tiny --out /tmp/v.json  # CPU self-test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.timing import call_times
from klein_core.accel import fast
from klein_core.memory.planner import vae_decode_activation_bytes
from klein_core.models import Flux2VAE, VAEConfig
from klein_core.models.variants import KLEIN_4B
from klein_core.testing.fill import full_size_configs, random_fill_

KERNEL_GROUPS = {  # substrings of CUDA kernel names -> what they do
    "group_norm": ("group_norm", "GroupNorm", "RowwiseMoments", "ComputeFusedParams", "group_norm_kernel"),
    "convolution": ("conv", "implicit_gemm", "sm90_xmma", "cutlass", "cudnn", "gemm", "wgrad", "fprop"),
    "silu": ("silu", "SiLU"),
    "upsample": ("upsample", "nearest"),
    "layout copy": ("nchwToNhwc", "nhwcToNchw", "copy_", "direct_copy", "transpose"),
}


def build_vae(tiny: bool, device: torch.device, dtype: torch.dtype) -> Flux2VAE:
    if tiny:
        cfg = VAEConfig(block_channels=(32,) * 4, decoder_block_channels=(32,) * 4, num_res_blocks=1)
    else:
        cfg = full_size_configs(KLEIN_4B)[2]
    with torch.device("meta"):
        vae = Flux2VAE(cfg)
    vae.to(dtype)
    vae.bn.float()
    vae.to_empty(device=device)
    random_fill_(vae, torch.Generator(device=device).manual_seed(0))
    return vae.eval().requires_grad_(False)


@contextmanager
def cudnn_benchmark(on: bool) -> Iterator[None]:
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def time_decode(vae: Flux2VAE, lat: torch.Tensor, runs: int, warmup: int) -> tuple[list[float], torch.Tensor, float]:
    """(per-run ms, the last pixels, the first call's ms)."""
    cuda = lat.device.type == "cuda"
    t0 = time.perf_counter()
    out = vae.decode(lat)
    if cuda:
        torch.cuda.synchronize(lat.device)
    first = (time.perf_counter() - t0) * 1000
    for _ in range(max(warmup - 1, 0)):
        vae.decode(lat)
    last: dict[str, torch.Tensor] = {}
    times = call_times(lambda: last.update(out=vae.decode(lat)), lat.device, runs)
    return times, last["out"], first


def live_at_peak(events: list[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """Replay the CUDA caching allocator's history (``torch.cuda.memory._snapshot()["device_traces"]``
    of one device: ``alloc`` / ``free_completed`` entries with ``addr``, ``size`` and Python
    ``frames``) and describe the moment the most bytes were live: the bytes, and the ``top``
    largest allocations then, each ``{"mb", "where"}`` (``where``: the innermost frame outside torch,
    then the innermost torch function, e.g. ``klein_core/models/vae.py:88 forward <- conv2d``).
    Memory allocated before the history began is not counted."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif action == "free_completed" and e.get("addr") in live:
            total -= live.pop(e["addr"])["size"]
    largest = sorted(at_peak, key=lambda a: -a["size"])[:top]
    return {"mb": peak / 2**20, "largest": [{"mb": a["size"] / 2**20, "where": _where(a.get("frames", []))}
                                            for a in largest]}


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch (file relative to klein_core/benchmarks when it is ours)
    and the innermost torch function it called."""
    def outside(f: dict[str, Any]) -> bool:
        return "/torch/" not in f.get("filename", "")

    own = next((f for f in frames if outside(f)), None)
    inner = next((f for f in frames if not outside(f) and f.get("name")), None)
    text = "?"
    if own is not None:
        name = own.get("filename", "?")
        for root in ("klein_core/", "benchmarks/"):
            if root in name:
                name = root + name.split(root, 1)[1]
        text = f"{name}:{own.get('line', '?')} {own.get('name', '?')}"
    return text + (f" <- {inner['name']}" if inner is not None else "")


def peak_memory(vae: Flux2VAE, lat: torch.Tensor) -> dict[str, Any] | None:
    """One decode's peak bytes above those allocated before it, and what was live then (CUDA only)."""
    if lat.device.type != "cuda":
        return None
    torch.cuda.synchronize(lat.device)
    base = torch.cuda.memory_allocated(lat.device)
    torch.cuda.reset_peak_memory_stats(lat.device)
    vae.decode(lat)
    torch.cuda.synchronize(lat.device)
    result: dict[str, Any] = {"peak_mb": (torch.cuda.max_memory_allocated(lat.device) - base) / 2**20}
    # One more decode with the allocator's history on (a private torch API: if it fails, the peak stays)
    try:
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=200_000)
        try:
            vae.decode(lat)
            torch.cuda.synchronize(lat.device)
            snap = torch.cuda.memory._snapshot(lat.device)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        index = lat.device.index if lat.device.index is not None else torch.cuda.current_device()
        traces = snap.get("device_traces", [])
        result["at_peak"] = live_at_peak(traces[index] if index < len(traces) else [])
    except Exception as exc:  # noqa: BLE001 - the history is a diagnosis, not the measurement
        result["at_peak"] = {"error": f"{type(exc).__name__}: {exc}"[:300], "mb": None, "largest": []}
    return result


def kernel_profile(vae: Flux2VAE, lat: torch.Tensor) -> dict[str, Any]:
    """One decode under torch.profiler: the costliest kernels and the share of each kind."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        vae.decode(lat)
        torch.cuda.synchronize(lat.device)
    rows = [(e.key, e.device_time_total / 1000.0) for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(ms for _, ms in rows) or float("nan")
    groups: dict[str, float] = {g: 0.0 for g in KERNEL_GROUPS}
    groups["other"] = 0.0
    for name, ms in rows:
        group = next((g for g, keys in KERNEL_GROUPS.items() if any(k.lower() in name.lower() for k in keys)), "other")
        groups[group] += ms
    top = sorted(rows, key=lambda r: -r[1])[:5]
    return {"total_ms": total, "by_kind_ms": groups, "top_kernels": [{"name": n[:120], "ms": ms} for n, ms in top]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels (multiple of 16)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="tiny VAE on the CPU (tests the script)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    ap.add_argument("--all", action="store_true", help="also the cudnn.benchmark and compiled NCHW variants")
    ap.add_argument("--out", default="out/vae_decode.json")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = 64 if args.tiny else args.size
    vae = build_vae(args.tiny, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    lat = torch.randn(1, vae.config.latent_channels, size // 16, size // 16, generator=g).to(device)

    def eager(channels_last: bool, fused: bool) -> Callable[[], None]:
        return lambda: fast.enable_fast_vae(vae, compile=False, fused_norm=fused, channels_last=channels_last)

    def compiled(channels_last: bool) -> Callable[[], None]:
        return lambda: fast.enable_fast_vae(vae, compile=True, channels_last=channels_last)

    variants: list[tuple[str, Callable[[], None], bool]] = [
        ("plain", lambda: fast.disable_fast_vae(vae), False),
        ("fast", eager(False, True), False),
        ("fast+channels_last", eager(True, True), False),
        ("channels_last", eager(True, False), False),
    ]
    if args.all:
        variants.append(("plain+cudnn_benchmark", lambda: fast.disable_fast_vae(vae), True))
    if not args.no_compile:
        variants.append(("compiled", compiled(True), False))
        if args.all:
            variants.append(("compiled_nchw", compiled(False), False))
    results: dict[str, Any] = {}
    ref = None
    with torch.no_grad():
        for name, setup, bench in variants:
            setup()
            with cudnn_benchmark(bench):
                times, out, first = time_decode(vae, lat, args.runs, args.warmup)
                prof = kernel_profile(vae, lat) if device.type == "cuda" and "compiled" not in name else None
                memory = peak_memory(vae, lat)
            ref = out.float() if ref is None else ref
            d = (out.float() - ref).abs()
            results[name] = {"median_ms": statistics.median(times), "all_ms": times, "first_call_ms": first,
                             "max_abs_vs_plain": float(d.max()), "finite": bool(torch.isfinite(out).all()),
                             **({"profile": prof} if prof else {}), **(memory or {})}
        fast.disable_fast_vae(vae)
    estimate = vae_decode_activation_bytes(size, size, 1, vae.config.decoder_block_channels, lat.element_size())
    env = {"torch": torch.__version__, "device": str(device), "dtype": str(dtype), "size": size,
           "estimate_mb": estimate / 2**20,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None}
    report = {"env": env, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"VAE decode {size}x{size} {str(dtype).removeprefix('torch.')} on {env['gpu'] or device} (ms, median)")
    for name, r in results.items():
        line = f"  {name:32} {r['median_ms']:8.1f}  first {r['first_call_ms']:8.0f}  max|d| {r['max_abs_vs_plain']:.3g}"
        if "profile" in r:
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in r["profile"]["by_kind_ms"].items() if v)
            line += f"\n      kernels: {kinds}"
        if "peak_mb" in r:
            top = ", ".join(f"{a['mb']:.0f} MB {a['where']}" for a in r["at_peak"]["largest"][:3]) \
                or r["at_peak"].get("error", "")
            line += f"\n      peak {r['peak_mb']:.0f} MB (estimate {estimate / 2**20:.0f}); largest then: {top}"
        print(line)
    return report


if __name__ == "__main__":
    main()
