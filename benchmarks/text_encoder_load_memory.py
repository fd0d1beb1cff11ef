"""Peak memory of ``load_text_encoder`` against the size of the file it reads.

Writes a random Qwen3 checkpoint in the ComfyUI single-file layout (``model.*`` keys plus
``lm_head.weight``, bf16) to a temporary folder, then loads it with ``load_text_encoder`` in a fresh
Python process and reports:

* the file size and how it splits into what Klein needs (embedding + layers 1-27) and what it never
  reads (layers 28-36, the final norm, ``lm_head``);
* the tensors actually read (counted through an instrumented ``WeightSource``);
* the growth of the process's peak resident set (``VmHWM``) during the load.

If the unused tensors were read, the peak would exceed the "needed" bytes by about their size.

Usage::

    python benchmarks/text_encoder_load_memory.py [--hidden 512] [--layers 36] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _write_checkpoint(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file

    from klein_core.files.qwen3_layout import checkpoint_shapes

    head_dim = 64
    heads = max(1, hidden // head_dim)
    kv = max(1, heads // 4)
    inter = (hidden * 38) // 10  # Qwen3-4B's 9728 / 2560 ratio
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    shapes = checkpoint_shapes(hidden, heads, kv, head_dim, inter, vocab, num_layers=layers)
    sd = {k: rnd(*shape) for k, shape in shapes.items()}
    save_file(sd, str(path))


def _child(path: str, dtype_name: str) -> None:
    """Runs in a fresh process: load once, report reads and peak RSS as JSON on stdout."""
    sys.path.insert(0, str(REPO))
    import torch

    from klein_core.files.loaders import load_text_encoder
    from klein_core.files.opening import open_weights
    from klein_core.files.source import WeightSource

    base = open_weights(path, component="text encoder")
    read: list[str] = []

    def reader(key: str) -> torch.Tensor:
        read.append(key)
        return base.get(key)

    src = WeightSource(base.name, {k: base.info(k) for k in base.keys()}, reader, base.metadata)

    def nbytes(key: str) -> int:
        info = src.info(key)
        n = info.dtype.itemsize
        for s in info.shape:
            n *= s
        return n

    # One-time torch start-up costs are ~70 MiB on their own (nn.Embedding's init on the meta device
    # imports ~800 modules of torch._refs/_decomp);
    # pay them before the baseline so the growth measures the load.
    with torch.device("meta"):
        torch.nn.Embedding(2, 2)
    torch.ones(2).sum()
    hwm_before = _status_kib("VmHWM")
    dtype = None if dtype_name == "stored" else getattr(torch, dtype_name)
    model = load_text_encoder(src, dtype=dtype)
    hwm_after = _status_kib("VmHWM")
    # klein_core reads each tensor into memory it owns (no file map), so the peak right after the
    # load already counts every byte; touching every parameter shows nothing more is allocated later.
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    hwm_touched = _status_kib("VmHWM")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    unread = sorted(set(src.keys()) - set(read))
    report = {
        "tensors_in_file": len(src),
        "tensors_read": len(read),
        "bytes_in_file_tensors": sum(nbytes(k) for k in src.keys()),
        "bytes_read": sum(nbytes(k) for k in read),
        "bytes_never_read": sum(nbytes(k) for k in unread),
        "never_read_examples": [k for k in unread if "layers." not in k],
        "never_read_layers": sorted({int(k.split(".")[2]) for k in unread if k.startswith("model.layers.")}),
        "param_bytes": param_bytes,
        "peak_rss_growth": (hwm_after - hwm_before) * 1024,
        "peak_rss_growth_touched": (hwm_touched - hwm_before) * 1024,
        "rss_anon_after": _status_kib("RssAnon") * 1024,  # measured after touching
        "rss_file_after": _status_kib("RssFile") * 1024,
    }
    sys.stdout.write(json.dumps(report) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument(
        "--dtype", choices=["stored", "bfloat16", "float16", "float32"], default="stored",
        help="dtype to load in (stored = keep the file's bf16)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.dtype)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3_random_bf16.safetensors"
        _write_checkpoint(path, args.hidden, args.layers, args.vocab)
        size = path.stat().st_size
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(path), "--dtype", args.dtype],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"random Qwen3 file: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, bf16; "
          f"loaded as {args.dtype}")
    print(f"  file size on disk          {size / MiB:9.1f} MiB")
    print(f"  tensors read               {r['tensors_read']} of {r['tensors_in_file']}")
    print(f"  bytes read (needed)        {r['bytes_read'] / MiB:9.1f} MiB")
    print(f"  bytes never read           {r['bytes_never_read'] / MiB:9.1f} MiB  "
          f"(layers {r['never_read_layers'][0] + 1}-{r['never_read_layers'][-1] + 1} counted from 1, "
          f"{', '.join(r['never_read_examples'][:2])})")
    print(f"  loaded parameters          {r['param_bytes'] / MiB:9.1f} MiB")
    print(f"  peak RSS growth (VmHWM), right after load        {r['peak_rss_growth'] / MiB:9.1f} MiB")
    print(f"  peak RSS growth after touching every parameter  {r['peak_rss_growth_touched'] / MiB:9.1f} MiB")
    print(f"  then: RssAnon {r['rss_anon_after'] / MiB:.1f} MiB (the owned weights), RssFile "
          f"{r['rss_file_after'] / MiB:.1f} MiB (libraries)")
    print(f"  peak growth (touched) / file size               {r['peak_rss_growth_touched'] / size:9.2f}")


if __name__ == "__main__":
    main()
