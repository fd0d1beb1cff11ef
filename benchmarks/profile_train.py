"""Where one LoRA training step spends its GPU time, klein_core's trainer beside diffusers + peft (issue 30).

``train_speed.py`` measured our step 5-17 % slower than diffusers + peft on an H100 (2026-11-27,
``benchmarks/results/2026-11-27_h100``). This script runs one case of ``train_speed.py`` (the same
models, LoRA, sample and optimizer; ``--case``, default ``4b``) with each side's steps profiled:
``--warmup`` untimed steps, then one step under ``torch.profiler``. It reports, for both sides, the GPU
time by kernel family and the top kernels (``profile_run.summarise``: matmul, attention, norm/rope,
elementwise, copies...), and prints the families side by side, so the kernels that make the
difference can be named.

Usage (GPU, from the repository root)::

    python benchmarks/profile_train.py --case 4b --out profile_train_4b.json
    python benchmarks/profile_train.py --case 4b --speed fast --no-diffusers --out profile_train_4b_fast.json
    python benchmarks/profile_train.py --tiny --device cpu --out /tmp/pt.json   # CPU self-test

On the CPU there are no GPU kernels: the families are empty and only the host operators are listed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

from benchmarks import train_speed  # noqa: E402
from benchmarks.profile_run import summarise  # noqa: E402


def profiled_steps(warmup: int, reports: list[dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A stand-in for ``train_speed.time_steps``: ``warmup`` steps, then one step under the
    profiler, its summary appended to ``reports`` (ours first, then diffusers: ``measure``'s order)."""
    def run(step: Callable[[], float], device: torch.device, _warmup: int, _steps: int) -> dict[str, Any]:
        for _ in range(warmup):
            step()
        train_speed._sync(device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            loss = step()
            train_speed._sync(device)
            wall = (time.perf_counter() - t0) * 1000
        reports.append({"wall_ms": wall, "loss": loss, **summarise(prof, wall)})
        s = wall / 1000
        return {"s_per_step": s, "it_per_s": 1 / s, "peak_gb": None, "peak_gib": None, "losses": [loss]}
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="4b", choices=list(train_speed.CASES))
    ap.add_argument("--preset", default="style", choices=train_speed.PRESETS)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny models (checks the script; numbers mean nothing)")
    ap.add_argument("--speed", default="plain", choices=train_speed.SPEEDS,
                    help="our transformer's path (apply_speed, as TrainJob(speed=...)); default plain")
    ap.add_argument("--no-diffusers", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the optimizer's state and the kernels' choices come first)")
    # train_speed's own options, for its measure(): one case, this preset and rank
    ts_args = train_speed.parse_args(["--cases", args.case, "--preset", args.preset, "--rank", str(args.rank),
                                      "--warmup", str(args.warmup), "--steps", "1", "--out", str(args.out),
                                      "--speed", args.speed]
                                     + (["--tiny"] if args.tiny else []) + (["--no-diffusers"] if args.no_diffusers
                                                                            else []))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device = train_speed.indexed_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reports: list[dict[str, Any]] = []
    train_speed.time_steps = profiled_steps(args.warmup, reports)  # measure() times through it
    rows = {args.case: train_speed._case_row(train_speed.CASES[args.case], ts_args, dtype)}
    peers: dict[str, dict] = {}
    train_speed.measure(ts_args, device, dtype, rows, peers,
                        "diffusers: skipped (--no-diffusers)" if args.no_diffusers else None)
    errors = {k: v["error"] for k, v in [("ours", rows[args.case].get("ours", {})), *peers.items()] if "error" in v}
    names = ["ours", "diffusers"][:len(reports)]
    result = {"case": args.case, "preset": args.preset, "rank": args.rank, "speed": args.speed, "device": str(device),
              "dtype": str(dtype), "errors": errors, **dict(zip(names, reports))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    families = sorted({f for n in names for f in result[n]["kernels_by_family_ms"]})
    print(f"one training step, case {args.case} ({device}, {dtype}), ours at speed {args.speed}; GPU ms by kernel family")
    print(f"{'family':14}" + "".join(f"{n:>12}" for n in names))
    for fam in families:
        print(f"{fam:14}" + "".join(f"{result[n]['kernels_by_family_ms'].get(fam, 0.0):12.1f}" for n in names))
    for key in ("gpu_busy_ms", "gpu_idle_ms", "wall_ms"):
        print(f"{key:14}" + "".join(f"{result[n][key]:12.1f}" for n in names))
    for name, err in errors.items():
        print(f"{name}: {err}")
    print(f"full results: {args.out}")
    return 1 if errors or not reports else 0


if __name__ == "__main__":
    raise SystemExit(main())
