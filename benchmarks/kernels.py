"""Per-op speed and agreement: klein_core's plain PyTorch path against comfy-kitchen, its fused-kernel backend.

Issue #19 replaced klein_core's own Triton kernels with comfy-kitchen's (ComfyUI's kernel library);
this script measures, at Klein's real shapes on one device, what the fast paths gain from it per
block step and how its fp8 matmul compares with klein_core's ``FP8Linear``:

* ``modulate``: LayerNorm then ``(1 + scale) * x + shift`` (plain vs comfy-kitchen ``adaln``),
  x ``[B, L, hidden]``;
* ``qk_norm_rope``: per-head RMSNorm of q and k, joined [txt, img], then interleaved RoPE (plain vs
  comfy-kitchen ``rms_rope``), q/k ``[B, L_i, H, 128]`` views of the projection, as in a block;
* ``blocks``: one full-size double block and one single block (random weights), plain against the
  fast path without its fused elementwise steps (gated residuals, SwiGLU, the single block's
  concatenation), with them but SwiGLU as two PyTorch ops, and complete; ``step_ms`` sums the
  blocks of one step;
* ``fp8_linear``: a Linear with e4m3 weights and a per-tensor scale, activations quantised per
  call (klein ``FP8Linear`` with ``torch._scaled_mm`` vs comfy-kitchen's ``TensorCoreFP8Layout``
  tensors through ``F.linear``, as ComfyUI runs fp8 files), shapes of the 4B / 9B block Linears.

Each variant is timed warm (median of ``--iters`` runs after ``--warmup``, CUDA events on a GPU)
and compared with the plain path (max abs diff; for fp8 also relative L2 vs the bf16 Linear).
Shapes: ``--tokens`` image tokens (4096 = 1024x1024) plus 512 text tokens, for 4B and 9B.

Usage (GPU)::

    python benchmarks/kernels.py --out kernels.json
    python benchmarks/kernels.py --tiny --device cpu --out /tmp/k.json   # CPU self-test of the script
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import call_times
from klein_core.accel.comfy_kitchen import KitchenOps, kitchen_available
from klein_core.accel.fast import FastOps, FastSettings
from klein_core.models.block_ops import PLAIN_OPS, BlockOps
from klein_core.models.transformer import DoubleStreamBlock, SingleStreamBlock, TransformerConfig
from klein_core.models.transformer_math import rope_tables
from klein_core.models.variants import KLEIN_4B, KLEIN_9B
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.quant.fp8 import FP8Linear, quantize_fp8
from klein_core.testing.fill import full_size_configs

MODELS = {"4b": KLEIN_4B, "9b": KLEIN_9B}
TEXT_TOKENS = 512


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` (warm)."""
    for _ in range(warmup):
        fn()
    return statistics.median(call_times(fn, device, iters))


