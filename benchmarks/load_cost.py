"""What reading weights as owned copies costs, against memory-mapping them (CPU).

klein_core reads every tensor with ``readinto`` into memory the tensor owns, so a model never
depends on its file afterwards (a file truncated or rewritten under a live model cannot crash the
process with SIGBUS or change its weights). A memory map (``safetensors.safe_open``) costs no copy
until the pages are touched. This writes a Qwen3-shaped bf16 checkpoint (the text encoder has the
largest never-read part: layers 28-36 and ``lm_head``), warms the page cache, and in fresh processes
measures, for the 27 layers Klein reads: the time to get every tensor, the time until every page has
been touched once (what the first forward pass does), and the growth of the peak resident set.
The full ``load_text_encoder`` (owned reads) is measured the same way.

Usage::

    python benchmarks/load_cost.py [--hidden 512] [--layers 36] [--repeats 3] [--out load_cost.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[3])

def hwm():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

mode, path = sys.argv[1], sys.argv[2]
import klein_core as kc
from klein_core.files.safetensors import open_safetensors
header = open_safetensors(path)
keys = [k for k in header.tensors if not k.startswith("lm_head") and k != "model.norm.weight"
        and not (k.startswith("model.layers.") and int(k.split(".")[2]) >= 27)]
base = hwm()
t0 = time.perf_counter()
if mode == "mmap":
    from safetensors import safe_open
    f = safe_open(path, framework="pt", device="cpu")
    tensors = [f.get_tensor(k) for k in keys]
elif mode == "owned":
    tensors = [header.read(k) for k in keys]
else:
    model = kc.load_text_encoder(path)
    tensors = [p for p in model.parameters()]
got = time.perf_counter() - t0
total = 0.0
for t in tensors:  # touch every page once, as a first forward pass would
    total += float(t.view(-1)[:: max(1, 4096 // t.element_size())].float().sum())
touched = time.perf_counter() - t0
print(json.dumps({"mode": mode, "tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors),
                  "get_s": got, "touched_s": touched, "peak_growth": hwm() - base}))
"""


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch
    from safetensors.torch import save_file

    from klein_core.files.qwen3_layout import checkpoint_shapes

    shapes = checkpoint_shapes(args.hidden, 8, 2, 64, 3 * args.hidden, num_layers=args.layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3.safetensors"
        g = torch.Generator().manual_seed(0)
        save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}, str(path))
        path.read_bytes()  # warm the page cache: both modes then read from memory, as a second load does
        for _ in range(args.repeats):
            for mode in ("mmap", "owned", "load_text_encoder"):
                done = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(REPO)], capture_output=True,
                                      text=True, check=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        size = path.stat().st_size
    summary = {}
    for mode in ("mmap", "owned", "load_text_encoder"):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {
            "read_MiB": mine[0]["bytes"] / MiB,
            "get_s": min(r["get_s"] for r in mine),
            "touched_s": min(r["touched_s"] for r in mine),
            "peak_growth_MiB": min(r["peak_growth"] for r in mine) / MiB,
        }
    report = {"file_MiB": size / MiB, "hidden": args.hidden, "layers": args.layers, "summary": summary, "rows": rows}
    print(f"file {size / MiB:.1f} MiB; the 27 layers Klein reads: {summary['owned']['read_MiB']:.1f} MiB")
    for mode, s in summary.items():
        print(f"{mode:>18}: tensors in {s['get_s']:.3f} s, every page touched after {s['touched_s']:.3f} s, "
              f"peak RSS +{s['peak_growth_MiB']:.1f} MiB")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
