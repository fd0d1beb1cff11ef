"""Throughput of the Ray batch job with 1, 2, 4 CPU actors on tiny models, and Ray's cost per image.

Every variant runs the same rows (``--rows``, tiny random models, ``--size`` px, ``--steps``); every
worker (the plain loop, each actor) is one process with one CPU and one torch thread, so k actors
use k CPUs (more actors than cores oversubscribe, and the table shows it). It reports, per actor count, the job's wall time (Ray start-up, actor start and
model loading included) and the steady rate from the first finished row to the last, their ratio
to 1 actor, and Ray's overhead per image: (1 actor's steady seconds per image) minus (a plain
in-process loop's). Output: a table, and ``--out`` JSON.

    python benchmarks/scale.py --rows 24 --actors 1,2,4 --out out/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from klein_core.distributed.batch import BatchConfig, run_batch_job
from klein_core.distributed.models import ModelSpec
from klein_core.distributed.rows import RowSpec
from klein_core.distributed.runner import RowRunner


def rows(n: int, size: int, steps: int) -> list[RowSpec]:
    return [RowSpec(f"r{i:04d}", f"a lighthouse at dusk, take {i}", "", size, size, steps, None, i) for i in range(n)]


def plain_loop(todo: list[RowSpec], threads: int) -> float:
    """Seconds per image of the rows run in this process, models loaded once, the first row as warm-up."""
    torch.set_num_threads(threads)
    runner = RowRunner(ModelSpec(demo=True))
    runner.run(todo[0], [])
    t0 = time.perf_counter()
    for r in todo:
        runner.run(r, [])
    return (time.perf_counter() - t0) / len(todo)


def ray_job(todo: list[RowSpec], actors: int, cpus: int, batch_size: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "rows.jsonl"
        src.write_text("".join(json.dumps({k: v for k, v in json.loads(r.to_json()).items()
                                           if k not in ("references", "loras")}) + "\n" for r in todo))
        stamps: list[float] = []
        config = BatchConfig(src, Path(tmp) / "out", ModelSpec(demo=True), actors=actors,
                             cpus_per_actor=1, batch_size=batch_size, num_cpus=cpus)
        t0 = time.perf_counter()
        summary = run_batch_job(config, lambda done, *_: stamps.append((done, time.perf_counter())))
        wall = time.perf_counter() - t0
    (d0, t_first), (d1, t_last) = stamps[0], stamps[-1]
    steady = (t_last - t_first) / max(d1 - d0, 1)  # between result batches: coarse for few rows
    return {"actors": actors, "wall_s": round(wall, 3), "images": summary.generated, "failed": summary.failed,
            "steady_s_per_image": round(steady, 4), "per_worker": summary.per_worker}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=24)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--actors", default="1,2,4")
    p.add_argument("--cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: most actors)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    import ray

    todo = rows(a.rows, a.size, a.steps)
    counts = [int(k) for k in a.actors.split(",")]
    a.cpus = a.cpus or max(counts)
    plain = plain_loop(todo, 1)
    ray.init(num_cpus=a.cpus, include_dashboard=False, log_to_driver=False)
    try:
        runs = [ray_job(todo, k, a.cpus, a.batch_size) for k in counts]
    finally:
        ray.shutdown()
    base = runs[0]
    for r in runs:
        r["throughput_vs_1"] = round(base["steady_s_per_image"] / r["steady_s_per_image"], 3)
        r["wall_vs_1"] = round(base["wall_s"] / r["wall_s"], 3)
    result = {"rows": a.rows, "size": a.size, "steps": a.steps, "cpus": a.cpus, "torch": torch.__version__,
              "plain_s_per_image": round(plain, 4), "runs": runs,
              "ray_overhead_s_per_image": round(base["steady_s_per_image"] - plain, 4)}
    print(f"plain loop: {plain:.4f} s/image (1 thread); host has {os.cpu_count()} CPUs")
    print("actors  wall s  steady s/image  throughput vs 1  per worker")
    for r in runs:
        print(f"{r['actors']:>6}  {r['wall_s']:>6.1f}  {r['steady_s_per_image']:>14.4f}  {r['throughput_vs_1']:>15.2f}"
              f"  {list(r['per_worker'].values())}")
    print(f"Ray overhead, 1 actor against the plain loop: {result['ray_overhead_s_per_image'] * 1000:+.1f} ms/image")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