def max_diff(a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        return max(max_diff(x, y) for x, y in zip(a, b, strict=True))
    return (a.float() - b.float()).abs().max().item()


def joint_rope(tokens: int, cfg: TransformerConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables ``[1, 1, 512 + tokens, D]`` for 512 text tokens and a square image grid."""
    side = math.isqrt(tokens)
    ids = torch.cat([text_position_ids(TEXT_TOKENS), position_ids(side, tokens // side)]).to(device)
    return rope_tables(ids, cfg.axes_dim, cfg.theta)


def op_variants() -> dict[str, Any]:
    """The BlockOps to compare: plain always; comfy-kitchen if installed."""
    out: dict[str, Any] = {"plain": PLAIN_OPS}
    if kitchen_available():
        out["kitchen"] = KitchenOps()
    else:
        print("  comfy-kitchen: skipped (not installed)")
    return out


def bench_block_ops(model: str, tokens: int, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                    ) -> list[dict[str, Any]]:
    cfg = full_size_configs(MODELS[model])[0]
    hidden, heads, head_dim = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    length = TEXT_TOKENS + tokens
    g = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    variants = op_variants()

    x = torch.randn(1, length, hidden, device=device, dtype=dtype, generator=g)
    shift = torch.randn(1, 1, hidden, device=device, dtype=dtype, generator=g) * 0.1
    scale = torch.randn(1, 1, hidden, device=device, dtype=dtype, generator=g) * 0.1
    qkv_t = torch.randn(1, TEXT_TOKENS, 3, heads, head_dim, device=device, dtype=dtype, generator=g)
    qkv_i = torch.randn(1, tokens, 3, heads, head_dim, device=device, dtype=dtype, generator=g)
    scales = [torch.rand(head_dim, device=device, dtype=dtype, generator=g) + 0.5 for _ in range(4)]
    parts = [(qkv_t[:, :, 0], qkv_t[:, :, 1], scales[0], scales[1]),  # views of the projection, as in a block
             (qkv_i[:, :, 0], qkv_i[:, :, 1], scales[2], scales[3])]
    cos, sin = joint_rope(tokens, cfg, device)

    cases = {
        "modulate": lambda ops: ops.modulate(x, shift, scale),
        "qk_norm_rope": lambda ops: ops.qk_norm_rope(parts, cos, sin),
    }
    for op, call in cases.items():
        with torch.no_grad():
            ref = call(PLAIN_OPS)
            for name, ops in variants.items():
                try:
                    got = call(ops)
                    ms = timed(lambda ops=ops, call=call: call(ops), device, args.warmup, args.iters)
                    row = {"op": op, "model": model, "tokens": length, "variant": name, "ms": ms,
                           "max_abs_diff_vs_plain": max_diff(got, ref)}
                except Exception as exc:  # noqa: BLE001 -- a variant that cannot run is reported, not fatal
                    row = {"op": op, "model": model, "tokens": length, "variant": name,
                           "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
                rows.append(row)
                print("  " + json.dumps(row))
    return rows


def block_op_variants(cfg: TransformerConfig) -> dict[str, BlockOps]:
    """Whole-block ops on the device: plain, then the fast path (``speed="fast"``) without the fused
    elementwise steps, with them but SwiGLU as silu then multiply, and complete."""
    def fast_ops(**settings: Any) -> BlockOps:
        return FastOps(FastSettings(**settings), cfg.head_dim, cfg.hidden_size)

    return {"plain": PLAIN_OPS, "fast, elementwise plain": fast_ops(fused_elementwise=False),
            "fast, swiglu plain": fast_ops(), "fast": fast_ops()}


def bench_blocks(model: str, tokens: int, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                 cfg: TransformerConfig | None = None) -> list[dict[str, Any]]:
    """One full-size double block and one single block (random weights), as the denoiser runs them,
    per variant of :func:`block_op_variants`; ``step_ms`` = double x depth + single x depth_single.
    ``cfg``: other sizes than ``model``'s (the CPU self-test)."""
    cfg = cfg or full_size_configs(MODELS[model])[0]
    hidden = cfg.hidden_size
    length = TEXT_TOKENS + tokens
    g = torch.Generator(device=device).manual_seed(2)
    torch.manual_seed(2)
    double = DoubleStreamBlock(cfg).to(device, dtype)
    single = SingleStreamBlock(cfg).to(device, dtype)
    img = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=g)
    txt = torch.randn(1, TEXT_TOKENS, hidden, device=device, dtype=dtype, generator=g)
    mod = [torch.randn(1, 1, hidden, device=device, dtype=dtype, generator=g) * 0.1 for _ in range(15)]
    cos, sin = joint_rope(tokens, cfg, device)
    rows: list[dict[str, Any]] = []
    ref = None
    for name, ops in block_op_variants(cfg).items():
        bound = ops.bind(device, dtype)
        if name == "fast, swiglu plain":
            bound = copy.copy(bound)
            bound._swiglu = None  # type: ignore[attr-defined]  # the same fast ops, SwiGLU as two PyTorch ops

        def run(bound: BlockOps = bound) -> tuple[torch.Tensor, ...]:
            i, t = double(img, txt, cos, sin, tuple(mod[:6]), tuple(mod[6:12]), bound)
            return i, t, single(torch.cat([txt, img], dim=1), cos, sin, tuple(mod[12:]), bound)

        try:
            with torch.no_grad():
                got = run()
                ref = got if ref is None else ref
                d_ms = timed(lambda: double(img, txt, cos, sin, tuple(mod[:6]), tuple(mod[6:12]), bound),
                             device, args.warmup, args.iters)
                joint = torch.cat([txt, img], dim=1)
                s_ms = timed(lambda: single(joint, cos, sin, tuple(mod[12:]), bound), device, args.warmup, args.iters)
            row = {"op": "blocks", "model": model, "tokens": length, "variant": name,
                   "double_ms": d_ms, "single_ms": s_ms, "step_ms": d_ms * cfg.depth + s_ms * cfg.depth_single,
                   "max_abs_diff_vs_plain": max_diff(got, ref),
                   "described": _described(ops, swiglu_plain=name == "fast, swiglu plain")}
        except Exception as exc:  # noqa: BLE001 -- reported in the row, not fatal
            row = {"op": "blocks", "model": model, "tokens": length, "variant": name,
                   "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        rows.append(row)
        print("  " + json.dumps(row))
    return rows


def _described(ops: Any, swiglu_plain: bool) -> dict[str, str]:
    """What the ops say ran; for the row whose SwiGLU was switched off after binding, with that
    said (the ops were resolved with the kernel, and would name it)."""
    described = getattr(ops, "resolved", dict)()
    if swiglu_plain:
        described = {k: v.replace("swiglu=triton", "swiglu=plain") for k, v in described.items()}
    return described


def bench_fp8_linear(model: str, tokens: int, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                     ) -> list[dict[str, Any]]:
    cfg = full_size_configs(MODELS[model])[0]
    hidden, mlp = cfg.hidden_size, cfg.mlp_hidden
    length = TEXT_TOKENS + tokens
    g = torch.Generator(device=device).manual_seed(1)
    rows: list[dict[str, Any]] = []
    # the block Linears' shapes: qkv, attention out, MLP in (gated: 2 x mlp), MLP out
    for in_f, out_f in [(hidden, 3 * hidden), (hidden, hidden), (hidden, 2 * mlp), (mlp, hidden)]:
        w = torch.randn(out_f, in_f, device=device, generator=g) * in_f**-0.5
        x = torch.randn(length, in_f, device=device, dtype=dtype, generator=g)
        q, s = quantize_fp8(w)
        ref = x.float() @ w.T
        variants: dict[str, Callable[[], torch.Tensor]] = {}
        bf16 = w.to(dtype)
        variants["plain bf16 Linear"] = lambda bf16=bf16, x=x: torch.nn.functional.linear(x, bf16)
        layer = FP8Linear(in_f, out_f, device=device)
        layer.weight.data.copy_(q)
        layer.weight_scale.copy_(s)
        layer.matmul = "scaled_mm"
        variants["klein FP8Linear (scaled_mm)"] = lambda layer=layer, x=x: layer(x)
        up = FP8Linear(in_f, out_f, device=device)
        up.weight.data.copy_(q)
        up.weight_scale.copy_(s)
        up.matmul = "upcast"
        variants["klein FP8Linear (upcast)"] = lambda up=up, x=x: up(x)
        if kitchen_available():
            from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout

            params = TensorCoreFP8Layout.Params(scale=s.float().reshape(()), orig_dtype=dtype, orig_shape=(out_f, in_f))
            wq = QuantizedTensor(q, "TensorCoreFP8Layout", params)

            def kitchen(x: torch.Tensor = x, wq: Any = wq) -> torch.Tensor:
                xq = QuantizedTensor.from_float(x, "TensorCoreFP8Layout")  # per-tensor amax scale, as ComfyUI
                return torch.nn.functional.linear(xq, wq)

            variants["kitchen TensorCoreFP8Layout"] = kitchen
        with torch.no_grad():
            for name, fn in variants.items():
                try:
                    got = fn()
                    ms = timed(fn, device, args.warmup, args.iters)
                    rel = ((got.float() - ref).norm() / ref.norm()).item()
                    row = {"op": "fp8_linear", "model": model, "shape": [length, in_f, out_f], "variant": name,
                           "ms": ms, "tflops": 2 * length * in_f * out_f / ms / 1e9, "rel_l2_vs_fp32_weights": rel}
                except Exception as exc:  # noqa: BLE001 -- reported in the row, not fatal
                    row = {"op": "fp8_linear", "model": model, "shape": [length, in_f, out_f], "variant": name,
                           "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
                rows.append(row)
                print("  " + json.dumps(row))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="4b,9b")
    ap.add_argument("--tokens", type=int, default=4096, help="image tokens, a square number (4096 = 1024x1024)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ops", default="modulate,qk_norm_rope,blocks,fp8_linear")
    ap.add_argument("--tiny", action="store_true", help="64 image tokens, 3 iterations (tests the script)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16
    if args.tiny:
        args.tokens, args.warmup, args.iters = 64, 1, 3
    ops = args.ops.split(",")
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    if kitchen_available():
        import comfy_kitchen

        env["comfy_kitchen"] = getattr(comfy_kitchen, "__version__", "installed")
    print(json.dumps(env))
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        print(f"{model}: {TEXT_TOKENS} + {args.tokens} tokens, {dtype}, {device}")
        if {"modulate", "qk_norm_rope"} & set(ops):
            rows += [r for r in bench_block_ops(model, args.tokens, device, dtype, args) if r["op"] in ops]
        if "blocks" in ops:
            rows += bench_blocks(model, args.tokens, device, dtype, args)
        if "fp8_linear" in ops:
            rows += bench_fp8_linear(model, args.tokens, device, dtype, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
