"""What reusing the references' keys/values saves (Klein 9B-KV mode), on random weights.

Three runs of the same edit through :class:`klein_core.Engine` with ``ref_mode="kv"``: a first run
(reference pass + steps), a second run with another seed and prompt that takes the stored keys/values
from the :class:`~klein_core.ReferenceKVCache`, and the same second run with no cache. It also times
the joint mode (references in the sequence at every step, Klein 4B/9B) for contrast, and reports the
stored bytes. On a GPU pass ``--device cuda --dtype bf16`` and a real width (the 9B is hidden 4096,
8 + 24 blocks, 32 heads).

Usage::

    python benchmarks/kv_reuse.py [--hidden 512] [--heads 4] [--depth 2] [--single 4] [--size 512]
        [--refs 2] [--steps 4] [--device cpu] [--dtype fp32] [--out kv_reuse.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import klein_core as kc  # noqa: E402
from klein_core.models.transformer import Flux2Transformer, TransformerConfig, kv_bytes  # noqa: E402
from klein_core.pipeline.reference_kv import ReferenceKVCache  # noqa: E402
from klein_core.pipeline.sampling import reference_tokens  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--size", type=int, default=512, help="output and reference side in pixels")
    ap.add_argument("--refs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    head_dim = args.hidden // args.heads
    cfg = TransformerConfig(hidden_size=args.hidden, num_heads=args.heads, depth=args.depth,
                            depth_single=args.single, context_dim=3 * 64, mlp_hidden=3 * args.hidden,
                            axes_dim=(head_dim // 4,) * 4)
    torch.manual_seed(0)
    with torch.device(device):
        model = Flux2Transformer(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    side = args.size // 16
    refs = [torch.randn(1, 128, side, side) for _ in range(args.refs)]
    cond = kc.Conditioning(torch.randn(1, 512, cfg.context_dim))
    settings = kc.Settings(width=args.size, height=args.size, steps=args.steps)

    def run(cache, seed, mode="kv"):
        engine = kc.Engine(model, kind="kv", device=device, ref_mode=mode, kv_cache=cache, memory="resident")
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            latents, _ = engine.denoise(cond, refs, kc.Settings(**{**settings.__dict__, "seed": seed}))
        _sync(device)
        return time.perf_counter() - t0, latents

    run(None, 0)  # warm up
    cache = ReferenceKVCache()
    first, _ = run(cache, 1)
    reused, a = run(cache, 2)
    fresh, b = run(None, 2)
    joint, _ = run(None, 2, "joint")
    ref_tokens = args.refs * side * side
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        model.reference_kv(reference_tokens(refs).tokens, reference_tokens(refs).ids)
        _sync(device)
        ref_pass = time.perf_counter() - t0
    result = {
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "device": str(device), "torch": torch.__version__,
        "reference_tokens": ref_tokens, "image_tokens": side * side,
        "seconds": {"kv_first_run": first, "kv_second_run_reused": reused, "kv_second_run_fresh": fresh,
                    "joint_mode_run": joint, "reference_pass_alone": ref_pass},
        "saved_by_reuse_s": fresh - reused,
        "reuse_equal_to_fresh": bool(torch.equal(a, b)),
        "stored_kv_bytes": cache.nbytes(),
        "stored_kv_bytes_formula": kv_bytes(cfg, ref_tokens, torch.finfo(dtype).bits // 8),
        "stored_kv_bytes_per_1mp_reference_klein_9b_bf16": kv_bytes(
            TransformerConfig(hidden_size=4096, num_heads=32, depth=8, depth_single=24, context_dim=12288,
                              mlp_hidden=12288), 4096),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
